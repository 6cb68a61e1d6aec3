/*
 * fastdata._shuffle: numpy's Fisher-Yates shuffle, run on a file instead of an array in RAM.
 *
 * `permute_file(fd, n, state_address, next32_address, next64_address[, window])`: the file
 * behind `fd` holds n native-endian int64 values (0..n-1 for a permutation); they are shuffled
 * in place exactly as numpy's `Generator.shuffle` shuffles a 1-D array, so that the file ends up
 * holding `Generator.permutation(n)` byte for byte (fastdata/write/permfile.py).
 *
 * Why: `fastdata shard` permutes each split with a seeded Generator, and for 100 million rows the
 * int64 array alone is 800 MB of process memory. Here the array is the file: the page cache
 * holds it (the kernel drops clean and written-back pages as it needs), and the process holds
 * one window of at most `window` values (default 512 Ki values, 4 MB). No mmap: mapped file
 * pages count in the process's RSS.
 *
 * The algorithm is numpy's (numpy/random/_generator.pyx `_shuffle_raw`, distributions.c
 * `random_interval`): for i = n-1 down to 1, j = random_interval(i), swap(a[i], a[j]), where
 * random_interval(max) takes the smallest all-ones mask >= max and draws `next_uint32() & mask`
 * (max <= 0xffffffff) or `next_uint64() & mask` until the value is <= max. The draws go through
 * the bit generator's own function pointers (`bit_generator.ctypes`: state_address, next_uint32,
 * next_uint64), so they are numpy's, 32-bit buffering (PCG64's has_uint32) included, and the
 * Generator's state afterwards is the one `permutation` leaves.
 *
 * Position i is final once step i is done (later steps touch only positions < i), so the file is
 * walked from the top in windows [lo, hi): the window is read with one pread, steps hi-1..lo swap
 * inside it in RAM, or with one 8-byte pread and pwrite at j when j < lo, and the window is
 * written back with one pwrite. The last window (lo == 0) is all in RAM. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef uint32_t (*next32_fn)(void *state);
typedef uint64_t (*next64_fn)(void *state);

typedef struct {
    void *state;
    next32_fn next32;
    next64_fn next64;
} draws_t;

#define DEFAULT_WINDOW ((Py_ssize_t)1 << 19) /* values held in RAM: 4 MB */

/* numpy's random_interval (numpy/random/src/distributions/distributions.c): a value in [0, max]. */
static uint64_t random_interval(const draws_t *d, uint64_t max) {
    uint64_t mask = max, value;
    if (max == 0) return 0;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    if (max <= 0xffffffffUL) {
        while ((value = (d->next32(d->state) & mask)) > max)
            ;
    } else {
        while ((value = (d->next64(d->state) & mask)) > max)
            ;
    }
    return value;
}

/* All of `len` bytes at `offset`, or 0 with errno set (EIO: the file ended first). */
static int read_all(int fd, void *buf, size_t len, off_t offset) {
    char *p = (char *)buf;
    while (len > 0) {
        ssize_t got = pread(fd, p, len, offset);
        if (got < 0) {
            if (errno == EINTR) continue;
            return 0;
        }
        if (got == 0) {
            errno = EIO;
            return 0;
        }
        p += got;
        len -= (size_t)got;
        offset += got;
    }
    return 1;
}

static int write_all(int fd, const void *buf, size_t len, off_t offset) {
    const char *p = (const char *)buf;
    while (len > 0) {
        ssize_t put = pwrite(fd, p, len, offset);
        if (put < 0) {
            if (errno == EINTR) continue;
            return 0;
        }
        if (put == 0) {
            errno = EIO;
            return 0;
        }
        p += put;
        len -= (size_t)put;
        offset += put;
    }
    return 1;
}

/* The shuffle (no GIL held): 0 on success, else the errno of the failed read or write. */
static int shuffle_file(int fd, int64_t n, const draws_t *d, int64_t *buf, int64_t window) {
    int64_t hi = n;
    while (hi > 1) {
        int64_t lo = hi > window ? hi - window : 0;
        size_t bytes = (size_t)(hi - lo) * sizeof(int64_t);
        if (!read_all(fd, buf, bytes, (off_t)lo * 8)) return errno;
        for (int64_t i = hi - 1; i >= (lo > 1 ? lo : 1); i--) {
            int64_t j = (int64_t)random_interval(d, (uint64_t)i);
            if (j >= lo) {
                int64_t t = buf[j - lo];
                buf[j - lo] = buf[i - lo];
                buf[i - lo] = t;
            } else {
                int64_t t;
                if (!read_all(fd, &t, sizeof t, (off_t)j * 8)) return errno;
                if (!write_all(fd, &buf[i - lo], sizeof t, (off_t)j * 8)) return errno;
                buf[i - lo] = t;
            }
        }
        if (!write_all(fd, buf, bytes, (off_t)lo * 8)) return errno;
        hi = lo;
    }
    return 0;
}

/* "O&" converter: a Python int holding a non-NULL address. */
static int to_pointer(PyObject *obj, void **out) {
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "address must not be 0");
        return 0;
    }
    *out = p;
    return 1;
}

static PyObject *py_permute_file(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    long long n;
    void *state, *next32, *next64;
    Py_ssize_t window = DEFAULT_WINDOW;
    if (!PyArg_ParseTuple(args, "iLO&O&O&|n", &fd, &n, to_pointer, &state, to_pointer, &next32,
                          to_pointer, &next64, &window))
        return NULL;
    if (n < 0 || n > INT64_MAX / 8) {
        PyErr_Format(PyExc_ValueError, "n must be in [0, 2**60), got %lld", n);
        return NULL;
    }
    if (window < 1 || window > ((Py_ssize_t)1 << 28)) {
        PyErr_Format(PyExc_ValueError, "window must be in [1, 2**28], got %zd", window);
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    if ((long long)st.st_size < n * 8) {
        PyErr_Format(PyExc_ValueError, "the file holds %lld bytes, fewer than n * 8 = %lld",
                     (long long)st.st_size, n * 8);
        return NULL;
    }
    if (n < 2) Py_RETURN_NONE;
    if ((long long)window > n) window = (Py_ssize_t)n;
    int64_t *buf = (int64_t *)PyMem_RawMalloc((size_t)window * sizeof(int64_t));
    if (buf == NULL) return PyErr_NoMemory();
    draws_t d = {state, (next32_fn)next32, (next64_fn)next64};
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = shuffle_file(fd, (int64_t)n, &d, buf, (int64_t)window);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(buf);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"permute_file", py_permute_file, METH_VARARGS,
     "permute_file(fd, n, state_address, next32_address, next64_address, window=524288): "
     "numpy's Fisher-Yates shuffle of the n int64 values in the file, in place, drawing through "
     "the bit generator's ctypes function pointers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shuffle",
    "numpy's Fisher-Yates shuffle on a file of int64 values (see the C file's header).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shuffle(void) { return PyModule_Create(&module); }
