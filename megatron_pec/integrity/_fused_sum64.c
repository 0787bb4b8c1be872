/* sum64 (megatron_pec/integrity/sum64.py) of whole 64-bit words in one pass, optionally copying them:
 * A = sum(x_k), B = sum((k + 1) * x_k), mod 2**64, k counted from the buffer's first word. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LANES 8 /* words per step: the lanes' sums are independent, so the compiler vectorises them */

/* A and B of m steps from the lanes' sums (per lane l, words k = LANES * i + l: a[l] = sum_i x, c[l] the sum of
   a[l] after each step, so c[l] = sum_i (m - i) x and sum_i i x = m a[l] - c[l]). */
static void lanes_into(const uint64_t *a, const uint64_t *c, size_t m, uint64_t *out_a, uint64_t *out_b)
{
    uint64_t A = 0, B = 0;
    for (int l = 0; l < LANES; l++) {
        A += a[l];
        B += (uint64_t)LANES * ((uint64_t)m * a[l] - c[l]) + (uint64_t)(l + 1) * a[l];
    }
    *out_a = A;
    *out_b = B;
}
#if defined(__SSE2__)
#include <emmintrin.h>
/* A copy this large streams past the caches (as glibc's memcpy does): stores that allocate cache lines read
   each destination line first, a third more memory traffic, which is what ranks copying at once share. */
#define STREAM_BYTES (1 << 20)

static void sums(const unsigned char *src, unsigned char *dst, size_t n, uint64_t *out_a, uint64_t *out_b);

/* sums() copying with streaming stores: the words before the destination is 16-byte aligned and those after
   the last whole step by sums(), the steps in between in vector registers (lane l: words LANES * i + l of
   the steps); each part's B counted from its own first word, moved to the buffer's (B + first * A). */
static void streamed_sums(const unsigned char *src, unsigned char *dst, size_t n, uint64_t *out_a,
                          uint64_t *out_b)
{
    size_t head = ((uintptr_t)dst % 16) ? 1 : 0;
    size_t m = (n - head) / LANES, tail = head + LANES * m;
    uint64_t A, B, part_a, part_b;
    sums(src, dst, head, &A, &B);
    const unsigned char *s = src + 8 * head;
    unsigned char *d = dst + 8 * head;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (size_t i = 0; i < m; i++) {
        const __m128i *from = (const __m128i *)(s + 8 * LANES * i);
        __m128i *to = (__m128i *)(d + 8 * LANES * i);
        __m128i x0 = _mm_loadu_si128(from), x1 = _mm_loadu_si128(from + 1);
        __m128i x2 = _mm_loadu_si128(from + 2), x3 = _mm_loadu_si128(from + 3);
        _mm_stream_si128(to, x0);
        _mm_stream_si128(to + 1, x1);
        _mm_stream_si128(to + 2, x2);
        _mm_stream_si128(to + 3, x3);
        a0 = _mm_add_epi64(a0, x0); c0 = _mm_add_epi64(c0, a0);
        a1 = _mm_add_epi64(a1, x1); c1 = _mm_add_epi64(c1, a1);
        a2 = _mm_add_epi64(a2, x2); c2 = _mm_add_epi64(c2, a2);
        a3 = _mm_add_epi64(a3, x3); c3 = _mm_add_epi64(c3, a3);
    }
    _mm_sfence(); /* (the streamed stores are seen before anything this thread writes next) */
    uint64_t a[LANES], c[LANES];
    _mm_storeu_si128((__m128i *)a, a0); _mm_storeu_si128((__m128i *)(a + 2), a1);
    _mm_storeu_si128((__m128i *)(a + 4), a2); _mm_storeu_si128((__m128i *)(a + 6), a3);
    _mm_storeu_si128((__m128i *)c, c0); _mm_storeu_si128((__m128i *)(c + 2), c1);
    _mm_storeu_si128((__m128i *)(c + 4), c2); _mm_storeu_si128((__m128i *)(c + 6), c3);
    lanes_into(a, c, m, &part_a, &part_b);
    A += part_a;
    B += part_b + (uint64_t)head * part_a;
    sums(src + 8 * tail, dst + 8 * tail, n - tail, &part_a, &part_b);
    *out_a = A + part_a;
    *out_b = B + part_b + (uint64_t)tail * part_a;
}
#endif

static void sums(const unsigned char *src, unsigned char *dst, size_t n, uint64_t *out_a, uint64_t *out_b)
{
    /* (per lane l, words k = LANES * i + l: a[l] += x, then c[l] += a[l], each step; ``lanes_into``) */
#if defined(__SSE2__)
    if (dst && n * 8 >= STREAM_BYTES && (uintptr_t)dst % 8 == 0) {
        streamed_sums(src, dst, n, out_a, out_b);
        return;
    }
#endif
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
    uint64_t A, B;
    lanes_into(a, c, m, &A, &B);
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
