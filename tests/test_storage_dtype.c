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
	cr_assert_eq(nf_dtype_parse("q5_k"), NF_DTYPE_Q5_K);
	cr_assert_eq(nf_dtype_parse("q4_1"), NF_DTYPE_Q4_1);
	cr_assert_eq(nf_dtype_parse("iq4_nl"), -1);
}

static const uint32_t ktypes[] = { NF_DTYPE_Q2_K, NF_DTYPE_Q3_K, NF_DTYPE_Q4_K, NF_DTYPE_Q5_K,
				   NF_DTYPE_Q6_K };

/* Every bit of a random K block survives unpack -> pack (bundles rely on it). */
Test(dtype, kquant_unpack_pack_round_trip)
{
	uint32_t s = 99;
	for (size_t ti = 0; ti < sizeof(ktypes) / sizeof(ktypes[0]); ti++) {
		uint32_t t = ktypes[ti];
		size_t bs = nf_dtype_block_size(t);
		cr_assert_eq(nf_dtype_block_len(t), 256);
		cr_assert(nf_dtype_is_kquant(t));
		for (int rep = 0; rep < 200; rep++) {
			uint8_t blk[256], back[256];
			for (size_t i = 0; i < bs; i++) {
				s = s * 1664525u + 1013904223u;
				blk[i] = (uint8_t)(s >> 24);
			}
			/* finite fp16 scales: d (and dmin) sit at the types' offsets */
			size_t doff = t == NF_DTYPE_Q2_K ? 80 : t == NF_DTYPE_Q3_K ? 108 :
				      t == NF_DTYPE_Q6_K ? 208 : 0;
			blk[doff + 1] &= 0x3b;
			if (t == NF_DTYPE_Q2_K || t == NF_DTYPE_Q4_K || t == NF_DTYPE_Q5_K)
				blk[doff + 3] &= 0x3b;
			struct nf_kblock kb;
			nf_kblock_unpack(t, blk, &kb);
			cr_assert_eq(nf_kblock_pack(t, &kb, back), 0, "%s", nf_dtype_name(t));
			cr_assert_eq(memcmp(blk, back, bs), 0, "%s rep %d", nf_dtype_name(t), rep);
			/* the per-value accessors agree with the unpacked form */
			memset(back, 0, bs);
			size_t qoff, qlen;
			nf_kquant_quant_span(t, &qoff, &qlen);
			memcpy(back, blk, qoff);
			memcpy(back + qoff + qlen, blk + qoff + qlen, bs - qoff - qlen);
			for (uint32_t i = 0; i < 256; i++) {
				uint32_t raw = nf_kquant_get(t, blk, i);
				cr_assert_eq((int)raw - nf_kquant_offset(t), kb.q[i]);
				cr_assert_lt(raw, 1u << nf_kquant_bits(t));
				nf_kquant_set(t, back, i, raw);
			}
			cr_assert_eq(memcmp(blk, back, bs), 0, "%s set/get rep %d", nf_dtype_name(t), rep);
			float y[256], z[256];
			nf_dequantize_row(t, blk, y, 256);
			nf_kblock_dequantize(&kb, z);
			cr_assert_eq(memcmp(y, z, sizeof(y)), 0);
		}
	}
}

/* The encoders fit within a sub-block step; q8_K follows ggml's rule. */
Test(dtype, kquant_encode_and_q8_K)
{
	float x[512], y[512];
	for (int i = 0; i < 512; i++)
		x[i] = sinf(i * 0.37f) * (i < 256 ? 1.0f : 30.0f) + (i % 7) * 0.01f;
	static const float step[] = { 1.0f / 3, 1.0f / 4, 1.0f / 15, 1.0f / 31, 1.0f / 32 };
	for (size_t ti = 0; ti < sizeof(ktypes) / sizeof(ktypes[0]); ti++) {
		uint32_t t = ktypes[ti];
		uint8_t q[2 * 210];
		nf_quantize_row(t, x, q, 512);
		nf_dequantize_row(t, q, y, 512);
		for (int i = 0; i < 512; i++) {
			float range = (i < 256 ? 2.0f : 60.0f) * step[ti];
			cr_assert(fabsf(x[i] - y[i]) <= range * 0.6f + 1e-3f, "%s x[%d]=%g y=%g",
				  nf_dtype_name(t), i, x[i], y[i]);
		}
	}
	struct nf_block_q8_K k8[2];
	nf_quantize_row_q8_K(x, k8, 512);
	for (int b = 0; b < 2; b++) {
		float amax = 0, max = 0;
		for (int j = 0; j < 256; j++)
			if (fabsf(x[256 * b + j]) > amax) {
				amax = fabsf(x[256 * b + j]);
				max = x[256 * b + j];
			}
		float iscale = -127.0f / max;
		cr_assert_eq(k8[b].d, 1.0f / iscale);
		for (int j = 0; j < 256; j++)
			cr_assert_eq(k8[b].qs[j], (int8_t)nearbyintf(iscale * x[256 * b + j]));
		for (int j = 0; j < 16; j++) {
			int sum = 0;
			for (int i = 0; i < 16; i++)
				sum += k8[b].qs[16 * j + i];
			cr_assert_eq(k8[b].bsums[j], sum);
		}
	}
	cr_assert_eq(nf_dtype_row_size(NF_DTYPE_Q4_K, 4096), 16 * 144);
	cr_assert_eq(nf_dtype_row_size(NF_DTYPE_Q6_K, 128), 0);
}
