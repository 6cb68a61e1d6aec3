/*
 * fastdata._pixels: the CPU's per-pixel loops over uint8 images that torch does slowly.
 *
 * `to_planes(src, dst, height, width, flip)`: interleaved RGB (H x W x 3) to planes (3 x H x W),
 * mirrored left-right when `flip`: the batch's layout, written in one pass (SSSE3 shuffles where
 * the CPU has them, 16 pixels at a time; torch's copy of a channels-last image to planes, and its
 * flip, take 2-3x as long).
 *
 * `normalize_planes(x, out, table, channels, plane)`: x holds uint8 planes (N x C x H x W, C-contiguous), out the
 * float32 planes of the same shape, table C x 256 float32 values; out[n, c, i] = table[c, x[n, c,
 * i]]. `normalize_pixels(x, out, table, channels)`: the same for interleaved pixels (N x H x W x C, i.e.
 * a channels-last batch). With table[c][v] = (v - mean[c]) / std[c] computed in float32, the
 * result is bit for bit that of the subtraction and division (fastdata.augment.kernels.normalize)
 * in one pass: one byte read, one float written, no arithmetic. The GIL is released.
 *
 * `planes_to_pixels(src, ids, dst, plane, moments)`: the shard writer's gather of CIFAR samples
 * (channel-first rows) into the channel-last pixels it stores, with the per-channel moments of
 * the dataset's statistics counted in the same pass (numpy took a gather, three strided copies
 * and two float passes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <tmmintrin.h>
#define HAVE_X86 1
#endif

/* a * b * c into *product; 0 when it overflows (sizes from Python are checked before use). */
static int mul3(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c, Py_ssize_t *product) {
    Py_ssize_t ab;
    return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, product);
}

static int check(Py_buffer *x, Py_buffer *out, Py_buffer *table, Py_ssize_t channels) {
    Py_ssize_t table_len, out_len;
    if (channels < 1 || !mul3(channels, 256, (Py_ssize_t)sizeof(float), &table_len) ||
        table->len != table_len) {
        PyErr_SetString(PyExc_ValueError, "table must hold channels x 256 float32 values");
        return 0;
    }
    if (!mul3(x->len, (Py_ssize_t)sizeof(float), 1, &out_len) || out->len != out_len ||
        x->len % channels != 0) {
        PyErr_SetString(PyExc_ValueError, "out must hold one float32 per byte of x");
        return 0;
    }
    return 1;
}

static PyObject *run(PyObject *args, int interleaved) {
    Py_buffer x, out, table;
    Py_ssize_t channels, plane = 0;
    if (!PyArg_ParseTuple(args, "y*w*y*n|n", &x, &out, &table, &channels, &plane)) return NULL;
    PyObject *result = NULL;
    if (check(&x, &out, &table, channels)) {
        Py_ssize_t whole;
        if (!interleaved && (plane < 1 || !mul3(plane, channels, 1, &whole) || x.len % whole != 0)) {
            PyErr_SetString(PyExc_ValueError, "normalize_planes: x must hold whole N x C planes of `plane`");
        } else {
            const uint8_t *src = (const uint8_t *)x.buf;
            float *dst = (float *)out.buf;
            const float *lut = (const float *)table.buf;
            Py_ssize_t len = x.len;
            Py_BEGIN_ALLOW_THREADS
            if (interleaved) {
                for (Py_ssize_t i = 0; i < len; i += channels)
                    for (Py_ssize_t c = 0; c < channels; c++)
                        dst[i + c] = lut[c * 256 + src[i + c]];
            } else {
                for (Py_ssize_t start = 0, k = 0; start < len; start += plane, k++) {
                    const float *t = lut + (k % channels) * 256;
                    for (Py_ssize_t i = start; i < start + plane; i++) dst[i] = t[src[i]];
                }
            }
            Py_END_ALLOW_THREADS
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    PyBuffer_Release(&table);
    return result;
}


/* Scalar: pixels [x0, x1) of one row. */
static void row_scalar(const uint8_t *row, uint8_t *r, uint8_t *g, uint8_t *b, Py_ssize_t w,
                       Py_ssize_t x0, int flip) {
    for (Py_ssize_t x = x0; x < w; x++) {
        Py_ssize_t k = flip ? w - 1 - x : x;
        r[x] = row[3 * k];
        g[x] = row[3 * k + 1];
        b[x] = row[3 * k + 2];
    }
}

#ifdef HAVE_X86
/* 16 pixels at a time: three 16-byte loads, each plane gathered by three byte shuffles. */
__attribute__((target("ssse3"))) static void rows_ssse3(const uint8_t *src, uint8_t *dst,
                                                       Py_ssize_t h, Py_ssize_t w, int flip) {
    const __m128i ra = _mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i rb = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14, -1, -1, -1, -1, -1);
    const __m128i rc = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1, 4, 7, 10, 13);
    const __m128i ga = _mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i gb = _mm_setr_epi8(-1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1);
    const __m128i gc = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14);
    const __m128i ba = _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i bb = _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1);
    const __m128i bc = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15);
    const __m128i rev = _mm_setr_epi8(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint8_t *r = dst, *g = dst + h * w, *b = dst + 2 * h * w;
    for (Py_ssize_t y = 0; y < h; y++, r += w, g += w, b += w) {
        const uint8_t *row = src + y * w * 3;
        Py_ssize_t x = 0;
        for (; x + 16 <= w; x += 16) {
            const uint8_t *p = row + 3 * (flip ? w - 16 - x : x);
            __m128i a = _mm_loadu_si128((const __m128i *)p);
            __m128i bv = _mm_loadu_si128((const __m128i *)(p + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(p + 32));
            __m128i vr = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(a, ra), _mm_shuffle_epi8(bv, rb)),
                                      _mm_shuffle_epi8(c, rc));
            __m128i vg = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(a, ga), _mm_shuffle_epi8(bv, gb)),
                                      _mm_shuffle_epi8(c, gc));
            __m128i vb = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(a, ba), _mm_shuffle_epi8(bv, bb)),
                                      _mm_shuffle_epi8(c, bc));
            if (flip) {
                vr = _mm_shuffle_epi8(vr, rev);
                vg = _mm_shuffle_epi8(vg, rev);
                vb = _mm_shuffle_epi8(vb, rev);
            }
            _mm_storeu_si128((__m128i *)(r + x), vr);
            _mm_storeu_si128((__m128i *)(g + x), vg);
            _mm_storeu_si128((__m128i *)(b + x), vb);
        }
        row_scalar(row, r, g, b, w, x, flip);
    }
}
#endif

static PyObject *py_to_planes(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t h, w;
    int flip;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*nnp", &src, &dst, &h, &w, &flip)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t size = -1;
    if (h < 0 || w < 0 || !mul3(h, w, 3, &size) || src.len != size || dst.len != size) {
        PyErr_SetString(PyExc_ValueError, "to_planes: src and dst must hold height x width x 3 bytes");
    } else {
        const uint8_t *s = (const uint8_t *)src.buf;
        uint8_t *d = (uint8_t *)dst.buf;
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_X86
        if (__builtin_cpu_supports("ssse3")) {
            rows_ssse3(s, d, h, w, flip);
        } else
#endif
        {
            for (Py_ssize_t y = 0; y < h; y++)
                row_scalar(s + y * w * 3, d + y * w, d + h * w + y * w, d + 2 * h * w + y * w, w, 0, flip);
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* planes_to_pixels(src, ids, dst, plane, moments): dst[i, p, c] = src[ids[i], c, p] for 3 channels,
 * i.e. a gather of whole samples from a channel-first array (CIFAR's rows) into channel-last
 * pixels, one pass, adding each channel's sum and sum of squares to moments[0:3] and [3:6]
 * (uint64: exact for any shard a tar holds). */
static PyObject *py_planes_to_pixels(PyObject *self, PyObject *args) {
    Py_buffer src, ids, dst, moments;
    Py_ssize_t plane;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*nw*", &src, &ids, &dst, &plane, &moments)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ids.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t sample = 0, total = 0;
    if (plane < 1 || !mul3(plane, 3, 1, &sample) || !mul3(n, sample, 1, &total) ||
        src.len % sample != 0 || ids.len % (Py_ssize_t)sizeof(int64_t) != 0 || dst.len != total ||
        moments.len != 6 * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError,
                        "planes_to_pixels: src must hold whole 3 x plane samples, dst one per id, "
                        "moments 6 uint64");
    } else {
        Py_ssize_t count = src.len / sample;
        const int64_t *index = (const int64_t *)ids.buf;
        Py_ssize_t bad = -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (index[i] < 0 || index[i] >= count) { bad = i; break; }
        if (bad >= 0) {
            PyErr_Format(PyExc_IndexError, "planes_to_pixels: id %lld is out of range (%zd samples)",
                         (long long)index[bad], count);
        } else {
            const uint8_t *s = (const uint8_t *)src.buf;
            uint8_t *d = (uint8_t *)dst.buf;
            uint64_t *m = (uint64_t *)moments.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                const uint8_t *r = s + index[i] * sample, *g = r + plane, *b = g + plane;
                uint8_t *out = d + i * sample;
                uint64_t sr = 0, sg = 0, sb = 0;
                uint64_t qr = 0, qg = 0, qb = 0;
                for (Py_ssize_t p = 0; p < plane; p++) {
                    uint32_t vr = r[p], vg = g[p], vb = b[p];
                    out[3 * p] = (uint8_t)vr;
                    out[3 * p + 1] = (uint8_t)vg;
                    out[3 * p + 2] = (uint8_t)vb;
                    sr += vr; sg += vg; sb += vb;
                    qr += vr * vr; qg += vg * vg; qb += vb * vb;
                }
                m[0] += sr; m[1] += sg; m[2] += sb;
                m[3] += qr; m[4] += qg; m[5] += qb;
            }
            Py_END_ALLOW_THREADS
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&moments);
    return result;
}

static PyObject *py_planes(PyObject *self, PyObject *args) {
    (void)self;
    return run(args, 0);
}

static PyObject *py_pixels(PyObject *self, PyObject *args) {
    (void)self;
    return run(args, 1);
}

static PyMethodDef methods[] = {
    {"to_planes", py_to_planes, METH_VARARGS,
     "to_planes(src, dst, height, width, flip): H x W x 3 RGB to 3 x H x W planes."},
    {"normalize_planes", py_planes, METH_VARARGS,
     "normalize_planes(x, out, table, channels, plane): out[n, c, i] = table[c, x[n, c, i]]."},
    {"normalize_pixels", py_pixels, METH_VARARGS,
     "normalize_pixels(x, out, table, channels): out[p, c] = table[c, x[p, c]] (interleaved)."},
    {"planes_to_pixels", py_planes_to_pixels, METH_VARARGS,
     "planes_to_pixels(src, ids, dst, plane, moments): gather channel-first samples into "
     "channel-last pixels, adding per-channel sums and sums of squares to moments."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pixels", "Per-pixel loops over uint8 images (see the C file's header).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pixels(void) { return PyModule_Create(&module); }
