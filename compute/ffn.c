/*
 * ffn.c - the built-in feed-forward blocks: dense gated FFN (SwiGLU, ReGLU,
 * dReLU; down matrix plain or PowerInfer-transposed) and Mixtral-style MoE.
 *
 * Invariants:
 *  1. Every input to a matrix product goes through the kernels' act_prepare
 *     for that weight's type (ggml's dot-type rule); for the transposed down
 *     matrix the activations are rounded to its dot type before the axpy.
 *  2. MoE routing as llama.cpp: softmax over all router logits, the top
 *     n_expert_used probabilities (ties to the lower expert id), renormalised
 *     to sum 1; the output is sum over slots in rank order of w * expert(x).
 *  3. Tokens routed to an expert are gathered and run as one batch through
 *     that expert, so prefill stays matrix-matrix; per token the arithmetic
 *     equals the single-token path.
 *  4. Only the context's scratch is used; nothing allocates.
 */
#include <math.h>
#include <string.h>

#include "nflash/dtype.h"
#include "model_impl.h"

struct act_job {
	struct nf_ctx *c;
	float *g;
	const float *u;
	size_t n;
};

static void act_rows(void *arg, size_t b0, size_t b1)
{
	struct act_job *j = arg;
	const struct nf_kernels *k = j->c->k;
	void (*fn)(float *, const float *, size_t) =
		j->c->m->hp.act == NF_FFN_RELU ? k->relu_mul :
		j->c->m->hp.act == NF_FFN_DRELU ? k->drelu_mul : k->silu_mul;
	for (size_t b = b0; b < b1; b++)
		fn(j->g + b * j->n, j->u + b * j->n, j->n);
}

/* g = act(g, u) for nb rows of n. */
static void activate(struct nf_ctx *c, float *g, const float *u, size_t n, size_t nb)
{
	struct act_job j = { .c = c, .g = g, .u = u, .n = n };
	nf_ctx_parallel(c, nb, act_rows, &j);
}

/* ---- transposed down (PowerInfer ffn_down_t) ------------------------------ */

struct downt_job {
	struct nf_ctx *c;
	const struct nf_weight *w;  /* n_ff rows of n_embd */
	const float *a;             /* nb x n_ff, already rounded to w's dot type */
	float *out;                 /* nb x n_embd */
	size_t nb;
};

/* Each thread owns a slice of output columns, whole 32-value blocks, and
 * sums every row's contribution into it: no reduction between threads. */
static void downt_worker(void *arg, int ith, int nth)
{
	struct downt_job *j = arg;
	const struct nf_weight *w = j->w;
	size_t E = w->n, F = w->nrows, k0, k1;
	nf_split(E, NF_QK, ith, nth, &k0, &k1);
	if (k0 >= k1)
		return;
	size_t off = nf_dtype_row_size(w->dtype, k0);
	for (size_t b = 0; b < j->nb; b++) {
		float *o = j->out + b * E;
		const float *a = j->a + b * F;
		memset(o + k0, 0, (k1 - k0) * sizeof(float));
		for (size_t r = 0; r < F; r++)
			if (a[r] != 0.0f)
				j->c->k->axpy[w->kt](k1 - k0, a[r],
						     (const char *)w->data + r * w->row_bytes + off, o + k0);
	}
}

struct round_job {
	struct nf_ctx *c;
	int kt;
	const float *src;
	float *dst;
	size_t n;
};

static void round_rows(void *arg, size_t b0, size_t b1)
{
	struct round_job *j = arg;
	uint32_t dt = nf_ktype_dot_dtype(j->kt);
	for (size_t b = b0; b < b1; b++) {
		void *q = (char *)j->c->xq + b * j->c->xq_row;
		j->c->k->act_prepare[j->kt](j->src + b * j->n, q, j->n);
		nf_dequantize_row(dt, q, j->dst + b * j->n, j->n);
	}
}

/* ---- dense ---------------------------------------------------------------- */

int nf_ffn_dense(struct nf_ctx *c, const struct nf_ffn_io *io)
{
	const struct nf_layer_weights *L = &c->m->layers[io->layer];
	size_t E = c->m->hp.n_embd, F = c->m->hp.n_ff, nb = io->nb;
	struct nf_mm gu[2] = {
		{ .w = &L->gate, .y = c->g, .ldy = F },
		{ .w = &L->up, .y = c->u, .ldy = F },
	};
	nf_ctx_matmul(c, gu, 2, io->x, E, nb);
	activate(c, c->g, c->u, F, nb);
	if (L->down.data) {
		struct nf_mm d = { .w = &L->down, .y = io->out, .ldy = E };
		nf_ctx_matmul(c, &d, 1, c->g, F, nb);
		return 0;
	}
	struct round_job rj = { .c = c, .kt = L->down_t.kt, .src = c->g, .dst = c->eg, .n = F };
	nf_ctx_parallel(c, nb, round_rows, &rj);
	struct downt_job dj = { .c = c, .w = &L->down_t, .a = c->eg, .out = io->out, .nb = nb };
	nf_ctx_run(c, downt_worker, &dj);
	return 0;
}

/* ---- mixture of experts ----------------------------------------------------- */

/* Softmax of the router logits, top-U by probability (ties: lower id),
 * weights renormalised. */
static void route_rows(void *arg, size_t b0, size_t b1)
{
	struct nf_ctx *c = arg;
	const struct nf_model_hparams *hp = &c->m->hp;
	size_t X = hp->n_expert, U = hp->n_expert_used;
	for (size_t b = b0; b < b1; b++) {
		float *p = c->router + b * X;
		c->k->softmax(p, X);
		int32_t *sel = c->sel + b * U;
		float *w = c->selw + b * U;
		float sum = 0.0f;
		for (size_t j = 0; j < U; j++) {
			int32_t best = -1;
			for (size_t e = 0; e < X; e++) {
				bool taken = false;
				for (size_t i = 0; i < j; i++)
					taken |= sel[i] == (int32_t)e;
				if (!taken && (best < 0 || p[e] > p[best]))
					best = (int32_t)e;
			}
			sel[j] = best;
			w[j] = p[best];
			sum += p[best];
		}
		for (size_t j = 0; j < U; j++)
			w[j] /= sum;
	}
}

struct combine_job {
	struct nf_ctx *c;
	float *out;
};

static void combine_rows(void *arg, size_t b0, size_t b1)
{
	struct combine_job *j = arg;
	struct nf_ctx *c = j->c;
	size_t E = c->m->hp.n_embd, U = c->m->hp.n_expert_used;
	for (size_t b = b0; b < b1; b++) {
		float *o = j->out + b * E;
		for (size_t i = 0; i < E; i++) {
			float s = 0.0f;
			for (size_t k = 0; k < U; k++)
				s += c->eout[(b * U + k) * E + i] * c->selw[b * U + k];
			o[i] = s;
		}
	}
}

int nf_ctx_moe_route(struct nf_ctx *c, const struct nf_ffn_io *io, const int32_t **sel, const float **w)
{
	const struct nf_model_hparams *hp = &c->m->hp;
	if (!hp->n_expert || io->layer >= hp->n_layer || io->nb == 0 || io->nb > c->n_batch)
		return NF_EUSAGE;
	const struct nf_layer_weights *L = &c->m->layers[io->layer];
	struct nf_mm r = { .w = &L->router, .y = c->router, .ldy = hp->n_expert };
	nf_ctx_matmul(c, &r, 1, io->x, hp->n_embd, io->nb);
	nf_ctx_parallel(c, io->nb, route_rows, c);
	*sel = c->sel;
	*w = c->selw;
	return 0;
}

int nf_ffn_moe(struct nf_ctx *c, const struct nf_ffn_io *io)
{
	const struct nf_model_hparams *hp = &c->m->hp;
	const struct nf_layer_weights *L = &c->m->layers[io->layer];
	size_t E = hp->n_embd, F = hp->n_ff, X = hp->n_expert, U = hp->n_expert_used, nb = io->nb;
	const int32_t *sel;
	const float *selw;
	nf_ctx_moe_route(c, io, &sel, &selw);

	for (uint32_t e = 0; e < X; e++) {
		size_t cnt = 0;
		for (size_t s = 0; s < nb * U; s++)
			if (c->sel[s] == (int32_t)e) {
				c->tok_of[cnt] = (int32_t)(s / U);
				c->slot_of[cnt] = (int32_t)s;
				cnt++;
			}
		if (cnt == 0)
			continue;
		for (size_t i = 0; i < cnt; i++)
			memcpy(c->xg + i * E, io->x + (size_t)c->tok_of[i] * E, E * sizeof(float));
		struct nf_weight wg = nf_weight_expert(&L->gate_exps, e);
		struct nf_weight wu = nf_weight_expert(&L->up_exps, e);
		struct nf_weight wd = nf_weight_expert(&L->down_exps, e);
		struct nf_mm gu[2] = {
			{ .w = &wg, .y = c->g, .ldy = F },
			{ .w = &wu, .y = c->u, .ldy = F },
		};
		nf_ctx_matmul(c, gu, 2, c->xg, E, cnt);
		activate(c, c->g, c->u, F, cnt);
		struct nf_mm d = { .w = &wd, .y = c->eg, .ldy = E };
		nf_ctx_matmul(c, &d, 1, c->g, F, cnt);
		for (size_t i = 0; i < cnt; i++)
			memcpy(c->eout + (size_t)c->slot_of[i] * E, c->eg + i * E, E * sizeof(float));
	}
	struct combine_job cj = { .c = c, .out = io->out };
	nf_ctx_parallel(c, nb, combine_rows, &cj);
	return 0;
}
