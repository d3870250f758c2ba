/*
 * gguf_write.c - streaming, crash-safe GGUF writer (version 3).
 *
 * Key/values are encoded into memory as they are declared; tensor infos are
 * kept until the first data byte arrives, when the whole header is written.
 * Data then streams through a 1 MiB buffer, with zero padding inserted after
 * each tensor so the next one starts on the alignment (after the last one
 * too, as llama.cpp does, so the file ends aligned).
 *
 * Invariants:
 *  1. Nothing is ever written under the final name until finish(): the file
 *     is built as ".<name>.nflash-tmp.<pid>.<hex>" (nf_io_tmp_create) in
 *     the same directory, fsynced, renamed over the final name, and the
 *     directory is fsynced. A killed
 *     process leaves at most that temporary file; abort() or a failed
 *     finish() unlinks it.
 *  2. Errors stick: after the first failure every call returns it, and
 *     finish() removes the temporary file. A failed fsync is not retried.
 *  3. The header describes exactly the bytes that follow: finish() refuses
 *     a file whose declared tensors did not all receive their data, and
 *     write() refuses bytes beyond the last tensor.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/io.h"

#define WBUF_SIZE (1u << 20)

struct wbuf {
	uint8_t *p;
	size_t len, cap;
};

struct wtensor {
	char *name;
	uint32_t type, n_dims;
	uint64_t ne[NF_GGUF_MAX_DIMS];
	uint64_t size, offset;   /* offset relative to the data section */
};

struct nf_gguf_writer {
	char *path, *tmp, *dir;
	int fd;
	uint64_t pos;            /* bytes written to fd */
	struct nf_io_sys sys;    /* every system call goes through it */
	bool powerinfer;
	int err;                 /* sticky first error, 0 if none */
	uint64_t alignment;

	struct wbuf kv;          /* encoded key/values */
	uint64_t n_kv;
	char **keys;
	size_t keys_cap;

	struct wtensor *t;
	size_t n_t, t_cap;
	uint64_t data_size;      /* declared bytes of the data section, padded */

	bool started;            /* header written */
	size_t cur;              /* tensor receiving data */
	uint64_t cur_done;       /* its bytes received */

	uint8_t *out;            /* output buffer */
	size_t out_len;
};

static int wbuf_put(struct wbuf *b, const void *p, size_t n)
{
	if (n == 0)
		return 0;
	if (n > b->cap - b->len) {
		size_t cap = b->cap ? b->cap : 256;
		while (cap - b->len < n) {
			if (cap > SIZE_MAX / 2)
				return -ENOMEM;
			cap *= 2;
		}
		uint8_t *q = realloc(b->p, cap);
		if (!q)
			return -ENOMEM;
		b->p = q;
		b->cap = cap;
	}
	memcpy(b->p + b->len, p, n);
	b->len += n;
	return 0;
}

static int wbuf_str(struct wbuf *b, const char *s, size_t len)
{
	uint64_t n = len;
	int rc = wbuf_put(b, &n, 8);
	return rc < 0 ? rc : wbuf_put(b, s, len);
}

static int fail(struct nf_gguf_writer *w, int rc)
{
	if (!w->err)
		w->err = rc;
	return rc;
}

static int write_all(struct nf_gguf_writer *w, const uint8_t *p, size_t n)
{
	int rc = nf_io_pwrite_full(&w->sys, w->fd, p, n, w->pos);
	if (rc < 0)
		return rc == NF_ETRUNCATED ? NF_ESHORT : rc;
	w->pos += n;
	return 0;
}

static int flush(struct nf_gguf_writer *w)
{
	int rc = write_all(w, w->out, w->out_len);
	w->out_len = 0;
	return rc < 0 ? fail(w, rc) : 0;
}

static int emit(struct nf_gguf_writer *w, const void *p, size_t n)
{
	if (n == 0)
		return 0;
	if (n > WBUF_SIZE - w->out_len) {
		int rc = flush(w);
		if (rc < 0)
			return rc;
		if (n >= WBUF_SIZE) {
			rc = write_all(w, p, n);
			return rc < 0 ? fail(w, rc) : 0;
		}
	}
	memcpy(w->out + w->out_len, p, n);
	w->out_len += n;
	return 0;
}

static int emit_zeros(struct nf_gguf_writer *w, uint64_t n)
{
	static const uint8_t zeros[256];
	while (n) {
		size_t k = n < sizeof(zeros) ? (size_t)n : sizeof(zeros);
		int rc = emit(w, zeros, k);
		if (rc < 0)
			return rc;
		n -= k;
	}
	return 0;
}

static uint64_t pad_to(uint64_t x, uint64_t a) { return (a - x % a) % a; }

int nf_gguf_writer_open(const char *path, bool powerinfer, struct nf_gguf_writer **out,
			struct nf_diag *diag)
{
	return nf_gguf_writer_open_sys(path, powerinfer, NULL, out, diag);
}

int nf_gguf_writer_open_sys(const char *path, bool powerinfer, const struct nf_io_sys *sys,
			    struct nf_gguf_writer **out, struct nf_diag *diag)
{
	int rc;
	if (!path || !*path || !out)
		return nf_diag_fail(diag, NF_EUSAGE, "nf_gguf_writer_open: no path");
	struct nf_gguf_writer *w = calloc(1, sizeof(*w));
	if (!w)
		return nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
	w->fd = -1;
	w->sys = sys ? *sys : nf_io_sys_default;
	w->powerinfer = powerinfer;
	w->alignment = NF_GGUF_DEFAULT_ALIGNMENT;
	w->path = strdup(path);
	w->out = malloc(WBUF_SIZE);
	const char *slash = strrchr(path, '/');
	const char *base = slash ? slash + 1 : path;
	size_t dlen = slash ? (size_t)(slash - path) : 0;
	w->dir = slash ? (dlen ? strndup(path, dlen) : strdup("/")) : strdup(".");
	if (!w->path || !w->out || !w->dir) {
		rc = nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
		goto fail;
	}
	if (!*base) {
		rc = nf_diag_fail(diag, NF_EUSAGE, "%s: path names a directory", path);
		goto fail;
	}
	if ((rc = nf_io_target_check(&w->sys, path, diag)) < 0)
		goto fail;
	if ((rc = nf_io_tmp_create(&w->sys, path, false, &w->tmp, &w->fd, diag)) < 0)
		goto fail;
	*out = w;
	return 0;

fail:
	free(w->tmp);
	w->tmp = NULL;          /* nothing was created */
	nf_gguf_writer_abort(w);
	return rc;
}

void nf_gguf_writer_abort(struct nf_gguf_writer *w)
{
	if (!w)
		return;
	if (w->fd >= 0)
		w->sys.close(w->fd);
	if (w->tmp)
		w->sys.unlink(w->tmp);
	for (size_t i = 0; i < w->n_t; i++)
		free(w->t[i].name);
	for (uint64_t i = 0; i < w->n_kv; i++)
		free(w->keys[i]);
	free(w->keys);
	free(w->t);
	free(w->kv.p);
	free(w->out);
	free(w->tmp);
	free(w->dir);
	free(w->path);
	free(w);
}

/* Start a key: checks state and uniqueness, encodes name and type. */
static int kv_begin(struct nf_gguf_writer *w, const char *key, uint32_t type)
{
	if (w->err)
		return w->err;
	if (w->started || !key || !*key || strlen(key) > 65535)
		return fail(w, NF_EUSAGE);
	for (uint64_t i = 0; i < w->n_kv; i++)
		if (!strcmp(w->keys[i], key))
			return fail(w, NF_EUSAGE);
	if (w->n_kv == w->keys_cap) {
		size_t cap = w->keys_cap ? w->keys_cap * 2 : 16;
		char **k = realloc(w->keys, cap * sizeof(*k));
		if (!k)
			return fail(w, -ENOMEM);
		w->keys = k;
		w->keys_cap = cap;
	}
	w->keys[w->n_kv] = strdup(key);
	if (!w->keys[w->n_kv])
		return fail(w, -ENOMEM);
	w->n_kv++;
	int rc = wbuf_str(&w->kv, key, strlen(key));
	if (rc == 0)
		rc = wbuf_put(&w->kv, &type, 4);
	return rc < 0 ? fail(w, rc) : 0;
}

static int kv_put(struct nf_gguf_writer *w, const void *p, size_t n)
{
	int rc = wbuf_put(&w->kv, p, n);
	return rc < 0 ? fail(w, rc) : 0;
}

static bool scalar_type(uint32_t t) { return nf_gguf_type_size(t) != 0; }

int nf_gguf_writer_kv_scalar(struct nf_gguf_writer *w, const char *key, uint32_t type,
			     const void *val)
{
	if (!scalar_type(type) || !val)
		return fail(w, NF_EUSAGE);
	if (type == NF_GGUF_BOOL && *(const uint8_t *)val > 1)
		return fail(w, NF_EUSAGE);
	if (key && !strcmp(key, "general.alignment")) {
		uint64_t a = 0;
		if (type == NF_GGUF_UINT32) {
			uint32_t x;
			memcpy(&x, val, 4);
			a = x;
		}
		/* Tensor offsets are laid out as tensors are declared. */
		if (type != NF_GGUF_UINT32 || a == 0 || (a & (a - 1)) || a > (1u << 30) || w->n_t)
			return fail(w, NF_EUSAGE);
		if (!w->err && !w->started)
			w->alignment = a;
	}
	int rc = kv_begin(w, key, type);
	return rc < 0 ? rc : kv_put(w, val, nf_gguf_type_size(type));
}

int nf_gguf_writer_kv_u32(struct nf_gguf_writer *w, const char *key, uint32_t v)
{
	return nf_gguf_writer_kv_scalar(w, key, NF_GGUF_UINT32, &v);
}

int nf_gguf_writer_kv_i32(struct nf_gguf_writer *w, const char *key, int32_t v)
{
	return nf_gguf_writer_kv_scalar(w, key, NF_GGUF_INT32, &v);
}

int nf_gguf_writer_kv_u64(struct nf_gguf_writer *w, const char *key, uint64_t v)
{
	return nf_gguf_writer_kv_scalar(w, key, NF_GGUF_UINT64, &v);
}

int nf_gguf_writer_kv_f32(struct nf_gguf_writer *w, const char *key, float v)
{
	return nf_gguf_writer_kv_scalar(w, key, NF_GGUF_FLOAT32, &v);
}

int nf_gguf_writer_kv_bool(struct nf_gguf_writer *w, const char *key, bool v)
{
	uint8_t b = v;
	return nf_gguf_writer_kv_scalar(w, key, NF_GGUF_BOOL, &b);
}

int nf_gguf_writer_kv_str(struct nf_gguf_writer *w, const char *key, const char *v)
{
	if (!v)
		return fail(w, NF_EUSAGE);
	int rc = kv_begin(w, key, NF_GGUF_STRING);
	if (rc < 0)
		return rc;
	rc = wbuf_str(&w->kv, v, strlen(v));
	return rc < 0 ? fail(w, rc) : 0;
}

static int arr_begin(struct nf_gguf_writer *w, const char *key, uint32_t et, uint64_t n)
{
	int rc = kv_begin(w, key, NF_GGUF_ARRAY);
	if (rc == 0)
		rc = kv_put(w, &et, 4);
	if (rc == 0)
		rc = kv_put(w, &n, 8);
	return rc;
}

int nf_gguf_writer_kv_arr(struct nf_gguf_writer *w, const char *key, uint32_t elem_type,
			  const void *data, uint64_t n)
{
	size_t es = nf_gguf_type_size(elem_type);
	if (!es || (n && !data) || n > SIZE_MAX / es)
		return fail(w, NF_EUSAGE);
	if (elem_type == NF_GGUF_BOOL)
		for (uint64_t i = 0; i < n; i++)
			if (((const uint8_t *)data)[i] > 1)
				return fail(w, NF_EUSAGE);
	int rc = arr_begin(w, key, elem_type, n);
	return rc < 0 ? rc : kv_put(w, data, (size_t)(n * es));
}

int nf_gguf_writer_kv_arr_str(struct nf_gguf_writer *w, const char *key,
			      const char *const *v, uint64_t n)
{
	if (n && !v)
		return fail(w, NF_EUSAGE);
	for (uint64_t i = 0; i < n; i++)
		if (!v[i])
			return fail(w, NF_EUSAGE);
	int rc = arr_begin(w, key, NF_GGUF_STRING, n);
	for (uint64_t i = 0; rc == 0 && i < n; i++) {
		rc = wbuf_str(&w->kv, v[i], strlen(v[i]));
		if (rc < 0)
			fail(w, rc);
	}
	return rc;
}

int nf_gguf_writer_kv_arr_f32(struct nf_gguf_writer *w, const char *key, const float *v, uint64_t n)
{
	return nf_gguf_writer_kv_arr(w, key, NF_GGUF_FLOAT32, v, n);
}

int nf_gguf_writer_kv_arr_i32(struct nf_gguf_writer *w, const char *key, const int32_t *v, uint64_t n)
{
	return nf_gguf_writer_kv_arr(w, key, NF_GGUF_INT32, v, n);
}

int nf_gguf_writer_kv_copy(struct nf_gguf_writer *w, const struct nf_gguf_kv *kv)
{
	if (!kv)
		return fail(w, NF_EUSAGE);
	uint8_t raw[8];
	switch (kv->type) {
	case NF_GGUF_STRING:
		return nf_gguf_writer_kv_str(w, kv->key, kv->v.str);
	case NF_GGUF_ARRAY:
		if (kv->arr_type != NF_GGUF_STRING)
			return nf_gguf_writer_kv_arr(w, kv->key, kv->arr_type, kv->arr_data, kv->arr_n);
		int rc = arr_begin(w, kv->key, NF_GGUF_STRING, kv->arr_n);
		for (uint64_t i = 0; rc == 0 && i < kv->arr_n; i++) {
			uint64_t len;
			const char *s = nf_gguf_arr_str(kv, i, &len);
			rc = s ? wbuf_str(&w->kv, s, (size_t)len) : NF_EUSAGE;
			if (rc < 0)
				fail(w, rc);
		}
		return rc;
	case NF_GGUF_UINT8: raw[0] = (uint8_t)kv->v.u64; break;
	case NF_GGUF_INT8: raw[0] = (uint8_t)(int8_t)kv->v.i64; break;
	case NF_GGUF_BOOL: raw[0] = kv->v.b; break;
	case NF_GGUF_UINT16: { uint16_t x = (uint16_t)kv->v.u64; memcpy(raw, &x, 2); break; }
	case NF_GGUF_INT16: { int16_t x = (int16_t)kv->v.i64; memcpy(raw, &x, 2); break; }
	case NF_GGUF_UINT32: { uint32_t x = (uint32_t)kv->v.u64; memcpy(raw, &x, 4); break; }
	case NF_GGUF_INT32: { int32_t x = (int32_t)kv->v.i64; memcpy(raw, &x, 4); break; }
	case NF_GGUF_FLOAT32: { float x = (float)kv->v.f64; memcpy(raw, &x, 4); break; }
	case NF_GGUF_UINT64: memcpy(raw, &kv->v.u64, 8); break;
	case NF_GGUF_INT64: memcpy(raw, &kv->v.i64, 8); break;
	case NF_GGUF_FLOAT64: memcpy(raw, &kv->v.f64, 8); break;
	default: return fail(w, NF_EUSAGE);
	}
	return nf_gguf_writer_kv_scalar(w, kv->key, kv->type, raw);
}

int nf_gguf_writer_tensor(struct nf_gguf_writer *w, const char *name, uint32_t type,
			  uint32_t n_dims, const uint64_t *ne)
{
	if (w->err)
		return w->err;
	if (w->started || !name || !*name || strlen(name) > 64 || n_dims < 1 ||
	    n_dims > NF_GGUF_MAX_DIMS || !ne)
		return fail(w, NF_EUSAGE);
	if (!nf_dtype_valid(type))
		return fail(w, NF_EUNSUPPORTED);
	for (size_t i = 0; i < w->n_t; i++)
		if (!strcmp(w->t[i].name, name))
			return fail(w, NF_EUSAGE);
	uint64_t bl = nf_dtype_block_len(type), rows = 1, size, padded, total;
	for (uint32_t d = 1; d < n_dims; d++)
		if (__builtin_mul_overflow(rows, ne[d], &rows))
			return fail(w, NF_EUSAGE);
	if (ne[0] % bl || ne[0] > INT64_MAX ||
	    __builtin_mul_overflow(ne[0] / bl * nf_dtype_block_size(type), rows, &size) ||
	    size > INT64_MAX || __builtin_add_overflow(size, pad_to(size, w->alignment), &padded) ||
	    __builtin_add_overflow(w->data_size, padded, &total) || total > INT64_MAX)
		return fail(w, NF_EUSAGE);
	if (w->n_t == w->t_cap) {
		size_t cap = w->t_cap ? w->t_cap * 2 : 16;
		struct wtensor *t = realloc(w->t, cap * sizeof(*t));
		if (!t)
			return fail(w, -ENOMEM);
		w->t = t;
		w->t_cap = cap;
	}
	struct wtensor *t = &w->t[w->n_t];
	memset(t, 0, sizeof(*t));
	t->name = strdup(name);
	if (!t->name)
		return fail(w, -ENOMEM);
	t->type = type;
	t->n_dims = n_dims;
	for (uint32_t d = 0; d < NF_GGUF_MAX_DIMS; d++)
		t->ne[d] = d < n_dims ? ne[d] : 1;
	t->size = size;
	t->offset = w->data_size;
	w->data_size = total;
	w->n_t++;
	return 0;
}

static int write_header(struct nf_gguf_writer *w)
{
	uint32_t version = 3;
	uint64_t n_t = w->n_t, pos;
	int rc = emit(w, w->powerinfer ? "PWRI" : "GGUF", 4);
	if (rc == 0) rc = emit(w, &version, 4);
	if (rc == 0) rc = emit(w, &n_t, 8);
	if (rc == 0) rc = emit(w, &w->n_kv, 8);
	if (rc == 0) rc = emit(w, w->kv.p, w->kv.len);
	pos = 24 + w->kv.len;
	for (size_t i = 0; rc == 0 && i < w->n_t; i++) {
		const struct wtensor *t = &w->t[i];
		uint64_t len = strlen(t->name);
		rc = emit(w, &len, 8);
		if (rc == 0) rc = emit(w, t->name, (size_t)len);
		if (rc == 0) rc = emit(w, &t->n_dims, 4);
		if (rc == 0) rc = emit(w, t->ne, 8 * (size_t)t->n_dims);
		if (rc == 0) rc = emit(w, &t->type, 4);
		if (rc == 0) rc = emit(w, &t->offset, 8);
		pos += 8 + len + 4 + 8 * t->n_dims + 4 + 8;
	}
	if (rc == 0)
		rc = emit_zeros(w, pad_to(pos, w->alignment));
	w->started = true;
	return rc;
}

/* Move past every tensor whose data is complete, writing its padding. */
static int advance(struct nf_gguf_writer *w)
{
	while (w->cur < w->n_t && w->cur_done == w->t[w->cur].size) {
		int rc = emit_zeros(w, pad_to(w->t[w->cur].size, w->alignment));
		if (rc < 0)
			return rc;
		w->cur++;
		w->cur_done = 0;
	}
	return 0;
}

int nf_gguf_writer_write(struct nf_gguf_writer *w, const void *buf, size_t len)
{
	const uint8_t *p = buf;
	int rc;
	if (w->err)
		return w->err;
	if (!w->started && (rc = write_header(w)) < 0)
		return rc;
	while (len) {
		if ((rc = advance(w)) < 0)
			return rc;
		if (w->cur >= w->n_t)
			return fail(w, NF_EUSAGE);
		uint64_t room = w->t[w->cur].size - w->cur_done;
		size_t k = len < room ? len : (size_t)room;
		if ((rc = emit(w, p, k)) < 0)
			return rc;
		w->cur_done += k;
		p += k;
		len -= k;
	}
	return advance(w);
}

int nf_gguf_writer_finish(struct nf_gguf_writer *w, struct nf_diag *diag)
{
	int rc = 0;
	if (!w)
		return nf_diag_fail(diag, NF_EUSAGE, "nf_gguf_writer_finish: NULL writer");
	if (w->err) {
		rc = nf_diag_fail(diag, w->err, "%s: an earlier write failed: %s", w->path,
				  nf_strerror(w->err));
		goto out;
	}
	if (!w->started && (rc = write_header(w)) < 0)
		goto io_fail;
	if ((rc = advance(w)) < 0)
		goto io_fail;
	if (w->cur < w->n_t) {
		rc = nf_diag_fail(diag, NF_EUSAGE, "%s: tensor '%s' got %" PRIu64 " of its %" PRIu64
				  " bytes", w->path, w->t[w->cur].name, w->cur_done, w->t[w->cur].size);
		goto out;
	}
	if ((rc = flush(w)) < 0)
		goto io_fail;
	if (w->sys.fsync(w->fd) < 0) {
		rc = -errno;
		goto io_fail;
	}
	if (w->sys.close(w->fd) < 0) {
		w->fd = -1;
		rc = -errno;
		goto io_fail;
	}
	w->fd = -1;
	if ((rc = nf_io_target_check(&w->sys, w->path, diag)) < 0)
		goto out;
	if (w->sys.rename(w->tmp, w->path) < 0) {
		rc = -errno;
		goto io_fail;
	}
	free(w->tmp);
	w->tmp = NULL;           /* the file now lives under its final name */
	int dfd = w->sys.open(w->dir, O_RDONLY | O_DIRECTORY, 0);
	if (dfd < 0 || w->sys.fsync(dfd) < 0) {
		rc = -errno;
		if (dfd >= 0)
			w->sys.close(dfd);
		nf_diag_fail(diag, rc, "%s: fsync of directory %s failed: %s", w->path, w->dir,
			     nf_strerror(rc));
		goto out;
	}
	w->sys.close(dfd);
	goto out;

io_fail:
	nf_diag_fail(diag, rc, "%s: writing %s failed: %s", w->path, w->tmp ? w->tmp : w->path,
		     nf_strerror(rc));
out:
	nf_gguf_writer_abort(w);
	return rc;
}
