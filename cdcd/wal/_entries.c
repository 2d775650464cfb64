/* A DataRecord's entries checked and counted in place, without a Python object per entry.
 *
 * Input: the entries array of a DataRecord as msgspec encodes it (array-like structs):
 *     [entry, ...]
 *     entry   = [cache_id, op, key, value, partition, version, primary?, expire_time_ms?, ...]
 *     version = [order, node_order, cluster_id, topology_version, other?, ...]
 *     other   = nil | [order, node_order, cluster_id, topology_version, nil?, ...]
 *
 * check() accepts exactly what msgspec's decoder for tuple[DataEntry, ...] accepts (cdcd/wal/records.py):
 * arrays only (no maps), at least the fields without defaults, integers of any MessagePack width for int
 * fields (never a float or a bool), op one of Op's values, primary a bool, other_cluster_version nil or a
 * version whose own other_cluster_version is nil (CacheVersion.__post_init__), keys and values any one
 * MessagePack object, and trailing fields of any kind skipped (the schema only ever appends fields).
 * tests/test_wal_entries.py holds the two to each other on generated and mutated entries.
 *
 * Skipping is iterative (a count of objects still to skip), so no input nests the C stack; the caller
 * has decoded the record around the entries with msgspec already, which bounds the nesting it accepts.
 * Every read is bounds-checked; a refused input raises ValueError naming the entry and what was wrong.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
    Py_ssize_t entry;
} Rd;

static int bad(Rd *r, const char *what) {
    if (r->entry >= 0) {
        PyErr_Format(PyExc_ValueError, "entry %zd: %s", r->entry, what);
    } else {
        PyErr_Format(PyExc_ValueError, "entries: %s", what);
    }
    return -1;
}

static int need(Rd *r, size_t n) {
    if ((size_t)(r->end - r->p) < n) return bad(r, "truncated");
    return 0;
}

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* An array header; its length in *n. */
static int read_array(Rd *r, uint64_t *n, const char *what) {
    if (need(r, 1) < 0) return -1;
    uint8_t b = *r->p;
    if (b >= 0x90 && b <= 0x9f) {
        *n = b & 0x0f;
        r->p += 1;
        return 0;
    }
    if (b == 0xdc || b == 0xdd) {
        int w = b == 0xdc ? 2 : 4;
        if (need(r, 1 + (size_t)w) < 0) return -1;
        *n = be(r->p + 1, w);
        r->p += 1 + w;
        return 0;
    }
    return bad(r, what);
}

/* An integer of any width; *neg tells a negative one (its value in *v as int64), else *v is unsigned. */
static int read_int(Rd *r, uint64_t *v, int *neg, const char *what) {
    if (need(r, 1) < 0) return -1;
    uint8_t b = *r->p;
    *neg = 0;
    if (b <= 0x7f) {
        *v = b;
        r->p += 1;
        return 0;
    }
    if (b >= 0xe0) {
        *v = (uint64_t)(int64_t)(int8_t)b;
        *neg = 1;
        r->p += 1;
        return 0;
    }
    if (b >= 0xcc && b <= 0xcf) {
        int w = 1 << (b - 0xcc);
        if (need(r, 1 + (size_t)w) < 0) return -1;
        *v = be(r->p + 1, w);
        r->p += 1 + w;
        return 0;
    }
    if (b >= 0xd0 && b <= 0xd3) {
        int w = 1 << (b - 0xd0);
        if (need(r, 1 + (size_t)w) < 0) return -1;
        uint64_t u = be(r->p + 1, w);
        int64_t s;
        if (w == 1) s = (int8_t)u;
        else if (w == 2) s = (int16_t)u;
        else if (w == 4) s = (int32_t)u;
        else s = (int64_t)u;
        *v = (uint64_t)s;
        *neg = s < 0;
        r->p += 1 + w;
        return 0;
    }
    return bad(r, what);
}

/* n objects of any kind. */
static int skip(Rd *r, uint64_t n) {
    while (n > 0) {
        n--;
        if (need(r, 1) < 0) return -1;
        uint8_t b = *r->p++;
        uint64_t len = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;
        if (b >= 0x80 && b <= 0x8f) {
            n += 2 * (uint64_t)(b & 0x0f);
            continue;
        }
        if (b >= 0x90 && b <= 0x9f) {
            n += b & 0x0f;
            continue;
        }
        if (b >= 0xa0 && b <= 0xbf) {
            len = b & 0x1f;
        } else {
            switch (b) {
                case 0xc4: case 0xd9: case 0xc5: case 0xda: case 0xc6: case 0xdb: {
                    int w = (b == 0xc4 || b == 0xd9) ? 1 : (b == 0xc5 || b == 0xda) ? 2 : 4;
                    if (need(r, (size_t)w) < 0) return -1;
                    len = be(r->p, w);
                    r->p += w;
                    break;
                }
                case 0xc7: case 0xc8: case 0xc9: {
                    int w = b == 0xc7 ? 1 : b == 0xc8 ? 2 : 4;
                    if (need(r, (size_t)w) < 0) return -1;
                    len = be(r->p, w) + 1; /* and the type byte */
                    r->p += w;
                    break;
                }
                case 0xca: len = 4; break;
                case 0xcb: len = 8; break;
                case 0xcc: case 0xd0: len = 1; break;
                case 0xcd: case 0xd1: len = 2; break;
                case 0xce: case 0xd2: len = 4; break;
                case 0xcf: case 0xd3: len = 8; break;
                case 0xd4: len = 2; break;
                case 0xd5: len = 3; break;
                case 0xd6: len = 5; break;
                case 0xd7: len = 9; break;
                case 0xd8: len = 17; break;
                case 0xdc: case 0xdd: case 0xde: case 0xdf: {
                    int w = (b == 0xdc || b == 0xde) ? 2 : 4;
                    if (need(r, (size_t)w) < 0) return -1;
                    uint64_t k = be(r->p, w);
                    r->p += w;
                    n += (b >= 0xde) ? 2 * k : k;
                    continue;
                }
                default:
                    return bad(r, "not MessagePack (byte 0xc1)");
            }
        }
        if ((uint64_t)(r->end - r->p) < len) return bad(r, "truncated");
        r->p += len;
    }
    return 0;
}

static int read_ints(Rd *r, int n, const char *what) {
    uint64_t v;
    int neg;
    for (int i = 0; i < n; i++) {
        if (read_int(r, &v, &neg, what) < 0) return -1;
    }
    return 0;
}

static int read_version(Rd *r) {
    uint64_t n;
    if (read_array(r, &n, "version is not an array") < 0) return -1;
    if (n < 4) return bad(r, "version has fewer than 4 fields");
    if (read_ints(r, 4, "version field is not an integer") < 0) return -1;
    if (n >= 5) {
        if (need(r, 1) < 0) return -1;
        if (*r->p == 0xc0) {
            r->p++;
        } else {
            uint64_t k;
            if (read_array(r, &k, "other_cluster_version is neither nil nor an array") < 0) return -1;
            if (k < 4) return bad(r, "other_cluster_version has fewer than 4 fields");
            if (read_ints(r, 4, "other_cluster_version field is not an integer") < 0) return -1;
            if (k >= 5) {
                if (need(r, 1) < 0) return -1;
                if (*r->p != 0xc0) return bad(r, "other_cluster_version nests another cluster's version (at most one level)");
                r->p++;
                if (skip(r, k - 5) < 0) return -1;
            }
        }
        if (skip(r, n - 5) < 0) return -1;
    }
    return 0;
}

/* One entry; its cache id and op in *cache_id (as the bytes' value), *neg and *op. */
static int read_entry(Rd *r, uint64_t *cache_id, int *neg, int *op) {
    uint64_t n, v;
    int vneg;
    if (read_array(r, &n, "not an array") < 0) return -1;
    if (n < 6) return bad(r, "fewer than 6 fields");
    if (read_int(r, cache_id, neg, "cache_id is not an integer") < 0) return -1;
    if (read_int(r, &v, &vneg, "op is not an integer") < 0) return -1;
    if (vneg || v > 2) return bad(r, "op is not 0, 1 or 2");
    *op = (int)v;
    if (skip(r, 2) < 0) return -1; /* key, value */
    if (read_int(r, &v, &vneg, "partition is not an integer") < 0) return -1;
    if (read_version(r) < 0) return -1;
    if (n >= 7) {
        if (need(r, 1) < 0) return -1;
        if (*r->p != 0xc2 && *r->p != 0xc3) return bad(r, "primary is not a bool");
        r->p++;
    }
    if (n >= 8) {
        if (read_int(r, &v, &vneg, "expire_time_ms is not an integer") < 0) return -1;
        if (skip(r, n - 8) < 0) return -1;
    }
    return 0;
}

PyDoc_STRVAR(check_doc,
             "check(entries) -> int\n\n"
             "The number of entries in a DataRecord's entries array (MessagePack), after checking each as\n"
             "msgspec decodes a DataEntry; ValueError naming the entry if one is refused.");

static PyObject *check(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer in;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0) return NULL;
    Rd r = {in.buf, (const uint8_t *)in.buf + in.len, -1};
    uint64_t n, cache_id;
    int neg, op;
    PyObject *result = NULL;
    if (read_array(&r, &n, "not an array") == 0) {
        uint64_t i = 0;
        for (; i < n; i++) {
            r.entry = (Py_ssize_t)i;
            if (read_entry(&r, &cache_id, &neg, &op) < 0) break;
        }
        if (i == n) {
            r.entry = -1;
            if (r.p != r.end) {
                bad(&r, "trailing bytes after the last entry");
            } else {
                result = PyLong_FromUnsignedLongLong(n);
            }
        }
    }
    PyBuffer_Release(&in);
    return result;
}

static PyObject *as_long(uint64_t v, int neg) {
    return neg ? PyLong_FromLongLong((long long)(int64_t)v) : PyLong_FromUnsignedLongLong(v);
}

/* counts[(cache_id, op)] += n */
static int add_count(PyObject *counts, uint64_t cache_id, int neg, int op, Py_ssize_t n) {
    PyObject *key = Py_BuildValue("(Ni)", as_long(cache_id, neg), op);
    if (key == NULL) return -1;
    PyObject *old = PyDict_GetItemWithError(counts, key);
    if (old == NULL && PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    PyObject *sum = PyLong_FromSsize_t((old == NULL ? 0 : PyLong_AsSsize_t(old)) + n);
    int rc = sum == NULL ? -1 : PyDict_SetItem(counts, key, sum);
    Py_XDECREF(sum);
    Py_DECREF(key);
    return rc;
}

PyDoc_STRVAR(count_ops_doc,
             "count_ops(entries, start, stop, counts) -> None\n\n"
             "Adds the entries start..stop (stop -1: to the end) of a checked entries array to counts,\n"
             "a dict of (cache_id, op) -> number of entries.");

static PyObject *count_ops(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer in;
    Py_ssize_t start, stop;
    PyObject *counts;
    if (!PyArg_ParseTuple(args, "y*nnO!:count_ops", &in, &start, &stop, &PyDict_Type, &counts)) return NULL;
    Rd r = {in.buf, (const uint8_t *)in.buf + in.len, -1};
    uint64_t n, cache_id = 0, run_id = 0;
    int neg = 0, op = 0, run_neg = 0, run_op = -1;
    Py_ssize_t run = 0;
    PyObject *result = NULL;
    if (read_array(&r, &n, "not an array") < 0) goto done;
    if (stop < 0 || (uint64_t)stop > n) stop = (Py_ssize_t)n;
    for (Py_ssize_t i = 0; i < stop; i++) {
        r.entry = i;
        if (read_entry(&r, &cache_id, &neg, &op) < 0) goto done;
        if (i < start) continue;
        if (run && (cache_id != run_id || neg != run_neg || op != run_op)) {
            if (add_count(counts, run_id, run_neg, run_op, run) < 0) goto done;
            run = 0;
        }
        run_id = cache_id;
        run_neg = neg;
        run_op = op;
        run++;
    }
    if (run && add_count(counts, run_id, run_neg, run_op, run) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&in);
    return result;
}

static PyMethodDef methods[] = {
    {"check", check, METH_O, check_doc},
    {"count_ops", count_ops, METH_VARARGS, count_ops_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cdcd.wal._entries", "DataRecord entries checked and counted without decoding them.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__entries(void) { return PyModule_Create(&module); }
