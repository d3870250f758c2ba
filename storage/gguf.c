/*
 * gguf.c - GGUF reader (llama.cpp's files and PowerInfer's "PWRI" flavour).
 *
 * The whole file is parsed from one memory image: a read-only mapping of the
 * file (nf_gguf_open) or the caller's buffer (nf_gguf_open_mem). Everything
 * the header describes is copied into memory the reader owns, so without
 * NF_GGUF_MMAP the mapping is dropped once parsing ends and tensor data is
 * read with pread.
 *
 * Invariants:
 *  1. No byte is read before checking it lies inside the image: every read
 *     goes through cur_take(), which compares against the bytes remaining.
 *  2. Every count read from the file (keys, tensors, array elements, string
 *     lengths) is checked against the bytes remaining before anything is
 *     allocated for it, so allocations are bounded by a small multiple of
 *     the file size.
 *  3. Arithmetic on sizes and offsets is checked for overflow
 *     (__builtin_*_overflow); a failure is NF_EFORMAT.
 *  4. After a successful open: keys and tensor names are unique, n_dims is
 *     1..4, every tensor type is supported, ne[0] is a multiple of the
 *     type's block length, each tensor's data lies inside the file, starts
 *     on the alignment, and no two tensors' data overlap.
 *  5. Errors: the file is too short for what it declares -> NF_ETRUNCATED;
 *     a value is impossible -> NF_EFORMAT; valid but not handled (tensor
 *     type, nested arrays, big-endian) -> NF_EUNSUPPORTED. Every message
 *     names the file and the field.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/io.h"

/* A string element of an array key (arr_data points to an array of these). */
struct nf_gguf_str {
	const char *s;
	uint64_t len;
};

struct nf_gguf_chunk {
	struct nf_gguf_chunk *next;
	size_t used, cap;
	_Alignas(16) unsigned char mem[];
};

struct nf_gguf {
	char *path;
	uint32_t version;
	bool powerinfer;
	uint64_t alignment;
	uint64_t data_offset;
	uint64_t file_size;
	int fd;                   /* -1 for open_mem */
	struct nf_io_sys sys;     /* every system call goes through it */
	const uint8_t *map;       /* the mapping kept with NF_GGUF_MMAP, else NULL */
	size_t map_len;
	const uint8_t *mem;       /* open_mem's buffer */

	size_t n_kv;
	struct nf_gguf_kv *kv;
	uint32_t *kv_hash;        /* index + 1, 0 = empty; kv_hash_mask + 1 slots */
	size_t kv_hash_mask;

	size_t n_tensors;
	struct nf_gguf_tensor *tensors;
	uint32_t *t_hash;
	size_t t_hash_mask;

	struct nf_gguf_chunk *arena;
};

/* ---- small helpers ------------------------------------------------------ */

static const char *const nf_gguf_type_names[] = {
	"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
	"bool", "string", "array", "uint64", "int64", "float64",
};

const char *nf_gguf_type_name(uint32_t type)
{
	if (type < sizeof(nf_gguf_type_names) / sizeof(nf_gguf_type_names[0]))
		return nf_gguf_type_names[type];
	return "unknown";
}

size_t nf_gguf_type_size(uint32_t type)
{
	switch (type) {
	case NF_GGUF_UINT8: case NF_GGUF_INT8: case NF_GGUF_BOOL: return 1;
	case NF_GGUF_UINT16: case NF_GGUF_INT16: return 2;
	case NF_GGUF_UINT32: case NF_GGUF_INT32: case NF_GGUF_FLOAT32: return 4;
	case NF_GGUF_UINT64: case NF_GGUF_INT64: case NF_GGUF_FLOAT64: return 8;
	default: return 0;
	}
}

/* ggml's names for its tensor types, to name an unsupported one. */
const char *nf_gguf_ggml_type_name(uint32_t t)
{
	static const char *const names[] = {
		[0] = "f32", [1] = "f16", [2] = "q4_0", [3] = "q4_1",
		[6] = "q5_0", [7] = "q5_1", [8] = "q8_0", [9] = "q8_1",
		[10] = "q2_K", [11] = "q3_K", [12] = "q4_K", [13] = "q5_K",
		[14] = "q6_K", [15] = "q8_K", [16] = "iq2_xxs", [17] = "iq2_xs",
		[18] = "iq3_xxs", [19] = "iq1_s", [20] = "iq4_nl", [21] = "iq3_s",
		[22] = "iq2_s", [23] = "iq4_xs", [24] = "i8", [25] = "i16",
		[26] = "i32", [27] = "i64", [28] = "f64", [29] = "iq1_m",
		[30] = "bf16", [34] = "tq1_0", [35] = "tq2_0", [39] = "mxfp4",
	};
	if (t < sizeof(names) / sizeof(names[0]) && names[t])
		return names[t];
	return "unknown";
}

static bool is_signed_type(uint32_t t)
{
	return t == NF_GGUF_INT8 || t == NF_GGUF_INT16 || t == NF_GGUF_INT32 || t == NF_GGUF_INT64;
}

static bool is_unsigned_type(uint32_t t)
{
	return t == NF_GGUF_UINT8 || t == NF_GGUF_UINT16 || t == NF_GGUF_UINT32 || t == NF_GGUF_UINT64;
}

static void *arena_alloc(struct nf_gguf *g, size_t n)
{
	n = (n + 15) & ~(size_t)15;
	struct nf_gguf_chunk *c = g->arena;
	if (!c || c->cap - c->used < n) {
		size_t cap = n > (1u << 16) ? n : (1u << 16);
		c = malloc(sizeof(*c) + cap);
		if (!c)
			return NULL;
		c->next = g->arena;
		c->used = 0;
		c->cap = cap;
		g->arena = c;
	}
	void *p = c->mem + c->used;
	c->used += n;
	return p;
}

static char *arena_strndup(struct nf_gguf *g, const uint8_t *s, uint64_t len)
{
	char *p = arena_alloc(g, (size_t)len + 1);
	if (!p)
		return NULL;
	memcpy(p, s, (size_t)len);
	p[len] = '\0';
	return p;
}

static uint64_t hash_bytes(const char *s)
{
	uint64_t h = 1469598103934665603ull;
	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ull;
	return h;
}

static size_t hash_slots(size_t n)
{
	size_t s = 8;
	while (s < 2 * n)
		s <<= 1;
	return s;
}

/* Look name up in a table whose entries' names are found by name_at(). */
static size_t hash_find(const uint32_t *tab, size_t mask, const char *name,
			const char *(*name_at)(const struct nf_gguf *, size_t), const struct nf_gguf *g)
{
	if (!tab)
		return SIZE_MAX;
	for (size_t h = hash_bytes(name) & mask;; h = (h + 1) & mask) {
		if (!tab[h])
			return SIZE_MAX;
		if (!strcmp(name_at(g, tab[h] - 1), name))
			return tab[h] - 1;
	}
}

static void hash_insert(uint32_t *tab, size_t mask, const char *name, size_t idx)
{
	size_t h = hash_bytes(name) & mask;
	while (tab[h])
		h = (h + 1) & mask;
	tab[h] = (uint32_t)(idx + 1);
}

static const char *kv_name_at(const struct nf_gguf *g, size_t i) { return g->kv[i].key; }
static const char *t_name_at(const struct nf_gguf *g, size_t i) { return g->tensors[i].name; }

/* ---- parsing ------------------------------------------------------------ */

struct cur {
	const uint8_t *p;
	uint64_t len, pos;
	const char *path;
	struct nf_diag *d;
	char ctx[192];            /* what is being read, for messages */
};

static uint64_t cur_left(const struct cur *c) { return c->len - c->pos; }

static int cur_take(struct cur *c, void *dst, uint64_t n, const char *field)
{
	if (n > cur_left(c))
		return nf_diag_fail(c->d, NF_ETRUNCATED,
				    "%s: truncated: %s%s%s needs %" PRIu64 " bytes at offset %" PRIu64
				    " but the file ends at %" PRIu64,
				    c->path, c->ctx, c->ctx[0] ? " " : "", field, n, c->pos, c->len);
	memcpy(dst, c->p + c->pos, (size_t)n);
	c->pos += n;
	return 0;
}

static int cur_u32(struct cur *c, uint32_t *v, const char *field) { return cur_take(c, v, 4, field); }
static int cur_u64(struct cur *c, uint64_t *v, const char *field) { return cur_take(c, v, 8, field); }

/* A GGUF string: u64 length then bytes. Points into the image. */
static int cur_str(struct cur *c, const uint8_t **s, uint64_t *len, const char *field)
{
	int rc = cur_u64(c, len, field);
	if (rc < 0)
		return rc;
	if (*len > cur_left(c))
		return nf_diag_fail(c->d, NF_ETRUNCATED,
				    "%s: truncated: %s%s%s has length %" PRIu64 " at offset %" PRIu64
				    " but only %" PRIu64 " bytes remain",
				    c->path, c->ctx, c->ctx[0] ? " " : "", field, *len, c->pos, cur_left(c));
	*s = c->p + c->pos;
	c->pos += *len;
	return 0;
}

/* Check that count items of at least min_size bytes each can fit. */
static int cur_count(struct cur *c, uint64_t count, uint64_t min_size, const char *field)
{
	if (count > cur_left(c) / min_size)
		return nf_diag_fail(c->d, NF_ETRUNCATED,
				    "%s: truncated: %s%s%s is %" PRIu64 " but only %" PRIu64
				    " bytes remain at offset %" PRIu64 " (at least %" PRIu64 " bytes each)",
				    c->path, c->ctx, c->ctx[0] ? " " : "", field, count, cur_left(c),
				    c->pos, min_size);
	return 0;
}

/* Printable, bounded copy of a name for messages. */
static void safe_name(char *dst, size_t cap, const uint8_t *s, uint64_t len)
{
	size_t j = 0;
	for (uint64_t i = 0; i < len && j + 4 < cap; i++)
		dst[j++] = (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '\'') ? (char)s[i] : '?';
	if (len > cap - 5 && j + 4 <= cap)
		dst[j++] = '.', dst[j++] = '.', dst[j++] = '.';
	dst[j] = '\0';
}

static int parse_scalar(struct nf_gguf *g, struct cur *c, uint32_t type, struct nf_gguf_kv *kv)
{
	uint8_t raw[8] = {0};
	int rc = cur_take(c, raw, nf_gguf_type_size(type), "value");
	if (rc < 0)
		return rc;
	switch (type) {
	case NF_GGUF_UINT8:  kv->v.u64 = raw[0]; break;
	case NF_GGUF_INT8:   kv->v.i64 = (int8_t)raw[0]; break;
	case NF_GGUF_UINT16: { uint16_t x; memcpy(&x, raw, 2); kv->v.u64 = x; break; }
	case NF_GGUF_INT16:  { int16_t x; memcpy(&x, raw, 2); kv->v.i64 = x; break; }
	case NF_GGUF_UINT32: { uint32_t x; memcpy(&x, raw, 4); kv->v.u64 = x; break; }
	case NF_GGUF_INT32:  { int32_t x; memcpy(&x, raw, 4); kv->v.i64 = x; break; }
	case NF_GGUF_FLOAT32: { float x; memcpy(&x, raw, 4); kv->v.f64 = x; break; }
	case NF_GGUF_UINT64: memcpy(&kv->v.u64, raw, 8); break;
	case NF_GGUF_INT64:  memcpy(&kv->v.i64, raw, 8); break;
	case NF_GGUF_FLOAT64: memcpy(&kv->v.f64, raw, 8); break;
	case NF_GGUF_BOOL:
		if (raw[0] > 1)
			return nf_diag_fail(c->d, NF_EFORMAT, "%s: %s: bool value is %u, not 0 or 1",
					    c->path, c->ctx, raw[0]);
		kv->v.b = raw[0];
		break;
	}
	(void)g;
	return 0;
}

static int parse_array(struct nf_gguf *g, struct cur *c, struct nf_gguf_kv *kv)
{
	uint32_t et;
	uint64_t n;
	int rc = cur_u32(c, &et, "array element type");
	if (rc < 0)
		return rc;
	if (et == NF_GGUF_ARRAY)
		return nf_diag_fail(c->d, NF_EUNSUPPORTED, "%s: %s: arrays of arrays are not supported",
				    c->path, c->ctx);
	if (et > NF_GGUF_FLOAT64)
		return nf_diag_fail(c->d, NF_EFORMAT, "%s: %s: unknown array element type %" PRIu32,
				    c->path, c->ctx, et);
	rc = cur_u64(c, &n, "array length");
	if (rc < 0)
		return rc;
	kv->arr_type = et;
	kv->arr_n = n;
	if (et == NF_GGUF_STRING) {
		rc = cur_count(c, n, 8, "array length");
		if (rc < 0)
			return rc;
		struct nf_gguf_str *a = arena_alloc(g, (size_t)n * sizeof(*a) + 1);
		if (!a)
			return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
		for (uint64_t i = 0; i < n; i++) {
			const uint8_t *s;
			uint64_t len;
			rc = cur_str(c, &s, &len, "array string");
			if (rc < 0)
				return rc;
			a[i].s = arena_strndup(g, s, len);
			if (!a[i].s)
				return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
			a[i].len = len;
		}
		kv->arr_data = a;
		return 0;
	}
	size_t es = nf_gguf_type_size(et);
	rc = cur_count(c, n, es, "array length");
	if (rc < 0)
		return rc;
	uint8_t *a = arena_alloc(g, (size_t)(n * es) + 1);
	if (!a)
		return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
	rc = cur_take(c, a, n * es, "array data");
	if (rc < 0)
		return rc;
	if (et == NF_GGUF_BOOL)
		for (uint64_t i = 0; i < n; i++)
			if (a[i] > 1)
				return nf_diag_fail(c->d, NF_EFORMAT,
						    "%s: %s: bool element %" PRIu64 " is %u, not 0 or 1",
						    c->path, c->ctx, i, a[i]);
	kv->arr_data = a;
	return 0;
}

static int parse_kvs(struct nf_gguf *g, struct cur *c, uint64_t n_kv)
{
	g->kv = calloc(n_kv ? n_kv : 1, sizeof(*g->kv));
	g->kv_hash_mask = hash_slots(n_kv) - 1;
	g->kv_hash = calloc(g->kv_hash_mask + 1, sizeof(*g->kv_hash));
	if (!g->kv || !g->kv_hash)
		return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
	for (uint64_t i = 0; i < n_kv; i++) {
		struct nf_gguf_kv *kv = &g->kv[i];
		const uint8_t *key;
		uint64_t klen;
		uint32_t type;
		char name[80];
		snprintf(c->ctx, sizeof(c->ctx), "key #%" PRIu64, i);
		int rc = cur_str(c, &key, &klen, "name");
		if (rc < 0)
			return rc;
		if (klen == 0 || klen > 65535 || memchr(key, 0, (size_t)klen))
			return nf_diag_fail(c->d, NF_EFORMAT,
					    "%s: key #%" PRIu64 ": name of length %" PRIu64
					    " is empty, longer than 65535 or contains NUL",
					    c->path, i, klen);
		safe_name(name, sizeof(name), key, klen);
		snprintf(c->ctx, sizeof(c->ctx), "key '%s'", name);
		kv->key = arena_strndup(g, key, klen);
		if (!kv->key)
			return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
		if (hash_find(g->kv_hash, g->kv_hash_mask, kv->key, kv_name_at, g) != SIZE_MAX)
			return nf_diag_fail(c->d, NF_EFORMAT, "%s: key '%s' appears twice", c->path, name);
		rc = cur_u32(c, &type, "type");
		if (rc < 0)
			return rc;
		if (type > NF_GGUF_FLOAT64)
			return nf_diag_fail(c->d, NF_EFORMAT, "%s: key '%s': unknown value type %" PRIu32,
					    c->path, name, type);
		kv->type = type;
		if (type == NF_GGUF_STRING) {
			const uint8_t *s;
			uint64_t len;
			rc = cur_str(c, &s, &len, "string value");
			if (rc < 0)
				return rc;
			kv->v.str = arena_strndup(g, s, len);
			if (!kv->v.str)
				return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
		} else if (type == NF_GGUF_ARRAY) {
			rc = parse_array(g, c, kv);
		} else {
			rc = parse_scalar(g, c, type, kv);
		}
		if (rc < 0)
			return rc;
		hash_insert(g->kv_hash, g->kv_hash_mask, kv->key, i);
		g->n_kv = i + 1;
	}
	c->ctx[0] = '\0';
	return 0;
}

static int parse_alignment(struct nf_gguf *g, struct cur *c)
{
	g->alignment = NF_GGUF_DEFAULT_ALIGNMENT;
	const struct nf_gguf_kv *kv = nf_gguf_find_kv(g, "general.alignment");
	if (!kv)
		return 0;
	uint64_t a;
	if (is_unsigned_type(kv->type))
		a = kv->v.u64;
	else if (is_signed_type(kv->type) && kv->v.i64 > 0)
		a = (uint64_t)kv->v.i64;
	else
		return nf_diag_fail(c->d, NF_EFORMAT,
				    "%s: key 'general.alignment' has type %s, not an integer >= 1",
				    c->path, nf_gguf_type_name(kv->type));
	if (a == 0 || (a & (a - 1)) || a > (1u << 30))
		return nf_diag_fail(c->d, NF_EFORMAT,
				    "%s: key 'general.alignment' is %" PRIu64
				    ", not a power of two between 1 and 2^30",
				    c->path, a);
	g->alignment = a;
	return 0;
}

static int parse_tensor_info(struct nf_gguf *g, struct cur *c, uint64_t i)
{
	struct nf_gguf_tensor *t = &g->tensors[i];
	const uint8_t *s;
	uint64_t len;
	char name[80];
	snprintf(c->ctx, sizeof(c->ctx), "tensor #%" PRIu64, i);
	int rc = cur_str(c, &s, &len, "name");
	if (rc < 0)
		return rc;
	if (len == 0 || len > 64 || memchr(s, 0, (size_t)len))
		return nf_diag_fail(c->d, NF_EFORMAT,
				    "%s: tensor #%" PRIu64 ": name of length %" PRIu64
				    " is empty, longer than 64 or contains NUL",
				    c->path, i, len);
	safe_name(name, sizeof(name), s, len);
	snprintf(c->ctx, sizeof(c->ctx), "tensor '%s'", name);
	t->name = arena_strndup(g, s, len);
	if (!t->name)
		return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
	if (hash_find(g->t_hash, g->t_hash_mask, t->name, t_name_at, g) != SIZE_MAX)
		return nf_diag_fail(c->d, NF_EFORMAT, "%s: tensor '%s' appears twice", c->path, name);
	rc = cur_u32(c, &t->n_dims, "n_dims");
	if (rc < 0)
		return rc;
	if (t->n_dims < 1 || t->n_dims > NF_GGUF_MAX_DIMS)
		return nf_diag_fail(c->d, NF_EFORMAT, "%s: tensor '%s': n_dims is %" PRIu32 ", not 1..%d",
				    c->path, name, t->n_dims, NF_GGUF_MAX_DIMS);
	for (uint32_t d = 0; d < NF_GGUF_MAX_DIMS; d++) {
		t->ne[d] = 1;
		if (d < t->n_dims && (rc = cur_u64(c, &t->ne[d], "ne")) < 0)
			return rc;
	}
	rc = cur_u32(c, &t->type, "type");
	if (rc < 0)
		return rc;
	rc = cur_u64(c, &t->offset, "offset");
	if (rc < 0)
		return rc;
	if (!nf_dtype_valid(t->type) || t->type == NF_DTYPE_Q8_1)
		return nf_diag_fail(c->d, NF_EUNSUPPORTED,
				    "%s: tensor '%s': type %s (%" PRIu32 ") is not supported"
				    " (nflash reads f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 and q2_K..q6_K)",
				    c->path, name, nf_gguf_ggml_type_name(t->type), t->type);
	uint64_t bl = nf_dtype_block_len(t->type), rows = 1, size;
	for (uint32_t d = 0; d < NF_GGUF_MAX_DIMS; d++)
		if (t->ne[d] > INT64_MAX || (d > 0 && __builtin_mul_overflow(rows, t->ne[d], &rows)) ||
		    rows > INT64_MAX)
			return nf_diag_fail(c->d, NF_EFORMAT,
					    "%s: tensor '%s': shape [%" PRIu64 ", %" PRIu64 ", %" PRIu64
					    ", %" PRIu64 "] overflows 63 bits",
					    c->path, name, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
	if (t->ne[0] % bl)
		return nf_diag_fail(c->d, NF_EFORMAT,
				    "%s: tensor '%s': ne[0] = %" PRIu64 " is not a multiple of %s's block of %" PRIu64,
				    c->path, name, t->ne[0], nf_dtype_name(t->type), bl);
	uint64_t row = t->ne[0] / bl * nf_dtype_block_size(t->type), nel;
	if (__builtin_mul_overflow(t->ne[0], rows, &nel) || nel > INT64_MAX ||
	    __builtin_mul_overflow(row, rows, &size) || size > INT64_MAX)
		return nf_diag_fail(c->d, NF_EFORMAT, "%s: tensor '%s': data size overflows 63 bits",
				    c->path, name);
	t->size = size;
	hash_insert(g->t_hash, g->t_hash_mask, t->name, i);
	g->n_tensors = i + 1;
	return 0;
}

static int cmp_by_offset(const void *a, const void *b)
{
	const struct nf_gguf_tensor *x = *(const struct nf_gguf_tensor *const *)a;
	const struct nf_gguf_tensor *y = *(const struct nf_gguf_tensor *const *)b;
	return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Place each tensor's data: aligned, inside the file, no overlaps. */
static int place_tensors(struct nf_gguf *g, struct cur *c)
{
	uint64_t a = g->alignment;
	uint64_t pos = c->pos;
	g->data_offset = (pos + a - 1) / a * a;  /* pos <= file size < 2^63: no overflow */
	for (size_t i = 0; i < g->n_tensors; i++) {
		struct nf_gguf_tensor *t = &g->tensors[i];
		uint64_t abs, end;
		if (t->offset % a)
			return nf_diag_fail(c->d, NF_EFORMAT,
					    "%s: tensor '%s': data offset %" PRIu64
					    " is not a multiple of the alignment %" PRIu64,
					    c->path, t->name, t->offset, a);
		if (__builtin_add_overflow(g->data_offset, t->offset, &abs) ||
		    __builtin_add_overflow(abs, t->size, &end))
			return nf_diag_fail(c->d, NF_EFORMAT,
					    "%s: tensor '%s': data offset %" PRIu64 " + size %" PRIu64 " overflows",
					    c->path, t->name, t->offset, t->size);
		if (end > g->file_size)
			return nf_diag_fail(c->d, NF_ETRUNCATED,
					    "%s: truncated: tensor '%s': data [%" PRIu64 ", %" PRIu64
					    ") extends past the end of the file at %" PRIu64,
					    c->path, t->name, abs, end, g->file_size);
		t->offset = abs;
	}
	if (g->n_tensors > 1) {
		const struct nf_gguf_tensor **s = malloc(g->n_tensors * sizeof(*s));
		if (!s)
			return nf_diag_fail(c->d, -ENOMEM, "%s: out of memory", c->path);
		for (size_t i = 0; i < g->n_tensors; i++)
			s[i] = &g->tensors[i];
		qsort(s, g->n_tensors, sizeof(*s), cmp_by_offset);
		for (size_t i = 0; i + 1 < g->n_tensors; i++) {
			if (s[i]->offset + s[i]->size > s[i + 1]->offset) {
				int rc = nf_diag_fail(c->d, NF_EFORMAT,
						      "%s: tensors '%s' and '%s': data overlap at offset %" PRIu64,
						      c->path, s[i]->name, s[i + 1]->name, s[i + 1]->offset);
				free(s);
				return rc;
			}
		}
		free(s);
	}
	return 0;
}

/* Parse the image at buf (len bytes) into g. */
static int parse(struct nf_gguf *g, const uint8_t *buf, uint64_t len, struct nf_diag *d)
{
	struct cur c = { .p = buf, .len = len, .path = g->path, .d = d };
	char magic[4];
	uint32_t version;
	uint64_t n_tensors, n_kv;
	int rc;

	g->file_size = len;
	if ((rc = cur_take(&c, magic, 4, "magic")) < 0)
		return rc;
	if (!memcmp(magic, "GGUF", 4))
		g->powerinfer = false;
	else if (!memcmp(magic, "PWRI", 4))
		g->powerinfer = true;
	else
		return nf_diag_fail(d, NF_EMAGIC,
				    "%s: magic: bytes %02x %02x %02x %02x are neither \"GGUF\" nor \"PWRI\"",
				    g->path, (uint8_t)magic[0], (uint8_t)magic[1], (uint8_t)magic[2],
				    (uint8_t)magic[3]);
	if ((rc = cur_u32(&c, &version, "version")) < 0)
		return rc;
	if (version != 0 && (version & 0xffff) == 0)
		return nf_diag_fail(d, NF_EUNSUPPORTED,
				    "%s: version: %#" PRIx32 " looks like a big-endian file, which is not supported",
				    g->path, version);
	if (version < 2 || version > 3)
		return nf_diag_fail(d, NF_EVERSION, "%s: version: %" PRIu32 " is not supported (2 or 3)",
				    g->path, version);
	g->version = version;
	if ((rc = cur_u64(&c, &n_tensors, "n_tensors")) < 0 ||
	    (rc = cur_u64(&c, &n_kv, "n_kv")) < 0)
		return rc;
	/* A key takes at least 13 bytes (length, one byte, type, a u8 value);
	 * a tensor info at least 33 (name length, one byte, n_dims, ne, type, offset). */
	if ((rc = cur_count(&c, n_kv, 13, "n_kv")) < 0 ||
	    (rc = cur_count(&c, n_tensors, 33, "n_tensors")) < 0)
		return rc;
	if ((rc = parse_kvs(g, &c, n_kv)) < 0)
		return rc;
	if ((rc = parse_alignment(g, &c)) < 0)
		return rc;
	if ((rc = cur_count(&c, n_tensors, 33, "n_tensors")) < 0)
		return rc;
	g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof(*g->tensors));
	g->t_hash_mask = hash_slots(n_tensors) - 1;
	g->t_hash = calloc(g->t_hash_mask + 1, sizeof(*g->t_hash));
	if (!g->tensors || !g->t_hash)
		return nf_diag_fail(d, -ENOMEM, "%s: out of memory", g->path);
	for (uint64_t i = 0; i < n_tensors; i++)
		if ((rc = parse_tensor_info(g, &c, i)) < 0)
			return rc;
	c.ctx[0] = '\0';
	return place_tensors(g, &c);
}

static struct nf_gguf *reader_new(const char *path)
{
	struct nf_gguf *g = calloc(1, sizeof(*g));
	if (!g)
		return NULL;
	g->fd = -1;
	g->sys = nf_io_sys_default;
	g->path = strdup(path);
	if (!g->path) {
		free(g);
		return NULL;
	}
	return g;
}

void nf_gguf_close(struct nf_gguf *g)
{
	if (!g)
		return;
	if (g->map)
		g->sys.munmap((void *)g->map, g->map_len);
	if (g->fd >= 0)
		g->sys.close(g->fd);
	while (g->arena) {
		struct nf_gguf_chunk *n = g->arena->next;
		free(g->arena);
		g->arena = n;
	}
	free(g->kv);
	free(g->kv_hash);
	free(g->tensors);
	free(g->t_hash);
	free(g->path);
	free(g);
}

int nf_gguf_open_mem(const void *buf, size_t len, struct nf_gguf **out, struct nf_diag *diag)
{
	if (!out || (!buf && len))
		return nf_diag_fail(diag, NF_EUSAGE, "nf_gguf_open_mem: NULL argument");
	struct nf_gguf *g = reader_new("<memory>");
	if (!g)
		return nf_diag_fail(diag, -ENOMEM, "<memory>: out of memory");
	g->mem = buf;
	int rc = parse(g, buf, len, diag);
	if (rc < 0) {
		nf_gguf_close(g);
		return rc;
	}
	for (size_t i = 0; i < g->n_tensors; i++)
		g->tensors[i].data = g->mem + g->tensors[i].offset;
	*out = g;
	return 0;
}

int nf_gguf_open(const char *path, unsigned flags, struct nf_gguf **out, struct nf_diag *diag)
{
	return nf_gguf_open_sys(path, flags, NULL, out, diag);
}

int nf_gguf_open_sys(const char *path, unsigned flags, const struct nf_io_sys *sys,
		     struct nf_gguf **out, struct nf_diag *diag)
{
	struct stat st;
	const uint8_t *map = NULL;
	int rc;

	if (!path || !out)
		return nf_diag_fail(diag, NF_EUSAGE, "nf_gguf_open: NULL argument");
	if (flags & ~(unsigned)NF_GGUF_MMAP)
		return nf_diag_fail(diag, NF_EUSAGE, "%s: unknown flags %#x", path, flags);
	struct nf_gguf *g = reader_new(path);
	if (!g)
		return nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
	if (sys)
		g->sys = *sys;
	g->fd = g->sys.open(path, O_RDONLY, 0);
	if (g->fd < 0) {
		rc = -errno;
		nf_diag_fail(diag, rc, "%s: cannot open: %s", path, nf_strerror(rc));
		goto fail;
	}
	if (g->sys.fstat(g->fd, &st) < 0) {
		rc = -errno;
		nf_diag_fail(diag, rc, "%s: cannot stat: %s", path, nf_strerror(rc));
		goto fail;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = nf_diag_fail(diag, -EINVAL, "%s: not a regular file", path);
		goto fail;
	}
	if (st.st_size > 0) {
		void *m = g->sys.mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, g->fd, 0);
		if (m == MAP_FAILED) {
			rc = -errno;
			nf_diag_fail(diag, rc, "%s: cannot map: %s", path, nf_strerror(rc));
			goto fail;
		}
		map = m;
	}
	rc = parse(g, map, (uint64_t)st.st_size, diag);
	if (rc < 0)
		goto fail_unmap;
	if (flags & NF_GGUF_MMAP) {
		g->map = map;
		g->map_len = (size_t)st.st_size;
		for (size_t i = 0; i < g->n_tensors; i++)
			g->tensors[i].data = map + g->tensors[i].offset;
	} else if (map) {
		g->sys.munmap((void *)map, (size_t)st.st_size);
	}
	*out = g;
	return 0;

fail_unmap:
	if (map)
		g->sys.munmap((void *)map, (size_t)st.st_size);
fail:
	nf_gguf_close(g);
	return rc;
}

/* ---- accessors ---------------------------------------------------------- */

uint32_t nf_gguf_version(const struct nf_gguf *g) { return g->version; }
bool nf_gguf_is_powerinfer(const struct nf_gguf *g) { return g->powerinfer; }
uint64_t nf_gguf_alignment(const struct nf_gguf *g) { return g->alignment; }
uint64_t nf_gguf_data_offset(const struct nf_gguf *g) { return g->data_offset; }
uint64_t nf_gguf_file_size(const struct nf_gguf *g) { return g->file_size; }
const char *nf_gguf_path(const struct nf_gguf *g) { return g->path; }
int nf_gguf_fd(const struct nf_gguf *g) { return g->fd; }
size_t nf_gguf_n_kv(const struct nf_gguf *g) { return g->n_kv; }
size_t nf_gguf_n_tensors(const struct nf_gguf *g) { return g->n_tensors; }

const struct nf_gguf_kv *nf_gguf_kv_at(const struct nf_gguf *g, size_t i)
{
	return i < g->n_kv ? &g->kv[i] : NULL;
}

const struct nf_gguf_kv *nf_gguf_find_kv(const struct nf_gguf *g, const char *key)
{
	size_t i = hash_find(g->kv_hash, g->kv_hash_mask, key, kv_name_at, g);
	return i == SIZE_MAX ? NULL : &g->kv[i];
}

const struct nf_gguf_tensor *nf_gguf_tensor_at(const struct nf_gguf *g, size_t i)
{
	return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct nf_gguf_tensor *nf_gguf_find_tensor(const struct nf_gguf *g, const char *name)
{
	size_t i = hash_find(g->t_hash, g->t_hash_mask, name, t_name_at, g);
	return i == SIZE_MAX ? NULL : &g->tensors[i];
}

/* An integer key as a signed 128-bit-free pair: ok if representable in [lo, hi]. */
static int kv_int(const struct nf_gguf *g, const char *key, uint64_t hi, uint64_t *out)
{
	const struct nf_gguf_kv *kv = nf_gguf_find_kv(g, key);
	if (!kv)
		return NF_ENOTFOUND;
	if (is_unsigned_type(kv->type) && kv->v.u64 <= hi)
		*out = kv->v.u64;
	else if (is_signed_type(kv->type) && kv->v.i64 >= 0 && (uint64_t)kv->v.i64 <= hi)
		*out = (uint64_t)kv->v.i64;
	else
		return NF_EFORMAT;
	return 0;
}

int nf_gguf_get_u32(const struct nf_gguf *g, const char *key, uint32_t *out)
{
	uint64_t v;
	int rc = kv_int(g, key, UINT32_MAX, &v);
	if (rc == 0)
		*out = (uint32_t)v;
	return rc;
}

int nf_gguf_get_u64(const struct nf_gguf *g, const char *key, uint64_t *out)
{
	return kv_int(g, key, UINT64_MAX, out);
}

int nf_gguf_get_f32(const struct nf_gguf *g, const char *key, float *out)
{
	const struct nf_gguf_kv *kv = nf_gguf_find_kv(g, key);
	if (!kv)
		return NF_ENOTFOUND;
	if (kv->type != NF_GGUF_FLOAT32 && kv->type != NF_GGUF_FLOAT64)
		return NF_EFORMAT;
	*out = (float)kv->v.f64;
	return 0;
}

int nf_gguf_get_bool(const struct nf_gguf *g, const char *key, bool *out)
{
	const struct nf_gguf_kv *kv = nf_gguf_find_kv(g, key);
	if (!kv)
		return NF_ENOTFOUND;
	if (kv->type != NF_GGUF_BOOL)
		return NF_EFORMAT;
	*out = kv->v.b;
	return 0;
}

int nf_gguf_get_str(const struct nf_gguf *g, const char *key, const char **out)
{
	const struct nf_gguf_kv *kv = nf_gguf_find_kv(g, key);
	if (!kv)
		return NF_ENOTFOUND;
	if (kv->type != NF_GGUF_STRING)
		return NF_EFORMAT;
	*out = kv->v.str;
	return 0;
}

int nf_gguf_get_arr(const struct nf_gguf *g, const char *key, const struct nf_gguf_kv **out)
{
	const struct nf_gguf_kv *kv = nf_gguf_find_kv(g, key);
	if (!kv)
		return NF_ENOTFOUND;
	if (kv->type != NF_GGUF_ARRAY)
		return NF_EFORMAT;
	*out = kv;
	return 0;
}

const char *nf_gguf_arr_str(const struct nf_gguf_kv *kv, uint64_t i, uint64_t *len)
{
	if (kv->type != NF_GGUF_ARRAY || kv->arr_type != NF_GGUF_STRING || i >= kv->arr_n)
		return NULL;
	const struct nf_gguf_str *a = kv->arr_data;
	if (len)
		*len = a[i].len;
	return a[i].s;
}

/* Numeric element i as double/int64; false if not numeric. */
static bool arr_num(const struct nf_gguf_kv *kv, uint64_t i, double *f, int64_t *n)
{
	if (kv->type != NF_GGUF_ARRAY || i >= kv->arr_n)
		return false;
	size_t es = nf_gguf_type_size(kv->arr_type);
	if (!es)
		return false;
	const uint8_t *p = (const uint8_t *)kv->arr_data + i * es;
	switch (kv->arr_type) {
	case NF_GGUF_UINT8: case NF_GGUF_BOOL: *n = p[0]; *f = *n; return true;
	case NF_GGUF_INT8: *n = (int8_t)p[0]; *f = *n; return true;
	case NF_GGUF_UINT16: { uint16_t x; memcpy(&x, p, 2); *n = x; *f = x; return true; }
	case NF_GGUF_INT16: { int16_t x; memcpy(&x, p, 2); *n = x; *f = x; return true; }
	case NF_GGUF_UINT32: { uint32_t x; memcpy(&x, p, 4); *n = x; *f = x; return true; }
	case NF_GGUF_INT32: { int32_t x; memcpy(&x, p, 4); *n = x; *f = x; return true; }
	case NF_GGUF_UINT64: { uint64_t x; memcpy(&x, p, 8); *n = (int64_t)x; *f = (double)x; return true; }
	case NF_GGUF_INT64: { int64_t x; memcpy(&x, p, 8); *n = x; *f = (double)x; return true; }
	case NF_GGUF_FLOAT32: { float x; memcpy(&x, p, 4); *f = x; *n = 0; return true; }
	case NF_GGUF_FLOAT64: { double x; memcpy(&x, p, 8); *f = x; *n = 0; return true; }
	default: return false;
	}
}

float nf_gguf_arr_f32(const struct nf_gguf_kv *kv, uint64_t i)
{
	double f;
	int64_t n;
	return arr_num(kv, i, &f, &n) ? (float)f : 0.0f;
}

int64_t nf_gguf_arr_i64(const struct nf_gguf_kv *kv, uint64_t i)
{
	double f;
	int64_t n;
	if (!arr_num(kv, i, &f, &n) || kv->arr_type == NF_GGUF_FLOAT32 || kv->arr_type == NF_GGUF_FLOAT64)
		return 0;
	return n;
}

int nf_gguf_read_tensor(const struct nf_gguf *g, const struct nf_gguf_tensor *t,
			uint64_t off, void *buf, size_t len)
{
	if (off > t->size || len > t->size - off)
		return NF_EFORMAT;
	const uint8_t *base = g->map ? g->map : g->mem;
	if (base) {
		memcpy(buf, base + t->offset + off, len);
		return 0;
	}
	int rc = nf_io_pread_full(&g->sys, g->fd, buf, len, t->offset + off);
	return rc == NF_ETRUNCATED ? NF_ESHORT : rc;
}
