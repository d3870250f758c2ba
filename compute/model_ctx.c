/*
 * model_ctx.c - a running sequence: KV cache, scratch, thread pool, and the
 * layer loop (embedding -> [attention, FFN] x n_layer -> norm -> logits).
 *
 * Invariants:
 *  1. nf_ctx_open allocates everything; nf_ctx_eval and all it calls never
 *     allocate (llama2.c's rule), so decode latency has no malloc in it.
 *  2. A batch of nb > 1 tokens goes through gemm, one token through gemv;
 *     per dot product both compute the same sums (the kernels guarantee
 *     it), so batched prefill equals token-by-token prefill.
 *  3. Work is split by output rows (matrix products) or by tokens/heads
 *     (everything else) so each thread writes disjoint memory: no locks,
 *     results independent of the thread count.
 *  4. Only the last token of a batch goes through the output norm and the
 *     vocabulary projection; logits are those of the last evaluated token.
 *     With many sequences (nf_ctx_eval_seqs), the last row of each one
 *     does, into that sequence's logits.
 *  5. A row's result depends only on its own sequence's tokens: one
 *     decode step of many sequences equals each of them evaluated alone,
 *     bit for bit (invariant 2 for the products, attention per row, and
 *     the FFN providers' own rule: the sparse engine's batch equals its
 *     tokens one by one).
 */
#include <errno.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "nflash/cache.h"
#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "nflash/stream.h"
#include "model_impl.h"

struct nf_ctx_params nf_ctx_defaults(void)
{
	return (struct nf_ctx_params){
		.n_ctx = 0, .n_batch = 512, .n_threads = 0, .kv_type = NF_KV_F32, .kernels = NULL,
	};
}

/* ---- parallel helpers --------------------------------------------------- */

void nf_ctx_run(struct nf_ctx *c, nf_pool_fn fn, void *arg)
{
	if (c->pool)
		nf_pool_run(c->pool, fn, arg);
	else
		fn(arg, 0, 1);
}

struct par_job {
	size_t n;
	void (*fn)(void *arg, size_t b0, size_t b1);
	void *arg;
};

static void par_worker(void *arg, int ith, int nth)
{
	struct par_job *j = arg;
	size_t b0, b1;
	nf_split(j->n, 1, ith, nth, &b0, &b1);
	if (b0 < b1)
		j->fn(j->arg, b0, b1);
}

void nf_ctx_parallel(struct nf_ctx *c, size_t n, void (*fn)(void *arg, size_t b0, size_t b1),
		     void *arg)
{
	if (!c->pool || n < 2) {
		fn(arg, 0, n);
		return;
	}
	struct par_job j = { .n = n, .fn = fn, .arg = arg };
	nf_pool_run(c->pool, par_worker, &j);
}

struct prep_job {
	const struct nf_kernels *k;
	int kt;
	const float *x;
	size_t ldx, n;
	char *dst;
	size_t stride;
};

static void prep_rows(void *arg, size_t b0, size_t b1)
{
	struct prep_job *j = arg;
	for (size_t b = b0; b < b1; b++)
		j->k->act_prepare[j->kt](j->x + b * j->ldx, j->dst + b * j->stride, j->n);
}

struct mm_job {
	const struct nf_kernels *k;
	const struct nf_mm *mm;
	size_t n_mm;
	const void *xq;
	size_t xq_stride, nb;
	size_t cs[4];          /* rows per chunk of each product */
	size_t c0[5];          /* first chunk of each product; c0[n_mm]: total */
	_Atomic size_t next;   /* next chunk to take */
	int even;              /* NFLASH_MM_EVEN: one chunk a thread, in thread order */
	struct nf_cache *poll; /* NULL, or the cache to poll between chunks */
	_Atomic uint64_t poll_ns; /* when it was last polled */
};

/* A poll between chunks at most this often: one syscall per about 0.1 ms
 * of the product, which is what a device with 100K reads a second needs
 * to stay fed, and nothing measurable beside the product. */
#define MM_POLL_NS 100000u

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Between two chunks: the thread that finds MM_POLL_NS passed since the
 * last poll polls (nf_cache_poll); the checksums of what landed run on it
 * while the other threads take its chunks. */
static void mm_poll(struct mm_job *j)
{
	uint64_t now = mono_ns(), last = atomic_load_explicit(&j->poll_ns, memory_order_relaxed);
	if (now - last < MM_POLL_NS ||
	    !atomic_compare_exchange_strong_explicit(&j->poll_ns, &last, now, memory_order_relaxed,
						     memory_order_relaxed))
		return;
	nf_cache_poll(j->poll);
}

/* Rows [r0, r1) of one product. */
static void mm_rows(const struct mm_job *j, const struct nf_mm *m, size_t r0, size_t r1)
{
	const struct nf_weight *w = m->w;
	const char *wr = (const char *)w->data + r0 * w->row_bytes;
	if (w->packed) {
		/* packed by nf_model_repack for the best table */
		const struct nf_kernels *k = j->k->gemv_x8[w->kt] ? j->k : nf_kernels_get();
		if (j->nb == 1)
			k->gemv_x8[w->kt](w->n, r1 - r0, wr, j->xq, m->y + r0);
		else
			k->gemm_x8[w->kt](w->n, r1 - r0, wr, j->nb, j->xq, j->xq_stride, m->y + r0, m->ldy);
	} else if (j->nb == 1)
		/* one column: F16 in vec_dot's order, as ggml (nf_ktype_column) */
		j->k->gemv[nf_ktype_column(w->kt, 1)](w->n, r1 - r0, wr, w->row_bytes, j->xq, m->y + r0);
	else
		j->k->gemm[w->kt](w->n, r1 - r0, wr, w->row_bytes, j->nb, j->xq, j->xq_stride, m->y + r0,
				  m->ldy);
}

/*
 * The products' rows are cut into chunks (MM_CHUNKS per thread and
 * product, in multiples of 16 rows so SIMD kernels stay on full tiles and
 * 8-row groups are never cut) that the threads take in turn from one
 * counter: a thread slowed by the host or by memory takes fewer, where an
 * even split left the other waiting at the end of every product. A row's
 * sum does not depend on who computes it, so the bits are the same.
 */
#define MM_CHUNKS 4

/* Embedding rows read from the store at a time (model_store.c invariant 5). */
#define EMBD_ROWS 64u

static void mm_worker(void *arg, int ith, int nth)
{
	struct mm_job *j = arg;
	size_t i = 0, total = j->c0[j->n_mm];
	if (j->even) {
		for (size_t q = 0; q < j->n_mm; q++) {
			const struct nf_mm *m = &j->mm[q];
			size_t r0 = (size_t)ith * j->cs[q], r1 = r0 + j->cs[q];
			if (r0 < m->w->nrows)
				mm_rows(j, m, r0, r1 < m->w->nrows ? r1 : m->w->nrows);
		}
		return;
	}
	for (;;) {
		size_t c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
		if (c >= total)
			break;
		while (c >= j->c0[i + 1])
			i++;
		const struct nf_mm *m = &j->mm[i];
		size_t r0 = (c - j->c0[i]) * j->cs[i], r1 = r0 + j->cs[i];
		mm_rows(j, m, r0, r1 < m->w->nrows ? r1 : m->w->nrows);
		if (j->poll)
			mm_poll(j);
	}
}

/* Chunk each product of j for nth threads. */
static void mm_chunk(struct mm_job *j, int nth)
{
	static _Atomic int even = -1; /* the old even split, for benchmarks against it */
	if (even < 0)
		even = getenv("NFLASH_MM_EVEN") != NULL;
	j->even = even;
	j->c0[0] = 0;
	for (size_t i = 0; i < j->n_mm; i++) {
		const struct nf_weight *w = j->mm[i].w;
		size_t align = w->nrows >= 16 * (size_t)nth ? 16 : w->packed ? 8 : 1;
		size_t units = (w->nrows + align - 1) / align;
		size_t per = nth > 1 ? (size_t)nth * (even ? 1 : MM_CHUNKS) : 1;
		size_t cs = (units + per - 1) / per * align;
		j->cs[i] = cs;
		j->c0[i + 1] = j->c0[i] + (w->nrows + cs - 1) / cs;
	}
	atomic_init(&j->next, 0);
}

void nf_ctx_matmul(struct nf_ctx *c, const struct nf_mm *mm, size_t n_mm, const float *x,
		   size_t ldx, size_t nb)
{
	nf_ctx_matmul_polling(c, mm, n_mm, x, ldx, nb, NULL);
}

void nf_ctx_matmul_polling(struct nf_ctx *c, const struct nf_mm *mm, size_t n_mm, const float *x,
			   size_t ldx, size_t nb, struct nf_cache *poll)
{
	bool done[4] = { false };
	for (size_t i = 0; i < n_mm; i++) {
		if (done[i])
			continue;
		/* Group the products that share i's dot type and input length. */
		struct nf_mm grp[4];
		size_t ng = 0;
		int kt = mm[i].w->kt;
		size_t n = mm[i].w->n;
		for (size_t j = i; j < n_mm; j++)
			if (!done[j] && mm[j].w->kt == kt && mm[j].w->n == n) {
				grp[ng++] = mm[j];
				done[j] = true;
			}
		const void *xq = x;
		size_t stride = ldx * sizeof(float);
		if (nf_ktype_dot_dtype(kt) != NF_DTYPE_F32) {
			struct prep_job pj = { .k = c->k, .kt = kt, .x = x, .ldx = ldx, .n = n,
					       .dst = c->xq, .stride = nf_act_size(kt, n) };
			nf_ctx_parallel(c, nb, prep_rows, &pj);
			xq = c->xq;
			stride = pj.stride;
		}
		struct mm_job j = { .k = c->k, .mm = grp, .n_mm = ng, .xq = xq, .xq_stride = stride,
				    .nb = nb, .poll = poll };
		atomic_init(&j.poll_ns, poll ? mono_ns() : 0);
		mm_chunk(&j, c->pool ? nf_pool_nthreads(c->pool) : 1);
		nf_ctx_run(c, mm_worker, &j);
	}
}

struct nf_weight nf_weight_expert(const struct nf_weight *w, uint32_t e)
{
	struct nf_weight v = *w;
	if (w->data)
		v.data = (const char *)w->data + (size_t)e * w->expert_bytes;
	v.n_expert = 1;
	/* ggml's mul_mat_id takes vec_dot for every column: F16 experts
	 * sum in the one-column order at any batch size */
	v.kt = nf_ktype_column(w->kt, 1);
	return v;
}

/* ---- context ------------------------------------------------------------- */

static void *zalloc(size_t n, size_t size, int *rc)
{
	void *p = calloc(n ? n : 1, size);
	if (!p)
		*rc = -ENOMEM;
	return p;
}

/* zalloc counted in c->bytes (what the context allocated, for the budget) */
static void *czalloc(struct nf_ctx *c, size_t n, size_t size, int *rc)
{
	c->bytes += (n ? n : 1) * size;
	return zalloc(n, size, rc);
}

int nf_ctx_open(const struct nf_model *m, const struct nf_ctx_params *p, struct nf_ctx **out,
		struct nf_diag *diag)
{
	const struct nf_model_hparams *hp = &m->hp;
	if (!p || p->n_batch == 0 || p->n_threads < 0 || (p->kv_type != NF_KV_F32 && p->kv_type != NF_KV_F16))
		return nf_diag_fail(diag, NF_EUSAGE, "context: n_batch must be positive, n_threads >= 0");
	int rc = 0;
	struct nf_ctx *c = zalloc(1, sizeof(*c), &rc);
	if (!c)
		return nf_diag_fail(diag, rc, "context: out of memory");
	c->m = m;
	c->k = p->kernels ? p->kernels : nf_kernels_get();
	c->n_ctx = p->n_ctx ? p->n_ctx : hp->n_ctx_train;
	c->n_batch = p->n_batch < c->n_ctx ? p->n_batch : c->n_ctx;
	c->kv_type = p->kv_type;
	c->all_rows = p->all_rows;
	c->kv_elt = p->kv_type == NF_KV_F16 ? 2 : 4;
	c->kv_dim = hp->n_head_kv * hp->head_dim;

	if (p->n_threads != 1) {
		rc = nf_pool_open(p->n_threads, -1, &c->pool);
		if (rc < 0) {
			nf_diag_fail(diag, rc, "context: cannot start %d threads", p->n_threads);
			goto fail;
		}
		c->n_threads = nf_pool_nthreads(c->pool);
		if (c->n_threads == 1) {
			nf_pool_close(c->pool);
			c->pool = NULL;
		}
	} else {
		c->n_threads = 1;
	}

	size_t E = hp->n_embd, F = hp->n_ff, KV = c->kv_dim, NB = c->n_batch;
	size_t U = hp->n_expert_used, X = hp->n_expert, NT = (size_t)c->n_threads;
	size_t maxn = E > F ? E : F;
	c->xq_row = 0;
	for (int kt = 0; kt < NF_KT_COUNT; kt++) {
		size_t s = nf_act_size(kt, maxn);
		c->xq_row = s > c->xq_row ? s : c->xq_row;
	}
	c->kcache = czalloc(c, hp->n_layer, sizeof(void *), &rc);
	c->vcache = czalloc(c, hp->n_layer, sizeof(void *), &rc);
	c->ffn = czalloc(c, hp->n_layer, sizeof(*c->ffn), &rc);
	if (rc < 0)
		goto fail_nomem;
	if (rc < 0)
		goto fail_nomem;
	/* K and V of every layer in one mapping, each buffer on its own pages:
	 * nothing is resident until a position is written (no huge pages,
	 * which would make a whole 2 MiB resident at the first row) */
	size_t pg = (size_t)sysconf(_SC_PAGESIZE);
	c->kv_buf_bytes = ((size_t)c->n_ctx * KV * c->kv_elt + pg - 1) / pg * pg;
	c->kv_map_bytes = 2 * (size_t)hp->n_layer * c->kv_buf_bytes;
	c->kv_map = mmap(NULL, c->kv_map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (c->kv_map == MAP_FAILED) {
		c->kv_map = NULL;
		rc = -ENOMEM;
		goto fail_nomem;
	}
#ifdef MADV_NOHUGEPAGE
	madvise(c->kv_map, c->kv_map_bytes, MADV_NOHUGEPAGE);
#endif
	c->bytes += c->kv_map_bytes;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		c->kcache[il] = (char *)c->kv_map + (2 * (size_t)il) * c->kv_buf_bytes;
		c->vcache[il] = (char *)c->kv_map + (2 * (size_t)il + 1) * c->kv_buf_bytes;
	}
	c->x = czalloc(c, NB * E, sizeof(float), &rc);
	c->xn = czalloc(c, NB * E, sizeof(float), &rc);
	c->q = czalloc(c, NB * E, sizeof(float), &rc);
	c->kn = czalloc(c, NB * KV, sizeof(float), &rc);
	c->vn = czalloc(c, NB * KV, sizeof(float), &rc);
	c->att = czalloc(c, NB * E, sizeof(float), &rc);
	c->tmp = czalloc(c, NB * E, sizeof(float), &rc);
	c->g = czalloc(c, NB * F, sizeof(float), &rc);
	c->u = czalloc(c, NB * F, sizeof(float), &rc);
	c->xq = czalloc(c, NB, c->xq_row, &rc);
	c->row_seq = czalloc(c, NB, sizeof(*c->row_seq), &rc);
	c->row_pos = czalloc(c, NB, sizeof(*c->row_pos), &rc);
	c->logits = czalloc(c, hp->n_vocab, sizeof(float), &rc);
	if (m->embd_obj) {
		/* EMBD_ROWS rows at a time: an aligned row is 8 KiB where the
		 * alignment is 4 KiB, so a whole batch's would be megabytes */
		uint32_t a = nf_cache_align(m->cache);
		c->embd_cap = NB < EMBD_ROWS ? NB : EMBD_ROWS;
		c->embd_span = nf_cache_row_span(m->cache, m->tok_embd.row_bytes);
		c->embd_rows = czalloc(c, c->embd_cap, sizeof(*c->embd_rows), &rc);
		c->bytes += c->embd_cap * c->embd_span;
		if (!(c->embd_buf = nf_io_buf_alloc(c->embd_cap * c->embd_span, a > 4096 ? a : 4096)))
			rc = -ENOMEM;
	}
	c->n_ctx_pad = ((size_t)c->n_ctx + 15) & ~(size_t)15;
	c->scores_row = c->n_ctx_pad + 64 * (size_t)hp->head_dim; /* + value-sum lanes */
	c->scores = czalloc(c, NT * c->scores_row, sizeof(float), &rc);
	c->qh_row = nf_act_size(NF_KT_F16, hp->head_dim);
	c->qh = czalloc(c, NT, c->qh_row, &rc);
	if (X) {
		c->router = czalloc(c, NB * X, sizeof(float), &rc);
		c->sel = czalloc(c, NB * U, sizeof(int32_t), &rc);
		c->selw = czalloc(c, NB * U, sizeof(float), &rc);
		c->tok_of = czalloc(c, NB, sizeof(int32_t), &rc);
		c->slot_of = czalloc(c, NB, sizeof(int32_t), &rc);
		c->xg = czalloc(c, NB * E, sizeof(float), &rc);
		c->eg = czalloc(c, NB * E, sizeof(float), &rc);
		c->eout = czalloc(c, NB * U * E, sizeof(float), &rc);
	} else if (m->layers[0].down_t.data) {
		c->eg = czalloc(c, NB * F, sizeof(float), &rc); /* rounded activations for down_t */
	}
	if (rc < 0)
		goto fail_nomem;
	c->bytes_kv = c->kv_map_bytes;
	c->env = (struct nf_ffn_env){ .model = m, .k = c->k, .pool = c->pool };
	*out = c;
	return 0;
fail_nomem:
	nf_diag_fail(diag, rc, "context: out of memory for n_ctx %u, n_batch %u", c->n_ctx, c->n_batch);
fail:
	nf_ctx_close(c);
	return rc;
}

void nf_ctx_close(struct nf_ctx *c)
{
	if (!c)
		return;
	nf_stream_close(c->attn);
	nf_pool_close(c->pool);
	if (c->kv_map)
		munmap(c->kv_map, c->kv_map_bytes);
	free(c->kcache);
	free(c->vcache);
	free(c->ffn);
	void *bufs[] = { c->x, c->xn, c->q, c->kn, c->vn, c->att, c->tmp, c->g, c->u, c->xq,
			 c->row_seq, c->row_pos, c->logits, c->scores, c->qh, c->router, c->sel, c->selw, c->tok_of,
			 c->slot_of, c->xg, c->eg, c->eout, (void *)c->embd_rows };
	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		free(bufs[i]);
	nf_io_buf_free(c->embd_buf);
	free(c);
}

const float *nf_ctx_logits(const struct nf_ctx *c) { return c->logits; }
uint32_t nf_ctx_n_past(const struct nf_ctx *c) { return c->n_past; }
uint32_t nf_ctx_n_ctx(const struct nf_ctx *c) { return c->n_ctx; }
int nf_ctx_n_threads(const struct nf_ctx *c) { return c->n_threads; }
uint32_t nf_ctx_n_batch(const struct nf_ctx *c) { return c->n_batch; }
const struct nf_kernels *nf_ctx_kernels(const struct nf_ctx *c) { return c->k; }
const struct nf_model *nf_ctx_model(const struct nf_ctx *c) { return c->m; }
uint64_t nf_ctx_bytes(const struct nf_ctx *c) { return c->bytes + sizeof(*c); }
uint64_t nf_ctx_bytes_kv(const struct nf_ctx *c) { return c->bytes_kv; }
void nf_ctx_reset(struct nf_ctx *c) { c->n_past = 0; }

void nf_ctx_set_kv_grow(struct nf_ctx *c, nf_ctx_kv_grow_fn grow, void *user, uint32_t covered)
{
	c->kv_grow = grow;
	c->kv_grow_user = user;
	if (covered > c->kv_fill)
		c->kv_fill = covered < c->n_ctx ? covered : c->n_ctx;
}

uint64_t nf_ctx_kv_bytes_at(const struct nf_ctx *c, uint32_t n)
{
	size_t pg = (size_t)sysconf(_SC_PAGESIZE);
	n = n < c->n_ctx ? n : c->n_ctx;
	uint64_t row = (uint64_t)c->kv_dim * c->kv_elt;
	return 2ull * c->m->hp.n_layer * ((row * n + pg - 1) / pg * pg);
}

int nf_ctx_stream_attn(struct nf_ctx *c, const struct nf_stream_opts *o, struct nf_diag *d)
{
	const struct nf_model *m = c->m;
	if (c->attn)
		return nf_diag_fail(d, NF_EUSAGE, "context: attention is streamed already");
	if (!m->store || !m->attn_obj)
		return nf_diag_fail(d, NF_EUNSUPPORTED,
				    "context: attention can only be streamed from a store (nflash import)");
	/* the layers whose attention is not in memory; all of them if every
	 * layer's is (a stream over pinned weights, for comparisons) */
	c->attn_first = m->attn_deferred ? m->attn_in_mem : 0;
	return nf_stream_open(m->cache, m->attn_obj + (size_t)c->attn_first * 4,
			      m->hp.n_layer - c->attn_first, 4, o, &c->attn, d);
}

uint64_t nf_model_attn_stream_bytes(const struct nf_model *m, uint32_t n_slots)
{
	if (!m->store || !m->attn_obj)
		return 0;
	return (uint64_t)n_slots * nf_stream_slot_bytes(m->store, m->attn_obj, m->hp.n_layer, 4);
}

uint64_t nf_ctx_attn_stream_bytes(const struct nf_ctx *c)
{
	return c->attn ? nf_stream_bytes(c->attn) : 0;
}

bool nf_ctx_attn_stats(const struct nf_ctx *c, struct nf_stream_stats *out)
{
	if (!c->attn)
		return false;
	nf_stream_stats_get(c->attn, out);
	return true;
}

int nf_ctx_set_ffn(struct nf_ctx *c, uint32_t il, const struct nf_ffn_ops *ops, void *self)
{
	if (il >= c->m->hp.n_layer || (ops && !ops->forward))
		return NF_EUSAGE;
	c->ffn[il] = (struct nf_ctx_layer_ffn){ .ops = ops, .self = self };
	return 0;
}

int nf_ctx_ffn_builtin(struct nf_ctx *c, const struct nf_ffn_io *io)
{
	if (io->layer >= c->m->hp.n_layer || io->nb == 0 || io->nb > c->n_batch)
		return NF_EUSAGE;
	/* A store-backed model's FFN lives in the store: it needs a provider
	 * (nf_ctx_set_ffn) or store_unpack_ffn at load. */
	if (!nf_model_ffn_in_memory(c->m))
		return NF_EUNSUPPORTED;
	return c->m->hp.n_expert ? nf_ffn_moe(c, io) : nf_ffn_dense(c, io);
}

/* ---- forward -------------------------------------------------------------- */

struct rows_job {
	struct nf_ctx *c;
	const float *w;
	float *dst;
	const float *src;
	const int32_t *ids;
};

static void embed_rows(void *arg, size_t b0, size_t b1)
{
	struct rows_job *j = arg;
	const struct nf_weight *te = &j->c->m->tok_embd;
	for (size_t b = b0; b < b1; b++)
		nf_dequantize_row(te->dtype,
				  te->data ? (const char *)te->data + (size_t)j->ids[b] * te->row_bytes
					   : j->c->embd_rows[b],
				  j->dst + b * te->n, te->n);
}

static void norm_rows(void *arg, size_t b0, size_t b1)
{
	struct rows_job *j = arg;
	size_t E = j->c->m->hp.n_embd;
	for (size_t b = b0; b < b1; b++)
		j->c->k->rmsnorm(j->dst + b * E, j->src + b * E, j->w, E, j->c->m->hp.rms_eps);
}

static void add_rows(void *arg, size_t b0, size_t b1)
{
	struct rows_job *j = arg;
	size_t E = j->c->m->hp.n_embd;
	for (size_t i = b0 * E; i < b1 * E; i++)
		j->dst[i] += j->src[i];
}

/* c->x += src for nb rows. */
static void residual_add(struct nf_ctx *c, const float *src, size_t nb)
{
	struct rows_job j = { .c = c, .dst = c->x, .src = src };
	nf_ctx_parallel(c, nb, add_rows, &j);
}

/* Row b is the last of its sequence among rows [0, nb). */
static bool last_of_seq(const struct nf_ctx *c, size_t b, size_t nb)
{
	for (size_t i = b + 1; i < nb; i++)
		if (c->row_seq[i] == c->row_seq[b])
			return false;
	return true;
}

/*
 * After the last layer's attention only the rows whose logits are taken
 * (the last of each sequence) go on, as llama.cpp's inp_out_ids does: they
 * move to the front, with their sequence and position, and their count is
 * returned. Besides the work saved, this is what keeps llama.cpp's bits:
 * its last FFN and output product then run on one column per sequence,
 * which for F16 weights is another order than a prompt's columns
 * (nf_ktype_column).
 */
static size_t keep_output_rows(struct nf_ctx *c, size_t nb)
{
	size_t E = c->m->hp.n_embd, k = 0;
	for (size_t b = 0; b < nb; b++) {
		if (!last_of_seq(c, b, nb))
			continue;
		if (k != b) {
			memcpy(c->x + k * E, c->x + b * E, E * sizeof(float));
			c->row_seq[k] = c->row_seq[b];
			c->row_pos[k] = c->row_pos[b];
		}
		k++;
	}
	return k;
}

/* One forward step of rows [0, nb) (c->row_seq / c->row_pos filled). */
static int forward(struct nf_ctx *c, const int32_t *ids, size_t nb)
{
	const struct nf_model *m = c->m;
	const struct nf_model_hparams *hp = &m->hp;
	size_t E = hp->n_embd;
	struct rows_job j = { .c = c, .ids = ids, .dst = c->x };
	if (m->embd_obj) {
		/* the rows of these tokens, read from the store (model_store.c),
		 * embd_cap at a time */
		for (size_t b0 = 0; b0 < nb; b0 += c->embd_cap) {
			size_t k = nb - b0 < c->embd_cap ? nb - b0 : c->embd_cap;
			struct nf_diag d = { 0 };
			int rc = nf_cache_read_rows(m->cache, m->embd_obj, m->tok_embd.row_bytes, ids + b0, (uint32_t)k,
						    c->embd_buf, c->embd_rows, &d);
			if (rc < 0)
				return rc;
			j = (struct rows_job){ .c = c, .ids = ids + b0, .dst = c->x + b0 * E };
			nf_ctx_parallel(c, k, embed_rows, &j);
		}
	} else {
		nf_ctx_parallel(c, nb, embed_rows, &j);
	}

	for (uint32_t il = 0; il < hp->n_layer; il++) {
		int rc = nf_attention(c, il, nb);
		if (rc < 0)
			return rc;
		if (il + 1 == hp->n_layer && !c->all_rows)
			nb = keep_output_rows(c, nb);

		j = (struct rows_job){ .c = c, .w = m->layers[il].ffn_norm, .dst = c->xn, .src = c->x };
		nf_ctx_parallel(c, nb, norm_rows, &j);
		struct nf_ffn_io io = { .layer = il, .nb = nb, .resid = c->x, .x = c->xn, .out = c->tmp };
		const struct nf_ctx_layer_ffn *f = &c->ffn[il];
		rc = f->ops ? f->ops->forward(f->self, &c->env, &io) : nf_ctx_ffn_builtin(c, &io);
		if (rc < 0)
			return rc;
		residual_add(c, c->tmp, nb);
	}

	for (size_t b = 0; b < nb; b++) {
		struct nf_ctx *sq = c->row_seq[b];
		if (!last_of_seq(c, b, nb))
			continue;
		c->k->rmsnorm(c->xn, c->x + b * E, m->output_norm, E, hp->rms_eps);
		struct nf_mm mm = { .w = &m->output, .y = sq->logits, .ldy = hp->n_vocab };
		nf_ctx_matmul(c, &mm, 1, c->xn, E, 1);
	}
	for (size_t b = 0; b < nb; b++)
		c->row_seq[b]->n_past = c->row_pos[b] + 1;
	return 0;
}

/* Tokens ids[0..n): token i of sequence seqs[i] (seqs NULL: all of c). */
static int eval_rows(struct nf_ctx *c, struct nf_ctx *const *seqs, const int32_t *ids, size_t n)
{
	if (n == 0)
		return NF_EUSAGE;
	for (size_t i = 0; i < n; i++) {
		const struct nf_ctx *sq = seqs ? seqs[i] : c;
		if (ids[i] < 0 || (uint32_t)ids[i] >= c->m->hp.n_vocab)
			return NF_EUSAGE;
		/* another sequence's cache must be one c's attention can use */
		if (sq->m != c->m || sq->kv_type != c->kv_type || sq->n_ctx > c->n_ctx)
			return NF_EUSAGE;
	}
	/* every sequence's tokens must fit its context: count them on n_past */
	bool over = false;
	for (size_t i = 0; i < n; i++) {
		struct nf_ctx *sq = seqs ? seqs[i] : c;
		over |= ++sq->n_past > sq->n_ctx;
	}
	for (size_t i = 0; i < n; i++)
		(seqs ? seqs[i] : c)->n_past--;
	if (over)
		return NF_EBUDGET;
	for (size_t off = 0; off < n; off += c->n_batch) {
		size_t nb = n - off < c->n_batch ? n - off : c->n_batch;
		/* positions: each sequence's next, in row order */
		for (size_t b = 0; b < nb; b++) {
			struct nf_ctx *sq = seqs ? seqs[off + b] : c;
			c->row_seq[b] = sq;
			c->row_pos[b] = sq->n_past;
			for (size_t i = b; i-- > 0;)
				if (c->row_seq[i] == sq) {
					c->row_pos[b] = c->row_pos[i] + 1;
					break;
				}
		}
		/* this context's positions past what its KV cache covers: asked
		 * for first (other sequences' caches are theirs) */
		uint32_t need = 0;
		for (size_t b = 0; b < nb; b++)
			if (c->row_seq[b] == c && c->row_pos[b] + 1 > need)
				need = c->row_pos[b] + 1;
		if (need > c->kv_fill) {
			if (c->kv_grow) {
				int g = c->kv_grow(c->kv_grow_user, need);
				if (g < 0)
					return g;
			}
			c->kv_fill = need;
		}
		int rc = forward(c, ids + off, nb);
		if (rc < 0)
			return rc;
	}
	return 0;
}

int nf_ctx_eval(struct nf_ctx *c, const int32_t *ids, size_t n)
{
	return eval_rows(c, NULL, ids, n);
}

int nf_ctx_eval_seqs(struct nf_ctx *c, struct nf_ctx *const *seqs, const int32_t *ids, size_t n)
{
	if (!seqs)
		return NF_EUSAGE;
	return eval_rows(c, seqs, ids, n);
}
