/*
 * synth_report.c - measure how sparse a model's FFN activations are, by
 * running the model (compute/model's dense forward pass) over a seeded
 * random token stream and watching every FFN call through the FFN seam.
 *
 * For each layer and token the hook computes, from the very inputs the
 * built-in FFN receives, the gate pre-activations (and up, for dReLU) with
 * the kernels' own activation rounding, and PowerInfer's predictor score
 * fc2 . ReLU(fc1 . resid) on the residual entering the FFN block; then it
 * hands the call to the built-in FFN, so the model runs exactly as it
 * would without the report.
 *
 * Invariants: the token stream is a pure function of the seed; the model's
 * output is unchanged by the hook; the hook allocates nothing per call
 * (all scratch is sized for the context's batch up front).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/kernels.h"
#include "nflash/model.h"
#include "nflash/pool.h"
#include "nflash/synth.h"

/* A matrix view for the hook (one expert of a stacked tensor). */
struct mat {
	const uint8_t *data;
	int kt;
	uint32_t n, nrows;
	size_t row_bytes;
};

struct hook {
	struct nf_ctx *ctx;
	const struct nf_model *m;
	const struct nf_model_hparams *hp;
	struct nf_synth_stats *stats;
	uint32_t n_neurons, n_batch;
	float threshold;
	bool predictor;
	/* per layer: predictor tensors from the GGUF (any layout: 2-D or 3-D) */
	const struct nf_gguf_tensor **fc1, **fc2;
	uint32_t rank;
	/* scratch */
	/* MoE: router logits, routed experts, gathered rows, per-token masks */
	float *R, *Xg, *Rg;          /* n_batch x n_expert, n_batch x n_embd (x2) */
	uint64_t *used;              /* n_batch: bit e set if routed to expert e */
	uint32_t *tok;               /* n_batch: token of each gathered row */
	uint8_t *FB, *PB;            /* n_batch x n_neurons */
	/* dense layers run batched: n_batch rows of each */
	float *G, *U, *Z, *S;        /* gate, up, fc1 output, scores */
	void *xqb;                   /* n_batch prepared rows */
	size_t xq_row;               /* bytes per prepared row (max over types) */
	uint8_t *fired, *pred;       /* n_neurons */
	int err;
};

static struct mat mat_of_weight(const struct nf_weight *w, uint32_t e)
{
	return (struct mat){ .data = (const uint8_t *)w->data + (size_t)e * w->expert_bytes,
			     .kt = w->kt, .n = w->n, .nrows = w->nrows, .row_bytes = w->row_bytes };
}

static struct mat mat_of_tensor(const struct nf_gguf_tensor *t, uint32_t e)
{
	size_t rb = nf_dtype_row_size(t->type, t->ne[0]);
	return (struct mat){ .data = (const uint8_t *)t->data + (size_t)e * rb * t->ne[1],
			     .kt = nf_ktype_of(t->type), .n = (uint32_t)t->ne[0],
			     .nrows = (uint32_t)t->ne[1], .row_bytes = rb };
}

struct mm_job {
	const struct nf_kernels *k;
	const struct mat *w;
	const uint8_t *xq;
	size_t xq_row, nb;
	float *y;             /* nb x w->nrows */
};

/* Tiles of 64 rows, dealt round-robin, each multiplied by every token:
 * a tile's weights stay in cache across the batch. */
static void mm_worker(void *arg, int ith, int nth)
{
	struct mm_job *j = arg;
	const uint32_t tile = 64, nt = (j->w->nrows + tile - 1) / tile;
	for (uint32_t t = (uint32_t)ith; t < nt; t += (uint32_t)nth) {
		uint32_t r0 = t * tile, r1 = r0 + tile < j->w->nrows ? r0 + tile : j->w->nrows;
		j->k->gemm[j->w->kt](j->w->n, r1 - r0, j->w->data + (size_t)r0 * j->w->row_bytes,
				     j->w->row_bytes, j->nb, j->xq, j->xq_row, j->y + r0,
				     j->w->nrows);
	}
}

/* Y = X W^T for nb rows of x (ldx apart), inputs rounded to W's dot type. */
static void matmul(const struct nf_ffn_env *env, struct hook *h, const struct mat *w,
		   const float *x, size_t ldx, size_t nb, float *y)
{
	for (size_t b = 0; b < nb; b++)
		env->k->act_prepare[w->kt](x + b * ldx, (uint8_t *)h->xqb + b * h->xq_row, w->n);
	struct mm_job j = { .k = env->k, .w = w, .xq = h->xqb, .xq_row = h->xq_row, .nb = nb,
			    .y = y };
	if (env->pool)
		nf_pool_run(env->pool, mm_worker, &j);
	else
		mm_worker(&j, 0, 1);
}

/* Dense layer: every token of the batch at once. */
static void observe_dense(const struct nf_ffn_env *env, struct hook *h,
			  const struct nf_layer_weights *L, const struct nf_ffn_io *io)
{
	const uint32_t ff = h->hp->n_ff, E = h->hp->n_embd;
	const bool drelu = h->hp->act == NF_FFN_DRELU;
	struct mat gate = mat_of_weight(&L->gate, 0), up = mat_of_weight(&L->up, 0);
	matmul(env, h, &gate, io->x, E, io->nb, h->G);
	if (drelu)
		matmul(env, h, &up, io->x, E, io->nb, h->U);
	if (h->predictor) {
		struct mat fc1 = mat_of_tensor(h->fc1[io->layer], 0);
		struct mat fc2 = mat_of_tensor(h->fc2[io->layer], 0);
		matmul(env, h, &fc1, io->resid, E, io->nb, h->Z);
		for (size_t i = 0; i < io->nb * h->rank; i++)
			h->Z[i] = h->Z[i] > 0 ? h->Z[i] : 0;
		matmul(env, h, &fc2, h->Z, h->rank, io->nb, h->S);
	}
	for (size_t b = 0; b < io->nb; b++) {
		const float *g = h->G + b * ff, *u = h->U + b * ff, *s = h->S + b * ff;
		for (uint32_t j = 0; j < ff; j++) {
			h->fired[j] = g[j] > 0 && (!drelu || u[j] > 0);
			if (h->predictor)
				h->pred[j] = s[j] >= h->threshold;
		}
		nf_synth_stats_add(h->stats, io->layer, h->fired, h->predictor ? h->pred : NULL, ff);
	}
}

/* MoE layer: route every token as the runtime does (top n_expert_used
 * router logits, i.e. of the softmax, ties to the lower expert id), then
 * run each expert once on the tokens routed to it. */
static void observe_moe(const struct nf_ffn_env *env, struct hook *h,
			const struct nf_layer_weights *L, const struct nf_ffn_io *io)
{
	const struct nf_model_hparams *hp = h->hp;
	const uint32_t ff = hp->n_ff, E = hp->n_embd, X = hp->n_expert, U = hp->n_expert_used;
	const bool drelu = hp->act == NF_FFN_DRELU;
	const size_t nb = io->nb, nn = h->n_neurons;
	struct mat router = mat_of_weight(&L->router, 0);
	matmul(env, h, &router, io->x, E, nb, h->R);
	memset(h->FB, 0, nb * nn);
	memset(h->PB, 0, nb * nn);
	for (size_t b = 0; b < nb; b++) {
		const float *r = h->R + b * X;
		uint64_t used = 0;
		for (uint32_t s = 0; s < U; s++) {
			int best = -1;
			for (uint32_t e = 0; e < X; e++)
				if (!(used >> e & 1) && (best < 0 || r[e] > r[best]))
					best = (int)e;
			used |= 1ull << best;
		}
		h->used[b] = used;
	}
	for (uint32_t e = 0; e < X; e++) {
		size_t m = 0;
		for (size_t b = 0; b < nb; b++) {
			if (!(h->used[b] >> e & 1))
				continue;
			memcpy(h->Xg + m * E, io->x + b * E, E * sizeof(float));
			memcpy(h->Rg + m * E, io->resid + b * E, E * sizeof(float));
			h->tok[m++] = (uint32_t)b;
		}
		if (!m)
			continue;
		struct mat gate = mat_of_weight(&L->gate_exps, e), up = mat_of_weight(&L->up_exps, e);
		matmul(env, h, &gate, h->Xg, E, m, h->G);
		if (drelu)
			matmul(env, h, &up, h->Xg, E, m, h->U);
		if (h->predictor) {
			struct mat fc1 = mat_of_tensor(h->fc1[io->layer], e);
			struct mat fc2 = mat_of_tensor(h->fc2[io->layer], e);
			matmul(env, h, &fc1, h->Rg, E, m, h->Z);
			for (size_t i = 0; i < m * h->rank; i++)
				h->Z[i] = h->Z[i] > 0 ? h->Z[i] : 0;
			matmul(env, h, &fc2, h->Z, h->rank, m, h->S);
		}
		for (size_t i = 0; i < m; i++) {
			const float *g = h->G + i * ff, *u = h->U + i * ff, *s = h->S + i * ff;
			uint8_t *f = h->FB + h->tok[i] * nn + (size_t)e * ff;
			uint8_t *p = h->PB + h->tok[i] * nn + (size_t)e * ff;
			for (uint32_t j = 0; j < ff; j++) {
				f[j] = g[j] > 0 && (!drelu || u[j] > 0);
				if (h->predictor)
					p[j] = s[j] >= h->threshold;
			}
		}
	}
	for (size_t b = 0; b < nb; b++)
		nf_synth_stats_add(h->stats, io->layer, h->FB + b * nn,
				   h->predictor ? h->PB + b * nn : NULL, U * ff);
}

static int hook_forward(void *self, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	struct hook *h = self;
	const struct nf_layer_weights *L = nf_model_layer(h->m, io->layer);
	if (h->hp->n_expert)
		observe_moe(env, h, L, io);
	else
		observe_dense(env, h, L, io);
	return nf_ctx_ffn_builtin(h->ctx, io);
}
static void hook_free(struct hook *h)
{
	free(h->fc1);
	free(h->fc2);
	free(h->R);
	free(h->Xg);
	free(h->Rg);
	free(h->used);
	free(h->tok);
	free(h->FB);
	free(h->PB);
	free(h->fired);
	free(h->pred);
	free(h->G);
	free(h->U);
	free(h->Z);
	free(h->S);
	free(h->xqb);
}

/* Bind and check the predictor tensors of every layer. */
static int bind_predictors(struct hook *h, const struct nf_gguf *g, struct nf_diag *d)
{
	const struct nf_model_hparams *hp = h->hp;
	uint32_t X = hp->n_expert ? hp->n_expert : 1;
	h->fc1 = calloc(hp->n_layer, sizeof(*h->fc1));
	h->fc2 = calloc(hp->n_layer, sizeof(*h->fc2));
	if (!h->fc1 || !h->fc2)
		return -ENOMEM;
	h->predictor = nf_gguf_find_tensor(g, "blk.0.fc1.weight") != NULL;
	if (!h->predictor)
		return 0;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		char n1[64], n2[64];
		snprintf(n1, sizeof(n1), "blk.%u.fc1.weight", il);
		snprintf(n2, sizeof(n2), "blk.%u.fc2.weight", il);
		const struct nf_gguf_tensor *a = nf_gguf_find_tensor(g, n1);
		const struct nf_gguf_tensor *b = nf_gguf_find_tensor(g, n2);
		if (!a || !b || !a->data || !b->data)
			return nf_diag_fail(d, NF_ENOTFOUND, "%s: layer %u has no predictor (%s, %s)",
					    nf_gguf_path(g), il, n1, n2);
		if (a->ne[0] != hp->n_embd || b->ne[0] != a->ne[1] || b->ne[1] != hp->n_ff ||
		    a->ne[2] != X || b->ne[2] != X || nf_ktype_of(a->type) < 0 ||
		    nf_ktype_of(b->type) < 0 || a->ne[1] > 1u << 20 ||
		    (h->rank && h->rank != a->ne[1]))
			return nf_diag_fail(d, NF_EFORMAT,
					    "%s: %s/%s: shapes do not make n_embd -> r -> n_ff",
					    nf_gguf_path(g), n1, n2);
		h->fc1[il] = a;
		h->fc2[il] = b;
		h->rank = (uint32_t)a->ne[1];
	}
	return 0;
}

int nf_synth_report_run(const char *path, const struct nf_synth_report_opts *o,
			struct nf_synth_report *out, struct nf_diag *d)
{
	struct nf_model *m = NULL;
	struct nf_ctx *c = NULL;
	struct hook h = { 0 };
	int32_t *ids = NULL;
	struct nf_model_opts mo = { .prefault = false };
	int rc;

	memset(out, 0, sizeof(*out));
	if (o->n_tokens < 2)
		return nf_diag_fail(d, NF_EUSAGE, "--tokens: %u is too few (at least 2)", o->n_tokens);
	if ((rc = nf_model_load(path, &mo, &m, d)) < 0)
		return rc;
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	if (hp->n_expert > 64) {
		rc = nf_diag_fail(d, NF_EUNSUPPORTED, "%s: %u experts (the report handles 64)",
				  path, hp->n_expert);
		goto cleanup;
	}
	uint32_t window = hp->n_ctx_train < 256 ? hp->n_ctx_train : 256;
	if (o->window)
		window = o->window;
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = window;
	cp.n_batch = window;
	cp.n_threads = o->n_threads;
	cp.all_rows = true; /* every token's activations, in every layer */
	if ((rc = nf_ctx_open(m, &cp, &c, d)) < 0)
		goto cleanup;

	h.ctx = c;
	h.m = m;
	h.hp = hp;
	h.threshold = hp->sparse_threshold;
	h.n_neurons = hp->n_ff * (hp->n_expert ? hp->n_expert : 1);
	if ((rc = bind_predictors(&h, nf_model_gguf(m), d)) < 0)
		goto cleanup;
	size_t maxn = hp->n_ff > hp->n_embd ? hp->n_ff : hp->n_embd;
	if (h.rank > maxn)
		maxn = h.rank;
	size_t xq_bytes = 0;
	for (int kt = 0; kt < NF_KT_COUNT; kt++)
		if (nf_act_size(kt, maxn) > xq_bytes)
			xq_bytes = nf_act_size(kt, maxn);
	rc = -ENOMEM;
	size_t nb = window, X = hp->n_expert;
	h.xq_row = (xq_bytes + 63) / 64 * 64;
	h.G = malloc(nb * hp->n_ff * sizeof(float));
	h.U = malloc(hp->act == NF_FFN_DRELU ? nb * hp->n_ff * sizeof(float) : 1);
	h.Z = malloc(nb * (h.rank + 1) * sizeof(float));
	h.S = malloc(h.predictor ? nb * hp->n_ff * sizeof(float) : 1);
	h.xqb = malloc(nb * h.xq_row);
	h.fired = malloc(h.n_neurons);
	h.pred = malloc(h.n_neurons);
	if (X) {
		h.R = malloc(nb * X * sizeof(float));
		h.Xg = malloc(nb * hp->n_embd * sizeof(float));
		h.Rg = malloc(nb * hp->n_embd * sizeof(float));
		h.used = malloc(nb * sizeof(uint64_t));
		h.tok = malloc(nb * sizeof(uint32_t));
		h.FB = malloc(nb * h.n_neurons);
		h.PB = malloc(nb * h.n_neurons);
	}
	ids = malloc((size_t)o->n_tokens * sizeof(int32_t));
	out->layers = calloc(hp->n_layer, sizeof(*out->layers));
	if (!h.G || !h.U || !h.Z || !h.S || !h.xqb || !h.fired || !h.pred || !ids ||
	    !out->layers || (X && (!h.R || !h.Xg || !h.Rg || !h.used || !h.tok || !h.FB || !h.PB))) {
		nf_diag_fail(d, rc, "out of memory for the report");
		goto cleanup;
	}
	if ((rc = nf_synth_stats_open(hp->n_layer, h.n_neurons, &h.stats)) < 0)
		goto cleanup;
	static const struct nf_ffn_ops ops = { .name = "synth-report", .forward = hook_forward };
	for (uint32_t il = 0; il < hp->n_layer; il++)
		nf_ctx_set_ffn(c, il, &ops, &h);

	for (uint32_t i = 0; i < o->n_tokens; i++)
		ids[i] = nf_synth_token(o->seed, i, hp->n_vocab);
	for (uint32_t t0 = 0; t0 < o->n_tokens; t0 += window) {
		uint32_t n = o->n_tokens - t0 < window ? o->n_tokens - t0 : window;
		nf_ctx_reset(c);
		if ((rc = nf_ctx_eval(c, ids + t0, n)) < 0) {
			nf_diag_fail(d, rc, "%s: running tokens %u..%u: %s", path, t0, t0 + n - 1,
				     nf_strerror(rc));
			goto cleanup;
		}
		if (o->progress)
			o->progress(o->progress_arg, t0 + n, o->n_tokens);
	}

	out->n_layer = hp->n_layer;
	out->n_neurons = h.n_neurons;
	out->tokens = o->n_tokens;
	out->predictor = h.predictor;
	out->threshold = h.threshold;
	out->act = nf_ffn_act_name(hp->act);
	double w = 1.0 / hp->n_layer;
	struct nf_synth_layer_stats *mean = &out->mean;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		struct nf_synth_layer_stats *ls = &out->layers[il];
		nf_synth_stats_layer(h.stats, il, ls);
		mean->tokens = ls->tokens;
		mean->sparsity += ls->sparsity * w;
		mean->top1_share += ls->top1_share * w;
		mean->top10_share += ls->top10_share * w;
		mean->top20_share += ls->top20_share * w;
		mean->overlap += ls->overlap * w;
		mean->recall += ls->recall * w;
		mean->precision += ls->precision * w;
		mean->skew += ls->skew * w;
	}
	rc = 0;
cleanup:
	if (rc < 0) {
		free(out->layers);
		out->layers = NULL;
	}
	nf_synth_stats_close(h.stats);
	hook_free(&h);
	free(ids);
	nf_ctx_close(c);
	nf_model_free(m);
	return rc;
}

void nf_synth_report_free(struct nf_synth_report *r)
{
	if (r) {
		free(r->layers);
		r->layers = NULL;
	}
}
