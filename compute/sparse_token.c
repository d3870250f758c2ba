/*
 * sparse_token.c - one token through a sparse FFN layer: the predictor
 * (or the exact mode's gate pass), the neuron masks, the chunks, and with
 * a cache the request for the misses, in windows when they do not fit the
 * cold segment (compute/sparse_impl.h).
 *
 * Invariants: the output is the same whatever the window size, thread
 * count or order the reads complete in (invariant 2).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/store.h"
#include "sparse_impl.h"

/* ---- one token ------------------------------------------------------------------- */

void nf_sp_predict(struct nf_sparse *s, const struct layer_tab *t, const float *resid)
{
	const struct nf_kernels *k = s->k;
	const struct nf_weight *fc1 = &t->fc1, *fc2 = &t->fc2;
	k->act_prepare[fc1->kt](resid, s->hq, s->E);
	k->gemv[fc1->kt](fc1->n, fc1->nrows, fc1->data, fc1->row_bytes, s->hq, s->h1);
	for (uint32_t i = 0; i < s->rank; i++)
		s->h1[i] = s->h1[i] > 0.0f ? s->h1[i] : 0.0f;
	k->act_prepare[fc2->kt](s->h1, s->hq, s->rank);
	k->gemv[fc2->kt](fc2->n, fc2->nrows, fc2->data, fc2->row_bytes, s->hq, s->score);
}

/* record_moments: z = s->h1 (after nf_sp_predict) folded into FFN
 * (layer, expert)'s sums; zeros (ReLU's) add nothing to them. */
void nf_sp_record_moments(struct nf_sparse *s, uint32_t layer, uint32_t expert)
{
	if (!s->mom)
		return;
	const struct layer_tab *t = nf_sp_tab(s, layer, expert);
	uint32_t r = t->fc1.data ? t->fc1.nrows : 0;
	if (!r)
		return;
	double *m = s->mom + ((size_t)layer * s->nx + expert) * s->mom_stride, *sum = m + 1, *sq = m + 1 + r;
	const float *z = s->h1;
	m[0] += 1.0;
	for (uint32_t i = 0; i < r; i++) {
		if (z[i] == 0.0f)
			continue;
		double zi = z[i];
		sum[i] += zi;
		for (uint32_t k = 0; k < r; k++)
			sq[(size_t)i * r + k] += zi * z[k];
	}
}

/* Neurons of group gi to compute: the predicted ones (score >= threshold,
 * after nf_sp_predict()), or every neuron that exists. */
uint32_t nf_sp_group_mask(const struct nf_sparse *s, uint32_t gi)
{
	uint32_t m = 0, valid = gi + 1 < s->n_groups ? UINT32_MAX : s->last_mask;
	if (s->mode != NF_SPARSE_PREDICTOR)
		return valid;
	for (uint32_t i = 0; i < GROUP; i++)
		if ((valid >> i & 1u) && s->score[gi * GROUP + i] >= s->threshold)
			m |= 1u << i;
	return m;
}

/* Gate values of every neuron (in memory) for recall. */
void nf_sp_measure_recall(struct nf_sparse *s)
{
	const struct layer_tab *t = s->cur_tab;
	if (s->cache || !t->gate)
		return;
	for (uint32_t gi = 0; gi < s->n_groups; gi++)
		for (uint32_t i = 0; i < GROUP && gi * GROUP + i < s->F; i++) {
			uint32_t j = gi * GROUP + i;
			float gv;
			s->k->gemv[nf_sp_kt_gu(s)](s->E, 1, t->gate + (size_t)j * t->gate_stride, 0, s->xq, &gv);
			if (gv > 0.0f) {
				s->st.recall_fired++;
				s->st.recall_hit += (s->gmask[gi] >> i) & 1u;
			}
		}
}

static void gate_done(void *cookie, int result)
{
	atomic_store((atomic_int *)cookie, result < 0 ? result : 0);
}

int nf_sp_gate_fetch(struct nf_sparse *s, uint32_t layer, const int32_t *experts, uint32_t n)
{
	int rc = 0;
	double t0 = nf_sp_now();
	for (uint32_t k = 0; k < n; k++) {
		const struct nf_store_object *g = s->gobj[(size_t)layer * s->nx + (uint32_t)experts[k]];
		s->gheld[k] = UINT32_MAX;
		atomic_store(&s->gdone[k], 1);
		int r = nf_cache_read_async(s->cache, g, s->gbuf + k * s->gbuf_stride, gate_done, &s->gdone[k]);
		if (r < 0)
			atomic_store(&s->gdone[k], r);
		s->st.gate_reads++;
		s->st.gate_bytes += g->length;
	}
	for (uint32_t k = 0; k < n; k++) {
		while (atomic_load(&s->gdone[k]) == 1)
			nf_cache_wait_io(s->cache); /* an error fails the reads it concerns */
		int r = atomic_load(&s->gdone[k]);
		if (r == 0)
			s->gheld[k] = layer * s->nx + (uint32_t)experts[k];
		rc = rc < 0 ? rc : r;
	}
	s->st.t_wait += nf_sp_now() - t0;
	return rc;
}

const char *nf_sp_gate_rows(struct nf_sparse *s, uint32_t layer)
{
	uint32_t id = layer * s->nx + s->cur_expert, nb = s->n_expert_used ? s->n_expert_used : 1;
	for (uint32_t k = 0; k < nb; k++)
		if (s->gheld[k] == id)
			return s->gbuf + k * s->gbuf_stride;
	int32_t e = (int32_t)s->cur_expert;
	return nf_sp_gate_fetch(s, layer, &e, 1) == 0 ? s->gbuf : NULL;
}

uint64_t nf_sp_token_masks(struct nf_sparse *s, uint32_t layer, const float *x, const float *resid)
{
	const struct layer_tab *t = nf_sp_tab(s, layer, s->cur_expert);
	s->cur_layer = layer;
	s->cur_tab = t;
	s->k->act_prepare[s->kt_gu](x, s->xq, s->E);
	if (s->mode == NF_SPARSE_PREDICTOR) {
		nf_sp_predict(s, t, resid);
		nf_sp_record_moments(s, layer, s->cur_expert);
	}
	/* gate-first: every gate from the gate rows read whole (each the bits
	 * a chunk's gemv_list gives), and only the positive ones computed */
	const char *gate = s->gate_first ? s->cur_gate : NULL;
	if (gate)
		s->k->gemv[nf_sp_kt_gu(s)](s->E, s->F, gate, nf_dtype_row_size(s->dt_gu, s->E), s->xq, s->score);
	uint64_t active = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		uint32_t m = nf_sp_group_mask(s, gi);
		for (uint32_t i = 0; gate && i < GROUP; i++)
			if (!(s->score[gi * GROUP + i] > 0.0f))
				m &= ~(1u << i);
		s->gmask[gi] = m;
		active += (uint64_t)__builtin_popcount(m);
	}
	return active;
}

/*
 * Layer-ahead prefetch (dense FFN, predictor mode, decode): layer+1's
 * predictor applied to this layer's residual guesses the neurons layer+1
 * will ask for, and nf_cache_prefetch reads the misses among them into
 * free cold slots, right after this layer's own reads are out, so that
 * they land while this layer computes and layer+1's attention runs. Only
 * the cache's contents change, never what a request hands out: the same
 * bits. The predictor's scratch (hq, h1, score) is free again once this
 * layer's masks are made.
 */
static void layer_ahead(struct nf_sparse *s, uint32_t layer, const float *resid)
{
	if (layer + 1 >= s->n_layer)
		return;
	const struct layer_tab *t = nf_sp_tab(s, layer + 1, 0);
	if (!t->sparse || !t->fc1.data)
		return;
	nf_sp_predict(s, t, resid);
	uint32_t *list = s->req + s->F, n = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		uint32_t g = nf_sp_group_mask(s, gi);
		s->la_mask[gi] = g;
		for (uint32_t m = g; m; m &= m - 1)
			list[n++] = gi * GROUP + (uint32_t)__builtin_ctz(m);
	}
	s->la_layer = layer + 1;
	if (n && nf_cache_prefetch(s->cache, layer + 1, 0, list, n) >= 0)
		s->st.route_prefetches++;
}

/*
 * Layer `layer`'s masks against the guess read ahead for it: counted, and
 * after NF_SPARSE_AHEAD_WARM tokens' guesses, layer-ahead stops for good
 * when fewer than la_min_right of the guessed neurons were computed.
 */
static void layer_ahead_check(struct nf_sparse *s, uint32_t layer)
{
	if (s->la_layer != layer)
		return;
	s->la_layer = UINT32_MAX;
	uint64_t guessed = 0, right = 0, needed = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		guessed += (uint64_t)__builtin_popcount(s->la_mask[gi]);
		right += (uint64_t)__builtin_popcount(s->la_mask[gi] & s->gmask[gi]);
		needed += (uint64_t)__builtin_popcount(s->gmask[gi]);
	}
	s->st.ahead_guessed += guessed;
	s->st.ahead_right += right;
	s->st.ahead_needed += needed;
	s->la_checks++;
	s->la_right += right;
	s->la_guessed += guessed;
	if (s->la_checks == (uint64_t)NF_SPARSE_AHEAD_WARM * (s->n_layer - 1) &&
	    (double)s->la_right < (double)s->la_min_right * (double)s->la_guessed) {
		s->layer_ahead = false;
		s->la_stopped = true;
	}
}

/* Drop the guard count of chunks [c0, c1): those whose bundles were all
 * in memory are ready now. */
static void drop_guards(struct nf_sparse *s, uint32_t c0, uint32_t c1)
{
	for (uint32_t ci = c0; ci < c1; ci++) {
		if (atomic_fetch_sub(&s->chunks[ci].pending, 1) == 1) {
			nf_sp_ready_push(s, ci);
			s->st.groups_ready_now += s->chunks[ci].n_groups;
		} else {
			s->st.groups_ready_later += s->chunks[ci].n_groups;
		}
	}
}

int nf_sp_token_forward(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t layer,
			 const float *x, const float *resid, float *out)
{
	const struct layer_tab *t = nf_sp_tab(s, layer, s->cur_expert);
	uint64_t later0 = s->st.groups_ready_later, active;
	const atomic_uint *pend = NULL;
	if (s->together) {
		/* masked and requested with the token's other experts
		 * (nf_sp_moe_forward); s->xq holds x prepared */
		uint32_t k = s->cur_k;
		memcpy(s->gmask, s->xmask + (size_t)k * s->n_groups, s->n_groups * sizeof(uint32_t));
		pend = s->xpend + (size_t)k * s->n_groups;
		active = s->xactive[k];
		s->cur_layer = layer;
		s->cur_tab = t;
		s->cur_ptrs = s->xptrs + (size_t)k * s->F;
	} else {
		/* gate-first: a failed gate read leaves every neuron to compute
		 * (exact mode's masks and chunks: the same bits) */
		s->cur_gate = s->gate_first ? nf_sp_gate_rows(s, layer) : NULL;
		active = nf_sp_token_masks(s, layer, x, resid);
		s->cur_gate = NULL;
		s->cur_ptrs = s->ptrs;
		layer_ahead_check(s, layer);
	}
	s->cur_scales = t->scales;
	s->cur_x = x;
	bool kq = nf_sp_is_kdown(s, t->dt_down);
	if (kq) {
		memset(s->kact, 0, s->F * sizeof(float));
		memset(s->kacc, 0, (size_t)s->E * KACC * sizeof(float));
	}
	bool fq = nf_sp_is_fdown(s, t->dt_down);
	if (fq) {
		memset(s->kact, 0, s->F * sizeof(float));
		memset(s->flanes, 0, (nf_sp_fdown_vec(s) ? 64 : 16) * (size_t)s->E * sizeof(float));
		s->fclosed = false;
	}

	atomic_store(&s->n_ready, 0);
	atomic_store(&s->next, 0);
	if (!s->together)
		atomic_store(&s->err, 0);
	/* chunks: consecutive groups up to CHUNK_NEURONS active neurons, cut
	 * from the masks alone (invariant 2); each waits for its neurons not
	 * yet in memory (requested together: those not landed yet) */
	uint32_t nc = 0, in_chunk = 0, waits = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		uint32_t m = s->gmask[gi];
		/* gate-first cuts as exact mode does: every neuron counts */
		uint32_t cut = s->gate_first ? nf_sp_group_mask(s, gi) : m;
		if (!cut)
			continue;
		uint32_t pc = (uint32_t)__builtin_popcount(m);
		struct chunk_state *c = &s->chunks[nc];
		if (!in_chunk) {
			c->g0 = gi;
			c->n_groups = 0;
			waits = 0;
		}
		c->g1 = gi + 1;
		c->n_groups++;
		s->groups[gi].chunk = nc;
		in_chunk += (uint32_t)__builtin_popcount(cut);
		waits += pend ? atomic_load(&pend[gi]) : pc;
		if (in_chunk >= CHUNK_NEURONS && (gi + 1) % s->kgroups == 0) {
			atomic_store(&c->pending, waits + 1u);
			nc++;
			in_chunk = 0;
		}
	}
	if (in_chunk)
		atomic_store(&s->chunks[nc++].pending, waits + 1u);
	s->n_chunks = nc;
	for (uint32_t i = 0; i < nc; i++)
		s->ready[i] = UINT32_MAX;
	if (s->measure_recall && s->mode == NF_SPARSE_PREDICTOR)
		nf_sp_measure_recall(s);

	if (!s->cache) {
		for (uint32_t ci = 0; ci < nc; ci++) {
			nf_sp_ready_push(s, ci);
			s->st.groups_ready_now += s->chunks[ci].n_groups;
		}
		nf_sp_run_workers(s, env, nf_sp_worker);
		if (kq && nc)
			nf_sp_kdown_blocks(s, env, t->dt_down, s->chunks[0].g0, s->chunks[nc - 1].g1);
		if (fq && nc)
			nf_sp_fdown_blocks(s, env, s->chunks[0].g0, s->chunks[nc - 1].g1, NULL);
	} else if (s->together) {
		/* the reads are in flight already; released after the last expert */
		drop_guards(s, 0, nc);
		nf_sp_run_workers(s, env, nf_sp_worker);
		int err = atomic_load(&s->err);
		if (err < 0)
			return err;
		if (kq && nc)
			nf_sp_kdown_blocks(s, env, t->dt_down, s->chunks[0].g0, s->chunks[nc - 1].g1);
		if (fq && nc)
			nf_sp_fdown_blocks(s, env, s->chunks[0].g0, s->chunks[nc - 1].g1, NULL);
	} else {
		/* one request for the layer; when its misses could outnumber the
		 * cold slots, windows of whole chunks, each requested, computed
		 * and released before the next (same sums: each chunk has its own
		 * output, reduced in chunk order below) */
		uint32_t n = 0;
		for (uint32_t gi = 0; gi < s->n_groups; gi++) {
			uint32_t m = s->gmask[gi];
			for (uint32_t i = 0; i < GROUP; i++)
				if (m & (1u << i))
					s->req[n++] = gi * GROUP + i;
		}
		struct nf_cache_stats cs0;
		nf_cache_stats_get(s->cache, &cs0);
		bool whole = nf_cache_cold_needed(s->cache, layer, s->cur_expert, s->req, n) <= s->cap;
		uint32_t c0 = 0;
		while (c0 < nc) {
			uint32_t c1 = nc, w = n, first = 0;
			if (!whole) {
				/* the longest run of chunks from c0 with at most cap neurons */
				uint32_t at = 0;
				for (c1 = c0; c1 < nc; c1++) {
					uint32_t k = 0;
					for (uint32_t gi = s->chunks[c1].g0; gi < s->chunks[c1].g1; gi++)
						k += (uint32_t)__builtin_popcount(s->gmask[gi]);
					if (c1 > c0 && at + k > s->cap)
						break;
					at += k;
				}
				for (uint32_t ci = 0; ci < c0; ci++)
					for (uint32_t gi = s->chunks[ci].g0; gi < s->chunks[ci].g1; gi++)
						first += (uint32_t)__builtin_popcount(s->gmask[gi]);
				w = at;
				s->st.windows++;
			}
			atomic_store(&s->n_ready, 0);
			atomic_store(&s->next, 0);
			for (uint32_t i = 0; i < c1 - c0; i++)
				s->ready[i] = UINT32_MAX;
			s->n_chunks = c1 - c0;
			s->t_req = nf_sp_now();
			atomic_store(&s->t_last_ready, 0.0);
			uint64_t later = s->st.groups_ready_later;
			int rc = nf_cache_request(s->cache, layer, s->cur_expert, s->req + first, w, s->ptrs, nf_sp_on_ready,
						  &s->tag0);
			/* drop the guard count: chunks whose bundles were all hits are ready now */
			drop_guards(s, c0, c1);
			if (rc < 0) {
				/* what was submitted must land before its slots are reused */
				nf_cache_release(s->cache);
				s->n_chunks = nc;
				return rc;
			}
			if (whole && s->layer_ahead && s->decode_now && !s->n_expert)
				layer_ahead(s, layer, resid);
			nf_sp_run_workers(s, env, nf_sp_worker);
			if (kq && !atomic_load(&s->err))
				nf_sp_kdown_blocks(s, env, t->dt_down, s->chunks[c0].g0, s->chunks[c1 - 1].g1);
			if (fq && !atomic_load(&s->err))
				nf_sp_fdown_blocks(s, env, s->chunks[c0].g0, s->chunks[c1 - 1].g1, NULL);
			/* every read must have landed before its slots are reused */
			rc = nf_cache_release(s->cache);
			int err = atomic_load(&s->err);
			double last = atomic_load(&s->t_last_ready);
			if (s->st.groups_ready_later > later && last > s->t_req)
				s->st.t_io += last - s->t_req;
			if (err < 0 || rc < 0) {
				s->n_chunks = nc;
				return err < 0 ? err : rc;
			}
			c0 = c1;
		}
		s->n_chunks = nc;
		if (s->xst) {
			struct nf_cache_stats cs1;
			nf_cache_stats_get(s->cache, &cs1);
			struct nf_sparse_expert_stats *xs = &s->xst[(size_t)layer * s->n_expert + s->cur_expert];
			xs->lookups += cs1.lookups - cs0.lookups;
			xs->hits += (cs1.hits_hot + cs1.hits_cold) - (cs0.hits_hot + cs0.hits_cold);
		}
	}
	(void)later0;
	if (!s->cache && atomic_load(&s->err) < 0)
		return atomic_load(&s->err);
	s->cur_out = out;
	if (kq) {
		struct kdown_job kj = { .s = s, .dt = t->dt_down, .out = out };
		nf_sp_run_job(env, nf_sp_kdown_worker, &kj);
	} else if (fq) {
		nf_sp_fdown_blocks(s, env, 0, 0, out);
	} else {
		nf_sp_run_workers(s, env, nf_sp_reduce_worker);
	}
	s->st.ffn_calls++;
	s->st.neurons_total += s->F;
	s->st.neurons_active += active;
	if (s->xst) {
		struct nf_sparse_expert_stats *xs = &s->xst[(size_t)layer * s->n_expert + s->cur_expert];
		xs->routed++;
		xs->neurons_active += active;
	}
	return 0;
}
