/*
 * sparse_moe.c - mixture-of-experts layers (in memory or from the cache):
 * route as the built-in FFN, then run each routed expert as the FFN
 * (layer, expert) in the engine's mode (compute/sparse_impl.h invariant 6).
 *
 * Invariants: the routed experts' outputs are combined in routing order
 * with the router's weights, as the built-in FFN combines them.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sparse_impl.h"

/* ---- mixture of experts --------------------------------------------------------- */

/*
 * From a cache: token x's routed experts sel[0..U) masked (each by its own
 * predictor, in predictor mode) and requested together, before any is
 * computed: every expert's misses in flight at once, at the I/O context's
 * queue depth. Returns 0 (s->together set: nf_sp_token_forward computes
 * each from its masks and pending counts; the caller releases), 1 when
 * they do not fit one round of the cache (more neurons than an FFN has, or
 * more cold slots than the segment; then each expert is requested on its
 * own), or a request's error (released).
 */
static int request_together(struct nf_sparse *s, uint32_t layer, const int32_t *sel, const float *x,
			    const float *resid)
{
	uint32_t U = s->n_expert_used, n = 0, cold = 0, base[64 + 1], need[64];
	if (U > 64)
		return 1;
	/* gate-first: every routed expert's gate rows read together first (a
	 * failed read: that token's experts computed whole, the same bits) */
	bool gf = s->gate_first && nf_sp_gate_fetch(s, layer, sel, U) == 0;
	for (uint32_t k = 0; k < U; k++) {
		s->cur_expert = (uint32_t)sel[k];
		s->cur_gate = gf ? s->gbuf + k * s->gbuf_stride : NULL;
		s->xactive[k] = nf_sp_token_masks(s, layer, x, resid);
		s->cur_gate = NULL;
		uint32_t *xm = s->xmask + (size_t)k * s->n_groups;
		memcpy(xm, s->gmask, s->n_groups * sizeof(uint32_t));
		base[k] = n;
		if (n + s->xactive[k] > s->F)
			return 1;
		for (uint32_t gi = 0; gi < s->n_groups; gi++) {
			atomic_store(&s->xpend[(size_t)k * s->n_groups + gi], (unsigned)__builtin_popcount(xm[gi]));
			for (uint32_t m = xm[gi]; m; m &= m - 1)
				s->req[n++] = gi * GROUP + (uint32_t)__builtin_ctz(m);
		}
		need[k] = nf_cache_cold_needed(s->cache, layer, s->cur_expert, s->req + base[k], n - base[k]);
		cold += need[k];
		if (cold > s->cap)
			return 1;
	}
	base[U] = n;
	atomic_store(&s->err, 0);
	s->cur_k = UINT32_MAX;
	s->together = true;
	s->st.moe_together++;
	s->t_req = nf_sp_now();
	atomic_store(&s->t_last_ready, 0.0);
	for (uint32_t k = 0; k < U; k++) {
		struct nf_cache_stats cs0, cs1;
		/* the experts after k keep their slots free of k's gap bundles */
		cold -= need[k];
		nf_cache_reserve(s->cache, cold);
		nf_cache_stats_get(s->cache, &cs0);
		int rc = nf_cache_request_tagged(s->cache, layer, (uint32_t)sel[k], s->req + base[k], base[k + 1] - base[k],
						 s->xptrs + (size_t)k * s->F, nf_sp_on_ready, &s->xtag[k]);
		nf_cache_stats_get(s->cache, &cs1);
		struct nf_sparse_expert_stats *xs = &s->xst[(size_t)layer * s->n_expert + (uint32_t)sel[k]];
		xs->lookups += cs1.lookups - cs0.lookups;
		xs->hits += (cs1.hits_hot + cs1.hits_cold) - (cs0.hits_hot + cs0.hits_cold);
		if (rc < 0) {
			/* what was submitted must land before its slots are reused */
			nf_cache_release(s->cache);
			s->together = false;
			return rc;
		}
	}
	return 0;
}

/* End of a token whose experts were requested together. */
static int release_together(struct nf_sparse *s, int rc)
{
	int rrc = nf_cache_release(s->cache);
	double last = atomic_load(&s->t_last_ready);
	if (last > s->t_req)
		s->st.t_io += last - s->t_req;
	s->together = false;
	s->cur_k = UINT32_MAX;
	return rc < 0 ? rc : rrc;
}

/* out = sum over ranks of w[k] * eout[k] (E floats each), in rank order,
 * as the built-in FFN sums them. */
static void combine(const struct nf_sparse *s, const float *eout, const float *w, float *out)
{
	size_t E = s->E, U = s->n_expert_used;
	for (size_t i = 0; i < E; i++) {
		float acc = 0.0f;
		for (size_t k = 0; k < U; k++)
			acc += eout[k * E + i] * w[k];
		out[i] = acc;
	}
}

/*
 * Tokens [b0, b1) of io (at most s->n_batch) from a cache: per expert, the
 * tokens routed to it gathered and run as one batch of that expert (one
 * request for their union: invariant 5), each output kept by slot, then
 * every token's combined. A batch equals its tokens one by one, so this
 * equals the token path bit for bit.
 */
static int moe_batch(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io, size_t b0,
		     size_t b1, const int32_t *sel, const float *w)
{
	size_t E = s->E, U = s->n_expert_used;
	float *xg = s->bx, *rg = xg + (size_t)s->n_batch * E, *og = rg + (size_t)s->n_batch * E;
	for (uint32_t e = 0; e < s->n_expert; e++) {
		uint32_t cnt = 0;
		for (size_t i = b0 * U; i < b1 * U; i++) {
			if (sel[i] != (int32_t)e)
				continue;
			memcpy(xg + (size_t)cnt * E, io->x + i / U * E, E * sizeof(float));
			memcpy(rg + (size_t)cnt * E, io->resid + i / U * E, E * sizeof(float));
			s->bslot[cnt++] = (uint32_t)(i - b0 * U);
		}
		if (!cnt)
			continue;
		s->cur_expert = e;
		struct nf_ffn_io eio = { .layer = io->layer, .nb = cnt, .resid = rg, .x = xg, .out = og };
		int rc = nf_sp_tokens_forward(s, env, &eio);
		if (rc < 0)
			return rc;
		for (uint32_t i = 0; i < cnt; i++)
			memcpy(s->beout + (size_t)s->bslot[i] * E, og + (size_t)i * E, E * sizeof(float));
	}
	for (size_t b = b0; b < b1; b++)
		combine(s, s->beout + (b - b0) * U * E, w + b * U, io->out + b * E);
	return 0;
}

/*
 * Route-ahead: a decode token's guess for layer+1's experts from the router
 * of layer+1 applied to this layer's FFN input, checked when layer+1 routes
 * (colibri and PowerInfer-2 prefetch from such a guess). The router's
 * scratch is the context's: the caller keeps this layer's routing first.
 */
static void route_guess_check(struct nf_sparse *s, const struct nf_ffn_io *io, const int32_t *sel)
{
	size_t U = s->n_expert_used;
	if (io->nb != 1 || s->guess_layer != io->layer)
		return;
	for (size_t k = 0; k < U; k++)
		for (size_t j = 0; j < U; j++)
			s->st.route_guess_hits += sel[k] == s->guess[j];
	s->st.route_guesses += U;
}

static void route_guess_make(struct nf_sparse *s, const struct nf_ffn_io *io)
{
	s->guess_layer = UINT32_MAX;
	if (io->nb != 1 || io->layer + 1 >= s->n_layer)
		return;
	struct nf_ffn_io g = *io;
	g.layer = io->layer + 1;
	const int32_t *gs;
	const float *gw;
	if (nf_ctx_moe_route(s->ctx, &g, &gs, &gw) < 0)
		return;
	memcpy(s->guess, gs, s->n_expert_used * sizeof(int32_t));
	s->guess_layer = g.layer;
}

/*
 * Route-ahead prefetch: the neurons each guessed expert of layer+1 would
 * compute for this layer's FFN input (its predictor on this layer's
 * residual; exact and dense: all of them), read ahead through the cache
 * (nf_cache_prefetch: ordinary reads that layer+1's requests find), issued
 * right after this layer's own reads, so that they land during this
 * layer's compute and layer+1's attention. Only the cache's contents
 * change, never what a request hands out: the output is the same bits.
 */
static void route_prefetch(struct nf_sparse *s, const struct nf_ffn_io *io)
{
	if (!s->route_prefetch || s->guess_layer == UINT32_MAX)
		return;
	for (uint32_t k = 0; k < s->n_expert_used; k++) {
		s->cur_expert = (uint32_t)s->guess[k];
		nf_sp_token_masks(s, s->guess_layer, io->x, io->resid);
		uint32_t n = 0;
		for (uint32_t gi = 0; gi < s->n_groups; gi++)
			for (uint32_t m = s->gmask[gi]; m; m &= m - 1)
				s->req[n++] = gi * GROUP + (uint32_t)__builtin_ctz(m);
		if (nf_cache_prefetch(s->cache, s->guess_layer, s->cur_expert, s->req, n) >= 0)
			s->st.route_prefetches++;
	}
	s->cur_expert = 0;
}

/*
 * Each token: the router (the built-in FFN's, nf_ctx_moe_route), then each
 * routed expert in rank order as the FFN (layer, expert) (from a cache:
 * the experts' requests together when they fit, else one request each),
 * then out = sum over ranks of w * expert(x), summed as the built-in FFN
 * does. A batch from a cache: per expert, its tokens as one batch. In
 * decode, the next layer's experts are guessed (and read ahead).
 */
int nf_sp_moe_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	const int32_t *sel;
	const float *w;
	int rc = nf_ctx_moe_route(s->ctx, io, &sel, &w);
	size_t E = s->E, U = s->n_expert_used;
	if (rc == 0)
		route_guess_check(s, io, sel);
	/* with route-ahead prefetch (decode), layer+1 is guessed and read
	 * ahead as soon as this layer's reads are out: its router overwrites
	 * the context's routing scratch, so this layer's routing is kept */
	int32_t lsel[64];
	float lw[64];
	bool early = rc == 0 && s->route_prefetch && io->nb == 1 && U <= 64, guessed = false;
	if (early) {
		memcpy(lsel, sel, U * sizeof(int32_t));
		memcpy(lw, w, U * sizeof(float));
		sel = lsel;
		w = lw;
	}
	if (rc == 0 && s->bx && io->nb > 1) {
		s->guess_layer = UINT32_MAX;
		for (size_t b0 = 0; b0 < io->nb && rc == 0; b0 += s->n_batch) {
			size_t b1 = b0 + s->n_batch < io->nb ? b0 + s->n_batch : io->nb;
			rc = moe_batch(s, env, io, b0, b1, sel, w);
		}
		s->cur_expert = 0;
		return rc;
	}
	for (size_t b = 0; b < io->nb && rc == 0; b++) {
		const float *x = io->x + b * E, *resid = io->resid + b * E;
		int tg = s->cache ? request_together(s, io->layer, sel + b * U, x, resid) : 1;
		if (tg < 0)
			return tg;
		if (early && tg == 0) {
			/* this layer's reads are all out (and pinned); the masks
			 * reuse scratch that its compute sets again (gmask from
			 * xmask, xq from the same x). Experts requested one by
			 * one would evict what it reads: then after the layer. */
			route_guess_make(s, io);
			route_prefetch(s, io);
			guessed = true;
		}
		for (size_t k = 0; k < U && rc == 0; k++) {
			s->cur_expert = (uint32_t)sel[b * U + k];
			s->cur_k = tg == 0 ? (uint32_t)k : UINT32_MAX;
			rc = nf_sp_token_forward(s, env, io->layer, x, resid, s->eout + k * E);
		}
		if (tg == 0)
			rc = release_together(s, rc);
		if (rc == 0)
			combine(s, s->eout, w + b * U, io->out + b * E);
	}
	s->cur_expert = 0;
	if (rc == 0 && !guessed) {
		route_guess_make(s, io);
		if (early)
			route_prefetch(s, io);
	}
	return rc;
}
