/*
 * sparse_chunk.c - the sparse FFN engine's unit of compute: a chunk of
 * 32-neuron groups, gate, up, activation and down, for ROW, QCOL and
 * K-quant down forms (compute/sparse_impl.h has the engine's invariants).
 *
 * Invariants: a chunk's down contributions are added in ascending neuron
 * order into its own output row (sparse_impl.h invariant 2); K-quant downs
 * are summed per super-block as ggml sums them (invariant 7), F16 downs in
 * vec_dot's or tinyBLAS's lanes as llama.cpp's product would (invariant 8).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/kernels.h"
#include "sparse_impl.h"

/* ---- group compute ----------------------------------------------------------- */

/* Addresses of neuron j's gate row, up row and down part. */
static void neuron_addr(const struct nf_sparse *s, uint32_t j, const char **g, const char **u, const char **d)
{
	if (s->cache) {
		const char *p = s->cur_ptrs[j];
		*g = p;
		*u = p + s->up_off_bundle;
		*d = p + s->down_off_bundle;
		return;
	}
	const struct layer_tab *t = s->cur_tab;
	*g = t->gate ? t->gate + (size_t)j * t->gate_stride : NULL;
	*u = t->up + (size_t)j * t->up_stride;
	*d = t->down + (size_t)j * t->down_stride;
}

/* SiLU of neuron id of F as llama.cpp's ggml_vec_silu_f32 computes it over
 * the whole row (the kernels' silu_mul): its expf on blocks of 16, libm's
 * on the last F % 16. */
static float silu1(float x, uint32_t id, uint32_t F)
{
	return x / (1.0f + (id < (F & ~15u) ? nf_expf_ggml(0.0f - x) : expf(-x)));
}

static float act1(enum nf_ffn_act act, float g, float u, bool has_gate, uint32_t id, uint32_t F)
{
	if (!has_gate)
		return act == NF_FFN_SILU ? silu1(u, id, F) : (u > 0.0f ? u : 0.0f);
	switch (act) {
	case NF_FFN_RELU:
		return (g > 0.0f ? g : 0.0f) * u;
	case NF_FFN_DRELU:
		return (g > 0.0f ? g : 0.0f) * (u > 0.0f ? u : 0.0f);
	default:
		return silu1(g, id, F) * u;
	}
}

/*
 * Q4_0 / Q8_0 QCOL downs in llama.cpp's dense order (sparse_impl.h
 * invariant 7). Per block (group) of 32 neurons, qcol_down adds the exact
 * integer sum of the active neurons' column values times their activation
 * quants into a row's chain by one fma with d_w * d_x, as the dense dot
 * does per block: the repacked Q4_0 chain (NF_KT_Q4_0) has one chain per
 * row; vec_dot's order (NF_KT_Q8_0, NF_KT_Q4_0L) has 8, lane j taking the
 * block's positions 4j .. 4j + 3, summed at the end as hsum_float_8. A
 * block or lane with no active neuron adds fma(0, d, acc) = acc in the
 * dense sum, so it is skipped.
 */
static bool qdown_chain(const struct nf_sparse *s, uint32_t dt)
{
	return nf_ktype_matrix(dt, s->E, false) == NF_KT_Q4_0;
}

void nf_sp_qdown_rows(const struct nf_sparse *s, uint32_t dt, const struct nf_block_q8_0 *qx, float *acc,
		      uint32_t g0, uint32_t g1, uint32_t r0, uint32_t r1)
{
	size_t E = s->E, n = r1 - r0;
	bool chain = qdown_chain(s, dt);
	size_t off = dt == NF_DTYPE_Q4_0 ? r0 / 2 : r0; /* bytes of a column before row r0 */
	void (*madd)(size_t, size_t, const int8_t *, const void *const *, const uint16_t *, float, float *) =
		s->k->qcol_down[nf_ktype_of(dt)];
	if (!n)
		return;
	for (uint32_t gi = g0; gi < g1; gi++) {
		const struct nf_block_q8_0 *x = &qx[gi];
		float dx = nf_fp16_to_fp32(x->d);
		if (dx == 0.0f)
			continue;
		int8_t q[GROUP];
		const void *cols[GROUP];
		uint32_t nc = 0, lane_end[8] = { 0 };
		for (uint32_t i = 0; i < GROUP; i++) {
			if (x->qs[i]) {
				const char *g, *u, *d;
				neuron_addr(s, gi * GROUP + i, &g, &u, &d);
				q[nc] = x->qs[i];
				cols[nc++] = d + off;
			}
			if (i % 4 == 3)
				lane_end[i / 4] = nc;
		}
		const uint16_t *sc = s->cur_scales + (size_t)gi * E + r0;
		if (chain) {
			if (nc)
				madd(n, nc, q, cols, sc, dx, acc + r0);
			continue;
		}
		for (uint32_t j = 0, c0 = 0; j < 8; c0 = lane_end[j++])
			if (lane_end[j] > c0)
				madd(n, lane_end[j] - c0, q + c0, cols + c0, sc, dx, acc + (size_t)j * E + r0);
	}
}

void nf_sp_qdown_finish(const struct nf_sparse *s, uint32_t dt, const float *acc, uint32_t r0, uint32_t r1,
			float *out)
{
	size_t E = s->E;
	if (qdown_chain(s, dt)) {
		memcpy(out + r0, acc + r0, (r1 - r0) * sizeof(float));
		return;
	}
	for (uint32_t r = r0; r < r1; r++) {
		float t[4];
		for (int i = 0; i < 4; i++)
			t[i] = acc[i * E + r] + acc[(i + 4) * E + r];
		out[r] = (t[0] + t[2]) + (t[1] + t[3]);
	}
}

#define KTILE 256u /* rows per pass: the tile's scales, quants and lanes stay in L1 */

void nf_sp_kdown_rows(const struct nf_sparse *s, uint32_t dt, const struct nf_block_q8_K *kx, float *kacc,
		      uint32_t kb0, uint32_t kb1, uint32_t r0, uint32_t r1)
{
	uint32_t E = s->E, bits = nf_kquant_bits(dt);
	int32_t off = nf_kquant_offset(dt);
	size_t bs = nf_dtype_block_size(dt), hb = nf_bundle_head_bytes(dt), qoff, qlen;
	nf_kquant_quant_span(dt, &qoff, &qlen);
	uint8_t blk[256];
	memset(blk, 0, sizeof(blk));
	for (uint32_t kb = kb0; kb < kb1; kb++) {
		const struct nf_block_q8_K *x = &kx[kb];
		if (x->d == 0.0f)
			continue; /* no neuron of the block is active: adds exact zeros */
		uint32_t nz = 0, lane[NF_QK_K], sub[NF_QK_K];
		int32_t qx[NF_QK_K];
		const uint8_t *col[NF_QK_K];
		for (uint32_t i = 0; i < NF_QK_K; i++) {
			if (!x->qs[i])
				continue;
			const char *g, *u, *d;
			neuron_addr(s, kb * NF_QK_K + i, &g, &u, &d);
			lane[nz] = (i % 32) / 4;
			sub[nz] = i / 16;
			qx[nz] = x->qs[i];
			col[nz++] = (const uint8_t *)d;
		}
		const uint8_t *heads = (const uint8_t *)s->cur_scales + (size_t)kb * E * hb;
		/* rows in tiles: the tile's scales decoded once, each active
		 * neuron's column unpacked once, the exact integer lanes summed
		 * neuron by neuron (any order: integers), then per row the fmas
		 * in ggml's order */
		for (uint32_t t0 = r0; t0 < r1; t0 += KTILE) {
			uint32_t nt = r1 - t0 < KTILE ? r1 - t0 : KTILE;
			int16_t sc[16][KTILE], mn[KTILE][16];
			float d[KTILE], dm[KTILE];
			int32_t li[8][KTILE];
			struct nf_kblock k;
			for (uint32_t r = 0; r < nt; r++) {
				const uint8_t *h = heads + (size_t)(t0 + r) * hb;
				memcpy(blk, h, qoff);
				memcpy(blk + qoff + qlen, h + qoff, bs - qoff - qlen);
				nf_kblock_unpack_scales(dt, blk, &k);
				for (int j = 0; j < 16; j++)
					sc[j][r] = k.sc[j];
				memcpy(mn[r], k.mn, sizeof(mn[r]));
				d[r] = k.d;
				dm[r] = k.dmin;
			}
			for (int m = 0; m < 8; m++)
				memset(li[m], 0, nt * sizeof(int32_t));
			/* t0 is a multiple of 8 rows: a whole byte of every column */
			for (uint32_t j = 0; j < nz; j++)
				s->k->kcol_madd(bits, off, col[j] + (size_t)t0 * bits / 8, nt, sc[sub[j]], qx[j],
						li[lane[j]]);
			for (uint32_t r = 0; r < nt; r++) {
				const int16_t *m16 = mn[r];
				float *acc = kacc + (size_t)(t0 + r) * KACC;
				const float dd = x->d * d[r], dmin = -x->d * dm[r];
				if (dt == NF_DTYPE_Q2_K) {
					for (int m = 0; m < 8; m++)
						acc[m] = fmaf(dmin, (float)(m16[2 * m] * x->bsums[2 * m] +
									    m16[2 * m + 1] * x->bsums[2 * m + 1]), acc[m]);
				} else if (dt == NF_DTYPE_Q4_K || dt == NF_DTYPE_Q5_K) {
					int32_t tot = 0;
					for (int m = 0; m < 4; m++) {
						int32_t p = m16[4 * m] * (x->bsums[4 * m] + x->bsums[4 * m + 1]) +
							    m16[4 * m + 2] * (x->bsums[4 * m + 2] + x->bsums[4 * m + 3]);
						tot += p;
						if (dt == NF_DTYPE_Q4_K)
							acc[8 + m] = fmaf(dmin, (float)p, acc[8 + m]);
					}
					if (dt == NF_DTYPE_Q5_K)
						acc[12] = fmaf(dmin, (float)tot, acc[12]);
				}
				for (int m = 0; m < 8; m++)
					acc[m] = fmaf(dd, (float)li[m][r], acc[m]);
			}
		}
	}
}

void nf_sp_kdown_finish(uint32_t dt, const float *kacc, uint32_t r0, uint32_t r1, float *out)
{
	for (uint32_t r = r0; r < r1; r++) {
		const float *a = kacc + (size_t)r * KACC;
		float t[4];
		for (int i = 0; i < 4; i++)
			t[i] = a[i] + a[i + 4];
		float v = (t[0] + t[2]) + (t[1] + t[3]);
		if (dt == NF_DTYPE_Q4_K)
			v += (a[8] + a[10]) + (a[9] + a[11]);
		else if (dt == NF_DTYPE_Q5_K)
			v += a[12];
		out[r] = v;
	}
}

void nf_sp_kdown_worker(void *arg, int ith, int nth)
{
	struct kdown_job *j = arg;
	/* rows split in multiples of 8: a slice starts on a whole byte of
	 * every K column (8 rows of b bits are b bytes); Q4_0/Q8_0 in
	 * multiples of 32 (qcol_down's unit) */
	bool kq = nf_dtype_is_kquant(j->dt);
	uint32_t E = j->s->E, u = kq ? 8 : 32, Eu = E / u;
	uint32_t r0 = (uint32_t)((uint64_t)Eu * ith / nth) * u, r1 = (uint32_t)((uint64_t)Eu * (ith + 1) / nth) * u;
	if (ith == nth - 1)
		r1 = E;
	if (!kq) {
		if (!j->out)
			nf_sp_qdown_rows(j->s, j->dt, j->s->qx, j->s->kacc, j->kb0, j->kb1, r0, r1);
		else
			nf_sp_qdown_finish(j->s, j->dt, j->s->kacc, r0, r1, j->out);
		return;
	}
	if (!j->out)
		nf_sp_kdown_rows(j->s, j->dt, j->s->kx, j->s->kacc, j->kb0, j->kb1, r0, r1);
	else
		nf_sp_kdown_finish(j->dt, j->s->kacc, r0, r1, j->out);
}

/* ---- F16 downs in llama.cpp's order (invariant 8) ------------------------------ */

/* vec_dot's four chains of row r combined (0+2)+(1+3), then summed */
static double fdown_close(const float *lanes, size_t E, uint32_t r)
{
	float v[16];
	for (int l = 0; l < 16; l++)
		v[l] = (lanes[(size_t)l * E + r] + lanes[(size_t)(32 + l) * E + r]) +
		       (lanes[(size_t)(16 + l) * E + r] + lanes[(size_t)(48 + l) * E + r]);
	return nf_sum16(v);
}

void nf_sp_fdown_rows(const struct nf_sparse *s, const float *act, float *lanes, double *facc, bool closed,
		      uint32_t i0, uint32_t i1, uint32_t r0, uint32_t r1)
{
	size_t E = s->E;
	bool vec = nf_sp_fdown_vec(s);
	uint32_t L = vec ? 64 : 16, np = vec ? s->F & ~63u : s->F;
	for (uint32_t i = i0; i < i1 && i < np; i++) {
		if (act[i] == 0.0f)
			continue; /* adds exact zeros in the dense sum */
		const char *g, *u, *d;
		neuron_addr(s, i, &g, &u, &d);
		/* lane = fma(w, a, lane): tinyBLAS's and vec_dot's step */
		s->k->axpy[NF_KT_F16](r1 - r0, act[i], (const uint16_t *)d + r0, lanes + (size_t)(i % L) * E + r0);
	}
	if (i1 <= np)
		return;
	for (uint32_t r = r0; r < r1 && !closed; r++)
		facc[r] = fdown_close(lanes, E, r);
	for (uint32_t i = i0 > np ? i0 : np; i < i1; i++) {
		if (act[i] == 0.0f)
			continue;
		const char *g, *u, *d;
		neuron_addr(s, i, &g, &u, &d);
		const uint16_t *w = (const uint16_t *)d;
		for (uint32_t r = r0; r < r1; r++)
			facc[r] += (double)(nf_fp16_to_fp32(w[r]) * act[i]);
	}
}

void nf_sp_fdown_finish(const struct nf_sparse *s, const float *lanes, double *facc, bool closed, uint32_t r0,
			uint32_t r1, float *out)
{
	size_t E = s->E;
	for (uint32_t r = r0; r < r1; r++) {
		if (!nf_sp_fdown_vec(s)) {
			float v[16];
			for (int l = 0; l < 16; l++)
				v[l] = lanes[(size_t)l * E + r];
			out[r] = nf_sum16(v);
		} else {
			out[r] = (float)(closed ? facc[r] : fdown_close(lanes, E, r));
		}
	}
}

/* Computes the neurons of groups [g0, g1) of the current layer that mask
 * (indexed by group) selects, for the token whose prepared input is xq,
 * into out (E floats). */
void nf_sp_chunk_compute(struct nf_sparse *s, uint32_t g0, uint32_t g1, const uint32_t *mask, const void *xq,
			  float *out, char *scratch, float *kact)
{
	const struct nf_kernels *k = s->k;
	uint32_t E = s->E;
	uint32_t ids[CHUNK_MAX], n = 0;
	float gv[2 * CHUNK_MAX], coef[CHUNK_MAX], *uv;
	const void *gp[2 * CHUNK_MAX], *up[CHUNK_MAX], *dp[CHUNK_MAX], *cols[CHUNK_MAX];
	for (uint32_t gi = g0; gi < g1; gi++) {
		uint32_t m = mask[gi];
		while (m) {
			uint32_t j = gi * GROUP + (uint32_t)__builtin_ctz(m);
			const char *g, *u, *d;
			m &= m - 1;
			neuron_addr(s, j, &g, &u, &d);
			ids[n] = j;
			gp[n] = g;
			up[n] = u;
			dp[n] = d;
			gv[n] = 0.0f;
			n++;
		}
	}
	/* gate and up rows in one gather call for the chunk (exact mode:
	 * gate rows first, dropping the neurons whose gate is not positive,
	 * then the up rows of the others); each row the same sum as gemv alone */
	if (!n)
		return;
	if (s->has_gate && s->mode != NF_SPARSE_EXACT) {
		memcpy(gp + n, up, n * sizeof(*up));
		k->gemv_list[nf_sp_kt_gu(s)](E, 2 * n, gp, xq, gv);
		uv = gv + n;
	} else {
		if (s->has_gate) {
			k->gemv_list[nf_sp_kt_gu(s)](E, n, gp, xq, gv);
			uint32_t kept = 0;
			for (uint32_t j = 0; j < n; j++) {
				if (!(gv[j] > 0.0f))
					continue;
				ids[kept] = ids[j];
				up[kept] = up[j];
				dp[kept] = dp[j];
				gv[kept] = gv[j];
				kept++;
			}
			n = kept;
		}
		uv = gv + CHUNK_MAX;
		if (n)
			k->gemv_list[nf_sp_kt_gu(s)](E, n, up, xq, uv);
	}

	/* per group (K-quant QCOL: per super-block): activations, rounded or
	 * quantized as one block, then the group's (coefficient, down part)
	 * pairs in neuron order */
	const struct layer_tab *tab = s->cur_tab;
	uint32_t dt_down = tab->dt_down;
	bool kcol = nf_sp_is_kdown(s, dt_down);
	uint32_t unit = kcol && nf_dtype_is_kquant(dt_down) ? NF_QK_K : GROUP;
	uint32_t ncols = 0;
	for (uint32_t j0 = 0; j0 < n;) {
		uint32_t gi = ids[j0] / unit, j1 = j0;
		float a[NF_QK_K];
		memset(a, 0, unit * sizeof(float));
		for (; j1 < n && ids[j1] / unit == gi; j1++) {
			if (s->mode == NF_SPARSE_EXACT && s->act == NF_FFN_DRELU && !(uv[j1] > 0.0f)) {
				dp[j1] = NULL;
				continue;
			}
			a[ids[j1] % unit] = act1(s->act, gv[j1], uv[j1], s->has_gate, ids[j1], s->F);
		}
		if (kcol) {
			/* the down product waits for the layer's activations (kdown_rows) */
			for (uint32_t j = j0; j < j1; j++)
				if (dp[j])
					kact[ids[j]] = a[ids[j] % unit];
		} else if (nf_dtype_block_len(dt_down) > 1) {
			/* PowerInfer: the activation vector quantized to Q8_0;
			 * neuron i contributes d * q[i] times its dequantized down row */
			struct nf_block_q8_0 blk;
			nf_quantize_row_q8_0(a, &blk, GROUP);
			float d = nf_fp16_to_fp32(blk.d);
			for (uint32_t j = j0; j < j1; j++) {
				int8_t q = blk.qs[ids[j] % GROUP];
				if (dp[j] && q != 0) {
					coef[ncols] = d * (float)q;
					cols[ncols++] = dp[j];
				}
			}
		} else {
			/* float down rows: the activations rounded to the row's dot type */
			float ar[GROUP];
			k->act_prepare[tab->kt_down](a, scratch, GROUP);
			nf_dequantize_row(nf_ktype_dot_dtype(tab->kt_down), scratch, ar, GROUP);
			if (nf_sp_is_fdown(s, dt_down)) {
				/* the down product waits for the layer's activations
				 * (invariant 8) */
				for (uint32_t j = j0; j < j1; j++)
					if (dp[j])
						kact[ids[j]] = ar[ids[j] % GROUP];
				j0 = j1;
				continue;
			}
			for (uint32_t j = j0; j < j1; j++) {
				float v = ar[ids[j] % GROUP];
				if (dp[j] && v != 0.0f) {
					coef[ncols] = v;
					cols[ncols++] = dp[j];
				}
			}
		}
		j0 = j1;
	}
	if (ncols)
		k->axpy_list[tab->kt_down](E, ncols, coef, cols, out);
}
