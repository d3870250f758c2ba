/*
 * kernels.c - kernel type mapping, ISA selection and RoPE.
 *
 * Invariants:
 * 1. The table is chosen once per process (pthread_once) and never changes
 *    afterwards; that choice is the only mutable state in the kernels.
 * 2. A SIMD table is returned only after the CPU reported every
 *    instruction set its file was compiled for (__builtin_cpu_supports on
 *    x86-64, getauxval(AT_HWCAP) on arm64), so no code path reaches an
 *    instruction the CPU lacks. Only the target's SIMD files are built.
 * 3. NFLASH_ISA=scalar|avx2|avx512 (x86-64), scalar|neon|neon-dot (arm64)
 *    forces a table; a name the CPU or build cannot run falls back to the
 *    best table it can, with one line on stderr.
 */
#if defined(__x86_64__)
#include <cpuid.h>
#endif
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

#if defined(__x86_64__)
/* F16C from CPUID leaf 1 (ECX bit 29): clang 14 has no "f16c" for
 * __builtin_cpu_supports, and the fuzz build compiles this file with it. */
static bool cpu_has_f16c(void)
{
	unsigned int a, b, c, d;
	return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

/* Best first. */
static const char *const isa_order[] = { "avx512", "avx2", "scalar" };

static const struct nf_kernels *isa_table(const char *isa)
{
	__builtin_cpu_init();
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
#elif defined(__aarch64__)
#include <sys/auxv.h>

static const char *const isa_order[] = { "neon-dot", "neon", "scalar" };

/* neon: Advanced SIMD (fp16 <-> f32 conversions are part of it);
 * neon-dot: plus the dot-product instructions (sdot, FEAT_DotProd). */
static const struct nf_kernels *isa_table(const char *isa)
{
	unsigned long hw = getauxval(AT_HWCAP);
	if (!(hw & HWCAP_ASIMD))
		return NULL;
	if (!strcmp(isa, "neon"))
		return &nf_kernels_table_neon;
	if (!strcmp(isa, "neon-dot") && (hw & HWCAP_ASIMDDP))
		return &nf_kernels_table_neondot;
	return NULL;
}
#else
static const char *const isa_order[] = { "scalar" };

static const struct nf_kernels *isa_table(const char *isa)
{
	(void)isa;
	return NULL;
}
#endif

const struct nf_kernels *nf_kernels_isa(const char *isa)
{
	if (!isa)
		return NULL;
	if (!strcmp(isa, "scalar"))
		return &nf_kernels_table_ref;
	return isa_table(isa);
}

static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;
static const struct nf_kernels *kernels_chosen;

static void kernels_choose(void)
{
	const char *want = getenv("NFLASH_ISA");
	const struct nf_kernels *k = NULL;

	if (want && *want) {
		k = nf_kernels_isa(want);
		if (!k)
			fprintf(stderr, "nflash: NFLASH_ISA=%s is not available on this CPU or build; "
				"using the best available\n", want);
	}
	for (size_t i = 0; !k && i < sizeof(isa_order) / sizeof(isa_order[0]); i++)
		k = nf_kernels_isa(isa_order[i]);
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

/* ---- Q4_0 and Q8_0 in 8-row groups (kernels.h) ----------------------------- */

/* One group: 8 plain rows <-> nb grouped blocks; bs the plain block's size
 * (the fp16 scale, then bs - 2 quant bytes). */
static void x8_group(unsigned char *plain, unsigned char *grp, size_t nb, size_t bs, size_t row_bytes,
		     int pack)
{
	size_t q = bs - 2;
	for (size_t i = 0; i < nb; i++) {
		unsigned char *g = grp + i * 8 * bs;
		for (int r = 0; r < 8; r++) {
			unsigned char *b = plain + (size_t)r * row_bytes + i * bs;
			memcpy(pack ? g + 2 * r : b, pack ? b : g + 2 * r, 2);
			for (size_t m = 0; m < q / 4; m++) {
				unsigned char *gq = g + 16 + 32 * m + 4 * (size_t)r, *bq = b + 2 + 4 * m;
				memcpy(pack ? gq : bq, pack ? bq : gq, 4);
			}
		}
	}
}

static void x8_convert(enum nf_ktype kt, unsigned char *plain, unsigned char *grp, size_t n, size_t nrows,
		       int pack)
{
	size_t bs = kt == NF_KT_Q4_0 ? sizeof(struct nf_block_q4_0) : sizeof(struct nf_block_q8_0);
	size_t nb = n / NF_QK, row_bytes = nb * bs;
	for (size_t g = 0; g < nrows / 8; g++)
		x8_group(plain + g * 8 * row_bytes, grp + g * 8 * row_bytes, nb, bs, row_bytes, pack);
}

void nf_repack_x8(enum nf_ktype kt, void *dst, const void *src, size_t n, size_t nrows)
{
	x8_convert(kt, (unsigned char *)src, dst, n, nrows, 1);
}

void nf_unpack_x8(enum nf_ktype kt, void *dst, const void *src, size_t n, size_t nrows)
{
	x8_convert(kt, dst, (unsigned char *)src, n, nrows, 0);
}
