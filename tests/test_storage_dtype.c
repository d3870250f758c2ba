/*
 * test_storage_dtype.c - fp16/bf16 conversion and reference quantizers.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "nflash/dtype.h"

/* The software fp16 conversion must be bit-exact with the hardware's (F16C
 * on x86-64, fcvt on arm64) for all floats we can reach cheaply: every fp16
 * value and many halfway/random points. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("f16c")))
static uint16_t hw_fp16(float f)
{
	return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
static bool hw_fp16_ok(void)
{
	__builtin_cpu_init();
	return __builtin_cpu_supports("avx2");
}
#else
static uint16_t hw_fp16(float f)
{
	__fp16 h = (__fp16)f;
	uint16_t u;
	memcpy(&u, &h, 2);
	return u;
}
static bool hw_fp16_ok(void)
{
	return true;
}
#endif

Test(dtype, fp16_matches_f16c)
{
	if (!hw_fp16_ok())
		cr_skip_test("no F16C on this CPU");
	for (uint32_t h = 0; h < 65536; h++) {
		float f = nf_fp16_to_fp32((uint16_t)h);
		if (isnan(f))
			continue;
		cr_assert_eq(nf_fp32_to_fp16(f), h, "round trip of %#x", h);
	}
	uint32_t s = 12345;
	for (int i = 0; i < 2000000; i++) {
		s = s * 1664525u + 1013904223u;
		uint32_t bits = s;
		float f;
		memcpy(&f, &bits, 4);
		if (isnan(f))
			continue;
		cr_assert_eq(nf_fp32_to_fp16(f), hw_fp16(f), "f=%a", f);
	}
}

Test(dtype, q8_0_and_q4_0_round_trip)
{
	float x[64], y[64];
	for (int i = 0; i < 64; i++)
		x[i] = sinf(i * 0.37f) * (i < 32 ? 1.0f : 100.0f);
	struct nf_block_q8_0 q8[2];
	nf_quantize_row_q8_0(x, q8, 64);
	nf_dequantize_row(NF_DTYPE_Q8_0, q8, y, 64);
	for (int i = 0; i < 64; i++)
		cr_assert(fabsf(x[i] - y[i]) <= (i < 32 ? 1.0f : 100.0f) / 127 * 0.51f + 1e-3f);
	struct nf_block_q4_0 q4[2];
	nf_quantize_row_q4_0(x, q4, 64);
	nf_dequantize_row(NF_DTYPE_Q4_0, q4, y, 64);
	for (int i = 0; i < 64; i++)
		cr_assert(fabsf(x[i] - y[i]) <= (i < 32 ? 1.0f : 100.0f) / 8 * 1.01f + 1e-2f);
	cr_assert_eq(nf_dtype_row_size(NF_DTYPE_Q4_0, 4096), 2304);
	cr_assert_eq(nf_dtype_row_size(NF_DTYPE_Q4_0, 100), 0);
	cr_assert_eq(nf_dtype_parse("Q8_0"), NF_DTYPE_Q8_0);
	cr_assert_eq(nf_dtype_parse("q5_k"), -1);
}
