/* The lake's change rows as column buffers, straight from MessagePack records.
 *
 * Input: what cdcd.lake.landing.arrow.pack() writes, a MessagePack array of record slices, each
 *     [segment, offset, start, stop | nil, record]
 * where record is a DataRecord as msgspec encodes it (array-like, tag first):
 *     [1, [entry, ...], commit_ts_ns, ...]
 *     entry   = [cache_id, op, key, value, partition, version, primary, expire_time_ms, ...]
 *     version = [order, node_order, cluster_id, topology_version, ...]
 * Fields past the ones read are skipped: the record schema only ever appends fields.
 *
 * Output: one buffer per column (native-endian fixed-width values, and for keys and values Arrow's
 * string layout: int32 offsets plus UTF-8 data), which cdcd/lake/landing/arrow.py wraps as Arrow arrays.
 *
 * Keys and values become JSON text here without a Python object in between. The text must be
 * byte for byte what the Python path writes: for values cdcd.lake.landing.jsontext.to_json_bytes (msgspec
 * decode, msgspec JSON encode, and a careful fallback for map keys JSON cannot hold), for keys
 * key_json_bytes (the same text, except that binary, NaN and the infinities, and maps whose keys
 * are not plain strings become {"$binary": ...}-style tags, so that no two keys share a text). This
 * covers the common cases exactly (nil, bools, integers, floats, UTF-8 strings, binary, arrays,
 * maps with distinct string keys, in a key none starting with '$') and hands every other object
 * (extension types, non-string, '$' or repeated map keys in a key, invalid UTF-8, nesting past
 * MAX_DEPTH, a non-finite float32 in a key) to that Python function, so the paths cannot disagree.
 * Tests compare both on generated values.
 *
 * The input is the output of cdcd's own encoder, but key and value bytes come from WAL files:
 * every read is bounds-checked, and a malformed input raises ValueError naming the byte offset.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64
#define FALLBACK 1
#define YIELD_ROWS 8192

/* ---- growable output buffers ---------------------------------------------------------------- */

/* A bytes object being filled, returned as it is at the end (no copy). */
typedef struct {
    char *data;
    size_t len;
    size_t cap;
    PyObject *bytes;
} Buf;

static int buf_init(Buf *b, size_t cap) {
    b->bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(cap ? cap : 64));
    if (b->bytes == NULL) return -1;
    b->data = PyBytes_AS_STRING(b->bytes);
    b->cap = (size_t)PyBytes_GET_SIZE(b->bytes);
    b->len = 0;
    return 0;
}

static int buf_grow(Buf *b, size_t extra) {
    size_t need = b->len + extra;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) {
        if (cap > ((size_t)PY_SSIZE_T_MAX) / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    if (_PyBytes_Resize(&b->bytes, (Py_ssize_t)cap) < 0) return -1;
    b->data = PyBytes_AS_STRING(b->bytes);
    b->cap = cap;
    return 0;
}

/* The filled bytes object (the Buf gives it up). */
static PyObject *buf_finish(Buf *b) {
    if (_PyBytes_Resize(&b->bytes, (Py_ssize_t)b->len) < 0) return NULL;
    PyObject *out = b->bytes;
    b->bytes = NULL;
    b->data = NULL;
    return out;
}

static inline int buf_put(Buf *b, const void *src, size_t n) {
    if (b->cap - b->len < n && buf_grow(b, n) < 0) return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static inline int buf_byte(Buf *b, char c) {
    if (b->len == b->cap && buf_grow(b, 1) < 0) return -1;
    b->data[b->len++] = c;
    return 0;
}

#define PUT_LIT(b, s) buf_put((b), (s), sizeof(s) - 1)

static inline int put_i64(Buf *b, int64_t v) { return buf_put(b, &v, sizeof v); }
static inline int put_i32(Buf *b, int32_t v) { return buf_put(b, &v, sizeof v); }
static inline int put_i8(Buf *b, int8_t v) { return buf_put(b, &v, sizeof v); }

/* ---- reading MessagePack ---------------------------------------------------------------------- */

typedef struct {
    const uint8_t *start;
    const uint8_t *p;
    const uint8_t *end;
} Rd;

static int bad(const Rd *r, const char *what) {
    PyErr_Format(PyExc_ValueError, "packed lake rows at byte %zd: %s", (Py_ssize_t)(r->p - r->start), what);
    return -1;
}

static inline int need(const Rd *r, size_t n) {
    if ((size_t)(r->end - r->p) < n) return bad(r, "truncated");
    return 0;
}

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

static int read_int(Rd *r, int64_t *out, const char *what) {
    if (need(r, 1) < 0) return -1;
    uint8_t b = *r->p;
    if (b <= 0x7f || b >= 0xe0) {
        *out = (int8_t)b;
        if (b <= 0x7f) *out = b;
        r->p += 1;
        return 0;
    }
    size_t size;
    switch (b) {
        case 0xcc: case 0xd0: size = 1; break;
        case 0xcd: case 0xd1: size = 2; break;
        case 0xce: case 0xd2: size = 4; break;
        case 0xcf: case 0xd3: size = 8; break;
        default: return bad(r, what);
    }
    if (need(r, 1 + size) < 0) return -1;
    const uint8_t *q = r->p + 1;
    switch (b) {
        case 0xcc: *out = q[0]; break;
        case 0xcd: *out = be16(q); break;
        case 0xce: *out = be32(q); break;
        case 0xcf: {
            uint64_t u = be64(q);
            if (u > (uint64_t)INT64_MAX) return bad(r, "integer out of the int64 range");
            *out = (int64_t)u;
            break;
        }
        case 0xd0: *out = (int8_t)q[0]; break;
        case 0xd1: *out = (int16_t)be16(q); break;
        case 0xd2: *out = (int32_t)be32(q); break;
        default: *out = (int64_t)be64(q); break;
    }
    r->p += 1 + size;
    return 0;
}

static int read_i32(Rd *r, int32_t *out, const char *what) {
    int64_t v;
    if (read_int(r, &v, what) < 0) return -1;
    if (v < INT32_MIN || v > INT32_MAX) return bad(r, "integer out of the int32 range");
    *out = (int32_t)v;
    return 0;
}

static int read_array(Rd *r, uint32_t *n, const char *what) {
    if (need(r, 1) < 0) return -1;
    uint8_t b = *r->p;
    if (b >= 0x90 && b <= 0x9f) {
        *n = b & 0x0f;
        r->p += 1;
        return 0;
    }
    if (b == 0xdc) {
        if (need(r, 3) < 0) return -1;
        *n = be16(r->p + 1);
        r->p += 3;
        return 0;
    }
    if (b == 0xdd) {
        if (need(r, 5) < 0) return -1;
        *n = be32(r->p + 1);
        r->p += 5;
        return 0;
    }
    return bad(r, what);
}

static int read_bool(Rd *r, int *out, const char *what) {
    if (need(r, 1) < 0) return -1;
    if (*r->p == 0xc2 || *r->p == 0xc3) {
        *out = *r->p == 0xc3;
        r->p += 1;
        return 0;
    }
    return bad(r, what);
}

/* Past one object of any kind (iteratively: nesting costs no stack). */
static int skip(Rd *r) {
    uint64_t remaining = 1;
    while (remaining) {
        remaining--;
        if (need(r, 1) < 0) return -1;
        uint8_t b = *r->p++;
        size_t len = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;
        if (b >= 0xa0 && b <= 0xbf) {
            len = b & 0x1f;
        } else if (b >= 0x90 && b <= 0x9f) {
            remaining += b & 0x0f;
            continue;
        } else if (b >= 0x80 && b <= 0x8f) {
            remaining += 2u * (b & 0x0f);
            continue;
        } else {
            switch (b) {
                case 0xcc: case 0xd0: len = 1; break;
                case 0xcd: case 0xd1: len = 2; break;
                case 0xce: case 0xd2: case 0xca: len = 4; break;
                case 0xcf: case 0xd3: case 0xcb: len = 8; break;
                case 0xd4: len = 2; break;
                case 0xd5: len = 3; break;
                case 0xd6: len = 5; break;
                case 0xd7: len = 9; break;
                case 0xd8: len = 17; break;
                case 0xc4: case 0xd9: if (need(r, 1) < 0) return -1; len = r->p[0]; r->p += 1; break;
                case 0xc5: case 0xda: if (need(r, 2) < 0) return -1; len = be16(r->p); r->p += 2; break;
                case 0xc6: case 0xdb: if (need(r, 4) < 0) return -1; len = be32(r->p); r->p += 4; break;
                case 0xc7: if (need(r, 1) < 0) return -1; len = 1 + (size_t)r->p[0]; r->p += 1; break;
                case 0xc8: if (need(r, 2) < 0) return -1; len = 1 + (size_t)be16(r->p); r->p += 2; break;
                case 0xc9: if (need(r, 4) < 0) return -1; len = 1 + (size_t)be32(r->p); r->p += 4; break;
                case 0xdc: if (need(r, 2) < 0) return -1; remaining += be16(r->p); r->p += 2; continue;
                case 0xdd: if (need(r, 4) < 0) return -1; remaining += be32(r->p); r->p += 4; continue;
                case 0xde: if (need(r, 2) < 0) return -1; remaining += 2u * be16(r->p); r->p += 2; continue;
                case 0xdf: if (need(r, 4) < 0) return -1; remaining += 2u * (uint64_t)be32(r->p); r->p += 4; continue;
                default: r->p--; return bad(r, "invalid MessagePack type byte 0xc1");
            }
        }
        if (need(r, len) < 0) return -1;
        r->p += len;
    }
    return 0;
}

/* ---- JSON text ------------------------------------------------------------------------------- */

static int put_u64_text(Buf *o, uint64_t v) {
    char tmp[24];
    int i = sizeof tmp;
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return buf_put(o, tmp + i, sizeof tmp - i);
}

static int put_i64_text(Buf *o, int64_t v) {
    if (v >= 0) return put_u64_text(o, (uint64_t)v);
    if (buf_byte(o, '-') < 0) return -1;
    return put_u64_text(o, (uint64_t)0 - (uint64_t)v);
}

static const uint64_t POW10[] = {1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull,
                                 100000000ull, 1000000000ull, 10000000000ull};
static const uint64_t POW5[] = {1ull, 5ull, 25ull, 125ull, 625ull, 3125ull, 15625ull, 78125ull, 390625ull, 1953125ull,
                                9765625ull};

/* The common doubles without dtoa: x = m * 2^-n (m odd, n <= 10, |x| < 2^53) whose spacing to its
 * neighbours is under 10^-n. Its exact decimal expansion has n decimals, the last one a 5, so every
 * text with fewer decimals is at least 5 * 10^-n away from x, more than half the spacing: it reads
 * back as another double. The exact expansion is then what repr's shortest-digits search finds.
 * Integers below 2^53 likewise. Returns 1 if written (rc: the write's result), 0 if x is not such
 * a number. */
static int put_double_fast(Buf *o, double x, int *rc) {
    double ax = fabs(x);
    if (!(ax < 9007199254740992.0)) return 0;
    const char *sign = signbit(x) ? "-" : "";
    if (ax == 0.0) {
        *rc = buf_put(o, signbit(x) ? "-0.0" : "0.0", signbit(x) ? 4 : 3);
        return 1;
    }
    int exp2;
    double fr = frexp(ax, &exp2);
    uint64_t mant = (uint64_t)ldexp(fr, 53);
    int e = exp2 - 53;
    int tz = __builtin_ctzll(mant);
    mant >>= tz;
    e += tz;
    char tmp[48];
    int len;
    if (e >= 0) {
        len = snprintf(tmp, sizeof tmp, "%s%llu.0", sign, (unsigned long long)(mant << e));
    } else {
        int n = -e;
        if (n > 10) return 0;
        if (!(ldexp((double)POW10[n], exp2 - 53) < 1.0)) return 0;
        if (mant > UINT64_MAX / POW5[n]) return 0;
        uint64_t scaled = mant * POW5[n];
        len = snprintf(tmp, sizeof tmp, "%s%llu.%0*llu", sign, (unsigned long long)(scaled / POW10[n]), n,
                       (unsigned long long)(scaled % POW10[n]));
    }
    *rc = buf_put(o, tmp, (size_t)len);
    return 1;
}

/* A double as msgspec's JSON encoder writes it: the shortest repr digits, "1e16" / "1e-7" style
 * exponents (no '+', no leading zeros), non-finite as null, and - unlike repr - a decimal point
 * position of -4 written out ("0.00001", where repr says "1e-05"). */
static int put_double_text(Buf *o, double x) {
    if (!isfinite(x)) return PUT_LIT(o, "null");
    int rc;
    if (put_double_fast(o, x, &rc)) return rc;
    char *s = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (s == NULL) return -1;
    char *e = strchr(s, 'e');
    if (e == NULL) {
        rc = buf_put(o, s, strlen(s));
    } else {
        long exp = strtol(e + 1, NULL, 10);
        char *m = s;
        rc = 0;
        if (exp == -5) {
            if (*m == '-') {
                rc = buf_byte(o, '-');
                m++;
            }
            if (rc == 0) rc = PUT_LIT(o, "0.0000");
            for (char *c = m; rc == 0 && c < e; c++) {
                if (*c != '.') rc = buf_byte(o, *c);
            }
        } else {
            rc = buf_put(o, s, (size_t)(e - s));
            if (rc == 0) rc = buf_byte(o, 'e');
            if (rc == 0) rc = put_i64_text(o, exp);
        }
    }
    PyMem_Free(s);
    return rc;
}

static const char HEX[] = "0123456789abcdef";

/* Length of the valid UTF-8 sequence at p (strict, as Python's decoder: no overlongs, no
 * surrogates, nothing past U+10FFFF), or 0. */
static inline size_t utf8_seq(const uint8_t *p, const uint8_t *end) {
    uint8_t c = p[0];
    size_t avail = (size_t)(end - p);
    if (c >= 0xc2 && c <= 0xdf) {
        return (avail >= 2 && (p[1] & 0xc0) == 0x80) ? 2 : 0;
    }
    if (c >= 0xe0 && c <= 0xef) {
        if (avail < 3 || (p[1] & 0xc0) != 0x80 || (p[2] & 0xc0) != 0x80) return 0;
        if (c == 0xe0 && p[1] < 0xa0) return 0;
        if (c == 0xed && p[1] > 0x9f) return 0;
        return 3;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        if (avail < 4 || (p[1] & 0xc0) != 0x80 || (p[2] & 0xc0) != 0x80 || (p[3] & 0xc0) != 0x80) return 0;
        if (c == 0xf0 && p[1] < 0x90) return 0;
        if (c == 0xf4 && p[1] > 0x8f) return 0;
        return 4;
    }
    return 0;
}

/* Whether any of 8 bytes is < 0x20, '"', '\\' or >= 0x80 (false alarms possible, no misses). */
static inline int needs_care(uint64_t v) {
    const uint64_t ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
    uint64_t q = v ^ (ones * '"'), b = v ^ (ones * '\\');
    return ((v | ((v - ones * 0x20) & ~v) | ((q - ones) & ~q) | ((b - ones) & ~b)) & high) != 0;
}

/* A string's bytes as a JSON string; FALLBACK if they are not valid UTF-8. */
static int put_string(Buf *o, const uint8_t *s, size_t n) {
    if (buf_grow(o, n + 2) < 0) return -1;
    o->data[o->len++] = '"';
    const uint8_t *end = s + n;
    const uint8_t *run = s;
    const uint8_t *p = s;
    while (p < end) {
        if (end - p >= 8) {
            uint64_t v;
            memcpy(&v, p, 8);
            if (!needs_care(v)) {
                p += 8;
                continue;
            }
        }
        uint8_t c = *p;
        if (c >= 0x80) {
            size_t k = utf8_seq(p, end);
            if (k == 0) return FALLBACK;
            p += k;
            continue;
        }
        if (c >= 0x20 && c != '"' && c != '\\') {
            p++;
            continue;
        }
        if (buf_put(o, run, (size_t)(p - run)) < 0) return -1;
        char esc[6] = {'\\', 0, 0, 0, 0, 0};
        size_t k = 2;
        switch (c) {
            case '"': esc[1] = '"'; break;
            case '\\': esc[1] = '\\'; break;
            case '\b': esc[1] = 'b'; break;
            case '\t': esc[1] = 't'; break;
            case '\n': esc[1] = 'n'; break;
            case '\f': esc[1] = 'f'; break;
            case '\r': esc[1] = 'r'; break;
            default:
                esc[1] = 'u';
                esc[2] = '0';
                esc[3] = '0';
                esc[4] = HEX[c >> 4];
                esc[5] = HEX[c & 0xf];
                k = 6;
        }
        if (buf_put(o, esc, k) < 0) return -1;
        run = ++p;
    }
    if (buf_put(o, run, (size_t)(end - run)) < 0) return -1;
    return buf_byte(o, '"');
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int put_base64(Buf *o, const uint8_t *s, size_t n) {
    if (buf_grow(o, 4 * ((n + 2) / 3) + 2) < 0) return -1;
    char *w = o->data + o->len;
    *w++ = '"';
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = ((uint32_t)s[i] << 16) | ((uint32_t)s[i + 1] << 8) | s[i + 2];
        *w++ = B64[v >> 18];
        *w++ = B64[(v >> 12) & 63];
        *w++ = B64[(v >> 6) & 63];
        *w++ = B64[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        *w++ = B64[v >> 18];
        *w++ = B64[(v >> 12) & 63];
        *w++ = '=';
        *w++ = '=';
    } else if (n - i == 2) {
        uint32_t v = ((uint32_t)s[i] << 16) | ((uint32_t)s[i + 1] << 8);
        *w++ = B64[v >> 18];
        *w++ = B64[(v >> 12) & 63];
        *w++ = B64[(v >> 6) & 63];
        *w++ = '=';
    }
    *w++ = '"';
    o->len = (size_t)(w - o->data);
    return 0;
}

typedef struct {
    const uint8_t *p;
    size_t n;
} Span;

static int span_cmp(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->n != y->n) return x->n < y->n ? -1 : 1;
    return memcmp(x->p, y->p, x->n);
}

/* The length of a string header at r (advancing past it), or -2 if r is not at a string. */
static int64_t str_len(Rd *r) {
    if (need(r, 1) < 0) return -1;
    uint8_t b = *r->p;
    size_t h;
    uint64_t n;
    if (b >= 0xa0 && b <= 0xbf) {
        h = 1;
        n = b & 0x1f;
    } else if (b == 0xd9) {
        if (need(r, 2) < 0) return -1;
        h = 2;
        n = r->p[1];
    } else if (b == 0xda) {
        if (need(r, 3) < 0) return -1;
        h = 3;
        n = be16(r->p + 1);
    } else if (b == 0xdb) {
        if (need(r, 5) < 0) return -1;
        h = 5;
        n = be32(r->p + 1);
    } else {
        return -2;
    }
    r->p += h;
    if (need(r, n) < 0) return -1;
    return (int64_t)n;
}

static int transcode(Rd *r, Buf *o, int depth, int key);

static int put_array(Rd *r, Buf *o, uint64_t n, int depth, int key) {
    if (buf_byte(o, '[') < 0) return -1;
    for (uint64_t i = 0; i < n; i++) {
        if (i && buf_byte(o, ',') < 0) return -1;
        int rc = transcode(r, o, depth + 1, key);
        if (rc) return rc;
    }
    return buf_byte(o, ']');
}

/* A map with string keys only, none repeated (msgspec keeps the last of repeated keys at the
 * first one's place; non-string keys have their own rules), and in a key none starting with '$' (a
 * key's map of such keys is written as {"$map": ...}): anything else is FALLBACK. */
static int put_map(Rd *r, Buf *o, uint64_t n, int depth, int key) {
    Span small[16];
    Span *keys = small;
    int rc = 0;
    if (n > 16) {
        if (n > (uint64_t)(r->end - r->p)) return bad(r, "truncated");
        keys = PyMem_Malloc(sizeof(Span) * n);
        if (keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (buf_byte(o, '{') < 0) {
        rc = -1;
        goto done;
    }
    for (uint64_t i = 0; i < n; i++) {
        int64_t len = str_len(r);
        if (len == -1) {
            rc = -1;
            goto done;
        }
        if (len == -2) {
            rc = FALLBACK;
            goto done;
        }
        if (key && len > 0 && r->p[0] == '$') {
            rc = FALLBACK;
            goto done;
        }
        keys[i].p = r->p;
        keys[i].n = (size_t)len;
        if ((i && buf_byte(o, ',') < 0) || (rc = put_string(o, r->p, (size_t)len)) != 0 || buf_byte(o, ':') < 0) {
            if (rc == 0) rc = -1;
            goto done;
        }
        r->p += len;
        if ((rc = transcode(r, o, depth + 1, key)) != 0) goto done;
    }
    if (buf_byte(o, '}') < 0) {
        rc = -1;
        goto done;
    }
    if (n <= 16) {
        for (uint64_t i = 1; i < n && rc == 0; i++) {
            for (uint64_t j = 0; j < i; j++) {
                if (keys[i].n == keys[j].n && memcmp(keys[i].p, keys[j].p, keys[i].n) == 0) {
                    rc = FALLBACK;
                    break;
                }
            }
        }
    } else {
        qsort(keys, n, sizeof(Span), span_cmp);
        for (uint64_t i = 1; i < n; i++) {
            if (span_cmp(&keys[i - 1], &keys[i]) == 0) {
                rc = FALLBACK;
                break;
            }
        }
    }
done:
    if (keys != small) PyMem_Free(keys);
    return rc;
}

/* A non-finite double in a key (cdcd.lake.landing.jsontext.key_json_bytes): a tag no plain key text is. */
static int put_float_tag(Buf *o, uint64_t bits) {
    if ((bits & 0x000fffffffffffffull) == 0) {
        return bits >> 63 ? PUT_LIT(o, "{\"$float\":\"-Infinity\"}") : PUT_LIT(o, "{\"$float\":\"Infinity\"}");
    }
    if (bits == 0x7ff8000000000000ull) return PUT_LIT(o, "{\"$float\":\"NaN\"}");
    char tmp[48];
    int len = snprintf(tmp, sizeof tmp, "{\"$float\":\"NaN:%016llx\"}", (unsigned long long)bits);
    return buf_put(o, tmp, (size_t)len);
}

/* One MessagePack object at r as JSON text appended to o: 0, FALLBACK (o holds partial text the
 * caller discards), or -1 with an exception set. `key`: written as a key (key_json_bytes), where
 * binary, non-finite floats and maps with '$' keys differ from a value's text. */
static int transcode(Rd *r, Buf *o, int depth, int key) {
    if (depth > MAX_DEPTH) return FALLBACK;
    if (need(r, 1) < 0) return -1;
    uint8_t b = *r->p;
    if (b <= 0x7f) {
        r->p++;
        return put_u64_text(o, b);
    }
    if (b >= 0xe0) {
        r->p++;
        return put_i64_text(o, (int8_t)b);
    }
    if ((b >= 0xa0 && b <= 0xbf) || b == 0xd9 || b == 0xda || b == 0xdb) {
        int64_t len = str_len(r);
        if (len < 0) return -1;
        const uint8_t *s = r->p;
        r->p += len;
        return put_string(o, s, (size_t)len);
    }
    if (b >= 0x90 && b <= 0x9f) {
        r->p++;
        return put_array(r, o, b & 0x0f, depth, key);
    }
    if (b >= 0x80 && b <= 0x8f) {
        r->p++;
        return put_map(r, o, b & 0x0f, depth, key);
    }
    const uint8_t *q = r->p + 1;
    switch (b) {
        case 0xc0: r->p++; return PUT_LIT(o, "null");
        case 0xc2: r->p++; return PUT_LIT(o, "false");
        case 0xc3: r->p++; return PUT_LIT(o, "true");
        case 0xc4: case 0xc5: case 0xc6: {
            size_t h = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
            if (need(r, 1 + h) < 0) return -1;
            size_t n = h == 1 ? q[0] : h == 2 ? be16(q) : be32(q);
            r->p += 1 + h;
            if (need(r, n) < 0) return -1;
            const uint8_t *s = r->p;
            r->p += n;
            if (!key) return put_base64(o, s, n);
            if (PUT_LIT(o, "{\"$binary\":") < 0 || put_base64(o, s, n) < 0) return -1;
            return buf_byte(o, '}');
        }
        case 0xca: {
            if (need(r, 5) < 0) return -1;
            uint32_t bits = be32(q);
            float f;
            memcpy(&f, &bits, sizeof f);
            if (key && !isfinite(f)) return FALLBACK; /* the node writes doubles only: Python says */
            r->p += 5;
            return put_double_text(o, (double)f);
        }
        case 0xcb: {
            if (need(r, 9) < 0) return -1;
            uint64_t bits = be64(q);
            double d;
            memcpy(&d, &bits, sizeof d);
            r->p += 9;
            if (key && !isfinite(d)) return put_float_tag(o, bits);
            return put_double_text(o, d);
        }
        case 0xcc: case 0xcd: case 0xce: case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
            int64_t v;
            if (read_int(r, &v, "integer") < 0) return -1;
            return put_i64_text(o, v);
        }
        case 0xcf: {
            if (need(r, 9) < 0) return -1;
            r->p += 9;
            return put_u64_text(o, be64(q));
        }
        case 0xdc: case 0xdd: {
            uint32_t n;
            if (read_array(r, &n, "array") < 0) return -1;
            return put_array(r, o, n, depth, key);
        }
        case 0xde: {
            if (need(r, 3) < 0) return -1;
            r->p += 3;
            return put_map(r, o, be16(q), depth, key);
        }
        case 0xdf: {
            if (need(r, 5) < 0) return -1;
            r->p += 5;
            return put_map(r, o, be32(q), depth, key);
        }
        default:
            return FALLBACK; /* extension types, and 0xc1 (which the fallback reports) */
    }
}

/* The object at r (a key if `key`, else a value) as JSON text appended to o, through `fallback` (a
 * Python callable: MessagePack bytes -> JSON bytes) when transcode cannot write it exactly. */
static int put_json(Rd *r, Buf *o, PyObject *fallback, int key) {
    const uint8_t *begin = r->p;
    size_t mark = o->len;
    int rc = transcode(r, o, 0, key);
    if (rc <= 0) return rc;
    o->len = mark;
    r->p = begin;
    if (skip(r) < 0) return -1;
    PyObject *raw = PyBytes_FromStringAndSize((const char *)begin, r->p - begin);
    if (raw == NULL) return -1;
    PyObject *text = PyObject_CallOneArg(fallback, raw);
    Py_DECREF(raw);
    if (text == NULL) return -1;
    if (!PyBytes_Check(text)) {
        Py_DECREF(text);
        PyErr_SetString(PyExc_TypeError, "the JSON fallback must return bytes");
        return -1;
    }
    rc = buf_put(o, PyBytes_AS_STRING(text), (size_t)PyBytes_GET_SIZE(text));
    Py_DECREF(text);
    return rc;
}

/* ---- records to columns ---------------------------------------------------------------------- */

enum {
    C_OP, C_PARTITION, C_PRIMARY, C_ORDER, C_NODE_ORDER, C_CLUSTER, C_TOPOLOGY, C_EXPIRE,
    C_CACHE, C_SEGMENT, C_OFFSET, C_INDEX, C_COMMIT_NS,
    C_KEY_OFFSETS, C_KEYS, C_VALUE_OFFSETS, C_VALUES,
    N_COLUMNS
};

static int skip_n(Rd *r, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        if (skip(r) < 0) return -1;
    }
    return 0;
}

static int text_offset(Rd *r, Buf *offsets, const Buf *data) {
    if (data->len > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "%zu bytes of JSON in one batch: over Arrow's 2 GiB limit, lower batch_max_bytes", data->len);
        (void)r;
        return -1;
    }
    return put_i32(offsets, (int32_t)data->len);
}

static int entry_row(Rd *r, Buf *c, PyObject *fallback, PyObject *key_fallback, int64_t segment, int64_t offset,
                     int32_t index) {
    uint32_t fields;
    int64_t cache_id, op, order, topology, expire;
    int32_t partition, node_order, cluster;
    int primary;
    if (read_array(r, &fields, "entry is not an array") < 0) return -1;
    if (fields < 8) return bad(r, "entry has fewer than 8 fields");
    if (read_int(r, &cache_id, "entry cache_id is not an integer") < 0) return -1;
    if (read_int(r, &op, "entry op is not an integer") < 0) return -1;
    if (op < 0 || op > 2) return bad(r, "entry op is not 0, 1 or 2");
    if (put_json(r, &c[C_KEYS], key_fallback, 1) < 0) return -1;
    if (op == 2) {
        if (skip(r) < 0) return -1; /* a DELETE's value is null */
    } else if (put_json(r, &c[C_VALUES], fallback, 0) < 0) {
        return -1;
    }
    if (read_i32(r, &partition, "entry partition is not an integer") < 0) return -1;
    uint32_t vfields;
    if (read_array(r, &vfields, "entry version is not an array") < 0) return -1;
    if (vfields < 4) return bad(r, "version has fewer than 4 fields");
    if (read_int(r, &order, "version order is not an integer") < 0) return -1;
    if (read_i32(r, &node_order, "version node_order is not an integer") < 0) return -1;
    if (read_i32(r, &cluster, "version cluster_id is not an integer") < 0) return -1;
    if (read_int(r, &topology, "version topology_version is not an integer") < 0) return -1;
    if (skip_n(r, vfields - 4) < 0) return -1;
    if (read_bool(r, &primary, "entry primary is not a bool") < 0) return -1;
    if (read_int(r, &expire, "entry expire_time_ms is not an integer") < 0) return -1;
    if (skip_n(r, fields - 8) < 0) return -1;
    if (put_i8(&c[C_OP], (int8_t)op) < 0 || put_i32(&c[C_PARTITION], partition) < 0 ||
        put_i8(&c[C_PRIMARY], (int8_t)primary) < 0 || put_i64(&c[C_ORDER], order) < 0 ||
        put_i32(&c[C_NODE_ORDER], node_order) < 0 || put_i32(&c[C_CLUSTER], cluster) < 0 ||
        put_i64(&c[C_TOPOLOGY], topology) < 0 || put_i64(&c[C_EXPIRE], expire) < 0 ||
        put_i64(&c[C_CACHE], cache_id) < 0 || put_i64(&c[C_SEGMENT], segment) < 0 ||
        put_i64(&c[C_OFFSET], offset) < 0 || put_i32(&c[C_INDEX], index) < 0 ||
        put_i64(&c[C_COMMIT_NS], 0) < 0 || text_offset(r, &c[C_KEY_OFFSETS], &c[C_KEYS]) < 0 ||
        text_offset(r, &c[C_VALUE_OFFSETS], &c[C_VALUES]) < 0) {
        return -1;
    }
    return 0;
}

static int slice_rows(Rd *r, Buf *c, PyObject *fallback, PyObject *key_fallback, Py_ssize_t *rows) {
    uint32_t fields, rfields, entries;
    int64_t segment, offset, start, stop, tag, commit_ns;
    if (read_array(r, &fields, "slice is not an array") < 0) return -1;
    if (fields < 5) return bad(r, "slice has fewer than 5 fields");
    if (read_int(r, &segment, "slice segment is not an integer") < 0) return -1;
    if (read_int(r, &offset, "slice offset is not an integer") < 0) return -1;
    if (read_int(r, &start, "slice start is not an integer") < 0) return -1;
    if (need(r, 1) < 0) return -1;
    int open_end = *r->p == 0xc0;
    stop = 0;
    if (open_end) {
        r->p++;
    } else if (read_int(r, &stop, "slice stop is neither nil nor an integer") < 0) {
        return -1;
    }
    if (read_array(r, &rfields, "record is not an array") < 0) return -1;
    if (rfields < 3) return bad(r, "record has fewer than 3 fields");
    if (read_int(r, &tag, "record tag is not an integer") < 0) return -1;
    if (tag != 1) return bad(r, "record is not a DataRecord (tag 1)");
    if (read_array(r, &entries, "record entries are not an array") < 0) return -1;
    if (open_end) stop = entries;
    if (start < 0 || start > stop || stop > (int64_t)entries) return bad(r, "slice start/stop outside the record");
    Py_ssize_t first = *rows;
    for (uint32_t i = 0; i < entries; i++) {
        if (i < start || i >= stop) {
            if (skip(r) < 0) return -1;
            continue;
        }
        if (entry_row(r, c, fallback, key_fallback, segment, offset, (int32_t)i) < 0) return -1;
        (*rows)++;
    }
    if (read_int(r, &commit_ns, "record commit_ts_ns is not an integer") < 0) return -1;
    int64_t *ts = (int64_t *)c[C_COMMIT_NS].data;
    for (Py_ssize_t i = first; i < *rows; i++) ts[i] = commit_ns;
    if (skip_n(r, rfields - 3) < 0) return -1;
    return skip_n(r, fields - 5);
}

PyDoc_STRVAR(columns_doc,
             "columns(packed, fallback, key_fallback) -> (rows, buffers)\n\n"
             "The rows of packed record slices (cdcd.lake.landing.arrow.pack) as column buffers, in the order\n"
             "op, partition, primary, order, node_order, cluster_id, topology_version, expire_time_ms,\n"
             "cache_id, segment, offset, index, commit_ts_ns, key offsets, key text, value offsets,\n"
             "value text. fallback(msgpack bytes) -> JSON bytes writes the values this module does not,\n"
             "key_fallback the keys (cdcd.lake.landing.jsontext.to_json_bytes and key_json_bytes).");

static PyObject *columns(PyObject *self, PyObject *args) {
    Py_buffer in;
    PyObject *fallback, *key_fallback;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*OO:columns", &in, &fallback, &key_fallback)) return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(key_fallback)) {
        PyBuffer_Release(&in);
        PyErr_SetString(PyExc_TypeError, "fallback and key_fallback must be callable");
        return NULL;
    }
    Buf c[N_COLUMNS];
    memset(c, 0, sizeof c);
    PyObject *result = NULL;
    Rd r = {in.buf, in.buf, (const uint8_t *)in.buf + in.len};
    Py_ssize_t rows = 0;
    uint32_t slices;
    /* First sizes from the input's: an entry takes at least ~16 bytes of it, and JSON text is
     * usually a little larger than MessagePack. Pages never written are never touched. */
    size_t input = (size_t)in.len;
    size_t rows_guess = input / 32 + 16;
    for (int i = 0; i < N_COLUMNS; i++) {
        size_t cap = i == C_KEYS ? input / 4 : i == C_VALUES ? input + input / 4 : rows_guess * 8;
        if (buf_init(&c[i], cap) < 0) goto done;
    }
    if (put_i32(&c[C_KEY_OFFSETS], 0) < 0 || put_i32(&c[C_VALUE_OFFSETS], 0) < 0) goto done;
    if (read_array(&r, &slices, "not an array of record slices") < 0) goto done;
    Py_ssize_t yielded = 0;
    for (uint32_t i = 0; i < slices; i++) {
        if (slice_rows(&r, c, fallback, key_fallback, &rows) < 0) goto done;
        if (rows - yielded >= YIELD_ROWS) {
            /* A batch takes a while: let other threads (the daemon's event loop, a node's writers
             * when the realtime worker lands) run now and then, as the interpreter would. */
            yielded = rows;
            Py_BEGIN_ALLOW_THREADS
            Py_END_ALLOW_THREADS
        }
    }
    if (r.p != r.end) {
        bad(&r, "trailing bytes after the last slice");
        goto done;
    }
    PyObject *buffers = PyTuple_New(N_COLUMNS);
    if (buffers == NULL) goto done;
    for (int i = 0; i < N_COLUMNS; i++) {
        PyObject *b = buf_finish(&c[i]);
        if (b == NULL) {
            Py_DECREF(buffers);
            goto done;
        }
        PyTuple_SET_ITEM(buffers, i, b);
    }
    result = Py_BuildValue("(nN)", rows, buffers);
done:
    for (int i = 0; i < N_COLUMNS; i++) Py_XDECREF(c[i].bytes);
    PyBuffer_Release(&in);
    return result;
}

PyDoc_STRVAR(to_json_doc, "to_json(raw, fallback) -> bytes\n\nOne MessagePack object as JSON text, as columns() writes values.");
PyDoc_STRVAR(key_json_doc, "key_json(raw, key_fallback) -> bytes\n\nOne MessagePack object as JSON text, as columns() writes keys.");

static PyObject *one_json(PyObject *args, const char *format, int key) {
    Py_buffer in;
    PyObject *fallback;
    if (!PyArg_ParseTuple(args, format, &in, &fallback)) return NULL;
    Buf o;
    PyObject *result = NULL;
    Rd r = {in.buf, in.buf, (const uint8_t *)in.buf + in.len};
    if (buf_init(&o, (size_t)in.len * 2) == 0 && put_json(&r, &o, fallback, key) == 0) {
        if (r.p != r.end) {
            bad(&r, "trailing bytes after the object");
        } else {
            result = buf_finish(&o);
        }
    }
    Py_XDECREF(o.bytes);
    PyBuffer_Release(&in);
    return result;
}

static PyObject *to_json(PyObject *self, PyObject *args) {
    (void)self;
    return one_json(args, "y*O:to_json", 0);
}

static PyObject *key_json(PyObject *self, PyObject *args) {
    (void)self;
    return one_json(args, "y*O:key_json", 1);
}

static PyMethodDef methods[] = {
    {"columns", columns, METH_VARARGS, columns_doc},
    {"to_json", to_json, METH_VARARGS, to_json_doc},
    {"key_json", key_json, METH_VARARGS, key_json_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cdcd.lake.landing._rows", "MessagePack records to the lake's column buffers.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
