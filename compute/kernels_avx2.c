/*
 * kernels_avx2.c - the kernel table for AVX2 + FMA + F16C.
 *
 * Invariants:
 * 1. Prepared activations are bit-identical to the reference (same amax,
 *    same d = amax / 127 and id = 127 / amax, round to nearest even).
 * 2. Integer block sums are exact; only the order of the f32 sum over
 *    blocks and lanes differs from the reference.
 * 3. axpy computes y = fma(a, w, y) per element, bit-identical to the
 *    reference.
 * 4. Only this file is compiled with -mavx2 -mfma -mf16c, and kernels.c
 *    hands out its table only after cpuid confirmed all three.
 * 5. Nothing here allocates; scratch lives on the stack, bounded by
 *    GEMV_CHUNK.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels_impl.h"

/* Activation blocks whose scales (and Q4_0 corrections) are prepared per
 * gemv pass: 36 bytes of stack each. */
#define GEMV_CHUNK 512
/* Weight rows kept hot while every activation tile passes over them. */
#define GEMM_ROW_BLOCK 16

static inline float hsum8(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

static inline float h2f(uint16_t h)
{
	return _cvtsh_ss(h);
}

/* ---- activation preparation ---------------------------------------------- */

void nf_kavx2_prepare_q8_0(const float *x, void *xq, size_t n)
{
	struct nf_block_q8_0 *y = xq;
	const __m256 sign = _mm256_set1_ps(-0.0f);
	const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
	for (size_t b = 0; b < n / NF_QK; b++) {
		const float *v = x + b * NF_QK;
		__m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
		__m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
		__m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
					 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
		__m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
		m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
		m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
		float amax = _mm_cvtss_f32(m4);
		y[b].d = (uint16_t)_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
		__m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
		const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
		__m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), rnd));
		__m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), rnd));
		__m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), rnd));
		__m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), rnd));
		__m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
		_mm256_storeu_si256((__m256i *)y[b].qs, _mm256_permutevar8x32_epi32(p, perm));
	}
}

void nf_kavx2_prepare_f16(const float *x, void *xq, size_t n)
{
	uint16_t *h = xq;
	size_t i = 0;
	for (; i + 8 <= n; i += 8)
		_mm_storeu_si128((__m128i *)(h + i),
				 _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
	for (; i < n; i++)
		h[i] = nf_fp32_to_fp16(x[i]);
}

void nf_kavx2_prepare_bf16(const float *x, void *xq, size_t n)
{
	uint16_t *h = xq;
	size_t i = 0;
	const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
	const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
	const __m256i quiet = _mm256_set1_epi32(64);
	for (; i + 8 <= n; i += 8) {
		__m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
		__m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
		__m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
		__m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
		__m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
		r = _mm256_blendv_epi8(r, q, nan);
		__m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
		_mm_storeu_si128((__m128i *)(h + i), _mm256_castsi256_si128(p));
	}
	for (; i < n; i++)
		h[i] = nf_fp32_to_bf16(x[i]);
}

/* ---- integer block products ------------------------------------------------ */

/* The 32 weights of a Q4_0 block as signed bytes -8..7, in x's order. */
static inline __m256i q4_unpack(const uint8_t *qs)
{
	__m128i q = _mm_loadu_si128((const __m128i *)qs);
	__m256i v = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
	return _mm256_sub_epi8(_mm256_and_si256(v, _mm256_set1_epi8(0x0f)), _mm256_set1_epi8(8));
}

/* Eight int32 partial sums of w . x for signed bytes (|w| <= 127). */
static inline __m256i dot_i8(__m256i w, __m256i x)
{
	__m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
	return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* Activation scales of up to GEMV_CHUNK blocks as f32. */
static void x_scales(const struct nf_block_q8_0 *x, size_t nb, float *dx)
{
	for (size_t i = 0; i < nb; i++)
		dx[i] = h2f(x[i].d);
}

static float row_q8_0(const struct nf_block_q8_0 *w, const struct nf_block_q8_0 *x,
		      const float *dx, size_t nb)
{
	/* One accumulator, blocks in order: llama.cpp's order (kernels_ref.c). */
	__m256 acc = _mm256_setzero_ps();
	for (size_t i = 0; i < nb; i++) {
		__m256i s = dot_i8(_mm256_loadu_si256((const __m256i *)w[i].qs), _mm256_loadu_si256((const __m256i *)x[i].qs));
		acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w[i].d) * dx[i]), _mm256_cvtepi32_ps(s), acc);
	}
	return hsum8(acc);
}

/* Nibbles 0..15 in x's order (low nibbles, then high), unsigned. */
static inline __m256i q4_nibbles(const uint8_t *qs)
{
	__m128i q = _mm_loadu_si128((const __m128i *)qs);
	__m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
	return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

/* Per activation block: the 8 lane sums of 8 * x that turn
 * maddubs(nibbles, x) into the sum of (q - 8) * x. */
static void x_corr(const struct nf_block_q8_0 *x, size_t nb, __m256i *corr)
{
	const __m256i ones8 = _mm256_set1_epi8(8), ones16 = _mm256_set1_epi16(1);
	for (size_t i = 0; i < nb; i++) {
		__m256i xv = _mm256_loadu_si256((const __m256i *)x[i].qs);
		corr[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones16);
	}
}

static float row_q4_0(const struct nf_block_q4_0 *w, const struct nf_block_q8_0 *x,
		      const float *dx, const __m256i *corr, size_t nb)
{
	const __m256i ones16 = _mm256_set1_epi16(1);
	/* One accumulator, blocks in order: llama.cpp's order (kernels_ref.c). */
	__m256 acc = _mm256_setzero_ps();
#define Q4_BLOCK(i, acc)                                                                        \
	do {                                                                                    \
		__m256i p = _mm256_maddubs_epi16(q4_nibbles(w[i].qs),                           \
						 _mm256_loadu_si256((const __m256i *)x[i].qs)); \
		__m256i s = _mm256_sub_epi32(_mm256_madd_epi16(p, ones16), corr[i]);            \
		acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w[i].d) * dx[i]), _mm256_cvtepi32_ps(s), acc); \
	} while (0)
	for (size_t i = 0; i < nb; i++)
		Q4_BLOCK(i, acc);
#undef Q4_BLOCK
	return hsum8(acc);
}

static float row_q8_0_c(const struct nf_block_q8_0 *w, const struct nf_block_q8_0 *x,
			const float *dx, const __m256i *corr, size_t nb)
{
	(void)corr;
	return row_q8_0(w, x, dx, nb);
}

/* Scratch per pass: activation scales and, for Q4_0, lane corrections. */
#define QGEMV(T, WBLOCK, ROW, CORR)                                                        \
	void nf_kavx2_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,   \
			     const void *xq, float *y)                                     \
	{                                                                                  \
		const struct nf_block_q8_0 *x = xq;                                        \
		float dx[GEMV_CHUNK];                                                      \
		__m256i corr[CORR ? GEMV_CHUNK : 1];                                       \
		size_t nb = n / NF_QK;                                                     \
		for (size_t c = 0; c < nb; c += GEMV_CHUNK) {                              \
			size_t cn = nb - c < GEMV_CHUNK ? nb - c : GEMV_CHUNK;             \
			x_scales(x + c, cn, dx);                                           \
			if (CORR)                                                          \
				x_corr(x + c, cn, corr);                                   \
			for (size_t r = 0; r < nrows; r++) {                               \
				const WBLOCK *wr = (const WBLOCK *)((const char *)w + r * row_bytes) + c; \
				float s = ROW(wr, x + c, dx, corr, cn);                    \
				y[r] = c ? y[r] + s : s;                                   \
			}                                                                  \
		}                                                                          \
	}

QGEMV(q8_0, struct nf_block_q8_0, row_q8_0_c, 0)
QGEMV(q4_0l, struct nf_block_q4_0, row_q4_0, 1)
#define gemv_q8_0 nf_kavx2_gemv_q8_0
#define gemv_q4_0l nf_kavx2_gemv_q4_0l

/*
 * gemv over a list of rows: the activation scales (and Q4_0 corrections)
 * prepared once per call, rows taken two at a time with one accumulator
 * each, so the two fma chains overlap. Each row's chain is the one gemv
 * runs for it alone (same blocks, same order): the same bits. Rows longer
 * than GEMV_CHUNK blocks go through gemv row by row.
 */
#ifndef LIST_PF
#define LIST_PF 1
#endif
#define QLIST(T, WBLOCK, ROW, CORR)                                                            \
	void nf_kavx2_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,          \
				    const void *xq, float *y)                                  \
	{                                                                                      \
		const struct nf_block_q8_0 *x = xq;                                            \
		size_t nb = n / NF_QK;                                                         \
		if (nb > GEMV_CHUNK) {                                                         \
			for (size_t r = 0; r < nrows; r++)                                     \
				nf_kavx2_gemv_##T(n, 1, rows[r], 0, xq, y + r);                \
			return;                                                                \
		}                                                                              \
		float dx[GEMV_CHUNK];                                                          \
		__m256i corr[CORR ? GEMV_CHUNK : 1];                                           \
		x_scales(x, nb, dx);                                                           \
		if (CORR)                                                                      \
			x_corr(x, nb, corr);                                                   \
		size_t r = 0;                                                                  \
		for (; r + 2 <= nrows; r += 2) {                                               \
			const WBLOCK *w0 = rows[r], *w1 = rows[r + 1];                         \
			/* the next pair's rows into L1 while this pair runs */                \
			const char *p0 = r + 2 < nrows ? rows[r + 2] : (const char *)w0;       \
			const char *p1 = r + 3 < nrows ? rows[r + 3] : (const char *)w1;       \
			__m256 a0 = _mm256_setzero_ps(), a1 = a0;                              \
			for (size_t i = 0; i < nb; i++) {                                      \
				if (LIST_PF)                                                   \
					_mm_prefetch(p0 + i * sizeof(WBLOCK), _MM_HINT_T0),    \
						_mm_prefetch(p1 + i * sizeof(WBLOCK), _MM_HINT_T0); \
				a0 = ROW(w0 + i, x + i, dx[i], corr + (CORR ? i : 0), a0);     \
				a1 = ROW(w1 + i, x + i, dx[i], corr + (CORR ? i : 0), a1);     \
			}                                                                      \
			y[r] = hsum8(a0);                                                      \
			y[r + 1] = hsum8(a1);                                                  \
		}                                                                              \
		if (r < nrows) {                                                               \
			const WBLOCK *w0 = rows[r];                                            \
			__m256 a0 = _mm256_setzero_ps();                                       \
			for (size_t i = 0; i < nb; i++)                                        \
				a0 = ROW(w0 + i, x + i, dx[i], corr + (CORR ? i : 0), a0);     \
			y[r] = hsum8(a0);                                                      \
		}                                                                              \
	}

/* One block of a row's chain, as row_q4_0 / row_q8_0 compute it. */
static inline __m256 step_q4_0(const struct nf_block_q4_0 *w, const struct nf_block_q8_0 *x, float dx,
			       const __m256i *corr, __m256 acc)
{
	__m256i p = _mm256_maddubs_epi16(q4_nibbles(w->qs), _mm256_loadu_si256((const __m256i *)x->qs));
	__m256i s = _mm256_sub_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), *corr);
	return _mm256_fmadd_ps(_mm256_set1_ps(h2f(w->d) * dx), _mm256_cvtepi32_ps(s), acc);
}

static inline __m256 step_q8_0(const struct nf_block_q8_0 *w, const struct nf_block_q8_0 *x, float dx,
			       const __m256i *corr, __m256 acc)
{
	(void)corr;
	__m256i s = dot_i8(_mm256_loadu_si256((const __m256i *)w->qs), _mm256_loadu_si256((const __m256i *)x->qs));
	return _mm256_fmadd_ps(_mm256_set1_ps(h2f(w->d) * dx), _mm256_cvtepi32_ps(s), acc);
}

QLIST(q8_0, struct nf_block_q8_0, step_q8_0, 0)
QLIST(q4_0l, struct nf_block_q4_0, step_q4_0, 1)
#define gemv_list_q8_0 nf_kavx2_gemv_list_q8_0
#define gemv_list_q4_0l nf_kavx2_gemv_list_q4_0l

/*
 * gemm tile: 2 weight rows x 4 activation rows. Each weight block is
 * unpacked once for the four activations, each activation block loaded once
 * for the two rows. Edges fall back to the one-row dot.
 */
#define TILE_R 2
#define TILE_B 4

#define QGEMM(T, WBLOCK, UNPACK)                                                            \
	static void tile_##T(size_t n, const void *const wrows[TILE_R],                       \
			     const void *const xrows[TILE_B], float out[TILE_R][TILE_B])              \
	{                                                                                   \
		const WBLOCK *wr[TILE_R];                                                   \
		const struct nf_block_q8_0 *xb[TILE_B];                                     \
		for (int r = 0; r < TILE_R; r++)                                            \
			wr[r] = wrows[r];                                                     \
		for (int b = 0; b < TILE_B; b++)                                            \
			xb[b] = xrows[b];                                                     \
		size_t nb = n / NF_QK;                                                      \
		__m256 acc[TILE_R][TILE_B];                                                 \
		for (int r = 0; r < TILE_R; r++)                                            \
			for (int b = 0; b < TILE_B; b++)                                    \
				acc[r][b] = _mm256_setzero_ps();                            \
		for (size_t i = 0; i < nb; i++) {                                           \
			__m256i wv[TILE_R], wa[TILE_R];                                     \
			__m256 dw[TILE_R];                                                  \
			_Pragma("GCC unroll 2") for (int r = 0; r < TILE_R; r++) {          \
				wv[r] = UNPACK(wr[r] + i);                                  \
				wa[r] = _mm256_sign_epi8(wv[r], wv[r]);                     \
				dw[r] = _mm256_set1_ps(h2f(wr[r][i].d));                    \
			}                                                                   \
			_Pragma("GCC unroll 4") for (int b = 0; b < TILE_B; b++) {          \
				__m256i xv = _mm256_loadu_si256((const __m256i *)xb[b][i].qs); \
				__m256 dx = _mm256_set1_ps(h2f(xb[b][i].d));                \
				_Pragma("GCC unroll 2") for (int r = 0; r < TILE_R; r++) {  \
					__m256i p = _mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(xv, wv[r])); \
					__m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1))); \
					acc[r][b] = _mm256_fmadd_ps(_mm256_mul_ps(dw[r], dx), s, acc[r][b]); \
				}                                                           \
			}                                                                   \
		}                                                                           \
		for (int r = 0; r < TILE_R; r++)                                            \
			for (int b = 0; b < TILE_B; b++)                                    \
				out[r][b] = hsum8(acc[r][b]);                               \
	}

static inline __m256i q8_load(const struct nf_block_q8_0 *b)
{
	return _mm256_loadu_si256((const __m256i *)b->qs);
}

static inline __m256i q4_load(const struct nf_block_q4_0 *b)
{
	return q4_unpack(b->qs);
}

QGEMM(q8_0, struct nf_block_q8_0, q8_load)
QGEMM(q4_0l, struct nf_block_q4_0, q4_load)

/*
 * gemm over TILE_R x TILE_B register tiles (tile_##T) inside blocks of
 * GEMM_ROW_BLOCK weight rows that stay in cache while every activation tile
 * passes; rows and activations left over go through gemv_##T. Exported as
 * nf_kavx2_gemm_##T: the AVX-512 table reuses the quantized ones.
 */
#define GEMM_DRIVER(T)                                                                      \
	void nf_kavx2_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,    \
			       size_t nbat, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                   \
		const char *wc = w, *xc = xq;                                               \
		for (size_t r0 = 0; r0 < nrows; r0 += GEMM_ROW_BLOCK) {                     \
			size_t r1 = r0 + GEMM_ROW_BLOCK < nrows ? r0 + GEMM_ROW_BLOCK : nrows; \
			size_t b = 0;                                                       \
			for (; b + TILE_B <= nbat; b += TILE_B) {                           \
				const void *xb[TILE_B], *wr[TILE_R];                        \
				float out[TILE_R][TILE_B];                                  \
				for (int j = 0; j < TILE_B; j++)                            \
					xb[j] = xc + (b + j) * xq_stride;                   \
				size_t r = r0;                                              \
				for (; r + TILE_R <= r1; r += TILE_R) {                     \
					for (int k = 0; k < TILE_R; k++)                    \
						wr[k] = wc + (r + k) * row_bytes;           \
					tile_##T(n, wr, xb, out);                           \
					for (int k = 0; k < TILE_R; k++)                    \
						for (int j = 0; j < TILE_B; j++)            \
							y[(b + j) * ldy + r + k] = out[k][j]; \
				}                                                           \
				for (; r < r1; r++)                                         \
					for (int j = 0; j < TILE_B; j++)                    \
						gemv_##T(n, 1, wc + r * row_bytes, row_bytes, xb[j], \
							 y + (b + j) * ldy + r);            \
			}                                                                   \
			for (; b < nbat; b++)                                               \
				gemv_##T(n, r1 - r0, wc + r0 * row_bytes, row_bytes,        \
					 xc + b * xq_stride, y + b * ldy + r0);             \
		}                                                                           \
	}

GEMM_DRIVER(q8_0)
GEMM_DRIVER(q4_0l)
#define gemm_q8_0 nf_kavx2_gemm_q8_0
#define gemm_q4_0l nf_kavx2_gemm_q4_0l

/* ---- float weights ---------------------------------------------------------- */

static inline __m256 ld_f32(const void *p, size_t i) { return _mm256_loadu_ps((const float *)p + i); }
static inline __m256 ld_f16(const void *p, size_t i)
{
	return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
static inline __m256 ld_bf16(const void *p, size_t i)
{
	__m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
	return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float el_f32(const void *p, size_t i) { return ((const float *)p)[i]; }
static inline float el_f16(const void *p, size_t i) { return h2f(((const uint16_t *)p)[i]); }
static inline float el_bf16(const void *p, size_t i) { return nf_bf16_to_fp32(((const uint16_t *)p)[i]); }

#define FDOT(T) FDOT_DOT(T) FDOT_OPS(T)
/* F32/BF16 dots in the gemm tile's order (one 8-lane chain, hsum8, then
 * the tail), so a row's result has the same bits for one token as in a
 * batch; gemv runs four rows' chains side by side for the fma latency. */
#define FDOT_DOT(T)                                                                          \
	static inline __attribute__((always_inline)) void fdot4_##T(int R, size_t n,         \
								    const char *const *w,    \
								    const void *x, float *y) \
	{                                                                                    \
		__m256 a[4];                                                                 \
		for (int r = 0; r < R; r++)                                                  \
			a[r] = _mm256_setzero_ps();                                          \
		size_t i = 0;                                                                \
		for (; i + 8 <= n; i += 8) {                                                 \
			__m256 xv = ld_##T(x, i);                                            \
			_Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                  \
				a[r] = _mm256_fmadd_ps(ld_##T(w[r], i), xv, a[r]);           \
		}                                                                            \
		for (int r = 0; r < R; r++) {                                                \
			float s = hsum8(a[r]);                                               \
			for (size_t k = i; k < n; k++)                                       \
				s += el_##T(w[r], k) * el_##T(x, k);                         \
			y[r] = s;                                                            \
		}                                                                            \
	}                                                                                    \
	static float fdot_##T(size_t n, const void *w, const void *x)                        \
	{                                                                                    \
		const char *wr[1] = { w };                                                   \
		float y;                                                                     \
		fdot4_##T(1, n, wr, x, &y);                                                  \
		return y;                                                                    \
	}                                                                                    \
	static void gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,       \
			     const void *xq, float *y)                                       \
	{                                                                                    \
		size_t r = 0;                                                                \
		for (; r + 4 <= nrows; r += 4) {                                             \
			const char *wr[4];                                                   \
			for (int k = 0; k < 4; k++)                                          \
				wr[k] = (const char *)w + (r + k) * row_bytes;               \
			fdot4_##T(4, n, wr, xq, y + r);                                      \
		}                                                                            \
		for (; r < nrows; r++)                                                       \
			y[r] = fdot_##T(n, (const char *)w + r * row_bytes, xq);             \
	}
#define FDOT_OPS(T)                                                                          \
	FDOT_AXPY(T)
#define FDOT_F16_OPS(T)                                                                      \
	static void gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,       \
			     const void *xq, float *y)                                       \
	{                                                                                    \
		for (size_t r = 0; r < nrows; r++)                                           \
			y[r] = fdot_##T(n, (const char *)w + r * row_bytes, xq);             \
	}                                                                                    \
	FDOT_AXPY(T)
#define FDOT_AXPY(T)                                                                         \
	void nf_kavx2_axpy_##T(size_t n, float a, const void *wrow, float *y)               \
	{                                                                                    \
		__m256 av = _mm256_set1_ps(a);                                               \
		size_t i = 0;                                                                \
		for (; i + 8 <= n; i += 8)                                                   \
			_mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, ld_##T(wrow, i), _mm256_loadu_ps(y + i))); \
		for (; i < n; i++)                                                           \
			y[i] = fmaf(a, el_##T(wrow, i), y[i]);                               \
	}
/* TILE_R weight rows x TILE_B activations, one 8-lane chain each */
#define FTILE(T)                                                                             \
	static void tile_##T(size_t n, const void *const wr[TILE_R], const void *const xb[TILE_B], \
			     float out[TILE_R][TILE_B])                                      \
	{                                                                                    \
		__m256 acc[TILE_R][TILE_B];                                                  \
		for (int r = 0; r < TILE_R; r++)                                             \
			for (int b = 0; b < TILE_B; b++)                                     \
				acc[r][b] = _mm256_setzero_ps();                             \
		size_t i = 0;                                                                \
		for (; i + 8 <= n; i += 8) {                                                 \
			__m256 wv[TILE_R];                                                   \
			_Pragma("GCC unroll 2") for (int r = 0; r < TILE_R; r++)             \
				wv[r] = ld_##T(wr[r], i);                                    \
			_Pragma("GCC unroll 4") for (int b = 0; b < TILE_B; b++) {           \
				__m256 xv = ld_##T(xb[b], i);                                \
				_Pragma("GCC unroll 2") for (int r = 0; r < TILE_R; r++)     \
					acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);   \
			}                                                                    \
		}                                                                            \
		for (int r = 0; r < TILE_R; r++)                                             \
			for (int b = 0; b < TILE_B; b++) {                                   \
				float s = hsum8(acc[r][b]);                                  \
				for (size_t k = i; k < n; k++)                               \
					s += el_##T(wr[r], k) * el_##T(xb[b], k);            \
				out[r][b] = s;                                               \
			}                                                                    \
	}

FDOT(f32)
/* F16 in llama.cpp's order (kernels_ref.c, nf_kref_dot_f16): 16 lanes as two
 * 8-lane accumulators, lanes i and i+8 added first, then hsum8's tree. */
static float fdot_f16(size_t n, const void *w, const void *x)
{
	if (n % 16)
		return nf_kref_dot_f16(n, w, x);
	__m256 a0 = _mm256_setzero_ps(), a1 = a0;
	for (size_t i = 0; i < n; i += 16) {
		a0 = _mm256_fmadd_ps(ld_f16(w, i), ld_f16(x, i), a0);
		a1 = _mm256_fmadd_ps(ld_f16(w, i + 8), ld_f16(x, i + 8), a1);
	}
	return hsum8(_mm256_add_ps(a0, a1));
}
FDOT_F16_OPS(f16)

/* F16 in ggml_vec_dot_f16's order (kernels_ref.c, nf_kref_dot_f16v): its
 * four 16-lane chains as eight 8-lane ones (a[2j]: chain j's lanes 0-7,
 * a[2j + 1]: 8-15), combined per lane as the reference, reduced as
 * fdot_f16, the tail's f32 products added in double. */
static float fdot_f16v(size_t n, const void *w, const void *x)
{
	/* named registers, not an array: GCC kept an array on the stack */
	__m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
	size_t np = n & ~(size_t)63;
	for (size_t i = 0; i < np; i += 64) {
		a0 = _mm256_fmadd_ps(ld_f16(w, i), ld_f16(x, i), a0);
		a1 = _mm256_fmadd_ps(ld_f16(w, i + 8), ld_f16(x, i + 8), a1);
		a2 = _mm256_fmadd_ps(ld_f16(w, i + 16), ld_f16(x, i + 16), a2);
		a3 = _mm256_fmadd_ps(ld_f16(w, i + 24), ld_f16(x, i + 24), a3);
		a4 = _mm256_fmadd_ps(ld_f16(w, i + 32), ld_f16(x, i + 32), a4);
		a5 = _mm256_fmadd_ps(ld_f16(w, i + 40), ld_f16(x, i + 40), a5);
		a6 = _mm256_fmadd_ps(ld_f16(w, i + 48), ld_f16(x, i + 48), a6);
		a7 = _mm256_fmadd_ps(ld_f16(w, i + 56), ld_f16(x, i + 56), a7);
	}
	__m256 lo = _mm256_add_ps(_mm256_add_ps(a0, a4), _mm256_add_ps(a2, a6));
	__m256 hi = _mm256_add_ps(_mm256_add_ps(a1, a5), _mm256_add_ps(a3, a7));
	double s = hsum8(_mm256_add_ps(lo, hi));
	for (size_t i = np; i < n; i++)
		s += (double)(el_f16(w, i) * el_f16(x, i));
	return (float)s;
}
static void gemv_f16v(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq,
		      float *y)
{
	for (size_t r = 0; r < nrows; r++)
		y[r] = fdot_f16v(n, (const char *)w + r * row_bytes, xq);
}
FDOT(bf16)
FTILE(f32)
FTILE(bf16)
GEMM_DRIVER(f32)
GEMM_DRIVER(bf16)

/* F16 gemm row by row through fdot_f16, whose 16-lane order a tile of
 * 8-lane chains would not keep (kernels_ref.c, nf_kref_dot_f16). */
void nf_kavx2_gemm_f16(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nbat,
		       const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	for (size_t r0 = 0; r0 < nrows; r0 += GEMM_ROW_BLOCK) {
		size_t rn = nrows - r0 < GEMM_ROW_BLOCK ? nrows - r0 : GEMM_ROW_BLOCK;
		for (size_t b = 0; b < nbat; b++)
			gemv_f16(n, rn, (const char *)w + r0 * row_bytes, row_bytes,
				 (const char *)xq + b * xq_stride, y + b * ldy + r0);
	}
}
#define gemm_f32 nf_kavx2_gemm_f32
#define gemm_f16 nf_kavx2_gemm_f16
#define gemm_bf16 nf_kavx2_gemm_bf16

/* Float gemv over a list: row by row through the same dot gemv uses. */
#define FLIST(T)                                                                             \
	static void gemv_list_##T(size_t n, size_t nrows, const void *const *rows,          \
				  const void *xq, float *y)                                  \
	{                                                                                    \
		for (size_t r = 0; r < nrows; r++)                                           \
			y[r] = fdot_##T(n, rows[r], xq);                                     \
	}
FLIST(f32)
FLIST(f16)
FLIST(f16v)
FLIST(bf16)

/* F16V gemm column by column: the one-column order for each (a
 * PowerInfer model's products of several tokens) */
static void gemm_f16v(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nbat,
		      const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	for (size_t b = 0; b < nbat; b++)
		gemv_f16v(n, nrows, w, row_bytes, (const char *)xq + b * xq_stride, y + b * ldy);
}

/*
 * Float axpy over a list: columns in slices of LIST_COLS, each slice in one
 * pass over y (8 elements kept in a register while every column of the
 * slice is added in order); the tail elements one fma at a time in the same
 * order.
 */
#define LIST_COLS 8
#define FAXPY_LIST(T)                                                                        \
	void nf_kavx2_axpy_list_##T(size_t n, size_t ncols, const float *a,                 \
				    const void *const *cols, float *y)                       \
	{                                                                                    \
		for (size_t c0 = 0; c0 < ncols; c0 += LIST_COLS) {                           \
			size_t cn = ncols - c0 < LIST_COLS ? ncols - c0 : LIST_COLS;         \
			const void *const *cc = cols + c0;                                   \
			const float *ac = a + c0;                                            \
			size_t i = 0;                                                        \
			for (; i + 8 <= n; i += 8) {                                         \
				__m256 o = _mm256_loadu_ps(y + i);                           \
				for (size_t c = 0; c < cn; c++)                              \
					o = _mm256_fmadd_ps(_mm256_set1_ps(ac[c]), ld_##T(cc[c], i), o); \
				_mm256_storeu_ps(y + i, o);                                  \
			}                                                                    \
			for (; i < n; i++)                                                   \
				for (size_t c = 0; c < cn; c++)                              \
					y[i] = fmaf(ac[c], el_##T(cc[c], i), y[i]);          \
		}                                                                            \
	}
FAXPY_LIST(f32)
FAXPY_LIST(f16)
FAXPY_LIST(bf16)

/* ---- quantized axpy ----------------------------------------------------------- */

void nf_kavx2_axpy_q8_0(size_t n, float a, const void *wrow, float *y)
{
	const struct nf_block_q8_0 *b = wrow;
	__m256 av = _mm256_set1_ps(a);
	for (size_t i = 0; i < n / NF_QK; i++) {
		__m256 d = _mm256_set1_ps(h2f(b[i].d));
		float *o = y + i * NF_QK;
		for (int j = 0; j < NF_QK; j += 8) {
			__m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b[i].qs + j)));
			__m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
			_mm256_storeu_ps(o + j, _mm256_fmadd_ps(av, wv, _mm256_loadu_ps(o + j)));
		}
	}
}

void nf_kavx2_axpy_q4_0(size_t n, float a, const void *wrow, float *y)
{
	const struct nf_block_q4_0 *b = wrow;
	__m256 av = _mm256_set1_ps(a);
	for (size_t i = 0; i < n / NF_QK; i++) {
		__m256 d = _mm256_set1_ps(h2f(b[i].d));
		__m256i v = q4_unpack(b[i].qs);
		int8_t q[32];
		_mm256_storeu_si256((__m256i *)q, v);
		float *o = y + i * NF_QK;
		for (int j = 0; j < NF_QK; j += 8) {
			__m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
			__m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d);
			_mm256_storeu_ps(o + j, _mm256_fmadd_ps(av, wv, _mm256_loadu_ps(o + j)));
		}
	}
}

/*
 * Quantized axpy over a list: columns in slices of LIST_COLS; per block of
 * 32 outputs the four 8-float registers stay loaded while each column of
 * the slice adds fma(a, (q - 8) * d, y) (Q8_0: q * d), in column order:
 * per element the chain axpy column by column gives. Weights are exact in
 * f32, so the bits are those of the reference.
 */
#define LIST_PREFETCH 256   /* bytes ahead in each column */

static inline void list_fma4(__m256 av, __m256 d, __m128i b0, __m128i b1, __m128i b2, __m128i b3,
			     __m256 o[4])
{
	o[0] = _mm256_fmadd_ps(av, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0)), d), o[0]);
	o[1] = _mm256_fmadd_ps(av, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1)), d), o[1]);
	o[2] = _mm256_fmadd_ps(av, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b2)), d), o[2]);
	o[3] = _mm256_fmadd_ps(av, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b3)), d), o[3]);
}

/* A block's 32 weights as signed bytes in output order, two halves. */
static inline void list_q4_0(const struct nf_block_q4_0 *b, __m128i *q0, __m128i *q1)
{
	const __m128i m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
	__m128i q = _mm_loadu_si128((const __m128i *)b->qs);
	*q0 = _mm_sub_epi8(_mm_and_si128(q, m4), eight);
	*q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), eight);
}

static inline void list_q8_0(const struct nf_block_q8_0 *b, __m128i *q0, __m128i *q1)
{
	*q0 = _mm_loadu_si128((const __m128i *)b->qs);
	*q1 = _mm_loadu_si128((const __m128i *)(b->qs + 16));
}

#define QAXPY_LIST(T, WBLOCK)                                                                     \
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
				__m256 o[4] = { _mm256_loadu_ps(op), _mm256_loadu_ps(op + 8),    \
						_mm256_loadu_ps(op + 16), _mm256_loadu_ps(op + 24) }; \
				for (size_t c = 0; c < cn; c++) {                                \
					const WBLOCK *b = cb[c] + i;                             \
					__m128i q0, q1;                                          \
					_mm_prefetch((const char *)b + LIST_PREFETCH, _MM_HINT_T0); \
					list_##T(b, &q0, &q1);                                   \
					list_fma4(_mm256_set1_ps(a[c0 + c]), _mm256_set1_ps(h2f(b->d)), q0, \
						  _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8), o); \
				}                                                                \
				for (int k = 0; k < 4; k++)                                      \
					_mm256_storeu_ps(op + 8 * k, o[k]);                      \
			}                                                                        \
		}                                                                                \
	}
QAXPY_LIST(q4_0, struct nf_block_q4_0)
QAXPY_LIST(q8_0, struct nf_block_q8_0)

/* ---- vector ops ---------------------------------------------------------------- */

void nf_kavx2_axpy_f32v(size_t n, float a, const float *x, float *y)
{
	nf_kavx2_axpy_f32(n, a, x, y);
}

void nf_kavx2_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps)
{
	__m256d s0 = _mm256_setzero_pd(), s1 = s0;
	size_t i = 0;
	for (; i + 8 <= n; i += 8) {
		__m256 v = _mm256_loadu_ps(x + i);
		__m256 sq = _mm256_mul_ps(v, v);
		s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
		s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
	}
	double lanes[4];
	_mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
	double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
	for (; i < n; i++)
		sum += (double)(x[i] * x[i]);
	float mean = (float)(sum / (double)n);
	float scale = 1.0f / sqrtf(mean + eps);
	__m256 sv = _mm256_set1_ps(scale);
	for (i = 0; i + 8 <= n; i += 8) {
		__m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), sv);
		if (w)
			v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
		_mm256_storeu_ps(out + i, v);
	}
	for (; i < n; i++)
		out[i] = w ? (x[i] * scale) * w[i] : x[i] * scale;
}

/* ---- exp-based ops ----------------------------------------------------------- */

/*
 * ggml's AVX-512 expf on 8 lanes, step for step as nf_expf_ggml, so
 * the same bits. scalef(j, n) is j times 2^n's bits where every |n| <= 126
 * (2^n a normal float: one rounding, as scalef); a lane outside that (an
 * underflow, an overflow, a NaN) sends the 8 lanes to the C reference.
 */
static inline __m256 expf_ggml8(__m256 x)
{
	const __m256 r = _mm256_set1_ps(0x1.8p23f);
	__m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
	__m256 n = _mm256_sub_ps(z, r);
	__m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
				    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
	__m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
	if (_mm256_movemask_ps(_mm256_cmp_ps(an, _mm256_set1_ps(126.0f), _CMP_NLE_UQ))) {
		float v[8];
		_mm256_storeu_ps(v, x);
		for (int l = 0; l < 8; l++)
			v[l] = nf_expf_ggml(v[l]);
		return _mm256_loadu_ps(v);
	}
	__m256 u = _mm256_mul_ps(b, b);
	__m256 j = _mm256_fmadd_ps(
		_mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
				_mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
		u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.ffffecp-1f), b, _mm256_set1_ps(1.0f)));
	__m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
	return _mm256_mul_ps(j, _mm256_castsi256_ps(e));
}

/* nf_sum16 of the 16 values lo (0..7) and hi (8..15) */
static inline float sum16(__m256 lo, __m256 hi)
{
	__m256 t8 = _mm256_add_ps(lo, hi);
	__m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
	__m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
	return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

/* nf_kref_silu_mul's bits */
void nf_kavx2_silu_mul(float *g, const float *u, size_t n)
{
	const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
	size_t i = 0;
	for (; i + 16 <= n; i += 16)
		for (size_t h = i; h < i + 16; h += 8) {
			__m256 v = _mm256_loadu_ps(g + h);
			__m256 sv = _mm256_div_ps(v, _mm256_add_ps(one, expf_ggml8(_mm256_sub_ps(zero, v))));
			if (u)
				sv = _mm256_mul_ps(sv, _mm256_loadu_ps(u + h));
			_mm256_storeu_ps(g + h, sv);
		}
	if (i < n)
		nf_kref_silu_mul(g + i, u ? u + i : NULL, n - i);
}

/* nf_kref_softmax's bits */
void nf_kavx2_softmax(float *x, size_t n)
{
	if (!n)
		return;
	size_t i = 0;
	__m256 mv = _mm256_set1_ps(-INFINITY);
	for (; i + 8 <= n; i += 8)
		mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
	__m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
	m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
	m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
	float max = _mm_cvtss_f32(m4);
	for (; i < n; i++)
		max = fmaxf(max, x[i]);
	mv = _mm256_set1_ps(max);
	double sum = 0.0;
	for (i = 0; i + 16 <= n; i += 16) {
		__m256 lo = expf_ggml8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
		__m256 hi = expf_ggml8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv));
		_mm256_storeu_ps(x + i, lo);
		_mm256_storeu_ps(x + i + 8, hi);
		sum += (double)sum16(lo, hi);
	}
	for (; i < n; i++) {
		x[i] = expf(x[i] - max);
		sum += (double)x[i];
	}
	__m256 inv = _mm256_set1_ps((float)(1.0 / sum));
	for (i = 0; i + 8 <= n; i += 8)
		_mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
	for (; i < n; i++)
		x[i] *= _mm256_cvtss_f32(inv);
}

/* nf_kref_dot_f32's bits: the four 16-lane chains as eight 8-lane ones */
float nf_kavx2_dot_f32v(const float *a, const float *b, size_t n)
{
	size_t np = n & ~(size_t)63;
	float sum = 0.0f;
	if (np) {
		__m256 acc[8];
		for (int j = 0; j < 8; j++)
			acc[j] = _mm256_setzero_ps();
		for (size_t i = 0; i < np; i += 64)
			for (int j = 0; j < 8; j++)
				acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j),
							 acc[j]);
		__m256 lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
		__m256 hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
		sum = sum16(lo, hi);
	}
	for (size_t i = np; i < n; i++)
		sum += a[i] * b[i];
	return sum;
}

/* ---- Q4_0 in 8-row groups ------------------------------------------------------ */

/*
 * One register per lane: lane j of the reference's 8-lane chain for 8 rows
 * at once (row r in element r). Block i of a group is 4 loads of 32 bytes;
 * load m holds values 4m..4m+3 of every row in its low nibbles and values
 * 16+4m..16+4m+3 in its high nibbles, i.e. lanes m and m + 4. The
 * activation side of lane j is 4 bytes broadcast, the -8 correction of lane
 * j one int32 broadcast, the scales of the 8 rows one vector: per block and
 * 8 rows 54 vector ops against about 12 per row and block for a plain row,
 * and no shuffles. acc_j[r] = fma(d_w[r] * d_x, lane_j[r], acc_j[r]) is the
 * reference's chain, and ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) its hsum8,
 * element by element: the same bits.
 */
#define X8_CHUNK 256 /* activation blocks per table (36 bytes each, on the stack) */

struct x8_tab {
	int32_t corr[8]; /* 8 * sum of x over lane j's 4 values */
	float dx;
};

static void x8_table(const struct nf_block_q8_0 *x, size_t nb, struct x8_tab *t)
{
	const __m256i eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
	for (size_t i = 0; i < nb; i++) {
		__m256i xv = _mm256_loadu_si256((const __m256i *)x[i].qs);
		_mm256_storeu_si256((__m256i *)t[i].corr, _mm256_madd_epi16(_mm256_maddubs_epi16(eight, xv), ones));
		t[i].dx = h2f(x[i].d);
	}
}

static inline __m256i bcast4(const int8_t *p)
{
	int32_t v;
	memcpy(&v, p, sizeof(v));
	return _mm256_set1_epi32(v);
}

#define X8_BS(q8) ((q8) ? sizeof(struct nf_block_q8_0x8) : sizeof(struct nf_block_q4_0x8))

/* Lane registers j = 0..7 of one grouped block (Q4_0: nibbles, unsigned;
 * Q8_0: |w|, the sign going to the activation with vpsignb). */
static inline __attribute__((always_inline)) void x8_lanes(int q8, const unsigned char *qs, __m256i l[8])
{
	const __m256i m4 = _mm256_set1_epi8(0x0f);
	if (q8) {
		_Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
			l[j] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
		return;
	}
	_Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
		__m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * m));
		l[m] = _mm256_and_si256(p, m4);
		l[m + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
	}
}

/* Lane j's exact integer sums of the 8 rows against activation block x. */
static inline __attribute__((always_inline)) __m256i x8_dot(int q8, __m256i l, const unsigned char *qs, int j,
							    const struct nf_block_q8_0 *x, const struct x8_tab *t)
{
	const __m256i ones = _mm256_set1_epi16(1);
	__m256i xb = bcast4(x->qs + 4 * j);
	if (q8)
		return _mm256_madd_epi16(
			_mm256_maddubs_epi16(l, _mm256_sign_epi8(xb, _mm256_loadu_si256((const __m256i *)(qs + 32 * j)))),
			ones);
	__m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(l, xb), ones);
	return _mm256_sub_epi32(v, _mm256_set1_epi32(t->corr[j]));
}

/* acc[0..7] += blocks [0, nb) of one group against x (table t). Every
 * line of the block X8_PF bytes ahead is prefetched into L1: the 32-byte
 * loads at 144-byte (272-byte) strides straddle cache lines, and a
 * straddling load that misses is slow; the hardware prefetcher alone left
 * the gemv at 0.62-0.68 of the memory read on 2 threads (Q4_0), 0.86-0.88
 * with it (docs/KERNELS.md). */
#define X8_PF 2048

static inline __attribute__((always_inline)) void x8_blocks(int q8, const unsigned char *b,
							    const struct nf_block_q8_0 *x,
							    const struct x8_tab *t, size_t nb, __m256 acc[8])
{
	for (size_t i = 0; i < nb; i++, b += X8_BS(q8)) {
		for (size_t o = 0; o < X8_BS(q8); o += 64)
			_mm_prefetch((const char *)b + X8_PF + o, _MM_HINT_T0);
		_mm_prefetch((const char *)b + X8_PF + X8_BS(q8) - 1, _MM_HINT_T0);
		__m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)),
					 _mm256_broadcast_ss(&t[i].dx));
		__m256i l[8];
		x8_lanes(q8, b + 16, l);
		_Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
			acc[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(x8_dot(q8, l[j], b + 16, j, &x[i], &t[i])), acc[j]);
	}
}

static inline void x8_store(const __m256 a[8], float *y)
{
	__m256 t0 = _mm256_add_ps(a[0], a[4]), t1 = _mm256_add_ps(a[1], a[5]);
	__m256 t2 = _mm256_add_ps(a[2], a[6]), t3 = _mm256_add_ps(a[3], a[7]);
	_mm256_storeu_ps(y, _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3)));
}

/* y[8g..8g+7] for groups [g0, g1) against one activation row; the table is
 * made once when the row fits X8_CHUNK blocks, else per group and chunk. */
static inline __attribute__((always_inline)) void x8_groups(int q8, size_t nb, const unsigned char *w, size_t g0,
							    size_t g1, const struct nf_block_q8_0 *x, float *y)
{
	struct x8_tab t[X8_CHUNK];
	if (nb <= X8_CHUNK)
		x8_table(x, nb, t);
	for (size_t g = g0; g < g1; g++) {
		__m256 acc[8];
		for (int j = 0; j < 8; j++)
			acc[j] = _mm256_setzero_ps();
		for (size_t c = 0; c < nb; c += X8_CHUNK) {
			size_t cn = nb - c < X8_CHUNK ? nb - c : X8_CHUNK;
			if (nb > X8_CHUNK)
				x8_table(x + c, cn, t);
			x8_blocks(q8, w + (g * nb + c) * X8_BS(q8), x + c, t, cn, acc);
		}
		x8_store(acc, y + 8 * g);
	}
}

static void gemv_q4_0x8(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	x8_groups(0, n / NF_QK, w, 0, nrows / 8, xq, y);
}

static void gemv_q8_0x8(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	x8_groups(1, n / NF_QK, w, 0, nrows / 8, xq, y);
}

/*
 * gemm: a block of a group is unpacked once (its 8 lane registers stay in
 * registers) and used for X8_TOK activation rows, whose accumulators live
 * on the stack (a 32-byte load and store per lane and row, no ALU op): per
 * row, lane and block the 5 ops of the integer sum, conversion and fma,
 * instead of 6.75 with the unpacking per row. X8_GRP groups (64 rows, at
 * most 400 KB at 11008 values) stay in L2 while the activation tiles pass;
 * the activation tables are made per tile and X8_GCHUNK-block chunk.
 * Per accumulator the chain is still the reference's, block by block.
 */
#define X8_TOK 16
#define X8_GRP 8
#define X8_GCHUNK 64

static inline __attribute__((always_inline)) void
x8_gemm_tile(int q8, size_t nb, const unsigned char *w, size_t g0, size_t g1, const char *xq, size_t xq_stride,
	     size_t nt, float *y, size_t ldy)
{
	__m256 acc[X8_GRP][X8_TOK][8];
	struct x8_tab tab[X8_TOK][X8_GCHUNK];
	for (size_t g = g0; g < g1; g++)
		for (size_t t = 0; t < nt; t++)
			for (int j = 0; j < 8; j++)
				acc[g - g0][t][j] = _mm256_setzero_ps();
	for (size_t c = 0; c < nb; c += X8_GCHUNK) {
		size_t cn = nb - c < X8_GCHUNK ? nb - c : X8_GCHUNK;
		for (size_t t = 0; t < nt; t++)
			x8_table((const struct nf_block_q8_0 *)(xq + t * xq_stride) + c, cn, tab[t]);
		for (size_t g = g0; g < g1; g++) {
			const unsigned char *b = w + (g * nb + c) * X8_BS(q8);
			for (size_t i = 0; i < cn; i++, b += X8_BS(q8)) {
				__m256i l[8];
				x8_lanes(q8, b + 16, l);
				__m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
				for (size_t t = 0; t < nt; t++) {
					const struct nf_block_q8_0 *x =
						(const struct nf_block_q8_0 *)(xq + t * xq_stride) + c + i;
					__m256 s = _mm256_mul_ps(dw, _mm256_broadcast_ss(&tab[t][i].dx));
					__m256 *a = acc[g - g0][t];
					_Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
						a[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(x8_dot(q8, l[j], b + 16, j, x, &tab[t][i])),
								       a[j]);
				}
			}
		}
	}
	for (size_t g = g0; g < g1; g++)
		for (size_t t = 0; t < nt; t++)
			x8_store(acc[g - g0][t], y + t * ldy + 8 * g);
}

static inline __attribute__((always_inline)) void x8_gemm(int q8, size_t n, size_t nrows, const void *w,
							  size_t nbat, const void *xq, size_t xq_stride, float *y,
							  size_t ldy)
{
	size_t ng = nrows / 8;
	for (size_t g0 = 0; g0 < ng; g0 += X8_GRP) {
		size_t g1 = g0 + X8_GRP < ng ? g0 + X8_GRP : ng;
		for (size_t b = 0; b < nbat; b += X8_TOK)
			x8_gemm_tile(q8, n / NF_QK, w, g0, g1, (const char *)xq + b * xq_stride, xq_stride,
				     nbat - b < X8_TOK ? nbat - b : X8_TOK, y + b * ldy, ldy);
	}
}

static void gemm_q4_0x8(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			float *y, size_t ldy)
{
	x8_gemm(0, n, nrows, w, nbat, xq, xq_stride, y, ldy);
}

static void gemm_q8_0x8(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			float *y, size_t ldy)
{
	x8_gemm(1, n, nrows, w, nbat, xq, xq_stride, y, ldy);
}

/* ---- Q4_0 in llama.cpp's repacked order (NF_KT_Q4_0) ---------------------------
 *
 * Per row and block the exact integer sum s of the 32 products, then
 * acc = fma(s, d_w * d_x, acc), blocks in order (kernels_ref.c dot_q4_0).
 * The integer sum is maddubs(nibbles, x) - maddubs(8, x) in int16 (each
 * lane at most 2 * 15 * 127 + 2 * 8 * 127), widened by madd; eight rows go
 * together so the lane sums of the eight become one register (a transpose
 * by hadds, exact: qb_rows8), whose float chain is the eight rows' chains
 * side by side. In the 8-row groups the rows are the lanes already (as in
 * llama.cpp's own kernel): the eight 4-value slices of a block add up in
 * int16 (at most 8 * 2 * 15 * 127 = 30480), one madd gives each row's sum.
 */

/*
 * Eight rows (w[0..7], any addresses; repeat one for fewer) against nt
 * activation rows x[0..nt-1]: acc[t] lane r = row r . x[t] in the chain
 * above, blocks [0, nb); nx (or NULL): the eight rows to prefetch. Register k holds the block's 16 quant bytes of row
 * k in its low half and of row k + 4 in its high half; against the
 * activation's values 0-15 (low nibbles) and 16-31 (high nibbles), each
 * copied to both halves, madd leaves 4 partial sums per row, and three
 * hadds turn the four registers into the eight rows' sums in order.
 */
static inline __attribute__((always_inline)) void qb_rows8(int nt, size_t nb, const struct nf_block_q4_0 *const w[8],
							   const struct nf_block_q4_0 *const *nx,
							   const struct nf_block_q8_0 *const *x, __m256 *acc)
{
	const __m256i m4 = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
	for (size_t i = 0; i < nb; i++) {
		__m256i lo[4], hi[4];
		/* the next eight rows into L1 while these run, a line of each
		 * every 3 blocks (54 bytes) */
		if (nx && i % 3 == 0)
			_Pragma("GCC unroll 8") for (int k = 0; k < 8; k++)
				_mm_prefetch((const char *)(nx[k] + i), _MM_HINT_T0);
		_Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
			__m256i v = _mm256_inserti128_si256(
				_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)w[k][i].qs)),
				_mm_loadu_si128((const __m128i *)w[k + 4][i].qs), 1);
			lo[k] = _mm256_and_si256(v, m4);
			hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
		}
		__m128i h = _mm_setr_epi16((short)w[0][i].d, (short)w[1][i].d, (short)w[2][i].d, (short)w[3][i].d,
					   (short)w[4][i].d, (short)w[5][i].d, (short)w[6][i].d, (short)w[7][i].d);
		__m256 dw = _mm256_cvtph_ps(h);
		for (int t = 0; t < nt; t++) {
			__m256i xv = _mm256_loadu_si256((const __m256i *)x[t][i].qs);
			__m256i xl = _mm256_permute2x128_si256(xv, xv, 0x00), xh = _mm256_permute2x128_si256(xv, xv, 0x11);
			__m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(eight, xl), _mm256_maddubs_epi16(eight, xh));
			__m256i p[4];
			_Pragma("GCC unroll 4") for (int k = 0; k < 4; k++)
				p[k] = _mm256_madd_epi16(
					_mm256_sub_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[k], xl),
									  _mm256_maddubs_epi16(hi[k], xh)),
							 c),
					ones);
			__m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
			__m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(h2f(x[t][i].d)));
			acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, acc[t]);
		}
	}
}

/* Rows [r, r + 8) of a list, the last repeated past nrows. */
static inline void qb_pick(const void *const *rows, size_t r, size_t nrows, const struct nf_block_q4_0 *w[8])
{
	for (int k = 0; k < 8; k++)
		w[k] = rows[r + (size_t)k < nrows ? r + (size_t)k : nrows - 1];
}

static inline void qb_put(__m256 a, float *y, size_t m)
{
	if (m == 8) {
		_mm256_storeu_ps(y, a);
		return;
	}
	float t[8];
	_mm256_storeu_ps(t, a);
	memcpy(y, t, m * sizeof(float));
}

void nf_kavx2_gemv_list_q4_0(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	const struct nf_block_q4_0 *w[8], *nx[8];
	if (nrows)
		qb_pick(rows, 0, nrows, w);
	for (size_t r = 0; r < nrows; r += 8) {
		bool more = r + 8 < nrows;
		if (more)
			qb_pick(rows, r + 8, nrows, nx);
		__m256 acc = _mm256_setzero_ps();
		qb_rows8(1, n / NF_QK, w, more ? nx : NULL, &x, &acc);
		if (more)
			memcpy(w, nx, sizeof(w));
		qb_put(acc, y + r, nrows - r < 8 ? nrows - r : 8);
	}
}

/* Rows at a stride: the list form over a group's addresses. */
static inline void qb_stride(const void *w, size_t row_bytes, size_t r, size_t nrows, const struct nf_block_q4_0 *p[8])
{
	for (size_t k = 0; k < 8; k++)
		p[k] = (const void *)((const char *)w + (r + k < nrows ? r + k : nrows - 1) * row_bytes);
}

void nf_kavx2_gemv_q4_0(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	for (size_t r = 0; r < nrows; r += 8) {
		const struct nf_block_q4_0 *p[8], *nx[8];
		qb_stride(w, row_bytes, r, nrows, p);
		if (r + 8 < nrows)
			qb_stride(w, row_bytes, r + 8, nrows, nx);
		__m256 acc = _mm256_setzero_ps();
		qb_rows8(1, n / NF_QK, p, r + 8 < nrows ? nx : NULL, &x, &acc);
		qb_put(acc, y + r, nrows - r < 8 ? nrows - r : 8);
	}
}

/* gemm: eight rows unpacked once per block for four activation rows. */
void nf_kavx2_gemm_q4_0(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nbat, const void *xq,
			size_t xq_stride, float *y, size_t ldy)
{
	for (size_t r = 0; r < nrows; r += 8) {
		const struct nf_block_q4_0 *p[8];
		qb_stride(w, row_bytes, r, nrows, p);
		size_t m = nrows - r < 8 ? nrows - r : 8, b = 0;
		for (; b + 4 <= nbat; b += 4) {
			const struct nf_block_q8_0 *x[4];
			__m256 acc[4];
			for (int t = 0; t < 4; t++) {
				x[t] = (const void *)((const char *)xq + (b + t) * xq_stride);
				acc[t] = _mm256_setzero_ps();
			}
			qb_rows8(4, n / NF_QK, p, NULL, x, acc);
			for (int t = 0; t < 4; t++)
				qb_put(acc[t], y + (b + t) * ldy + r, m);
		}
		for (; b < nbat; b++) {
			const struct nf_block_q8_0 *x = (const void *)((const char *)xq + b * xq_stride);
			__m256 acc = _mm256_setzero_ps();
			qb_rows8(1, n / NF_QK, p, NULL, &x, &acc);
			qb_put(acc, y + b * ldy + r, m);
		}
	}
}

/* Per activation block: 8 * its sum, and its scale. */
struct qb_tab {
	int32_t corr;
	float dx;
};

/* The gemm makes these per tile, chunk and panel of rows (a tenth of a
 * Q4_0 prefill when the sum was a scalar loop): maddubs(8, x) gives 8 * the
 * pairs' sums in int16 (at most 2048 in magnitude), exact, as is the rest. */
static void qb_table(const struct nf_block_q8_0 *x, size_t nb, struct qb_tab *t)
{
	const __m256i eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
	for (size_t i = 0; i < nb; i++) {
		__m256i v = _mm256_madd_epi16(
			_mm256_maddubs_epi16(eight, _mm256_loadu_si256((const __m256i *)x[i].qs)), ones);
		__m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
		s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
		s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
		t[i].corr = _mm_cvtsi128_si32(s);
		t[i].dx = h2f(x[i].d);
	}
}

/* One grouped block's row sums against x (lanes = rows). */
static inline __attribute__((always_inline)) __m256i qb_x8_sum(const __m256i l[8], const struct nf_block_q8_0 *x,
							       int32_t corr)
{
	__m256i a = _mm256_maddubs_epi16(l[0], bcast4(x->qs));
	_Pragma("GCC unroll 8") for (int j = 1; j < 8; j++)
		a = _mm256_add_epi16(a, _mm256_maddubs_epi16(l[j], bcast4(x->qs + 4 * j)));
	return _mm256_sub_epi32(_mm256_madd_epi16(a, _mm256_set1_epi16(1)), _mm256_set1_epi32(corr));
}

static void gemv_q4_0x8b(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	size_t nb = n / NF_QK;
	struct qb_tab t[X8_CHUNK];
	if (nb <= X8_CHUNK)
		qb_table(x, nb, t);
	for (size_t g = 0; g < nrows / 8; g++) {
		__m256 acc = _mm256_setzero_ps();
		for (size_t c = 0; c < nb; c += X8_CHUNK) {
			size_t cn = nb - c < X8_CHUNK ? nb - c : X8_CHUNK;
			if (nb > X8_CHUNK)
				qb_table(x + c, cn, t);
			const unsigned char *b = (const unsigned char *)w + (g * nb + c) * sizeof(struct nf_block_q4_0x8);
			for (size_t i = 0; i < cn; i++, b += sizeof(struct nf_block_q4_0x8)) {
				for (size_t o = 0; o < sizeof(struct nf_block_q4_0x8); o += 64)
					_mm_prefetch((const char *)b + X8_PF + o, _MM_HINT_T0);
				_mm_prefetch((const char *)b + X8_PF + sizeof(struct nf_block_q4_0x8) - 1, _MM_HINT_T0);
				__m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)),
							 _mm256_broadcast_ss(&t[i].dx));
				__m256i l[8];
				x8_lanes(0, b + 16, l);
				acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qb_x8_sum(l, x + c + i, t[i].corr)), d, acc);
			}
		}
		_mm256_storeu_ps(y + 8 * g, acc);
	}
}

/* gemm: as x8_gemm_tile, one accumulator per group and activation row. */
static void gemm_q4_0x8b(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			 float *y, size_t ldy)
{
	size_t nb = n / NF_QK, ng = nrows / 8;
	for (size_t g0 = 0; g0 < ng; g0 += X8_GRP) {
		size_t g1 = g0 + X8_GRP < ng ? g0 + X8_GRP : ng;
		for (size_t b0 = 0; b0 < nbat; b0 += X8_TOK) {
			size_t nt = nbat - b0 < X8_TOK ? nbat - b0 : X8_TOK;
			const char *xt = (const char *)xq + b0 * xq_stride;
			__m256 acc[X8_GRP][X8_TOK];
			struct qb_tab tab[X8_TOK][X8_GCHUNK];
			for (size_t g = g0; g < g1; g++)
				for (size_t t = 0; t < nt; t++)
					acc[g - g0][t] = _mm256_setzero_ps();
			for (size_t c = 0; c < nb; c += X8_GCHUNK) {
				size_t cn = nb - c < X8_GCHUNK ? nb - c : X8_GCHUNK;
				for (size_t t = 0; t < nt; t++)
					qb_table((const struct nf_block_q8_0 *)(xt + t * xq_stride) + c, cn, tab[t]);
				for (size_t g = g0; g < g1; g++) {
					const unsigned char *b =
						(const unsigned char *)w + (g * nb + c) * sizeof(struct nf_block_q4_0x8);
					for (size_t i = 0; i < cn; i++, b += sizeof(struct nf_block_q4_0x8)) {
						__m256i l[8];
						x8_lanes(0, b + 16, l);
						__m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
						for (size_t t = 0; t < nt; t++) {
							const struct nf_block_q8_0 *x =
								(const struct nf_block_q8_0 *)(xt + t * xq_stride) + c + i;
							__m256 d = _mm256_mul_ps(dw, _mm256_broadcast_ss(&tab[t][i].dx));
							acc[g - g0][t] = _mm256_fmadd_ps(
								_mm256_cvtepi32_ps(qb_x8_sum(l, x, tab[t][i].corr)), d,
								acc[g - g0][t]);
						}
					}
				}
			}
			for (size_t g = g0; g < g1; g++)
				for (size_t t = 0; t < nt; t++)
					_mm256_storeu_ps(y + (b0 + t) * ldy + 8 * g, acc[g - g0][t]);
		}
	}
}

void nf_kavx2_gemv_x8_Q4_0(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	gemv_q4_0x8b(n, nrows, w, xq, y);
}

void nf_kavx2_gemm_x8_Q4_0(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			   float *y, size_t ldy)
{
	gemm_q4_0x8b(n, nrows, w, nbat, xq, xq_stride, y, ldy);
}

const struct nf_kernels nf_kernels_table_avx2 = {
	.isa = "avx2",
	.act_prepare = {
		[NF_KT_F32] = nf_kref_prepare_f32,
		[NF_KT_F16] = nf_kavx2_prepare_f16,
		[NF_KT_BF16] = nf_kavx2_prepare_bf16,
		[NF_KT_Q8_0] = nf_kavx2_prepare_q8_0,
		[NF_KT_Q4_0] = nf_kavx2_prepare_q8_0,
		[NF_KT_Q4_0L] = nf_kavx2_prepare_q8_0,
		[NF_KT_F16V] = nf_kavx2_prepare_f16,
		NF_KAVX2_KQUANT_PREPARE,
		NF_KREF_LEGACY_PREPARE,
	},
	.gemv = {
		[NF_KT_F32] = gemv_f32, [NF_KT_F16] = gemv_f16, [NF_KT_BF16] = gemv_bf16,
		[NF_KT_Q8_0] = gemv_q8_0, [NF_KT_Q4_0] = nf_kavx2_gemv_q4_0,
		[NF_KT_Q4_0L] = gemv_q4_0l, [NF_KT_F16V] = gemv_f16v,
		NF_KAVX2_KQUANT(gemv),
		NF_KREF_LEGACY(gemv),
	},
	.gemm = {
		[NF_KT_F32] = gemm_f32, [NF_KT_F16] = gemm_f16, [NF_KT_BF16] = gemm_bf16,
		[NF_KT_Q8_0] = gemm_q8_0, [NF_KT_Q4_0] = nf_kavx2_gemm_q4_0,
		[NF_KT_Q4_0L] = gemm_q4_0l, [NF_KT_F16V] = gemm_f16v,
		NF_KAVX2_KQUANT(gemm),
		NF_KREF_LEGACY(gemm),
	},
	.axpy = {
		[NF_KT_F32] = nf_kavx2_axpy_f32, [NF_KT_F16] = nf_kavx2_axpy_f16,
		[NF_KT_BF16] = nf_kavx2_axpy_bf16, [NF_KT_Q8_0] = nf_kavx2_axpy_q8_0,
		[NF_KT_Q4_0] = nf_kavx2_axpy_q4_0, [NF_KT_Q4_0L] = nf_kavx2_axpy_q4_0,
		[NF_KT_F16V] = nf_kavx2_axpy_f16,
		NF_KAVX2_KQUANT(axpy),
		NF_KREF_LEGACY(axpy),
	},
	.gemv_list = {
		[NF_KT_F32] = gemv_list_f32, [NF_KT_F16] = gemv_list_f16,
		[NF_KT_BF16] = gemv_list_bf16, [NF_KT_Q8_0] = gemv_list_q8_0,
		[NF_KT_Q4_0] = nf_kavx2_gemv_list_q4_0, [NF_KT_Q4_0L] = gemv_list_q4_0l,
		[NF_KT_F16V] = gemv_list_f16v,
		NF_KAVX2_KQUANT(gemv_list),
		NF_KREF_LEGACY(gemv_list),
	},
	.axpy_list = {
		[NF_KT_F32] = nf_kavx2_axpy_list_f32, [NF_KT_F16] = nf_kavx2_axpy_list_f16,
		[NF_KT_BF16] = nf_kavx2_axpy_list_bf16, [NF_KT_Q8_0] = axpy_list_q8_0,
		[NF_KT_Q4_0] = axpy_list_q4_0, [NF_KT_Q4_0L] = axpy_list_q4_0,
		[NF_KT_F16V] = nf_kavx2_axpy_list_f16,
		NF_KAVX2_KQUANT(axpy_list),
		NF_KREF_LEGACY(axpy_list),
	},
	.kcol_madd = nf_kavx2_kcol_madd,
	.qcol_down = { [NF_KT_Q8_0] = nf_kavx2_qcol_down_q8_0, [NF_KT_Q4_0] = nf_kavx2_qcol_down_q4_0,
		       [NF_KT_Q4_0L] = nf_kavx2_qcol_down_q4_0 },
	.rmsnorm = nf_kavx2_rmsnorm,
	.softmax = nf_kavx2_softmax,
	.silu_mul = nf_kavx2_silu_mul,
	.relu_mul = nf_kref_relu_mul,
	.drelu_mul = nf_kref_drelu_mul,
	.dot_f32 = nf_kavx2_dot_f32v,
	.axpy_f32 = nf_kavx2_axpy_f32v,
	.gemv_x8 = { [NF_KT_Q4_0] = gemv_q4_0x8b, [NF_KT_Q4_0L] = gemv_q4_0x8, [NF_KT_Q8_0] = gemv_q8_0x8, NF_KAVX2_X8(gemv) },
	.gemm_x8 = { [NF_KT_Q4_0] = gemm_q4_0x8b, [NF_KT_Q4_0L] = gemm_q4_0x8, [NF_KT_Q8_0] = gemm_q8_0x8, NF_KAVX2_X8(gemm) },
};
