/*
 * kernels_avx512.c - the kernel table for AVX-512 (F, BW, VL, DQ, VNNI).
 *
 * Quantized products use VPDPBUSD (unsigned x signed bytes, 4-way into
 * int32) on unsigned weights (Q4_0 nibbles as they are, Q8_0 + 128), with
 * the correction (-8 or -128 times each lane's activation sum) precomputed
 * per lane; the integer sums are exact, scales are applied per block in
 * f32 (the "quantized products in llama.cpp's order" below).
 *
 * Invariants:
 * 1. Integer block sums are exact. The Q4_0, Q8_0 and F16 kernels in the
 *    table (go_, xr_, gemv_f16, and the group kernels of kernels_avx512_x8.c) sum in the reference's (llama.cpp's)
 *    order and give its bits; F32 and BF16 agree with it within rounding,
 *    their gemv and gemm in one order (the tile's).
 * 2. Weight loads never leave the row: a group read unaligned takes two
 *    overlapping 64-byte loads at its first and its (size - 64)th byte; a
 *    run of groups read aligned takes whole cache lines inside the row.
 * 3. Only this file is compiled with the AVX-512 flags, and kernels.c hands
 *    out its table only after cpuid confirmed every one of them (and AVX2,
 *    FMA, F16C, whose kernels this table reuses).
 * 4. No allocation: repacked activations live on the stack, up to 272 KiB
 *    per xr_ call (4 tokens x 1024 blocks x 64 bytes, plus their scales),
 *    which every thread of the pool and the caller have room for (8 MiB
 *    default stacks).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels_impl.h"

#define INLINE static inline __attribute__((always_inline))

/* Rows of weights a gemm keeps hot in L2 while activation tiles pass. */
#define GEMM_ROW_BLOCK 64

/* ---- quantized products in llama.cpp's order ------------------------------------
 *
 * With activations rounded to Q8_0 at every layer a one-ulp difference
 * from another summation order flips a rounding downstream and changes
 * greedy continuations, so these follow llama.cpp's x86 order exactly
 * (kernels_ref.c):
 * per block 8 int32 lanes of 4 consecutive products, per (row, token) one
 * 8-lane chain acc = fma(d_w * d_x, lanes, acc) over the blocks in order,
 * then hsum8. To fill 512-bit registers a vector holds two weight rows
 * (lanes 0-7 row A, 8-15 row B) against the same activation block, so each
 * row's chain stays sequential. VPDPBUSD takes unsigned weights (Q4_0
 * nibbles as they are, Q8_0 + 128) and a precomputed correction of -8 or
 * -128 times each lane's activation sum. Rows of more than XR_MAX_BLOCKS
 * blocks go to the reference, which sums in the same order.
 */
#define XR_MAX_BLOCKS 1024   /* rows up to 32768 values: 68 KiB of packed x per token */
#define XR_ROW_BLOCK 64
#define XR_PREFETCH 512     /* bytes ahead in each weight row */

struct xr {
	__m256i x;     /* the block's 32 activation bytes */
	__m256i corr;  /* -8 or -128 times each 4-byte lane's sum */
};

/* Per block: x, and the lane sums shifted left by shift's lane (3 or 7), negated. */
static void xr_pack(const struct nf_block_q8_0 *x, size_t nb, __m256i shift, struct xr *out, float *dx)
{
	const __m256i ones = _mm256_set1_epi8(1);
	for (size_t i = 0; i < nb; i++) {
		__m256i v = _mm256_loadu_si256((const __m256i *)x[i].qs);
		__m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, v);
		out[i].x = v;
		out[i].corr = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_sllv_epi32(s, shift));
		dx[i] = _cvtsh_ss(x[i].d);
	}
}

INLINE float xr_hsum8(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

/* Rows A and B of block i as unsigned bytes (A in the low 256 bits). */
INLINE __m512i xr_w_q4_0(const char *a, const char *b, size_t i)
{
	__m128i qa = _mm_loadu_si128((const __m128i *)(a + i * sizeof(struct nf_block_q4_0) + 2));
	__m128i qb = _mm_loadu_si128((const __m128i *)(b + i * sizeof(struct nf_block_q4_0) + 2));
	__m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(qa, qa)),
				       _mm256_set_m128i(qb, qb), 1);
	const __m512i m4 = _mm512_set1_epi8(0x0f);
	return _mm512_mask_blend_epi8(0xFFFF0000FFFF0000ull, _mm512_and_si512(v, m4),
				      _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
}

INLINE __m512i xr_w_q8_0(const char *a, const char *b, size_t i)
{
	__m256i qa = _mm256_loadu_si256((const __m256i *)(a + i * sizeof(struct nf_block_q8_0) + 2));
	__m256i qb = _mm256_loadu_si256((const __m256i *)(b + i * sizeof(struct nf_block_q8_0) + 2));
	return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
				_mm512_set1_epi8((char)0x80));
}

/* Scales of rows A and B at block i: [dA x8 | dB x8]. */
INLINE __m512 xr_dw(const char *a, const char *b, size_t i, size_t bsz)
{
	__m256 da = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(a + i * bsz)));
	__m256 db = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(b + i * bsz)));
	return _mm512_insertf32x8(_mm512_castps256_ps512(da), db, 1);
}

/* P row pairs x B tokens over nb blocks: out[(2p + h) * B + t], h = 0 (A) or 1 (B). */
#define XR_TILE(T, BSZ)                                                                       \
	INLINE void xr_tile_##T(const int P, const int B, size_t nb, const char *const *wr,   \
				const struct xr *const *xb, const float *const *dxb, float *out) \
	{                                                                                     \
		__m512 acc[2][4];                                                             \
		for (int p = 0; p < P; p++)                                                   \
			for (int t = 0; t < B; t++)                                           \
				acc[p][t] = _mm512_setzero_ps();                              \
		for (size_t i = 0; i < nb; i++) {                                             \
			__m512i w[2];                                                         \
			__m512 dw[2];                                                         \
			_Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {                 \
				_mm_prefetch(wr[2 * p] + i * BSZ + XR_PREFETCH, _MM_HINT_T0); \
				_mm_prefetch(wr[2 * p + 1] + i * BSZ + XR_PREFETCH, _MM_HINT_T0); \
				w[p] = xr_w_##T(wr[2 * p], wr[2 * p + 1], i);                 \
				dw[p] = xr_dw(wr[2 * p], wr[2 * p + 1], i, BSZ);              \
			}                                                                     \
			_Pragma("GCC unroll 4") for (int t = 0; t < B; t++) {                 \
				const struct xr *x = xb[t] + i;                               \
				__m512i xv = _mm512_broadcast_i64x4(x->x);                    \
				__m512i cv = _mm512_broadcast_i64x4(x->corr);                 \
				__m512 dx = _mm512_set1_ps(dxb[t][i]);                        \
				_Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {         \
					__m512 s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, w[p], xv)); \
					acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(dw[p], dx), s, acc[p][t]); \
				}                                                             \
			}                                                                     \
		}                                                                             \
		for (int p = 0; p < P; p++)                                                   \
			for (int t = 0; t < B; t++) {                                         \
				out[(2 * p) * B + t] = xr_hsum8(_mm512_castps512_ps256(acc[p][t])); \
				out[(2 * p + 1) * B + t] = xr_hsum8(_mm512_extractf32x8_ps(acc[p][t], 1)); \
			}                                                                     \
	}

XR_TILE(q4_0, sizeof(struct nf_block_q4_0))
XR_TILE(q8_0, sizeof(struct nf_block_q8_0))

/* Rows r0..r1 of W against the B packed tokens, into y[t * ldy + r]. */
#define XR_ROWS(T)                                                                            \
	static void xr_rows_##T(size_t nb, const char *w, size_t row_bytes, size_t r0, size_t r1, \
				int B, const struct xr *const *xb, const float *const *dxb,   \
				float *y, size_t ldy)                                         \
	{                                                                                     \
		const char *wr[4];                                                            \
		float out[16];                                                                \
		size_t r = r0;                                                                \
		for (; r + 4 <= r1; r += 4) {                                                 \
			for (int k = 0; k < 4; k++)                                           \
				wr[k] = w + (r + k) * row_bytes;                              \
			if (B == 4)                                                           \
				xr_tile_##T(2, 4, nb, wr, xb, dxb, out);                      \
			else if (B == 1) {                                                    \
				xr_tile_##T(1, 1, nb, wr, xb, dxb, out);                      \
				xr_tile_##T(1, 1, nb, wr + 2, xb, dxb, out + 2);              \
			}                                                                     \
			else                                                                  \
				for (int t = 0; t < B; t++) {                                 \
					float o[4];                                           \
					xr_tile_##T(2, 1, nb, wr, xb + t, dxb + t, o);        \
					for (int k = 0; k < 4; k++)                           \
						out[k * B + t] = o[k];                        \
				}                                                             \
			for (int k = 0; k < 4; k++)                                           \
				for (int t = 0; t < B; t++)                                   \
					y[(size_t)t * ldy + r + k] = out[k * B + t];          \
		}                                                                             \
		for (; r < r1; r++) {                                                         \
			wr[0] = wr[1] = w + r * row_bytes;                                    \
			for (int t = 0; t < B; t++) {                                         \
				float o[2];                                                   \
				xr_tile_##T(1, 1, nb, wr, xb + t, dxb + t, o);                \
				y[(size_t)t * ldy + r] = o[0];                                \
			}                                                                     \
		}                                                                             \
	}                                                                                     \
	static void xr_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,     \
				size_t nbat, const void *xq, size_t xq_stride, float *y,      \
				size_t ldy)                                                   \
	{                                                                                     \
		size_t nb = n / NF_QK;                                                        \
		if (nb > XR_MAX_BLOCKS) {                                                     \
			nf_kernels_table_ref.gemm[XR_KT_##T](n, nrows, w, row_bytes, nbat,    \
							     xq, xq_stride, y, ldy);          \
			return;                                                               \
		}                                                                             \
		struct xr xp[4][XR_MAX_BLOCKS];                                               \
		float dx[4][XR_MAX_BLOCKS];                                                   \
		const char *xc = xq;                                                          \
		for (size_t r0 = 0; r0 < nrows; r0 += XR_ROW_BLOCK) {                         \
			size_t r1 = r0 + XR_ROW_BLOCK < nrows ? r0 + XR_ROW_BLOCK : nrows;    \
			for (size_t b0 = 0; b0 < nbat; b0 += 4) {                             \
				int bn = nbat - b0 < 4 ? (int)(nbat - b0) : 4;                \
				const struct xr *xb[4];                                       \
				const float *dxb[4];                                          \
				for (int j = 0; j < bn; j++) {                                \
					xr_pack((const void *)(xc + (b0 + j) * xq_stride), nb, \
						_mm256_set1_epi32(XR_SHIFT_##T), xp[j], dx[j]);                  \
					xb[j] = xp[j];                                        \
					dxb[j] = dx[j];                                       \
				}                                                             \
				xr_rows_##T(nb, w, row_bytes, r0, r1, bn, xb, dxb, y + b0 * ldy, ldy); \
			}                                                                     \
		}                                                                             \
	}

#define XR_KT_q4_0 NF_KT_Q4_0L
#define XR_KT_q8_0 NF_KT_Q8_0
#define XR_SHIFT_q4_0 3
#define XR_SHIFT_q8_0 7
XR_ROWS(q4_0)
XR_ROWS(q8_0)

/* ---- Q4_0 gemv in llama.cpp's order ------------------------------------------
 *
 * One token, so the weights stream from memory once and the kernel must
 * keep up with DRAM with as few instructions per byte as it can:
 * - Each row's chain acc = fma(d_w * d_x, lanes, acc) is sequential over
 *   the blocks (that is llama.cpp's order), so one row at a time is bound
 *   by fma latency. Eight rows run side by side instead, two per 512-bit
 *   register (row A in lanes 0-7, row B in 8-15, as xr_ above).
 * - Per block and row pair: two 16-byte broadcast loads, one AND that
 *   keeps low nibbles in lanes 0-3 and high nibbles (times 16) in lanes
 *   4-7 (see go_shift), one VPDPBUSD, one conversion, one VPERMT2PS for the
 *   scales and one fma. The scales of 8 blocks of a pair are gathered and
 *   multiplied by d_x once (go_scales8).
 * - While a group of rows is computed the next group is prefetched into
 *   L1, so that loads that straddle two cache lines hit in cache. Into L1
 *   even when the group is larger than L1 (11008-wide rows: 48 KiB): the
 *   L2 hint measured 0.68 of the memory read against 0.8 for L1. (An
 *   earlier version copied each group to the stack with aligned loads
 *   first; with the prefetch in place the copy only cost time.)
 * The activation row is repacked once per call (xr_pack) with each
 * block's correction precomputed. Rows of more than GO_MAX_BLOCKS blocks
 * go to the AVX2 kernel, which sums in the same order. Stack: about 34 KiB.
 */
#define GO_MAX_BLOCKS 512   /* 16384 values: 32 KiB of repacked activations */
#ifndef GO_PAIRS
#define GO_PAIRS 4
#endif

/*
 * Activations for this kernel: per block the 32 bytes and a correction in
 * which the low-nibble lanes 0-3 carry -8 and the high-nibble lanes 4-7
 * -128 times the lane's activation sum. The weights enter VPDPBUSD as
 * q & 0x0f (lanes 0-3) and q & 0xf0 = 16 * hi (lanes 4-7), so lanes 4-7
 * come out as exactly 16 times llama.cpp's integer lane; converting to
 * float and multiplying by a scale divided by 16 (a power of two: exact)
 * gives the same fma product, hence the same bits, as the reference.
 * This saves the shift that would otherwise isolate the high nibbles.
 */
INLINE __m256i go_shift(void)
{
	return _mm256_set_epi32(7, 7, 7, 7, 3, 3, 3, 3);
}

/* Blocks of rows A and B (pointers at their fp16 scale) as unsigned bytes
 * in x's lane order: [A & 0x0f | A & 0xf0 | B & 0x0f | B & 0xf0]. */
INLINE __m512i go_w_q4_0(const char *a, const char *b)
{
	__m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(a + 2)));
	z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128((const __m128i *)(b + 2)));
	const __m512i m = _mm512_set_epi64(-0x0f0f0f0f0f0f0f10ll, -0x0f0f0f0f0f0f0f10ll,
					   0x0f0f0f0f0f0f0f0fll, 0x0f0f0f0f0f0f0f0fll,
					   -0x0f0f0f0f0f0f0f10ll, -0x0f0f0f0f0f0f0f10ll,
					   0x0f0f0f0f0f0f0f0fll, 0x0f0f0f0f0f0f0f0fll);
	return _mm512_and_si512(z, m);
}

/* lanes 0-3 and 8-11 x1, lanes 4-7 and 12-15 x1/16 */
INLINE __m512 go_sixteenth(void)
{
	return _mm512_set_ps(0.0625f, 0.0625f, 0.0625f, 0.0625f, 1, 1, 1, 1,
			     0.0625f, 0.0625f, 0.0625f, 0.0625f, 1, 1, 1, 1);
}

/* acc += row pair (a, b) at one block, scales taken one block at a time */
INLINE __m512 go_step_q4_0(const char *a, const char *b, const struct xr *x, float dx, __m512 acc)
{
	uint32_t dd = (uint32_t)*(const uint16_t *)a | (uint32_t)*(const uint16_t *)b << 16;
	__m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));
	const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
	__m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f)), _mm512_set1_ps(dx));
	__m512i s = _mm512_dpbusd_epi32(_mm512_broadcast_i64x4(x->corr), go_w_q4_0(a, b),
					_mm512_broadcast_i64x4(x->x));
	return _mm512_fmadd_ps(_mm512_mul_ps(sc, go_sixteenth()), _mm512_cvtepi32_ps(s), acc);
}

/*
 * Scales of 8 blocks of rows A and B (pointers at block 0's scale):
 * lane j = d_A,j * d_x,j, lane 8 + j = d_B,j * d_x,j. Block j's scale is
 * word 9j of the 128 bytes from the pointer (the 8 blocks span 144).
 */
INLINE __m512 go_scales8(const char *a, const char *b, const float *dx)
{
	const __m512i ia = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
					    0, 0, 0, 0, 0, 0, 0, 0, 63, 54, 45, 36, 27, 18, 9, 0);
	const __m512i ib = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
					    63, 54, 45, 36, 27, 18, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0);
	__m512i ha = _mm512_permutex2var_epi16(_mm512_loadu_si512((const void *)a), ia,
					       _mm512_loadu_si512((const void *)(a + 64)));
	__m512i hb = _mm512_permutex2var_epi16(_mm512_loadu_si512((const void *)b), ib,
					       _mm512_loadu_si512((const void *)(b + 64)));
	__m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_mask_blend_epi16(0xFF00, ha, hb)));
	return _mm512_mul_ps(d, _mm512_broadcast_f32x8(_mm256_loadu_ps(dx)));
}

/*
 * One group of 2 * GO_PAIRS rows (pairs a[p]/b[p]) over nb blocks into
 * y[2p] and y[2p + 1]. Blocks go 8 at a time: the 8 blocks' scales of a
 * pair are gathered into one vector (go_scales8), and each block's
 * [A x8 | B x8] scale vector, with the high-nibble lanes divided by 16, is
 * one VPERMT2PS from it. nx[0..2 * GO_PAIRS) are the next group's rows,
 * whose first pl lines are prefetched meanwhile (pl = 0: none).
 */
INLINE void go_pass_q4_0(size_t nb, const char *const *a, const char *const *b, const char *const *nx,
			 size_t pl, const struct xr *xp, const float *dx, float *y)
{
	enum { BSZ = sizeof(struct nf_block_q4_0), P = GO_PAIRS, R = 2 * GO_PAIRS };
	__m512 acc[P];
	for (int p = 0; p < P; p++)
		acc[p] = _mm512_setzero_ps();
	size_t i = 0;
	for (; i + 8 <= nb; i += 8) {
		size_t o = i * BSZ;
		__m512 sv[P], tv[P];
#pragma GCC unroll 8
		for (int p = 0; p < P; p++) {
			sv[p] = go_scales8(a[p] + o, b[p] + o, dx + i);
			tv[p] = _mm512_mul_ps(sv[p], _mm512_set1_ps(0.0625f));
		}
		/* 2.25 lines per row per 8 blocks: prefetch 3 of the next group */
		if (i / 8 * 3 < pl) {
			for (size_t l = i / 8 * 3; l < i / 8 * 3 + 3 && l < pl; l++)
#pragma GCC unroll 16
				for (int q = 0; q < R; q++)
					_mm_prefetch(nx[q] + 64 * l, _MM_HINT_T0);
		}
#pragma GCC unroll 8
		for (int k = 0; k < 8; k++) {
			const struct xr *x = xp + i + k;
			__m512i xv = _mm512_broadcast_i64x4(x->x);
			__m512i cv = _mm512_broadcast_i64x4(x->corr);
			const __m512i idx = _mm512_add_epi32(
				_mm512_set_epi32(24, 24, 24, 24, 8, 8, 8, 8, 16, 16, 16, 16, 0, 0, 0, 0),
				_mm512_set1_epi32(k));
			size_t ok = o + (size_t)k * BSZ;
#pragma GCC unroll 8
			for (int p = 0; p < P; p++) {
				__m512 sc = _mm512_permutex2var_ps(sv[p], idx, tv[p]);
				__m512i d = _mm512_dpbusd_epi32(cv, go_w_q4_0(a[p] + ok, b[p] + ok), xv);
				acc[p] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(d), acc[p]);
			}
		}
	}
	for (; i < nb; i++)
		for (int p = 0; p < P; p++)
			acc[p] = go_step_q4_0(a[p] + i * BSZ, b[p] + i * BSZ, xp + i, dx[i], acc[p]);
	for (int p = 0; p < P; p++) {
		y[2 * p] = xr_hsum8(_mm512_castps512_ps256(acc[p]));
		y[2 * p + 1] = xr_hsum8(_mm512_extractf32x8_ps(acc[p], 1));
	}
}

/* Rows a0 and b0 (b0 == a0 for a lone row) block by block into y0, y1. */
static void go_pair_q4_0(size_t nb, const char *a0, const char *b0, const struct xr *xp, const float *dx,
			 float *y0, float *y1)
{
	__m512 acc0 = _mm512_setzero_ps();
	for (size_t i = 0; i < nb; i++)
		acc0 = go_step_q4_0(a0 + i * sizeof(struct nf_block_q4_0), b0 + i * sizeof(struct nf_block_q4_0),
				    xp + i, dx[i], acc0);
	*y0 = xr_hsum8(_mm512_castps512_ps256(acc0));
	if (y1)
		*y1 = xr_hsum8(_mm512_extractf32x8_ps(acc0, 1));
}

/* y = W x for Q4_0, see the section comment: groups of 2 * GO_PAIRS rows,
 * the last one or two rows as one pair. */
static void go_gemv_q4_0(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq,
			 float *y)
{
	enum { BSZ = sizeof(struct nf_block_q4_0) };
	size_t nb = n / NF_QK, len = nb * BSZ;
	if (nb > GO_MAX_BLOCKS || nrows < 2) {
		nf_kavx2_gemv_q4_0l(n, nrows, w, row_bytes, xq, y);
		return;
	}
	struct xr xp[GO_MAX_BLOCKS];
	float dx[GO_MAX_BLOCKS];
	xr_pack(xq, nb, go_shift(), xp, dx);
	const char *wc = w;
	size_t r = 0;
	enum { P = GO_PAIRS, R = 2 * GO_PAIRS };
	for (; r + R <= nrows; r += R) {
		const char *a[P], *b[P], *nx[R];
		for (int p = 0; p < P; p++) {
			a[p] = wc + (r + 2 * p) * row_bytes;
			b[p] = a[p] + row_bytes;
		}
		for (int q = 0; q < R; q++)
			nx[q] = wc + (r + R + q) * row_bytes;
		go_pass_q4_0(nb, a, b, nx, r + 2 * R <= nrows ? (len + 63) / 64 : 0, xp, dx, y + r);
	}
	for (; r < nrows; r += 2) {
		/* the last one or two rows: a lone row pairs with itself */
		const char *a0 = wc + r * row_bytes;
		bool two = r + 1 < nrows;
		go_pair_q4_0(nb, a0, two ? a0 + row_bytes : a0, xp, dx, y + r, two ? y + r + 1 : NULL);
	}
}

/* gemv_list for Q4_0: the same passes over rows at arbitrary addresses,
 * the next group's rows prefetched from the list. */
static void go_gemv_list_q4_0(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y)
{
	enum { BSZ = sizeof(struct nf_block_q4_0) };
	size_t nb = n / NF_QK, len = nb * BSZ;
	if (nb > GO_MAX_BLOCKS) {
		nf_kavx2_gemv_list_q4_0l(n, nrows, rows, xq, y);
		return;
	}
	struct xr xp[GO_MAX_BLOCKS];
	float dx[GO_MAX_BLOCKS];
	xr_pack(xq, nb, go_shift(), xp, dx);
	size_t r = 0;
	enum { P = GO_PAIRS, R = 2 * GO_PAIRS };
	for (; r + R <= nrows; r += R) {
		const char *a[P], *b[P], *nx[R];
		for (int p = 0; p < P; p++) {
			a[p] = rows[r + 2 * p];
			b[p] = rows[r + 2 * p + 1];
		}
		bool next = r + 2 * R <= nrows;
		for (int q = 0; q < R; q++)
			nx[q] = next ? rows[r + R + q] : NULL;
		go_pass_q4_0(nb, a, b, nx, next ? (len + 63) / 64 : 0, xp, dx, y + r);
	}
	for (; r < nrows; r += 2) {
		bool two = r + 1 < nrows;
		go_pair_q4_0(nb, rows[r], two ? rows[r + 1] : rows[r], xp, dx, y + r, two ? y + r + 1 : NULL);
	}
}

/* gemv_list for Q8_0: pairs of rows side by side (xr_tile_q8_0), each
 * row's chain in llama.cpp's order as the AVX2 gemv the table uses. */
static void xr_gemv_list_q8_0(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y)
{
	size_t nb = n / NF_QK;
	if (nb > GO_MAX_BLOCKS) {
		nf_kavx2_gemv_list_q8_0(n, nrows, rows, xq, y);
		return;
	}
	struct xr xp[GO_MAX_BLOCKS];
	float dx[GO_MAX_BLOCKS];
	xr_pack(xq, nb, _mm256_set1_epi32(XR_SHIFT_q8_0), xp, dx);
	const struct xr *xb[1] = { xp };
	const float *dxb[1] = { dx };
	size_t r = 0;
	for (; r + 4 <= nrows; r += 4)
		xr_tile_q8_0(2, 1, nb, (const char *const *)(rows + r), xb, dxb, y + r);
	for (; r < nrows; r += 2) {
		const char *wr[2] = { rows[r], r + 1 < nrows ? rows[r + 1] : rows[r] };
		float o[2];
		xr_tile_q8_0(1, 1, nb, wr, xb, dxb, o);
		y[r] = o[0];
		if (r + 1 < nrows)
			y[r + 1] = o[1];
	}
}

/* ---- float weights -------------------------------------------------------------- */

INLINE __m512 ld16_f32(const void *p, size_t i) { return _mm512_loadu_ps((const float *)p + i); }
INLINE __m512 ld16_f16(const void *p, size_t i)
{
	return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
}
INLINE __m512 ld16_bf16(const void *p, size_t i)
{
	__m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
	return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
INLINE float el_f32(const void *p, size_t i) { return ((const float *)p)[i]; }
INLINE float el_f16(const void *p, size_t i) { return _cvtsh_ss(((const uint16_t *)p)[i]); }
INLINE float el_bf16(const void *p, size_t i) { return nf_bf16_to_fp32(((const uint16_t *)p)[i]); }

#define FTILE512(T)                                                                           \
	INLINE void ftile_##T(const int R, const int B, size_t n, const char *const *wr,     \
			      const char *const *xb, float *out)                              \
	{                                                                                     \
		__m512 acc[4][4];                                                             \
		for (int r = 0; r < R; r++)                                                   \
			for (int b = 0; b < B; b++)                                           \
				acc[r][b] = _mm512_setzero_ps();                              \
		size_t i = 0;                                                                 \
		for (; i + 16 <= n; i += 16) {                                                \
			__m512 wv[4];                                                         \
			_Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                   \
				wv[r] = ld16_##T(wr[r], i);                                   \
			_Pragma("GCC unroll 4") for (int b = 0; b < B; b++) {                 \
				__m512 xv = ld16_##T(xb[b], i);                               \
				_Pragma("GCC unroll 4") for (int r = 0; r < R; r++)           \
					acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);    \
			}                                                                     \
		}                                                                             \
		for (int r = 0; r < R; r++)                                                   \
			for (int b = 0; b < B; b++) {                                         \
				float s = _mm512_reduce_add_ps(acc[r][b]);                    \
				for (size_t k = i; k < n; k++)                                \
					s += el_##T(wr[r], k) * el_##T(xb[b], k);             \
				out[r * B + b] = s;                                           \
			}                                                                     \
	}
#define FKERNELS(T, ESIZE) FTILE512(T) FREST512(T)
/* gemv and gemv_list take the gemm tile's order (one 16-lane chain per row,
 * reduced with _mm512_reduce_add_ps, then the tail), four rows' chains side
 * by side: a row's result has the same bits whether it was computed for
 * one token or in a batch (a decode step of several sequences gives each
 * the logits it gets alone). */
#define FREST512(T)                                                                           \
	static float fdot_##T(size_t n, const void *w, const void *x)                         \
	{                                                                                     \
		const char *wr[1] = { w }, *xb[1] = { x };                                    \
		float out[1];                                                                 \
		ftile_##T(1, 1, n, wr, xb, out);                                              \
		return out[0];                                                                \
	}                                                                                     \
	static void gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			     const void *xq, float *y)                                        \
	{                                                                                     \
		const char *xb[1] = { xq }, *wr[4];                                           \
		size_t r = 0;                                                                 \
		for (; r + 4 <= nrows; r += 4) {                                              \
			for (int k = 0; k < 4; k++)                                           \
				wr[k] = (const char *)w + (r + k) * row_bytes;                \
			ftile_##T(4, 1, n, wr, xb, y + r);                                    \
		}                                                                             \
		for (; r < nrows; r++)                                                        \
			y[r] = fdot_##T(n, (const char *)w + r * row_bytes, xq);              \
	}                                                                                     \
	static void gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			     size_t nbat, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                     \
		const char *wc = w, *xc = xq;                                                 \
		for (size_t r0 = 0; r0 < nrows; r0 += GEMM_ROW_BLOCK) {                       \
			size_t r1 = r0 + GEMM_ROW_BLOCK < nrows ? r0 + GEMM_ROW_BLOCK : nrows;  \
			for (size_t b0 = 0; b0 < nbat; b0 += 4) {                             \
				size_t bn = nbat - b0 < 4 ? nbat - b0 : 4;                    \
				const char *xb[4];                                            \
				for (size_t j = 0; j < bn; j++)                               \
					xb[j] = xc + (b0 + j) * xq_stride;                    \
				size_t r = r0;                                                \
				const char *wr[4];                                            \
				float out[16];                                                \
				for (; r + 4 <= r1 && bn == 4; r += 4) {                      \
					for (int k = 0; k < 4; k++)                           \
						wr[k] = wc + (r + k) * row_bytes;             \
					ftile_##T(4, 4, n, wr, xb, out);                      \
					for (int k = 0; k < 4; k++)                           \
						for (int j = 0; j < 4; j++)                   \
							y[(b0 + j) * ldy + r + k] = out[k * 4 + j]; \
				}                                                             \
				for (; r < r1; r++) {                                         \
					wr[0] = wc + r * row_bytes;                           \
					for (size_t j = 0; j < bn; j++) {                     \
						ftile_##T(1, 1, n, wr, xb + j, out);          \
						y[(b0 + j) * ldy + r] = out[0];               \
					}                                                     \
				}                                                             \
			}                                                                     \
		}                                                                             \
	}

FKERNELS(f32, 4)
FKERNELS(bf16, 2)
FTILE512(f16)

/*
 * F16 in llama.cpp's order (kernels_ref.c, nf_kref_dot_f16): for rows of a
 * multiple of 16, one 16-lane fma chain per row, reduced as
 * _mm512_reduce_add_ps; other lengths take the reference. gemv runs four
 * rows' chains side by side so the fma latency does not bound it.
 */
static void gemv_f16(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq,
		     float *y)
{
	const char *wc = w;
	size_t r = 0;
	if (n % 16) {
		for (; r < nrows; r++)
			y[r] = nf_kref_dot_f16(n, wc + r * row_bytes, xq);
		return;
	}
	for (; r + 4 <= nrows; r += 4) {
		const char *w0 = wc + r * row_bytes, *w1 = w0 + row_bytes;
		const char *w2 = w1 + row_bytes, *w3 = w2 + row_bytes;
		__m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
		for (size_t i = 0; i < n; i += 16) {
			__m512 xv = ld16_f16(xq, i);
			a0 = _mm512_fmadd_ps(ld16_f16(w0, i), xv, a0);
			a1 = _mm512_fmadd_ps(ld16_f16(w1, i), xv, a1);
			a2 = _mm512_fmadd_ps(ld16_f16(w2, i), xv, a2);
			a3 = _mm512_fmadd_ps(ld16_f16(w3, i), xv, a3);
		}
		y[r] = _mm512_reduce_add_ps(a0);
		y[r + 1] = _mm512_reduce_add_ps(a1);
		y[r + 2] = _mm512_reduce_add_ps(a2);
		y[r + 3] = _mm512_reduce_add_ps(a3);
	}
	for (; r < nrows; r++) {
		const char *w0 = wc + r * row_bytes;
		__m512 a0 = _mm512_setzero_ps();
		for (size_t i = 0; i < n; i += 16)
			a0 = _mm512_fmadd_ps(ld16_f16(w0, i), ld16_f16(xq, i), a0);
		y[r] = _mm512_reduce_add_ps(a0);
	}
}

/*
 * F16 in ggml_vec_dot_f16's order (kernels_ref.c, nf_kref_dot_f16v): four
 * 16-lane chains per row over 64-element steps, four rows side by side,
 * combined (0+2)+(1+3) and reduced as _mm512_reduce_add_ps, the tail's f32
 * products added in double. The eight chains are named registers: as an
 * array indexed in loops, GCC kept them on the stack (a store and a load
 * around every fma), which made this kernel several times slower.
 */
INLINE float f16v_finish(__m512 a0, __m512 a1, __m512 a2, __m512 a3, const void *w,
			 const void *xq, size_t np, size_t n)
{
	__m512 c = _mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3));
	double s = _mm512_reduce_add_ps(c);
	for (size_t i = np; i < n; i++)
		s += (double)(el_f16(w, i) * el_f16(xq, i));
	return (float)s;
}

/* one 64-element step of a row's four chains */
#define F16V_STEP(w, a0, a1, a2, a3)                                   \
	do {                                                           \
		a0 = _mm512_fmadd_ps(ld16_f16(w, i), x0, a0);          \
		a1 = _mm512_fmadd_ps(ld16_f16(w, i + 16), x1, a1);     \
		a2 = _mm512_fmadd_ps(ld16_f16(w, i + 32), x2, a2);     \
		a3 = _mm512_fmadd_ps(ld16_f16(w, i + 48), x3, a3);     \
	} while (0)

static void gemv_f16v(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq,
		      float *y)
{
	const char *wc = w;
	size_t np = n & ~(size_t)63, r = 0;
	for (; r + 4 <= nrows; r += 4) {
		const char *w0 = wc + r * row_bytes, *w1 = w0 + row_bytes;
		const char *w2 = w1 + row_bytes, *w3 = w2 + row_bytes;
		__m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
		__m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
		__m512 d0 = a0, d1 = a0, d2 = a0, d3 = a0;
		for (size_t i = 0; i < np; i += 64) {
			__m512 x0 = ld16_f16(xq, i), x1 = ld16_f16(xq, i + 16);
			__m512 x2 = ld16_f16(xq, i + 32), x3 = ld16_f16(xq, i + 48);
			F16V_STEP(w0, a0, a1, a2, a3);
			F16V_STEP(w1, b0, b1, b2, b3);
			F16V_STEP(w2, c0, c1, c2, c3);
			F16V_STEP(w3, d0, d1, d2, d3);
		}
		y[r] = f16v_finish(a0, a1, a2, a3, w0, xq, np, n);
		y[r + 1] = f16v_finish(b0, b1, b2, b3, w1, xq, np, n);
		y[r + 2] = f16v_finish(c0, c1, c2, c3, w2, xq, np, n);
		y[r + 3] = f16v_finish(d0, d1, d2, d3, w3, xq, np, n);
	}
	for (; r < nrows; r++) {
		const char *w0 = wc + r * row_bytes;
		__m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
		for (size_t i = 0; i < np; i += 64) {
			__m512 x0 = ld16_f16(xq, i), x1 = ld16_f16(xq, i + 16);
			__m512 x2 = ld16_f16(xq, i + 32), x3 = ld16_f16(xq, i + 48);
			F16V_STEP(w0, a0, a1, a2, a3);
		}
		y[r] = f16v_finish(a0, a1, a2, a3, w0, xq, np, n);
	}
}
#undef F16V_STEP

static void gemm_f16v(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nbat,
		      const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	for (size_t b = 0; b < nbat; b++)
		gemv_f16v(n, nrows, w, row_bytes, (const char *)xq + b * xq_stride, y + b * ldy);
}

/* ftile_f16 keeps one 16-lane chain per (row, token): the same order. */
static void gemm_f16(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nbat,
		     const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	if (n % 16) {
		nf_kernels_table_ref.gemm[NF_KT_F16](n, nrows, w, row_bytes, nbat, xq, xq_stride, y, ldy);
		return;
	}
	const char *wc = w, *xc = xq;
	for (size_t r0 = 0; r0 < nrows; r0 += GEMM_ROW_BLOCK) {
		size_t r1 = r0 + GEMM_ROW_BLOCK < nrows ? r0 + GEMM_ROW_BLOCK : nrows;
		for (size_t b0 = 0; b0 < nbat; b0 += 4) {
			size_t bn = nbat - b0 < 4 ? nbat - b0 : 4;
			const char *xb[4], *wr[4];
			float out[16];
			for (size_t j = 0; j < bn; j++)
				xb[j] = xc + (b0 + j) * xq_stride;
			size_t r = r0;
			for (; r + 4 <= r1 && bn == 4; r += 4) {
				for (int k = 0; k < 4; k++)
					wr[k] = wc + (r + k) * row_bytes;
				ftile_f16(4, 4, n, wr, xb, out);
				for (int k = 0; k < 4; k++)
					for (int j = 0; j < 4; j++)
						y[(b0 + j) * ldy + r + k] = out[k * 4 + j];
			}
			for (; r < r1; r++)
				for (size_t j = 0; j < bn; j++)
					gemv_f16(n, 1, wc + r * row_bytes, row_bytes, xb[j], y + (b0 + j) * ldy + r);
		}
	}
}

/* ---- quantized axpy ------------------------------------------------------------- */

/*
 * axpy_list: columns in slices of LIST_COLS; per block of 32 outputs the
 * two 16-float registers stay loaded while each column of the slice adds
 * fma(a, w, y) in column order, per element the chain axpy column by column
 * gives. Q4_0 weights come from a 16-entry table (k - 8) * d (exact) that
 * VPERMPS indexes with the nibble, without masking: it reads the index's
 * low 4 bits only.
 */
#define LIST_COLS 8
#define LIST_PREFETCH 256   /* bytes ahead in each column */

/* A block's 32 weights as exact floats in output order, two halves. */
INLINE void list_q4(const struct nf_block_q4_0 *b, __m512 *w0, __m512 *w1)
{
	const __m512 base = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
	__m512 tbl = _mm512_mul_ps(base, _mm512_set1_ps(_cvtsh_ss(b->d)));
	__m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b->qs));
	*w0 = _mm512_permutexvar_ps(q, tbl);
	*w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tbl);
}

INLINE void list_q8(const struct nf_block_q8_0 *b, __m512 *w0, __m512 *w1)
{
	__m512 d = _mm512_set1_ps(_cvtsh_ss(b->d));
	__m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->qs));
	__m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + 16)));
	*w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
	*w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
}

#define QAXPY_LIST512(T, WBLOCK)                                                                  \
	static void axpy_list_##T(size_t n, size_t ncols, const float *a, const void *const *cols, \
				  float *y)                                                      \
	{                                                                                        \
		size_t nb = n / NF_QK;                                                           \
		for (size_t c0 = 0; c0 < ncols; c0 += LIST_COLS) {                               \
			size_t cn = ncols - c0 < LIST_COLS ? ncols - c0 : LIST_COLS;             \
			const WBLOCK *cb[LIST_COLS];                                             \
			for (size_t c = 0; c < cn; c++)                                          \
				cb[c] = cols[c0 + c];                                            \
			for (size_t i = 0; i < nb; i++) {                                        \
				float *op = y + i * NF_QK;                                       \
				__m512 o0 = _mm512_loadu_ps(op), o1 = _mm512_loadu_ps(op + 16);  \
				for (size_t c = 0; c < cn; c++) {                                \
					const WBLOCK *b = cb[c] + i;                             \
					__m512 w0, w1, av = _mm512_set1_ps(a[c0 + c]);           \
					_mm_prefetch((const char *)b + LIST_PREFETCH, _MM_HINT_T0); \
					list_##T(b, &w0, &w1);                                   \
					o0 = _mm512_fmadd_ps(av, w0, o0);                        \
					o1 = _mm512_fmadd_ps(av, w1, o1);                        \
				}                                                                \
				_mm512_storeu_ps(op, o0);                                        \
				_mm512_storeu_ps(op + 16, o1);                                   \
			}                                                                        \
		}                                                                                \
	}
QAXPY_LIST512(q4, struct nf_block_q4_0)
QAXPY_LIST512(q8, struct nf_block_q8_0)

/* Float gemv over a list: row by row through the table's gemv. */
#define FLIST512(T)                                                                          \
	static void gemv_list_##T(size_t n, size_t nrows, const void *const *rows,          \
				  const void *xq, float *y)                                  \
	{                                                                                    \
		for (size_t r = 0; r < nrows; r++)                                           \
			gemv_##T(n, 1, rows[r], 0, xq, y + r);                               \
	}
FLIST512(f32)
FLIST512(f16)
FLIST512(f16v)
FLIST512(bf16)

/* y += a * w with w = (q - 8) * d exact in f32: one fma per element, as the
 * reference. */
static void axpy_q4(size_t n, float a, const void *wrow, float *y)
{
	const struct nf_block_q4_0 *b = wrow;
	const __m512 av = _mm512_set1_ps(a);
	const __m512i m4 = _mm512_set1_epi32(0x0f), eight = _mm512_set1_epi32(8);
	for (size_t i = 0; i < n / NF_QK; i++) {
		__m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
		__m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b[i].qs));
		__m512i lo = _mm512_sub_epi32(_mm512_and_si512(q, m4), eight);
		__m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
		float *o = y + i * NF_QK;
		__m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
		__m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
		_mm512_storeu_ps(o, _mm512_fmadd_ps(av, w0, _mm512_loadu_ps(o)));
		_mm512_storeu_ps(o + 16, _mm512_fmadd_ps(av, w1, _mm512_loadu_ps(o + 16)));
	}
}

static void axpy_q8(size_t n, float a, const void *wrow, float *y)
{
	const struct nf_block_q8_0 *b = wrow;
	const __m512 av = _mm512_set1_ps(a);
	for (size_t i = 0; i < n / NF_QK; i++) {
		__m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
		__m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b[i].qs));
		__m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b[i].qs + 16)));
		float *o = y + i * NF_QK;
		__m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
		__m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
		_mm512_storeu_ps(o, _mm512_fmadd_ps(av, w0, _mm512_loadu_ps(o)));
		_mm512_storeu_ps(o + 16, _mm512_fmadd_ps(av, w1, _mm512_loadu_ps(o + 16)));
	}
}

/*
 * The table, twice: "avx512" runs NF_KT_Q4_0's group gemv two groups per
 * 512-bit register (two streams), "avx512-256" one group per 256-bit
 * register (one stream), for cores that split every 512-bit operation in
 * two (AMD Zen 4), where the one stream reads faster (docs/KERNELS.md
 * "One stream on Zen 4"). Every other entry is the same function, and both
 * give the reference's bits.
 */
#define NF_KAVX512_TABLE(NAME, Q4_0_GEMV_X8)                                                               \
{                                                                                                          \
	.isa = NAME,                                                                                       \
	.act_prepare = {                                                                                   \
		[NF_KT_F32] = nf_kref_prepare_f32,                                                         \
		[NF_KT_F16] = nf_kavx2_prepare_f16,                                                        \
		[NF_KT_BF16] = nf_kavx2_prepare_bf16,                                                      \
		[NF_KT_Q8_0] = nf_kavx2_prepare_q8_0,                                                      \
		[NF_KT_Q4_0] = nf_kavx2_prepare_q8_0,                                                      \
		[NF_KT_Q4_0L] = nf_kavx2_prepare_q8_0,                                                     \
		[NF_KT_F16V] = nf_kavx2_prepare_f16,                                                       \
		NF_KAVX2_KQUANT_PREPARE,                                                                   \
		NF_KREF_LEGACY_PREPARE,                                                                   \
	},                                                                                                 \
	.gemv = {                                                                                          \
		[NF_KT_F32] = gemv_f32, [NF_KT_F16] = gemv_f16, [NF_KT_BF16] = gemv_bf16,                  \
		/* ggml's vec_dot order: see go_gemv_q4_0 */                                               \
		[NF_KT_Q8_0] = nf_kavx2_gemv_q8_0, [NF_KT_Q4_0L] = go_gemv_q4_0,                           \
		[NF_KT_Q4_0] = nf_kavx2_gemv_q4_0, [NF_KT_F16V] = gemv_f16v,                               \
		NF_KAVX2_KQUANT(gemv),                                                                     \
		NF_KREF_LEGACY(gemv),                                                                     \
	},                                                                                                 \
	.gemm = {                                                                                          \
		[NF_KT_F32] = gemm_f32, [NF_KT_F16] = gemm_f16, [NF_KT_BF16] = gemm_bf16,                  \
		[NF_KT_Q8_0] = xr_gemm_q8_0, [NF_KT_Q4_0L] = xr_gemm_q4_0,                                 \
		[NF_KT_Q4_0] = nf_kavx2_gemm_q4_0, [NF_KT_F16V] = gemm_f16v,                               \
		NF_KAVX2_KQUANT(gemm),                                                                     \
		NF_KREF_LEGACY(gemm),                                                                     \
	},                                                                                                 \
	.axpy = {                                                                                          \
		[NF_KT_F32] = nf_kavx2_axpy_f32, [NF_KT_F16] = nf_kavx2_axpy_f16,                          \
		[NF_KT_BF16] = nf_kavx2_axpy_bf16, [NF_KT_Q8_0] = axpy_q8,                                 \
		[NF_KT_Q4_0] = axpy_q4, [NF_KT_Q4_0L] = axpy_q4, [NF_KT_F16V] = nf_kavx2_axpy_f16,         \
		NF_KAVX2_KQUANT(axpy),                                                                     \
		NF_KREF_LEGACY(axpy),                                                                     \
	},                                                                                                 \
	.gemv_list = {                                                                                     \
		[NF_KT_F32] = gemv_list_f32, [NF_KT_F16] = gemv_list_f16, [NF_KT_BF16] = gemv_list_bf16,   \
		[NF_KT_Q8_0] = xr_gemv_list_q8_0, [NF_KT_Q4_0L] = go_gemv_list_q4_0,                       \
		[NF_KT_Q4_0] = nf_kavx2_gemv_list_q4_0, [NF_KT_F16V] = gemv_list_f16v,                     \
		NF_KAVX2_KQUANT(gemv_list),                                                                \
		NF_KREF_LEGACY(gemv_list),                                                                \
	},                                                                                                 \
	.axpy_list = {                                                                                     \
		[NF_KT_F32] = nf_kavx2_axpy_list_f32, [NF_KT_F16] = nf_kavx2_axpy_list_f16,                \
		[NF_KT_BF16] = nf_kavx2_axpy_list_bf16, [NF_KT_Q8_0] = axpy_list_q8,                       \
		[NF_KT_Q4_0] = axpy_list_q4, [NF_KT_Q4_0L] = axpy_list_q4,                                 \
		[NF_KT_F16V] = nf_kavx2_axpy_list_f16,                                                     \
		NF_KAVX2_KQUANT(axpy_list),                                                                \
		NF_KREF_LEGACY(axpy_list),                                                                \
	},                                                                                                 \
	.kcol_madd = nf_kavx2_kcol_madd,                                                                   \
	.qcol_down = { [NF_KT_Q8_0] = nf_kavx512_qcol_down_q8_0, [NF_KT_Q4_0] = nf_kavx512_qcol_down_q4_0, \
		       [NF_KT_Q4_0L] = nf_kavx512_qcol_down_q4_0 },                                        \
	/* 8-row groups: Q4_0 and Q8_0 two groups per register (Q4_0's gemv: the argument)                                            \
	 * (kernels_avx512_x8.c), the K-quants the AVX2 kernels */                                         \
	.gemv_x8 = { [NF_KT_Q4_0L] = nf_kavx512_gemv_x8_Q4_0,                                              \
		     [NF_KT_Q4_0] = Q4_0_GEMV_X8,                                                          \
		     [NF_KT_Q8_0] = nf_kavx512_gemv_x8_Q8_0,                                               \
		     NF_KAVX2_X8(gemv) },                                                                  \
	.gemm_x8 = { [NF_KT_Q4_0L] = nf_kavx512_gemm_x8_Q4_0,                                              \
		     [NF_KT_Q4_0] = nf_kavx512_gemm_x8_Q4_0c,                                              \
		     [NF_KT_Q8_0] = nf_kavx512_gemm_x8_Q8_0,                                               \
		     NF_KAVX2_X8(gemm) },                                                                  \
	.rmsnorm = nf_kavx2_rmsnorm,                                                                       \
	.softmax = nf_kavx2_softmax,                                                                       \
	.silu_mul = nf_kavx2_silu_mul,                                                                     \
	.relu_mul = nf_kref_relu_mul,                                                                      \
	.drelu_mul = nf_kref_drelu_mul,                                                                    \
	.dot_f32 = nf_kavx2_dot_f32v,                                                                      \
	.axpy_f32 = nf_kavx2_axpy_f32v,                                                                    \
}

const struct nf_kernels nf_kernels_table_avx512 = NF_KAVX512_TABLE("avx512", nf_kavx512_gemv_x8_Q4_0c);
const struct nf_kernels nf_kernels_table_avx512_256 =
	NF_KAVX512_TABLE("avx512-256", nf_kavx512_gemv_x8_Q4_0y);
