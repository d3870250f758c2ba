/*
 * store_relayout.c - copy a store with each FFN's bundles in hotness
 * order (nflash/store.h, nf_store_relayout).
 *
 * Invariants:
 *  1. Only the placement of bundles (and, when asked, the block size that
 *     aligns them) changes: every object keeps its name,
 *     kind, type, shape and bytes; an FFN's bundle of neuron n moves to
 *     slot rank(n) and perm[n] = rank(n), so every reader that maps neuron
 *     ids through perm computes exactly what it computed on the input.
 *     rank is the profile's order where it has one (hot first, then
 *     co-activated neurons side by side: nf_coact_order), else descending
 *     count, ties in neuron order.
 *  2. Every byte copied was checked against its crc32c when read (the I/O
 *     context verifies whole objects and extents), the writer recomputes
 *     the extent checksums for the new order, and the copy is re-read and
 *     checked before success is reported.
 *  3. Creation is the writer's: nothing appears under the output name
 *     unless the copy is complete and fsync'd.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/bundle.h"
#include "nflash/io.h"
#include "nflash/store.h"

struct rank_key {
	uint32_t count, neuron;
};

static int cmp_rank(const void *a, const void *b)
{
	const struct rank_key *x = a, *y = b;
	if (x->count != y->count)
		return x->count > y->count ? -1 : 1;
	return x->neuron < y->neuron ? -1 : x->neuron > y->neuron;
}

/* order[r] = neuron at rank r; perm[n] = rank of neuron n. */
static int hot_order(const uint32_t *counts, uint32_t n, uint32_t *order, uint32_t *perm)
{
	struct rank_key *k = malloc((size_t)n * sizeof(*k));
	if (!k)
		return -ENOMEM;
	for (uint32_t j = 0; j < n; j++)
		k[j] = (struct rank_key){ counts[j], j };
	qsort(k, n, sizeof(*k), cmp_rank);
	for (uint32_t r = 0; r < n; r++) {
		order[r] = k[r].neuron;
		perm[k[r].neuron] = r;
	}
	free(k);
	return 0;
}

/* The layout of FFN object i: the profile's order where it has a valid
 * one, else hot_order. */
static int new_order(const struct nf_store_profile *p, bool by_count, uint32_t i, uint32_t n, uint32_t *order,
		     uint32_t *perm)
{
	if (by_count || !p->order || !p->order[i] || !nf_store_profile_order_valid(p->order[i], n))
		return hot_order(p->counts[i], n, order, perm);
	memcpy(order, p->order[i], (size_t)n * sizeof(*order));
	for (uint32_t r = 0; r < n; r++)
		perm[order[r]] = r;
	return 0;
}

static void read_done(void *cookie, int result)
{
	*(int *)cookie = result;
}

/* Read object ob whole (checked) into buf. */
static int read_whole(struct nf_io_ctx *io, const struct nf_store_object *ob, void *buf)
{
	int res = 1;
	int rc = nf_io_ctx_read_object(io, ob, buf, read_done, &res);
	if (rc == 0)
		rc = nf_io_ctx_wait(io, 0, -1);
	return rc < 0 ? rc : res;
}

static uint64_t max_buf(const struct nf_store *s, uint32_t bs)
{
	uint64_t m = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		uint64_t b = nf_store_object_buf_size(nf_store_object_get(s, i), bs);
		m = b > m ? b : m;
	}
	return m;
}

/* Re-read every object of the store at path through a verifying context. */
static int verify_copy(const char *path, const struct nf_store_open_opts *so,
		       const struct nf_store_profile *p, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	struct nf_io_ctx *io = NULL;
	struct nf_store_profile *q = NULL;
	void *buf = NULL;
	int rc = nf_store_open(path, so, &s, d);
	if (rc < 0)
		return rc;
	if ((rc = nf_io_ctx_open(s, NULL, &io, d)) < 0)
		goto out;
	uint32_t al = nf_io_ctx_align(io);
	if (!(buf = nf_io_buf_alloc(max_buf(s, al), al))) {
		rc = nf_diag_fail(d, -ENOMEM, "%s: no memory to verify the copy", path);
		goto out;
	}
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (!ob->length)
			continue;
		if ((rc = read_whole(io, ob, buf)) < 0) {
			nf_diag_fail(d, rc, "%s: verifying '%s' after writing: %s", path, ob->name, nf_strerror(rc));
			goto out;
		}
	}
	if ((rc = nf_store_profile_read(s, &q, d)) < 0)
		goto out;
	for (uint32_t i = 0; i < q->n_objects; i++)
		if (q->lens[i] != p->lens[i] ||
		    (q->lens[i] && memcmp(q->counts[i], p->counts[i], 4ull * q->lens[i])) ||
		    (q->order && q->order[i] && (!p->order || !p->order[i] ||
						 memcmp(q->order[i], p->order[i], 4ull * q->lens[i])))) {
			rc = nf_diag_fail(d, NF_ECHECKSUM, "%s: the profile read back differs (object %u)", path, i);
			goto out;
		}
out:
	nf_store_profile_free(q);
	nf_io_buf_free(buf);
	nf_io_ctx_close(io);
	nf_store_close(s);
	return rc;
}

int nf_store_relayout(const char *in, const char *out, const struct nf_store_relayout_opts *o,
		      struct nf_diag *d)
{
	struct nf_store_open_opts so = { .sys = o ? o->sys : NULL };
	struct nf_store *s = NULL;
	struct nf_store_profile *own = NULL;
	struct nf_store_writer *w = NULL;
	struct nf_io_ctx *io = NULL;
	uint32_t *order = NULL, *perm = NULL;
	uint8_t *buf = NULL;
	int rc = nf_store_open(in, &so, &s, d);
	if (rc < 0)
		return rc;
	const struct nf_store_profile *p = o ? o->profile : NULL;
	if (!p) {
		if ((rc = nf_store_profile_read(s, &own, d)) < 0)
			goto out;
		p = own;
	}
	uint32_t n = nf_store_object_count(s);
	if (p->n_objects != n) {
		rc = nf_diag_fail(d, NF_EUSAGE, "%s: the profile is for %u objects, the store has %u", in,
				  p->n_objects, n);
		goto out;
	}
	const struct nf_store_info *info = nf_store_info(s);
	uint32_t bs = o && o->block_size ? o->block_size : info->block_size;
	if (bs < NF_STORE_BLOCK_MIN || bs > NF_STORE_BLOCK_MAX || (bs & (bs - 1))) {
		rc = nf_diag_fail(d, NF_EUSAGE, "%s: block size %u is not a power of two in [%u, %u]", out, bs,
				  NF_STORE_BLOCK_MIN, NF_STORE_BLOCK_MAX);
		goto out;
	}
	struct nf_store_create_opts co = { .block_size = bs, .sys = so.sys };
	if ((rc = nf_store_writer_open(out, &co, &w, d)) < 0)
		goto out;
	uint32_t max_n = 0;
	for (uint32_t i = 0; i < n && rc == 0; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_DENSE) {
			rc = nf_store_writer_add_dense(w, ob->name, ob->dtype, ob->n_dims, ob->shape, d);
		} else if (ob->kind == NF_STORE_KIND_BLOB) {
			rc = nf_store_writer_add_blob(w, ob->name, ob->length, d);
		} else {
			struct nf_bundle_layout L;
			nf_store_ffn_layout(ob, &L);
			L.stride = (L.bundle_bytes + bs - 1) / bs * bs;   /* the copy's alignment */
			rc = nf_store_writer_add_ffn_layout(w, ob->name, ob->layer, ob->expert, &L,
							    ob->down_transposed, ob->extent_bundles, d);
			if (p->lens[i] != ob->n_bundles)
				rc = nf_diag_fail(d, NF_EUSAGE, "%s: the profile has %u counts for '%s' (%u neurons)",
						  in, p->lens[i], ob->name, ob->n_bundles);
			max_n = ob->n_bundles > max_n ? ob->n_bundles : max_n;
		}
	}
	if (rc < 0)
		goto out;
	order = malloc((max_n ? max_n : 1) * sizeof(uint32_t));
	perm = malloc((max_n ? max_n : 1) * sizeof(uint32_t));
	if (!order || !perm) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_FFN)
			continue;
		if ((rc = new_order(p, o && o->by_count, i, ob->n_bundles, order, perm)) < 0 ||
		    (rc = nf_store_writer_set_perm(w, i, perm, d)) < 0)
			goto out;
	}
	if ((rc = nf_store_writer_set_profile(w, p, d)) < 0 || (rc = nf_store_writer_begin(w, d)) < 0)
		goto out;
	if ((rc = nf_io_ctx_open(s, NULL, &io, d)) < 0)
		goto out;
	uint32_t al = nf_io_ctx_align(io);
	if (!(buf = nf_io_buf_alloc(max_buf(s, al), al))) {
		rc = nf_diag_fail(d, -ENOMEM, "%s: no memory for a copy buffer", in);
		goto out;
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->length && (rc = read_whole(io, ob, buf)) < 0) {
			nf_diag_fail(d, rc, "%s: reading '%s': %s", in, ob->name, nf_strerror(rc));
			goto out;
		}
		if (ob->kind != NF_STORE_KIND_FFN) {
			rc = nf_store_writer_write_dense(w, buf, ob->length);
		} else {
			if ((rc = new_order(p, o && o->by_count, i, ob->n_bundles, order, perm)) < 0)
				goto out;
			for (uint32_t r = 0; r < ob->n_bundles && rc == 0; r++)
				rc = nf_store_writer_write_bundles(w, buf + (uint64_t)ob->perm[order[r]] * ob->stride, 1);
		}
		if (rc < 0) {
			nf_diag_fail(d, rc, "%s: writing '%s': %s", out, ob->name, nf_strerror(rc));
			goto out;
		}
		if (o && o->progress)
			o->progress(o->progress_user, nf_store_writer_done(w), nf_store_writer_total(w));
	}
	nf_io_ctx_close(io);
	io = NULL;
	nf_io_buf_free(buf);
	buf = NULL;
	if ((rc = nf_store_writer_finish(w, d)) < 0)
		goto out;
	if ((rc = verify_copy(out, &so, p, d)) < 0)
		(so.sys ? so.sys : &nf_io_sys_default)->unlink(out);   /* never leave a bad copy */
out:
	nf_io_buf_free(buf);
	nf_io_ctx_close(io);
	nf_store_writer_close(w);
	free(order);
	free(perm);
	nf_store_profile_free(own);
	nf_store_close(s);
	return rc;
}
