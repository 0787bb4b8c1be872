/* sum64 (megatron_pec/integrity/sum64.py) of whole 64-bit words in one pass, optionally copying them:
 * A = sum(x_k), B = sum((k + 1) * x_k), mod 2**64, k counted from the buffer's first word. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LANES 8 /* words per step: the lanes' sums are independent, so the compiler vectorises them */

static void sums(const unsigned char *src, unsigned char *dst, size_t n, uint64_t *out_a, uint64_t *out_b)
{
    /* Per lane l (words k = LANES * i + l): a[l] = sum_i x, c[l] += a[l] after each step, so after m steps
       c[l] = sum_i (m - i) x and sum_i i x = m a[l] - c[l]. */
    uint64_t a[LANES] = {0}, c[LANES] = {0};
    size_t m = n / LANES;
    if (dst) {
        for (size_t i = 0; i < m; i++) {
            uint64_t x[LANES];
            memcpy(x, src + 8 * LANES * i, 8 * LANES);
            memcpy(dst + 8 * LANES * i, x, 8 * LANES);
            for (int l = 0; l < LANES; l++) { a[l] += x[l]; c[l] += a[l]; }
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint64_t x[LANES];
            memcpy(x, src + 8 * LANES * i, 8 * LANES);
            for (int l = 0; l < LANES; l++) { a[l] += x[l]; c[l] += a[l]; }
        }
    }
    uint64_t A = 0, B = 0;
    for (int l = 0; l < LANES; l++) {
        A += a[l];
        B += (uint64_t)LANES * ((uint64_t)m * a[l] - c[l]) + (uint64_t)(l + 1) * a[l];
    }
    for (size_t k = LANES * m; k < n; k++) {
        uint64_t x;
        memcpy(&x, src + 8 * k, 8);
        if (dst) memcpy(dst + 8 * k, &x, 8);
        A += x;
        B += (uint64_t)(k + 1) * x;
    }
    *out_a = A;
    *out_b = B;
}

static PyObject *run(PyObject *args, int copying)
{
    Py_buffer dst = {0}, src = {0};
    if (copying ? !PyArg_ParseTuple(args, "w*y*", &dst, &src) : !PyArg_ParseTuple(args, "y*", &src))
        return NULL;
    PyObject *out = NULL;
    if (copying && dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes, source of %zd", dst.len, src.len);
    } else if (src.len % 8) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole 64-bit words", src.len);
    } else {
        uint64_t a, b;
        Py_BEGIN_ALLOW_THREADS
        sums(src.buf, copying ? dst.buf : NULL, (size_t)src.len / 8, &a, &b);
        Py_END_ALLOW_THREADS
        out = Py_BuildValue("KK", (unsigned long long)a, (unsigned long long)b);
    }
    if (copying) PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

static PyObject *copy_words(PyObject *self, PyObject *args) { return run(args, 1); }
static PyObject *sum_words(PyObject *self, PyObject *args) { return run(args, 0); }

static PyMethodDef methods[] = {
    {"copy_words", copy_words, METH_VARARGS,
     "copy_words(dst, src) -> (A, B): copy src into dst (same length, whole 64-bit words) and return their sums"},
    {"sum_words", sum_words, METH_VARARGS, "sum_words(src) -> (A, B): the sums of src's 64-bit words"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_sum64", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused_sum64(void) { return PyModule_Create(&module); }
