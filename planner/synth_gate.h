/*
 * synth_gate.h - private to the synthetic-model generator: out[c] =
 * sum_k b[k] * A[k * nt + c] for c < nt (nt a multiple of 32), on integer
 * valued floats (exact). The AVX2 version is used when the CPU has it.
 */
#ifndef NFLASH_SYNTH_GATE_H
#define NFLASH_SYNTH_GATE_H

#include <stdbool.h>
#include <stdint.h>

#if defined(__x86_64__)
void nf_synth_gate_row_avx2(const float *A, const float *b, uint32_t R, uint32_t nt, float *out);
static inline bool nf_synth_gate_avx2_ok(void)
{
	return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
/* No AVX2 on this target: the portable loop always runs. */
static inline bool nf_synth_gate_avx2_ok(void)
{
	return false;
}
static inline void nf_synth_gate_row_avx2(const float *A, const float *b, uint32_t R, uint32_t nt,
					  float *out)
{
	(void)A, (void)b, (void)R, (void)nt, (void)out;
}
#endif

#endif
