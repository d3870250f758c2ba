/*
 * kernels_avx2_kquant.c - AVX2 K-quant kernels: Q8_K activation preparation,
 * the Q2_K..Q6_K dot products (gemv, gemm, gemv_list), their axpys (y += a *
 * row, with the reference's bits), and the sparse FFN's
 * K-quant down columns (kcol_madd).
 *
 * Invariants:
 * 1. Prepared Q8_K blocks are bit-identical to nf_kref_prepare_q8_K (same
 *    largest-magnitude value, first on ties; same f32 iscale; products
 *    rounded half to even; the same integer sums).
 * 2. Every dot product has the reference's bits (kernels_ref.c,
 *    dot_kquant): lane m of the int32 sums covers bytes 4m..4m+3 of each
 *    32-value group, which is what maddubs then madd against a per-lane
 *    scale gives; one fma per lane and super-block; the min terms computed
 *    exactly as the reference computes them.
 * 3. Compiled with -mavx2 -mfma -mf16c (the file name has _avx2), handed out
 *    only through tables kernels.c returns after cpuid checks.
 * 4. Nothing here allocates.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "kernels_impl.h"

static inline float reduce8(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

/* ---- activations ----------------------------------------------------------- */

void nf_kavx2_prepare_q8_K(const float *x, void *xq, size_t n)
{
	struct nf_block_q8_K *y = xq;
	const __m256 sign = _mm256_set1_ps(-0.0f);
	const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
	for (size_t b = 0; b < n / NF_QK_K; b++, x += NF_QK_K) {
		__m256 m = _mm256_setzero_ps();
		for (int j = 0; j < NF_QK_K; j += 8)
			m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m);
		__m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
		m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
		m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
		float amax = _mm_cvtss_f32(m4);
		const float max = nf_kq_q8_K_max(x, amax, &y[b]);
		if (max == 0.0f)
			continue;
		const float iscale = -127.0f / max;
		const __m256 vs = _mm256_set1_ps(iscale);
		const __m256i cap = _mm256_set1_epi32(127);
		for (int j = 0; j < NF_QK_K; j += 32) {
			__m256i q[4];
			for (int k = 0; k < 4; k++) {
				__m256 v = _mm256_round_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j + 8 * k)), rnd);
				q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(v), cap);
			}
			/* pack 32 int32 to 32 int8 in order */
			__m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
			__m256i p = _mm256_packs_epi16(p01, p23);
			p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
			_mm256_storeu_si256((__m256i *)(y[b].qs + j), p);
			/* sums of each 16: widen to int16 and add pairs up */
			__m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(p));
			__m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(p, 1));
			__m256i ones = _mm256_set1_epi16(1);
			__m256i s32lo = _mm256_madd_epi16(lo, ones), s32hi = _mm256_madd_epi16(hi, ones);
			/* s32lo: 8 pair sums of values j..j+15; s32hi: of j+16..j+31 */
			__m256i h = _mm256_hadd_epi32(s32lo, s32hi);   /* [lo01 lo23 hi01 hi23 | lo45 lo67 hi45 hi67] */
			h = _mm256_hadd_epi32(h, h);                    /* [lo0-3 hi0-3 .. | lo4-7 hi4-7 ..] */
			int32_t t[8];
			_mm256_storeu_si256((__m256i *)t, h);
			y[b].bsums[j / 16] = (int16_t)(t[0] + t[4]);
			y[b].bsums[j / 16 + 1] = (int16_t)(t[1] + t[5]);
		}
		y[b].d = 1.0f / iscale;
	}
}

/* ---- dot products ---------------------------------------------------------- */

/* The lines of block i of the row at pf into L1: gemv_list passes the
 * row two ahead, which the hardware prefetcher cannot guess (2.5x on
 * scattered Q4_K rows); gemv and gemm, whose rows follow each other, the
 * row itself. (With a NULL test in place of that, GCC 12 dropped the
 * prefetches altogether.) */
static inline void kq_prefetch(const char *pf, size_t i, size_t bs)
{
	const char *p = pf + i * bs;
	for (size_t o = 0; o < bs; o += 64)
		_mm_prefetch(p + o, _MM_HINT_T0);
	_mm_prefetch(p + bs - 1, _MM_HINT_T0);
}

/*
 * A q4_K/q5_K block against b: d, dmin, the 8 six-bit scales as int16
 * (both 128-bit lanes alike) and the per-32 min products p[k] = m[2k]
 * s[2k] + m[2k+1] s[2k+1], k = 0..3, as int32 (s: bsums summed in pairs).
 * The scale bytes are unpacked four at a time in 32-bit words, as
 * nf_kq_scales_k4 does byte by byte; all the integers are exact, so p is
 * the reference's.
 */
static inline void k4_head(const uint8_t *scales, uint16_t hd, uint16_t hdmin,
			   const struct nf_block_q8_K *b, float *d, float *dmin, __m256i *sc, __m128i *p)
{
	uint32_t w[3];
	memcpy(w, scales, sizeof(w));
	const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
	uint32_t sc_lo = w[0] & m6, mn_lo = w[1] & m6;
	uint32_t sc_hi = (w[2] & m4) | ((w[0] >> 6) & m2) << 4;
	uint32_t mn_hi = ((w[2] >> 4) & m4) | ((w[1] >> 6) & m2) << 4;
	*d = b->d * _cvtsh_ss(hd);
	*dmin = -b->d * _cvtsh_ss(hdmin);
	*sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
	const __m128i mn = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo));
	const __m128i s = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)b->bsums),
					 _mm_loadu_si128((const __m128i *)(b->bsums + 8)));
	*p = _mm_madd_epi16(mn, s);
}

/* pshufb indexes: int16 element j of a vector, in every element */
static const uint8_t k4_bw[8][32] __attribute__((aligned(32))) = {
#define K4_BW(j) { 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
		   2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
		   2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
		   2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1 }
	K4_BW(0), K4_BW(1), K4_BW(2), K4_BW(3), K4_BW(4), K4_BW(5), K4_BW(6), K4_BW(7),
#undef K4_BW
};

/* scale j of k4_head's sc in every int16 */
static inline __m256i k4_scale(__m256i sc, int j)
{
	return _mm256_shuffle_epi8(sc, _mm256_load_si256((const __m256i *)k4_bw[j]));
}

/* sc * (4-consecutive sums of q * x) as 8 int32 lanes */
static inline __m256i lanes(__m256i q, __m256i x, __m256i sc)
{
	return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), sc);
}

/* sc0 * (sums of 4 of the low 16 products) | sc1 * (of the high 16): the
 * reference's lanes 0-3 and 4-7 of a 32-value group whose halves have
 * their own scales; p holds the 16 pair sums (maddubs) */
static inline __m256i lanes2(__m256i p, int sc0, int sc1)
{
	return _mm256_madd_epi16(p, _mm256_setr_m128i(_mm_set1_epi16((int16_t)sc0), _mm_set1_epi16((int16_t)sc1)));
}

/* Q2_K: value 128h + 32k + l is (qs[32h + l] >> 2k) & 3; per 16 values a
 * 4-bit scale and a 4-bit min whose products with the bsums go into the
 * lanes before the quants (dot_kquant). */
static float dot_q2_K(size_t n, const void *w, const void *xq, const char *pf)
{
	const struct nf_block_q2_K *a = w;
	const struct nf_block_q8_K *b = xq;
	const __m256i m3 = _mm256_set1_epi8(3);
	__m256 acc = _mm256_setzero_ps();
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		kq_prefetch(pf, i, sizeof(a[0]));
		const float d = b[i].d * _cvtsh_ss(a[i].d), dmin = -b[i].d * _cvtsh_ss(a[i].dmin);
		const __m128i sm = _mm_loadu_si128((const __m128i *)a[i].scales);
		/* lane m: mn[2m] bsums[2m] + mn[2m+1] bsums[2m+1] */
		__m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0xf)));
		__m256i pm = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)b[i].bsums));
		acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(pm), acc);
		uint8_t sc[16];
		_mm_storeu_si128((__m128i *)sc, _mm_and_si128(sm, _mm_set1_epi8(0xf)));
		__m256i sumi = _mm256_setzero_si256();
		for (int h = 0; h < 2; h++) {
			const __m256i q = _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * h));
			for (int k = 0; k < 4; k++) {
				const int g = 4 * h + k;
				__m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3);
				__m256i x = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * g));
				sumi = _mm256_add_epi32(sumi, lanes2(_mm256_maddubs_epi16(v, x), sc[2 * g], sc[2 * g + 1]));
			}
		}
		acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
	}
	return reduce8(acc);
}

/* Q3_K: Q2_K's low bits, bit g of hmask[l] the high bit of value 32g + l,
 * value (low | hbit << 2) - 4, 16 signed 6-bit scales; no mins. */
static float dot_q3_K(size_t n, const void *w, const void *xq, const char *pf)
{
	const struct nf_block_q3_K *a = w;
	const struct nf_block_q8_K *b = xq;
	const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
	__m256 acc = _mm256_setzero_ps();
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		kq_prefetch(pf, i, sizeof(a[0]));
		const float d = b[i].d * _cvtsh_ss(a[i].d);
		int8_t sc[16];
		nf_kq_scales_k3(a[i].scales, sc);
		const __m256i hm = _mm256_loadu_si256((const __m256i *)a[i].hmask);
		__m256i sumi = _mm256_setzero_si256();
		for (int h = 0; h < 2; h++) {
			const __m256i q = _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * h));
			for (int k = 0; k < 4; k++) {
				const int g = 4 * h + k;
				const __m256i bit = _mm256_set1_epi8((char)(1 << g));
				__m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four);
				__m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3), hb);
				__m256i x = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * g));
				/* (v - 4) * x in int16 pairs: exact */
				__m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(v, x), _mm256_maddubs_epi16(four, x));
				sumi = _mm256_add_epi32(sumi, lanes2(p, sc[2 * g], sc[2 * g + 1]));
			}
		}
		acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
	}
	return reduce8(acc);
}

static float dot_q4_K(size_t n, const void *w, const void *xq, const char *pf)
{
	const struct nf_block_q4_K *a = w;
	const struct nf_block_q8_K *b = xq;
	const __m256i m4 = _mm256_set1_epi8(0xf);
	__m256 acc = _mm256_setzero_ps();
	__m128 accm = _mm_setzero_ps(); /* the reference's four min chains */
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		kq_prefetch(pf, i, sizeof(a[0]));
		float d, dmin;
		__m256i sc;
		__m128i p;
		k4_head(a[i].scales, a[i].d, a[i].dmin, &b[i], &d, &dmin, &sc, &p);
		accm = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(p), accm);
		__m256i sumi = _mm256_setzero_si256();
		for (int j = 0; j < 4; j++) {
			__m256i q = _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * j));
			__m256i x0 = _mm256_loadu_si256((const __m256i *)(b[i].qs + 64 * j));
			__m256i x1 = _mm256_loadu_si256((const __m256i *)(b[i].qs + 64 * j + 32));
			__m256i lo = lanes(_mm256_and_si256(q, m4), x0, k4_scale(sc, 2 * j));
			__m256i hi = lanes(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), x1, k4_scale(sc, 2 * j + 1));
			sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(lo, hi));
		}
		acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
	}
	/* (m0 + m2) + (m1 + m3), as the reference adds them */
	__m128 h = _mm_add_ps(accm, _mm_movehl_ps(accm, accm));
	return reduce8(acc) + _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static float dot_q5_K(size_t n, const void *w, const void *xq, const char *pf)
{
	const struct nf_block_q5_K *a = w;
	const struct nf_block_q8_K *b = xq;
	const __m256i m4 = _mm256_set1_epi8(0xf), sixteen = _mm256_set1_epi8(16);
	__m256 acc = _mm256_setzero_ps();
	float summs = 0.0f;
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		kq_prefetch(pf, i, sizeof(a[0]));
		float d, dmin;
		__m256i sc;
		__m128i p;
		k4_head(a[i].scales, a[i].d, a[i].dmin, &b[i], &d, &dmin, &sc, &p);
		p = _mm_add_epi32(p, _mm_unpackhi_epi64(p, p));
		p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 1));
		summs = fmaf(dmin, (float)_mm_cvtsi128_si32(p), summs);
		const __m256i qh = _mm256_loadu_si256((const __m256i *)a[i].qh);
		__m256i sumi = _mm256_setzero_si256();
		for (int j = 0; j < 4; j++) {
			__m256i q = _mm256_loadu_si256((const __m256i *)(a[i].qs + 32 * j));
			__m256i bl = _mm256_set1_epi8((char)(1 << (2 * j))), bh = _mm256_set1_epi8((char)(2 << (2 * j)));
			__m256i hl = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), sixteen);
			__m256i hh = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), sixteen);
			__m256i x0 = _mm256_loadu_si256((const __m256i *)(b[i].qs + 64 * j));
			__m256i x1 = _mm256_loadu_si256((const __m256i *)(b[i].qs + 64 * j + 32));
			__m256i lo = lanes(_mm256_or_si256(_mm256_and_si256(q, m4), hl), x0, k4_scale(sc, 2 * j));
			__m256i hi = lanes(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), hh), x1,
					   k4_scale(sc, 2 * j + 1));
			sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(lo, hi));
		}
		acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
	}
	return reduce8(acc) + summs;
}

static float dot_q6_K(size_t n, const void *w, const void *xq, const char *pf)
{
	const struct nf_block_q6_K *a = w;
	const struct nf_block_q8_K *b = xq;
	const __m256i m4 = _mm256_set1_epi8(0xf), m2 = _mm256_set1_epi8(3);
	const __m256i m32 = _mm256_set1_epi8(32);
	__m256 acc = _mm256_setzero_ps();
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		kq_prefetch(pf, i, sizeof(a[0]));
		const float d = b[i].d * _cvtsh_ss(a[i].d);
		__m256i sumi = _mm256_setzero_si256();
		for (int h = 0; h < 2; h++) {
			__m256i l0 = _mm256_loadu_si256((const __m256i *)(a[i].ql + 64 * h));
			__m256i l1 = _mm256_loadu_si256((const __m256i *)(a[i].ql + 64 * h + 32));
			__m256i qh = _mm256_loadu_si256((const __m256i *)(a[i].qh + 32 * h));
			__m256i q[4] = {
				_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
				_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
				_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
			};
			for (int k = 0; k < 4; k++) {
				__m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
				__m256i v = _mm256_or_si256(q[k], _mm256_slli_epi16(hb, 4));
				__m256i x = _mm256_loadu_si256((const __m256i *)(b[i].qs + 128 * h + 32 * k));
				/* (q - 32) * x in int16 pairs: exact */
				__m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(v, x), _mm256_maddubs_epi16(m32, x));
				sumi = _mm256_add_epi32(sumi, lanes2(p, a[i].scales[8 * h + 2 * k], a[i].scales[8 * h + 2 * k + 1]));
			}
		}
		acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
	}
	return reduce8(acc);
}

typedef float (*kdot_fn)(size_t n, const void *w, const void *xq, const char *pf);

static inline void gemv_with(kdot_fn dot, size_t n, size_t nrows, const void *w, size_t row_bytes,
			     const void *xq, float *y)
{
	for (size_t r = 0; r < nrows; r++)
		y[r] = dot(n, (const char *)w + r * row_bytes, xq, (const char *)w + r * row_bytes);
}

/* Tokens inner: each weight row stays in L1 while every token passes it. */
static inline void gemm_with(kdot_fn dot, size_t n, size_t nrows, const void *w, size_t row_bytes,
			     size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	for (size_t r = 0; r < nrows; r++)
		for (size_t t = 0; t < nb; t++)
			y[t * ldy + r] = dot(n, (const char *)w + r * row_bytes, (const char *)xq + t * xq_stride,
					     (const char *)w + r * row_bytes);
}

#define AVX2_K(T)                                                                               \
	void nf_kavx2_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			       const void *xq, float *y)                                        \
	{                                                                                       \
		gemv_with(dot_##T, n, nrows, w, row_bytes, xq, y);                              \
	}                                                                                       \
	void nf_kavx2_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			       size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                       \
		gemm_with(dot_##T, n, nrows, w, row_bytes, nb, xq, xq_stride, y, ldy);          \
	}                                                                                       \
	void nf_kavx2_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,           \
				    const void *xq, float *y)                                   \
	{                                                                                       \
		for (size_t r = 0; r < nrows; r++)                                              \
			y[r] = dot_##T(n, rows[r], xq, rows[r + 2 < nrows ? r + 2 : r]);      \
	}

AVX2_K(q2_K)
AVX2_K(q3_K)
AVX2_K(q4_K)
AVX2_K(q5_K)
AVX2_K(q6_K)

/* ---- axpy: y += a * row (the sparse FFN's down rows, PowerInfer layout) ---------- */

/* Q4_K's and Q6_K's quants of one super-block as signed values, in order
 * (value 64c + l is qs[32c + l]'s low nibble, 64c + 32 + l its high one;
 * Q6_K's value 128h + 32k + l: ql and qh as dot_q6_K reads them, - 32). */
static void kq_quants(uint32_t t, const void *blk, int8_t q[NF_QK_K])
{
	const __m256i m4 = _mm256_set1_epi8(0xf);
	if (t == NF_DTYPE_Q4_K) {
		const struct nf_block_q4_K *b = blk;
		for (int c = 0; c < 4; c++) {
			__m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * c));
			_mm256_storeu_si256((__m256i *)(q + 64 * c), _mm256_and_si256(v, m4));
			_mm256_storeu_si256((__m256i *)(q + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
		}
		return;
	}
	const struct nf_block_q6_K *b = blk;
	const __m256i m2 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
	for (int h = 0; h < 2; h++) {
		__m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
		__m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
		__m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
		__m256i lo[4] = { _mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
				  _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
				  _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4) };
		for (int k = 0; k < 4; k++) {
			__m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
			__m256i v = _mm256_or_si256(lo[k], _mm256_slli_epi16(hb, 4));
			_mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * k), _mm256_sub_epi8(v, m32));
		}
	}
}

/*
 * The reference's axpy_kquant with its bits: per 16 values dl = d * sc and
 * ml = dmin * mn (the same scalar products), value = dl * q - ml rounded
 * twice (the reference's C has no contraction), y = fma(a, value, y).
 * The quants of Q4_K and Q6_K are unpacked with vector ops, the other
 * types' by nf_kblock_unpack; every type's scales by nf_kblock_unpack_scales.
 */
static void axpy_kq(uint32_t t, size_t n, float a, const void *wrow, float *y)
{
	const size_t bs = nf_dtype_block_size(t);
	const __m256 va = _mm256_set1_ps(a);
	for (size_t i = 0; i < n / NF_QK_K; i++, y += NF_QK_K) {
		const char *blk = (const char *)wrow + i * bs;
		struct nf_kblock kb;
		if (t == NF_DTYPE_Q4_K || t == NF_DTYPE_Q6_K) {
			nf_kblock_unpack_scales(t, blk, &kb);
			kq_quants(t, blk, kb.q);
		} else {
			nf_kblock_unpack(t, blk, &kb);
		}
		for (int j = 0; j < 16; j++) {
			const __m256 dl = _mm256_set1_ps(kb.d * (float)kb.sc[j]);
			const __m256 ml = _mm256_set1_ps(kb.dmin * (float)kb.mn[j]);
			const __m128i q = _mm_loadu_si128((const __m128i *)(kb.q + 16 * j));
			const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
			const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
			float *yj = y + 16 * j;
			_mm256_storeu_ps(yj, _mm256_fmadd_ps(va, _mm256_sub_ps(_mm256_mul_ps(dl, q0), ml),
							      _mm256_loadu_ps(yj)));
			_mm256_storeu_ps(yj + 8, _mm256_fmadd_ps(va, _mm256_sub_ps(_mm256_mul_ps(dl, q1), ml),
								  _mm256_loadu_ps(yj + 8)));
		}
	}
}

#define AVX2_KAXPY(T, DT)                                                                             \
	void nf_kavx2_axpy_##T(size_t n, float a, const void *wrow, float *y)                         \
	{                                                                                             \
		axpy_kq(DT, n, a, wrow, y);                                                           \
	}                                                                                             \
	void nf_kavx2_axpy_list_##T(size_t n, size_t ncols, const float *a, const void *const *cols, \
				    float *y)                                                         \
	{                                                                                             \
		for (size_t c = 0; c < ncols; c++)                                                    \
			axpy_kq(DT, n, a[c], cols[c], y);                                             \
	}

AVX2_KAXPY(q2_K, NF_DTYPE_Q2_K)
AVX2_KAXPY(q3_K, NF_DTYPE_Q3_K)
AVX2_KAXPY(q4_K, NF_DTYPE_Q4_K)
AVX2_KAXPY(q5_K, NF_DTYPE_Q5_K)
AVX2_KAXPY(q6_K, NF_DTYPE_Q6_K)

/* ---- K-quant down columns ------------------------------------------------------ */

/* Exactly the 2b bytes of 16 b-bit values (never reading past them). */
static inline __m128i kcol_load(const uint8_t *p, uint32_t b)
{
	uint64_t u64;
	uint32_t u32;
	uint16_t u16;
	if (b < 4) {
		memcpy(&u32, p, 4);
		__m128i v = _mm_cvtsi32_si128((int)u32);
		if (b == 3) {
			memcpy(&u16, p + 4, 2);
			v = _mm_insert_epi16(v, u16, 2);
		}
		return v;
	}
	memcpy(&u64, p, 8);
	__m128i v = _mm_cvtsi64_si128((long long)u64);
	if (b == 5) {
		memcpy(&u16, p + 8, 2);
		v = _mm_insert_epi16(v, u16, 4);
	} else if (b == 6) {
		memcpy(&u32, p + 8, 4);
		v = _mm_insert_epi32(v, (int)u32, 2);
	}
	return v;
}

/* 16 rows per step: the values unpacked to int16 (nf_kcol_idx/mul),
 * minus off, times xq (|.| <= 63 * 128: exact in int16), times the rows'
 * scales as exact 32-bit products (mullo/mulhi interleaved). */
static inline void kcol_madd_b(uint32_t b, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
			       int32_t xq, int32_t *acc)
{
	const __m256i idx = _mm256_loadu_si256((const __m256i *)nf_kcol_idx[b - 2]);
	const __m256i mul = _mm256_loadu_si256((const __m256i *)nf_kcol_mul[b - 2]);
	const __m128i sh = _mm_cvtsi32_si128((int)(16 - b));
	const __m256i vo = _mm256_set1_epi16((int16_t)off), vx = _mm256_set1_epi16((int16_t)xq);
	size_t r = 0;
	for (; r + 16 <= n; r += 16, col += 2 * b) {
		__m256i w = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(kcol_load(col, b)), idx);
		__m256i v = _mm256_sub_epi16(_mm256_srl_epi16(_mm256_mullo_epi16(w, mul), sh), vo);
		__m256i p = _mm256_mullo_epi16(v, vx), s = _mm256_loadu_si256((const __m256i *)(sc + r));
		__m256i lo = _mm256_mullo_epi16(p, s), hi = _mm256_mulhi_epi16(p, s);
		__m256i a = _mm256_unpacklo_epi16(lo, hi), c = _mm256_unpackhi_epi16(lo, hi); /* [0-3|8-11], [4-7|12-15] */
		__m256i *o = (__m256i *)(acc + r);
		_mm256_storeu_si256(o, _mm256_add_epi32(_mm256_loadu_si256(o), _mm256_permute2x128_si256(a, c, 0x20)));
		_mm256_storeu_si256(o + 1, _mm256_add_epi32(_mm256_loadu_si256(o + 1), _mm256_permute2x128_si256(a, c, 0x31)));
	}
	if (r < n)
		nf_kref_kcol_madd(b, off, col, n - r, sc + r, xq, acc + r);
}

void nf_kavx2_kcol_madd(uint32_t bits, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
			int32_t xq, int32_t *acc)
{
	NF_KCOL_BY_BITS(kcol_madd_b, bits, off, col, n, sc, xq, acc);
}

/* ---- 8-row groups ---------------------------------------------------------------- */

/*
 * Q4_K, Q5_K and Q6_K matrices in 8-row groups (kernels.h). Register e of
 * lane m holds element r = row r's int32 lane m (bytes 4m..4m+3 of each
 * 32-value group): one 32-byte load of quants serves 8 rows, the 4
 * activation bytes are one broadcast, and the sub-block scale of the 8
 * rows is one vector (pshufb of the group's scale bytes, rows 0-3 in the
 * low lane and 4-7 in the high one), applied by madd to maddubs' pair
 * sums: exactly the reference's integer lanes. Per super-block and lane
 * acc_m[r] = fma(d_w[r] * d_x, lane_m[r], acc_m[r]), the mins as the
 * reference adds them (Q4_K: 4 chains, Q5_K: one), and the end is hsum8
 * element by element: the plain reference's bits for every row.
 */
#define KX8_CHUNK 64 /* super-blocks per activation table (16384 values) */

struct kx8_tab {
	float d;
	int32_t mp[4];       /* Q4_K/Q5_K: the sums of 32 as int16 pairs (s0, s1), k = 0..3 */
	int32_t corr[8][8];  /* Q6_K: 32 * (x pair sums) of lane m of group g, as int16 pairs */
};

static void kx8_table(int q6, const struct nf_block_q8_K *x, size_t nsb, struct kx8_tab *t)
{
	const __m256i m32 = _mm256_set1_epi8(32);
	for (size_t i = 0; i < nsb; i++) {
		t[i].d = x[i].d;
		if (q6) {
			for (int g = 0; g < 8; g++)
				_mm256_storeu_si256((__m256i *)t[i].corr[g],
						    _mm256_maddubs_epi16(m32, _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * g))));
			continue;
		}
		for (int k = 0; k < 4; k++) {
			int32_t s0 = x[i].bsums[4 * k] + x[i].bsums[4 * k + 1];
			int32_t s1 = x[i].bsums[4 * k + 2] + x[i].bsums[4 * k + 3];
			t[i].mp[k] = (int32_t)((uint32_t)(uint16_t)s0 | (uint32_t)s1 << 16);
		}
	}
}

static inline __m256i bcast32(const int8_t *p)
{
	int32_t v;
	memcpy(&v, p, sizeof(v));
	return _mm256_set1_epi32(v);
}

/* pshufb indexes (the same in both 128-bit lanes): element r gets, from
 * the scale bytes' lane, rows 0-3 (low lane) or 4-7 (high lane):
 * KX8_SC + p: byte 4p + r % 4 as int16, twice (a sub-block's scale of 8 rows);
 * KX8_MN + k: bytes 8k + r % 4 and 8k + 4 + r % 4 as int16 (two mins);
 * KX8_S6 + p: byte 4p + r % 4 in the high byte of each int16 (for srai). */
enum { KX8_SC = 0, KX8_MN = 4, KX8_S6 = 6 };
static const uint8_t kx8_ix[10][32] __attribute__((aligned(32))) = {
#define KX8_L(...) { __VA_ARGS__, __VA_ARGS__ }
	KX8_L(0x00, 0x80, 0x00, 0x80, 0x01, 0x80, 0x01, 0x80, 0x02, 0x80, 0x02, 0x80, 0x03, 0x80, 0x03, 0x80),
	KX8_L(0x04, 0x80, 0x04, 0x80, 0x05, 0x80, 0x05, 0x80, 0x06, 0x80, 0x06, 0x80, 0x07, 0x80, 0x07, 0x80),
	KX8_L(0x08, 0x80, 0x08, 0x80, 0x09, 0x80, 0x09, 0x80, 0x0a, 0x80, 0x0a, 0x80, 0x0b, 0x80, 0x0b, 0x80),
	KX8_L(0x0c, 0x80, 0x0c, 0x80, 0x0d, 0x80, 0x0d, 0x80, 0x0e, 0x80, 0x0e, 0x80, 0x0f, 0x80, 0x0f, 0x80),
	KX8_L(0x00, 0x80, 0x04, 0x80, 0x01, 0x80, 0x05, 0x80, 0x02, 0x80, 0x06, 0x80, 0x03, 0x80, 0x07, 0x80),
	KX8_L(0x08, 0x80, 0x0c, 0x80, 0x09, 0x80, 0x0d, 0x80, 0x0a, 0x80, 0x0e, 0x80, 0x0b, 0x80, 0x0f, 0x80),
	KX8_L(0x80, 0x00, 0x80, 0x00, 0x80, 0x01, 0x80, 0x01, 0x80, 0x02, 0x80, 0x02, 0x80, 0x03, 0x80, 0x03),
	KX8_L(0x80, 0x04, 0x80, 0x04, 0x80, 0x05, 0x80, 0x05, 0x80, 0x06, 0x80, 0x06, 0x80, 0x07, 0x80, 0x07),
	KX8_L(0x80, 0x08, 0x80, 0x08, 0x80, 0x09, 0x80, 0x09, 0x80, 0x0a, 0x80, 0x0a, 0x80, 0x0b, 0x80, 0x0b),
	KX8_L(0x80, 0x0c, 0x80, 0x0c, 0x80, 0x0d, 0x80, 0x0d, 0x80, 0x0e, 0x80, 0x0e, 0x80, 0x0f, 0x80, 0x0f),
#undef KX8_L
};

static inline __m256i kx8_shuf(__m256i v, int which)
{
	return _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i *)kx8_ix[which]));
}

/* bit p (0..7) of each byte of h, moved to 0x10 */
static inline __m256i kx8_bit4(__m256i h, int p)
{
	const __m256i b4 = _mm256_set1_epi8(0x10);
	if (p < 4)
		return _mm256_and_si256(_mm256_slli_epi16(h, 4 - p), b4);
	if (p > 4)
		return _mm256_and_si256(_mm256_srli_epi16(h, p - 4), b4);
	return _mm256_and_si256(h, b4);
}

/* hsum8 of the 8 lane chains, element by element, plus the min sums (ty 4:
 * Q4_K's (0+2) + (1+3), 5: Q5_K's one chain; none for Q6_K, where adding
 * 0 would turn -0 into +0) */
static inline void kx8_out(int ty, const __m256 a[8], const __m256 m[4], float *y)
{
	__m256 t0 = _mm256_add_ps(a[0], a[4]), t1 = _mm256_add_ps(a[1], a[5]);
	__m256 t2 = _mm256_add_ps(a[2], a[6]), t3 = _mm256_add_ps(a[3], a[7]);
	__m256 s = _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
	if (ty == 4)
		s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(m[0], m[2]), _mm256_add_ps(m[1], m[3])));
	else if (ty == 5)
		s = _mm256_add_ps(s, m[0]);
	_mm256_storeu_ps(y, s);
}

/* Q4_K/Q5_K: the 8 sub-blocks' scale vectors and the 4 min-pair vectors
 * (mins 2k, 2k+1 as int16) of one group block. */
static inline __attribute__((always_inline)) void kx8_k4_scales(const unsigned char *b, __m256i sv[8], __m256i mnp[4])
{
	const __m256i m4 = _mm256_set1_epi8(0x0f), m63 = _mm256_set1_epi8(63), m30 = _mm256_set1_epi8(0x30);
	const __m256i A = _mm256_loadu_si256((const __m256i *)(b + 32));
	const __m256i B = _mm256_loadu_si256((const __m256i *)(b + 64));
	const __m256i C = _mm256_loadu_si256((const __m256i *)(b + 96));
	__m256i sc[2], mn[2];
	sc[0] = _mm256_and_si256(A, m63);
	sc[1] = _mm256_or_si256(_mm256_and_si256(C, m4), _mm256_and_si256(_mm256_srli_epi16(A, 2), m30));
	mn[0] = _mm256_and_si256(B, m63);
	mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), m4), _mm256_and_si256(_mm256_srli_epi16(B, 2), m30));
	for (int j = 0; j < 8; j++)
		sv[j] = kx8_shuf(sc[j / 4], KX8_SC + j % 4);
	for (int k = 0; k < 4; k++)
		mnp[k] = kx8_shuf(mn[k / 2], KX8_MN + k % 2);
}

/* The min terms of one super-block as the reference adds them: Q4_K four
 * chains accm[k], Q5_K one (accm[0]); dm = -d_x * dmin_w per row. */
static inline __attribute__((always_inline)) void kx8_k4_mins(int q5, const __m256i mnp[4], const struct kx8_tab *t,
							       __m256 dm, __m256 accm[4])
{
	if (q5) {
		__m256i tot = _mm256_setzero_si256();
		for (int k = 0; k < 4; k++)
			tot = _mm256_add_epi32(tot, _mm256_madd_epi16(mnp[k], _mm256_set1_epi32(t->mp[k])));
		accm[0] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(tot), accm[0]);
		return;
	}
	for (int k = 0; k < 4; k++)
		accm[k] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(_mm256_madd_epi16(mnp[k], _mm256_set1_epi32(t->mp[k]))),
					  accm[k]);
}

/* Q4_K/Q5_K: the values of run j, lane m of the 8 rows (lo: sub-block 2j,
 * hi: 2j + 1), unsigned bytes. */
static inline __attribute__((always_inline)) void kx8_k4_quants(int q5, const unsigned char *b, int j, int m,
								 __m256i *lo, __m256i *hi)
{
	const __m256i m4 = _mm256_set1_epi8(0x0f);
	const size_t qso = q5 ? offsetof(struct nf_block_q5_Kx8, qs) : offsetof(struct nf_block_q4_Kx8, qs);
	__m256i q = _mm256_loadu_si256((const __m256i *)(b + qso + 32 * (8 * j + m)));
	__asm__("" : "+x"(q)); /* one load, not one per use */
	*lo = _mm256_and_si256(q, m4);
	*hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
	if (q5) {
		const __m256i h = _mm256_loadu_si256((const __m256i *)(b + offsetof(struct nf_block_q5_Kx8, qh) + 32 * m));
		*lo = _mm256_or_si256(*lo, kx8_bit4(h, 2 * j));
		*hi = _mm256_or_si256(*hi, kx8_bit4(h, 2 * j + 1));
	}
}

/* lane m's integer sum of run j: both sub-blocks times their scales */
static inline __m256i kx8_k4_dot(__m256i lo, __m256i hi, const int8_t *xq, int j, int m, __m256i s0, __m256i s1)
{
	__m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, bcast32(xq + 64 * j + 4 * m)), s0);
	__m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, bcast32(xq + 64 * j + 32 + 4 * m)), s1);
	return _mm256_add_epi32(p0, p1);
}

/* the fp16 scales of the 8 rows at p, times s */
static inline __m256 kx8_d(const unsigned char *p, float s)
{
	return _mm256_mul_ps(_mm256_set1_ps(s), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
}

/* Q4_K (q5 = 0) or Q5_K: super-blocks [0, nsb) of one group into acc,
 * accm (Q4_K's min chains) or accm[0] (Q5_K's). */
static inline __attribute__((always_inline)) void kx8_k4(int q5, const unsigned char *b,
							  const struct nf_block_q8_K *x, const struct kx8_tab *t,
							  size_t nsb, __m256 acc[8], __m256 accm[4])
{
	const size_t bs = q5 ? sizeof(struct nf_block_q5_Kx8) : sizeof(struct nf_block_q4_Kx8);
	for (size_t i = 0; i < nsb; i++, b += bs) {
		__m256i sv[8], mnp[4];
		kx8_k4_scales(b, sv, mnp);
		kx8_k4_mins(q5, mnp, &t[i], kx8_d(b + 16, -t[i].d), accm);
		/* lanes m = 0..7 in registers while the 4 runs of 64 values pass */
		const int8_t *xq = x[i].qs;
		__m256i sumi[8];
		for (int m = 0; m < 8; m++)
			sumi[m] = _mm256_setzero_si256();
		_Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
			const __m256i s0 = sv[2 * j], s1 = sv[2 * j + 1];
			_Pragma("GCC unroll 8") for (int m = 0; m < 8; m++) {
				__m256i lo, hi;
				kx8_k4_quants(q5, b, j, m, &lo, &hi);
				sumi[m] = _mm256_add_epi32(sumi[m], kx8_k4_dot(lo, hi, xq, j, m, s0, s1));
			}
		}
		const __m256 dv = kx8_d(b, t[i].d);
		for (int m = 0; m < 8; m++)
			acc[m] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(sumi[m]), acc[m]);
	}
}

/* Q6_K: the 16 sub-blocks' scale vectors (sign-extended int16 pairs). */
static inline __attribute__((always_inline)) void kx8_k6_scales(const unsigned char *b, __m256i sv[16])
{
	for (int sb = 0; sb < 16; sb++)
		sv[sb] = _mm256_srai_epi16(kx8_shuf(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (sb / 4))),
						    KX8_S6 + sb % 4), 8);
}

/* Q6_K: the 6-bit values of lane m in groups 4h..4h+3 of the 8 rows. */
static inline __attribute__((always_inline)) void kx8_k6_quants(const unsigned char *b, int h, int m, __m256i v[4])
{
	const size_t qlo = offsetof(struct nf_block_q6_Kx8, ql), qho = offsetof(struct nf_block_q6_Kx8, qh);
	const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
	const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + qlo + 32 * (16 * h + m)));
	const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + qlo + 32 * (16 * h + 8 + m)));
	const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + qho + 32 * (8 * h + m)));
	v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
	v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
	v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
	v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
			       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

/* Q6_K: (v - 32) * x of lane m in group g times the sub-block scale s */
static inline __m256i kx8_k6_dot(__m256i v, const int8_t *xq, const struct kx8_tab *t, int g, int m, __m256i s)
{
	__m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(v, bcast32(xq + 32 * g + 4 * m)), _mm256_set1_epi32(t->corr[g][m]));
	return _mm256_madd_epi16(p, s);
}

/*
 * Q6_K: super-blocks [0, nsb) of one group into acc. A group block's
 * lanes are read out of order (ql rows 16h + m and 16h + 8 + m, qh row
 * 8h + m), which the hardware prefetcher follows badly: streamed from
 * memory the loop ran at 16 GB/s on one Zen 5 core against 28 from L2.
 * So each super-block prefetches the whole block KX8_PF6 blocks ahead
 * into L2 (blocks are contiguous across groups; a prefetch past the end
 * is harmless), and h is the outer loop so that each half of the block is
 * done before the next is touched. Into L2, not L1: on a Zen 4 core the
 * 27 L1 prefetches two blocks ahead held the loop at 0.4-0.55 of the
 * memory read (0.6-0.9 with none), where 4 blocks ahead into L2 reaches
 * 0.8-1.0 (docs/KERNELS.md, session 18).
 */
#define KX8_PF6 4
static inline __attribute__((always_inline)) void kx8_k6(const unsigned char *b, const struct nf_block_q8_K *x,
							  const struct kx8_tab *t, size_t nsb, __m256 acc[8])
{
	const size_t bs = sizeof(struct nf_block_q6_Kx8);
	for (size_t i = 0; i < nsb; i++, b += bs) {
		const __m256 dv = kx8_d(b, t[i].d);
		const int8_t *xq = x[i].qs;
		for (size_t l = 0; l < bs; l += 64)
			_mm_prefetch((const char *)b + KX8_PF6 * bs + l, _MM_HINT_T1);
		__m256i sumi[8];
		for (int m = 0; m < 8; m++)
			sumi[m] = _mm256_setzero_si256();
		_Pragma("GCC unroll 1") for (int h = 0; h < 2; h++) {
			_Pragma("GCC unroll 1") for (int mh = 0; mh < 8; mh += 4) {
				__m256i s[4];
				_Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
					const int sb = 2 * (4 * h + k) + mh / 4; /* sub-block of 16 */
					const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (sb / 4)));
					s[k] = _mm256_srai_epi16(kx8_shuf(v, KX8_S6 + sb % 4), 8);
				}
				_Pragma("GCC unroll 4") for (int m = mh; m < mh + 4; m++) {
					__m256i v[4];
					kx8_k6_quants(b, h, m, v);
					_Pragma("GCC unroll 4") for (int k = 0; k < 4; k++)
						sumi[m] = _mm256_add_epi32(sumi[m], kx8_k6_dot(v[k], xq, &t[i], 4 * h + k, m, s[k]));
				}
			}
		}
		for (int m = 0; m < 8; m++)
			acc[m] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(sumi[m]), acc[m]);
	}
}

static inline size_t kx8_bs(int ty)
{
	return ty == 4 ? sizeof(struct nf_block_q4_Kx8) : ty == 5 ? sizeof(struct nf_block_q5_Kx8) : sizeof(struct nf_block_q6_Kx8);
}

static inline void kx8_zero(__m256 acc[8], __m256 accm[4])
{
	for (int j = 0; j < 8; j++)
		acc[j] = _mm256_setzero_ps();
	for (int j = 0; j < 4; j++)
		accm[j] = _mm256_setzero_ps();
}

/* Type 4 (Q4_K), 5 (Q5_K), 6 (Q6_K): y[8g..8g+7] for groups [0, ng) of
 * w against activation row x; the table is made once when the row fits
 * KX8_CHUNK super-blocks, else per group and chunk. */
static inline __attribute__((always_inline)) void kx8_groups(int ty, size_t nsb, const unsigned char *w, size_t ng,
							      const struct nf_block_q8_K *x, float *y)
{
	const size_t bs = kx8_bs(ty);
	struct kx8_tab t[KX8_CHUNK];
	if (nsb <= KX8_CHUNK)
		kx8_table(ty == 6, x, nsb, t);
	for (size_t g = 0; g < ng; g++) {
		__m256 acc[8], accm[4];
		kx8_zero(acc, accm);
		for (size_t c = 0; c < nsb; c += KX8_CHUNK) {
			size_t cn = nsb - c < KX8_CHUNK ? nsb - c : KX8_CHUNK;
			if (nsb > KX8_CHUNK)
				kx8_table(ty == 6, x + c, cn, t);
			const unsigned char *b = w + (g * nsb + c) * bs;
			if (ty == 6)
				kx8_k6(b, x + c, t, cn, acc);
			else
				kx8_k4(ty == 5, b, x + c, t, cn, acc, accm);
		}
		kx8_out(ty, acc, accm, y + 8 * g);
	}
}

/*
 * gemm: a group's super-block is unpacked once (quant vectors, scale
 * vectors: 2.5 KB on the stack) and used for a tile of KX8_TOK activation
 * rows, whose lane sums stay in registers over the super-block and whose
 * f32 chains live on the stack: per token the unpacking's ops (Q4_K: 3 of
 * 11 per 32 bytes, Q6_K: 17 of 41 per 96) are gone. KX8_GRP groups (at
 * most 4 x 72 KB at 11008 values) stay in L2 while the tiles pass; the
 * activation tables are made per tile and KX8_GCHUNK super-blocks. Each
 * accumulator still follows its row's chain super-block by super-block.
 */
#define KX8_GRP 4
#define KX8_TOK 8
#define KX8_GCHUNK 16

struct kx8_unp {
	__m256i q[64];  /* Q4_K/Q5_K: [2 (8j + m)] lo, [+ 1] hi; Q6_K: [4 (8h + m) + k] */
	__m256i sv[16]; /* scale vectors */
	__m256i mnp[4]; /* Q4_K/Q5_K min pairs */
};

static inline __attribute__((always_inline)) void kx8_unpack(int ty, const unsigned char *b, struct kx8_unp *u)
{
	if (ty == 6) {
		kx8_k6_scales(b, u->sv);
		for (int h = 0; h < 2; h++)
			for (int m = 0; m < 8; m++)
				kx8_k6_quants(b, h, m, &u->q[4 * (8 * h + m)]);
		return;
	}
	kx8_k4_scales(b, u->sv, u->mnp);
	for (int j = 0; j < 4; j++)
		for (int m = 0; m < 8; m++)
			kx8_k4_quants(ty == 5, b, j, m, &u->q[2 * (8 * j + m)], &u->q[2 * (8 * j + m) + 1]);
}

/* one unpacked super-block (group block b) against the blocks x[0..nx-1]
 * (nx = 1 or 2) of one or two tokens: each quant vector loaded once for
 * both, lanes in halves of 4 so that both tokens' sums stay in registers */
static inline __attribute__((always_inline)) void kx8_tok(int ty, int nx, const unsigned char *b,
							   const struct kx8_unp *u, const struct nf_block_q8_K *const x[2],
							   const struct kx8_tab *const t[2], __m256 *const acc[2],
							   __m256 *const accm[2])
{
	for (int e = 0; e < nx && ty != 6; e++)
		kx8_k4_mins(ty == 5, u->mnp, t[e], kx8_d(b + 16, -t[e]->d), accm[e]);
	_Pragma("GCC unroll 1") for (int mh = 0; mh < 8; mh += 4) {
		__m256i sumi[2][4];
		for (int e = 0; e < 2; e++)
			for (int mm = 0; mm < 4; mm++)
				sumi[e][mm] = _mm256_setzero_si256();
		if (ty == 6) {
			_Pragma("GCC unroll 1") for (int h = 0; h < 2; h++)
				_Pragma("GCC unroll 4") for (int mm = 0; mm < 4; mm++)
					_Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
						const int m = mh + mm, g = 4 * h + k;
						const __m256i v = u->q[4 * (8 * h + m) + k], sc = u->sv[2 * g + mh / 4];
						for (int e = 0; e < nx; e++)
							sumi[e][mm] = _mm256_add_epi32(sumi[e][mm], kx8_k6_dot(v, x[e]->qs, t[e], g, m, sc));
					}
		} else {
			_Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
				const __m256i s0 = u->sv[2 * j], s1 = u->sv[2 * j + 1];
				_Pragma("GCC unroll 4") for (int mm = 0; mm < 4; mm++) {
					const int m = mh + mm;
					const __m256i lo = u->q[2 * (8 * j + m)], hi = u->q[2 * (8 * j + m) + 1];
					for (int e = 0; e < nx; e++)
						sumi[e][mm] = _mm256_add_epi32(sumi[e][mm], kx8_k4_dot(lo, hi, x[e]->qs, j, m, s0, s1));
				}
			}
		}
		for (int e = 0; e < nx; e++) {
			const __m256 dv = kx8_d(b, t[e]->d);
			for (int mm = 0; mm < 4; mm++)
				acc[e][mh + mm] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(sumi[e][mm]), acc[e][mh + mm]);
		}
	}
}

static inline __attribute__((always_inline)) void kx8_gemm_tile(int ty, size_t nsb, const unsigned char *w, size_t g0,
								 size_t g1, const char *xq, size_t xq_stride, size_t nt,
								 float *y, size_t ldy)
{
	const size_t bs = kx8_bs(ty);
	__m256 acc[KX8_GRP][KX8_TOK][8], accm[KX8_GRP][KX8_TOK][4];
	struct kx8_tab tab[KX8_TOK][KX8_GCHUNK];
	struct kx8_unp u;
	for (size_t g = g0; g < g1; g++)
		for (size_t t = 0; t < nt; t++)
			kx8_zero(acc[g - g0][t], accm[g - g0][t]);
	for (size_t c = 0; c < nsb; c += KX8_GCHUNK) {
		size_t cn = nsb - c < KX8_GCHUNK ? nsb - c : KX8_GCHUNK;
		for (size_t t = 0; t < nt; t++)
			kx8_table(ty == 6, (const struct nf_block_q8_K *)(xq + t * xq_stride) + c, cn, tab[t]);
		for (size_t g = g0; g < g1; g++) {
			const unsigned char *b = w + (g * nsb + c) * bs;
			for (size_t i = 0; i < cn; i++, b += bs) {
				kx8_unpack(ty, b, &u);
				for (size_t t = 0; t < nt; t += 2) {
					size_t t1 = t + 1 < nt ? t + 1 : t;
					const struct nf_block_q8_K *x2[2] = {
						(const struct nf_block_q8_K *)(xq + t * xq_stride) + c + i,
						(const struct nf_block_q8_K *)(xq + t1 * xq_stride) + c + i,
					};
					const struct kx8_tab *t2[2] = { &tab[t][i], &tab[t1][i] };
					__m256 *a2[2] = { acc[g - g0][t], acc[g - g0][t1] };
					__m256 *m2[2] = { accm[g - g0][t], accm[g - g0][t1] };
					if (t1 > t)
						kx8_tok(ty, 2, b, &u, x2, t2, a2, m2);
					else
						kx8_tok(ty, 1, b, &u, x2, t2, a2, m2);
				}
			}
		}
	}
	for (size_t g = g0; g < g1; g++)
		for (size_t t = 0; t < nt; t++)
			kx8_out(ty, acc[g - g0][t], accm[g - g0][t], y + t * ldy + 8 * g);
}

static inline __attribute__((always_inline)) void kx8_gemm(int ty, size_t n, size_t nrows, const void *w, size_t nbat,
							    const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	size_t ng = nrows / 8;
	for (size_t g0 = 0; g0 < ng; g0 += KX8_GRP) {
		size_t g1 = g0 + KX8_GRP < ng ? g0 + KX8_GRP : ng;
		for (size_t b = 0; b < nbat; b += KX8_TOK)
			kx8_gemm_tile(ty, n / NF_QK_K, w, g0, g1, (const char *)xq + b * xq_stride, xq_stride,
				      nbat - b < KX8_TOK ? nbat - b : KX8_TOK, y + b * ldy, ldy);
	}
}

#define KX8_ENTRIES(T, TY)                                                                                  \
	void nf_kavx2_gemv_x8_##T(size_t n, size_t nrows, const void *w, const void *xq, float *y)          \
	{                                                                                                   \
		kx8_groups(TY, n / NF_QK_K, w, nrows / 8, xq, y);                                           \
	}                                                                                                   \
	void nf_kavx2_gemm_x8_##T(size_t n, size_t nrows, const void *w, size_t nb, const void *xq,         \
				  size_t xq_stride, float *y, size_t ldy)                                   \
	{                                                                                                   \
		kx8_gemm(TY, n, nrows, w, nb, xq, xq_stride, y, ldy);                                       \
	}

KX8_ENTRIES(Q4_K, 4)
KX8_ENTRIES(Q5_K, 5)
KX8_ENTRIES(Q6_K, 6)
