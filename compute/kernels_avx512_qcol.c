/*
 * kernels_avx512_qcol.c - the sparse FFN's QCOL down parts (qcol_down) for
 * the AVX-512 table; the same sums as kernels_avx2_qcol.c, 32 rows a
 * register.
 *
 * Invariants: as kernels_avx2_qcol.c's: Q4_0 sums in int16 lanes (at most
 * 32 * 127 * 8 = 32512), Q8_0 sums in int32, and per row out = fma(sum,
 * scale * dx, out), so results have the reference's bits.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels_impl.h"

/* out[0 .. 16) = fma(acc, f16(sc) * dx, out), acc 16 int32 */
static inline void scale_add16(float *out, const uint16_t *sc, __m512 dx, __m512i acc)
{
	__m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
	_mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, dx), _mm512_loadu_ps(out)));
}

/* 32 rows of a Q4_0 column (16 bytes, low nibble first) as int16 values 0..15 in row order */
static inline __m512i nib32(const uint8_t *p)
{
	__m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
	return _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0x0f)),
			       _mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0xf0)), 12));
}

static inline void scale_add32(float *out, const uint16_t *sc, __m512 dx, __m512i a)
{
	scale_add16(out, sc, dx, _mm512_cvtepi16_epi32(_mm512_castsi512_si256(a)));
	scale_add16(out + 16, sc + 16, dx, _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(a, 1)));
}

void nf_kavx512_qcol_down_q4_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols,
			       const uint16_t *sc, float dx, float *out)
{
	const __m512i eight = _mm512_set1_epi16(8);
	const __m512 vdx = _mm512_set1_ps(dx);
	size_t r = 0;
	for (; r + 128 <= n; r += 128) {
		__m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
		for (size_t c = 0; c < ncols; c++) {
			const uint8_t *p = (const uint8_t *)cols[c] + r / 2;
			__m512i qv = _mm512_set1_epi16(q[c]);
			a0 = _mm512_add_epi16(a0, _mm512_mullo_epi16(_mm512_sub_epi16(nib32(p), eight), qv));
			a1 = _mm512_add_epi16(a1, _mm512_mullo_epi16(_mm512_sub_epi16(nib32(p + 16), eight), qv));
			a2 = _mm512_add_epi16(a2, _mm512_mullo_epi16(_mm512_sub_epi16(nib32(p + 32), eight), qv));
			a3 = _mm512_add_epi16(a3, _mm512_mullo_epi16(_mm512_sub_epi16(nib32(p + 48), eight), qv));
		}
		scale_add32(out + r, sc + r, vdx, a0);
		scale_add32(out + r + 32, sc + r + 32, vdx, a1);
		scale_add32(out + r + 64, sc + r + 64, vdx, a2);
		scale_add32(out + r + 96, sc + r + 96, vdx, a3);
	}
	for (; r < n; r += 32) { /* n is a multiple of 32 */
		__m512i a0 = _mm512_setzero_si512();
		for (size_t c = 0; c < ncols; c++)
			a0 = _mm512_add_epi16(a0, _mm512_mullo_epi16(
							  _mm512_sub_epi16(nib32((const uint8_t *)cols[c] + r / 2), eight),
							  _mm512_set1_epi16(q[c])));
		scale_add32(out + r, sc + r, vdx, a0);
	}
}

void nf_kavx512_qcol_down_q8_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols,
			       const uint16_t *sc, float dx, float *out)
{
	const __m512 vdx = _mm512_set1_ps(dx);
	size_t r = 0;
	for (; r + 64 <= n; r += 64) {
		__m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
		for (size_t c = 0; c < ncols; c++) {
			const int8_t *p = (const int8_t *)cols[c] + r;
			__m512i qv = _mm512_set1_epi32(q[c]);
			a0 = _mm512_add_epi32(a0, _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), qv));
			a1 = _mm512_add_epi32(a1, _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), qv));
			a2 = _mm512_add_epi32(a2, _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32))), qv));
			a3 = _mm512_add_epi32(a3, _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 48))), qv));
		}
		scale_add16(out + r, sc + r, vdx, a0);
		scale_add16(out + r + 16, sc + r + 16, vdx, a1);
		scale_add16(out + r + 32, sc + r + 32, vdx, a2);
		scale_add16(out + r + 48, sc + r + 48, vdx, a3);
	}
	if (r < n) { /* n is a multiple of 32: one 32-row tail */
		__m512i a0 = _mm512_setzero_si512(), a1 = a0;
		for (size_t c = 0; c < ncols; c++) {
			const int8_t *p = (const int8_t *)cols[c] + r;
			__m512i qv = _mm512_set1_epi32(q[c]);
			a0 = _mm512_add_epi32(a0, _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), qv));
			a1 = _mm512_add_epi32(a1, _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), qv));
		}
		scale_add16(out + r, sc + r, vdx, a0);
		scale_add16(out + r + 16, sc + r + 16, vdx, a1);
	}
}
