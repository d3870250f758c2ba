/*
 * kernels_ref.c - the plain C reference of every kernel in nflash/kernels.h.
 *
 * Invariants:
 * 1. Matrix products take activations in the weight type's dot type: Q8_0
 *    blocks for Q4_0/Q8_0 weights (integer block sums, then
 *    sum over blocks of fp16(d_w) * fp16(d_x) * sumi in f32), fp16 for F16,
 *    bf16 for BF16, f32 for F32; float dot products accumulate in f32.
 * 2. Activation quantization is the one ggml's x86 SIMD path performs, so
 *    that every ISA produces bit-identical prepared activations:
 *    d = amax / 127 (stored fp16), id = amax ? 127 / amax : 0,
 *    q = x * id rounded to nearest, ties to even.
 * 3. axpy is y[k] = fma(a, w[k], y[k]) with w[k] the exact f32 value of the
 *    weight, as the SIMD versions compute it (one rounding per element).
 * 4. rmsnorm follows ggml: squares in f32 summed in double, mean and scale
 *    in f32, out = (x * scale) * w.
 * 5. K-quant weights (Q2_K..Q6_K) take activations as Q8_K blocks (ggml's
 *    quantize_row_q8_K_ref) and follow ggml's x86 AVX2 vec_dot_qN_K_q8_K
 *    order: exact int32 lanes, one fma per super-block and lane, the min
 *    terms where and how ggml adds them (see dot_kquant).
 * 6. Nothing here allocates or keeps state; everything is thread-safe.
 */
#include <math.h>
#include <string.h>

#include "kernels_impl.h"

/* ---- activation preparation ---------------------------------------------- */

void nf_kref_prepare_f32(const float *x, void *xq, size_t n)
{
	if (xq != (const void *)x)
		memmove(xq, x, n * sizeof(float));
}

void nf_kref_prepare_f16(const float *x, void *xq, size_t n)
{
	uint16_t *h = xq;
	for (size_t i = 0; i < n; i++)
		h[i] = nf_fp32_to_fp16(x[i]);
}

void nf_kref_prepare_bf16(const float *x, void *xq, size_t n)
{
	uint16_t *h = xq;
	for (size_t i = 0; i < n; i++)
		h[i] = nf_fp32_to_bf16(x[i]);
}

/* One block by the SIMD rule above; returns d (f32, before fp16) and the
 * quants' sum. */
static float prepare_block(const float *v, int8_t qs[NF_QK], int32_t *sum)
{
	float amax = 0.0f;
	for (int j = 0; j < NF_QK; j++)
		amax = fmaxf(amax, fabsf(v[j]));
	float id = amax != 0.0f ? 127.0f / amax : 0.0f;
	*sum = 0;
	for (int j = 0; j < NF_QK; j++) {
		qs[j] = (int8_t)nearbyintf(v[j] * id);
		*sum += qs[j];
	}
	return amax / 127.0f;
}

void nf_kref_prepare_q8_0(const float *x, void *xq, size_t n)
{
	struct nf_block_q8_0 *y = xq;
	int32_t sum;
	for (size_t b = 0; b < n / NF_QK; b++)
		y[b].d = nf_fp32_to_fp16(prepare_block(x + b * NF_QK, y[b].qs, &sum));
}

/* Q8_1 (Q4_1 and Q5_1 weights): Q8_0's rule, and s = d * sum(q) in f32
 * (ggml's AVX2 quantize_row_q8_1), stored as fp16. */
void nf_kref_prepare_q8_1(const float *x, void *xq, size_t n)
{
	struct nf_block_q8_1 *y = xq;
	for (size_t b = 0; b < n / NF_QK; b++) {
		int32_t sum;
		float d = prepare_block(x + b * NF_QK, y[b].qs, &sum);
		y[b].d = nf_fp32_to_fp16(d);
		y[b].s = nf_fp32_to_fp16(d * (float)sum);
	}
}

void nf_kref_prepare_q8_K(const float *x, void *xq, size_t n)
{
	nf_quantize_row_q8_K(x, xq, n);
}

/* ---- one row's dot product per weight type -------------------------------- */

static float dot_f32(size_t n, const void *w, const void *x)
{
	const float *a = w, *b = x;
	float s = 0.0f;
	for (size_t i = 0; i < n; i++)
		s += a[i] * b[i];
	return s;
}

/*
 * F16 rows follow llama.cpp's summation order, because with activations
 * rounded to fp16 a last-bit difference in one layer's output can flip a
 * rounding in the next and move logits by 1e-3 (seen on tiny-llama-f16).
 * ggml's mul_mat has two: a product of two or more columns goes to
 * llamafile's tinyBLAS when the row length is a multiple of 16 (AVX-512),
 * where lane l accumulates elements l, l+16, ... with fma and the 16 lanes
 * are summed as _mm512_reduce_add_ps does (NF_KT_F16); every other product
 * to ggml_vec_dot_f16 (NF_KT_F16V, nf_kref_dot_f16v).
 */
float nf_kref_dot_f16(size_t n, const void *w, const void *x)
{
	const uint16_t *a = w, *b = x;
	if (n % 16)
		return nf_kref_dot_f16v(n, w, x);
	float acc[16] = { 0 };
	for (size_t i = 0; i < n; i += 16)
		for (int l = 0; l < 16; l++)
			acc[l] = fmaf(nf_fp16_to_fp32(a[i + l]), nf_fp16_to_fp32(b[i + l]), acc[l]);
	return nf_sum16(acc);
}

/* ggml_vec_dot_f16 (AVX-512 build): four 16-lane accumulators over
 * 64-element steps, combined (0+2, 1+3, then 0+1) and reduced as
 * _mm512_reduce_add_ps, the tail's f32 products added in double. */
float nf_kref_dot_f16v(size_t n, const void *w, const void *x)
{
	const uint16_t *a = w, *b = x;
	float acc[4][16] = { { 0 } };
	size_t np = n & ~(size_t)63;
	for (size_t i = 0; i < np; i += 64)
		for (int j = 0; j < 4; j++)
			for (int l = 0; l < 16; l++)
				acc[j][l] = fmaf(nf_fp16_to_fp32(a[i + 16 * j + l]),
						 nf_fp16_to_fp32(b[i + 16 * j + l]), acc[j][l]);
	for (int l = 0; l < 16; l++)
		acc[0][l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
	double s = nf_sum16(acc[0]);
	for (size_t i = np; i < n; i++)
		s += (double)(nf_fp16_to_fp32(a[i]) * nf_fp16_to_fp32(b[i]));
	return (float)s;
}

static float dot_f16(size_t n, const void *w, const void *x)
{
	return nf_kref_dot_f16(n, w, x);
}

static float dot_f16v(size_t n, const void *w, const void *x)
{
	return nf_kref_dot_f16v(n, w, x);
}

static float dot_bf16(size_t n, const void *w, const void *x)
{
	const uint16_t *a = w, *b = x;
	float s = 0.0f;
	for (size_t i = 0; i < n; i++)
		s += nf_bf16_to_fp32(a[i]) * nf_bf16_to_fp32(b[i]);
	return s;
}

/*
 * Quantized rows follow llama.cpp's x86 order (ggml's vec_dot_q8_0_q8_0 and
 * vec_dot_q4_0_q8_0, and llamafile's tinyBLAS_Q0_AVX): per block, 8 int32
 * lanes each summing 4 consecutive products; lane j accumulates
 * fma(d_w * d_x, lane_j, acc_j) over the blocks in order; then the 8 lanes
 * are summed as hsum_float_8 does ((0+4)+(2+6)) + ((1+5)+(3+7)). With
 * activations rounded to Q8_0 per layer, any other order can move a
 * product by one ulp, flip a rounding in the next layer and change the
 * greedy continuation (seen with tiny-llama-q8_0).
 */
static float reduce8(const float *v)
{
	float t[4];
	for (int i = 0; i < 4; i++)
		t[i] = v[i] + v[i + 4];
	return (t[0] + t[2]) + (t[1] + t[3]);
}

static void lanes_fma(const int8_t *w, const int8_t *x, float d, float acc[8])
{
	for (int j = 0; j < 8; j++) {
		int32_t l = 0;
		for (int k = 0; k < 4; k++)
			l += (int32_t)w[4 * j + k] * x[4 * j + k];
		acc[j] = fmaf(d, (float)l, acc[j]);
	}
}

static float dot_q8_0(size_t n, const void *w, const void *x)
{
	const struct nf_block_q8_0 *a = w, *b = x;
	float acc[8] = { 0 };
	for (size_t i = 0; i < n / NF_QK; i++)
		lanes_fma(a[i].qs, b[i].qs, nf_fp16_to_fp32(a[i].d) * nf_fp16_to_fp32(b[i].d), acc);
	return reduce8(acc);
}

/* A Q4_0 block's weights as signed bytes -8..7, in x's order. */
static void q4_0_bytes(const struct nf_block_q4_0 *a, int8_t q[NF_QK])
{
	for (int j = 0; j < NF_QK / 2; j++) {
		q[j] = (int8_t)((a->qs[j] & 0x0f) - 8);
		q[j + NF_QK / 2] = (int8_t)((a->qs[j] >> 4) - 8);
	}
}

/* NF_KT_Q4_0L: ggml's vec_dot_q4_0_q8_0, the lanes above. */
static float dot_q4_0l(size_t n, const void *w, const void *x)
{
	const struct nf_block_q4_0 *a = w;
	const struct nf_block_q8_0 *b = x;
	float acc[8] = { 0 };
	for (size_t i = 0; i < n / NF_QK; i++) {
		int8_t q[NF_QK];
		q4_0_bytes(&a[i], q);
		lanes_fma(q, b[i].qs, nf_fp16_to_fp32(a[i].d) * nf_fp16_to_fp32(b[i].d), acc);
	}
	return reduce8(acc);
}

/*
 * NF_KT_Q4_0: llama.cpp's repacked Q4_0 (ggml_gemv/gemm_q4_0_8x8_q8_0, x86),
 * which every Q4_0 matrix of a multiple of 8 rows goes through there: per
 * block the exact integer sum s of the 32 products, then one chain
 * acc = fma(s, d_w * d_x, acc) over the blocks in order; no lanes.
 */
static float dot_q4_0(size_t n, const void *w, const void *x)
{
	const struct nf_block_q4_0 *a = w;
	const struct nf_block_q8_0 *b = x;
	float acc = 0.0f;
	for (size_t i = 0; i < n / NF_QK; i++) {
		int8_t q[NF_QK];
		q4_0_bytes(&a[i], q);
		int32_t s = 0;
		for (int j = 0; j < NF_QK; j++)
			s += (int32_t)q[j] * b[i].qs[j];
		acc = fmaf((float)s, nf_fp16_to_fp32(a[i].d) * nf_fp16_to_fp32(b[i].d), acc);
	}
	return acc;
}

/*
 * Q4_1, Q5_0, Q5_1 (ggml's vec_dot_q4_1_q8_1, q5_0_q8_0, q5_1_q8_1 on x86,
 * and llamafile's tinyBLAS_Q0_AVX for Q5_0 batches: the same lanes): the
 * lanes of Q8_0 above on the raw quants (Q5_0: minus 16), acc_j =
 * fma(d_w * d_x, lane_j, acc_j), summed by hsum_float_8; Q4_1 and Q5_1 add
 * the block's min term m_w * s_x to a float sum block by block (one fma,
 * as GCC contracts ggml's `summs += m * s`; the unfused form matched
 * tests/peer/requant as well), added after the lanes.
 */
static float dot_legacy(uint32_t t, size_t n, const void *w, const void *x)
{
	size_t bs = nf_dtype_block_size(t);
	float acc[8] = { 0 }, summs = 0.0f;
	for (size_t i = 0; i < n / NF_QK; i++) {
		const void *a = (const char *)w + i * bs;
		uint8_t u[NF_QK];
		int8_t q[NF_QK];
		nf_quant5_unpack(t, a, u);
		for (int j = 0; j < NF_QK; j++)
			q[j] = (int8_t)(t == NF_DTYPE_Q5_0 ? (int)u[j] - 16 : (int)u[j]);
		float dw = nf_fp16_to_fp32(((const uint16_t *)a)[0]);
		if (t == NF_DTYPE_Q5_0) {
			const struct nf_block_q8_0 *b = (const struct nf_block_q8_0 *)x + i;
			lanes_fma(q, b->qs, dw * nf_fp16_to_fp32(b->d), acc);
		} else {
			const struct nf_block_q8_1 *b = (const struct nf_block_q8_1 *)x + i;
			summs = fmaf(nf_fp16_to_fp32(((const uint16_t *)a)[1]), nf_fp16_to_fp32(b->s), summs);
			lanes_fma(q, b->qs, dw * nf_fp16_to_fp32(b->d), acc);
		}
	}
	return reduce8(acc) + summs;
}

static float dot_q4_1(size_t n, const void *w, const void *x)
{
	return dot_legacy(NF_DTYPE_Q4_1, n, w, x);
}

static float dot_q5_0(size_t n, const void *w, const void *x)
{
	return dot_legacy(NF_DTYPE_Q5_0, n, w, x);
}

static float dot_q5_1(size_t n, const void *w, const void *x)
{
	return dot_legacy(NF_DTYPE_Q5_1, n, w, x);
}

/*
 * K-quant rows against Q8_K activations, in llama.cpp's x86 (AVX2) order.
 * Per super-block, with d = d_x * d_w and dmin = -d_x * dmin_w:
 * - integer lane m (0..7) sums, over the block's eight 32-value groups g,
 *   sc[i / 16] * q_w[i] * q_x[i] for i = 32g + 4m .. 32g + 4m + 3 (exact);
 *   acc[m] = fma(d, lane_m, acc[m]);
 * - the min terms, exact integers times dmin: Q2_K adds
 *   fma(dmin, mn[2m] * bsum[2m] + mn[2m+1] * bsum[2m+1], acc[m]) before
 *   the lanes; Q4_K keeps 4 extra lanes over the per-32 sums
 *   (fma(dmin, m[2k] s[2k] + m[2k+1] s[2k+1], accm[k])) summed at the end as
 *   (0+2) + (1+3); Q5_K one scalar fma(dmin, sum of m * s, summs).
 * The result is hsum_float_8(acc) (reduce8) plus those extra sums.
 */
struct kq_acc {
	float acc[8], accm[4], summs;
};

/* One super-block w of type t against y into the row's sums a. */
static void kq_step(uint32_t t, const void *w, const struct nf_block_q8_K *y, struct kq_acc *a)
{
	struct nf_kblock kb;
	nf_kblock_unpack(t, w, &kb);
	const float d = y->d * kb.d, dmin = -y->d * kb.dmin;
	const int16_t *bsum = y->bsums;
	if (t == NF_DTYPE_Q2_K) {
		for (int m = 0; m < 8; m++) {
			int32_t p = kb.mn[2 * m] * bsum[2 * m] + kb.mn[2 * m + 1] * bsum[2 * m + 1];
			a->acc[m] = fmaf(dmin, (float)p, a->acc[m]);
		}
	} else if (t == NF_DTYPE_Q4_K || t == NF_DTYPE_Q5_K) {
		int32_t p[4], tot = 0;
		for (int k = 0; k < 4; k++) {
			int32_t s0 = bsum[4 * k] + bsum[4 * k + 1], s1 = bsum[4 * k + 2] + bsum[4 * k + 3];
			p[k] = kb.mn[4 * k] * s0 + kb.mn[4 * k + 2] * s1;
			tot += p[k];
			if (t == NF_DTYPE_Q4_K)
				a->accm[k] = fmaf(dmin, (float)p[k], a->accm[k]);
		}
		if (t == NF_DTYPE_Q5_K)
			a->summs = fmaf(dmin, (float)tot, a->summs);
	}
	int32_t lane[8] = { 0 };
	for (int g = 0; g < NF_QK_K / 32; g++)
		for (int m = 0; m < 8; m++)
			for (int k = 0; k < 4; k++) {
				int idx = 32 * g + 4 * m + k;
				lane[m] += kb.sc[idx / 16] * (kb.q[idx] * y->qs[idx]);
			}
	for (int m = 0; m < 8; m++)
		a->acc[m] = fmaf(d, (float)lane[m], a->acc[m]);
}

static float kq_finish(uint32_t t, const struct kq_acc *a)
{
	float r = reduce8(a->acc);
	if (t == NF_DTYPE_Q4_K)
		r += (a->accm[0] + a->accm[2]) + (a->accm[1] + a->accm[3]);
	else if (t == NF_DTYPE_Q5_K)
		r += a->summs;
	return r;
}

static float dot_kquant(uint32_t t, size_t n, const void *w, const void *x)
{
	const struct nf_block_q8_K *y = x;
	size_t bs = nf_dtype_block_size(t);
	struct kq_acc a = { { 0 }, { 0 }, 0.0f };
	for (size_t i = 0; i < n / NF_QK_K; i++)
		kq_step(t, (const char *)w + i * bs, &y[i], &a);
	return kq_finish(t, &a);
}

/*
 * The same products on matrices in 8-row groups (kernels.h): each row's
 * block is read back from its group block (nf_x8_block_row) and goes
 * through kq_step as a plain row's would, so the definition is the plain
 * one by construction.
 */
static void gemm_x8_kquant(uint32_t t, enum nf_ktype kt, size_t n, size_t nrows, const void *w, size_t nb,
			   const void *xq, size_t xq_stride, float *y, size_t ldy)
{
	size_t bs = nf_dtype_block_size(t), nsb = n / NF_QK_K;
	unsigned char blk[256];
	for (size_t g = 0; g < nrows / 8; g++)
		for (size_t b = 0; b < nb; b++) {
			const struct nf_block_q8_K *x = (const void *)((const char *)xq + b * xq_stride);
			struct kq_acc a[8];
			memset(a, 0, sizeof(a));
			for (size_t i = 0; i < nsb; i++)
				for (size_t r = 0; r < 8; r++) {
					nf_x8_block_row(kt, (const char *)w + (g * nsb + i) * 8 * bs, r, blk);
					kq_step(t, blk, &x[i], &a[r]);
				}
			for (size_t r = 0; r < 8; r++)
				y[b * ldy + 8 * g + r] = kq_finish(t, &a[r]);
		}
}

/* y[k] = fma(a, w[k], y[k]) with w[k] ggml's dequantized value */
static void axpy_kquant(uint32_t t, size_t n, float a, const void *wrow, float *y)
{
	size_t bs = nf_dtype_block_size(t);
	struct nf_kblock kb;
	float v[NF_QK_K];
	for (size_t i = 0; i < n / NF_QK_K; i++) {
		nf_kblock_unpack(t, (const char *)wrow + i * bs, &kb);
		nf_kblock_dequantize(&kb, v);
		for (int j = 0; j < NF_QK_K; j++)
			y[i * NF_QK_K + j] = fmaf(a, v[j], y[i * NF_QK_K + j]);
	}
}

typedef float (*row_dot_fn)(size_t n, const void *w, const void *x);

static void gemv_rows(row_dot_fn dot, size_t n, size_t nrows, const void *w,
		      size_t row_bytes, const void *xq, float *y)
{
	const char *wr = w;
	for (size_t r = 0; r < nrows; r++)
		y[r] = dot(n, wr + r * row_bytes, xq);
}

static void gemm_rows(row_dot_fn dot, size_t n, size_t nrows, const void *w,
		      size_t row_bytes, size_t nb, const void *xq, size_t xq_stride,
		      float *y, size_t ldy)
{
	const char *wr = w, *xr = xq;
	for (size_t b = 0; b < nb; b++)
		for (size_t r = 0; r < nrows; r++)
			y[b * ldy + r] = dot(n, wr + r * row_bytes, xr + b * xq_stride);
}

#define REF_MATMUL(T)                                                                   \
	static void gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,  \
			     const void *xq, float *y)                                  \
	{                                                                               \
		gemv_rows(dot_##T, n, nrows, w, row_bytes, xq, y);                      \
	}                                                                               \
	static void gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,  \
			     size_t nb, const void *xq, size_t xq_stride, float *y,     \
			     size_t ldy)                                                \
	{                                                                               \
		gemm_rows(dot_##T, n, nrows, w, row_bytes, nb, xq, xq_stride, y, ldy);  \
	}

REF_MATMUL(f32)
REF_MATMUL(f16)
REF_MATMUL(f16v)
REF_MATMUL(bf16)
REF_MATMUL(q8_0)
REF_MATMUL(q4_0)
REF_MATMUL(q4_0l)
REF_MATMUL(q4_1)
REF_MATMUL(q5_0)
REF_MATMUL(q5_1)

/* gemv over a list of rows: each row's dot alone, as gemv computes it */
#define REF_LIST(T)                                                                     \
	static void gemv_list_##T(size_t n, size_t nrows, const void *const *rows,     \
				  const void *xq, float *y)                             \
	{                                                                               \
		for (size_t r = 0; r < nrows; r++)                                      \
			y[r] = dot_##T(n, rows[r], xq);                                 \
	}

REF_LIST(f32)
REF_LIST(f16)
REF_LIST(f16v)
REF_LIST(bf16)
REF_LIST(q8_0)
REF_LIST(q4_0)
REF_LIST(q4_0l)
REF_LIST(q4_1)
REF_LIST(q5_0)
REF_LIST(q5_1)

/* ---- sparse down-column update --------------------------------------------- */

static void axpy_f32w(size_t n, float a, const void *wrow, float *y)
{
	const float *w = wrow;
	for (size_t k = 0; k < n; k++)
		y[k] = fmaf(a, w[k], y[k]);
}

static void axpy_f16(size_t n, float a, const void *wrow, float *y)
{
	const uint16_t *w = wrow;
	for (size_t k = 0; k < n; k++)
		y[k] = fmaf(a, nf_fp16_to_fp32(w[k]), y[k]);
}

void nf_kref_axpy_bf16(size_t n, float a, const void *wrow, float *y)
{
	const uint16_t *w = wrow;
	for (size_t k = 0; k < n; k++)
		y[k] = fmaf(a, nf_bf16_to_fp32(w[k]), y[k]);
}

static void axpy_q8_0(size_t n, float a, const void *wrow, float *y)
{
	const struct nf_block_q8_0 *b = wrow;
	for (size_t i = 0; i < n / NF_QK; i++) {
		float d = nf_fp16_to_fp32(b[i].d);
		for (int j = 0; j < NF_QK; j++)
			y[i * NF_QK + j] = fmaf(a, (float)b[i].qs[j] * d, y[i * NF_QK + j]);
	}
}

static void axpy_q4_0(size_t n, float a, const void *wrow, float *y)
{
	const struct nf_block_q4_0 *b = wrow;
	for (size_t i = 0; i < n / NF_QK; i++) {
		float d = nf_fp16_to_fp32(b[i].d);
		float *o = y + i * NF_QK;
		for (int j = 0; j < NF_QK / 2; j++) {
			o[j] = fmaf(a, (float)((b[i].qs[j] & 0x0f) - 8) * d, o[j]);
			o[j + NF_QK / 2] = fmaf(a, (float)((b[i].qs[j] >> 4) - 8) * d, o[j + NF_QK / 2]);
		}
	}
}

/* The definition of axpy_list: one axpy per column, in ascending order.
 * SIMD tables use it for weight types whose fused form is not worth it. */
void nf_kref_axpy_list(void (*axpy)(size_t, float, const void *, float *), size_t n, size_t ncols,
		       const float *a, const void *const *cols, float *y)
{
	for (size_t c = 0; c < ncols; c++)
		axpy(n, a[c], cols[c], y);
}

#define REF_AXPY_LIST(T, FN)                                                              \
	static void axpy_list_##T(size_t n, size_t ncols, const float *a,                \
				  const void *const *cols, float *y)                      \
	{                                                                                 \
		nf_kref_axpy_list(FN, n, ncols, a, cols, y);                              \
	}

REF_AXPY_LIST(f32, axpy_f32w)
REF_AXPY_LIST(f16, axpy_f16)
REF_AXPY_LIST(bf16, nf_kref_axpy_bf16)
REF_AXPY_LIST(q8_0, axpy_q8_0)
REF_AXPY_LIST(q4_0, axpy_q4_0)

/* Q4_1, Q5_0, Q5_1 down rows: y[k] = fma(a, value_k, y[k]), value_k as
 * nf_dequantize_row gives it */
static void axpy_legacy(uint32_t t, size_t n, float a, const void *wrow, float *y)
{
	float v[NF_QK];
	size_t bs = nf_dtype_block_size(t);
	for (size_t i = 0; i < n / NF_QK; i++) {
		nf_dequantize_row(t, (const char *)wrow + i * bs, v, NF_QK);
		for (int j = 0; j < NF_QK; j++)
			y[i * NF_QK + j] = fmaf(a, v[j], y[i * NF_QK + j]);
	}
}

static void axpy_q4_1(size_t n, float a, const void *wrow, float *y)
{
	axpy_legacy(NF_DTYPE_Q4_1, n, a, wrow, y);
}

static void axpy_q5_0(size_t n, float a, const void *wrow, float *y)
{
	axpy_legacy(NF_DTYPE_Q5_0, n, a, wrow, y);
}

static void axpy_q5_1(size_t n, float a, const void *wrow, float *y)
{
	axpy_legacy(NF_DTYPE_Q5_1, n, a, wrow, y);
}

REF_AXPY_LIST(q4_1, axpy_q4_1)
REF_AXPY_LIST(q5_0, axpy_q5_0)
REF_AXPY_LIST(q5_1, axpy_q5_1)

/* The Q4_1/Q5_0/Q5_1 entries, exported (kernels_impl.h) for the SIMD
 * tables, which take them as they are. */
#define KREF_LEGACY(T)                                                                            \
	void nf_kref_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes, const void *xq, \
			      float *y)                                                           \
	{                                                                                         \
		gemv_##T(n, nrows, w, row_bytes, xq, y);                                          \
	}                                                                                         \
	void nf_kref_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes, size_t nb,     \
			      const void *xq, size_t xq_stride, float *y, size_t ldy)             \
	{                                                                                         \
		gemm_##T(n, nrows, w, row_bytes, nb, xq, xq_stride, y, ldy);                      \
	}                                                                                         \
	void nf_kref_gemv_list_##T(size_t n, size_t nrows, const void *const *rows, const void *xq,  \
				   float *y)                                                      \
	{                                                                                         \
		gemv_list_##T(n, nrows, rows, xq, y);                                             \
	}                                                                                         \
	void nf_kref_axpy_##T(size_t n, float a, const void *wrow, float *y)                      \
	{                                                                                         \
		axpy_##T(n, a, wrow, y);                                                          \
	}                                                                                         \
	void nf_kref_axpy_list_##T(size_t n, size_t ncols, const float *a, const void *const *cols,  \
				   float *y)                                                      \
	{                                                                                         \
		axpy_list_##T(n, ncols, a, cols, y);                                              \
	}
KREF_LEGACY(q4_1)
KREF_LEGACY(q5_0)
KREF_LEGACY(q5_1)
#undef KREF_LEGACY

/* The K-quant entries, exported (kernels_impl.h) for tables that reuse them. */
#define KREF(T, DT)                                                                          \
	float nf_kref_dot_##T(size_t n, const void *w, const void *x)                        \
	{                                                                                    \
		return dot_kquant(DT, n, w, x);                                              \
	}                                                                                    \
	void nf_kref_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,      \
			      const void *xq, float *y)                                      \
	{                                                                                    \
		gemv_rows(nf_kref_dot_##T, n, nrows, w, row_bytes, xq, y);                   \
	}                                                                                    \
	void nf_kref_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,      \
			      size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                    \
		gemm_rows(nf_kref_dot_##T, n, nrows, w, row_bytes, nb, xq, xq_stride, y, ldy); \
	}                                                                                    \
	void nf_kref_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,         \
				   const void *xq, float *y)                                 \
	{                                                                                    \
		for (size_t r = 0; r < nrows; r++)                                           \
			y[r] = dot_kquant(DT, n, rows[r], xq);                               \
	}                                                                                    \
	void nf_kref_axpy_##T(size_t n, float a, const void *wrow, float *y)                \
	{                                                                                    \
		axpy_kquant(DT, n, a, wrow, y);                                              \
	}                                                                                    \
	void nf_kref_axpy_list_##T(size_t n, size_t ncols, const float *a,                  \
				   const void *const *cols, float *y)                        \
	{                                                                                    \
		nf_kref_axpy_list(nf_kref_axpy_##T, n, ncols, a, cols, y);                   \
	}

KREF(q2_K, NF_DTYPE_Q2_K)
KREF(q3_K, NF_DTYPE_Q3_K)
KREF(q4_K, NF_DTYPE_Q4_K)
KREF(q5_K, NF_DTYPE_Q5_K)
KREF(q6_K, NF_DTYPE_Q6_K)

#define KREF_X8(T, DT)                                                                       \
	void nf_kref_gemv_x8_##T(size_t n, size_t nrows, const void *w, const void *xq, float *y) \
	{                                                                                    \
		gemm_x8_kquant(DT, NF_KT_##T, n, nrows, w, 1, xq, 0, y, 0);                  \
	}                                                                                    \
	void nf_kref_gemm_x8_##T(size_t n, size_t nrows, const void *w, size_t nb, const void *xq, \
				 size_t xq_stride, float *y, size_t ldy)                     \
	{                                                                                    \
		gemm_x8_kquant(DT, NF_KT_##T, n, nrows, w, nb, xq, xq_stride, y, ldy);       \
	}

KREF_X8(Q4_K, NF_DTYPE_Q4_K)
KREF_X8(Q5_K, NF_DTYPE_Q5_K)
KREF_X8(Q6_K, NF_DTYPE_Q6_K)

/* ---- K-quant down columns ---------------------------------------------------- */

/* the SIMD kcol_madd tables (kernels_impl.h) */
const uint8_t nf_kcol_idx[5][32] = {
	{ 0x00, 0x01, 0x00, 0x01, 0x00, 0x01, 0x00, 0x01, 0x01, 0x02, 0x01, 0x02, 0x01, 0x02, 0x01, 0x02,
	  0x02, 0x03, 0x02, 0x03, 0x02, 0x03, 0x02, 0x03, 0x03, 0x80, 0x03, 0x80, 0x03, 0x80, 0x03, 0x80 },
	{ 0x00, 0x01, 0x00, 0x01, 0x00, 0x01, 0x01, 0x02, 0x01, 0x02, 0x01, 0x02, 0x02, 0x03, 0x02, 0x03,
	  0x03, 0x04, 0x03, 0x04, 0x03, 0x04, 0x04, 0x05, 0x04, 0x05, 0x04, 0x05, 0x05, 0x80, 0x05, 0x80 },
	{ 0x00, 0x01, 0x00, 0x01, 0x01, 0x02, 0x01, 0x02, 0x02, 0x03, 0x02, 0x03, 0x03, 0x04, 0x03, 0x04,
	  0x04, 0x05, 0x04, 0x05, 0x05, 0x06, 0x05, 0x06, 0x06, 0x07, 0x06, 0x07, 0x07, 0x80, 0x07, 0x80 },
	{ 0x00, 0x01, 0x00, 0x01, 0x01, 0x02, 0x01, 0x02, 0x02, 0x03, 0x03, 0x04, 0x03, 0x04, 0x04, 0x05,
	  0x05, 0x06, 0x05, 0x06, 0x06, 0x07, 0x06, 0x07, 0x07, 0x08, 0x08, 0x09, 0x08, 0x09, 0x09, 0x80 },
	{ 0x00, 0x01, 0x00, 0x01, 0x01, 0x02, 0x02, 0x03, 0x03, 0x04, 0x03, 0x04, 0x04, 0x05, 0x05, 0x06,
	  0x06, 0x07, 0x06, 0x07, 0x07, 0x08, 0x08, 0x09, 0x09, 0x0a, 0x09, 0x0a, 0x0a, 0x0b, 0x0b, 0x80 },
};
const uint16_t nf_kcol_mul[5][16] = {
	{ 16384, 4096, 1024, 256, 16384, 4096, 1024, 256, 16384, 4096, 1024, 256, 16384, 4096, 1024, 256 },
	{ 8192, 1024, 128, 4096, 512, 64, 2048, 256, 8192, 1024, 128, 4096, 512, 64, 2048, 256 },
	{ 4096, 256, 4096, 256, 4096, 256, 4096, 256, 4096, 256, 4096, 256, 4096, 256, 4096, 256 },
	{ 2048, 64, 512, 16, 128, 1024, 32, 256, 2048, 64, 512, 16, 128, 1024, 32, 256 },
	{ 1024, 16, 64, 256, 1024, 16, 64, 256, 1024, 16, 64, 256, 1024, 16, 64, 256 },
};

void nf_kref_kcol_madd(uint32_t bits, int32_t off, const uint8_t *col, size_t n, const int16_t *sc,
		       int32_t xq, int32_t *acc)
{
	uint32_t buf = 0, have = 0, mask = (1u << bits) - 1;
	for (size_t r = 0; r < n; r++) {
		if (have < bits) {
			buf |= (uint32_t)*col++ << have;
			have += 8;
		}
		int32_t q = (int32_t)(buf & mask) - off;
		acc[r] += sc[r] * (q * xq);
		buf >>= bits;
		have -= bits;
	}
}

/* ---- QCOL down parts ------------------------------------------------------- */

/* The definition (include/nflash/kernels.h): integer sums per row, then
 * out = fma(sum, scale * dx, out), one step of llama.cpp's dense chain. */
#define KREF_QCOL_DOWN(T, VALUE)                                                                   \
	void nf_kref_qcol_down_##T(size_t n, size_t ncols, const int8_t *q, const void *const *cols, \
				   const uint16_t *sc, float dx, float *out)                       \
	{                                                                                          \
		for (size_t r = 0; r < n; r++) {                                                   \
			int32_t acc = 0;                                                           \
			for (size_t c = 0; c < ncols; c++)                                         \
				acc += q[c] * (VALUE);                                             \
			out[r] = fmaf((float)acc, nf_fp16_to_fp32(sc[r]) * dx, out[r]);             \
		}                                                                                  \
	}
KREF_QCOL_DOWN(q4_0, (int32_t)((((const uint8_t *)cols[c])[r / 2] >> (4 * (r % 2))) & 0x0f) - 8)
KREF_QCOL_DOWN(q8_0, (int32_t)((const int8_t *)cols[c])[r])
#undef KREF_QCOL_DOWN

/* ---- vector ops ------------------------------------------------------------ */

void nf_kref_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps)
{
	double sum = 0.0;
	for (size_t i = 0; i < n; i++)
		sum += (double)(x[i] * x[i]);
	float mean = (float)(sum / (double)n);
	float scale = 1.0f / sqrtf(mean + eps);
	for (size_t i = 0; i < n; i++)
		out[i] = w ? (x[i] * scale) * w[i] : x[i] * scale;
}

/*
 * ggml's expf (ggml_v_expf as its AVX-512 build has it: llama.cpp's softmax
 * and SiLU run through it on 16-lane blocks), one lane: n = round(x log2 e)
 * by the 1.5 * 2^23 trick, b = x - n ln 2 in two fma steps, a degree-5
 * polynomial j ~ e^b, then j * 2^n (scalef: one rounding); |n| > 192 gives
 * 0 or inf. Every step is one IEEE operation, so the SIMD tables compute the
 * same bits with the same steps.
 */
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("fma", "default"))) /* fmaf inline where the CPU has FMA: the same bits */
#endif
float nf_expf_ggml(float x)
{
	const float r = 0x1.8p23f;
	float z = fmaf(x, 0x1.715476p+0f, r);
	float n = z - r;
	float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
	if (n != n)
		return n;
	if (fabsf(n) > 192.0f)
		return n <= 0.0f ? 0.0f : INFINITY;
	float u = b * b;
	float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
		       u, fmaf(0x1.ffffecp-1f, b, 1.0f));
	return ldexpf(j, (int)n);
}

/* _mm512_reduce_add_ps's tree over 16 values (GCC's): halves, quarters,
 * then (0 + 2) + (1 + 3). */
float nf_sum16(const float *a)
{
	float t8[8], t4[4];
	for (int i = 0; i < 8; i++)
		t8[i] = a[i] + a[i + 8];
	for (int i = 0; i < 4; i++)
		t4[i] = t8[i] + t8[i + 4];
	return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/*
 * ggml_vec_soft_max_f32 (AVX-512 build): blocks of 16 through the expf
 * above, each block's sum16 added in double; the last n % 16 through libm's
 * expf, added one by one; then scaled by (float)(1 / sum). Attention pads
 * its rows to 16 with -inf (llama.cpp's rows are the KV cache's n_kv, a
 * multiple of 32, masked), so there every score takes the block path.
 */
void nf_kref_softmax(float *x, size_t n)
{
	if (!n)
		return;
	float max = -INFINITY;
	for (size_t i = 0; i < n; i++)
		max = fmaxf(max, x[i]);
	double sum = 0.0;
	size_t i = 0;
	for (; i + 16 <= n; i += 16) {
		for (size_t l = 0; l < 16; l++)
			x[i + l] = nf_expf_ggml(x[i + l] - max);
		sum += (double)nf_sum16(x + i);
	}
	for (; i < n; i++) {
		x[i] = expf(x[i] - max);
		sum += (double)x[i];
	}
	float inv = (float)(1.0 / sum);
	for (i = 0; i < n; i++)
		x[i] *= inv;
}

/* ggml_vec_silu_f32 (AVX-512 build) then the product with u: x / (1 +
 * e^-x), e^-x by the expf above on blocks of 16, libm's on the last n % 16. */
void nf_kref_silu_mul(float *g, const float *u, size_t n)
{
	size_t i = 0;
	for (; i + 16 <= n; i += 16)
		for (size_t l = i; l < i + 16; l++) {
			float s = g[l] / (1.0f + nf_expf_ggml(0.0f - g[l]));
			g[l] = u ? s * u[l] : s;
		}
	for (; i < n; i++) {
		float s = g[i] / (1.0f + expf(-g[i]));
		g[i] = u ? s * u[i] : s;
	}
}

void nf_kref_relu_mul(float *g, const float *u, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		float r = g[i] > 0.0f ? g[i] : 0.0f;
		g[i] = u ? r * u[i] : r;
	}
}

void nf_kref_drelu_mul(float *g, const float *u, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		float r = g[i] > 0.0f ? g[i] : 0.0f;
		g[i] = u ? r * (u[i] > 0.0f ? u[i] : 0.0f) : r;
	}
}

/* ggml_vec_dot_f32 (AVX-512 build; the attention scores of an F32 KV
 * cache): four 16-lane fma chains over each 64 values, chains 0+2 and 1+3,
 * then their sum, sum16; the last n % 64 added one by one, unfused. */
float nf_kref_dot_f32(const float *a, const float *b, size_t n)
{
	size_t np = n & ~(size_t)63;
	float sum = 0.0f;
	if (np) {
		float acc[4][16] = { { 0 } };
		for (size_t i = 0; i < np; i += 64)
			for (size_t j = 0; j < 4; j++)
				for (size_t l = 0; l < 16; l++)
					acc[j][l] = fmaf(a[i + 16 * j + l], b[i + 16 * j + l], acc[j][l]);
		for (size_t l = 0; l < 16; l++)
			acc[0][l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
		sum = nf_sum16(acc[0]);
	}
	for (size_t i = np; i < n; i++)
		sum += a[i] * b[i];
	return sum;
}

void nf_kref_axpy_f32(size_t n, float a, const float *x, float *y)
{
	axpy_f32w(n, a, x, y);
}

const struct nf_kernels nf_kernels_table_ref = {
	.isa = "scalar",
	.act_prepare = {
		[NF_KT_F32] = nf_kref_prepare_f32,
		[NF_KT_F16] = nf_kref_prepare_f16,
		[NF_KT_BF16] = nf_kref_prepare_bf16,
		[NF_KT_Q8_0] = nf_kref_prepare_q8_0,
		[NF_KT_Q4_0] = nf_kref_prepare_q8_0,
		[NF_KT_Q4_0L] = nf_kref_prepare_q8_0,
		[NF_KT_F16V] = nf_kref_prepare_f16,
		NF_KREF_KQUANT_PREPARE,
		NF_KREF_LEGACY_PREPARE,
	},
	.gemv = {
		[NF_KT_F32] = gemv_f32, [NF_KT_F16] = gemv_f16, [NF_KT_BF16] = gemv_bf16,
		[NF_KT_Q8_0] = gemv_q8_0, [NF_KT_Q4_0] = gemv_q4_0, [NF_KT_Q4_0L] = gemv_q4_0l,
		[NF_KT_F16V] = gemv_f16v,
		NF_KREF_KQUANT(gemv),
		NF_KREF_LEGACY(gemv),
	},
	.gemm = {
		[NF_KT_F32] = gemm_f32, [NF_KT_F16] = gemm_f16, [NF_KT_BF16] = gemm_bf16,
		[NF_KT_Q8_0] = gemm_q8_0, [NF_KT_Q4_0] = gemm_q4_0, [NF_KT_Q4_0L] = gemm_q4_0l,
		[NF_KT_F16V] = gemm_f16v,
		NF_KREF_KQUANT(gemm),
		NF_KREF_LEGACY(gemm),
	},
	.axpy = {
		[NF_KT_F32] = axpy_f32w, [NF_KT_F16] = axpy_f16, [NF_KT_BF16] = nf_kref_axpy_bf16,
		[NF_KT_Q8_0] = axpy_q8_0, [NF_KT_Q4_0] = axpy_q4_0, [NF_KT_Q4_0L] = axpy_q4_0,
		[NF_KT_F16V] = axpy_f16,
		NF_KREF_KQUANT(axpy),
		NF_KREF_LEGACY(axpy),
	},
	.gemv_list = {
		[NF_KT_F32] = gemv_list_f32, [NF_KT_F16] = gemv_list_f16, [NF_KT_BF16] = gemv_list_bf16,
		[NF_KT_Q8_0] = gemv_list_q8_0, [NF_KT_Q4_0] = gemv_list_q4_0, [NF_KT_Q4_0L] = gemv_list_q4_0l,
		[NF_KT_F16V] = gemv_list_f16v,
		NF_KREF_KQUANT(gemv_list),
		NF_KREF_LEGACY(gemv_list),
	},
	.axpy_list = {
		[NF_KT_F32] = axpy_list_f32, [NF_KT_F16] = axpy_list_f16, [NF_KT_BF16] = axpy_list_bf16,
		[NF_KT_Q8_0] = axpy_list_q8_0, [NF_KT_Q4_0] = axpy_list_q4_0,
		[NF_KT_Q4_0L] = axpy_list_q4_0, [NF_KT_F16V] = axpy_list_f16,
		NF_KREF_KQUANT(axpy_list),
		NF_KREF_LEGACY(axpy_list),
	},
	.kcol_madd = nf_kref_kcol_madd,
	.qcol_down = { [NF_KT_Q8_0] = nf_kref_qcol_down_q8_0, [NF_KT_Q4_0] = nf_kref_qcol_down_q4_0,
		       [NF_KT_Q4_0L] = nf_kref_qcol_down_q4_0 },
	.gemv_x8 = { NF_KREF_X8(gemv) },
	.gemm_x8 = { NF_KREF_X8(gemm) },
	.rmsnorm = nf_kref_rmsnorm,
	.softmax = nf_kref_softmax,
	.silu_mul = nf_kref_silu_mul,
	.relu_mul = nf_kref_relu_mul,
	.drelu_mul = nf_kref_drelu_mul,
	.dot_f32 = nf_kref_dot_f32,
	.axpy_f32 = nf_kref_axpy_f32,
};
