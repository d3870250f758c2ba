/*
 * kernels_avx2_qcol.c - the sparse FFN's QCOL down parts (qcol_down) for
 * the AVX2 table: a group of 32 neurons' Q4_0 or Q8_0 down columns summed
 * per row in exact integers, then scaled by the row's fp16 scale and the
 * activation block's scale and fused into out.
 *
 * Invariants:
 * 1. Q4_0 sums are held in int16 lanes: |q| <= 127 and |nibble - 8| <= 8
 *    over at most 32 columns stay within 32 * 127 * 8 = 32512, so they are
 *    the reference's int32 sums exactly; Q8_0 sums are int32.
 * 2. Per row the float step is the reference's: out = fma(sum, scale * dx,
 *    out) (the step of llama.cpp's dense chain), so results have its bits.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels_impl.h"

/* out[r0 .. r0 + 8) = fma(acc, f16(sc) * dx, out), acc 8 int32 */
static inline void scale_add8(float *out, const uint16_t *sc, __m256 dx, __m256i acc)
{
	__m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
	_mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(s, dx), _mm256_loadu_ps(out)));
}

/* 16 rows of a Q4_0 column (8 bytes, low nibble first) as int16 values 0..15 in row order */
static inline __m256i nib16(const uint8_t *p)
{
	__m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
	return _mm256_or_si256(_mm256_and_si256(d, _mm256_set1_epi32(0x0f)),
			       _mm256_slli_epi32(_mm256_and_si256(d, _mm256_set1_epi32(0xf0)), 12));
}

void nf_kavx2_qcol_down_q4_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols, const uint16_t *sc,
			     float dx, float *out)
{
	const __m256i eight = _mm256_set1_epi16(8);
	const __m256 vdx = _mm256_set1_ps(dx);
	size_t r = 0;
	for (; r + 64 <= n; r += 64) {
		__m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
		for (size_t c = 0; c < ncols; c++) {
			const uint8_t *p = (const uint8_t *)cols[c] + r / 2;
			__m256i qv = _mm256_set1_epi16(q[c]);
			a0 = _mm256_add_epi16(a0, _mm256_mullo_epi16(_mm256_sub_epi16(nib16(p), eight), qv));
			a1 = _mm256_add_epi16(a1, _mm256_mullo_epi16(_mm256_sub_epi16(nib16(p + 8), eight), qv));
			a2 = _mm256_add_epi16(a2, _mm256_mullo_epi16(_mm256_sub_epi16(nib16(p + 16), eight), qv));
			a3 = _mm256_add_epi16(a3, _mm256_mullo_epi16(_mm256_sub_epi16(nib16(p + 24), eight), qv));
		}
		__m256i a[4] = { a0, a1, a2, a3 };
		for (int i = 0; i < 4; i++) {
			scale_add8(out + r + 16 * i, sc + r + 16 * i, vdx,
				   _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a[i])));
			scale_add8(out + r + 16 * i + 8, sc + r + 16 * i + 8, vdx,
				   _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a[i], 1)));
		}
	}
	for (; r < n; r += 16) {
		__m256i a0 = _mm256_setzero_si256();
		for (size_t c = 0; c < ncols; c++)
			a0 = _mm256_add_epi16(a0, _mm256_mullo_epi16(
							  _mm256_sub_epi16(nib16((const uint8_t *)cols[c] + r / 2), eight),
							  _mm256_set1_epi16(q[c])));
		scale_add8(out + r, sc + r, vdx, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a0)));
		scale_add8(out + r + 8, sc + r + 8, vdx, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a0, 1)));
	}
}

void nf_kavx2_qcol_down_q8_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols, const uint16_t *sc,
			     float dx, float *out)
{
	const __m256 vdx = _mm256_set1_ps(dx);
	for (size_t r = 0; r < n; r += 32) { /* n is a multiple of 32 */
		__m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
		for (size_t c = 0; c < ncols; c++) {
			const int8_t *p = (const int8_t *)cols[c] + r;
			__m256i qv = _mm256_set1_epi32(q[c]);
			a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), qv));
			a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))), qv));
			a2 = _mm256_add_epi32(a2, _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16))), qv));
			a3 = _mm256_add_epi32(a3, _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 24))), qv));
		}
		scale_add8(out + r, sc + r, vdx, a0);
		scale_add8(out + r + 8, sc + r + 8, vdx, a1);
		scale_add8(out + r + 16, sc + r + 16, vdx, a2);
		scale_add8(out + r + 24, sc + r + 24, vdx, a3);
	}
}
