/*
 * synth_gate.h - private to the synthetic-model generator: out[c] =
 * sum_k b[k] * A[k * nt + c] for c < nt (nt a multiple of 32), on integer
 * valued floats (exact). The AVX2 version is used when the CPU has it.
 */
#ifndef NFLASH_SYNTH_GATE_H
#define NFLASH_SYNTH_GATE_H

#include <stdint.h>

void nf_synth_gate_row_avx2(const float *A, const float *b, uint32_t R, uint32_t nt, float *out);

#endif
