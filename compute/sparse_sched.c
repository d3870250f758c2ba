/*
 * sparse_sched.c - the ready list: chunks whose bytes are in memory,
 * taken through one atomic counter by any worker; idle workers reap the
 * cache's completions (compute/sparse_impl.h invariants 2 and 4).
 *
 * Invariants: each ready chunk is computed exactly once; the layer's
 * output is summed in chunk order whatever the order chunks completed.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sparse_impl.h"

/* ---- the ready list ------------------------------------------------------------ */

void nf_sp_ready_push(struct nf_sparse *s, uint32_t ci)
{
	uint32_t at = atomic_fetch_add(&s->n_ready, 1);
	__atomic_store_n(&s->ready[at], ci, __ATOMIC_RELEASE);
}

/* Cache completion: bundles of neurons[0..n) are in memory (or failed). */
void nf_sp_on_ready(void *user, const uint32_t *neurons, uint32_t n, int result)
{
	const struct sp_tag *tag = user;
	struct nf_sparse *s = tag->s;
	if (result < 0) {
		int expect = 0;
		atomic_compare_exchange_strong(&s->err, &expect, result);
	}
	if (s->cache)
		atomic_store(&s->t_last_ready, nf_sp_now());
	if (tag->k != UINT32_MAX && tag->k != s->cur_k) {
		/* an expert of the token requested together, not computed yet
		 * (cur_k changes only while no thread reaps) */
		atomic_uint *pend = s->xpend + (size_t)tag->k * s->n_groups;
		for (uint32_t k = 0; k < n; k++)
			atomic_fetch_sub(&pend[neurons[k] / GROUP], 1);
		return;
	}
	if (s->in_batch) {
		/* a batch consumes groups in order: count per group */
		for (uint32_t k = 0; k < n; k++)
			atomic_fetch_sub(&s->groups[neurons[k] / GROUP].pending, 1);
		return;
	}
	for (uint32_t k = 0; k < n; k++) {
		uint32_t ci = s->groups[neurons[k] / GROUP].chunk;
		if (atomic_fetch_sub(&s->chunks[ci].pending, 1) == 1)
			nf_sp_ready_push(s, ci);
	}
}

/* Reap completions (serialised by the cache); thread 0 times its waits.
 * Returns false after recording an error. */
bool nf_sp_reap_some(struct nf_sparse *s, int ith)
{
	double t0 = ith == 0 ? nf_sp_now() : 0.0;
	int rc = nf_cache_reap(s->cache, nf_sp_on_ready, &s->tag0);
	if (ith == 0)
		s->st.t_wait += nf_sp_now() - t0;
	if (rc < 0) {
		int expect = 0;
		atomic_compare_exchange_strong(&s->err, &expect, rc);
		return false;
	}
	return true;
}

void nf_sp_worker(void *arg, int ith, int nth)
{
	(void)nth;
	struct nf_sparse *s = arg;
	char *scratch = s->tscratch + (size_t)ith * s->act_stride;
	for (;;) {
		if (atomic_load(&s->err))
			return;
		uint32_t taken = atomic_load(&s->next);
		if (taken >= s->n_chunks)
			return;
		if (taken < atomic_load(&s->n_ready)) {
			if (!atomic_compare_exchange_weak(&s->next, &taken, taken + 1))
				continue;
			/* the slot may be claimed before its id is stored */
			uint32_t ci;
			while ((ci = __atomic_load_n(&s->ready[taken], __ATOMIC_ACQUIRE)) == UINT32_MAX)
				;
			float *out = s->gout + (size_t)ci * s->E;
			memset(out, 0, s->E * sizeof(float));
			const struct chunk_state *c = &s->chunks[ci];
			nf_sp_chunk_compute(s, c->g0, c->g1, s->gmask, s->xq, out, scratch, s->kact);
			continue;
		}
		/* Nothing ready: reap completions. */
		if (!nf_sp_reap_some(s, ith))
			return;
	}
}

void nf_sp_run_workers(struct nf_sparse *s, const struct nf_ffn_env *env, nf_pool_fn fn)
{
	if (env->pool)
		nf_pool_run(env->pool, fn, s);
	else
		fn(s, 0, 1);
}

void nf_sp_run_job(const struct nf_ffn_env *env, nf_pool_fn fn, void *arg)
{
	if (env->pool)
		nf_pool_run(env->pool, fn, arg);
	else
		fn(arg, 0, 1);
}

/* QCOL down of the super-blocks (Q4_0/Q8_0: groups) holding groups [g0,
 * g1): their Q8_K (Q8_0) activations, then every row's accumulators, rows
 * split over threads. */
void nf_sp_kdown_blocks(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t dt, uint32_t g0,
			 uint32_t g1)
{
	struct kdown_job j = { .s = s, .dt = dt, .kb0 = g0, .kb1 = g1 };
	if (nf_dtype_is_kquant(dt)) {
		j.kb0 = g0 / s->kgroups;
		j.kb1 = (g1 + s->kgroups - 1) / s->kgroups;
		nf_quantize_row_q8_K(s->kact + (size_t)j.kb0 * NF_QK_K, s->kx + j.kb0,
				     (size_t)(j.kb1 - j.kb0) * NF_QK_K);
	} else {
		/* the dense product's activation rounding (every table: the same bytes) */
		s->k->act_prepare[NF_KT_Q8_0](s->kact + (size_t)g0 * GROUP, s->qx + g0, (size_t)(g1 - g0) * GROUP);
	}
	nf_sp_run_job(env, nf_sp_kdown_worker, &j);
}

struct fdown_job {
	struct nf_sparse *s;
	uint32_t i0, i1;
	float *out;                  /* final pass: the layer's output */
};

static void fdown_worker(void *arg, int ith, int nth)
{
	struct fdown_job *j = arg;
	struct nf_sparse *s = j->s;
	/* rows in multiples of 16, so each slice's axpys stay on whole vectors */
	uint32_t E16 = (s->E + 15) / 16;
	uint32_t r0 = (uint32_t)((uint64_t)E16 * ith / nth) * 16, r1 = (uint32_t)((uint64_t)E16 * (ith + 1) / nth) * 16;
	if (r1 > s->E)
		r1 = s->E;
	if (r0 >= r1)
		return;
	if (!j->out)
		nf_sp_fdown_rows(s, s->kact, s->flanes, s->facc, s->fclosed, j->i0, j->i1, r0, r1);
	else
		nf_sp_fdown_finish(s, s->flanes, s->facc, s->fclosed, r0, r1, j->out);
}

void nf_sp_fdown_blocks(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t g0, uint32_t g1, float *out)
{
	uint32_t i1 = g1 * GROUP < s->F ? g1 * GROUP : s->F;
	struct fdown_job j = { .s = s, .i0 = g0 * GROUP, .i1 = i1, .out = out };
	nf_sp_run_job(env, fdown_worker, &j);
	/* vec_dot's order: past F & ~63 the chains were summed (rows_) */
	if (!out && nf_sp_fdown_vec(s) && i1 > (s->F & ~63u))
		s->fclosed = true;
}

/* out = sum of the chunks' contributions in chunk order, each thread a
 * slice of the rows: the same sums whatever the thread count or the order
 * in which chunks became ready. */
void nf_sp_reduce_worker(void *arg, int ith, int nth)
{
	struct nf_sparse *s = arg;
	size_t E = s->E, r0 = E * (size_t)ith / (size_t)nth, r1 = E * (size_t)(ith + 1) / (size_t)nth;
	float *out = s->cur_out;
	for (size_t r = r0; r < r1; r++)
		out[r] = 0.0f;
	for (uint32_t ci = 0; ci < s->n_chunks; ci++) {
		const float *g = s->gout + (size_t)ci * E;
		for (size_t r = r0; r < r1; r++)
			out[r] += g[r];
	}
}
