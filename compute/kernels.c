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
 * 3. NFLASH_ISA=scalar|avx2|avx512|avx512-256 (x86-64), scalar|neon|neon-dot
 *    (arm64) forces a table; a name the CPU or build cannot run falls back to the
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
	case NF_DTYPE_Q4_1: return NF_KT_Q4_1;
	case NF_DTYPE_Q5_0: return NF_KT_Q5_0;
	case NF_DTYPE_Q5_1: return NF_KT_Q5_1;
	default: return -1;
	}
}

int nf_ktype_matrix(uint32_t dtype, uint64_t nrows, bool vec_dot_order)
{
	int kt = nf_ktype_of(dtype);
	if (kt == NF_KT_Q4_0 && (nrows % 8 || vec_dot_order))
		kt = NF_KT_Q4_0L;
	if (kt == NF_KT_F16 && vec_dot_order)
		kt = NF_KT_F16V;
	return kt;
}

int nf_ktype_column(int kt, size_t nb)
{
	return kt == NF_KT_F16 && nb == 1 ? NF_KT_F16V : kt;
}

uint32_t nf_ktype_dot_dtype(enum nf_ktype kt)
{
	switch (kt) {
	case NF_KT_F16: case NF_KT_F16V: return NF_DTYPE_F16;
	case NF_KT_BF16: return NF_DTYPE_BF16;
	case NF_KT_Q8_0: case NF_KT_Q4_0: case NF_KT_Q4_0L: case NF_KT_Q5_0: return NF_DTYPE_Q8_0;
	case NF_KT_Q4_1: case NF_KT_Q5_1: return NF_DTYPE_Q8_1;
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

/*
 * A core that runs every 512-bit operation as two 256-bit halves: AMD's
 * family 19h with AVX-512 (Zen 4; Zen 3, the same family, has none). There
 * the AVX-512 table with one 256-bit stream for Q4_0 groups is the faster
 * one (docs/KERNELS.md "One stream on Zen 4"); Zen 5 (family 1Ah) and
 * Intel's cores run 512 bits at once.
 */
static bool cpu_splits_512(void)
{
	unsigned int a, b, c, d;
	if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541 || d != 0x69746e65 || c != 0x444d4163)
		return false; /* "AuthenticAMD" */
	if (!__get_cpuid(1, &a, &b, &c, &d))
		return false;
	unsigned int family = (a >> 8) & 0xf;
	if (family == 0xf)
		family += (a >> 20) & 0xff;
	return family == 0x19;
}

/* Best first (after isa_preferred). */
static const char *const isa_order[] = { "avx512", "avx2", "scalar" };

/* The table to try before isa_order on this core, or NULL. */
static const char *isa_preferred(void)
{
	return cpu_splits_512() ? "avx512-256" : NULL;
}

static const struct nf_kernels *isa_table(const char *isa)
{
	__builtin_cpu_init();
	if (!strcmp(isa, "avx2") && __builtin_cpu_supports("avx2") &&
	    __builtin_cpu_supports("fma") && cpu_has_f16c())
		return &nf_kernels_table_avx2;
	bool avx512 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c() &&
		      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
		      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
		      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
	if (!avx512)
		return NULL;
	if (!strcmp(isa, "avx512"))
		return &nf_kernels_table_avx512;
	if (!strcmp(isa, "avx512-256"))
		return &nf_kernels_table_avx512_256;
	return NULL;
}
#elif defined(__aarch64__)
#include <sys/auxv.h>

static const char *const isa_order[] = { "neon-dot", "neon", "scalar" };

static const char *isa_preferred(void)
{
	return NULL;
}

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

static const char *isa_preferred(void)
{
	return NULL;
}

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
	if (!k && isa_preferred())
		k = nf_kernels_isa(isa_preferred());
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
 * multiplied by base^(-2/head_dim) once per pair in f32, divided by the
 * pair's frequency factor where the model has them (rope_freqs, LLaMA 3.1
 * and later), then scaled by freq_scale; the rotation is fma(x0, c, -(x1*s)) and fma(x0, s, x1*c),
 * the fused form GCC gives ggml's `x0*c - x1*s` and `x0*s + x1*c` (ggml
 * builds in GNU C mode, -ffp-contract=fast, with FMA on every x86 machine
 * it is tuned for and on arm64). The unfused form moved 93 of tiny-llama's
 * 512 rotated query values by an ulp, and an ulp is enough to flip a Q8_0
 * rounding of a later layer's input. An fma target clone keeps fmaf inline
 * on x86 (the default clone calls libm's fmaf, the same exact operation).
 */
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("fma", "default")))
#endif
void nf_rope(float *x, size_t n_head, size_t head_dim, int64_t pos, float freq_base,
	     float freq_scale, const float *freq_factors)
{
	const float theta_scale = powf(freq_base, -2.0f / (float)head_dim);
	float theta = (float)pos;
	for (size_t i = 0; i < head_dim; i += 2) {
		float t = freq_scale * (freq_factors ? theta / freq_factors[i / 2] : theta);
		float c = cosf(t), s = sinf(t);
		for (size_t h = 0; h < n_head; h++) {
			float *p = x + h * head_dim + i;
			float x0 = p[0], x1 = p[1];
			p[0] = fmaf(x0, c, -(x1 * s));
			p[1] = fmaf(x0, s, x1 * c);
		}
		theta *= theta_scale;
	}
}

/* ---- matrices in 8-row groups (kernels.h) ------------------------------------ */

/*
 * Where each byte of a plain block goes in its group's block: a type's
 * block is a list of fields, each moved as a whole by one rule, for row r
 * and byte b of the field:
 *   X8_FP16   (one fp16 per row)  grp + 2r + b
 *   X8_CHUNK4 (quants)            grp + 32 (b / 4) + 4r + b % 4
 *   X8_BYTES  (scale bytes)       grp + 32 (b / 4) + 16 (r / 4) + 4 (b % 4) + r % 4
 * CHUNK4 puts 4 consecutive bytes of each of the 8 rows in one 32-byte
 * load; BYTES puts byte b of rows 0-3 in the load's low 128-bit lane and of
 * rows 4-7 in its high lane, where one pshufb per lane reaches them.
 */
enum { X8_FP16, X8_CHUNK4, X8_BYTES };
struct x8_field {
	uint16_t plain, grp, len; /* offsets in the plain and group blocks, bytes per row */
	uint8_t kind;
};
struct x8_form {
	size_t bs, qk, nf; /* plain block bytes, values per block, fields */
	struct x8_field f[5];
};

static const struct x8_form *x8_form(enum nf_ktype kt)
{
	static const struct x8_form q4_0 = { 18, NF_QK, 2, { { 0, 0, 2, X8_FP16 }, { 2, 16, 16, X8_CHUNK4 } } };
	static const struct x8_form q8_0 = { 34, NF_QK, 2, { { 0, 0, 2, X8_FP16 }, { 2, 16, 32, X8_CHUNK4 } } };
	static const struct x8_form q4_K = { 144, NF_QK_K, 4,
					     { { 0, 0, 2, X8_FP16 }, { 2, 16, 2, X8_FP16 },
					       { 4, 32, 12, X8_BYTES }, { 16, 128, 128, X8_CHUNK4 } } };
	static const struct x8_form q5_K = { 176, NF_QK_K, 5,
					     { { 0, 0, 2, X8_FP16 }, { 2, 16, 2, X8_FP16 },
					       { 4, 32, 12, X8_BYTES }, { 16, 128, 32, X8_CHUNK4 },
					       { 48, 384, 128, X8_CHUNK4 } } };
	static const struct x8_form q6_K = { 210, NF_QK_K, 4,
					     { { 208, 0, 2, X8_FP16 }, { 192, 16, 16, X8_BYTES },
					       { 0, 144, 128, X8_CHUNK4 }, { 128, 1168, 64, X8_CHUNK4 } } };
	switch (kt) {
	case NF_KT_Q4_0: case NF_KT_Q4_0L: return &q4_0;
	case NF_KT_Q8_0: return &q8_0;
	case NF_KT_Q4_K: return &q4_K;
	case NF_KT_Q5_K: return &q5_K;
	case NF_KT_Q6_K: return &q6_K;
	default: return NULL;
	}
}

bool nf_x8_supported(enum nf_ktype kt)
{
	return x8_form(kt) != NULL;
}

/* One row's plain block <-> its place in a group block. Each kind in its
 * own loop with constant-size copies: matrices of gigabytes are repacked
 * at load, and a generic loop ran at a few hundred MB/s. */
static void x8_row(const struct x8_field *f, size_t nf, unsigned char *plain, unsigned char *grp, size_t r,
		   int pack)
{
	for (size_t i = 0; i < nf; i++) {
		unsigned char *p = plain + f[i].plain, *g = grp + f[i].grp;
		switch (f[i].kind) {
		case X8_FP16:
			if (pack)
				memcpy(g + 2 * r, p, 2);
			else
				memcpy(p, g + 2 * r, 2);
			break;
		case X8_CHUNK4:
			g += 4 * r;
			if (pack)
				for (size_t b = 0; b < f[i].len; b += 4)
					memcpy(g + 8 * b, p + b, 4);
			else
				for (size_t b = 0; b < f[i].len; b += 4)
					memcpy(p + b, g + 8 * b, 4);
			break;
		default: /* X8_BYTES */
			g += 16 * (r / 4) + r % 4;
			for (size_t b = 0; b < f[i].len; b++) {
				unsigned char *q = g + 32 * (b / 4) + 4 * (b % 4);
				if (pack)
					*q = p[b];
				else
					p[b] = *q;
			}
		}
	}
}

void nf_x8_block_row(enum nf_ktype kt, const void *grp, size_t r, void *plain)
{
	const struct x8_form *fm = x8_form(kt);
	x8_row(fm->f, fm->nf, plain, (unsigned char *)grp, r, 0);
}

static void x8_convert(enum nf_ktype kt, unsigned char *plain, unsigned char *grp, size_t n, size_t nrows,
		       int pack)
{
	const struct x8_form *fm = x8_form(kt);
	if (!fm)
		return;
	size_t nb = n / fm->qk, row_bytes = nb * fm->bs;
	for (size_t g = 0; g < nrows / 8; g++)
		for (size_t i = 0; i < nb; i++)
			for (size_t r = 0; r < 8; r++)
				x8_row(fm->f, fm->nf, plain + (g * 8 + r) * row_bytes + i * fm->bs,
				       grp + g * 8 * row_bytes + i * 8 * fm->bs, r, pack);
}

void nf_repack_x8(enum nf_ktype kt, void *dst, const void *src, size_t n, size_t nrows)
{
	x8_convert(kt, (unsigned char *)src, dst, n, nrows, 1);
}

void nf_unpack_x8(enum nf_ktype kt, void *dst, const void *src, size_t n, size_t nrows)
{
	x8_convert(kt, dst, (unsigned char *)src, n, nrows, 0);
}
