/*
 * kernels_neon_kquant.h - private to compute/kernels_neon.c and
 * compute/kernels_neondot.c: the K-quant kernels of both arm64 tables, Q8_K
 * activation preparation, the Q2_K..Q6_K products (gemv, gemm, gemv_list)
 * and axpys (y += a * row, the reference's bits),
 * written once over the integer block product dot16 that each file
 * defines before including this (see kernels_neon_q.h), and the sparse
 * FFN's K-quant down columns (kcol_madd, exact integers).
 *
 * Invariants:
 * 1. Prepared Q8_K blocks are bit-identical to nf_kref_prepare_q8_K: the
 *    first value of largest magnitude (NaN ignored, as the reference's
 *    comparison ignores it), iscale = -127 / max in f32, q = iscale * x
 *    rounded half to even (fcvtns) and capped at 127, d = 1 / iscale, and
 *    the same integer sums of 16.
 * 2. Every product has the reference's bits (kernels_ref.c, dot_kquant):
 *    a 32-value group is two 16-byte registers and dot16's lane j sums
 *    values 4j..4j+3 of each, so the register for values 0-15 holds the
 *    reference's lanes 0-3 and the one for values 16-31 its lanes 4-7;
 *    each is multiplied by its sub-block's integer scale and summed over
 *    the 8 groups in int32 (exact: at most 8 * 4 * 32 * 128 * 128 < 2^31);
 *    one fma per lane and super-block with d_x * d_w, the min terms as
 *    exact integers in the reference's places (Q2_K into the lanes before
 *    them, Q4_K 4 lanes of their own, Q5_K one scalar sum), and the same
 *    final reduction.
 * 3. Nothing here allocates.
 */
#ifndef NF_KERNELS_NEON_KQUANT_H
#define NF_KERNELS_NEON_KQUANT_H

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "kernels_neon_q.h"

/* ---- Q8_K activations ------------------------------------------------------ */

static void nk_prepare_q8_K(const float *x, void *xq, size_t n)
{
	struct nf_block_q8_K *y = xq;
	for (size_t b = 0; b < n / NF_QK_K; b++, x += NF_QK_K) {
		float32x4_t m = vdupq_n_f32(0.0f);
		for (int j = 0; j < NF_QK_K; j += 4)
			m = vmaxnmq_f32(m, vabsq_f32(vld1q_f32(x + j)));
		const float amax = vmaxnmvq_f32(m);
		const float max = nf_kq_q8_K_max(x, amax, &y[b]);
		if (max == 0.0f)
			continue;
		const float iscale = -127.0f / max;
		const int32x4_t cap = vdupq_n_s32(127);
		for (int j = 0; j < NF_QK_K; j += 16) {
			int16x8_t h[2];
			for (int k = 0; k < 2; k++) {
				int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + j + 8 * k), iscale));
				int32x4_t c = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + j + 8 * k + 4), iscale));
				h[k] = vcombine_s16(vqmovn_s32(vminq_s32(a, cap)), vqmovn_s32(vminq_s32(c, cap)));
			}
			int8x16_t q = vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1]));
			vst1q_s8(y[b].qs + j, q);
			y[b].bsums[j / 16] = vaddlvq_s8(q);
		}
		y[b].d = 1.0f / iscale;
	}
}

/* ---- one super-block's integer lanes ------------------------------------------- */

/* Group of 32: lanes 0-3 (s0) += sc0 * dot16 of values 0-15, lanes 4-7
 * (s1) += sc1 * dot16 of values 16-31. */
static inline void nk_group(int8x16_t w0, int8x16_t w1, const int8_t *x, int32_t sc0, int32_t sc1,
			    int32x4_t *s0, int32x4_t *s1)
{
	*s0 = vmlaq_n_s32(*s0, dot16(w0, vld1q_s8(x)), sc0);
	*s1 = vmlaq_n_s32(*s1, dot16(w1, vld1q_s8(x + 16)), sc1);
}

static inline int8x16_t nk_s8(uint8x16_t v)
{
	return vreinterpretq_s8_u8(v);
}

/* Q2_K and Q3_K low bits: value 128h + 32k + l is (qs[32h + l] >> 2k) & 3;
 * qh (Q3_K) the high bit, bit g of hmask[l] for value 32g + l, already
 * shifted into bit 2 of each byte; the value is then q - 4 (low | 4 * hbit
 * minus 4). off = 0 and no qh for Q2_K. */
static inline void nk_lanes_2bit(const uint8_t *qs, const uint8_t *hmask, const int8_t *sc, const int8_t *x,
				 int32x4_t *s0, int32x4_t *s1)
{
	const uint8x16_t m3 = vdupq_n_u8(3), four = vdupq_n_u8(4);
	uint8x16_t h0 = vdupq_n_u8(0), h1 = h0;
	if (hmask) {
		h0 = vld1q_u8(hmask);
		h1 = vld1q_u8(hmask + 16);
	}
	for (int h = 0; h < 2; h++) {
		uint8x16_t q0 = vld1q_u8(qs + 32 * h), q1 = vld1q_u8(qs + 32 * h + 16);
		for (int k = 0; k < 4; k++) {
			const int g = 4 * h + k;
			uint8x16_t v0 = vandq_u8(q0, m3), v1 = vandq_u8(q1, m3);
			int8x16_t w0, w1;
			if (hmask) {
				/* low | (hbit << 2), minus 4 */
				v0 = vorrq_u8(v0, vandq_u8(vshlq_n_u8(h0, 2), four));
				v1 = vorrq_u8(v1, vandq_u8(vshlq_n_u8(h1, 2), four));
				w0 = vsubq_s8(nk_s8(v0), vdupq_n_s8(4));
				w1 = vsubq_s8(nk_s8(v1), vdupq_n_s8(4));
				h0 = vshrq_n_u8(h0, 1);
				h1 = vshrq_n_u8(h1, 1);
			} else {
				w0 = nk_s8(v0);
				w1 = nk_s8(v1);
			}
			nk_group(w0, w1, x + 32 * g, sc[2 * g], sc[2 * g + 1], s0, s1);
			q0 = vshrq_n_u8(q0, 2);
			q1 = vshrq_n_u8(q1, 2);
		}
	}
}

/* Q4_K and Q5_K: qs[32c + l] holds value 64c + l (low nibble) and
 * 64c + 32 + l (high nibble); qh (Q5_K) bit g of qh[l] the fifth bit of
 * value 32g + l. sc: one scale per 32 values. */
static inline void nk_lanes_4bit(const uint8_t *qs, const uint8_t *qh, const uint8_t *sc, const int8_t *x,
				 int32x4_t *s0, int32x4_t *s1)
{
	const uint8x16_t m4 = vdupq_n_u8(0xf), one = vdupq_n_u8(1);
	uint8x16_t h0 = vdupq_n_u8(0), h1 = h0;
	if (qh) {
		h0 = vld1q_u8(qh);
		h1 = vld1q_u8(qh + 16);
	}
	for (int c = 0; c < 4; c++) {
		uint8x16_t q0 = vld1q_u8(qs + 32 * c), q1 = vld1q_u8(qs + 32 * c + 16);
		for (int hi = 0; hi < 2; hi++) {
			const int g = 2 * c + hi;
			uint8x16_t v0 = hi ? vshrq_n_u8(q0, 4) : vandq_u8(q0, m4);
			uint8x16_t v1 = hi ? vshrq_n_u8(q1, 4) : vandq_u8(q1, m4);
			if (qh) {
				v0 = vorrq_u8(v0, vshlq_n_u8(vandq_u8(h0, one), 4));
				v1 = vorrq_u8(v1, vshlq_n_u8(vandq_u8(h1, one), 4));
				h0 = vshrq_n_u8(h0, 1);
				h1 = vshrq_n_u8(h1, 1);
			}
			nk_group(nk_s8(v0), nk_s8(v1), x + 32 * g, sc[g], sc[g], s0, s1);
		}
	}
}

/* Q6_K: value 128h + 32k + l has its low 4 bits in ql[64h + 32(k & 1) + l]
 * (low nibble for k < 2, high for k >= 2) and its top 2 in bits 2k, 2k+1
 * of qh[32h + l]; the value is q - 32. */
static inline void nk_lanes_6bit(const struct nf_block_q6_K *a, const int8_t *x, int32x4_t *s0, int32x4_t *s1)
{
	const uint8x16_t m4 = vdupq_n_u8(0xf), m3 = vdupq_n_u8(3);
	const int8x16_t m32 = vdupq_n_s8(32);
	for (int h = 0; h < 2; h++) {
		uint8x16_t l[4], qh0 = vld1q_u8(a->qh + 32 * h), qh1 = vld1q_u8(a->qh + 32 * h + 16);
		for (int i = 0; i < 4; i++)
			l[i] = vld1q_u8(a->ql + 64 * h + 16 * i);
		for (int k = 0; k < 4; k++) {
			const int g = 4 * h + k;
			uint8x16_t lo0 = l[2 * (k & 1)], lo1 = l[2 * (k & 1) + 1];
			lo0 = k < 2 ? vandq_u8(lo0, m4) : vshrq_n_u8(lo0, 4);
			lo1 = k < 2 ? vandq_u8(lo1, m4) : vshrq_n_u8(lo1, 4);
			uint8x16_t v0 = vorrq_u8(lo0, vshlq_n_u8(vandq_u8(qh0, m3), 4));
			uint8x16_t v1 = vorrq_u8(lo1, vshlq_n_u8(vandq_u8(qh1, m3), 4));
			qh0 = vshrq_n_u8(qh0, 2);
			qh1 = vshrq_n_u8(qh1, 2);
			nk_group(vsubq_s8(nk_s8(v0), m32), vsubq_s8(nk_s8(v1), m32), x + 32 * g,
				 a->scales[2 * g], a->scales[2 * g + 1], s0, s1);
		}
	}
}

/* acc += d * the 8 lanes */
static inline void nk_fma_lanes(int32x4_t s0, int32x4_t s1, float d, float32x4_t *a0, float32x4_t *a1)
{
	*a0 = vfmaq_n_f32(*a0, vcvtq_f32_s32(s0), d);
	*a1 = vfmaq_n_f32(*a1, vcvtq_f32_s32(s1), d);
}

/* Q4_K/Q5_K min products of a super-block, k = 0..3:
 * mn[2k] * (bsums[4k] + bsums[4k+1]) + mn[2k+1] * (bsums[4k+2] + bsums[4k+3]). */
static inline int32x4_t nk_mins_k4(const int16_t *bsums, const uint8_t mn[8])
{
	int32x4_t s0 = vpaddlq_s16(vld1q_s16(bsums)), s1 = vpaddlq_s16(vld1q_s16(bsums + 8));
	uint16x8_t m = vmovl_u8(vld1_u8(mn));
	int32x4_t m0 = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(m)));
	int32x4_t m1 = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(m)));
	return vpaddq_s32(vmulq_s32(s0, m0), vmulq_s32(s1, m1));
}

/* ((v0 + v2) + (v1 + v3)), the reference's sum of the Q4_K min lanes */
static inline float nk_reduce4(float32x4_t v)
{
	float32x2_t u = vadd_f32(vget_low_f32(v), vget_high_f32(v));
	return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}

/* ---- one row's dot product per type ---------------------------------------------- */

static float nk_dot_q2_K(size_t n, const void *w, const void *xq)
{
	const struct nf_block_q2_K *a = w;
	const struct nf_block_q8_K *b = xq;
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		const float d = b[i].d * nq_h2f(a[i].d), dmin = -b[i].d * nq_h2f(a[i].dmin);
		uint8x16_t sm = vld1q_u8(a[i].scales);
		int8_t sc[16];
		vst1q_s8(sc, nk_s8(vandq_u8(sm, vdupq_n_u8(0xf))));
		/* mins: lane m gets mn[2m] bsum[2m] + mn[2m+1] bsum[2m+1] */
		int16x8_t mn = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(vshrq_n_u8(sm, 4))));
		int16x8_t mh = vreinterpretq_s16_u16(vmovl_high_u8(vshrq_n_u8(sm, 4)));
		int16x8_t b0 = vld1q_s16(b[i].bsums), b1 = vld1q_s16(b[i].bsums + 8);
		int32x4_t p0 = vpaddq_s32(vmull_s16(vget_low_s16(mn), vget_low_s16(b0)), vmull_high_s16(mn, b0));
		int32x4_t p1 = vpaddq_s32(vmull_s16(vget_low_s16(mh), vget_low_s16(b1)), vmull_high_s16(mh, b1));
		nk_fma_lanes(p0, p1, dmin, &a0, &a1);
		int32x4_t s0 = vdupq_n_s32(0), s1 = s0;
		nk_lanes_2bit(a[i].qs, NULL, sc, b[i].qs, &s0, &s1);
		nk_fma_lanes(s0, s1, d, &a0, &a1);
	}
	return nq_reduce8(a0, a1);
}

static float nk_dot_q3_K(size_t n, const void *w, const void *xq)
{
	const struct nf_block_q3_K *a = w;
	const struct nf_block_q8_K *b = xq;
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		const float d = b[i].d * nq_h2f(a[i].d);
		int8_t sc[16];
		nf_kq_scales_k3(a[i].scales, sc);
		int32x4_t s0 = vdupq_n_s32(0), s1 = s0;
		nk_lanes_2bit(a[i].qs, a[i].hmask, sc, b[i].qs, &s0, &s1);
		nk_fma_lanes(s0, s1, d, &a0, &a1);
	}
	return nq_reduce8(a0, a1);
}

static float nk_dot_q4_K(size_t n, const void *w, const void *xq)
{
	const struct nf_block_q4_K *a = w;
	const struct nf_block_q8_K *b = xq;
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, am = a0;
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		const float d = b[i].d * nq_h2f(a[i].d), dmin = -b[i].d * nq_h2f(a[i].dmin);
		uint8_t sc[8], mn[8];
		nf_kq_scales_k4(a[i].scales, sc, mn);
		am = vfmaq_n_f32(am, vcvtq_f32_s32(nk_mins_k4(b[i].bsums, mn)), dmin);
		int32x4_t s0 = vdupq_n_s32(0), s1 = s0;
		nk_lanes_4bit(a[i].qs, NULL, sc, b[i].qs, &s0, &s1);
		nk_fma_lanes(s0, s1, d, &a0, &a1);
	}
	return nq_reduce8(a0, a1) + nk_reduce4(am);
}

static float nk_dot_q5_K(size_t n, const void *w, const void *xq)
{
	const struct nf_block_q5_K *a = w;
	const struct nf_block_q8_K *b = xq;
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
	float summs = 0.0f;
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		const float d = b[i].d * nq_h2f(a[i].d), dmin = -b[i].d * nq_h2f(a[i].dmin);
		uint8_t sc[8], mn[8];
		nf_kq_scales_k4(a[i].scales, sc, mn);
		summs = fmaf(dmin, (float)vaddvq_s32(nk_mins_k4(b[i].bsums, mn)), summs);
		int32x4_t s0 = vdupq_n_s32(0), s1 = s0;
		nk_lanes_4bit(a[i].qs, a[i].qh, sc, b[i].qs, &s0, &s1);
		nk_fma_lanes(s0, s1, d, &a0, &a1);
	}
	return nq_reduce8(a0, a1) + summs;
}

static float nk_dot_q6_K(size_t n, const void *w, const void *xq)
{
	const struct nf_block_q6_K *a = w;
	const struct nf_block_q8_K *b = xq;
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		const float d = b[i].d * nq_h2f(a[i].d);
		int32x4_t s0 = vdupq_n_s32(0), s1 = s0;
		nk_lanes_6bit(&a[i], b[i].qs, &s0, &s1);
		nk_fma_lanes(s0, s1, d, &a0, &a1);
	}
	return nq_reduce8(a0, a1);
}

/* gemv, gemm (each weight row stays in L1 while the tokens pass) and
 * gemv_list, all one row's chain at a time. */
#define NK_MATMUL(T)                                                                             \
	static void nk_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,         \
				const void *xq, float *y)                                         \
	{                                                                                        \
		for (size_t r = 0; r < nrows; r++)                                               \
			y[r] = nk_dot_##T(n, (const char *)w + r * row_bytes, xq);               \
	}                                                                                        \
	static void nk_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,         \
				size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                        \
		for (size_t r = 0; r < nrows; r++)                                               \
			for (size_t t = 0; t < nb; t++)                                          \
				y[t * ldy + r] = nk_dot_##T(n, (const char *)w + r * row_bytes,  \
							    (const char *)xq + t * xq_stride);   \
	}                                                                                        \
	static void nk_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,            \
				     const void *xq, float *y)                                    \
	{                                                                                        \
		for (size_t r = 0; r < nrows; r++)                                               \
			y[r] = nk_dot_##T(n, rows[r], xq);                                       \
	}

NK_MATMUL(q2_K)
NK_MATMUL(q3_K)
NK_MATMUL(q4_K)
NK_MATMUL(q5_K)
NK_MATMUL(q6_K)

/* ---- K-quant down columns (kcol_madd) -------------------------------------------- */

/* Exactly the 2b bytes of 16 b-bit values (never reading past them). */
static inline uint8x16_t nk_kcol_load(const uint8_t *p, uint32_t b)
{
	uint64_t u64;
	uint32_t u32;
	uint16_t u16;
	if (b < 4) {
		memcpy(&u32, p, 4);
		uint16x8_t v = vreinterpretq_u16_u32(vsetq_lane_u32(u32, vdupq_n_u32(0), 0));
		if (b == 3) {
			memcpy(&u16, p + 4, 2);
			v = vsetq_lane_u16(u16, v, 2);
		}
		return vreinterpretq_u8_u16(v);
	}
	memcpy(&u64, p, 8);
	uint64x2_t v = vsetq_lane_u64(u64, vdupq_n_u64(0), 0);
	if (b == 5) {
		memcpy(&u16, p + 8, 2);
		return vreinterpretq_u8_u16(vsetq_lane_u16(u16, vreinterpretq_u16_u64(v), 4));
	}
	if (b == 6) {
		memcpy(&u32, p + 8, 4);
		return vreinterpretq_u8_u32(vsetq_lane_u32(u32, vreinterpretq_u32_u64(v), 2));
	}
	return vreinterpretq_u8_u64(v);
}

/* 8 rows: acc += sc * p, exact 32-bit products (smlal) */
static inline void nk_kcol_acc8(int16x8_t p, const int16_t *sc, int32_t *acc)
{
	int16x8_t s = vld1q_s16(sc);
	vst1q_s32(acc, vmlal_s16(vld1q_s32(acc), vget_low_s16(p), vget_low_s16(s)));
	vst1q_s32(acc + 4, vmlal_high_s16(vld1q_s32(acc + 4), p, s));
}

/* 16 rows per step: the values unpacked to int16 by tbl and the
 * nf_kcol_idx/mul tables (kernels_impl.h), minus off, times xq (exact in
 * int16), then times the rows' scales into the int32 sums. */
static inline void nk_kcol_madd_b(uint32_t b, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
				  int32_t xq, int32_t *acc)
{
	const uint8x16_t i0 = vld1q_u8(nf_kcol_idx[b - 2]), i1 = vld1q_u8(nf_kcol_idx[b - 2] + 16);
	const uint16x8_t m0 = vld1q_u16(nf_kcol_mul[b - 2]), m1 = vld1q_u16(nf_kcol_mul[b - 2] + 8);
	const int16x8_t sh = vdupq_n_s16((int16_t)(b - 16)), vo = vdupq_n_s16((int16_t)off);
	size_t r = 0;
	for (; r + 16 <= n; r += 16, col += 2 * b) {
		uint8x16_t src = nk_kcol_load(col, b);
		uint16x8_t w0 = vshlq_u16(vmulq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(src, i0)), m0), sh);
		uint16x8_t w1 = vshlq_u16(vmulq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(src, i1)), m1), sh);
		nk_kcol_acc8(vmulq_n_s16(vsubq_s16(vreinterpretq_s16_u16(w0), vo), (int16_t)xq), sc + r, acc + r);
		nk_kcol_acc8(vmulq_n_s16(vsubq_s16(vreinterpretq_s16_u16(w1), vo), (int16_t)xq), sc + r + 8,
			     acc + r + 8);
	}
	if (r < n)
		nf_kref_kcol_madd(b, off, col, n - r, sc + r, xq, acc + r);
}

static void nk_kcol_madd(uint32_t bits, int32_t off, const uint8_t *col, size_t n, const int16_t *sc, int32_t xq,
			 int32_t *acc)
{
	NF_KCOL_BY_BITS(nk_kcol_madd_b, bits, off, col, n, sc, xq, acc);
}

/* ---- axpy: y += a * row (the sparse FFN's down rows, PowerInfer layout) ---------- */

/* Q4_K's and Q6_K's quants of one super-block as signed values, in order
 * (as kernels_avx2_kquant.c's kq_quants: Q4_K value 64c + l is qs[32c +
 * l]'s low nibble, 64c + 32 + l its high one; Q6_K value 128h + 32k + l
 * from ql and qh, - 32). */
static void nk_kq_quants(uint32_t t, const void *blk, int8_t q[NF_QK_K])
{
	const uint8x16_t m4 = vdupq_n_u8(0xf);
	if (t == NF_DTYPE_Q4_K) {
		const struct nf_block_q4_K *b = blk;
		for (int c = 0; c < 4; c++)
			for (int p = 0; p < 2; p++) {
				uint8x16_t v = vld1q_u8(b->qs + 32 * c + 16 * p);
				vst1q_s8(q + 64 * c + 16 * p, vreinterpretq_s8_u8(vandq_u8(v, m4)));
				vst1q_s8(q + 64 * c + 32 + 16 * p, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)));
			}
		return;
	}
	const struct nf_block_q6_K *b = blk;
	const uint8x16_t m2 = vdupq_n_u8(3);
	const int8x16_t m32 = vdupq_n_s8(32);
	for (int h = 0; h < 2; h++)
		for (int p = 0; p < 2; p++) {
			uint8x16_t l0 = vld1q_u8(b->ql + 64 * h + 16 * p);
			uint8x16_t l1 = vld1q_u8(b->ql + 64 * h + 32 + 16 * p);
			uint8x16_t qh = vld1q_u8(b->qh + 32 * h + 16 * p);
			uint8x16_t lo[4] = { vandq_u8(l0, m4), vandq_u8(l1, m4), vshrq_n_u8(l0, 4), vshrq_n_u8(l1, 4) };
			uint8x16_t hb[4] = { vandq_u8(qh, m2), vandq_u8(vshrq_n_u8(qh, 2), m2),
					     vandq_u8(vshrq_n_u8(qh, 4), m2), vshrq_n_u8(qh, 6) };
			for (int k = 0; k < 4; k++) {
				int8x16_t v = vreinterpretq_s8_u8(vorrq_u8(lo[k], vshlq_n_u8(hb[k], 4)));
				vst1q_s8(q + 128 * h + 32 * k + 16 * p, vsubq_s8(v, m32));
			}
		}
}

/* The reference's axpy_kquant with its bits (per 16 values the same scalar
 * dl and ml, dl * q - ml rounded twice, one fma), as the x86 tables do. */
static void nk_axpy_kq(uint32_t t, size_t n, float a, const void *wrow, float *y)
{
	const size_t bs = nf_dtype_block_size(t);
	for (size_t i = 0; i < n / NF_QK_K; i++, y += NF_QK_K) {
		const char *blk = (const char *)wrow + i * bs;
		struct nf_kblock kb;
		if (t == NF_DTYPE_Q4_K || t == NF_DTYPE_Q6_K) {
			nf_kblock_unpack_scales(t, blk, &kb);
			nk_kq_quants(t, blk, kb.q);
		} else {
			nf_kblock_unpack(t, blk, &kb);
		}
		for (int j = 0; j < 16; j++) {
			const float32x4_t dl = vdupq_n_f32(kb.d * (float)kb.sc[j]);
			const float32x4_t ml = vdupq_n_f32(kb.dmin * (float)kb.mn[j]);
			const int8x16_t q = vld1q_s8(kb.q + 16 * j);
			const int16x8_t h[2] = { vmovl_s8(vget_low_s8(q)), vmovl_s8(vget_high_s8(q)) };
			for (int r = 0; r < 4; r++) {
				int32x4_t qi = r % 2 ? vmovl_s16(vget_high_s16(h[r / 2])) : vmovl_s16(vget_low_s16(h[r / 2]));
				float32x4_t v = vsubq_f32(vmulq_f32(dl, vcvtq_f32_s32(qi)), ml);
				float *yr = y + 16 * j + 4 * r;
				vst1q_f32(yr, vfmaq_n_f32(vld1q_f32(yr), v, a));
			}
		}
	}
}

#define NK_KAXPY(T, DT)                                                                              \
	static void nk_axpy_##T(size_t n, float a, const void *wrow, float *y)                       \
	{                                                                                            \
		nk_axpy_kq(DT, n, a, wrow, y);                                                       \
	}                                                                                            \
	static void nk_axpy_list_##T(size_t n, size_t ncols, const float *a, const void *const *cols, \
				     float *y)                                                       \
	{                                                                                            \
		for (size_t c = 0; c < ncols; c++)                                                   \
			nk_axpy_kq(DT, n, a[c], cols[c], y);                                         \
	}
NK_KAXPY(q2_K, NF_DTYPE_Q2_K)
NK_KAXPY(q3_K, NF_DTYPE_Q3_K)
NK_KAXPY(q4_K, NF_DTYPE_Q4_K)
NK_KAXPY(q5_K, NF_DTYPE_Q5_K)
NK_KAXPY(q6_K, NF_DTYPE_Q6_K)

/* The table entries this header defines. */
#define NK_ENTRIES(op)                                                                           \
	.op[NF_KT_Q2_K] = nk_##op##_q2_K, .op[NF_KT_Q3_K] = nk_##op##_q3_K,                      \
	.op[NF_KT_Q4_K] = nk_##op##_q4_K, .op[NF_KT_Q5_K] = nk_##op##_q5_K,                      \
	.op[NF_KT_Q6_K] = nk_##op##_q6_K
#define NF_KNEON_KQUANT_ENTRIES                                                                  \
	.act_prepare[NF_KT_Q2_K] = nk_prepare_q8_K, .act_prepare[NF_KT_Q3_K] = nk_prepare_q8_K,  \
	.act_prepare[NF_KT_Q4_K] = nk_prepare_q8_K, .act_prepare[NF_KT_Q5_K] = nk_prepare_q8_K,  \
	.act_prepare[NF_KT_Q6_K] = nk_prepare_q8_K, NK_ENTRIES(gemv), NK_ENTRIES(gemm),          \
	NK_ENTRIES(gemv_list), NK_ENTRIES(axpy), NK_ENTRIES(axpy_list), .kcol_madd = nk_kcol_madd

#endif /* NF_KERNELS_NEON_KQUANT_H */
