/*
 * model_store.c - a model whose weights come from a store made by
 * `nflash import` (see nflash/model.h, docs/IMPORT.md).
 *
 * Invariants:
 *  1. Every byte used comes through the model's cache (nflash/cache.h),
 *     compute's one door to the store: dense objects are pinned in its
 *     pinned segment, FFNs to unpack read through it, and the engine adds
 *     the FFN segments to the same cache. Reads are O_DIRECT, each
 *     object's (and each FFN extent's) crc32c checked on completion. A
 *     damaged store fails the load with a message naming the object;
 *     nothing is computed on it.
 *  2. Dense objects are exposed as GGUF tensors of the same name and shape,
 *     so model.c binds them exactly as it binds a GGUF's tensors, and the
 *     hyperparameters come from the metadata blob through the GGUF reader.
 *  3. The FFN objects are checked against the hyperparameters at load
 *     (every (layer, expert) present, dim, neuron count, gate, exact down
 *     part, QCOL scales present), so a provider can trust m->ffn.
 *  4. With store_unpack_ffn, bundles are unpacked back into the GGUF layout
 *     with nf_bundle_unpack (byte for byte what the GGUF held), through the
 *     store's permutation, and bound under the GGUF tensor names.
 *  5. The token embedding of a model whose output matrix is not tied to
 *     it is not pinned: its crc32c is checked once at load (read in
 *     pieces, nothing kept), and each forward step reads the rows of its
 *     tokens (nf_cache_read_rows, model_ctx.c). Tied, it is pinned, as the
 *     output matrix needs all of it.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/bundle.h"
#include "nflash/cache.h"
#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "model_impl.h"

#define MEM_ALIGN 4096u
#define UNPACK_CHUNK 64u   /* neurons unpacked together: each down row touched once per chunk */

bool nf_model_path_is_store(const char *path)
{
	return nf_store_probe(path);   /* either superblock, as nf_store_open reads them */
}

static uint64_t round_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

static void tensor_of(struct nf_gguf_tensor *t, const char *name, uint32_t n_dims,
		      const uint64_t *ne, uint32_t type, uint64_t size, const void *data)
{
	memset(t, 0, sizeof(*t));
	t->name = name;
	t->n_dims = n_dims;
	for (uint32_t k = 0; k < NF_GGUF_MAX_DIMS; k++)
		t->ne[k] = k < n_dims ? ne[k] : 1;
	t->type = type;
	t->size = size;
	t->data = data;
}

bool nf_model_is_attn_name(const char *name)
{
	static const char *const kinds[] = { "attn_q", "attn_k", "attn_v", "attn_output" };
	unsigned l;
	int n = 0;
	if (sscanf(name, "blk.%u.%n", &l, &n) != 1 || n == 0)
		return false;
	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		size_t len = strlen(kinds[k]);
		if (!strncmp(name + n, kinds[k], len) && !strcmp(name + n + len, ".weight"))
			return true;
	}
	return false;
}

int nf_model_store_open(struct nf_model *m, const char *path, bool defer_attn,
			struct nf_diag *diag)
{
	const struct nf_store_object **objs = NULL;
	const void **data = NULL;
	int rc = nf_store_open(path, NULL, &m->store, diag);
	if (rc < 0)
		return rc;
	struct nf_store *s = m->store;
	uint32_t n = nf_store_object_count(s);
	const struct nf_store_object *meta = nf_store_object_find(s, NF_STORE_META_NAME);
	if (!meta || meta->kind != NF_STORE_KIND_BLOB)
		return nf_diag_fail(diag, NF_ENOTFOUND,
				    "%s: no metadata blob '%s' (a store not made by nflash import?)",
				    path, NF_STORE_META_NAME);
	/* the load's reads: the cache's defaults (the engine may reopen its
	 * I/O context with its own settings when it adds the FFN segments) */
	struct nf_cache_opts co;
	nf_cache_opts_default(&co);
	co.io.quiet = true;
	if ((rc = nf_cache_open_dense(s, &co.io, &m->cache, diag)) < 0)
		return rc;

	/* The metadata blob and every dense object (attention left in the
	 * store when deferred: bound with no data, model.c) pinned at once. */
	size_t n_dense = 0;
	for (uint32_t i = 0; i < n; i++)
		n_dense += nf_store_object_get(s, i)->kind == NF_STORE_KIND_DENSE;
	m->st = calloc(n_dense ? n_dense : 1, sizeof(*m->st));
	objs = calloc(n_dense + 1, sizeof(*objs));
	data = calloc(n_dense + 1, sizeof(*data));
	size_t *at = calloc(n_dense + 1, sizeof(*at));
	if (!m->st || !objs || !data || !at) {
		rc = nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
		goto out;
	}
	objs[0] = meta;
	size_t k = 1;
	/* The token embedding stays in the store when the output matrix is
	 * its own (not tied): a token reads one row of it (invariant 5). */
	const struct nf_store_object *out_obj = nf_store_object_find(s, "output.weight");
	bool defer_embd = out_obj && out_obj->kind == NF_STORE_KIND_DENSE;
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		/* gate rows (--gate-objects) are the sparse engine's, read per use */
		if (o->kind != NF_STORE_KIND_DENSE || nf_store_is_gate_rows_name(o->name))
			continue;
		if (defer_attn && nf_model_is_attn_name(o->name))
			m->attn_deferred = true;
		else if (defer_embd && !strcmp(o->name, "token_embd.weight"))
			m->embd_obj = o;
		else {
			objs[k] = o;
			at[k++] = m->n_st;
		}
		tensor_of(&m->st[m->n_st++], o->name, o->n_dims, o->shape, o->dtype, o->length, NULL);
	}
	if ((rc = nf_cache_pin_objects(m->cache, objs, (uint32_t)k, data, diag)) < 0 ||
	    (m->embd_obj && (rc = nf_cache_verify_object(m->cache, m->embd_obj, diag)) < 0))
		goto out;
	m->meta = data[0];
	for (size_t j = 1; j < k; j++)
		m->st[at[j]].data = data[j];
	rc = nf_gguf_open_mem(m->meta, meta->length, &m->g, diag);
	if (rc < 0)
		nf_diag_fail(diag, rc, "%s: metadata blob: not a GGUF image", path);
out:
	free(objs);
	free(data);
	free(at);
	return rc;
}

/* Bytes of one FFN's matrices in the GGUF layout: gate, up, down (or down_t). */
static void ffn_sizes(const struct nf_store_object *o, uint64_t *gu, uint64_t *down)
{
	*gu = (uint64_t)o->n_bundles * o->row_bytes;
	if (o->down_transposed)
		*down = (uint64_t)o->n_bundles * o->down_bytes;
	else
		*down = nf_dtype_row_size(o->down_dtype, o->n_bundles) * o->dim;
}

/* Read every FFN and unpack it into GGUF-layout tensors added to m->st. */
static int unpack_all(struct nf_model *m, uint32_t X, struct nf_diag *diag)
{
	const struct nf_model_hparams *hp = &m->hp;
	struct nf_store *s = m->store;
	uint32_t L = hp->n_layer, nx = X ? X : 1;
	uint64_t gu, dn, total = 0, max_obj = 0, max_stride = 0;
	int rc = 0;
	for (uint32_t i = 0; i < L * nx; i++) {
		const struct nf_store_object *o = m->ffn[i].obj;
		ffn_sizes(o, &gu, &dn);
		total += round_up(gu, 64) * 2 + round_up(dn, 64);
		if (o->length > max_obj)
			max_obj = o->length;
		if (o->stride > max_stride)
			max_stride = o->stride;
	}
	struct nf_gguf_tensor *st = realloc(m->st, (m->n_st + 3 * (size_t)L) * sizeof(*st));
	if (st)
		m->st = st;
	m->st_names = calloc(3 * (size_t)L, sizeof(*m->st_names));
	uint32_t al = nf_cache_align(m->cache) > MEM_ALIGN ? nf_cache_align(m->cache) : MEM_ALIGN;
	m->ffn_mem = nf_io_buf_alloc(total ? total : 64, MEM_ALIGN);
	uint8_t *buf = nf_io_buf_alloc(nf_store_object_buf_size(m->ffn[0].obj, al) > max_obj ?
				       nf_store_object_buf_size(m->ffn[0].obj, al) : max_obj, al);
	uint8_t *chunk = nf_io_buf_alloc((size_t)UNPACK_CHUNK * max_stride, MEM_ALIGN);
	if (!st || !m->st_names || !m->ffn_mem || !buf || !chunk) {
		rc = nf_diag_fail(diag, -ENOMEM, "%s: out of memory to unpack %llu bytes of FFN weights",
				  nf_store_path(s), (unsigned long long)total);
		goto out;
	}
	memset(m->ffn_mem, 0, total);
	uint8_t *p = m->ffn_mem;
	for (uint32_t l = 0; l < L && rc == 0; l++) {
		const struct nf_store_object *o0 = m->ffn[l * nx].obj;
		ffn_sizes(o0, &gu, &dn);
		uint8_t *g = p, *u = g + round_up(gu * nx, 64), *d = u + round_up(gu * nx, 64);
		p = d + round_up(dn * nx, 64);
		const char *suffix = X ? "_exps" : "";
		char (*nm)[64] = &m->st_names[3 * (size_t)l];
		snprintf(nm[0], 64, "blk.%u.ffn_gate%s.weight", l, suffix);
		snprintf(nm[1], 64, "blk.%u.ffn_up%s.weight", l, suffix);
		snprintf(nm[2], 64, "blk.%u.ffn_down%s%s.weight", l, o0->down_transposed ? "_t" : "",
			 suffix);
		uint64_t ne_gu[3] = { o0->dim, o0->n_bundles, nx };
		uint64_t ne_d[3] = { o0->n_bundles, o0->dim, nx };
		uint32_t nd = X ? 3 : 2;
		tensor_of(&m->st[m->n_st++], nm[0], nd, ne_gu, o0->dtype, gu * nx, g);
		tensor_of(&m->st[m->n_st++], nm[1], nd, ne_gu, o0->dtype, gu * nx, u);
		tensor_of(&m->st[m->n_st++], nm[2], nd, o0->down_transposed ? ne_gu : ne_d,
			  o0->down_dtype, dn * nx, d);
		for (uint32_t e = 0; e < nx && rc == 0; e++) {
			const struct nf_model_ffn *f = &m->ffn[l * nx + e];
			const struct nf_store_object *o = f->obj;
			if ((rc = nf_cache_read_object(m->cache, o, buf, diag)) < 0)
				break;
			struct nf_bundle_layout lay;
			nf_store_ffn_layout(o, &lay);
			struct nf_bundle_dst dst = {
				.gate = g + e * gu, .up = u + e * gu,
				.down = o->down_transposed ? NULL : d + e * dn,
				.down_t = o->down_transposed ? d + e * dn : NULL,
			};
			for (uint32_t i0 = 0; i0 < o->n_bundles; i0 += UNPACK_CHUNK) {
				uint32_t c = o->n_bundles - i0 < UNPACK_CHUNK ? o->n_bundles - i0 : UNPACK_CHUNK;
				const uint8_t *src = buf + (size_t)o->perm[i0] * o->stride;
				for (uint32_t k = 1; k < c && src != chunk; k++)
					if (o->perm[i0 + k] != o->perm[i0] + k)
						src = chunk;   /* slots not in neuron order: gather */
				for (uint32_t k = 0; k < c && src == chunk; k++)
					memcpy(chunk + (size_t)k * o->stride,
					       buf + (size_t)o->perm[i0 + k] * o->stride, o->stride);
				nf_bundle_unpack_many(&lay, src, i0, c, f->scales, &dst);
			}
		}
	}
	if (rc == 0)
		m->ffn_unpacked = true;
out:
	nf_io_buf_free(chunk);
	nf_io_buf_free(buf);
	return rc;
}

int nf_model_store_ffn(struct nf_model *m, bool unpack, struct nf_diag *diag)
{
	const struct nf_model_hparams *hp = &m->hp;
	struct nf_store *s = m->store;
	const char *path = nf_store_path(s);
	uint32_t X = hp->n_expert, nx = X ? X : 1;
	m->ffn = calloc((size_t)hp->n_layer * nx, sizeof(*m->ffn));
	if (!m->ffn)
		return nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
	for (uint32_t l = 0; l < hp->n_layer; l++) {
		for (uint32_t e = 0; e < nx; e++) {
			const struct nf_store_object *o = nf_store_ffn_find(s, l, e);
			if (!o)
				return nf_diag_fail(diag, NF_ENOTFOUND,
						    "%s: missing the FFN object of layer %u, expert %u",
						    path, l, e);
			if (o->dim != hp->n_embd || o->n_bundles != hp->n_ff)
				return nf_diag_fail(diag, NF_EFORMAT,
						    "%s: FFN object %s: %u neurons of dim %u where the "
						    "model has n_ff %u, n_embd %u", path, o->name,
						    o->n_bundles, o->dim, hp->n_ff, hp->n_embd);
			if (!o->has_gate)
				return nf_diag_fail(diag, NF_EUNSUPPORTED,
						    "%s: FFN object %s: no gate rows (the model needs "
						    "a gated FFN)", path, o->name);
			if (o->down_form == NF_DOWN_ROW && !o->down_transposed &&
			    nf_dtype_block_len(o->down_dtype) != 1)
				return nf_diag_fail(diag, NF_EUNSUPPORTED,
						    "%s: FFN object %s: a %s down row without "
						    "ffn_down_t has no GGUF layout", path, o->name,
						    nf_dtype_name(o->down_dtype));
			m->ffn[l * nx + e].obj = o;
			if (o->down_form == NF_DOWN_QCOL) {
				const struct nf_store_object *sc = nf_store_ffn_scales(s, o);
				const struct nf_gguf_tensor *t = sc ? nf_model_find_tensor(m, sc->name) : NULL;
				if (!t)
					return nf_diag_fail(diag, NF_ENOTFOUND,
							    "%s: FFN object %s: missing its scales "
							    "object %s.down_scales", path, o->name, o->name);
				m->ffn[l * nx + e].scales = t->data;
				/* pinned beside the dense weights, and counted with
				 * them: n_embd x n_ff/32 f16 per FFN (896 MiB on a
				 * Mixtral-shaped store) */
				m->weight_bytes += t->size;
			}
			if (e > 0) {
				const struct nf_store_object *o0 = m->ffn[l * nx].obj;
				if (o->dtype != o0->dtype || o->down_dtype != o0->down_dtype ||
				    o->down_form != o0->down_form ||
				    o->down_transposed != o0->down_transposed)
					return nf_diag_fail(diag, NF_EFORMAT,
							    "%s: FFN objects %s and %s: experts of "
							    "one layer differ in type", path, o0->name,
							    o->name);
			}
		}
	}
	return unpack ? unpack_all(m, X, diag) : 0;
}

int nf_model_attn_load(struct nf_model *m, uint32_t n_layers, struct nf_diag *diag)
{
	const struct nf_model_hparams *hp = &m->hp;
	uint32_t n_l = n_layers < hp->n_layer ? n_layers : hp->n_layer;
	if (!m->attn_deferred || n_l <= m->attn_in_mem)
		return 0;
	if (m->attn_in_mem)
		return nf_diag_fail(diag, NF_EUSAGE, "%s: attention already loaded for %u layers",
				    nf_store_path(m->store), m->attn_in_mem);
	size_t n = (size_t)n_l * 4;
	const void **data = calloc(n, sizeof(*data));
	if (!data)
		return nf_diag_fail(diag, -ENOMEM, "%s: out of memory", nf_store_path(m->store));
	int rc = nf_cache_pin_objects(m->cache, m->attn_obj, (uint32_t)n, data, diag);
	if (rc < 0)
		goto out;
	for (uint32_t il = 0; il < n_l; il++) {
		struct nf_layer_weights *L = &m->layers[il];
		struct nf_weight *w[4] = { &L->wq, &L->wk, &L->wv, &L->wo };
		for (size_t k = 0; k < 4; k++) {
			w[k]->data = data[(size_t)il * 4 + k];
			m->weight_bytes += (uint64_t)w[k]->row_bytes * w[k]->nrows;
		}
	}
	for (size_t i = 0; i < m->n_st; i++)
		for (size_t j = 0; j < n; j++)
			if (!m->st[i].data && !strcmp(m->st[i].name, m->attn_obj[j]->name))
				m->st[i].data = data[j];
	m->attn_in_mem = n_l;
	m->attn_deferred = n_l < hp->n_layer;
out:
	free(data);
	return rc;
}

void nf_model_store_free(struct nf_model *m)
{
	free(m->attn_obj);
	m->attn_obj = NULL;
	nf_cache_close(m->cache);
	m->cache = NULL;
	nf_io_buf_free(m->ffn_mem);
	free(m->st);
	free(m->st_names);
	free(m->ffn);
	nf_store_close(m->store);
	m->meta = NULL;
	m->ffn_mem = NULL;
	m->st = NULL;
	m->st_names = NULL;
	m->ffn = NULL;
	m->store = NULL;
}

int nf_model_ffn_layout(const struct nf_model *m, uint32_t layer, uint32_t expert,
			const struct nf_store_object **obj, struct nf_bundle_layout *layout,
			const uint16_t **scales, bool *down_transposed)
{
	if (!m->store || !m->ffn)
		return NF_ENOTFOUND;
	uint32_t nx = m->hp.n_expert ? m->hp.n_expert : 1;
	if (layer >= m->hp.n_layer || expert >= nx)
		return NF_EUSAGE;
	const struct nf_model_ffn *f = &m->ffn[layer * nx + expert];
	if (obj)
		*obj = f->obj;
	if (layout)
		nf_store_ffn_layout(f->obj, layout);
	if (scales)
		*scales = f->scales;
	if (down_transposed)
		*down_transposed = f->obj->down_transposed;
	return 0;
}
