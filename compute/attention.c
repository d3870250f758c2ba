/*
 * attention.c - the attention block of one layer for a batch of tokens:
 * RMSNorm, Q/K/V projections, RoPE, KV cache append, causal grouped-query
 * attention, output projection, residual add.
 *
 * Invariants:
 *  1. Query head h reads KV head h / (n_head / n_head_kv).
 *  2. Row b of a batch is a token of sequence c->row_seq[b] at position
 *     p = c->row_pos[b] and attends to that sequence's positions 0 .. p
 *     (a prompt: rows of one sequence at consecutive positions; a decode
 *     step of many sequences: one row each, in their own KV caches); the
 *     batch's keys and values are in the caches before any score is
 *     computed. The matrix products run over all rows at once.
 *  3. Scores and value sums follow ggml's types: with an F16 cache the
 *     query is rounded to fp16 for the K dot product and the softmax weight
 *     to fp16 for the V sum; with an F32 cache everything stays f32.
 *  4. Each (token, head) pair is computed by one thread into its own output
 *     slice, using that thread's score row.
 *  5. Streamed attention (c->attn, layers from c->attn_first on) holds the
 *     layer's buffer from before the Q/K/V products until after the output
 *     product, and only then.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "nflash/cache.h"
#include "nflash/dtype.h"
#include "nflash/stream.h"
#include "model_impl.h"

struct att_job {
	struct nf_ctx *c;
	uint32_t il;
	size_t nb;
	const float *norm_w;
	_Atomic size_t next; /* attend: (row, head) pairs taken */
};

static void norm_rows(void *arg, size_t b0, size_t b1)
{
	struct att_job *j = arg;
	struct nf_ctx *c = j->c;
	const struct nf_model_hparams *hp = &c->m->hp;
	size_t E = hp->n_embd;
	for (size_t b = b0; b < b1; b++)
		c->k->rmsnorm(c->xn + b * E, c->x + b * E, j->norm_w, E, hp->rms_eps);
}

static void rope_store_rows(void *arg, size_t b0, size_t b1)
{
	struct att_job *j = arg;
	struct nf_ctx *c = j->c;
	const struct nf_model_hparams *hp = &c->m->hp;
	size_t E = hp->n_embd, KV = c->kv_dim;
	for (size_t b = b0; b < b1; b++) {
		int64_t pos = (int64_t)c->row_pos[b];
		const struct nf_ctx *sq = c->row_seq[b];
		float *q = c->q + b * E, *k = c->kn + b * KV, *v = c->vn + b * KV;
		nf_rope(q, hp->n_head, hp->head_dim, pos, hp->rope_freq_base, hp->rope_freq_scale, c->m->rope_freqs);
		nf_rope(k, hp->n_head_kv, hp->head_dim, pos, hp->rope_freq_base, hp->rope_freq_scale, c->m->rope_freqs);
		char *kd = (char *)sq->kcache[j->il] + (size_t)pos * KV * c->kv_elt;
		char *vd = (char *)sq->vcache[j->il] + (size_t)pos * KV * c->kv_elt;
		if (c->kv_type == NF_KV_F32) {
			memcpy(kd, k, KV * sizeof(float));
			memcpy(vd, v, KV * sizeof(float));
		} else {
			uint16_t *kh = (uint16_t *)kd, *vh = (uint16_t *)vd;
			for (size_t i = 0; i < KV; i++) {
				kh[i] = nf_fp32_to_fp16(k[i]);
				vh[i] = nf_fp32_to_fp16(v[i]);
			}
		}
	}
}


/*
 * PowerInfer's ggml (the one its files are checked against) takes exp from
 * an fp16 table: exp(x) = fp16(expf(fp16(x))), summed in double, then
 * scaled by 1/sum. An exact exp moves its logits by about 1e-3.
 */
static void softmax_exp_f16(float *x, size_t n)
{
	float max = x[0];
	for (size_t i = 1; i < n; i++)
		max = fmaxf(max, x[i]);
	double sum = 0.0;
	for (size_t i = 0; i < n; i++) {
		float v = nf_fp16_to_fp32(nf_fp32_to_fp16(expf(nf_fp16_to_fp32(nf_fp32_to_fp16(x[i] - max)))));
		x[i] = v;
		sum += (double)v;
	}
	float inv = (float)(1.0 / sum);
	for (size_t i = 0; i < n; i++)
		x[i] *= inv;
}

/*
 * The value sum of a batch of one row (a decode step), as ggml's mul_mat
 * takes it with one column: vec_dot over the KV cache's n_kv positions (a
 * multiple of 32, at least 32; the masked ones add nothing): four 16-lane
 * chains over each 64 positions (position t in lane t % 64 of lanes),
 * combined (0+2)+(1+3) and summed as nf_sum16, then the rest one by one:
 * unfused in f32 with an F32 cache; with an F16 one, the weights rounded
 * to fp16 and the f32 products added in double (ggml_vec_dot_f16).
 */
static void value_sum_column(const struct nf_kernels *k, bool f16, const float *p, size_t n_t,
			     const char *vb, size_t row_bytes, size_t HD, float *lanes, float *out)
{
	size_t n_kv = (n_t + 31) & ~(size_t)31, np = n_kv & ~(size_t)63;
	size_t nc = np < n_t ? np : n_t;
	memset(lanes, 0, 64 * HD * sizeof(float));
	for (size_t t = 0; t < nc; t++) {
		float *acc = lanes + (t % 64) * HD;
		if (f16)
			k->axpy[NF_KT_F16](HD, nf_fp16_to_fp32(nf_fp32_to_fp16(p[t])), vb + t * row_bytes, acc);
		else
			k->axpy_f32(HD, p[t], (const float *)(vb + t * row_bytes), acc);
	}
	for (size_t d = 0; d < HD; d++) {
		float v[16];
		for (size_t l = 0; l < 16; l++)
			v[l] = (lanes[l * HD + d] + lanes[(32 + l) * HD + d]) +
			       (lanes[(16 + l) * HD + d] + lanes[(48 + l) * HD + d]);
		out[d] = nf_sum16(v);
	}
	if (nc == n_t)
		return;
	/* The tail, position by position: each d's sum keeps its order, and
	 * the HD sums are independent chains (the lanes are free again). */
	if (f16) {
		double *sd = (double *)lanes;
		for (size_t d = 0; d < HD; d++)
			sd[d] = out[d];
		for (size_t t = nc; t < n_t; t++) {
			const uint16_t *vr = (const uint16_t *)(vb + t * row_bytes);
			float pt = nf_fp16_to_fp32(nf_fp32_to_fp16(p[t]));
			for (size_t d = 0; d < HD; d++)
				sd[d] += (double)(nf_fp16_to_fp32(vr[d]) * pt);
		}
		for (size_t d = 0; d < HD; d++)
			out[d] = (float)sd[d];
	} else {
		for (size_t t = nc; t < n_t; t++) {
			const float *vr = (const float *)(vb + t * row_bytes);
			for (size_t d = 0; d < HD; d++)
				out[d] += vr[d] * p[t];
		}
	}
}

static void attend(void *arg, int ith, int nth)
{
	struct att_job *j = arg;
	struct nf_ctx *c = j->c;
	const struct nf_kernels *k = c->k;
	const struct nf_model_hparams *hp = &c->m->hp;
	size_t E = hp->n_embd, HD = hp->head_dim, KV = c->kv_dim;
	size_t group = hp->n_head / hp->n_head_kv;
	size_t row_bytes = KV * c->kv_elt;
	float scale = 1.0f / sqrtf((float)HD);
	float *scores = c->scores + (size_t)ith * c->scores_row, *lanes = scores + c->n_ctx_pad;
	void *qh = (char *)c->qh + (size_t)ith * c->qh_row;
	bool f16 = c->kv_type == NF_KV_F16;

	/* A row's cost grows with its position (a causal prefill's last row
	 * reads 512 keys, its first one), so an even split of the rows gave
	 * the thread with the later half three times the work: the threads
	 * take (row, head) pairs from one counter instead, from the
	 * batch's last row back (the longest first). Each pair's sums are the same whoever computes them. */
	(void)nth;
	size_t np = j->nb * hp->n_head;
	for (;;) {
		size_t taken = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
		if (taken >= np)
			break;
		size_t p = np - 1 - taken;
		size_t b = p / hp->n_head, h = p % hp->n_head, hk = h / group;
		size_t n_t = (size_t)c->row_pos[b] + 1;
		const struct nf_ctx *sq = c->row_seq[b];
		const float *q = c->q + b * E + h * HD;
		const char *kb = (const char *)sq->kcache[j->il] + hk * HD * c->kv_elt;
		const char *vb = (const char *)sq->vcache[j->il] + hk * HD * c->kv_elt;
		if (f16) {
			/* ggml's K*Q rounds Q to fp16 into a contiguous buffer,
			 * which llamafile's sgemm takes when the batch has two or
			 * more rows (PowerInfer's ggml has no sgemm) */
			int kt = c->m->hp.powerinfer ? NF_KT_F16V : nf_ktype_column(NF_KT_F16, j->nb);
			k->act_prepare[kt](q, qh, HD);
			k->gemv[kt](HD, n_t, kb, row_bytes, qh, scores);
		} else if (c->m->hp.powerinfer) {
			k->gemv[NF_KT_F32](HD, n_t, kb, row_bytes, q, scores);
		} else {
			for (size_t t = 0; t < n_t; t++)
				scores[t] = k->dot_f32(q, (const float *)(kb + t * row_bytes), HD);
		}
		for (size_t t = 0; t < n_t; t++)
			scores[t] *= scale;
		if (c->m->hp.powerinfer) {
			softmax_exp_f16(scores, n_t);
		} else {
			/* llama.cpp's rows are n_kv long, masked: pad to 16 */
			size_t n_pad = (n_t + 15) & ~(size_t)15;
			for (size_t t = n_t; t < n_pad; t++)
				scores[t] = -INFINITY;
			k->softmax(scores, n_pad);
		}
		float *out = c->att + b * E + h * HD;
		if (j->nb == 1 && !c->m->hp.powerinfer) {
			value_sum_column(k, f16, scores, n_t, vb, row_bytes, HD, lanes, out);
			continue;
		}
		/* the value sum in llama.cpp's order for two or more rows
		 * (tinyBLAS over the positions): 16 chains, position t in
		 * chain t % 16, then nf_kref_sum16 across the chains */
		size_t chains = c->m->hp.powerinfer ? 1 : 16; /* PowerInfer's ggml: one */
		memset(lanes, 0, chains * HD * sizeof(float));
		for (size_t t = 0; t < n_t; t++) {
			float *acc = lanes + (t % chains) * HD;
			if (f16)
				k->axpy[NF_KT_F16](HD, nf_fp16_to_fp32(nf_fp32_to_fp16(scores[t])),
						   vb + t * row_bytes, acc);
			else
				k->axpy_f32(HD, scores[t], (const float *)(vb + t * row_bytes), acc);
		}
		if (chains == 1)
			memcpy(out, lanes, HD * sizeof(float));
		for (size_t d = 0; chains == 16 && d < HD; d++) {
			float v[16];
			for (size_t l = 0; l < 16; l++)
				v[l] = lanes[l * HD + d];
			out[d] = nf_sum16(v);
		}
	}
}

static void add_rows(void *arg, size_t b0, size_t b1)
{
	struct att_job *j = arg;
	size_t E = j->c->m->hp.n_embd;
	for (size_t i = b0 * E; i < b1 * E; i++)
		j->c->x[i] += j->c->tmp[i];
}

int nf_attention(struct nf_ctx *c, uint32_t il, size_t nb)
{
	const struct nf_layer_weights *L = &c->m->layers[il];
	size_t E = c->m->hp.n_embd, KV = c->kv_dim;
	struct att_job j = { .c = c, .il = il, .nb = nb, .norm_w = L->attn_norm };
	/* Streamed: this layer's matrices from the stream's buffer (read
	 * while the previous layer ran), same shapes and types as bound. */
	struct nf_weight wq = L->wq, wk = L->wk, wv = L->wv, wo = L->wo;
	bool streamed = c->attn && il >= c->attn_first;
	if (streamed) {
		const void *d[4];
		int rc = nf_stream_acquire(c->attn, il - c->attn_first, d);
		if (rc < 0)
			return rc;
		wq.data = d[0];
		wk.data = d[1];
		wv.data = d[2];
		wo.data = d[3];
		wq.packed = wk.packed = wv.packed = wo.packed = 0; /* the store's plain rows */
	} else if (!wq.data) {
		return NF_EUNSUPPORTED;
	}

	/* Between the steps below, the FFN's reads that landed are collected
	 * (nf_cache_poll): each holds a place in the queue depth until reaped,
	 * and the reads queued behind them (the next layer's, read ahead)
	 * would wait out this layer's attention with the device idle. */
	nf_cache_poll(c->m->cache);
	nf_ctx_parallel(c, nb, norm_rows, &j);
	struct nf_mm qkv[3] = {
		{ .w = &wq, .y = c->q, .ldy = E },
		{ .w = &wk, .y = c->kn, .ldy = KV },
		{ .w = &wv, .y = c->vn, .ldy = KV },
	};
	nf_ctx_matmul_polling(c, qkv, 3, c->xn, E, nb, c->m->cache);
	nf_cache_poll(c->m->cache);
	nf_ctx_parallel(c, nb, rope_store_rows, &j);
	atomic_init(&j.next, 0);
	nf_ctx_run(c, attend, &j);
	nf_cache_poll(c->m->cache);
	struct nf_mm o = { .w = &wo, .y = c->tmp, .ldy = E };
	nf_ctx_matmul_polling(c, &o, 1, c->att, E, nb, c->m->cache);
	nf_cache_poll(c->m->cache);
	/* The buffer now takes a later layer. A failed prefetch is not this
	 * layer's error: the acquire of the layer it was for reports it. */
	if (streamed)
		(void)nf_stream_release(c->attn, il - c->attn_first);
	nf_ctx_parallel(c, nb, add_rows, &j);
	return 0;
}
