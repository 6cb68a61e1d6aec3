/*
 * fastdata.read._jpeg: a JPEG crop region decoded by libjpeg-turbo, and nothing else.
 *
 * `region(data, left, top, width, height, out)` decodes the box's pixels as interleaved RGB into
 * `out` (a writable buffer of width * height * 3 bytes): columns outside the box skip the IDCT
 * and colour conversion (jpeg_crop_scanline), rows above it skip the IDCT (jpeg_skip_scanlines)
 * and rows below it are never read at all: the decode stops at the box's last row, where
 * nvImageCodec's decoder entropy-decodes the rest of the image to finish cleanly. Chroma is
 * upsampled with libjpeg's default (fancy) filter and the IDCT is the default (islow), as Pillow
 * decodes: the box's pixels are those of a full Pillow decode (tests/read/test_decode.py). One
 * pixel beyond each side of the box is decoded as well, so that the fancy upsampling at the box's
 * edge sees the same neighbours as a full decode.
 *
 * Returns True, or False when libjpeg raised an error or a warning (a truncated or corrupt file):
 * the caller then decodes the image with Pillow, which says why it cannot. Damage below the box
 * (or in markers after the scan) is not seen: those bytes are not read. fastdata shard decodes
 * every image whole when it writes it; `fastdata verify` does so for indexed foreign shards. The GIL is released
 * while libjpeg works, so one thread per core decodes in parallel.
 *
 * `info(data)` returns (width, height, components) of an 8-bit JPEG this decoder takes (grey,
 * YCbCr or RGB), or None (not a JPEG, CMYK/YCCK, 12-bit, unreadable header).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

/* The narrowest crop asked of libjpeg: 8 chroma samples even at 4:1:1 subsampling. */
#define MIN_CROP 32

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int warned;
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt data that libjpeg would paper over */
        ((error_mgr *)cinfo->err)->warned = 1;
    }
}

static void no_output(j_common_ptr cinfo) { (void)cinfo; }

static void set_errors(struct jpeg_decompress_struct *cinfo, error_mgr *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->pub.output_message = no_output;
    err->warned = 0;
}

/* Whether the header describes an 8-bit JPEG this module decodes to RGB. */
static int takes(const struct jpeg_decompress_struct *cinfo) {
    if (cinfo->data_precision != 8) return 0;
    if (cinfo->num_components == 1) return cinfo->jpeg_color_space == JCS_GRAYSCALE;
    if (cinfo->num_components == 3)
        return cinfo->jpeg_color_space == JCS_YCbCr || cinfo->jpeg_color_space == JCS_RGB;
    return 0;
}

/* The decode itself, without the GIL. Returns 1 on success. */
static int decode_region(const unsigned char *data, unsigned long size, JDIMENSION left,
                         JDIMENSION top, JDIMENSION width, JDIMENSION height, unsigned char *out) {
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    unsigned char *volatile row = NULL;
    volatile int ok = 0;

    memset(&cinfo, 0, sizeof(cinfo)); /* jpeg_destroy_decompress is safe before create */
    set_errors(&cinfo, &err);
    if (setjmp(err.jump)) goto done;
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    if (jpeg_read_header(&cinfo, TRUE) != JPEG_HEADER_OK || !takes(&cinfo)) goto done;
    if (width == 0 || height == 0 || left + width > cinfo.image_width ||
        top + height > cinfo.image_height)
        goto done;
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3) goto done;

    /* One more column each side (when there is one), at least MIN_CROP wide (libjpeg upsamples a
     * component at most 2 samples wide with the box filter, not the fancy one), then widened to
     * iMCU boundaries by jpeg_crop_scanline. */
    JDIMENSION x0 = left > 0 ? left - 1 : 0;
    JDIMENSION x1 = left + width < cinfo.output_width ? left + width + 1 : cinfo.output_width;
    if (x1 - x0 < MIN_CROP) {
        x1 = x0 + MIN_CROP < cinfo.output_width ? x0 + MIN_CROP : cinfo.output_width;
        x0 = x1 > MIN_CROP ? x1 - MIN_CROP : 0;
    }
    JDIMENSION xoff = x0, cwidth = x1 - x0;
    /* Not for a progressive JPEG: libjpeg smooths the blocks of scans that leave coefficients
     * unrefined across block edges, and after a column crop (libjpeg-turbo 2.1.5) it does so
     * differently from a full decode (found with DC-only scans: up to 49 levels). Its
     * coefficients are all entropy-decoded at jpeg_start_decompress anyway. */
    if (cinfo.progressive_mode) {
        xoff = 0;
        cwidth = cinfo.output_width;
    }
    if (xoff > 0 || cwidth < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cwidth);
    if (xoff > left || left + width > xoff + cinfo.output_width) goto done;
    if (top > 0 && jpeg_skip_scanlines(&cinfo, top) != top) goto done;

    size_t shift = (size_t)(left - xoff) * 3, row_bytes = (size_t)width * 3;
    row = malloc((size_t)cinfo.output_width * 3);
    if (row == NULL) goto done;
    JSAMPROW rows[1] = {row};
    for (JDIMENSION y = 0; y < height; y++) {
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) goto done;
        memcpy(out + (size_t)y * row_bytes, row + shift, row_bytes);
    }
    ok = !err.warned;
done:
    /* Stops here, below the box: no entropy decoding of the rows that are not needed. */
    jpeg_destroy_decompress(&cinfo);
    free(row);
    return ok;
}

static PyObject *py_region(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    Py_ssize_t left, top, width, height; /* "n": an int past Py_ssize_t raises, never wraps */
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnnw*", &data, &left, &top, &width, &height, &out))
        return NULL;
    PyObject *result = NULL;
    if (left < 0 || top < 0 || width < 0 || height < 0 || width > 65535 || height > 65535 ||
        left > 65535 || top > 65535) {
        PyErr_Format(PyExc_ValueError, "box out of JPEG range: %zd,%zd %zdx%zd", left, top,
                     width, height);
    } else if ((size_t)out.len < (size_t)width * height * 3) { /* w*: contiguous, writable */
        PyErr_Format(PyExc_ValueError, "out must be a buffer of >= %zd bytes",
                     width * height * 3);
    } else {
        int ok;
        Py_BEGIN_ALLOW_THREADS
        ok = decode_region((const unsigned char *)data.buf, (unsigned long)data.len,
                           (JDIMENSION)left, (JDIMENSION)top, (JDIMENSION)width,
                           (JDIMENSION)height, (unsigned char *)out.buf);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(ok);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_info(PyObject *self, PyObject *args) {
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    volatile int ok = 0;
    long width = 0, height = 0, components = 0;
    memset(&cinfo, 0, sizeof(cinfo));
    set_errors(&cinfo, &err);
    if (setjmp(err.jump) == 0) {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        if (jpeg_read_header(&cinfo, TRUE) == JPEG_HEADER_OK && takes(&cinfo)) {
            width = cinfo.image_width;
            height = cinfo.image_height;
            components = cinfo.num_components;
            ok = 1;
        }
    }
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(lll)", width, height, components);
}

static PyMethodDef methods[] = {
    {"region", py_region, METH_VARARGS,
     "region(data, left, top, width, height, out) -> bool: the box's RGB pixels into out."},
    {"info", py_info, METH_VARARGS,
     "info(data) -> (width, height, components) of a JPEG this module decodes, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg",
    "JPEG crop-region decoding with libjpeg-turbo (see fastdata/read/jpeg_region.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION",
#ifdef LIBJPEG_TURBO_VERSION
#define FASTDATA_STR2(x) #x
#define FASTDATA_STR(x) FASTDATA_STR2(x)
                                   FASTDATA_STR(LIBJPEG_TURBO_VERSION)
#else
                                   "unknown"
#endif
                                   ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
