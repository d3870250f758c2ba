/*
 * ffn_sparse.c - the sparse FFN engine (nflash/sparse.h): predictor, exact
 * two-phase and dense modes over 32-neuron groups, from the model's
 * in-memory weights or from the segmented cache. This file: names, the
 * forward entry point, set-up and tear-down; the parts are listed in
 * compute/sparse_impl.h with the engine's invariants.
 *
 * Invariants: everything forward() needs is allocated in nf_sparse_open()
 * (sparse_impl.h invariant 3), and the same arithmetic sizes it for the
 * budget (nf_sparse_bytes_for).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/store.h"
#include "sparse_impl.h"

/* ---- names ------------------------------------------------------------------ */

static const char *const mode_names[] = {
	[NF_SPARSE_AUTO] = "auto", [NF_SPARSE_PREDICTOR] = "predictor",
	[NF_SPARSE_EXACT] = "exact", [NF_SPARSE_DENSE] = "dense", [NF_SPARSE_OFF] = "off",
};

const char *nf_sparse_mode_name(enum nf_sparse_mode m)
{
	return (unsigned)m <= NF_SPARSE_OFF ? mode_names[m] : "?";
}

int nf_sparse_mode_parse(const char *name)
{
	for (int i = 0; i <= NF_SPARSE_OFF; i++)
		if (!strcmp(name, mode_names[i]))
			return i;
	return -1;
}

void nf_sparse_params_init(struct nf_sparse_params *p)
{
	memset(p, 0, sizeof(*p));
	p->mode = NF_SPARSE_AUTO;
}

/* Tokens of io through FFN (io->layer, s->cur_expert): from a cache as one
 * batch, or halves of it while the union's misses outnumber the cold slots
 * (each token's sums are its own, so any split gives the same output),
 * else one at a time. */
int nf_sp_tokens_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	if (s->cache && io->nb > 1 && io->nb <= s->n_batch) {
		int rc = nf_sp_batch_forward(s, env, io);
		if (rc != BATCH_TOO_BIG)
			return rc;
		s->st.batch_splits++;
		size_t h = io->nb / 2, E = s->E;
		struct nf_ffn_io a = *io, b = *io;
		a.nb = h;
		b.nb = io->nb - h;
		b.x += h * E;
		b.resid += h * E;
		b.out += h * E;
		if ((rc = nf_sp_tokens_forward(s, env, &a)) < 0)
			return rc;
		return nf_sp_tokens_forward(s, env, &b);
	}
	int rc = 0;
	s->decode_now = io->nb == 1;
	if (!s->decode_now)
		s->la_layer = UINT32_MAX; /* a guess is checked by the same token's next layer only */
	for (size_t b = 0; b < io->nb && rc == 0; b++)
		rc = nf_sp_token_forward(s, env, io->layer, io->x + b * s->E, io->resid + b * s->E, io->out + b * s->E);
	return rc;
}

static int sparse_forward(void *self, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	struct nf_sparse *s = self;
	if (!nf_sp_tab(s, io->layer, 0)->sparse)
		return nf_ctx_ffn_builtin(s->ctx, io);
	int rc = 0;
	if (s->cache && io->layer == 0) {
		/* between tokens: no slot of any layer is in use */
		if (s->hot_after && s->tokens >= s->next_hot) {
			double th = nf_sp_now();
			if ((rc = nf_cache_hot_load(s->cache)) < 0)
				return rc;
			s->st.hot_loads++;
			s->st.t_hot += nf_sp_now() - th;
			s->next_hot = s->tokens + 16ull * s->hot_after;
		} else if (s->replan_moves && s->tokens / NF_SPARSE_DECAY_TOKENS !=
						      (s->tokens + io->nb) / NF_SPARSE_DECAY_TOKENS) {
			nf_cache_decay(s->cache); /* the hot set follows recent text */
		}
		/* a re-planning step: each layer, once done, trades its cold-
		 * resident neurons that now fire more for hot ones */
		s->replan_now = s->replan_moves && !s->hot_after && s->tokens &&
				s->tokens / NF_SPARSE_REPLAN_TOKENS != (s->tokens + io->nb) / NF_SPARSE_REPLAN_TOKENS;
		s->tokens += io->nb;
	}
	/* llama.cpp's products have one column for a single token, and for
	 * experts always (mul_mat_id runs vec_dot): invariant 8 */
	s->one_col = io->nb == 1 || s->n_expert;
	double t0 = nf_sp_now();
	if (s->n_expert)
		rc = nf_sp_moe_forward(s, env, io);
	else
		rc = nf_sp_tokens_forward(s, env, io);
	s->st.t_ffn += nf_sp_now() - t0;
	if (rc == 0 && s->replan_now) {
		/* each FFN of the layer (every expert: one not routed now has
		 * nothing cold-resident to trade and returns at once) */
		double th = nf_sp_now();
		for (uint32_t e = 0; e < s->nx; e++)
			nf_cache_rebalance(s->cache, io->layer, e, s->replan_moves);
		s->st.t_hot += nf_sp_now() - th;
	}
	return rc;
}

/* ---- set-up ------------------------------------------------------------------------ */

/* calloc counted in s->bytes; in a sizing pass (nf_sparse_bytes_for) only
 * counted, returning a pointer that is never dereferenced */
static void *zalloc(struct nf_sparse *s, size_t n)
{
	if (s->count_only) {
		s->bytes += n;
		return s;
	}
	void *p = calloc(1, n ? n : 1);
	if (p)
		s->bytes += n;
	return p;
}

/* The per-call, per-thread and batch scratch: everything forward() needs
 * beyond the layer tables, sized from s's geometry (E, F, kt_gu, n_expert,
 * threads) and ctx's batch. The one place this arithmetic lives: the
 * engine sizes its budget from it (nf_sparse_bytes_for). */
static int scratch(struct nf_sparse *s, const struct nf_ctx *ctx)
{
	const struct nf_model *m = nf_ctx_model(ctx);
	size_t xq = nf_act_size(s->kt_gu, s->E);
	size_t hq = 0;
	if (s->rank) {
		const struct nf_layer_weights *L = nf_model_layer(m, 0);
		size_t a = nf_act_size(L->fc1.kt, s->E), b = nf_act_size(L->fc2.kt, s->rank);
		hq = a > b ? a : b;
	}
	s->act_stride = (size_t)s->E * sizeof(int32_t) + 256;
	s->xq_size = (xq + 63) & ~(size_t)63;
	/* a mixture of experts gathers each expert's tokens of a forward step
	 * (n_batch x n_expert_used x n_embd floats of per-slot outputs) */
	s->n_batch = s->cache ? nf_ctx_n_batch(ctx) : 0;
	/* every chunk but the last holds CHUNK_NEURONS active neurons or more */
	s->max_chunks = s->F / CHUNK_NEURONS + 1;
	if (!(s->xq = zalloc(s, xq)) || !(s->hq = zalloc(s, hq + 64)) ||
	    !(s->h1 = zalloc(s, (s->rank + 1) * sizeof(float))) ||
	    !(s->score = zalloc(s, s->F * sizeof(float))) ||
	    !(s->groups = zalloc(s, s->n_groups * sizeof(*s->groups))) ||
	    !(s->gmask = zalloc(s, s->n_groups * sizeof(uint32_t))) ||
	    (s->cache && !(s->la_mask = zalloc(s, s->n_groups * sizeof(uint32_t)))) ||
	    !(s->chunks = zalloc(s, s->max_chunks * sizeof(*s->chunks))) ||
	    !(s->ready = zalloc(s, s->max_chunks * sizeof(uint32_t))) ||
	    !(s->ptrs = zalloc(s, s->F * sizeof(void *))) ||
	    !(s->req = zalloc(s, 2ull * s->F * sizeof(uint32_t))) ||
	    !(s->gout = zalloc(s, (size_t)s->max_chunks * s->E * sizeof(float))) ||
	    !(s->tscratch = zalloc(s, (size_t)s->nth * s->act_stride)) ||
	    (s->n_expert && !(s->eout = zalloc(s, (size_t)s->n_expert_used * s->E * sizeof(float)))) ||
	    (s->n_expert && !(s->xst = zalloc(s, (size_t)s->n_layer * s->n_expert * sizeof(*s->xst)))) ||
	    (s->n_expert && !(s->guess = zalloc(s, (size_t)s->n_expert_used * sizeof(int32_t)))))
		return -ENOMEM;
	s->guess_layer = UINT32_MAX;
	s->la_layer = UINT32_MAX;
	size_t U = s->n_expert_used;
	if (s->cache && s->n_expert &&
	    (!(s->xtag = zalloc(s, U * sizeof(*s->xtag))) ||
	     !(s->xmask = zalloc(s, U * s->n_groups * sizeof(uint32_t))) ||
	     !(s->xpend = zalloc(s, U * s->n_groups * sizeof(atomic_uint))) ||
	     !(s->xptrs = zalloc(s, U * s->F * sizeof(void *))) ||
	     !(s->xactive = zalloc(s, U * sizeof(uint64_t)))))
		return -ENOMEM;
	if (s->cache && s->n_expert && s->n_batch > 1 &&
	    (!(s->bx = zalloc(s, 3 * (size_t)s->n_batch * s->E * sizeof(float))) ||
	     !(s->beout = zalloc(s, (size_t)s->n_batch * U * s->E * sizeof(float))) ||
	     !(s->bslot = zalloc(s, (size_t)s->n_batch * sizeof(uint32_t)))))
		return -ENOMEM;
	if (!s->count_only) {
		s->tag0 = (struct sp_tag){ .s = s, .k = UINT32_MAX };
		s->cur_k = UINT32_MAX;
		for (uint32_t k = 0; s->xtag && k < U; k++)
			s->xtag[k] = (struct sp_tag){ .s = s, .k = k };
	}
	/* QCOL downs wait for the layer's activations (invariant 7) */
	bool qcol = s->form == DOWN_QCOL;
	if (qcol &&
	    (!(s->kact = zalloc(s, s->F * sizeof(float))) ||
	     (s->kgroups > 1 && !(s->kx = zalloc(s, (size_t)(s->F / NF_QK_K) * sizeof(struct nf_block_q8_K)))) ||
	     !(s->qx = zalloc(s, (size_t)(s->F / GROUP) * sizeof(struct nf_block_q8_0))) ||
	     !(s->kacc = zalloc(s, (size_t)s->E * KACC * sizeof(float)))))
		return -ENOMEM;
	if (s->fdown &&
	    ((!s->kact && !(s->kact = zalloc(s, s->F * sizeof(float)))) ||
	     !(s->flanes = zalloc(s, (size_t)64 * s->E * sizeof(float))) ||
	     !(s->facc = zalloc(s, (size_t)s->E * sizeof(double)))))
		return -ENOMEM;
	if (s->n_batch > 1 && s->fdown &&
	    ((!s->bkact && !(s->bkact = zalloc(s, (size_t)s->n_batch * s->F * sizeof(float)))) ||
	     !(s->bflanes = zalloc(s, (size_t)s->nth * 64 * s->E * sizeof(float))) ||
	     !(s->bfacc = zalloc(s, (size_t)s->nth * s->E * sizeof(double)))))
		return -ENOMEM;
	if (s->n_batch > 1 && qcol &&
	    (!(s->bkact = zalloc(s, (size_t)s->n_batch * s->F * sizeof(float))) ||
	     (s->kgroups > 1 &&
	      !(s->bkx = zalloc(s, (size_t)s->nth * (s->F / NF_QK_K) * sizeof(struct nf_block_q8_K)))) ||
	     !(s->bqx = zalloc(s, (size_t)s->nth * (s->F / GROUP) * sizeof(struct nf_block_q8_0))) ||
	     !(s->bkacc = zalloc(s, (size_t)s->nth * s->E * KACC * sizeof(float)))))
		return -ENOMEM;
	if (s->n_batch > 1 &&
	    (!(s->bxq = zalloc(s, (size_t)s->n_batch * s->xq_size)) ||
	     !(s->bmask = zalloc(s, (size_t)s->n_batch * s->n_groups * sizeof(uint32_t))) ||
	     !(s->bchunk = zalloc(s, (size_t)s->n_batch * 2 * sizeof(uint32_t))) ||
	     !(s->bsum = zalloc(s, (size_t)s->nth * s->E * sizeof(float)))))
		return -ENOMEM;
	return 0;
}

/* Repack a regular down matrix [E rows x F] into per-neuron parts. */
static int tab_down_regular(struct nf_sparse *s, struct layer_tab *t, const struct nf_weight *w)
{
	uint32_t E = s->E, F = s->F;
	if (w->dtype == NF_DTYPE_F32 || w->dtype == NF_DTYPE_F16 || w->dtype == NF_DTYPE_BF16) {
		size_t esz = w->dtype == NF_DTYPE_F32 ? 4 : 2;
		char *o = zalloc(s, (size_t)F * E * esz);
		if (!o)
			return -ENOMEM;
		for (uint32_t r = 0; r < E; r++) {
			const char *row = (const char *)w->data + (size_t)r * w->row_bytes;
			for (uint32_t j = 0; j < F; j++)
				memcpy(o + ((size_t)j * E + r) * esz, row + (size_t)j * esz, esz);
		}
		t->owned = o;
		t->down = o;
		t->down_stride = (size_t)E * esz;
		return 0;
	}
	if (nf_dtype_is_kquant(w->dtype)) {
		/* K-quant QCOL: bit-packed columns and the blocks' heads, as a
		 * store holds them (nflash/bundle.h) */
		struct nf_bundle_src src = { .down = w->data, .dtype_down = w->dtype, .n_embd = E, .n_ff = F };
		uint64_t shape[2];
		struct nf_bundle_layout L = { .dtype = w->dtype, .dim = E, .n_neurons = F,
					      .down_form = NF_DOWN_QCOL, .down_dtype = w->dtype };
		L.down_bytes = (uint32_t)((uint64_t)E * nf_kquant_bits(w->dtype) / 8);
		L.bundle_bytes = L.stride = L.down_bytes;
		nf_bundle_scales_shape(&L, shape);
		size_t colb = (size_t)F * L.down_bytes;
		char *o = zalloc(s, colb + (size_t)(shape[0] * shape[1]) * sizeof(uint16_t));
		if (!o)
			return -ENOMEM;
		if (!s->count_only) {
			nf_bundle_pack_down_columns(&src, &L, 0, F, o);
			nf_bundle_pack_scales(&src, (uint16_t *)(o + colb));
		}
		t->owned = o;
		t->down = o;
		t->down_stride = L.down_bytes;
		t->scales = (const uint16_t *)(o + colb);
		return 0;
	}
	/* quantized: QCOL columns and fp16 scales d[b][r] */
	bool q8 = w->dtype == NF_DTYPE_Q8_0;
	size_t col = q8 ? E : E / 2;
	char *o = zalloc(s, (size_t)F * col + (size_t)(F / GROUP) * E * sizeof(uint16_t));
	if (!o)
		return -ENOMEM;
	uint16_t *sc = (uint16_t *)(o + (size_t)F * col);
	for (uint32_t r = 0; r < E; r++) {
		const char *row = (const char *)w->data + (size_t)r * w->row_bytes;
		for (uint32_t b = 0; b < F / GROUP; b++) {
			int8_t q[GROUP];
			if (q8) {
				const struct nf_block_q8_0 *blk = (const struct nf_block_q8_0 *)row + b;
				sc[(size_t)b * E + r] = blk->d;
				memcpy(q, blk->qs, GROUP);
			} else {
				const struct nf_block_q4_0 *blk = (const struct nf_block_q4_0 *)row + b;
				sc[(size_t)b * E + r] = blk->d;
				for (uint32_t i = 0; i < GROUP / 2; i++) {
					q[i] = (int8_t)((blk->qs[i] & 0x0f) - 8);
					q[i + GROUP / 2] = (int8_t)((blk->qs[i] >> 4) - 8);
				}
			}
			for (uint32_t i = 0; i < GROUP; i++) {
				char *c = o + (size_t)(b * GROUP + i) * col;
				if (q8) {
					c[r] = (char)q[i];
				} else {
					uint8_t nib = (uint8_t)(q[i] + 8);
					uint8_t *byte = (uint8_t *)c + r / 2;
					*byte = (r & 1) ? (uint8_t)((*byte & 0x0f) | (nib << 4))
							: (uint8_t)((*byte & 0xf0) | nib);
				}
			}
		}
	}
	t->owned = o;
	t->down = o;
	t->down_stride = col;
	t->scales = sc;
	return 0;
}

static enum nf_sparse_mode resolve_mode(const struct nf_model_hparams *hp, bool has_pred,
					enum nf_sparse_mode m)
{
	if (m != NF_SPARSE_AUTO)
		return m;
	if (has_pred)
		return NF_SPARSE_PREDICTOR;
	return hp->act == NF_FFN_SILU ? NF_SPARSE_DENSE : NF_SPARSE_EXACT;
}

/* What the model and the context fix: sizes, kernels, threads. */
static void init_state(struct nf_sparse *s, struct nf_ctx *ctx, struct nf_cache *cache)
{
	const struct nf_model *m = nf_ctx_model(ctx);
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	s->ctx = ctx;
	s->m = m;
	s->k = nf_ctx_kernels(ctx);
	s->E = hp->n_embd;
	s->F = hp->n_ff;
	s->n_layer = hp->n_layer;
	s->act = hp->act;
	s->cache = cache;
	s->nth = nf_ctx_n_threads(ctx) > 0 ? nf_ctx_n_threads(ctx) : 1;
	s->nx = hp->n_expert ? hp->n_expert : 1;
	s->n_groups = (s->F + GROUP - 1) / GROUP;
	s->last_mask = s->F % GROUP ? (1u << (s->F % GROUP)) - 1u : UINT32_MAX;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		if (L->fc1.data && L->fc1.nrows > s->rank)
			s->rank = L->fc1.nrows;
	}
}

/* The kernel of the gate and up rows: the dense FFN's (nf_ktype_matrix),
 * so a row sums in the order llama.cpp's matrix would. */
static int gu_ktype(const struct nf_sparse *s)
{
	return nf_ktype_matrix(s->dt_gu, s->F, nf_model_hparams(s->m)->powerinfer);
}

/* The bundles' forms, from the store's geometry. */
/* Invariant 8: F16 down columns of a llama.cpp model (PowerInfer's
 * ffn_down_t keeps its ggml's neuron-by-neuron order). */
static bool fdown_of(const struct nf_sparse *s)
{
	return s->dt_down == NF_DTYPE_F16 && s->form == DOWN_ROW && !nf_model_hparams(s->m)->powerinfer;
}

static void forms_of_geometry(struct nf_sparse *s, const struct nf_cache_geom *g)
{
	s->has_gate = g->has_gate;
	s->dt_gu = g->dtype;
	s->dt_down = g->down_dtype;
	s->form = g->down_form == NF_CACHE_DOWN_QCOL ? DOWN_QCOL : DOWN_ROW;
	s->up_off_bundle = g->has_gate ? g->row_bytes : 0;
	s->down_off_bundle = g->down_off;
	s->kgroups = s->form == DOWN_QCOL && nf_dtype_is_kquant(s->dt_down) ? NF_QK_K / GROUP : 1;
	s->kt_gu = gu_ktype(s);
	s->kt_down = nf_ktype_of(s->dt_down);
	s->fdown = fdown_of(s);
}

/* The mode asked for, checked against the model. */
static int check_mode(struct nf_sparse *s, const struct nf_sparse_params *p, struct nf_diag *diag)
{
	const struct nf_model_hparams *hp = nf_model_hparams(s->m);
	bool has_pred = s->rank;
	for (uint32_t il = 0; il < hp->n_layer; il++)
		has_pred &= nf_model_layer(s->m, il)->fc1.data != NULL;
	s->mode = resolve_mode(hp, has_pred, p->mode);
	s->threshold = p->threshold_set ? p->threshold : hp->sparse_threshold;
	s->measure_recall = p->measure_recall;
	s->hot_after = p->hot_after;
	s->next_hot = p->hot_after;
	s->replan_moves = p->replan_moves;
	/* the measured defaults: a mixture's whole experts' reads gain from
	 * going out a layer early, its predicted neurons' scattered ones did
	 * not; a dense FFN's predicted neurons did (docs/PIPELINE.md) */
	s->route_prefetch = p->cache && (p->route_prefetch < 0 ? s->mode != NF_SPARSE_PREDICTOR : p->route_prefetch > 0);
	s->layer_ahead = p->cache && s->mode == NF_SPARSE_PREDICTOR && p->route_prefetch != 0;
	s->la_min_right = p->ahead_min_right > 0 ? p->ahead_min_right : NF_SPARSE_AHEAD_MIN_RIGHT;
	if (s->mode == NF_SPARSE_OFF)
		return 0;
	s->n_expert = hp->n_expert;
	s->n_expert_used = hp->n_expert_used;
	if (s->mode == NF_SPARSE_PREDICTOR && !has_pred)
		return nf_diag_fail(diag, NF_EUSAGE, "--sparse-mode predictor: the model has no predictor (blk.N.fc1/fc2)");
	if (s->mode == NF_SPARSE_EXACT && hp->act == NF_FFN_SILU)
		return nf_diag_fail(diag, NF_EUSAGE, "--sparse-mode exact: needs a ReLU or dReLU model; this one is %s",
				    nf_ffn_act_name(hp->act));
	return 0;
}

/* The in-memory matrices of FFN (layer il, expert e): gate (data NULL
 * without), up, and down: the regular [n_embd x n_ff] or, in PowerInfer
 * files, the transposed down_t (*transposed). Experts are never transposed. */
static void ffn_mats(const struct nf_sparse *s, uint32_t il, uint32_t e, struct nf_weight *g,
		     struct nf_weight *u, struct nf_weight *d, bool *transposed)
{
	const struct nf_layer_weights *L = nf_model_layer(s->m, il);
	if (s->n_expert) {
		*g = nf_weight_expert(&L->gate_exps, e);
		*u = nf_weight_expert(&L->up_exps, e);
		*d = nf_weight_expert(&L->down_exps, e);
		*transposed = false;
		return;
	}
	*g = L->gate;
	*u = L->up;
	*transposed = L->down_t.data != NULL;
	*d = *transposed ? L->down_t : L->down;
}

/* Where the FFN's bytes come from (the cache's bundles or the model's
 * matrices) and in which forms; checks they fit the model and a kernel. */
static int forms(struct nf_sparse *s, struct nf_diag *diag)
{
	const struct nf_model_hparams *hp = nf_model_hparams(s->m);
	const struct nf_layer_weights *L0 = nf_model_layer(s->m, 0);
	uint32_t gate_dt = 0;
	if (s->cache) {
		struct nf_cache_geom g;
		nf_cache_geometry(s->cache, &g);
		if (g.dim != s->E || g.n_neurons != s->F || g.n_layer < hp->n_layer)
			return nf_diag_fail(diag, NF_EUSAGE,
					    "sparse FFN: the store's bundles (dim %u, %u neurons, %u layers) do not match "
					    "the model (n_embd %u, n_ff %u, %u layers)",
					    g.dim, g.n_neurons, g.n_layer, s->E, s->F, hp->n_layer);
		forms_of_geometry(s, &g);
		gate_dt = s->dt_gu;
		if (L0->up.data && (L0->up.dtype != s->dt_gu || (L0->gate.data != NULL) != s->has_gate))
			return nf_diag_fail(diag, NF_EUSAGE, "sparse FFN: the store's bundles are %s, the model's FFN %s",
					    nf_dtype_name(s->dt_gu), nf_dtype_name(L0->up.dtype));
	} else {
		struct nf_weight g, u, d;
		bool transposed;
		ffn_mats(s, 0, 0, &g, &u, &d, &transposed);
		if (!u.data)
			return nf_diag_fail(diag, NF_EUSAGE,
					    "sparse FFN: the model's FFN weights are not in memory (a store): give a cache");
		s->has_gate = g.data != NULL;
		s->dt_gu = u.dtype;
		gate_dt = g.data ? g.dtype : u.dtype;
		s->dt_down = d.dtype;
		bool q = nf_dtype_block_len(s->dt_down) > 1;
		s->form = (!transposed && q) ? DOWN_QCOL : DOWN_ROW;
		s->kgroups = s->form == DOWN_QCOL && nf_dtype_is_kquant(s->dt_down) ? NF_QK_K / GROUP : 1;
		s->kt_gu = gu_ktype(s);
		s->kt_down = nf_ktype_of(s->dt_down);
		s->fdown = fdown_of(s);
	}
	if (nf_dtype_is_legacy(s->dt_gu) || nf_dtype_is_legacy(gate_dt) || nf_dtype_is_legacy(s->dt_down))
		return nf_diag_fail(diag, NF_EUNSUPPORTED,
				    "sparse FFN: %s/%s FFN weights have no neuron form yet; the built-in dense "
				    "FFN runs them (--sparse-mode off)",
				    nf_dtype_name(s->dt_gu), nf_dtype_name(s->dt_down));
	bool quant_down = nf_dtype_block_len(s->dt_down) > 1;
	if (quant_down && s->F % (GROUP * s->kgroups))
		return nf_diag_fail(diag, NF_EFORMAT, "sparse FFN: %s down with n_ff %u not a multiple of %u",
				    nf_dtype_name(s->dt_down), s->F, GROUP * s->kgroups);
	if (s->cache && s->kgroups > 1 && s->cap < CHUNK_MAX)
		return nf_diag_fail(diag, NF_EBUDGET,
				    "sparse FFN: a %s down needs a cold segment of at least %u bundles (one chunk of "
				    "whole 256-neuron super-blocks); the cache has %u (--cold-slots)",
				    nf_dtype_name(s->dt_down), CHUNK_MAX, s->cap);
	if (s->kt_gu < 0 || s->kt_down < 0 || gate_dt != s->dt_gu)
		return nf_diag_fail(diag, NF_EUNSUPPORTED, "sparse FFN: weight types %s/%s have no bundle form",
				    nf_dtype_name(s->dt_gu), nf_dtype_name(s->dt_down));
	return 0;
}

/* FFN (layer il, expert e)'s table: predictor, down type, and where its
 * bytes are. */
static int build_tab(struct nf_sparse *s, uint32_t il, uint32_t e, struct nf_diag *diag)
{
	const struct nf_layer_weights *L = nf_model_layer(s->m, il);
	struct layer_tab *t = nf_sp_tab(s, il, e);
	t->sparse = true;
	t->fc1 = nf_weight_expert(&L->fc1, e);
	t->fc2 = nf_weight_expert(&L->fc2, e);
	if (t->fc2.data && t->fc2.nrows != s->F)
		return nf_diag_fail(diag, NF_EFORMAT, "blk.%u.fc2: %u outputs, n_ff is %u", il, t->fc2.nrows, s->F);
	struct nf_weight g, u, d;
	bool transposed = false;
	if (!s->cache)
		ffn_mats(s, il, e, &g, &u, &d, &transposed);
	/* K-quant downs may change type from layer to layer (llama-quantize's
	 * _M recipes); any other type is the same in every layer */
	t->dt_down = s->dt_down;
	struct nf_bundle_layout bl;
	if (s->cache && nf_model_ffn_layout(s->m, il, e, NULL, &bl, NULL, NULL) == 0)
		t->dt_down = bl.down_dtype;
	else if (!s->cache)
		t->dt_down = d.dtype;
	t->kt_down = nf_ktype_of(t->dt_down);
	if (t->dt_down != s->dt_down &&
	    (!nf_dtype_is_kquant(t->dt_down) || !nf_dtype_is_kquant(s->dt_down) || s->form != DOWN_QCOL ||
	     t->kt_down < 0))
		return nf_diag_fail(diag, NF_EUNSUPPORTED,
				    "sparse FFN: layer %u's down matrix is %s, layer 0's %s (only K-quant down "
				    "matrices may differ per layer)", il, nf_dtype_name(t->dt_down),
				    nf_dtype_name(s->dt_down));
	if (s->cache) {
		if (s->form != DOWN_QCOL)
			return 0;
		const uint16_t *sc = NULL;
		if (nf_model_ffn_layout(s->m, il, e, NULL, NULL, &sc, NULL) < 0 || !sc)
			return nf_diag_fail(diag, NF_EUNSUPPORTED,
					    "sparse FFN: layer %u expert %u: QCOL bundles need their scales: run the "
					    "store itself (-m STORE), not a GGUF with --ffn-store", il, e);
		t->scales = sc;
		return 0;
	}
	t->gate = g.data;
	t->gate_stride = g.row_bytes;
	t->up = u.data;
	t->up_stride = u.row_bytes;
	if (u.dtype != s->dt_gu)
		return nf_diag_fail(diag, NF_EUNSUPPORTED, "sparse FFN: layer %u has other weight types than layer 0", il);
	if (transposed) {
		t->down = d.data;
		t->down_stride = d.row_bytes;
		return 0;
	}
	return tab_down_regular(s, t, &d);
}

/* Gate-first buffers: one per routed expert (1 for a dense FFN), each the
 * largest gate-rows object rounded to the I/O alignment. */
static uint64_t gate_buf_bytes(const struct nf_sparse *s, uint64_t stride)
{
	return (uint64_t)(s->n_expert_used ? s->n_expert_used : 1) * stride;
}

uint64_t nf_sparse_gate_first_bytes(const struct nf_ctx *ctx, const struct nf_cache_geom *g)
{
	struct nf_sparse s = { 0 };
	init_state(&s, (struct nf_ctx *)ctx, NULL);
	s.n_expert_used = nf_model_hparams(s.m)->n_expert_used;
	uint64_t len = (uint64_t)g->n_neurons * g->row_bytes;
	return gate_buf_bytes(&s, (len + 4095) / 4096 * 4096) + s.n_layer * s.nx * sizeof(void *);
}

/* Gate-first exact mode: every FFN's gate-rows object in the cache's store
 * and the buffers they are read into. */
static int gate_first_setup(struct nf_sparse *s, struct nf_diag *diag)
{
	if (!s->cache || s->mode != NF_SPARSE_EXACT || !s->has_gate)
		return nf_diag_fail(diag, NF_EUSAGE, "--gate-first: needs exact mode (a ReLU/dReLU model without a "
				    "predictor) from a store");
	struct nf_store *st = nf_cache_store(s->cache);
	uint32_t align = nf_cache_align(s->cache);
	uint64_t len = 0;
	if (!(s->gobj = zalloc(s, (size_t)s->n_layer * s->nx * sizeof(*s->gobj))))
		return -ENOMEM;
	for (uint32_t il = 0; il < s->n_layer; il++)
		for (uint32_t e = 0; e < s->nx; e++) {
			const struct nf_store_object *f = nf_store_ffn_find(st, il, e);
			const struct nf_store_object *g = f ? nf_store_ffn_gate_rows(st, f) : NULL;
			if (!g)
				return nf_diag_fail(diag, NF_EUSAGE, "--gate-first: the store has no gate rows for layer %u "
						    "expert %u (import it with --gate-objects)", il, e);
			s->gobj[(size_t)il * s->nx + e] = g;
			uint64_t b = nf_store_object_buf_size(g, align);
			len = b > len ? b : len;
		}
	s->gbuf_stride = (size_t)((len + 4095) / 4096 * 4096);
	uint64_t n = gate_buf_bytes(s, s->gbuf_stride);
	if (!(s->gbuf = nf_io_buf_alloc((size_t)n, align > 4096 ? align : 4096)) ||
	    !(s->gdone = zalloc(s, (size_t)(s->n_expert_used ? s->n_expert_used : 1) * sizeof(atomic_int))) ||
	    !(s->gheld = zalloc(s, (size_t)(s->n_expert_used ? s->n_expert_used : 1) * sizeof(uint32_t))))
		return -ENOMEM;
	memset(s->gheld, 0xff, (size_t)(s->n_expert_used ? s->n_expert_used : 1) * sizeof(uint32_t));
	s->bytes += n;
	s->gate_first = true;
	s->route_prefetch = false; /* it would read the guessed experts' every bundle */
	return 0;
}

int nf_sparse_open(struct nf_ctx *ctx, const struct nf_sparse_params *p, struct nf_sparse **out,
		   struct nf_diag *diag)
{
	int rc;
	struct nf_sparse *s = calloc(1, sizeof(*s));
	if (!s)
		return nf_diag_fail(diag, -ENOMEM, "sparse engine: out of memory");
	s->bytes = sizeof(*s);
	init_state(s, ctx, p->cache);
	if (s->cache) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(s->cache, &cl);
		s->cap = cl.cold_slots;
	}
	s->ops = (struct nf_ffn_ops){ .name = "sparse", .forward = sparse_forward };
	if ((rc = check_mode(s, p, diag)) < 0)
		goto fail;
	if (s->mode == NF_SPARSE_OFF) {
		*out = s;
		return 0;
	}
	if ((rc = forms(s, diag)) < 0)
		goto fail;
	rc = -ENOMEM;
	if (!(s->tabs = zalloc(s, (size_t)s->n_layer * s->nx * sizeof(*s->tabs))))
		goto fail;
	for (uint32_t il = 0; il < s->n_layer; il++)
		for (uint32_t e = 0; e < s->nx; e++)
			if ((rc = build_tab(s, il, e, diag)) < 0)
				goto fail;
	if ((rc = scratch(s, ctx)) < 0)
		goto fail;
	if (p->gate_first && (rc = gate_first_setup(s, diag)) < 0)
		goto fail;
	if (p->record_moments && s->mode == NF_SPARSE_PREDICTOR && s->rank) {
		rc = -ENOMEM;
		s->mom_stride = 1 + (size_t)s->rank + (size_t)s->rank * s->rank;
		/* counted with the profile's record (the engine's fit), not here */
		if (!(s->mom = calloc((size_t)s->n_layer * s->nx * s->mom_stride, sizeof(double))))
			goto fail;
	}
	for (uint32_t il = 0; il < s->n_layer; il++)
		nf_ctx_set_ffn(ctx, il, &s->ops, s);
	*out = s;
	return 0;
fail:
	if (rc == -ENOMEM)
		nf_diag_fail(diag, -ENOMEM, "sparse engine: out of memory");
	nf_sparse_close(s);
	return rc;
}

uint32_t nf_sparse_pred_record(const struct nf_sparse *s, uint32_t layer, uint32_t expert, uint64_t *n,
			       const double **sum, const double **sq)
{
	if (!s || !s->mom || layer >= s->n_layer || expert >= s->nx)
		return 0;
	const struct layer_tab *t = nf_sp_tab(s, layer, expert);
	uint32_t r = t->fc1.data ? t->fc1.nrows : 0;
	const double *m = s->mom + ((size_t)layer * s->nx + expert) * s->mom_stride;
	if (!r || t->fc2.nrows != s->F)
		return 0;
	*n = (uint64_t)m[0];
	*sum = m + 1;
	*sq = m + 1 + r;
	return r;
}

int nf_sparse_pred_fc2(const struct nf_sparse *s, uint32_t layer, uint32_t expert, float *rows)
{
	if (!s || layer >= s->n_layer || expert >= s->nx)
		return NF_EUNSUPPORTED;
	const struct nf_weight *w = &nf_sp_tab(s, layer, expert)->fc2;
	if (!w->data || w->packed || w->nrows != s->F)
		return NF_EUNSUPPORTED;
	for (uint32_t j = 0; j < w->nrows; j++)
		nf_dequantize_row(w->dtype, (const char *)w->data + (size_t)j * w->row_bytes, rows + (size_t)j * w->n,
				  w->n);
	return 0;
}

uint32_t nf_sparse_min_cold_slots(const struct nf_cache_geom *g)
{
	return g->down_form == NF_CACHE_DOWN_QCOL && nf_dtype_is_kquant(g->down_dtype) ? CHUNK_MAX : 1;
}

uint64_t nf_sparse_bytes_for(const struct nf_ctx *ctx, const struct nf_cache_geom *g)
{
	struct nf_sparse s = { .count_only = true, .bytes = sizeof(struct nf_sparse) };
	/* the cache is only tested for NULL ("from a cache") here */
	init_state(&s, (struct nf_ctx *)ctx, (struct nf_cache *)&s);
	const struct nf_model_hparams *hp = nf_model_hparams(s.m);
	s.n_expert = hp->n_expert;
	s.n_expert_used = hp->n_expert_used;
	forms_of_geometry(&s, g);
	if (s.kt_gu < 0)
		return 0;
	zalloc(&s, (size_t)s.n_layer * s.nx * sizeof(struct layer_tab));
	scratch(&s, ctx);
	return s.bytes;
}

void nf_sparse_close(struct nf_sparse *s)
{
	if (!s)
		return;
	if (s->tabs) {
		for (uint32_t il = 0; il < s->n_layer; il++)
			nf_ctx_set_ffn(s->ctx, il, NULL, NULL);
		for (size_t i = 0; i < (size_t)s->n_layer * s->nx; i++)
			free(s->tabs[i].owned);
	}
	free(s->tabs);
	free(s->xq);
	free(s->hq);
	free(s->h1);
	free(s->score);
	free(s->groups);
	free(s->chunks);
	free(s->ready);
	free(s->ptrs);
	free(s->req);
	free(s->gout);
	free(s->tscratch);
	free(s->kact);
	free(s->flanes);
	free(s->facc);
	free(s->bflanes);
	free(s->bfacc);
	free(s->kx);
	free(s->qx);
	free(s->kacc);
	free(s->bkact);
	free(s->bkx);
	free(s->bqx);
	free(s->bkacc);
	free(s->gmask);
	free(s->la_mask);
	free(s->bxq);
	free(s->bmask);
	free(s->bchunk);
	free(s->bsum);
	free(s->eout);
	free(s->xst);
	free(s->guess);
	free(s->xtag);
	free(s->xmask);
	free((void *)s->xpend);
	free(s->xptrs);
	free(s->xactive);
	free(s->bx);
	free(s->beout);
	free(s->bslot);
	free(s->gobj);
	nf_io_buf_free(s->gbuf);
	free((void *)s->gdone);
	free(s->gheld);
	free(s->mom);
	free(s);
}

enum nf_sparse_mode nf_sparse_mode_of(const struct nf_sparse *s)
{
	return s->mode;
}

float nf_sparse_threshold(const struct nf_sparse *s)
{
	return s->threshold;
}

uint64_t nf_sparse_bytes(const struct nf_sparse *s)
{
	return s->bytes;
}

void nf_sparse_stats_get(const struct nf_sparse *s, struct nf_sparse_stats *out)
{
	*out = s->st;
	out->ahead_stopped = s->la_stopped;
}

void nf_sparse_stats_reset(struct nf_sparse *s)
{
	memset(&s->st, 0, sizeof(s->st));
	if (s->xst)
		memset(s->xst, 0, (size_t)s->n_layer * s->n_expert * sizeof(*s->xst));
}

const struct nf_sparse_expert_stats *nf_sparse_expert_stats(const struct nf_sparse *s)
{
	return s->xst;
}
void nf_sparse_ffn_ops(const struct nf_sparse *s, const struct nf_ffn_ops **ops, void **self)
{
	*ops = &s->ops;
	*self = (void *)s;
}

