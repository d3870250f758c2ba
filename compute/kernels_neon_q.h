/*
 * kernels_neon_q.h - private to compute/kernels_neon.c and
 * compute/kernels_neondot.c: the Q8_0 and Q4_0 products (gemv, gemm,
 * gemv_list) written once over an integer block product that each file
 * supplies:
 *
 *	static inline int32x4_t dot16(int8x16_t a, int8x16_t b);
 *
 * lane j = sum of a[4j + k] * b[4j + k], k = 0..3 (what sdot computes; the
 * plain NEON file builds it from widening multiplies and pairwise adds).
 * Integer sums are exact, so both give the same lanes.
 *
 * Invariant: every row is one chain in the reference's order
 * (kernels_ref.c): per block, 8 int32 lanes of 4 consecutive products
 * (two dot16 over the two 16-byte halves); lane j accumulates
 * fma(d_w * d_x, lane_j, acc_j) over the blocks in order; the 8 lanes are
 * summed ((0+4)+(2+6)) + ((1+5)+(3+7)). Hence gemv, gemm and gemv_list give
 * the reference's bits for any row length.
 */
#ifndef NF_KERNELS_NEON_Q_H
#define NF_KERNELS_NEON_Q_H

#include <arm_neon.h>
#include <string.h>

#include "kernels_impl.h"

static inline float nq_h2f(uint16_t h)
{
	__fp16 f;
	memcpy(&f, &h, sizeof(f));
	return (float)f;
}

/* The reference's reduce8 on lanes 0-3 (a) and 4-7 (b). */
static inline float nq_reduce8(float32x4_t a, float32x4_t b)
{
	float32x4_t t = vaddq_f32(a, b);
	float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
	return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}

/* A Q4_0 block's weights as signed bytes -8..7, elements 0-15 and 16-31. */
static inline void nq_q4_0_unpack(const struct nf_block_q4_0 *b, int8x16_t *lo, int8x16_t *hi)
{
	uint8x16_t q = vld1q_u8(b->qs);
	const int8x16_t eight = vdupq_n_s8(8);
	*lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f))), eight);
	*hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), eight);
}

static inline void nq_q8_0_unpack(const struct nf_block_q8_0 *b, int8x16_t *lo, int8x16_t *hi)
{
	*lo = vld1q_s8(b->qs);
	*hi = vld1q_s8(b->qs + 16);
}

/* One block of a chain: acc += d_w * d_x * (the 8 lane sums). */
static inline void nq_step(int8x16_t w0, int8x16_t w1, float dw, const struct nf_block_q8_0 *x,
			   float32x4_t *a0, float32x4_t *a1)
{
	int32x4_t s0 = dot16(w0, vld1q_s8(x->qs)), s1 = dot16(w1, vld1q_s8(x->qs + 16));
	float d = dw * nq_h2f(x->d);
	*a0 = vfmaq_n_f32(*a0, vcvtq_f32_s32(s0), d);
	*a1 = vfmaq_n_f32(*a1, vcvtq_f32_s32(s1), d);
}

#define NQ_ROW(T, WBLOCK)                                                                     \
	static float row_##T(size_t nb, const WBLOCK *w, const struct nf_block_q8_0 *x)       \
	{                                                                                     \
		float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;                                  \
		for (size_t i = 0; i < nb; i++) {                                             \
			int8x16_t w0, w1;                                                     \
			nq_##T##_unpack(w + i, &w0, &w1);                                      \
			nq_step(w0, w1, nq_h2f(w[i].d), x + i, &a0, &a1);                     \
		}                                                                             \
		return nq_reduce8(a0, a1);                                                    \
	}                                                                                     \
	static void gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			     const void *xq, float *y)                                        \
	{                                                                                     \
		for (size_t r = 0; r < nrows; r++)                                            \
			y[r] = row_##T(n / NF_QK, (const WBLOCK *)((const char *)w + r * row_bytes), xq); \
	}                                                                                     \
	/* two rows at a time: two independent chains, each the one gemv runs */        \
	static void gemv_list_##T(size_t n, size_t nrows, const void *const *rows,           \
				  const void *xq, float *y)                                   \
	{                                                                                     \
		const struct nf_block_q8_0 *x = xq;                                           \
		size_t nb = n / NF_QK, r = 0;                                                 \
		for (; r + 2 <= nrows; r += 2) {                                              \
			const WBLOCK *p = rows[r], *q = rows[r + 1];                          \
			float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, b0 = a0, b1 = a0;        \
			for (size_t i = 0; i < nb; i++) {                                     \
				int8x16_t w0, w1, v0, v1;                                     \
				nq_##T##_unpack(p + i, &w0, &w1);                              \
				nq_##T##_unpack(q + i, &v0, &v1);                              \
				nq_step(w0, w1, nq_h2f(p[i].d), x + i, &a0, &a1);             \
				nq_step(v0, v1, nq_h2f(q[i].d), x + i, &b0, &b1);             \
			}                                                                     \
			y[r] = nq_reduce8(a0, a1);                                            \
			y[r + 1] = nq_reduce8(b0, b1);                                        \
		}                                                                             \
		if (r < nrows)                                                                \
			y[r] = row_##T(nb, rows[r], x);                                       \
	}                                                                                     \
	/* gemm: 2 weight rows x 4 activation rows per tile, each weight block          \
	 * unpacked once for the four; edges through row_##T. Same chains. */          \
	static void gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			     size_t nbat, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                     \
		const char *wc = w, *xc = xq;                                                 \
		size_t nb = n / NF_QK, b = 0;                                                 \
		for (; b + 4 <= nbat; b += 4) {                                               \
			const struct nf_block_q8_0 *xb[4];                                    \
			for (int j = 0; j < 4; j++)                                           \
				xb[j] = (const void *)(xc + (b + j) * xq_stride);             \
			size_t r = 0;                                                         \
			for (; r + 2 <= nrows; r += 2) {                                      \
				const WBLOCK *wr[2] = { (const void *)(wc + r * row_bytes),   \
							(const void *)(wc + (r + 1) * row_bytes) }; \
				float32x4_t acc[2][4][2];                                     \
				for (int i = 0; i < 2; i++)                                   \
					for (int j = 0; j < 4; j++)                           \
						acc[i][j][0] = acc[i][j][1] = vdupq_n_f32(0.0f); \
				for (size_t i = 0; i < nb; i++) {                             \
					int8x16_t wv[2][2];                                   \
					float dw[2];                                          \
					for (int k = 0; k < 2; k++) {                         \
						nq_##T##_unpack(wr[k] + i, &wv[k][0], &wv[k][1]); \
						dw[k] = nq_h2f(wr[k][i].d);                    \
					}                                                     \
					for (int j = 0; j < 4; j++)                           \
						for (int k = 0; k < 2; k++)                   \
							nq_step(wv[k][0], wv[k][1], dw[k], xb[j] + i, \
								&acc[k][j][0], &acc[k][j][1]); \
				}                                                             \
				for (int k = 0; k < 2; k++)                                   \
					for (int j = 0; j < 4; j++)                           \
						y[(b + j) * ldy + r + k] = nq_reduce8(acc[k][j][0], acc[k][j][1]); \
			}                                                                     \
			for (; r < nrows; r++)                                                \
				for (int j = 0; j < 4; j++)                                   \
					y[(b + j) * ldy + r] = row_##T(nb, (const void *)(wc + r * row_bytes), xb[j]); \
		}                                                                             \
		for (; b < nbat; b++)                                                         \
			gemv_##T(n, nrows, w, row_bytes, xc + b * xq_stride, y + b * ldy);    \
	}

NQ_ROW(q8_0, struct nf_block_q8_0)
NQ_ROW(q4_0, struct nf_block_q4_0)

/*
 * NF_KT_Q4_0, llama.cpp's repacked order (kernels_ref.c dot_q4_0): per
 * block the exact integer sum of the 32 products, acc = fma(sum, d_w * d_x,
 * acc), blocks in order. Four rows at a time, one row per lane: each row's
 * two dot16 lanes added, three pairwise adds turn the four rows' lanes into
 * their four sums, one vector fma with the four rows' d_w * d_x (a lane's
 * chain is its row's, so any row count gives the reference's bits).
 */
static inline int32x4_t nqb_lanes(const struct nf_block_q4_0 *w, int8x16_t x0, int8x16_t x1)
{
	int8x16_t w0, w1;
	nq_q4_0_unpack(w, &w0, &w1);
	return vaddq_s32(dot16(w0, x0), dot16(w1, x1));
}

static inline float32x4_t nqb_scales(const struct nf_block_q4_0 *const w[4], size_t i)
{
	uint16_t h[4] = { w[0][i].d, w[1][i].d, w[2][i].d, w[3][i].d };
	return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

/* acc lane r += rows w[r] . x for nt activation rows, blocks [0, nb). */
static inline void nqb_rows4(int nt, size_t nb, const struct nf_block_q4_0 *const w[4],
			     const struct nf_block_q8_0 *const *x, float32x4_t *acc)
{
	for (size_t i = 0; i < nb; i++) {
		float32x4_t dw = nqb_scales(w, i);
		for (int t = 0; t < nt; t++) {
			int8x16_t x0 = vld1q_s8(x[t][i].qs), x1 = vld1q_s8(x[t][i].qs + 16);
			int32x4_t s = vpaddq_s32(vpaddq_s32(nqb_lanes(w[0] + i, x0, x1), nqb_lanes(w[1] + i, x0, x1)),
						 vpaddq_s32(nqb_lanes(w[2] + i, x0, x1), nqb_lanes(w[3] + i, x0, x1)));
			acc[t] = vfmaq_f32(acc[t], vcvtq_f32_s32(s), vmulq_n_f32(dw, nq_h2f(x[t][i].d)));
		}
	}
}

static inline void nqb_put(float32x4_t a, float *y, size_t m)
{
	float t[4];
	vst1q_f32(t, a);
	memcpy(y, t, m * sizeof(float));
}

static void gemv_list_q4_0b(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	for (size_t r = 0; r < nrows; r += 4) {
		const struct nf_block_q4_0 *w[4];
		for (size_t k = 0; k < 4; k++)
			w[k] = rows[r + k < nrows ? r + k : nrows - 1];
		float32x4_t acc = vdupq_n_f32(0.0f);
		nqb_rows4(1, n / NF_QK, w, &x, &acc);
		nqb_put(acc, y + r, nrows - r < 4 ? nrows - r : 4);
	}
}

static void nqb_stride(const void *w, size_t row_bytes, size_t r, size_t nrows, const struct nf_block_q4_0 *p[4])
{
	for (size_t k = 0; k < 4; k++)
		p[k] = (const void *)((const char *)w + (r + k < nrows ? r + k : nrows - 1) * row_bytes);
}

static void gemv_q4_0b(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	for (size_t r = 0; r < nrows; r += 4) {
		const struct nf_block_q4_0 *p[4];
		nqb_stride(w, row_bytes, r, nrows, p);
		float32x4_t acc = vdupq_n_f32(0.0f);
		nqb_rows4(1, n / NF_QK, p, &x, &acc);
		nqb_put(acc, y + r, nrows - r < 4 ? nrows - r : 4);
	}
}

/* gemm: four rows against two activation rows per pass, the rest one. */
static void gemm_q4_0b(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nbat, const void *xq,
		       size_t xq_stride, float *y, size_t ldy)
{
	for (size_t r = 0; r < nrows; r += 4) {
		const struct nf_block_q4_0 *p[4];
		nqb_stride(w, row_bytes, r, nrows, p);
		size_t m = nrows - r < 4 ? nrows - r : 4, b = 0;
		for (; b + 2 <= nbat; b += 2) {
			const struct nf_block_q8_0 *x[2] = { (const void *)((const char *)xq + b * xq_stride),
							     (const void *)((const char *)xq + (b + 1) * xq_stride) };
			float32x4_t acc[2] = { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
			nqb_rows4(2, n / NF_QK, p, x, acc);
			nqb_put(acc[0], y + b * ldy + r, m);
			nqb_put(acc[1], y + (b + 1) * ldy + r, m);
		}
		for (; b < nbat; b++) {
			const struct nf_block_q8_0 *x = (const void *)((const char *)xq + b * xq_stride);
			float32x4_t acc = vdupq_n_f32(0.0f);
			nqb_rows4(1, n / NF_QK, p, &x, &acc);
			nqb_put(acc, y + b * ldy + r, m);
		}
	}
}

/* The table entries this header defines (NF_KT_Q4_0L: ggml's vec_dot
 * order, the lanes of NQ_ROW). */
#define NF_KNEON_QUANT_ENTRIES                                                          \
	.gemv[NF_KT_Q8_0] = gemv_q8_0, .gemv[NF_KT_Q4_0L] = gemv_q4_0,                  \
	.gemm[NF_KT_Q8_0] = gemm_q8_0, .gemm[NF_KT_Q4_0L] = gemm_q4_0,                  \
	.gemv_list[NF_KT_Q8_0] = gemv_list_q8_0, .gemv_list[NF_KT_Q4_0L] = gemv_list_q4_0, \
	.gemv[NF_KT_Q4_0] = gemv_q4_0b, .gemm[NF_KT_Q4_0] = gemm_q4_0b,                 \
	.gemv_list[NF_KT_Q4_0] = gemv_list_q4_0b

#endif /* NF_KERNELS_NEON_Q_H */
