/*
 * kernels.c - kernel type mapping, ISA selection and RoPE.
 *
 * Invariants:
 * 1. The table is chosen once per process (pthread_once) and never changes
 *    afterwards; that choice is the only mutable state in the kernels.
 * 2. A SIMD table is returned only after __builtin_cpu_supports has seen
 *    every instruction set its file was compiled for, so no code path
 *    reaches an instruction the CPU lacks.
 * 3. NFLASH_ISA=scalar|avx2|avx512 forces a table; a name the CPU cannot run
 *    falls back to the best table it can, with one line on stderr.
 */
#include <cpuid.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_impl.h"

int nf_ktype_of(uint32_t dtype)
{
	switch (dtype) {
	case NF_DTYPE_F32: return NF_KT_F32;
	case NF_DTYPE_F16: return NF_KT_F16;
	case NF_DTYPE_BF16: return NF_KT_BF16;
	case NF_DTYPE_Q8_0: return NF_KT_Q8_0;
	case NF_DTYPE_Q4_0: return NF_KT_Q4_0;
	case NF_DTYPE_Q2_K: return NF_KT_Q2_K;
	case NF_DTYPE_Q3_K: return NF_KT_Q3_K;
	case NF_DTYPE_Q4_K: return NF_KT_Q4_K;
	case NF_DTYPE_Q5_K: return NF_KT_Q5_K;
	case NF_DTYPE_Q6_K: return NF_KT_Q6_K;
	default: return -1;
	}
}

uint32_t nf_ktype_dot_dtype(enum nf_ktype kt)
{
	switch (kt) {
	case NF_KT_F16: return NF_DTYPE_F16;
	case NF_KT_BF16: return NF_DTYPE_BF16;
	case NF_KT_Q8_0: case NF_KT_Q4_0: return NF_DTYPE_Q8_0;
	case NF_KT_Q2_K: case NF_KT_Q3_K: case NF_KT_Q4_K: case NF_KT_Q5_K:
	case NF_KT_Q6_K: return NF_DTYPE_Q8_K;
	case NF_KT_F32: default: return NF_DTYPE_F32;
	}
}

size_t nf_act_size(enum nf_ktype kt, size_t n)
{
	return nf_dtype_row_size(nf_ktype_dot_dtype(kt), n);
}

const struct nf_kernels *nf_kernels_ref(void)
{
	return &nf_kernels_table_ref;
}

/* F16C from CPUID leaf 1 (ECX bit 29): clang 14 has no "f16c" for
 * __builtin_cpu_supports, and the fuzz build compiles this file with it. */
static bool cpu_has_f16c(void)
{
	unsigned int a, b, c, d;
	return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

const struct nf_kernels *nf_kernels_isa(const char *isa)
{
	if (!isa)
		return NULL;
	__builtin_cpu_init();
	if (!strcmp(isa, "scalar"))
		return &nf_kernels_table_ref;
	if (!strcmp(isa, "avx2") && __builtin_cpu_supports("avx2") &&
	    __builtin_cpu_supports("fma") && cpu_has_f16c())
		return &nf_kernels_table_avx2;
	if (!strcmp(isa, "avx512") && __builtin_cpu_supports("avx2") &&
	    __builtin_cpu_supports("fma") && cpu_has_f16c() &&
	    __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
	    __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16"))
		return &nf_kernels_table_avx512;
	return NULL;
}

static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;
static const struct nf_kernels *kernels_chosen;

static void kernels_choose(void)
{
	static const char *const order[] = { "avx512", "avx2", "scalar" };
	const char *want = getenv("NFLASH_ISA");
	const struct nf_kernels *k = NULL;

	if (want && *want) {
		k = nf_kernels_isa(want);
		if (!k)
			fprintf(stderr, "nflash: NFLASH_ISA=%s is not available on this CPU or build; "
				"using the best available\n", want);
	}
	for (size_t i = 0; !k && i < sizeof(order) / sizeof(order[0]); i++)
		k = nf_kernels_isa(order[i]);
	kernels_chosen = k;
}

const struct nf_kernels *nf_kernels_get(void)
{
	pthread_once(&kernels_once, kernels_choose);
	return kernels_chosen;
}

/*
 * RoPE as ggml computes it (mode 0, no YaRN): theta starts at pos and is
 * multiplied by base^(-2/head_dim) once per pair in f32, then scaled by
 * freq_scale; the rotation is x0*c - x1*s, x0*s + x1*c.
 */
void nf_rope(float *x, size_t n_head, size_t head_dim, int64_t pos, float freq_base,
	     float freq_scale)
{
	const float theta_scale = powf(freq_base, -2.0f / (float)head_dim);
	float theta = (float)pos;
	for (size_t i = 0; i < head_dim; i += 2) {
		float t = freq_scale * theta;
		float c = cosf(t), s = sinf(t);
		for (size_t h = 0; h < n_head; h++) {
			float *p = x + h * head_dim + i;
			float x0 = p[0], x1 = p[1];
			p[0] = x0 * c - x1 * s;
			p[1] = x0 * s + x1 * c;
		}
		theta *= theta_scale;
	}
}
