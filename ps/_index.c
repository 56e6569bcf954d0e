/*
 * ps._index -- Int64Index, a vectorised int64 key -> dense row id hash index.
 *
 * The server keeps embedding rows in dense arrays; this table maps the sparse int64 feature
 * ids that clients send to row numbers in those arrays, a whole request batch per call.
 *
 * Layout: open addressing with linear probing over a power-of-two array of {key, row} slots,
 * an int64 key and an int32 row packed into 12 bytes. Emptiness is marked by row == -1 rather
 * than by a reserved key, so every int64 (including -1 and INT64_MIN) is a valid key; row ids
 * are limited to [0, MAX_ROWS), and an insert past that raises OverflowError with the index
 * unchanged. Linear probing over 12-byte slots keeps a probe sequence within one or two cache
 * lines, which matters more than anything else once the table is far larger than the CPU
 * caches (one array of packed slots, not separate key and row arrays: a probe then misses the
 * cache once, not twice); for the same reason each probe loop prefetches the home slot of a key
 * PREFETCH_DISTANCE positions ahead, so that many cache misses are in flight at once.
 *
 * Buffers are taken through the buffer protocol only (no numpy headers), and the GIL is
 * released around every loop over keys or slots. The object itself is NOT thread-safe: callers
 * must serialise access with their own lock. A cheap in-use flag turns a caller's locking bug
 * into a RuntimeError instead of memory corruption.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: it defines _GNU_SOURCE, which exposes aligned_alloc/madvise */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

/* 4-byte alignment makes the slot 12 bytes, not 16: the key is read unaligned one slot in
 * two, which costs nothing measurable on x86-64 and AArch64. */
#pragma pack(push, 4)
typedef struct {
    int64_t key;
    int32_t row; /* EMPTY_ROW marks a free slot */
} Slot;
#pragma pack(pop)

#define EMPTY_ROW (-1)
/* Row ids are below this (an int32 holds them), so an index holds at most 2**31 - 1 rows. */
#define MAX_ROWS ((size_t)INT32_MAX)
#define MIN_CAPACITY ((size_t)8)
/* Far below where capacity * sizeof(Slot) or capacity * 7 could overflow a 64-bit size_t. */
#define MAX_CAPACITY ((size_t)1 << 58)
/* Keys ahead of the current one whose home slot is prefetched: enough to cover DRAM latency. */
#define PREFETCH_DISTANCE 16
#define HUGE_PAGE_BYTES ((size_t)2 << 20)

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(addr, rw) __builtin_prefetch((addr), (rw), 3)
#else
#define PREFETCH(addr, rw) ((void)0)
#endif

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t capacity; /* number of slots, a power of two */
    size_t size;     /* number of keys */
    size_t next_row; /* one past the largest row id ever held: what lookup_or_insert gives next */
    size_t max_size; /* load limit: 0.7 * capacity */
    uint64_t seed;
    int readers; /* lookups/exports currently running with the GIL released */
    int writing; /* a mutation currently running with the GIL released */
} Int64Index;

/* splitmix64 finaliser: every input bit affects the low bits used as the slot index, so
 * sequential or strided ids (the common case for feature ids) do not cluster. */
static inline uint64_t hash_key(int64_t key, uint64_t seed) {
    uint64_t z = (uint64_t)key ^ seed;
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static size_t load_limit(size_t capacity) { return capacity * 7 / 10; }

/* Smallest power-of-two capacity holding n keys at the load limit; 0 if too large. */
static size_t capacity_for(size_t n) {
    size_t cap = MIN_CAPACITY;
    while (load_limit(cap) < n) {
        if (cap >= MAX_CAPACITY) return 0;
        cap <<= 1;
    }
    return cap;
}

/* Large tables are 2 MiB aligned and advised onto transparent huge pages: random probes into
 * a table of hundreds of MiB otherwise miss the TLB on nearly every key. Needs no GIL. */
static Slot *slots_alloc(size_t cap) {
    size_t nbytes = cap * sizeof(Slot);
    if (nbytes < HUGE_PAGE_BYTES) return (Slot *)malloc(nbytes);
    /* C11 wants a multiple of the alignment; the rounded-up tail is never written, so it takes
     * address space, not memory. */
    nbytes = (nbytes + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
    Slot *p = (Slot *)aligned_alloc(HUGE_PAGE_BYTES, nbytes);
#ifdef MADV_HUGEPAGE
    if (p != NULL) (void)madvise(p, nbytes, MADV_HUGEPAGE); /* advisory; failure is harmless */
#endif
    return p;
}

/* All-ones bytes make every slot {key = -1, row = -1}, i.e. empty. */
static void slots_clear(Slot *slots, size_t cap) { memset(slots, 0xFF, cap * sizeof(Slot)); }

/* Re-inserts every occupied slot of `old` into the empty table `fresh`. Keys are known to be
 * distinct, so only an empty slot is searched for. Scanning `old` in order writes `fresh` in a
 * few nearly sequential streams (a home slot h & (cap-1) becomes h & (2cap-1)), so no prefetch
 * is needed. Needs no GIL. */
static void slots_move(const Slot *old, size_t old_cap, Slot *fresh, size_t cap, uint64_t seed) {
    const size_t mask = cap - 1;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].row < 0) continue;
        size_t j = hash_key(old[i].key, seed) & mask;
        while (fresh[j].row >= 0) j = (j + 1) & mask;
        fresh[j] = old[i];
    }
}

/* Ensures room for `need` keys without passing the load limit. GIL held on entry and exit;
 * released while the new table is filled. On failure the table is unchanged. */
static int index_reserve(Int64Index *self, size_t need) {
    if (self->slots != NULL && need <= self->max_size) return 0;
    size_t cap = capacity_for(need);
    Slot *fresh = cap ? slots_alloc(cap) : NULL;
    if (fresh == NULL) {
        PyErr_Format(PyExc_MemoryError, "Int64Index: cannot allocate room for %zu keys", need);
        return -1;
    }
    Slot *old = self->slots;
    Py_BEGIN_ALLOW_THREADS
    slots_clear(fresh, cap);
    slots_move(old, self->capacity, fresh, cap, self->seed);
    free(old);
    Py_END_ALLOW_THREADS
    self->slots = fresh;
    self->capacity = cap;
    self->max_size = load_limit(cap);
    return 0;
}

/* The in-use guard. Checked and set with the GIL held, so it is race-free itself; it lets
 * concurrent readers through but refuses anything that overlaps a writer. */
static int begin_use(Int64Index *self, int write) {
    if (self->writing || (write && self->readers)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Int64Index used from two threads at once; callers must hold a lock");
        return -1;
    }
    if (write) self->writing = 1;
    else self->readers++;
    return 0;
}

static void end_use(Int64Index *self, int write) {
    if (write) self->writing = 0;
    else self->readers--;
}

/* Acquires a 1-D C-contiguous buffer of native int64. On failure nothing is held. */
static int get_int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *fmt = view->format ? view->format : "B";
    char order = (*fmt && strchr("@=<>!", *fmt)) ? *fmt++ : '@';
    /* 'l' is 8 bytes only in native mode; explicit byte orders use standard sizes ('q'). */
    int ok_char = (fmt[0] == 'q' || (fmt[0] == 'l' && order == '@')) && fmt[1] == '\0';
    int ok_order = order == '@' || order == '=' || (order == '<') == (PY_LITTLE_ENDIAN != 0);
    if (!ok_char || !ok_order || view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a native int64 buffer, got format '%s' (itemsize %zd)", name,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be 1-D, got %d dimensions", name, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Acquires keys (read) and out (write), which must have equal lengths and must not partly
 * overlap (keys is out is fine: each key is read before its own output is written). */
static int get_keys_and_out(PyObject *keys_obj, PyObject *out_obj, Py_buffer *keys,
                            Py_buffer *out) {
    if (get_int64_buffer(keys_obj, keys, 0, "keys") < 0) return -1;
    if (get_int64_buffer(out_obj, out, 1, "out") < 0) {
        PyBuffer_Release(keys);
        return -1;
    }
    const char *k = keys->buf, *o = out->buf;
    if (keys->len != out->len) {
        PyErr_Format(PyExc_ValueError,
                     "keys and out differ in length: keys has %zd elements, out has %zd",
                     keys->len / 8, out->len / 8);
    } else if (k != o && k < o + out->len && o < k + keys->len) {
        PyErr_SetString(PyExc_ValueError, "keys and out overlap without being the same buffer");
    } else {
        return 0;
    }
    PyBuffer_Release(keys);
    PyBuffer_Release(out);
    return -1;
}

/* ---- probe loops: run without the GIL ---- */

static Py_ssize_t probe_lookup(const Int64Index *self, const int64_t *keys, int64_t *out,
                               Py_ssize_t n) {
    const Slot *slots = self->slots;
    const size_t mask = self->capacity - 1;
    const uint64_t seed = self->seed;
    Py_ssize_t found = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_DISTANCE < n)
            PREFETCH(&slots[hash_key(keys[i + PREFETCH_DISTANCE], seed) & mask], 0);
        const int64_t key = keys[i];
        size_t j = hash_key(key, seed) & mask;
        int64_t row;
        /* Terminates: the load limit guarantees at least one empty slot. */
        while ((row = slots[j].row) >= 0 && slots[j].key != key) j = (j + 1) & mask;
        out[i] = row; /* EMPTY_ROW (-1) when absent */
        found += row >= 0;
    }
    return found;
}

/* Capacity for size + n keys must already be reserved, so no slot moves during the loop and
 * the prefetches stay valid. Returns the new next_row, which the caller stores with the GIL
 * held (len() from another thread must not see it change mid-call); or, when a new key would
 * need row MAX_ROWS, stops there and returns MAX_ROWS + 1 (rows it created stay: see
 * undo_insert). */
static size_t probe_insert(Int64Index *self, const int64_t *keys, int64_t *out, Py_ssize_t n) {
    Slot *slots = self->slots;
    const size_t mask = self->capacity - 1;
    const uint64_t seed = self->seed;
    size_t next_row = self->next_row;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_DISTANCE < n)
            PREFETCH(&slots[hash_key(keys[i + PREFETCH_DISTANCE], seed) & mask], 1);
        const int64_t key = keys[i];
        size_t j = hash_key(key, seed) & mask;
        while (slots[j].row >= 0 && slots[j].key != key) j = (j + 1) & mask;
        if (slots[j].row < 0) { /* first appearance: next dense row id */
            if (next_row >= MAX_ROWS) return MAX_ROWS + 1;
            slots[j].key = key;
            slots[j].row = (int32_t)next_row++;
        }
        out[i] = slots[j].row;
    }
    return next_row;
}

static void slot_remove(Slot *slots, size_t mask, uint64_t seed, size_t i);

/* Removes the keys of `keys` that hold rows >= first_row, i.e. those a probe_insert that ran
 * out of row ids created: the index is as it was before that call. Needs no GIL. */
static void undo_insert(Int64Index *self, const int64_t *keys, Py_ssize_t n, size_t first_row) {
    Slot *slots = self->slots;
    const size_t mask = self->capacity - 1;
    const uint64_t seed = self->seed;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t j = hash_key(keys[i], seed) & mask;
        while (slots[j].row >= 0 && slots[j].key != keys[i]) j = (j + 1) & mask;
        if (slots[j].row >= 0 && (size_t)slots[j].row >= first_row)
            slot_remove(slots, mask, seed, j);
    }
}

/* ---- methods ---- */

static PyObject *Int64Index_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity_hint", "seed", NULL};
    Py_ssize_t hint = 0;
    PyObject *seed_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nO!:Int64Index", kwlist, &hint, &PyLong_Type,
                                     &seed_obj))
        return NULL;
    if (hint < 0)
        return PyErr_Format(PyExc_ValueError, "capacity_hint must be >= 0, got %zd", hint);
    uint64_t seed = 0;
    if (seed_obj != NULL) {
        PyObject *zero = PyLong_FromLong(0);
        if (zero == NULL) return NULL;
        int negative = PyObject_RichCompareBool(seed_obj, zero, Py_LT);
        Py_DECREF(zero);
        if (negative < 0) return NULL;
        if (negative) return PyErr_Format(PyExc_ValueError, "seed must be >= 0, got %R", seed_obj);
        seed = PyLong_AsUnsignedLongLong(seed_obj); /* OverflowError past 2**64 - 1 */
        if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    Int64Index *self = (Int64Index *)type->tp_alloc(type, 0); /* zero-filled: no table yet */
    if (self == NULL) return NULL;
    self->seed = seed;
    if (index_reserve(self, (size_t)hint) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Int64Index_dealloc(Int64Index *self) {
    free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(lookup_doc,
"lookup($self, keys, out, /)\n--\n\n"
"Write the row id of each key in `keys` into `out`, or -1 for a key that is absent.\n"
"Both are 1-D C-contiguous int64 buffers of equal length; `out` may be `keys` itself.\n"
"Returns the number of keys found. Releases the GIL while probing; not thread-safe.");

static PyObject *Int64Index_lookup(Int64Index *self, PyObject *args) {
    PyObject *keys_obj, *out_obj;
    Py_buffer keys, out;
    if (!PyArg_ParseTuple(args, "OO:lookup", &keys_obj, &out_obj)) return NULL;
    if (get_keys_and_out(keys_obj, out_obj, &keys, &out) < 0) return NULL;
    Py_ssize_t found = -1;
    if (begin_use(self, 0) == 0) {
        Py_BEGIN_ALLOW_THREADS
        found = probe_lookup(self, keys.buf, out.buf, keys.len / 8);
        Py_END_ALLOW_THREADS
        end_use(self, 0);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return found < 0 ? NULL : PyLong_FromSsize_t(found);
}

PyDoc_STRVAR(lookup_or_insert_doc,
"lookup_or_insert($self, keys, out, /)\n--\n\n"
"Like lookup(), but a key that is absent is inserted first. New keys get row ids\n"
"row_limit, row_limit + 1, ... (len(self), ... while nothing was deleted) in order of first\n"
"appearance in `keys`; repeats of a key share its row. Returns the number of rows created.\n"
"Room for len(self) + len(keys) keys is reserved before anything is inserted, so on\n"
"MemoryError the table is unchanged; so it is on OverflowError, raised when a new key would\n"
"need a row id past 2**31 - 2 (an index holds at most 2**31 - 1 rows).\n"
"Releases the GIL while probing; not thread-safe.");

static PyObject *Int64Index_lookup_or_insert(Int64Index *self, PyObject *args) {
    PyObject *keys_obj, *out_obj;
    Py_buffer keys, out;
    if (!PyArg_ParseTuple(args, "OO:lookup_or_insert", &keys_obj, &out_obj)) return NULL;
    if (get_keys_and_out(keys_obj, out_obj, &keys, &out) < 0) return NULL;
    Py_ssize_t n = keys.len / 8, created = -1;
    if (begin_use(self, 1) == 0) {
        size_t before = self->next_row, after = 0;
        /* Worst case reservation: it may grow the table one batch early, but it makes the call
         * all-or-nothing, so a row id is never handed out without being returned. */
        if (index_reserve(self, self->size + (size_t)n) == 0) {
            /* Near the row limit the keys are copied first: a call that runs out of row ids
             * removes the keys it inserted again, and `out` may be `keys` itself. */
            const int64_t *k = keys.buf;
            int64_t *copy = NULL;
            int ready = 1;
            if (before + (size_t)n > MAX_ROWS) {
                copy = (int64_t *)malloc((size_t)n * sizeof(int64_t));
                ready = copy != NULL;
                if (ready) k = memcpy(copy, keys.buf, (size_t)n * sizeof(int64_t));
                else PyErr_NoMemory();
            }
            if (ready) {
                Py_BEGIN_ALLOW_THREADS
                after = probe_insert(self, k, out.buf, n);
                if (after > MAX_ROWS) undo_insert(self, k, n, before);
                Py_END_ALLOW_THREADS
                if (after > MAX_ROWS) {
                    PyErr_Format(PyExc_OverflowError,
                                 "Int64Index: %zd keys with %zu rows held would pass the limit "
                                 "of 2**31 - 1 rows per index; nothing was inserted. Spread "
                                 "the keys over more indexes", n, self->size);
                } else {
                    self->next_row = after;
                    self->size += after - before;
                    created = (Py_ssize_t)(after - before);
                }
            }
            free(copy);
        }
        end_use(self, 1);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return created < 0 ? NULL : PyLong_FromSsize_t(created);
}

PyDoc_STRVAR(export_doc,
"export($self, keys_out, /)\n--\n\n"
"Write the key of every row into `keys_out`, a writable 1-D C-contiguous int64 buffer of\n"
"length len(self): keys_out[row] = key. Releases the GIL while scanning; not thread-safe.");

static PyObject *Int64Index_export(Int64Index *self, PyObject *arg) {
    Py_buffer out;
    if (get_int64_buffer(arg, &out, 1, "keys_out") < 0) return NULL;
    int ok = 0;
    if (self->next_row != self->size) {
        PyErr_Format(PyExc_ValueError,
                     "export needs dense row ids 0..len-1, but the index holds %zu keys with row "
                     "ids up to %zu (keys were deleted); use items()", self->size,
                     self->next_row);
    } else if ((size_t)(out.len / 8) != self->size) {
        PyErr_Format(PyExc_ValueError, "keys_out has %zd elements, the index holds %zu keys",
                     out.len / 8, self->size);
    } else if (begin_use(self, 0) == 0) {
        const Slot *slots = self->slots;
        int64_t *dst = out.buf;
        size_t cap = self->capacity;
        Py_BEGIN_ALLOW_THREADS
        for (size_t i = 0; i < cap; i++)
            if (slots[i].row >= 0) dst[slots[i].row] = slots[i].key;
        Py_END_ALLOW_THREADS
        end_use(self, 0);
        ok = 1;
    }
    PyBuffer_Release(&out);
    return ok ? Py_NewRef(Py_None) : NULL;
}

PyDoc_STRVAR(reserve_doc,
"reserve($self, n, /)\n--\n\n"
"Grow the table, if needed, so that it holds n keys without another rehash. Never shrinks.");

static PyObject *Int64Index_reserve(Int64Index *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0, got %zd", n);
    if (begin_use(self, 1) < 0) return NULL;
    int rc = index_reserve(self, (size_t)n);
    end_use(self, 1);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

PyDoc_STRVAR(clear_doc,
"clear($self)\n--\n\n"
"Remove every key; the capacity is kept, and row ids start again from 0 (row_limit is 0).");

static PyObject *Int64Index_clear(Int64Index *self, PyObject *Py_UNUSED(ignored)) {
    if (begin_use(self, 1) < 0) return NULL;
    Slot *slots = self->slots;
    size_t cap = self->capacity;
    Py_BEGIN_ALLOW_THREADS
    slots_clear(slots, cap);
    Py_END_ALLOW_THREADS
    self->size = 0;
    self->next_row = 0;
    end_use(self, 1);
    Py_RETURN_NONE;
}


/* ---- deletion and explicit rows ---- */

/* Backward-shift deletion: empties slot i, then moves each later entry of its probe run into
 * the hole when the hole lies on that entry's path from its home slot, so lookups never meet
 * a hole inside a run and no tombstones build up. Needs no GIL. */
static void slot_remove(Slot *slots, size_t mask, uint64_t seed, size_t i) {
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (slots[j].row < 0) break;
        const size_t home = hash_key(slots[j].key, seed) & mask;
        /* The entry at j may move to i iff its home is not cyclically within (i, j]. */
        const int stays = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (stays) continue;
        slots[i] = slots[j];
        i = j;
    }
    slots[i].key = -1;
    slots[i].row = EMPTY_ROW;
}

static Py_ssize_t probe_delete(Int64Index *self, const int64_t *keys, int64_t *out,
                               Py_ssize_t n) {
    Slot *slots = self->slots;
    const size_t mask = self->capacity - 1;
    const uint64_t seed = self->seed;
    Py_ssize_t removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t key = keys[i];
        size_t j = hash_key(key, seed) & mask;
        int64_t row;
        while ((row = slots[j].row) >= 0 && slots[j].key != key) j = (j + 1) & mask;
        out[i] = row;
        if (row >= 0) {
            slot_remove(slots, mask, seed, j);
            removed++;
        }
    }
    return removed;
}

PyDoc_STRVAR(delete_doc,
"delete($self, keys, out, /)\n--\n\n"
"Remove each key of `keys`, writing the row id it held into `out` (-1 for a key that is\n"
"absent, or a repeat of one removed earlier in the call). Returns the number removed. The\n"
"row ids are not handed out again by lookup_or_insert (it continues from row_limit); give\n"
"them to new keys with insert_rows. Backward-shift deletion: no tombstones. Releases the\n"
"GIL while probing; not thread-safe.");

static PyObject *Int64Index_delete(Int64Index *self, PyObject *args) {
    PyObject *keys_obj, *out_obj;
    Py_buffer keys, out;
    if (!PyArg_ParseTuple(args, "OO:delete", &keys_obj, &out_obj)) return NULL;
    if (get_keys_and_out(keys_obj, out_obj, &keys, &out) < 0) return NULL;
    Py_ssize_t removed = -1;
    if (begin_use(self, 1) == 0) {
        if (self->slots == NULL) {
            removed = 0;
        } else {
            Py_BEGIN_ALLOW_THREADS
            removed = probe_delete(self, keys.buf, out.buf, keys.len / 8);
            Py_END_ALLOW_THREADS
            self->size -= (size_t)removed;
        }
        end_use(self, 1);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return removed < 0 ? NULL : PyLong_FromSsize_t(removed);
}

PyDoc_STRVAR(insert_rows_doc,
"insert_rows($self, keys, rows, /)\n--\n\n"
"Insert each key of `keys` with the row id at the same position of `rows` (each in\n"
"[0, 2**31 - 1)): how a caller reuses the row ids of deleted keys. Keys must be absent and\n"
"distinct, rows must not be held by another key (the index does not check that).\n"
"All-or-nothing: a negative row or a key already present raises ValueError, a row of\n"
"2**31 - 1 or more OverflowError, with the index unchanged. Raises row_limit past the\n"
"largest row given. Releases the GIL while probing; not thread-safe.");

static PyObject *Int64Index_insert_rows(Int64Index *self, PyObject *args) {
    PyObject *keys_obj, *rows_obj;
    Py_buffer keys, rows;
    if (!PyArg_ParseTuple(args, "OO:insert_rows", &keys_obj, &rows_obj)) return NULL;
    if (get_int64_buffer(keys_obj, &keys, 0, "keys") < 0) return NULL;
    if (get_int64_buffer(rows_obj, &rows, 0, "rows") < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    const Py_ssize_t n = keys.len / 8;
    const int64_t *k = keys.buf, *r = rows.buf;
    int ok = 0;
    if (rows.len != keys.len) {
        PyErr_Format(PyExc_ValueError, "keys has %zd elements, rows has %zd", n, rows.len / 8);
    } else if (begin_use(self, 1) == 0) {
        int64_t top = -1;
        Py_ssize_t bad = -1, present = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (r[i] < 0 || (uint64_t)r[i] >= MAX_ROWS) {
                bad = i;
                break;
            }
            if (r[i] > top) top = r[i];
        }
        if (bad >= 0 && r[bad] < 0) {
            PyErr_Format(PyExc_ValueError, "row %lld at position %zd is negative",
                         (long long)r[bad], bad);
        } else if (bad >= 0) {
            PyErr_Format(PyExc_OverflowError,
                         "row %lld at position %zd is past the largest row id an index holds, "
                         "2**31 - 2; nothing was inserted", (long long)r[bad], bad);
        } else if (index_reserve(self, self->size + (size_t)n) == 0) {
            Slot *slots = self->slots;
            const size_t mask = self->capacity - 1;
            const uint64_t seed = self->seed;
            Py_ssize_t i;
            Py_BEGIN_ALLOW_THREADS
            for (i = 0; i < n; i++) {
                size_t j = hash_key(k[i], seed) & mask;
                while (slots[j].row >= 0 && slots[j].key != k[i]) j = (j + 1) & mask;
                if (slots[j].row >= 0) {
                    present = i;
                    break;
                }
                slots[j].key = k[i];
                slots[j].row = (int32_t)r[i];
            }
            if (present >= 0) { /* undo: the index is as it was */
                for (Py_ssize_t u = 0; u < present; u++) {
                    size_t j = hash_key(k[u], seed) & mask;
                    while (slots[j].key != k[u] || slots[j].row < 0) j = (j + 1) & mask;
                    slot_remove(slots, mask, seed, j);
                }
            }
            Py_END_ALLOW_THREADS
            if (present >= 0) {
                PyErr_Format(PyExc_ValueError,
                             "key %lld at position %zd is already in the index; insert_rows "
                             "takes absent, distinct keys", (long long)k[present], present);
            } else {
                self->size += (size_t)n;
                if ((size_t)(top + 1) > self->next_row) self->next_row = (size_t)(top + 1);
                ok = 1;
            }
        }
        end_use(self, 1);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    return ok ? Py_NewRef(Py_None) : NULL;
}

PyDoc_STRVAR(items_doc,
"items($self, keys_out, rows_out, /)\n--\n\n"
"Write every (key, row id) pair, in slot order, into two writable int64 buffers of length\n"
"len(self). Releases the GIL while scanning; not thread-safe.");

static PyObject *Int64Index_items(Int64Index *self, PyObject *args) {
    PyObject *keys_obj, *rows_obj;
    Py_buffer keys, rows;
    if (!PyArg_ParseTuple(args, "OO:items", &keys_obj, &rows_obj)) return NULL;
    if (get_int64_buffer(keys_obj, &keys, 1, "keys_out") < 0) return NULL;
    if (get_int64_buffer(rows_obj, &rows, 1, "rows_out") < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    int ok = 0;
    if (rows.len != keys.len) {
        PyErr_Format(PyExc_ValueError, "keys_out has %zd elements, rows_out has %zd",
                     keys.len / 8, rows.len / 8);
    } else if ((size_t)(keys.len / 8) != self->size) {
        PyErr_Format(PyExc_ValueError, "keys_out has %zd elements, the index holds %zu keys",
                     keys.len / 8, self->size);
    } else if (keys.buf == rows.buf && self->size > 0) {
        PyErr_SetString(PyExc_ValueError, "keys_out and rows_out must be different buffers");
    } else if (begin_use(self, 0) == 0) {
        const Slot *slots = self->slots;
        int64_t *kd = keys.buf, *rd = rows.buf;
        size_t cap = self->capacity, w = 0;
        Py_BEGIN_ALLOW_THREADS
        for (size_t i = 0; i < cap; i++)
            if (slots[i].row >= 0) {
                kd[w] = slots[i].key;
                rd[w++] = slots[i].row;
            }
        Py_END_ALLOW_THREADS
        end_use(self, 0);
        ok = 1;
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    return ok ? Py_NewRef(Py_None) : NULL;
}

PyDoc_STRVAR(scan_doc,
"scan($self, start, max_slots, keys_out, rows_out, /)\n--\n\n"
"Write the (key, row id) pairs held in slots start, start + 1, ... into keys_out and\n"
"rows_out (writable 1-D int64 buffers of equal length), in slot order, stopping after\n"
"max_slots slots, after the last slot, or when the buffers are full. 0 <= start < capacity.\n"
"Returns (count, next_slot): the pairs written and the slot to go on from, 0 after the last\n"
"slot, so that a cursor goes round the table in bounded steps. Between two calls a delete\n"
"may move an entry to an earlier slot (backward shift), past the cursor: that pass misses it\n"
"(or, moved across the wrap, meets it twice). Each move brings an entry nearer its home slot,\n"
"so no entry is missed on every pass. Releases the GIL while scanning; not thread-safe.");

static PyObject *Int64Index_scan(Int64Index *self, PyObject *args) {
    Py_ssize_t start, max_slots;
    PyObject *keys_obj, *rows_obj;
    Py_buffer keys, rows;
    if (!PyArg_ParseTuple(args, "nnOO:scan", &start, &max_slots, &keys_obj, &rows_obj))
        return NULL;
    if (start < 0 || (size_t)start >= self->capacity)
        return PyErr_Format(PyExc_ValueError, "start must be in [0, %zu), got %zd",
                            self->capacity, start);
    if (max_slots < 0)
        return PyErr_Format(PyExc_ValueError, "max_slots must be >= 0, got %zd", max_slots);
    if (get_int64_buffer(keys_obj, &keys, 1, "keys_out") < 0) return NULL;
    if (get_int64_buffer(rows_obj, &rows, 1, "rows_out") < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    PyObject *result = NULL;
    if (rows.len != keys.len) {
        PyErr_Format(PyExc_ValueError, "keys_out has %zd elements, rows_out has %zd",
                     keys.len / 8, rows.len / 8);
    } else if (keys.buf == rows.buf && keys.len > 0) {
        PyErr_SetString(PyExc_ValueError, "keys_out and rows_out must be different buffers");
    } else if (begin_use(self, 0) == 0) {
        const Slot *slots = self->slots;
        int64_t *kd = keys.buf, *rd = rows.buf;
        const size_t room = (size_t)(keys.len / 8), cap = self->capacity;
        const size_t left = cap - (size_t)start;
        const size_t end = (size_t)start + ((size_t)max_slots < left ? (size_t)max_slots : left);
        size_t i = (size_t)start, w = 0;
        Py_BEGIN_ALLOW_THREADS
        for (; i < end && w < room; i++)
            if (slots[i].row >= 0) {
                kd[w] = slots[i].key;
                rd[w++] = slots[i].row;
            }
        Py_END_ALLOW_THREADS
        end_use(self, 0);
        result = Py_BuildValue("nn", (Py_ssize_t)w, (Py_ssize_t)(i < cap ? i : 0));
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    return result;
}

static PyObject *Int64Index_get_row_limit(Int64Index *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->next_row);
}

static Py_ssize_t Int64Index_len(Int64Index *self) { return (Py_ssize_t)self->size; }

static PyObject *Int64Index_get_capacity(Int64Index *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->capacity);
}

static PyObject *Int64Index_get_nbytes(Int64Index *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->capacity * sizeof(Slot));
}

static PyMethodDef Int64Index_methods[] = {
    {"lookup", (PyCFunction)Int64Index_lookup, METH_VARARGS, lookup_doc},
    {"lookup_or_insert", (PyCFunction)Int64Index_lookup_or_insert, METH_VARARGS,
     lookup_or_insert_doc},
    {"export", (PyCFunction)Int64Index_export, METH_O, export_doc},
    {"reserve", (PyCFunction)Int64Index_reserve, METH_O, reserve_doc},
    {"clear", (PyCFunction)Int64Index_clear, METH_NOARGS, clear_doc},
    {"delete", (PyCFunction)Int64Index_delete, METH_VARARGS, delete_doc},
    {"insert_rows", (PyCFunction)Int64Index_insert_rows, METH_VARARGS, insert_rows_doc},
    {"items", (PyCFunction)Int64Index_items, METH_VARARGS, items_doc},
    {"scan", (PyCFunction)Int64Index_scan, METH_VARARGS, scan_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Int64Index_getset[] = {
    {"capacity", (getter)Int64Index_get_capacity, NULL, "Number of slots (a power of two).", NULL},
    {"nbytes", (getter)Int64Index_get_nbytes, NULL,
     "Bytes held by the slot array (12 per slot).", NULL},
    {"row_limit", (getter)Int64Index_get_row_limit, NULL,
     "One past the largest row id handed out since the last clear.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Int64Index_as_sequence = {.sq_length = (lenfunc)Int64Index_len};

PyDoc_STRVAR(Int64Index_doc,
"Int64Index(capacity_hint=0, seed=0)\n--\n\n"
"Hash index from int64 keys to dense row ids 0..len-1, assigned in order of first insertion.\n"
"Every int64 is a valid key. capacity_hint pre-sizes the table for that many keys; seed\n"
"(0 <= seed < 2**64) perturbs the hash. Methods take int64 buffers and release the GIL,\n"
"but the object is NOT thread-safe: callers must serialise access with a lock (overlapping\n"
"use is detected on a best-effort basis and raises RuntimeError).");

static PyTypeObject Int64IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ps._index.Int64Index",
    .tp_basicsize = sizeof(Int64Index),
    .tp_dealloc = (destructor)Int64Index_dealloc,
    .tp_as_sequence = &Int64Index_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Int64Index_doc,
    .tp_methods = Int64Index_methods,
    .tp_getset = Int64Index_getset,
    .tp_new = Int64Index_new,
};

/* ---- repeat detection for push requests ---- */

PyDoc_STRVAR(first_repeat_doc,
"first_repeat(rows, bitmap) -> int\n\n"
"Position of the first element of `rows` (int64 row ids) equal to an earlier element, or -1\n"
"when all are distinct. `bitmap` is a writable byte buffer of at least (max row + 8) // 8\n"
"bytes that is all zero on entry; it is all zero again on return. Costs one bit test per\n"
"row, instead of a sort. Releases the GIL; callers serialise uses of one bitmap.");

static PyObject *first_repeat(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *rows_obj, *bits_obj;
    if (!PyArg_ParseTuple(args, "OO:first_repeat", &rows_obj, &bits_obj)) return NULL;
    Py_buffer rows, bits;
    if (get_int64_buffer(rows_obj, &rows, 0, "rows") < 0) return NULL;
    if (PyObject_GetBuffer(bits_obj, &bits, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    const int64_t *r = rows.buf;
    uint8_t *b = bits.buf;
    const Py_ssize_t n = rows.len / 8;
    const uint64_t nbits = (uint64_t)bits.len * 8;
    Py_ssize_t i, repeat = -1, outside = -1;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        const uint64_t v = (uint64_t)r[i]; /* negative ids wrap to huge values: outside */
        if (v >= nbits) {
            outside = i;
            break;
        }
        const uint8_t mask = (uint8_t)(1u << (v & 7));
        if (b[v >> 3] & mask) {
            repeat = i;
            break;
        }
        b[v >> 3] |= mask;
    }
    /* Elements [0, i) set their bits (a repeat's bit was set by its first occurrence). */
    for (Py_ssize_t j = 0; j < i; j++) {
        const uint64_t v = (uint64_t)r[j];
        b[v >> 3] &= (uint8_t)~(1u << (v & 7));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&bits);
    if (outside >= 0) {
        PyErr_Format(PyExc_ValueError, "row %lld at position %zd is outside the bitmap of %llu rows",
                     (long long)r[outside], outside, (unsigned long long)nbits);
        return NULL;
    }
    return PyLong_FromSsize_t(repeat);
}

static PyMethodDef module_methods[] = {
    {"first_repeat", (PyCFunction)first_repeat, METH_VARARGS, first_repeat_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Fast int64 key -> dense row id hash index for the parameter server (see ps.index.KeyIndex\n"
"for the typed numpy wrapper). Blocking calls that release the GIL; not thread-safe.");

static struct PyModuleDef index_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ps._index",
    .m_doc = module_doc,
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__index(void) {
    if (PyType_Ready(&Int64IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&index_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Int64Index", (PyObject *)&Int64IndexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
