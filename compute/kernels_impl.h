/*
 * kernels_impl.h - private to compute/kernels*.c: the per-ISA tables and the
 * reference functions SIMD tables reuse for ops that are not hot.
 *
 * Invariant: every table fills every entry; a SIMD table either implements
 * an entry itself or points it at the reference function below.
 */
#ifndef NF_KERNELS_IMPL_H
#define NF_KERNELS_IMPL_H

#include <math.h>
#include <string.h>

#include "nflash/kernels.h"

extern const struct nf_kernels nf_kernels_table_ref;
extern const struct nf_kernels nf_kernels_table_avx2;
extern const struct nf_kernels nf_kernels_table_avx512;
extern const struct nf_kernels nf_kernels_table_avx512_256; /* one 256-bit stream for Q4_0 groups */
extern const struct nf_kernels nf_kernels_table_neon;
extern const struct nf_kernels nf_kernels_table_neondot;

/* Reference ops shared with the SIMD tables (compute/kernels_ref.c). */
void nf_kref_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps);
void nf_kref_softmax(float *x, size_t n);
void nf_kref_silu_mul(float *g, const float *u, size_t n);
void nf_kref_relu_mul(float *g, const float *u, size_t n);
void nf_kref_drelu_mul(float *g, const float *u, size_t n);
float nf_kref_dot_f32(const float *a, const float *b, size_t n);
void nf_kref_axpy_f32(size_t n, float a, const float *x, float *y);
void nf_kref_prepare_f16(const float *x, void *xq, size_t n);
void nf_kref_prepare_bf16(const float *x, void *xq, size_t n);
void nf_kref_prepare_f32(const float *x, void *xq, size_t n);
void nf_kref_prepare_q8_0(const float *x, void *xq, size_t n);
void nf_kref_axpy_bf16(size_t n, float a, const void *wrow, float *y);
/* axpy_list as ncols calls of axpy, in ascending order (the definition). */
void nf_kref_axpy_list(void (*axpy)(size_t, float, const void *, float *), size_t n, size_t ncols,
		       const float *a, const void *const *cols, float *y);
/* F16 dot product in llama.cpp's summation order (see kernels_ref.c); the
 * SIMD tables use it for rows that are not a multiple of 16 long. */
float nf_kref_dot_f16(size_t n, const void *w, const void *x);
float nf_kref_dot_f16v(size_t n, const void *w, const void *x);

/* K-quant down columns (kcol_madd): 16 values of b bits are 2b bytes; word
 * i of a 16-byte source register gathers bytes (ib / 8, ib / 8 + 1), i.e.
 * the value's bits at shift ib % 8 (0x80: nothing, past the 2b bytes);
 * multiplying by 2^(16 - shift - b) puts them at the top of the word, and
 * a right shift by 16 - b leaves the value. Row b - 2 of each table. Both
 * pshufb (per 128-bit lane: values 0-7 then 8-15) and tbl read them. */
/* Calls FN(b, ...) with b a constant 2..6 (so FN's loop specialises), the
 * reference for any other width. */
#define NF_KCOL_BY_BITS(FN, bits, off, col, n, sc, xq, acc)                                        \
	do {                                                                                       \
		switch (bits) {                                                                    \
		case 2: FN(2, off, col, n, sc, xq, acc); break;                                    \
		case 3: FN(3, off, col, n, sc, xq, acc); break;                                    \
		case 4: FN(4, off, col, n, sc, xq, acc); break;                                    \
		case 5: FN(5, off, col, n, sc, xq, acc); break;                                    \
		case 6: FN(6, off, col, n, sc, xq, acc); break;                                    \
		default: nf_kref_kcol_madd(bits, off, col, n, sc, xq, acc); break;                 \
		}                                                                                  \
	} while (0)
extern const uint8_t nf_kcol_idx[5][32];
extern const uint16_t nf_kcol_mul[5][16];
void nf_kref_kcol_madd(uint32_t bits, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
		       int32_t xq, int32_t *acc);
/* QCOL down parts (qcol_down): the reference, and the x86 tables'. */
void nf_kref_qcol_down_q4_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols, const uint16_t *sc,
			    float dx, float *out);
void nf_kref_qcol_down_q8_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols, const uint16_t *sc,
			    float dx, float *out);
void nf_kavx2_qcol_down_q4_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols, const uint16_t *sc,
			     float dx, float *out);
void nf_kavx2_qcol_down_q8_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols, const uint16_t *sc,
			     float dx, float *out);
void nf_kavx512_qcol_down_q4_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols,
			       const uint16_t *sc, float dx, float *out);
void nf_kavx512_qcol_down_q8_0(size_t n, size_t ncols, const int8_t *q, const void *const *cols,
			       const uint16_t *sc, float dx, float *out);
void nf_kavx2_kcol_madd(uint32_t bits, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
			int32_t xq, int32_t *acc);

/* K-quant reference entries (kernels_ref.c): Q8_K activations, ggml's x86
 * order. Any table may point its K-quant entries at these. */
void nf_kref_prepare_q8_K(const float *x, void *xq, size_t n);
/* The reference's gemv, gemm, gemv_list, axpy and axpy_list of type T. */
#define NF_KREF_OPS_DECL(T)                                                                     \
	void nf_kref_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,         \
			      const void *xq, float *y);                                        \
	void nf_kref_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,         \
			      size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy); \
	void nf_kref_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,            \
				   const void *xq, float *y);                                   \
	void nf_kref_axpy_##T(size_t n, float a, const void *wrow, float *y);                  \
	void nf_kref_axpy_list_##T(size_t n, size_t ncols, const float *a,                     \
				   const void *const *cols, float *y);
#define NF_KREF_KQUANT_DECL(T)                                                                  \
	float nf_kref_dot_##T(size_t n, const void *w, const void *x);                          \
	NF_KREF_OPS_DECL(T)
NF_KREF_KQUANT_DECL(q2_K)
NF_KREF_KQUANT_DECL(q3_K)
NF_KREF_KQUANT_DECL(q4_K)
NF_KREF_KQUANT_DECL(q5_K)
NF_KREF_KQUANT_DECL(q6_K)
/* Designated initialisers for one op's five K-quant entries, and for
 * act_prepare's: `.gemv = { ..., NF_KREF_KQUANT(gemv) }`. */
#define NF_KREF_KQUANT(op)                                                                     \
	[NF_KT_Q2_K] = nf_kref_##op##_q2_K, [NF_KT_Q3_K] = nf_kref_##op##_q3_K,                \
	[NF_KT_Q4_K] = nf_kref_##op##_q4_K, [NF_KT_Q5_K] = nf_kref_##op##_q5_K,                \
	[NF_KT_Q6_K] = nf_kref_##op##_q6_K
#define NF_KREF_KQUANT_PREPARE                                                                 \
	[NF_KT_Q2_K] = nf_kref_prepare_q8_K, [NF_KT_Q3_K] = nf_kref_prepare_q8_K,              \
	[NF_KT_Q4_K] = nf_kref_prepare_q8_K, [NF_KT_Q5_K] = nf_kref_prepare_q8_K,              \
	[NF_KT_Q6_K] = nf_kref_prepare_q8_K

/* Q4_1, Q5_0, Q5_1 (kernels_ref.c): the reference's entries serve every
 * table (these types are rare: llama-quantize's fallbacks and old recipes). */
void nf_kref_prepare_q8_1(const float *x, void *xq, size_t n);
NF_KREF_OPS_DECL(q4_1)
NF_KREF_OPS_DECL(q5_0)
NF_KREF_OPS_DECL(q5_1)
#define NF_KREF_LEGACY(op)                                                                     \
	[NF_KT_Q4_1] = nf_kref_##op##_q4_1, [NF_KT_Q5_0] = nf_kref_##op##_q5_0,                \
	[NF_KT_Q5_1] = nf_kref_##op##_q5_1
#define NF_KREF_LEGACY_PREPARE                                                                 \
	[NF_KT_Q4_1] = nf_kref_prepare_q8_1, [NF_KT_Q5_0] = nf_kref_prepare_q8_0,              \
	[NF_KT_Q5_1] = nf_kref_prepare_q8_1
/* The same as member designators, for tables written that way (NEON). */
#define NF_KREF_LEGACY_OP(op)                                                                  \
	.op[NF_KT_Q4_1] = nf_kref_##op##_q4_1, .op[NF_KT_Q5_0] = nf_kref_##op##_q5_0,          \
	.op[NF_KT_Q5_1] = nf_kref_##op##_q5_1
#define NF_KREF_LEGACY_ENTRIES                                                                 \
	.act_prepare[NF_KT_Q4_1] = nf_kref_prepare_q8_1,                                        \
	.act_prepare[NF_KT_Q5_0] = nf_kref_prepare_q8_0,                                        \
	.act_prepare[NF_KT_Q5_1] = nf_kref_prepare_q8_1, NF_KREF_LEGACY_OP(gemv),               \
	NF_KREF_LEGACY_OP(gemm), NF_KREF_LEGACY_OP(gemv_list), NF_KREF_LEGACY_OP(axpy),          \
	NF_KREF_LEGACY_OP(axpy_list)

/* Matrices in 8-row groups (kernels.h): row r's plain block read back
 * from a group block (kernels.c). */
void nf_x8_block_row(enum nf_ktype kt, const void *grp, size_t r, void *plain);
/* The reference's K-quant products on 8-row groups (kernels_ref.c); every
 * table without its own points its Q4_K..Q6_K gemv_x8/gemm_x8 here or
 * leaves them NULL (rows stay plain). */
#define NF_KX8_DECL(P, T)                                                                          \
	void P##_gemv_x8_##T(size_t n, size_t nrows, const void *w, const void *xq, float *y);    \
	void P##_gemm_x8_##T(size_t n, size_t nrows, const void *w, size_t nb, const void *xq,    \
			     size_t xq_stride, float *y, size_t ldy);
NF_KX8_DECL(nf_kref, Q4_K)
NF_KX8_DECL(nf_kref, Q5_K)
NF_KX8_DECL(nf_kref, Q6_K)
NF_KX8_DECL(nf_kavx2, Q4_K)
NF_KX8_DECL(nf_kavx2, Q5_K)
NF_KX8_DECL(nf_kavx2, Q6_K)
/* AVX-512 Q4_0/Q8_0 in 8-row groups (kernels_avx512_x8.c) */
NF_KX8_DECL(nf_kavx512, Q4_0)
NF_KX8_DECL(nf_kavx512, Q8_0)
NF_KX8_DECL(nf_kavx512, Q4_0c) /* NF_KT_Q4_0: llama.cpp's repacked chain */
/* the same chain in one 256-bit stream per call */
void nf_kavx512_gemv_x8_Q4_0y(size_t n, size_t nrows, const void *w, const void *xq, float *y);
#define NF_KREF_X8(op)                                                                             \
	[NF_KT_Q4_K] = nf_kref_##op##_x8_Q4_K, [NF_KT_Q5_K] = nf_kref_##op##_x8_Q5_K,                  \
	[NF_KT_Q6_K] = nf_kref_##op##_x8_Q6_K
#define NF_KAVX2_X8(op)                                                                            \
	[NF_KT_Q4_K] = nf_kavx2_##op##_x8_Q4_K, [NF_KT_Q5_K] = nf_kavx2_##op##_x8_Q5_K,                \
	[NF_KT_Q6_K] = nf_kavx2_##op##_x8_Q6_K

/* Q4_K/Q5_K: the 8 six-bit scales and mins of a super-block, one per 32
 * values (ggml's get_scale_min_k4), from its 12 scale bytes. */
static inline void nf_kq_scales_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8])
{
	for (int j = 0; j < 4; j++) {
		sc[j] = s[j] & 63;
		mn[j] = s[j + 4] & 63;
		sc[j + 4] = (uint8_t)((s[j + 8] & 0xf) | ((s[j] >> 6) << 4));
		mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
	}
}

/* Q8_K preparation of one super-block once its largest magnitude amax is
 * known: an all-zero block (returns 0) or the first value of magnitude
 * amax, whose sign the scale takes (the reference's rule). */
static inline float nf_kq_q8_K_max(const float *x, float amax, struct nf_block_q8_K *y)
{
	if (amax == 0.0f) {
		memset(y, 0, sizeof(*y));
		return 0.0f;
	}
	for (int j = 0; j < NF_QK_K; j++)
		if (fabsf(x[j]) == amax)
			return x[j];
	return amax;
}

/* Q3_K: the 16 signed scales (-32..31), one per 16 values. */
static inline void nf_kq_scales_k3(const uint8_t *s, int8_t sc[16])
{
	for (int i = 0; i < 16; i++) {
		int lo = i < 8 ? s[i] & 0xf : s[i - 8] >> 4;
		int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
		sc[i] = (int8_t)((lo | (hi << 4)) - 32);
	}
}

/* AVX2 K-quant kernels (kernels_avx2_kquant.c), for the AVX2 and AVX-512
 * tables: Q8_K preparation and Q2_K..Q6_K products with the reference's
 * bits, and the axpys (y += a * row) with the reference's bits too. */
void nf_kavx2_prepare_q8_K(const float *x, void *xq, size_t n);
#define NF_KAVX2_KQUANT_DECL(T)                                                                 \
	void nf_kavx2_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			       const void *xq, float *y);                                       \
	void nf_kavx2_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,        \
			       size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy); \
	void nf_kavx2_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,           \
				    const void *xq, float *y);                                  \
	void nf_kavx2_axpy_##T(size_t n, float a, const void *wrow, float *y);                 \
	void nf_kavx2_axpy_list_##T(size_t n, size_t ncols, const float *a,                     \
				    const void *const *cols, float *y);
NF_KAVX2_KQUANT_DECL(q2_K)
NF_KAVX2_KQUANT_DECL(q3_K)
NF_KAVX2_KQUANT_DECL(q4_K)
NF_KAVX2_KQUANT_DECL(q5_K)
NF_KAVX2_KQUANT_DECL(q6_K)
#define NF_KAVX2_KQUANT(op)                                                                    \
	[NF_KT_Q2_K] = nf_kavx2_##op##_q2_K, [NF_KT_Q3_K] = nf_kavx2_##op##_q3_K,              \
	[NF_KT_Q4_K] = nf_kavx2_##op##_q4_K, [NF_KT_Q5_K] = nf_kavx2_##op##_q5_K,              \
	[NF_KT_Q6_K] = nf_kavx2_##op##_q6_K
#define NF_KAVX2_KQUANT_PREPARE                                                                \
	[NF_KT_Q2_K] = nf_kavx2_prepare_q8_K, [NF_KT_Q3_K] = nf_kavx2_prepare_q8_K,            \
	[NF_KT_Q4_K] = nf_kavx2_prepare_q8_K, [NF_KT_Q5_K] = nf_kavx2_prepare_q8_K,            \
	[NF_KT_Q6_K] = nf_kavx2_prepare_q8_K

/* AVX2 ops the AVX-512 table reuses (compute/kernels_avx2.c); call only
 * when the AVX2 table itself is available. */
void nf_kavx2_prepare_q8_0(const float *x, void *xq, size_t n);
void nf_kavx2_prepare_f16(const float *x, void *xq, size_t n);
void nf_kavx2_prepare_bf16(const float *x, void *xq, size_t n);
void nf_kavx2_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps);
void nf_kavx2_axpy_f32(size_t n, float a, const void *wrow, float *y);
void nf_kavx2_axpy_f16(size_t n, float a, const void *wrow, float *y);
void nf_kavx2_axpy_bf16(size_t n, float a, const void *wrow, float *y);
void nf_kavx2_axpy_q8_0(size_t n, float a, const void *wrow, float *y);
void nf_kavx2_axpy_q4_0(size_t n, float a, const void *wrow, float *y);
float nf_kavx2_dot_f32v(const float *a, const float *b, size_t n);
void nf_kavx2_axpy_f32v(size_t n, float a, const float *x, float *y);
void nf_kavx2_softmax(float *x, size_t n);
void nf_kavx2_silu_mul(float *g, const float *u, size_t n);
/* Quantized products in llama.cpp's summation order (kernels_ref.c); the
 * AVX-512 table uses them so every ISA rounds the same way. */
void nf_kavx2_gemv_q8_0(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq, float *y);
void nf_kavx2_gemv_q4_0l(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq, float *y);
void nf_kavx2_gemm_q8_0(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nb,
			const void *xq, size_t xq_stride, float *y, size_t ldy);
void nf_kavx2_gemv_list_q8_0(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y);
void nf_kavx2_gemv_list_q4_0l(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y);
void nf_kavx2_axpy_list_f32(size_t n, size_t ncols, const float *a, const void *const *cols, float *y);
void nf_kavx2_axpy_list_f16(size_t n, size_t ncols, const float *a, const void *const *cols, float *y);
void nf_kavx2_axpy_list_bf16(size_t n, size_t ncols, const float *a, const void *const *cols, float *y);
void nf_kavx2_gemm_q4_0l(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nb,
			const void *xq, size_t xq_stride, float *y, size_t ldy);
/* NF_KT_Q4_0, llama.cpp's repacked order (kernels_ref.c dot_q4_0). */
void nf_kavx2_gemv_q4_0(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq, float *y);
void nf_kavx2_gemm_q4_0(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nb,
			const void *xq, size_t xq_stride, float *y, size_t ldy);
void nf_kavx2_gemv_list_q4_0(size_t n, size_t nrows, const void *const *rows, const void *xq, float *y);
void nf_kavx2_gemv_x8_Q4_0(size_t n, size_t nrows, const void *w, const void *xq, float *y);
void nf_kavx2_gemm_x8_Q4_0(size_t n, size_t nrows, const void *w, size_t nb, const void *xq, size_t xq_stride,
			   float *y, size_t ldy);

/* NEON ops both arm64 tables use (compute/kernels_neon.c): everything but
 * the integer block products, which kernels_neon_q.h builds per table. */
void nf_kneon_prepare_q8_0(const float *x, void *xq, size_t n);
void nf_kneon_prepare_f16(const float *x, void *xq, size_t n);
void nf_kneon_prepare_bf16(const float *x, void *xq, size_t n);
#define NF_KNEON_FLOAT_DECL(T)                                                                     \
	void nf_kneon_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,           \
			       const void *xq, float *y);                                          \
	void nf_kneon_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nb, \
			       const void *xq, size_t xq_stride, float *y, size_t ldy);            \
	void nf_kneon_gemv_list_##T(size_t n, size_t nrows, const void *const *rows, const void *xq, \
				    float *y);
NF_KNEON_FLOAT_DECL(f32)
NF_KNEON_FLOAT_DECL(f16)
NF_KNEON_FLOAT_DECL(f16v)
NF_KNEON_FLOAT_DECL(bf16)
#define NF_KNEON_AXPY_DECL(T)                                                                      \
	void nf_kneon_axpy_##T(size_t n, float a, const void *wrow, float *y);                    \
	void nf_kneon_axpy_list_##T(size_t n, size_t ncols, const float *a, const void *const *cols, \
				    float *y);
NF_KNEON_AXPY_DECL(f32)
NF_KNEON_AXPY_DECL(f16)
NF_KNEON_AXPY_DECL(bf16)
NF_KNEON_AXPY_DECL(q8_0)
NF_KNEON_AXPY_DECL(q4_0)
void nf_kneon_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps);
void nf_kneon_softmax(float *x, size_t n);
void nf_kneon_silu_mul(float *g, const float *u, size_t n);
float nf_kneon_dot_f32v(const float *a, const float *b, size_t n);
void nf_kneon_axpy_f32v(size_t n, float a, const float *x, float *y);

#define NF_KNEON_SHARED_ENTRIES                                                                    \
	.act_prepare[NF_KT_F32] = nf_kref_prepare_f32, .act_prepare[NF_KT_F16] = nf_kneon_prepare_f16, \
	.act_prepare[NF_KT_BF16] = nf_kneon_prepare_bf16,                                          \
	.act_prepare[NF_KT_Q8_0] = nf_kneon_prepare_q8_0,                                          \
	.act_prepare[NF_KT_Q4_0] = nf_kneon_prepare_q8_0,                                          \
	.act_prepare[NF_KT_Q4_0L] = nf_kneon_prepare_q8_0,                                         \
	.gemv[NF_KT_F32] = nf_kneon_gemv_f32, .gemv[NF_KT_F16] = nf_kneon_gemv_f16,                \
	.gemv[NF_KT_BF16] = nf_kneon_gemv_bf16, .gemv[NF_KT_F16V] = nf_kneon_gemv_f16v,            \
	.gemm[NF_KT_F32] = nf_kneon_gemm_f32, .gemm[NF_KT_F16] = nf_kneon_gemm_f16,                \
	.gemm[NF_KT_BF16] = nf_kneon_gemm_bf16, .gemm[NF_KT_F16V] = nf_kneon_gemm_f16v,            \
	.gemv_list[NF_KT_F32] = nf_kneon_gemv_list_f32, .gemv_list[NF_KT_F16] = nf_kneon_gemv_list_f16, \
	.gemv_list[NF_KT_BF16] = nf_kneon_gemv_list_bf16,                                          \
	.gemv_list[NF_KT_F16V] = nf_kneon_gemv_list_f16v,                                          \
	.act_prepare[NF_KT_F16V] = nf_kneon_prepare_f16, .axpy[NF_KT_F16V] = nf_kneon_axpy_f16,    \
	.axpy_list[NF_KT_F16V] = nf_kneon_axpy_list_f16,                                           \
	.axpy[NF_KT_F32] = nf_kneon_axpy_f32, .axpy[NF_KT_F16] = nf_kneon_axpy_f16,                \
	.axpy[NF_KT_BF16] = nf_kneon_axpy_bf16, .axpy[NF_KT_Q8_0] = nf_kneon_axpy_q8_0,            \
	.axpy[NF_KT_Q4_0] = nf_kneon_axpy_q4_0,                                                    \
	.axpy[NF_KT_Q4_0L] = nf_kneon_axpy_q4_0,                                                   \
	.axpy_list[NF_KT_F32] = nf_kneon_axpy_list_f32, .axpy_list[NF_KT_F16] = nf_kneon_axpy_list_f16, \
	.axpy_list[NF_KT_BF16] = nf_kneon_axpy_list_bf16,                                          \
	.axpy_list[NF_KT_Q8_0] = nf_kneon_axpy_list_q8_0,                                          \
	.axpy_list[NF_KT_Q4_0] = nf_kneon_axpy_list_q4_0,                                          \
	.axpy_list[NF_KT_Q4_0L] = nf_kneon_axpy_list_q4_0,                                         \
	.rmsnorm = nf_kneon_rmsnorm, .softmax = nf_kneon_softmax, .silu_mul = nf_kneon_silu_mul,  \
	.relu_mul = nf_kref_relu_mul, .drelu_mul = nf_kref_drelu_mul,                              \
	.dot_f32 = nf_kneon_dot_f32v, .axpy_f32 = nf_kneon_axpy_f32v,                              \
	.qcol_down[NF_KT_Q8_0] = nf_kref_qcol_down_q8_0, .qcol_down[NF_KT_Q4_0] = nf_kref_qcol_down_q4_0, \
	.qcol_down[NF_KT_Q4_0L] = nf_kref_qcol_down_q4_0
/* (the arm64 tables' K-quant entries, axpys included, are
 * kernels_neon_kquant.h's) */

#endif /* NF_KERNELS_IMPL_H */
