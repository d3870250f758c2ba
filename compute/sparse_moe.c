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
 * Each token: the router (the built-in FFN's, nf_ctx_moe_route), then each
 * routed expert in rank order as the FFN (layer, expert) (from a cache: one
 * request for its neurons), then out = sum over ranks of w * expert(x),
 * summed as the built-in FFN does.
 */
int nf_sp_moe_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	const int32_t *sel;
	const float *w;
	int rc = nf_ctx_moe_route(s->ctx, io, &sel, &w);
	size_t E = s->E, U = s->n_expert_used;
	for (size_t b = 0; b < io->nb && rc == 0; b++) {
		for (size_t k = 0; k < U && rc == 0; k++) {
			s->cur_expert = (uint32_t)sel[b * U + k];
			rc = nf_sp_token_forward(s, env, io->layer, io->x + b * E, io->resid + b * E, s->eout + k * E);
		}
		float *o = io->out + b * E;
		for (size_t i = 0; i < E && rc == 0; i++) {
			float acc = 0.0f;
			for (size_t k = 0; k < U; k++)
				acc += s->eout[k * E + i] * w[b * U + k];
			o[i] = acc;
		}
	}
	s->cur_expert = 0;
	return rc;
}

/* Tokens of io: from a cache as one batch, or halves of it while the
 * union's misses outnumber the cold slots (each token's sums are its own,
 * so any split gives the same output), else one at a time. */
