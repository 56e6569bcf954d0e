/*
 * ps._rows -- row gathers, scatters and adds over a sparse table's [capacity, dim] storage,
 * Adagrad's row update and Adam's dense one, and the NaN/Inf scan of pushed gradients.
 *
 * A push or pull touches tens of thousands of rows scattered over a table far larger than the
 * CPU caches, so every row is a cache miss. torch's CPU index_select / index_copy_ /
 * index_add_ spend most of their time elsewhere (index_add_ sorts its index; index_copy_ goes
 * through a generic TensorIterator loop per row): measured on 64k random rows of 64 floats in
 * a 10M-row table, about 5, 25 and 9 ms. These loops copy or add whole rows, prefetching the
 * row PREFETCH_DISTANCE positions ahead so that many misses are in flight at once.
 *
 * Every call checks all row ids against the table before it writes anything (a bad id is a
 * ValueError and nothing changed), then releases the GIL for the loop. Buffers come through
 * the buffer protocol, C-contiguous. Rows must not repeat in add() and scatter() (the table's
 * index guarantees it); a repeated row would be written twice, not accumulated.
 *
 * first_nonfinite() is the scan every gradient passes before it may apply: one pass over the
 * raw bits, without the tensor ops (and GIL hand-offs) of a torch check.
 *
 * add() computes table[r] = table[r] + (alpha * src[i]) one rounding at a time, as torch's
 * "scale, then index_add_" does; the build turns off floating-point contraction so the
 * compiler may not fuse the two into an FMA (bit-for-bit agreement with torch.optim matters).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_DISTANCE 16

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_LINE(addr, rw) __builtin_prefetch((addr), (rw), 3)
#else
#define PREFETCH_LINE(addr, rw) ((void)0)
#endif
#define CACHE_LINE 64

/* The loops below that stream through memory (the optimizer updates, the NaN scans) run about
 * twice as fast with AVX2 as with the SSE2 that x86-64 builds assume, and the optimizer
 * updates need FMA instructions to round as torch does at that speed; where the toolchain
 * can, each is built for x86-64-v3 (AVX2, FMA) and for the baseline, and the loader picks. */
#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__GNUC__) || defined(__clang__))
#define SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SIMD_CLONES
#endif

/* Every cache line of one row: a prefetch fetches one line, and rows are often 4 or more. */
static inline void prefetch_row(const char *row, Py_ssize_t row_bytes, int rw) {
    for (Py_ssize_t b = 0; b < row_bytes; b += CACHE_LINE) {
        if (rw)
            PREFETCH_LINE(row + b, 1);
        else
            PREFETCH_LINE(row + b, 0);
    }
}

typedef struct {
    Py_buffer table, rows, other;
    Py_ssize_t row_bytes, table_rows, n;
    int have_table, have_rows, have_other;
} Call;

static void release(Call *c) {
    if (c->have_table) PyBuffer_Release(&c->table);
    if (c->have_rows) PyBuffer_Release(&c->rows);
    if (c->have_other) PyBuffer_Release(&c->other);
}

/* Takes the three buffers and checks their sizes and every row id. 0 on success; -1 with an
 * exception set (and the buffers released) otherwise. */
static int prepare(Call *c, PyObject *table, int table_writable, Py_ssize_t row_bytes,
                   PyObject *rows, PyObject *other, int other_writable, const char *other_name) {
    memset(c, 0, sizeof(*c));
    if (row_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "row_bytes must be positive, got %zd", row_bytes);
        return -1;
    }
    const int base = PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(table, &c->table, base | (table_writable ? PyBUF_WRITABLE : 0)) < 0)
        goto fail;
    c->have_table = 1;
    if (PyObject_GetBuffer(rows, &c->rows, base) < 0) goto fail;
    c->have_rows = 1;
    if (PyObject_GetBuffer(other, &c->other, base | (other_writable ? PyBUF_WRITABLE : 0)) < 0)
        goto fail;
    c->have_other = 1;
    if (c->table.len % row_bytes) {
        PyErr_Format(PyExc_ValueError, "table of %zd bytes is not a whole number of %zd-byte rows",
                     c->table.len, row_bytes);
        goto fail;
    }
    if (c->rows.len % 8) {
        PyErr_Format(PyExc_ValueError, "rows buffer of %zd bytes is not int64 row ids",
                     c->rows.len);
        goto fail;
    }
    c->row_bytes = row_bytes;
    c->table_rows = c->table.len / row_bytes;
    c->n = c->rows.len / 8;
    if (c->other.len != c->n * row_bytes) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes; %zd rows of %zd bytes need %zd",
                     other_name, c->other.len, c->n, row_bytes, c->n * row_bytes);
        goto fail;
    }
    const int64_t *r = c->rows.buf;
    for (Py_ssize_t i = 0; i < c->n; i++) {
        if (r[i] < 0 || r[i] >= c->table_rows) {
            PyErr_Format(PyExc_ValueError, "row %lld at position %zd is outside the table's %zd rows",
                         (long long)r[i], i, c->table_rows);
            goto fail;
        }
    }
    return 0;
fail:
    release(c);
    return -1;
}

/* gather() and scatter(): whole rows copied out of the table (into `other`) or into it (from
 * `other`), prefetching the table's rows ahead. */
static PyObject *copy_rows(PyObject *args, const char *format, int into_table) {
    PyObject *table, *rows, *other;
    Py_ssize_t row_bytes;
    if (!PyArg_ParseTuple(args, format, &table, &row_bytes, &rows, &other)) return NULL;
    Call c;
    if (prepare(&c, table, into_table, row_bytes, rows, other, !into_table,
                into_table ? "src" : "out") < 0)
        return NULL;
    const int64_t *r = c.rows.buf;
    char *t = c.table.buf, *o = c.other.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n; i++) {
        if (i + PREFETCH_DISTANCE < c.n)
            prefetch_row(t + r[i + PREFETCH_DISTANCE] * row_bytes, row_bytes, into_table);
        char *table_row = t + r[i] * row_bytes, *other_row = o + i * row_bytes;
        if (into_table)
            memcpy(table_row, other_row, (size_t)row_bytes);
        else
            memcpy(other_row, table_row, (size_t)row_bytes);
    }
    Py_END_ALLOW_THREADS
    release(&c);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gather_doc,
"gather(table, row_bytes, rows, out)\n\n"
"out[i] = table[rows[i]] for each int64 row id, rows of row_bytes bytes. Releases the GIL.");

static PyObject *gather(PyObject *Py_UNUSED(module), PyObject *args) {
    return copy_rows(args, "OnOO:gather", 0);
}

PyDoc_STRVAR(scatter_doc,
"scatter(table, row_bytes, rows, src)\n\n"
"table[rows[i]] = src[i] for each int64 row id (distinct), rows of row_bytes bytes. Releases\n"
"the GIL.");

static PyObject *scatter(PyObject *Py_UNUSED(module), PyObject *args) {
    return copy_rows(args, "OnOO:scatter", 1);
}

#define ADD_LOOP(T)                                                                            \
    do {                                                                                       \
        const Py_ssize_t dim = row_bytes / (Py_ssize_t)sizeof(T);                              \
        const T a = (T)alpha;                                                                  \
        T *t = c.table.buf;                                                                    \
        const T *s = c.other.buf;                                                              \
        for (Py_ssize_t i = 0; i < c.n; i++) {                                                 \
            if (i + PREFETCH_DISTANCE < c.n)                                                   \
                prefetch_row((const char *)(t + r[i + PREFETCH_DISTANCE] * dim), row_bytes, 1);  \
            T *restrict dst = t + r[i] * dim;                                                  \
            const T *restrict row = s + i * dim;                                               \
            if (unit)                                                                          \
                for (Py_ssize_t j = 0; j < dim; j++) dst[j] = dst[j] + row[j];                 \
            else                                                                               \
                for (Py_ssize_t j = 0; j < dim; j++) dst[j] = dst[j] + a * row[j];             \
        }                                                                                      \
    } while (0)

PyDoc_STRVAR(add_doc,
"add(table, dim, rows, src, alpha, double)\n\n"
"table[rows[i]] += alpha * src[i] for each int64 row id (distinct), over float32 rows of `dim`\n"
"elements (float64 when `double` is true). alpha * src is rounded before the add; alpha 1\n"
"adds src as it is. Releases the GIL.");

static PyObject *add(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *table, *rows, *src;
    Py_ssize_t dim;
    double alpha;
    int is_double;
    if (!PyArg_ParseTuple(args, "OnOOdp:add", &table, &dim, &rows, &src, &alpha, &is_double))
        return NULL;
    const Py_ssize_t itemsize = is_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    if (dim <= 0) {
        PyErr_Format(PyExc_ValueError, "dim must be positive, got %zd", dim);
        return NULL;
    }
    const Py_ssize_t row_bytes = dim * itemsize;
    Call c;
    if (prepare(&c, table, 1, row_bytes, rows, src, 0, "src") < 0) return NULL;
    const int64_t *r = c.rows.buf;
    const int unit = alpha == 1.0;
    Py_BEGIN_ALLOW_THREADS
    if (is_double)
        ADD_LOOP(double);
    else
        ADD_LOOP(float);
    Py_END_ALLOW_THREADS
    release(&c);
    Py_RETURN_NONE;
}

/* Adagrad on distinct rows, one pass over each row (torch.optim's way is ten tensor ops, each a
 * pass with its own temporary), in torch.optim.Adagrad's order of ops:
 * g = grad + weight_decay * param; sum += g * g; param += (g * -lr) / (sqrt(sum) + eps).
 * torch's CPU kernels compute the first two as fused multiply-adds (add with alpha and addcmul_
 * are vec::fmadd) and the rest one rounding per op, so this does too: fma() where torch fuses,
 * nothing contracted elsewhere (see the build). The square root is correctly rounded, which
 * torch's is not always (one unit in the last place). Built as SIMD_CLONES: the baseline's
 * fma() is libm's. */

#define DEFINE_ADAGRAD(name, T, FMA, SQRT)                                                   \
    SIMD_CLONES static void name(T *p, T *acc, const T *g_all, const int64_t *r, Py_ssize_t n, \
                                Py_ssize_t dim, double lr, double eps, double weight_decay) { \
        const T neg_lr = (T)(-lr), e = (T)eps, wd = (T)weight_decay;                          \
        const Py_ssize_t row_bytes = dim * (Py_ssize_t)sizeof(T);                             \
        const int decay = weight_decay != 0.0;                                                \
        for (Py_ssize_t i = 0; i < n; i++) {                                                  \
            if (i + PREFETCH_DISTANCE < n) {                                                  \
                const Py_ssize_t ahead = r[i + PREFETCH_DISTANCE] * dim;                      \
                prefetch_row((const char *)(p + ahead), row_bytes, 1);                        \
                prefetch_row((const char *)(acc + ahead), row_bytes, 1);                      \
            }                                                                                 \
            T *restrict pr = p + r[i] * dim, *restrict ar = acc + r[i] * dim;                 \
            const T *restrict gr = g_all + i * dim;                                           \
            for (Py_ssize_t j = 0; j < dim; j++) {                                            \
                const T g = decay ? FMA(wd, pr[j], gr[j]) : gr[j];                            \
                const T s = FMA(g, g, ar[j]);                                                 \
                ar[j] = s;                                                                    \
                pr[j] = pr[j] + (g * neg_lr) / (SQRT(s) + e);                                 \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_ADAGRAD(adagrad_f32, float, fmaf, sqrtf)
DEFINE_ADAGRAD(adagrad_f64, double, fma, sqrt)

PyDoc_STRVAR(adagrad_doc,
"adagrad(param, state_sum, dim, rows, grad, lr, eps, weight_decay, double)\n\n"
"Adagrad on the distinct int64 `rows` of float32 [capacity, dim] `param` and its `state_sum`\n"
"(float64 when `double` is true), with the [len(rows), dim] `grad`:\n"
"g = grad + weight_decay * param; sum += g * g; param += (g * -lr) / (sqrt(sum) + eps),\n"
"rounded as torch's CPU kernels round them (the first two fused). Checks every row first.\n"
"Releases the GIL.");

static PyObject *adagrad(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *table, *state_obj, *rows, *grad;
    Py_ssize_t dim;
    double lr, eps, weight_decay;
    int is_double;
    if (!PyArg_ParseTuple(args, "OOnOOdddp:adagrad", &table, &state_obj, &dim, &rows, &grad,
                          &lr, &eps, &weight_decay, &is_double))
        return NULL;
    if (dim <= 0) {
        PyErr_Format(PyExc_ValueError, "dim must be positive, got %zd", dim);
        return NULL;
    }
    const Py_ssize_t row_bytes = dim * (is_double ? (Py_ssize_t)sizeof(double)
                                                  : (Py_ssize_t)sizeof(float));
    Call c;
    if (prepare(&c, table, 1, row_bytes, rows, grad, 0, "grad") < 0) return NULL;
    Py_buffer state;
    if (PyObject_GetBuffer(state_obj, &state, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        release(&c);
        return NULL;
    }
    if (state.len != c.table.len) {
        PyErr_Format(PyExc_ValueError, "state_sum is %zd bytes, the table %zd", state.len,
                     c.table.len);
        PyBuffer_Release(&state);
        release(&c);
        return NULL;
    }
    const int64_t *r = c.rows.buf;
    Py_BEGIN_ALLOW_THREADS
    if (is_double)
        adagrad_f64(c.table.buf, state.buf, c.other.buf, r, c.n, dim, lr, eps, weight_decay);
    else
        adagrad_f32(c.table.buf, state.buf, c.other.buf, r, c.n, dim, lr, eps, weight_decay);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&state);
    release(&c);
    Py_RETURN_NONE;
}

/* Adam on a dense block, element by element in torch.optim.Adam's (single-tensor) order of ops,
 * with the bias corrections worked out by the caller as torch does (in double):
 * g = grad + weight_decay * param; m = lerp(m, g, 1 - beta1); v = v * beta2 + (1 - beta2) * g * g;
 * param += (-step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps). The fused multiply-adds
 * are where torch's CPU kernels fuse (add with alpha, lerp, addcmul_); lerp takes torch's two
 * forms, by whether its weight is under one half. */
#define DEFINE_ADAM(name, T, FMA, SQRT)                                                       \
    SIMD_CLONES static void name(T *p, T *m, T *v, const T *grad, Py_ssize_t n, double beta1,   \
                                double beta2, double step_size, double bc2_sqrt, double eps,   \
                                double weight_decay) {                                         \
        const T w = (T)(1.0 - beta1), w1 = w - (T)1, b2 = (T)beta2, c2 = (T)(1.0 - beta2);     \
        const T neg_step = (T)(-step_size), root = (T)bc2_sqrt, e = (T)eps;                    \
        const T wd = (T)weight_decay;                                                          \
        const int decay = weight_decay != 0.0, small = w < (T)0.5 && w > (T)-0.5;              \
        for (Py_ssize_t i = 0; i < n; i++) {                                                   \
            const T g = decay ? FMA(wd, p[i], grad[i]) : grad[i];                              \
            const T d = g - m[i];                                                              \
            const T mi = small ? FMA(w, d, m[i]) : FMA(w1, d, g);                              \
            m[i] = mi;                                                                         \
            const T vi = FMA(c2 * g, g, v[i] * b2);                                            \
            v[i] = vi;                                                                         \
            p[i] = p[i] + (neg_step * mi) / (SQRT(vi) / root + e);                             \
        }                                                                                      \
    }

DEFINE_ADAM(adam_f32, float, fmaf, sqrtf)
DEFINE_ADAM(adam_f64, double, fma, sqrt)

PyDoc_STRVAR(adam_doc,
"adam(param, exp_avg, exp_avg_sq, grad, beta1, beta2, step_size, bias_correction2_sqrt, eps,\n"
"     weight_decay, double)\n\n"
"Adam on equally long float32 buffers (float64 when `double` is true), element by element, as\n"
"torch.optim.Adam's single-tensor step with the given bias-corrected scalars. Releases the GIL.");

static PyObject *adam(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *objs[4];
    double beta1, beta2, step_size, bc2_sqrt, eps, weight_decay;
    int is_double;
    if (!PyArg_ParseTuple(args, "OOOOddddddp:adam", &objs[0], &objs[1], &objs[2], &objs[3],
                          &beta1, &beta2, &step_size, &bc2_sqrt, &eps, &weight_decay,
                          &is_double))
        return NULL;
    static const char *names[4] = {"param", "exp_avg", "exp_avg_sq", "grad"};
    const Py_ssize_t itemsize = is_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    Py_buffer bufs[4];
    int held = 0;
    for (; held < 4; held++) {
        const int flags = PyBUF_C_CONTIGUOUS | (held < 3 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[held], &bufs[held], flags) < 0) goto fail;
        if (bufs[held].len != bufs[0].len || bufs[held].len % itemsize) {
            PyErr_Format(PyExc_ValueError, "%s is %zd bytes; param is %zd, in %zd-byte elements",
                         names[held], bufs[held].len, bufs[0].len, itemsize);
            held++;
            goto fail;
        }
    }
    const Py_ssize_t n = bufs[0].len / itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (is_double)
        adam_f64(bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, n, beta1, beta2, step_size,
                 bc2_sqrt, eps, weight_decay);
    else
        adam_f32(bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, n, beta1, beta2, step_size,
                 bc2_sqrt, eps, weight_decay);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 4; i++) PyBuffer_Release(&bufs[i]);
    Py_RETURN_NONE;
fail:
    for (int i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    return NULL;
}

#define FINITE_BLOCK 4096
/* Scans of this many bytes or more release the GIL; shorter ones (a streamed chunk takes tens
 * of microseconds) keep it, which costs other threads less than handing it over twice. */
#define FINITE_GIL_BYTES (4 << 20)

/* First of `n` elements whose exponent bits (`m`) are all set, i.e. a NaN or an infinity in
 * IEEE-754 layouts (float16, bfloat16, float32, float64); -1 when there is none. Elements may
 * be unaligned (they often sit behind a message header), hence the memcpy loads.
 *
 * The exponent field ends just below the sign bit, so adding its lowest bit to (v & m) carries
 * into the sign bit exactly when every exponent bit is set. Blocks of elements are OR-reduced
 * that way (an and, an add and an or per element: plain SIMD) and only a block whose sign bit
 * came out set is searched for its first bad element. */
#define DEFINE_SCAN(name, T)                                                            \
    SIMD_CLONES static Py_ssize_t name(const char *p, Py_ssize_t n, T m) {              \
        const T low = (T)(m & (T)(~m + 1)), top = (T)((T)1 << (8 * sizeof(T) - 1));      \
        for (Py_ssize_t start = 0; start < n; start += FINITE_BLOCK) {                  \
            const Py_ssize_t end = n - start < FINITE_BLOCK ? n : start + FINITE_BLOCK; \
            T any = 0;                                                                  \
            for (Py_ssize_t i = start; i < end; i++) {                                  \
                T v;                                                                    \
                memcpy(&v, p + i * (Py_ssize_t)sizeof(T), sizeof(T));                   \
                any |= (T)((v & m) + low);                                              \
            }                                                                           \
            if (!(any & top)) continue;                                                 \
            for (Py_ssize_t i = start; i < end; i++) {                                  \
                T v;                                                                    \
                memcpy(&v, p + i * (Py_ssize_t)sizeof(T), sizeof(T));                   \
                if ((v & m) == m) return i;                                             \
            }                                                                           \
        }                                                                               \
        return -1;                                                                      \
    }

DEFINE_SCAN(scan16, uint16_t)
DEFINE_SCAN(scan32, uint32_t)
DEFINE_SCAN(scan64, uint64_t)

PyDoc_STRVAR(first_nonfinite_doc,
"first_nonfinite(buf, width, mask, /) -> int\n\n"
"Index of the first `width`-byte element of `buf` whose bits under `mask` are all set (the\n"
"exponent mask of an IEEE-754 format: a NaN or an infinity), or -1.");

static PyObject *first_nonfinite(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *obj;
    Py_ssize_t width;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "OnK:first_nonfinite", &obj, &width, &mask)) return NULL;
    if (width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width must be 2, 4 or 8 bytes, got %zd", width);
        return NULL;
    }
    /* An exponent mask: one run of bits that ends just below the sign bit. */
    const unsigned long long sign = 1ULL << (8 * width - 1);
    const unsigned long long low = mask & (~mask + 1);
    if (mask == 0 || mask >= sign || mask + low != sign) {
        PyErr_Format(PyExc_ValueError, "mask %llu is not an exponent mask of %zd-byte floats",
                     mask, width);
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(obj, &buf, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (buf.len % width) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is not a whole number of %zd-byte "
                     "elements", buf.len, width);
        PyBuffer_Release(&buf);
        return NULL;
    }
    const char *p = buf.buf;
    const Py_ssize_t n = buf.len / width;
    Py_ssize_t found;
    PyThreadState *saved = buf.len >= FINITE_GIL_BYTES ? PyEval_SaveThread() : NULL;
    if (width == 2)
        found = scan16(p, n, (uint16_t)mask);
    else if (width == 4)
        found = scan32(p, n, (uint32_t)mask);
    else
        found = scan64(p, n, (uint64_t)mask);
    if (saved) PyEval_RestoreThread(saved);
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(found);
}

static PyMethodDef module_methods[] = {
    {"gather", (PyCFunction)gather, METH_VARARGS, gather_doc},
    {"scatter", (PyCFunction)scatter, METH_VARARGS, scatter_doc},
    {"add", (PyCFunction)add, METH_VARARGS, add_doc},
    {"adagrad", (PyCFunction)adagrad, METH_VARARGS, adagrad_doc},
    {"adam", (PyCFunction)adam, METH_VARARGS, adam_doc},
    {"first_nonfinite", (PyCFunction)first_nonfinite, METH_VARARGS, first_nonfinite_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Row gathers, scatters and adds over [capacity, dim] storage by int64 row ids (see ps.rows for\n"
"the torch wrapper). Each call checks every row id first, then releases the GIL. Also the scan\n"
"for NaN and infinity that pushes pass before anything applies.");

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ps._rows",
    .m_doc = module_doc,
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&rows_module); }
