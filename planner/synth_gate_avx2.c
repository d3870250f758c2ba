/*
 * synth_gate_avx2.c - the low-rank gate product of the synthetic-model
 * generator, compiled for AVX2/FMA (chosen at run time by synth_write.c).
 *
 * Invariant: the factors are integers and every partial sum is an integer
 * below 2^24, so FMA, vector width and summation order cannot change a bit
 * of the result: this file and the portable version give the same bytes.
 */
#include <stdint.h>
#include <string.h>

#include "synth_gate.h"

typedef float v8 __attribute__((vector_size(32)));

void nf_synth_gate_row_avx2(const float *A, const float *b, uint32_t R, uint32_t nt, float *out)
{
	for (uint32_t c = 0; c < nt; c += 32) {
		v8 acc0 = { 0 }, acc1 = { 0 }, acc2 = { 0 }, acc3 = { 0 };
		for (uint32_t k = 0; k < R; k++) {
			const float *a = A + (size_t)k * nt + c;
			v8 bk = { b[k], b[k], b[k], b[k], b[k], b[k], b[k], b[k] };
			v8 a0, a1, a2, a3;
			memcpy(&a0, a, 32);
			memcpy(&a1, a + 8, 32);
			memcpy(&a2, a + 16, 32);
			memcpy(&a3, a + 24, 32);
			acc0 += bk * a0;
			acc1 += bk * a1;
			acc2 += bk * a2;
			acc3 += bk * a3;
		}
		memcpy(out + c, &acc0, 32);
		memcpy(out + c + 8, &acc1, 32);
		memcpy(out + c + 16, &acc2, 32);
		memcpy(out + c + 24, &acc3, 32);
	}
}
