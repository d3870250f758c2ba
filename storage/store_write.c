/*
 * store_write.c - creating a store by streaming its objects.
 *
 * Invariants:
 *  1. Nothing exists under the final name until every byte, the table and
 *     both superblocks are written and fsync'd; then rename() puts the file
 *     in place and the directory is fsync'd. An interrupted creation leaves
 *     only the temporary file ".<name>.nflash-tmp.<pid>.<hex>" behind
 *     (nf_io_tmp_create), which close() removes when the process survives
 *     and `nflash store clean` when it did not.
 *  2. Bytes are written strictly in file order through one staging buffer,
 *     in large pwrite calls; padding between objects and after bundles is
 *     zero, so checksums cover well-defined bytes.
 *  3. Errors stick: after a failed write or fsync every call returns that
 *     error (STYLE.md rule 6); a failed fsync is never retried.
 *  4. The layout (offsets) is fixed by begin() and mirrors what the reader
 *     validates in store.c.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nflash/bundle.h"
#include "nflash/crc32c.h"
#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "store_format.h"

#define STAGING_BYTES (16u << 20)

struct wobj {
	struct nf_store_object o;
	uint32_t *extent_crc;    /* owned */
	uint32_t *perm;          /* owned */
	uint32_t *bundle_crc;    /* owned */
};

struct nf_store_writer {
	struct nf_io_sys sys;
	char *path, *tmp;
	int fd;
	int dfd;                 /* same file with O_DIRECT, or -1 */
	uint32_t block_size, extent_bundles;
	struct wobj *objs;
	uint32_t n, cap;
	bool begun, finished;
	int err;                 /* sticky */
	/* streaming state */
	uint32_t cur;            /* object being written */
	uint64_t cur_done;       /* dense: bytes; FFN: bundles */
	uint32_t run_crc;        /* dense object or current extent */
	uint64_t total, done;
	uint64_t table_offset, table_length, file_size;
	struct nf_store_profile *profile;  /* owned copy, or NULL */
	uint8_t *stage;
	size_t stage_cap, stage_len;
	uint64_t stage_off;      /* file offset of stage[0] */
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

static int flush_stage(struct nf_store_writer *w)
{
	size_t left = w->stage_len;
	const uint8_t *p = w->stage;
	uint64_t off = w->stage_off;
	/* Whole aligned buffers bypass the page cache: creating a store many
	 * times the size of memory then runs at device speed. */
	int fd = w->dfd >= 0 && off % 4096 == 0 && left % 4096 == 0 ? w->dfd : w->fd;
	int rc = nf_io_pwrite_full(&w->sys, fd, p, left, off);
	if (rc == -EINVAL && fd == w->dfd)   /* O_DIRECT refused for this write after all */
		rc = nf_io_pwrite_full(&w->sys, w->fd, p, left, off);
	if (rc < 0) {
		w->err = rc == NF_ETRUNCATED ? NF_ESHORT : rc;
		return w->err;
	}
	w->stage_off += w->stage_len;
	w->stage_len = 0;
	return 0;
}

/* Room for len contiguous bytes at the end of the staging buffer. */
static uint8_t *stage_reserve(struct nf_store_writer *w, size_t len)
{
	if (w->stage_len + len > w->stage_cap && flush_stage(w) < 0)
		return NULL;
	uint8_t *p = w->stage + w->stage_len;
	w->stage_len += len;
	return p;
}

/* Zero-fill from the current position up to file offset off. */
static int pad_to(struct nf_store_writer *w, uint64_t off)
{
	uint64_t pos = w->stage_off + w->stage_len;
	while (pos < off) {
		size_t room = w->stage_cap - w->stage_len;
		if (room == 0) {
			if (flush_stage(w) < 0)
				return w->err;
			continue;
		}
		size_t k = off - pos < room ? (size_t)(off - pos) : room;
		memset(w->stage + w->stage_len, 0, k);
		w->stage_len += k;
		pos += k;
	}
	return 0;
}

static int append(struct nf_store_writer *w, const void *data, size_t len)
{
	const uint8_t *p = data;
	while (len) {
		size_t room = w->stage_cap - w->stage_len;
		if (room == 0) {
			if (flush_stage(w) < 0)
				return w->err;
			continue;
		}
		size_t k = len < room ? len : room;
		memcpy(w->stage + w->stage_len, p, k);
		w->stage_len += k;
		p += k;
		len -= k;
	}
	return 0;
}

static uint64_t mix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static uint64_t now_ns(clockid_t c)
{
	struct timespec ts;
	clock_gettime(c, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int nf_store_writer_open(const char *path, const struct nf_store_create_opts *o,
			 struct nf_store_writer **out, struct nf_diag *d)
{
	int rc;
	*out = NULL;
	struct nf_store_writer *w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	w->fd = -1;
	w->dfd = -1;
	w->sys = o && o->sys ? *o->sys : nf_io_sys_default;
	w->block_size = o && o->block_size ? o->block_size : NF_STORE_BLOCK_DEFAULT;
	w->extent_bundles = o && o->extent_bundles ? o->extent_bundles : 16;
	if (w->block_size < NF_STORE_BLOCK_MIN || w->block_size > NF_STORE_BLOCK_MAX ||
	    (w->block_size & (w->block_size - 1))) {
		rc = nf_diag_fail(d, NF_EUSAGE, "block size %u is not a power of two in [%u, %u]",
				  w->block_size, NF_STORE_BLOCK_MIN, NF_STORE_BLOCK_MAX);
		goto fail;
	}
	if ((rc = nf_io_target_check(&w->sys, path, d)) < 0)
		goto fail;
	w->path = strdup(path);
	if (!w->path) {
		rc = -ENOMEM;
		goto fail;
	}
	if ((rc = nf_io_tmp_create(&w->sys, path, false, &w->tmp, &w->fd, d)) < 0)
		goto fail;   /* nothing to unlink */
	/* Optional: where O_DIRECT is refused, all writes go through fd. */
	w->dfd = w->sys.open(w->tmp, O_WRONLY | O_DIRECT, 0);
	*out = w;
	return 0;
fail:
	nf_store_writer_close(w);
	return rc;
}

static struct wobj *new_obj(struct nf_store_writer *w, const char *name, struct nf_diag *d,
			    int *rc)
{
	if (w->begun || w->err) {
		*rc = w->err ? w->err : nf_diag_fail(d, NF_EUSAGE, "objects must be declared before begin()");
		return NULL;
	}
	size_t len = strlen(name);
	if (len == 0 || len >= NF_STORE_NAME_MAX) {
		*rc = nf_diag_fail(d, NF_EUSAGE, "object name '%s' must be 1..%d bytes", name,
				   NF_STORE_NAME_MAX - 1);
		return NULL;
	}
	for (uint32_t i = 0; i < w->n; i++)
		if (!strcmp(w->objs[i].o.name, name)) {
			*rc = nf_diag_fail(d, NF_EUSAGE, "object name '%s' declared twice", name);
			return NULL;
		}
	if (w->n == w->cap) {
		uint32_t cap = w->cap ? w->cap * 2 : 64;
		struct wobj *v = realloc(w->objs, cap * sizeof(*v));
		if (!v) {
			*rc = -ENOMEM;
			return NULL;
		}
		w->objs = v;
		w->cap = cap;
	}
	struct wobj *o = &w->objs[w->n];
	memset(o, 0, sizeof(*o));
	memcpy(o->o.name, name, len + 1);
	o->o.index = w->n;
	return o;
}

int nf_store_writer_add_dense(struct nf_store_writer *w, const char *name, uint32_t dtype,
			      uint32_t n_dims, const uint64_t *shape, struct nf_diag *d)
{
	int rc = 0;
	struct wobj *o = new_obj(w, name, d, &rc);
	if (!o)
		return rc;
	if (!nf_dtype_valid(dtype))
		return nf_diag_fail(d, NF_EUSAGE, "object '%s': unknown dtype %u", name, dtype);
	if (n_dims < 1 || n_dims > NF_STORE_MAX_DIMS)
		return nf_diag_fail(d, NF_EUSAGE, "object '%s': n_dims %u not in [1, 4]", name, n_dims);
	uint64_t size = nf_dtype_row_size(dtype, shape[0]);
	if (size == 0)
		return nf_diag_fail(d, NF_EUSAGE, "object '%s': shape[0] %llu is not a multiple of %zu",
				    name, (unsigned long long)shape[0], nf_dtype_block_len(dtype));
	for (uint32_t k = 1; k < n_dims; k++)
		if (__builtin_mul_overflow(size, shape[k], &size))
			return nf_diag_fail(d, NF_EFORMAT, "object '%s': size overflows", name);
	o->o.kind = NF_STORE_KIND_DENSE;
	o->o.dtype = dtype;
	o->o.n_dims = n_dims;
	for (uint32_t k = 0; k < n_dims; k++)
		o->o.shape[k] = shape[k];
	o->o.length = size;
	w->n++;
	return 0;
}

int nf_store_writer_add_ffn(struct nf_store_writer *w, const char *name, uint32_t layer,
			    uint32_t expert, uint32_t dtype, uint32_t dim, uint32_t n_bundles,
			    bool has_gate, uint32_t extent_bundles, struct nf_diag *d)
{
	int rc = 0;
	struct wobj *o = new_obj(w, name, d, &rc);
	if (!o)
		return rc;
	if (!nf_dtype_valid(dtype))
		return nf_diag_fail(d, NF_EUSAGE, "FFN '%s': unknown dtype %u", name, dtype);
	size_t row = nf_dtype_row_size(dtype, dim);
	if (row == 0 || row > UINT32_MAX / 4)
		return nf_diag_fail(d, NF_EUSAGE, "FFN '%s': dim %u is not a whole number of %s blocks",
				    name, dim, nf_dtype_name(dtype));
	if (n_bundles == 0)
		return nf_diag_fail(d, NF_EUSAGE, "FFN '%s': no neurons", name);
	for (uint32_t i = 0; i < w->n; i++) {
		const struct nf_store_object *p = &w->objs[i].o;
		if (p->kind == NF_STORE_KIND_FFN && p->layer == layer && p->expert == expert)
			return nf_diag_fail(d, NF_EUSAGE, "FFN (layer %u, expert %u) declared twice",
					    layer, expert);
	}
	uint32_t rows = has_gate ? 3 : 2;
	uint64_t bundle = rows * row;
	uint64_t stride = align_up(bundle, w->block_size);
	if (stride > UINT32_MAX)
		return nf_diag_fail(d, NF_EUSAGE, "FFN '%s': bundle too large", name);
	uint32_t eb = extent_bundles ? extent_bundles : w->extent_bundles;
	if (eb > n_bundles)
		eb = n_bundles;
	struct nf_store_object *x = &o->o;
	x->kind = NF_STORE_KIND_FFN;
	x->dtype = dtype;
	x->n_dims = 3;
	x->shape[0] = dim;
	x->shape[1] = n_bundles;
	x->shape[2] = rows;
	x->layer = layer;
	x->expert = expert;
	x->n_bundles = n_bundles;
	x->dim = dim;
	x->has_gate = has_gate;
	x->row_bytes = (uint32_t)row;
	x->down_form = NF_DOWN_ROW;
	x->down_dtype = dtype;
	x->down_off = (uint32_t)((rows - 1) * row);
	x->down_bytes = (uint32_t)row;
	x->bundle_bytes = (uint32_t)bundle;
	x->stride = (uint32_t)stride;
	x->extent_bundles = eb;
	x->n_extents = (n_bundles + eb - 1) / eb;
	x->length = (uint64_t)n_bundles * stride;
	o->extent_crc = calloc(x->n_extents, sizeof(uint32_t));
	o->perm = malloc((size_t)n_bundles * sizeof(uint32_t));
	o->bundle_crc = calloc(n_bundles, sizeof(uint32_t));
	if (!o->extent_crc || !o->perm || !o->bundle_crc) {
		free(o->extent_crc);
		free(o->perm);
		free(o->bundle_crc);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < n_bundles; i++)
		o->perm[i] = i;
	x->extent_crc = o->extent_crc;
	x->perm = o->perm;
	x->bundle_crc = o->bundle_crc;
	w->n++;
	return 0;
}

int nf_store_writer_add_ffn_layout(struct nf_store_writer *w, const char *name, uint32_t layer,
				   uint32_t expert, const struct nf_bundle_layout *L,
				   bool down_transposed, uint32_t extent_bundles, struct nf_diag *d)
{
	uint64_t row = nf_dtype_row_size(L->dtype, L->dim);
	if (L->row_bytes != row || L->down_off != (L->has_gate ? 2 : 1) * row ||
	    L->bundle_bytes != (uint64_t)L->down_off + L->down_bytes ||
	    L->stride < L->bundle_bytes || L->stride % w->block_size ||
	    L->down_form > NF_DOWN_QCOL || !nf_dtype_valid(L->down_dtype) ||
	    (L->down_form == NF_DOWN_QCOL && L->n_neurons % nf_dtype_block_len(L->down_dtype)))
		return nf_diag_fail(d, NF_EUSAGE,
				    "FFN '%s': bundle layout does not match the writer's block size %u",
				    name, w->block_size);
	int rc = nf_store_writer_add_ffn(w, name, layer, expert, L->dtype, L->dim, L->n_neurons,
					 L->has_gate, extent_bundles, d);
	if (rc < 0)
		return rc;
	struct nf_store_object *x = &w->objs[w->n - 1].o;
	x->down_form = L->down_form;
	x->down_dtype = L->down_dtype;
	x->down_bytes = L->down_bytes;
	x->down_transposed = down_transposed;
	x->bundle_bytes = L->bundle_bytes;
	x->stride = L->stride;
	x->length = (uint64_t)x->n_bundles * x->stride;
	return 0;
}

int nf_store_writer_add_blob(struct nf_store_writer *w, const char *name, uint64_t len,
			     struct nf_diag *d)
{
	int rc = 0;
	if (len == 0)
		return nf_diag_fail(d, NF_EUSAGE, "blob '%s': empty", name);
	struct wobj *o = new_obj(w, name, d, &rc);
	if (!o)
		return rc;
	o->o.kind = NF_STORE_KIND_BLOB;
	o->o.dtype = 0;
	o->o.n_dims = 1;
	o->o.shape[0] = len;
	o->o.length = len;
	w->n++;
	return 0;
}

int nf_store_writer_set_perm(struct nf_store_writer *w, uint32_t i, const uint32_t *perm,
			     struct nf_diag *d)
{
	if (i >= w->n || w->objs[i].o.kind != NF_STORE_KIND_FFN)
		return nf_diag_fail(d, NF_EUSAGE, "object %u is not an FFN", i);
	struct wobj *o = &w->objs[i];
	uint8_t *seen = calloc(o->o.n_bundles, 1);
	if (!seen)
		return -ENOMEM;
	int rc = 0;
	for (uint32_t k = 0; k < o->o.n_bundles && rc == 0; k++) {
		if (perm[k] >= o->o.n_bundles || seen[perm[k]])
			rc = nf_diag_fail(d, NF_EUSAGE, "FFN '%s': perm[%u] = %u is out of range or repeated",
					  o->o.name, k, perm[k]);
		else
			seen[perm[k]] = 1;
	}
	free(seen);
	if (rc == 0)
		memcpy(o->perm, perm, o->o.n_bundles * sizeof(uint32_t));
	return rc;
}

int nf_store_writer_set_profile(struct nf_store_writer *w, const struct nf_store_profile *p,
				struct nf_diag *d)
{
	if (w->finished || w->err)
		return w->err ? w->err : nf_diag_fail(d, NF_EUSAGE, "set_profile() after finish()");
	if (p->n_objects != w->n)
		return nf_diag_fail(d, NF_EUSAGE, "the profile is for %u objects, the store has %u", p->n_objects,
				    w->n);
	for (uint32_t i = 0; i < w->n; i++) {
		const struct nf_store_object *o = &w->objs[i].o;
		uint32_t want = o->kind == NF_STORE_KIND_FFN ? o->n_bundles : 0;
		if ((p->counts[i] ? p->lens[i] : 0) != want)
			return nf_diag_fail(d, NF_EUSAGE, "the profile has %u counts for object '%s' (%u expected)",
					    p->counts[i] ? p->lens[i] : 0, o->name, want);
	}
	struct nf_store_profile *c = calloc(1, sizeof(*c));
	if (!c || !(c->counts = calloc(w->n ? w->n : 1, sizeof(*c->counts))) ||
	    !(c->lens = calloc(w->n ? w->n : 1, sizeof(*c->lens)))) {
		nf_store_profile_free(c);
		return -ENOMEM;
	}
	c->n_objects = w->n;
	if (p->order && !(c->order = calloc(w->n ? w->n : 1, sizeof(*c->order)))) {
		nf_store_profile_free(c);
		return -ENOMEM;
	}
	c->tokens = p->tokens;
	c->source = p->source;
	c->created_ns = p->created_ns;
	for (uint32_t i = 0; i < w->n; i++) {
		if (!p->counts[i])
			continue;
		if (!(c->counts[i] = malloc(4ull * p->lens[i]))) {
			nf_store_profile_free(c);
			return -ENOMEM;
		}
		memcpy(c->counts[i], p->counts[i], 4ull * p->lens[i]);
		c->lens[i] = p->lens[i];
		if (p->order && p->order[i]) {
			if (!(c->order[i] = malloc(4ull * (p->lens[i] ? p->lens[i] : 1)))) {
				nf_store_profile_free(c);
				return -ENOMEM;
			}
			memcpy(c->order[i], p->order[i], 4ull * p->lens[i]);
		}
	}
	nf_store_profile_free(w->profile);
	w->profile = c;
	return 0;
}

static void advance_object(struct nf_store_writer *w)
{
	while (w->cur < w->n) {
		struct nf_store_object *o = &w->objs[w->cur].o;
		uint64_t need = o->kind == NF_STORE_KIND_FFN ? o->n_bundles : o->length;
		if (w->cur_done < need)
			return;
		if (o->kind != NF_STORE_KIND_FFN)
			o->crc = w->run_crc;
		w->cur++;
		w->cur_done = 0;
		w->run_crc = 0;
	}
}

int nf_store_writer_begin(struct nf_store_writer *w, struct nf_diag *d)
{
	if (w->err)
		return w->err;
	if (w->begun)
		return nf_diag_fail(d, NF_EUSAGE, "begin() called twice");
	uint64_t pos = nf_store_data_start(w->block_size);
	uint64_t aux = 0, max_stride = 0;
	for (uint32_t i = 0; i < w->n; i++) {
		struct nf_store_object *o = &w->objs[i].o;
		o->offset = align_up(pos, w->block_size);
		pos = o->offset + o->length;
		w->total += o->length;
		if (o->kind == NF_STORE_KIND_FFN) {
			aux += 4ull * ((uint64_t)o->n_extents + 2ull * o->n_bundles);   /* + bundle_crc */
			if (o->stride > max_stride)
				max_stride = o->stride;
		}
	}
	w->table_offset = align_up(pos, w->block_size);
	w->table_length = (uint64_t)w->n * sizeof(struct nf_store_obj_disk) + aux;
	w->file_size = align_up(w->table_offset + w->table_length, w->block_size);
	w->stage_cap = STAGING_BYTES;
	if (max_stride * 2 > w->stage_cap)
		w->stage_cap = align_up(max_stride * 2, w->block_size);
	w->stage = nf_io_buf_alloc(w->stage_cap, 4096);
	if (!w->stage)
		return nf_diag_fail(d, -ENOMEM, "no memory for a %zu-byte write buffer", w->stage_cap);
	/* Superblock slots stay zero until finish() fills them. */
	memset(w->stage, 0, NF_STORE_SB_AREA);
	w->stage_off = 0;
	w->stage_len = 0;
	w->begun = true;
	w->cur = 0;
	w->cur_done = 0;
	w->run_crc = 0;
	advance_object(w);   /* skips empty objects */
	return 0;
}

uint32_t nf_store_writer_object_count(const struct nf_store_writer *w)
{
	return w->n;
}

const struct nf_store_object *nf_store_writer_object(const struct nf_store_writer *w, uint32_t i)
{
	return i < w->n ? &w->objs[i].o : NULL;
}

uint64_t nf_store_writer_total(const struct nf_store_writer *w)
{
	return w->total;
}

uint64_t nf_store_writer_done(const struct nf_store_writer *w)
{
	return w->done;
}

static int current(struct nf_store_writer *w, uint32_t kind, struct nf_store_object **out)
{
	if (w->err)
		return w->err;
	if (!w->begun || w->finished || w->cur >= w->n)
		return NF_EUSAGE;
	struct nf_store_object *o = &w->objs[w->cur].o;
	/* Blobs are written as dense bytes. */
	if (o->kind != kind && !(kind == NF_STORE_KIND_DENSE && o->kind == NF_STORE_KIND_BLOB))
		return NF_EUSAGE;
	if (w->cur_done == 0 && pad_to(w, o->offset) < 0)
		return w->err;
	*out = o;
	return 0;
}

int nf_store_writer_write_dense(struct nf_store_writer *w, const void *data, size_t len)
{
	const uint8_t *p = data;
	while (len) {
		struct nf_store_object *o = NULL;
		int rc = current(w, NF_STORE_KIND_DENSE, &o);
		if (rc < 0)
			return rc;
		uint64_t left = o->length - w->cur_done;
		size_t k = len < left ? len : (size_t)left;
		w->run_crc = nf_crc32c(w->run_crc, p, k);
		if (append(w, p, k) < 0)
			return w->err;
		w->cur_done += k;
		w->done += k;
		p += k;
		len -= k;
		advance_object(w);
	}
	return 0;
}

static int put_bundle(struct nf_store_writer *w, const void *gate, const void *up, const void *down)
{
	struct nf_store_object *o = NULL;
	int rc = current(w, NF_STORE_KIND_FFN, &o);
	if (rc < 0)
		return rc;
	if ((gate != NULL) != o->has_gate)
		return NF_EUSAGE;
	uint8_t *p = stage_reserve(w, o->stride);
	if (!p)
		return w->err;
	uint8_t *q = p;
	if (gate) {
		memcpy(q, gate, o->row_bytes);
		q += o->row_bytes;
	}
	memcpy(q, up, o->row_bytes);
	memcpy(p + o->down_off, down, o->down_bytes);
	memset(p + o->bundle_bytes, 0, o->stride - o->bundle_bytes);
	uint32_t slot = (uint32_t)w->cur_done;
	uint32_t e = slot / o->extent_bundles;
	w->run_crc = nf_crc32c(w->run_crc, p, o->stride);
	w->objs[w->cur].bundle_crc[slot] = nf_crc32c(0, p, o->bundle_bytes);
	if ((slot + 1) % o->extent_bundles == 0 || slot + 1 == o->n_bundles) {
		w->objs[w->cur].extent_crc[e] = w->run_crc;
		w->run_crc = 0;
	}
	w->cur_done++;
	w->done += o->stride;
	advance_object(w);
	return 0;
}

int nf_store_writer_write_bundle(struct nf_store_writer *w, const void *gate, const void *up,
				 const void *down)
{
	return put_bundle(w, gate, up, down);
}

int nf_store_writer_write_bundles(struct nf_store_writer *w, const void *bundles, uint32_t n)
{
	const uint8_t *p = bundles;
	for (uint32_t i = 0; i < n; i++) {
		struct nf_store_object *o = NULL;
		int rc = current(w, NF_STORE_KIND_FFN, &o);
		if (rc < 0)
			return rc;
		uint32_t r = o->row_bytes;
		rc = put_bundle(w, o->has_gate ? p : NULL, p + (o->has_gate ? r : 0), p + o->down_off);
		if (rc < 0)
			return rc;
		p += o->stride;
	}
	return 0;
}

static int fsync_dir(struct nf_store_writer *w)
{
	char *dcopy = strdup(w->path);
	if (!dcopy)
		return -ENOMEM;
	int rc = 0;
	int fd = w->sys.open(dirname(dcopy), O_RDONLY | O_DIRECTORY, 0);
	if (fd < 0)
		rc = -errno;
	else {
		if (w->sys.fsync(fd) < 0)
			rc = -errno;
		w->sys.close(fd);
	}
	free(dcopy);
	return rc;
}

static int write_table(struct nf_store_writer *w, uint32_t *table_crc)
{
	const struct nf_store_object **v = malloc((w->n ? w->n : 1) * sizeof(*v));
	uint8_t *tbl = NULL;
	uint64_t len;
	if (!v)
		return w->err = -ENOMEM;
	for (uint32_t i = 0; i < w->n; i++)
		v[i] = &w->objs[i].o;
	int rc = nf_store_table_encode(v, w->n, &tbl, &len, table_crc);
	free(v);
	if (rc < 0)
		return w->err = rc;
	rc = append(w, tbl, len);
	free(tbl);
	return rc;
}

int nf_store_writer_finish(struct nf_store_writer *w, struct nf_diag *d)
{
	if (w->err)
		return nf_diag_fail(d, w->err, "%s: an earlier write failed: %s", w->path,
				    nf_strerror(w->err));
	if (!w->begun || w->finished)
		return nf_diag_fail(d, NF_EUSAGE, "%s: finish() without begin(), or twice", w->path);
	if (w->cur < w->n) {
		const struct nf_store_object *o = &w->objs[w->cur].o;
		return nf_diag_fail(d, NF_EUSAGE, "%s: object '%s' is incomplete (%llu of %llu %s written)",
				    w->path, o->name, (unsigned long long)w->cur_done,
				    (unsigned long long)(o->kind == NF_STORE_KIND_FFN ? o->n_bundles : o->length),
				    o->kind == NF_STORE_KIND_FFN ? "bundles" : "bytes");
	}
	uint32_t table_crc = 0;
	int rc;
	if (pad_to(w, w->table_offset) < 0 || write_table(w, &table_crc) < 0 ||
	    pad_to(w, w->file_size) < 0) {
		rc = w->err;
		return nf_diag_fail(d, rc, "%s: writing %s: %s", w->path, w->tmp, nf_strerror(rc));
	}
	/* The profile section after the table (docs/FORMAT.md item 19). */
	uint64_t prof_off = 0, prof_used = 0;
	uint32_t prof_crc = 0;
	if (w->profile) {
		uint8_t *pb;
		uint64_t plen;
		if ((rc = nf_store_profile_encode(w->profile, w->block_size, &pb, &plen, &prof_used, &prof_crc)) < 0)
			return nf_diag_fail(d, w->err = rc, "%s: encoding the profile: %s", w->path, nf_strerror(rc));
		prof_off = w->file_size;
		rc = append(w, pb, plen);
		free(pb);
		if (rc < 0)
			return nf_diag_fail(d, w->err, "%s: writing %s: %s", w->path, w->tmp, nf_strerror(w->err));
		w->file_size += plen;
	}
	if (flush_stage(w) < 0) {
		rc = w->err;
		return nf_diag_fail(d, rc, "%s: writing %s: %s", w->path, w->tmp, nf_strerror(rc));
	}
	if (w->sys.fsync(w->fd) < 0 || (w->dfd >= 0 && w->sys.fsync(w->dfd) < 0)) {
		w->err = -errno;
		return nf_diag_fail(d, w->err, "%s: fsync: %s", w->tmp, nf_strerror(w->err));
	}
	/* Superblocks last: generation 0 in slot 0, 1 in slot 1, same table. */
	memset(w->stage, 0, NF_STORE_SB_AREA);
	struct nf_store_info in;
	memset(&in, 0, sizeof(in));
	in.created_ns = now_ns(CLOCK_REALTIME);
	uint64_t id0 = mix64(in.created_ns ^ ((uint64_t)getpid() << 20)), id1 = mix64(id0 ^ w->file_size);
	memcpy(in.uuid, &id0, 8);
	memcpy(in.uuid + 8, &id1, 8);
	in.block_size = w->block_size;
	in.n_objects = w->n;
	in.file_size = w->file_size;
	in.table_offset = w->table_offset;
	in.table_length = w->table_length;
	in.profile_offset = prof_off;
	in.profile_length = prof_used;
	in.profile_crc = prof_crc;
	/* Features old readers must refuse (docs/FORMAT.md item 16). */
	for (uint32_t i = 0; i < w->n; i++) {
		const struct nf_store_object *o = &w->objs[i].o;
		if (o->kind == NF_STORE_KIND_BLOB)
			in.incompat |= NF_STORE_INCOMPAT_BLOB;
		if (o->kind == NF_STORE_KIND_FFN &&
		    (o->down_form != NF_DOWN_ROW || o->down_dtype != o->dtype))
			in.incompat |= NF_STORE_INCOMPAT_DOWN_FORMS;
	}
	in.compat |= NF_STORE_COMPAT_BUNDLE_CRC;   /* every FFN written here has them (item 22) */
	for (int slot = 0; slot < 2; slot++) {
		struct nf_store_sb_disk sb;
		in.generation = (uint64_t)slot;
		nf_store_sb_build(&sb, &in, table_crc);
		memcpy(w->stage + slot * NF_STORE_SB_SLOT, &sb, sizeof(sb));
	}
	w->stage_off = 0;
	w->stage_len = NF_STORE_SB_AREA;
	if (flush_stage(w) < 0)
		return nf_diag_fail(d, w->err, "%s: writing superblocks: %s", w->tmp, nf_strerror(w->err));
	if (w->sys.fsync(w->fd) < 0) {
		w->err = -errno;
		return nf_diag_fail(d, w->err, "%s: fsync: %s", w->tmp, nf_strerror(w->err));
	}
	if ((rc = nf_io_target_check(&w->sys, w->path, d)) < 0) {
		w->err = rc;
		return rc;
	}
	if (w->sys.rename(w->tmp, w->path) < 0) {
		w->err = -errno;
		return nf_diag_fail(d, w->err, "%s: rename from %s: %s", w->path, w->tmp,
				    nf_strerror(w->err));
	}
	w->finished = true;
	rc = fsync_dir(w);
	if (rc < 0) {
		/* The store is in place but its name may not survive a crash. */
		w->err = rc;
		return nf_diag_fail(d, rc, "%s: fsync of the directory: %s", w->path, nf_strerror(rc));
	}
	return 0;
}

void nf_store_writer_close(struct nf_store_writer *w)
{
	if (!w)
		return;
	if (w->fd >= 0)
		w->sys.close(w->fd);
	if (w->dfd >= 0)
		w->sys.close(w->dfd);
	if (w->tmp && !w->finished)
		w->sys.unlink(w->tmp);
	for (uint32_t i = 0; i < w->n; i++) {
		free(w->objs[i].extent_crc);
		free(w->objs[i].perm);
		free(w->objs[i].bundle_crc);
	}
	free(w->objs);
	nf_store_profile_free(w->profile);
	nf_io_buf_free(w->stage);
	free(w->tmp);
	free(w->path);
	free(w);
}
