/*
 * nflash/kernels.h - the numeric kernels of the transformer.
 *
 * A plain C reference implements every op; AVX2 and AVX-512 versions
 * (compute/kernels_avx2.c, compute/kernels_avx512.c) implement the same table
 * and are chosen once, at first call of nf_kernels_get(), by cpuid. The
 * environment variable NFLASH_ISA=scalar|avx2|avx512 forces one (for tests
 * and benchmarks; a name this CPU cannot run falls back to the best table,
 * with one line on stderr). AMX is not used. See docs/KERNELS.md.
 *
 * Matrix products follow ggml: the activation vector x is first converted
 * to the weight type's "dot type" (Q8_0 for Q4_0/Q8_0 weights, Q8_K for the
 * K-quants Q2_K..Q6_K, F16 for F16, BF16 for BF16, F32 for F32) and the dot
 * product is taken on that, integer for quantized types. This is what makes
 * logits match llama.cpp to 1e-6.
 *
 *	const struct nf_kernels *k = nf_kernels_get();
 *	enum nf_ktype kt = nf_ktype_of(NF_DTYPE_Q4_0);
 *	k->act_prepare[kt](x, xq, n);                    // xq: nf_act_size(kt, n) bytes
 *	k->gemv[kt](n, rows, W, row_bytes, xq, y);       // y[r] = W[r] . x
 *
 * Kernels never allocate and are thread-safe (callers split rows between
 * threads). Row lengths n are multiples of 32 for Q4_0/Q8_0, of 256 for
 * the K-quants.
 */
#ifndef NFLASH_KERNELS_H
#define NFLASH_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Weight types the kernels index by. Q4_0 has two, the same bytes summed in
 * the two orders llama.cpp uses on x86 (kernels_ref.c):
 *   NF_KT_Q4_0   llama.cpp's repacked Q4_0 (q4_0_8x8, chosen for every Q4_0
 *                matrix of a multiple of 8 rows): per block the exact
 *                integer sum, acc = fma(sum, d_w * d_x, acc);
 *   NF_KT_Q4_0L  ggml's vec_dot_q4_0_q8_0 (rows not a multiple of 8,
 *                PowerInfer's ggml): 8 lanes per block, summed at the end.
 * nf_ktype_matrix() says which a matrix takes. F16 has two as well:
 *   NF_KT_F16    a product of two or more columns, as llamafile's tinyBLAS
 *                sums it (one 16-lane chain per row and column);
 *   NF_KT_F16V   a product of one column (a decode step, the last layer of
 *                a prompt), or any F16 product of PowerInfer's ggml, as
 *                ggml_vec_dot_f16 sums it (four 16-lane chains per 64
 *                values, the tail in double): nf_ktype_column() picks it.
 */
enum nf_ktype {
	NF_KT_F32, NF_KT_F16, NF_KT_BF16, NF_KT_Q8_0, NF_KT_Q4_0,
	NF_KT_Q2_K, NF_KT_Q3_K, NF_KT_Q4_K, NF_KT_Q5_K, NF_KT_Q6_K,
	NF_KT_Q4_0L, NF_KT_F16V,
	NF_KT_Q4_1, NF_KT_Q5_0, NF_KT_Q5_1,
	NF_KT_COUNT,
};

/* The kernel index of a dtype (Q4_0: NF_KT_Q4_0), or -1 if no kernel
 * handles it. */
int nf_ktype_of(uint32_t dtype);
/* The kernel index of a matrix of nrows rows of dtype: nf_ktype_of, but
 * NF_KT_Q4_0L for Q4_0 when nrows is not a multiple of 8 (llama.cpp does
 * not repack it) or vec_dot_order (a model of PowerInfer's ggml). */
int nf_ktype_matrix(uint32_t dtype, uint64_t nrows, bool vec_dot_order);
/* The kernel a product of matrix kernel kt with nb activation columns
 * runs: NF_KT_F16V for NF_KT_F16 when nb == 1 (ggml's mul_mat leaves
 * one-column products to vec_dot, llamafile's sgemm takes two or more);
 * kt otherwise. */
int nf_ktype_column(int kt, size_t nb);
/* The dtype in which activations are given to a weight type's dot product. */
uint32_t nf_ktype_dot_dtype(enum nf_ktype kt);
/* Bytes of a prepared activation row of n values for weight kernel kt. */
size_t nf_act_size(enum nf_ktype kt, size_t n);

struct nf_kernels {
	const char *isa; /* "scalar", "avx2", "avx512", "avx512-256", "neon", "neon-dot" */

	/* Convert f32 activations to kt's dot type (quantize to Q8_0, round to
	 * fp16/bf16, or copy). */
	void (*act_prepare[NF_KT_COUNT])(const float *x, void *xq, size_t n);

	/* y[r] = dot(W row r, xq), r in [0, nrows); rows are row_bytes apart. */
	void (*gemv[NF_KT_COUNT])(size_t n, size_t nrows, const void *w, size_t row_bytes,
				  const void *xq, float *y);

	/* Batched: y[b * ldy + r] = dot(W row r, xq row b), b in [0, nb);
	 * prepared activation rows are xq_stride bytes apart. */
	void (*gemm[NF_KT_COUNT])(size_t n, size_t nrows, const void *w, size_t row_bytes,
				  size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy);

	/* y[k] += a * W_row[k], k in [0, n): the sparse "down column" update.
	 * Callers round a as the reference requires before calling. */
	void (*axpy[NF_KT_COUNT])(size_t n, float a, const void *wrow, float *y);

	/* Sparse gather forms (compute/ffn_sparse.c). gemv_list: y[j] =
	 * dot(rows[j], xq), j in [0, nrows), rows at arbitrary addresses; each
	 * y[j] has exactly the bits gemv gives for that row alone. Any nrows
	 * (the activation is repacked once per call: pass long lists whole). */
	void (*gemv_list[NF_KT_COUNT])(size_t n, size_t nrows, const void *const *rows,
				       const void *xq, float *y);
	/* axpy_list: for c = 0, 1, ..., ncols - 1 in that order, y += a[c] *
	 * cols[c]: the bits of ncols axpy calls in ascending order (per element
	 * the same chain of fmas), in few passes over y. */
	void (*axpy_list[NF_KT_COUNT])(size_t n, size_t ncols, const float *a,
				       const void *const *cols, float *y);

	/* A K-quant down column of the sparse FFN (compute/sparse_chunk.c):
	 * for r in [0, n), acc[r] += sc[r] * ((raw_r - off) * xq), raw_r the
	 * r-th bits-wide value (bits 2..6) packed in col, low bits first.
	 * Exact integers, so every table gives the same sums. Reads exactly
	 * (n * bits + 7) / 8 bytes of col. */
	void (*kcol_madd)(uint32_t bits, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
			  int32_t xq, int32_t *acc);

	/* A Q4_0 or Q8_0 down part of the sparse FFN in the QCOL form
	 * (compute/sparse_chunk.c), one group of 32 neurons: for r in [0, n),
	 * out[r] = fma(sum_c q[c] * w_c[r], f16(sc[r]) * dx, out[r]), w_c =
	 * cols[c]'s r-th value (Q4_0: n nibbles, low first, minus 8; Q8_0: n
	 * int8), c in [0, ncols), ncols <= 32, |q[c]| <= 127: one step of the
	 * dense product's fma chain (or of one of its 8 lanes). The sum is an
	 * exact integer, so every table gives the same bits. n a multiple of
	 * 32. NULL for other types. */
	void (*qcol_down[NF_KT_COUNT])(size_t n, size_t ncols, const int8_t *q, const void *const *cols,
				       const uint16_t *sc, float dx, float *out);

	/* out = x / sqrt(mean(x^2) + eps) * w (w may be NULL: no scale). out may alias x. */
	void (*rmsnorm)(float *out, const float *x, const float *w, size_t n, float eps);
	/* In place, numerically stable (max subtracted). */
	void (*softmax)(float *x, size_t n);
	/* g[i] = act(g[i]) * u[i]; u may be NULL (no gate). */
	void (*silu_mul)(float *g, const float *u, size_t n);
	void (*relu_mul)(float *g, const float *u, size_t n);
	/* dReLU: g[i] = relu(g[i]) * relu(u[i]). */
	void (*drelu_mul)(float *g, const float *u, size_t n);
	/* Dot and scaled-add on f32 vectors (attention scores and values). */
	float (*dot_f32)(const float *a, const float *b, size_t n);
	void (*axpy_f32)(size_t n, float a, const float *x, float *y);

	/* Matrices repacked into 8-row groups (nf_repack_x8: Q4_0, Q8_0,
	 * Q4_K, Q5_K, Q6_K), indexed by the plain type; NULL where the table
	 * has no kernel for that form (callers then keep the plain rows).
	 * nrows is a multiple of 8, w the first group; x as for gemv/gemm of
	 * the plain type. Each y value has exactly the bits gemv[kt] /
	 * gemm[kt] give on the plain row. */
	void (*gemv_x8[NF_KT_COUNT])(size_t n, size_t nrows, const void *w, const void *xq, float *y);
	void (*gemm_x8[NF_KT_COUNT])(size_t n, size_t nrows, const void *w, size_t nb, const void *xq,
				     size_t xq_stride, float *y, size_t ldy);
};

/*
 * Matrices in groups of 8 rows: block i of a group holds block i of rows
 * 8g..8g+7, the same bytes as the 8 plain blocks, reordered so that one
 * 32-byte load holds 4 consecutive quant bytes of each of the 8 rows
 * (qs[32 * m + 4 * r + k] is row r's qs[4 * m + k]) and the fp16 scales
 * of the 8 rows are one 16-byte load. A group's blocks are consecutive, so
 * a matrix keeps its size and group g starts at byte g * 8 * row_bytes.
 * Q4_0: low nibble value 4m+k, high nibble value 16+4m+k; Q8_0: value
 * 4m+k. The K-quants keep their fields in this order (ggml's field names):
 *   Q4_K  d[8] dmin[8] scales[96] qs[1024]          (1152 bytes)
 *   Q5_K  d[8] dmin[8] scales[96] qh[256] qs[1024]  (1408 bytes)
 *   Q6_K  d[8] scales[128] ql[1024] qh[512]         (1680 bytes)
 * where scale byte b of row r sits at 32 (b / 4) + 16 (r / 4) + 4 (b % 4)
 * + r % 4 (rows 0-3 in a load's low 128-bit lane, 4-7 in its high one).
 * See docs/KERNELS.md.
 */
struct nf_block_q4_0x8 {
	uint16_t d[8];
	uint8_t qs[128];
};
_Static_assert(sizeof(struct nf_block_q4_0x8) == 8 * sizeof(struct nf_block_q4_0), "q4_0x8 block");
struct nf_block_q8_0x8 {
	uint16_t d[8];
	int8_t qs[256];
};
_Static_assert(sizeof(struct nf_block_q8_0x8) == 8 * sizeof(struct nf_block_q8_0), "q8_0x8 block");
struct nf_block_q4_Kx8 {
	uint16_t d[8], dmin[8];
	uint8_t scales[96];
	uint8_t qs[1024];
};
_Static_assert(sizeof(struct nf_block_q4_Kx8) == 8 * sizeof(struct nf_block_q4_K), "q4_Kx8 block");
struct nf_block_q5_Kx8 {
	uint16_t d[8], dmin[8];
	uint8_t scales[96];
	uint8_t qh[256];
	uint8_t qs[1024];
};
_Static_assert(sizeof(struct nf_block_q5_Kx8) == 8 * sizeof(struct nf_block_q5_K), "q5_Kx8 block");
struct nf_block_q6_Kx8 {
	uint16_t d[8];
	uint8_t scales[128];
	uint8_t ql[1024];
	uint8_t qh[512];
};
_Static_assert(sizeof(struct nf_block_q6_Kx8) == 8 * sizeof(struct nf_block_q6_K), "q6_Kx8 block");

/* Whether type kt has an 8-row group form (Q4_0 in both orders, Q8_0,
 * Q4_K, Q5_K, Q6_K). */
bool nf_x8_supported(enum nf_ktype kt);
/* Repack nrows (a multiple of 8) plain rows of type kt (nf_x8_supported)
 * of n values (row_bytes = nf_dtype_row_size apart) from src into 8-row
 * groups at dst; nf_unpack_x8 is the inverse. dst and src do not overlap.
 * Thread-safe on disjoint groups (row ranges that are multiples of 8). */
void nf_repack_x8(enum nf_ktype kt, void *dst, const void *src, size_t n, size_t nrows);
void nf_unpack_x8(enum nf_ktype kt, void *dst, const void *src, size_t n, size_t nrows);

/* The best table for this CPU (or NFLASH_ISA), chosen once; never NULL. */
const struct nf_kernels *nf_kernels_get(void);
/* The plain C reference. */
const struct nf_kernels *nf_kernels_ref(void);
/* A named ISA's table, or NULL if this CPU (or build) cannot run it. */
const struct nf_kernels *nf_kernels_isa(const char *isa);

/* ggml's expf (ggml_v_expf of its AVX-512 build), one lane: llama.cpp's
 * softmax and SiLU take exp from it on blocks of 16 (kernels_ref.c). */
float nf_expf_ggml(float x);

/* The sum of 16 floats in the tree of _mm512_reduce_add_ps (GCC's): a[i] +
 * a[i + 8], then those i and i + 4, then (0 + 2) + (1 + 3): llama.cpp's
 * AVX-512 reductions (softmax blocks, tinyBLAS's value sums). */
float nf_sum16(const float *a);

/*
 * RoPE, LLaMA "normal" style: rotates adjacent pairs (x[2i], x[2i+1]) of each
 * head by pos * freq_scale * base^(-2i/head_dim) / freq_factors[i]
 * (freq_factors NULL: 1). x holds n_head heads.
 */
void nf_rope(float *x, size_t n_head, size_t head_dim, int64_t pos, float freq_base,
	     float freq_scale, const float *freq_factors);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_KERNELS_H */
