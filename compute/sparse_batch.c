/*
 * sparse_batch.c - a batch of tokens from the cache (prefill): one request
 * per layer for the union of the tokens' neurons, groups consumed in
 * group order as they land (compute/sparse_impl.h invariant 5).
 *
 * Invariants: a batch equals its tokens one by one, bit for bit; a batch
 * whose union does not fit the cold segment is halved (BATCH_TOO_BIG).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sparse_impl.h"

/* ---- a batch of tokens from the cache (prefill) ------------------------------------ */

/*
 * Thread ith's share of a batch: tokens [b0, b1). Walks the layer's groups
 * in group order, waiting (reaping) until each group's bundles are in
 * memory; each token cuts its own chunks from its own masks exactly as
 * nf_sp_token_forward does, and a chunk that closes is computed and added to the
 * token's output at once: out = 0, then += each chunk in chunk order, the
 * sums nf_sp_reduce_worker makes for one token.
 */
static void batch_worker(void *arg, int ith, int nth)
{
	struct nf_sparse *s = arg;
	size_t nb = s->cur_nb, E = s->E;
	size_t b0 = nb * (size_t)ith / (size_t)nth, b1 = nb * (size_t)(ith + 1) / (size_t)nth;
	char *scratch = s->tscratch + (size_t)ith * s->act_stride;
	float *g = s->bsum + (size_t)ith * E;
	uint32_t kdt = s->cur_tab->dt_down;
	bool kq = nf_sp_is_kdown(s, kdt), fq = nf_sp_is_fdown(s, kdt);
	for (size_t b = b0; b < b1; b++) {
		memset(s->cur_out + b * E, 0, E * sizeof(float));
		if (kq || fq)
			memset(s->bkact + b * s->F, 0, s->F * sizeof(float));
		s->bchunk[2 * b] = 0;
		s->bchunk[2 * b + 1] = 0;
	}
	for (uint32_t gi = 0; gi <= s->n_groups; gi++) {
		bool last = gi == s->n_groups;
		if (!last && !s->gmask[gi])
			continue;
		while (!last && atomic_load(&s->groups[gi].pending) != 0)
			if (atomic_load(&s->err) || !nf_sp_reap_some(s, ith))
				return;
		for (size_t b = b0; b < b1; b++) {
			const uint32_t *bm = s->bmask + b * s->n_groups;
			uint32_t *open = s->bchunk + 2 * b;
			if (!last) {
				if (!bm[gi])
					continue;
				if (!open[1])
					open[0] = gi;
				open[1] += (uint32_t)__builtin_popcount(bm[gi]);
				if (open[1] < CHUNK_NEURONS || (gi + 1) % s->kgroups)
					continue;
			} else if (!open[1]) {
				continue;
			}
			memset(g, 0, E * sizeof(float));
			nf_sp_chunk_compute(s, open[0], last ? s->n_groups : gi + 1, bm, s->bxq + b * s->xq_size, g, scratch,
					    kq || fq ? s->bkact + b * s->F : NULL);
			float *out = s->cur_out + b * E;
			for (size_t r = 0; r < E; r++)
				out[r] += g[r];
			open[1] = 0;
		}
	}
	/* F16 down: every group landed, each token's down in llama.cpp's
	 * order for this call (invariant 8), all rows on this thread */
	if (fq) {
		float *lanes = s->bflanes + (size_t)ith * 64 * E;
		double *facc = s->bfacc + (size_t)ith * E;
		for (size_t b = b0; b < b1; b++) {
			memset(lanes, 0, (nf_sp_fdown_vec(s) ? 64 : 16) * E * sizeof(float));
			nf_sp_fdown_rows(s, s->bkact + b * s->F, lanes, facc, false, 0, s->F, 0, (uint32_t)E);
			nf_sp_fdown_finish(s, lanes, facc, s->F > (s->F & ~63u) && nf_sp_fdown_vec(s), 0,
					   (uint32_t)E, s->cur_out + b * E);
		}
		return;
	}
	/* K-quant down: every group landed, each token's down in ggml's
	 * dense order from its activations (as nf_sp_token_forward's) */
	if (!kq)
		return;
	float *kacc = s->bkacc + (size_t)ith * E * KACC;
	if (!nf_dtype_is_kquant(kdt)) {
		struct nf_block_q8_0 *qx = s->bqx + (size_t)ith * (s->F / GROUP);
		for (size_t b = b0; b < b1; b++) {
			s->k->act_prepare[NF_KT_Q8_0](s->bkact + b * s->F, qx, s->F);
			memset(kacc, 0, E * KACC * sizeof(float));
			nf_sp_qdown_rows(s, kdt, qx, kacc, 0, s->n_groups, 0, (uint32_t)E);
			nf_sp_qdown_finish(s, kdt, kacc, 0, (uint32_t)E, s->cur_out + b * E);
		}
		return;
	}
	struct nf_block_q8_K *kx = s->bkx + (size_t)ith * (s->F / NF_QK_K);
	for (size_t b = b0; b < b1; b++) {
		nf_quantize_row_q8_K(s->bkact + b * s->F, kx, s->F);
		memset(kacc, 0, E * KACC * sizeof(float));
		nf_sp_kdown_rows(s, kdt, kx, kacc, 0, s->F / NF_QK_K, 0, (uint32_t)E);
		nf_sp_kdown_finish(kdt, kacc, 0, (uint32_t)E, s->cur_out + b * E);
	}
}

/*
 * Tokens x[0..nb) of one layer with a cache: one request for every neuron
 * any of them needs (for a long prompt nearly the whole FFN: adjacent
 * misses coalesce into reads of up to max_coalesce bytes, the FFN read as
 * large sequential extents), and compute proceeds group by group as those
 * reads land. Same results, bit for bit, as the tokens one at a time.
 */

int nf_sp_batch_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	const struct layer_tab *t = nf_sp_tab(s, io->layer, s->cur_expert);
	uint64_t later0 = s->st.groups_ready_later, active = 0;
	s->cur_layer = io->layer;
	s->cur_tab = t;
	s->cur_ptrs = s->ptrs;
	s->cur_scales = t->scales;
	s->cur_nb = io->nb;
	s->cur_out = io->out;
	memset(s->gmask, 0, s->n_groups * sizeof(uint32_t));
	for (size_t b = 0; b < io->nb; b++) {
		s->k->act_prepare[s->kt_gu](io->x + b * s->E, s->bxq + b * s->xq_size, s->E);
		if (s->mode == NF_SPARSE_PREDICTOR) {
			nf_sp_predict(s, t, io->resid + b * s->E);
			nf_sp_record_moments(s, io->layer, s->cur_expert);
		}
		uint32_t *bm = s->bmask + b * s->n_groups;
		for (uint32_t gi = 0; gi < s->n_groups; gi++) {
			uint32_t m = nf_sp_group_mask(s, gi);
			bm[gi] = m;
			s->gmask[gi] |= m;
			active += (uint64_t)__builtin_popcount(m);
		}
	}
	uint32_t n = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		uint32_t m = s->gmask[gi];
		for (uint32_t i = 0; i < GROUP; i++)
			if (m & (1u << i))
				s->req[n++] = gi * GROUP + i;
	}
	/* more misses than cold slots: the caller halves the batch */
	if (nf_cache_cold_needed(s->cache, io->layer, s->cur_expert, s->req, n) > s->cap)
		return BATCH_TOO_BIG;
	/* for the online hot set, count each token's own neurons; the request
	 * of the union counts once more, standing in for the last */
	for (size_t b = 0; b + 1 < io->nb; b++) {
		const uint32_t *bm = s->bmask + b * s->n_groups;
		uint32_t k = 0;
		for (uint32_t gi = 0; gi < s->n_groups; gi++)
			for (uint32_t m = bm[gi]; m; m &= m - 1)
				s->req[n + k++] = gi * GROUP + (uint32_t)__builtin_ctz(m);
		nf_cache_count(s->cache, io->layer, s->cur_expert, s->req + n, k);
	}
	atomic_store(&s->err, 0);
	for (uint32_t gi = 0; gi < s->n_groups; gi++)
		atomic_store(&s->groups[gi].pending, (unsigned)__builtin_popcount(s->gmask[gi]));
	s->in_batch = true;
	s->t_req = nf_sp_now();
	atomic_store(&s->t_last_ready, 0.0);
	struct nf_cache_stats cs0, cs1;
	nf_cache_stats_get(s->cache, &cs0);
	int rc = nf_cache_request(s->cache, io->layer, s->cur_expert, s->req, n, s->ptrs, nf_sp_on_ready, &s->tag0);
	nf_cache_stats_get(s->cache, &cs1);
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		if (!s->gmask[gi])
			continue;
		if (atomic_load(&s->groups[gi].pending) == 0)
			s->st.groups_ready_now++;
		else
			s->st.groups_ready_later++;
	}
	if (rc >= 0) {
		nf_sp_run_workers(s, env, batch_worker);
		rc = 0;
	}
	int err = atomic_load(&s->err);
	int rrc = nf_cache_release(s->cache);
	s->in_batch = false;
	if (!err)
		err = rc < 0 ? rc : rrc < 0 ? rrc : 0;
	double last = atomic_load(&s->t_last_ready);
	if (s->st.groups_ready_later > later0 && last > s->t_req)
		s->st.t_io += last - s->t_req;
	if (err < 0)
		return err;
	s->st.ffn_calls += io->nb;
	s->st.neurons_total += (uint64_t)s->F * io->nb;
	s->st.neurons_active += active;
	if (s->xst) {
		struct nf_sparse_expert_stats *xs = &s->xst[(size_t)io->layer * s->n_expert + s->cur_expert];
		xs->routed += io->nb;
		xs->neurons_active += active;
		xs->lookups += cs1.lookups - cs0.lookups;
		xs->hits += (cs1.hits_hot + cs1.hits_cold) - (cs0.hits_hot + cs0.hits_cold);
	}
	return 0;
}
