/*
 * kernels_neon.c - the kernel table for arm64 Advanced SIMD (NEON), without
 * the dot-product extension; compute/kernels_neondot.c reuses everything
 * here but the integer block product.
 *
 * Invariants:
 * 1. Prepared activations are bit-identical to the reference (same amax,
 *    d = amax / 127 and id = 127 / amax, round to nearest even; fp16 by
 *    fcvtn, bf16 by the reference's integer rounding).
 * 2. Q8_0, Q4_0, K-quant and F16 products sum in the reference's
 *    (llama.cpp's) order, so they have its bits (kernels_neon_q.h,
 *    kernels_neon_kquant.h, fdot_f16); F32 and
 *    BF16 products differ from it only in summation order.
 * 3. axpy and axpy_list compute y = fma(a, w, y) per element, w the exact
 *    f32 weight, columns in ascending order: the reference's bits.
 * 4. Only this file (and kernels_neondot.c) include arm_neon.h, and
 *    kernels.c hands out the table only when AT_HWCAP has HWCAP_ASIMD.
 * 5. Nothing here allocates.
 */
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "kernels_impl.h"

/* Lane j = sum of a[4j+k] * b[4j+k], k = 0..3, from widening multiplies
 * (|a * b| <= 2^14 fits int16) and two pairwise adds. */
static inline int32x4_t dot16(int8x16_t a, int8x16_t b)
{
	int16x8_t p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b));
	int16x8_t p1 = vmull_high_s8(a, b);
	return vpaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1));
}

#include "kernels_neon_q.h"
#include "kernels_neon_kquant.h"

#define h2f nq_h2f

/* ---- activation preparation ---------------------------------------------- */

void nf_kneon_prepare_q8_0(const float *x, void *xq, size_t n)
{
	struct nf_block_q8_0 *y = xq;
	for (size_t b = 0; b < n / NF_QK; b++) {
		const float *v = x + b * NF_QK;
		float32x4_t f[8];
		float32x4_t m = vdupq_n_f32(0.0f);
		for (int j = 0; j < 8; j++) {
			f[j] = vld1q_f32(v + 4 * j);
			m = vmaxq_f32(m, vabsq_f32(f[j]));
		}
		float amax = vmaxvq_f32(m);
		y[b].d = nf_fp32_to_fp16(amax / 127.0f);
		float id = amax != 0.0f ? 127.0f / amax : 0.0f;
		for (int j = 0; j < 8; j += 2) {
			int32x4_t i0 = vcvtnq_s32_f32(vmulq_n_f32(f[j], id));
			int32x4_t i1 = vcvtnq_s32_f32(vmulq_n_f32(f[j + 1], id));
			int16x8_t h = vcombine_s16(vqmovn_s32(i0), vqmovn_s32(i1));
			vst1_s8(y[b].qs + 4 * j, vqmovn_s16(h));
		}
	}
}

void nf_kneon_prepare_f16(const float *x, void *xq, size_t n)
{
	uint16_t *h = xq;
	size_t i = 0;
	for (; i + 4 <= n; i += 4)
		vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
	for (; i < n; i++)
		h[i] = nf_fp32_to_fp16(x[i]);
}

/* The reference's rounding (nf_fp32_to_bf16): round to nearest even on the
 * bits, NaN made quiet. */
void nf_kneon_prepare_bf16(const float *x, void *xq, size_t n)
{
	uint16_t *h = xq;
	size_t i = 0;
	const uint32x4_t one = vdupq_n_u32(1), bias = vdupq_n_u32(0x7fff);
	const uint32x4_t inf = vdupq_n_u32(0x7f800000), absm = vdupq_n_u32(0x7fffffff);
	const uint32x4_t quiet = vdupq_n_u32(64);
	for (; i + 4 <= n; i += 4) {
		uint32x4_t u = vreinterpretq_u32_f32(vld1q_f32(x + i));
		uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), one);
		uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(bias, lsb)), 16);
		uint32x4_t nan = vcgtq_u32(vandq_u32(u, absm), inf);
		uint32x4_t q = vorrq_u32(vshrq_n_u32(u, 16), quiet);
		vst1_u16(h + i, vmovn_u32(vbslq_u32(nan, q, r)));
	}
	for (; i < n; i++)
		h[i] = nf_fp32_to_bf16(x[i]);
}

/* ---- float weights ----------------------------------------------------------- */

static inline float32x4_t ld_f32(const void *p, size_t i) { return vld1q_f32((const float *)p + i); }
static inline float32x4_t ld_f16(const void *p, size_t i)
{
	return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p + i)));
}
static inline float32x4_t ld_bf16(const void *p, size_t i)
{
	return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p + i), 16));
}
static inline float el_f32(const void *p, size_t i) { return ((const float *)p)[i]; }
static inline float el_f16(const void *p, size_t i) { return h2f(((const uint16_t *)p)[i]); }
static inline float el_bf16(const void *p, size_t i) { return nf_bf16_to_fp32(((const uint16_t *)p)[i]); }

/* F32 and BF16: four 4-lane chains, then the tail; order differs from the
 * reference only within rounding. */
#define FDOT(T)                                                                              \
	static float fdot_##T(size_t n, const void *w, const void *x)                        \
	{                                                                                    \
		float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;               \
		size_t i = 0;                                                                \
		for (; i + 16 <= n; i += 16) {                                               \
			a0 = vfmaq_f32(a0, ld_##T(w, i), ld_##T(x, i));                      \
			a1 = vfmaq_f32(a1, ld_##T(w, i + 4), ld_##T(x, i + 4));              \
			a2 = vfmaq_f32(a2, ld_##T(w, i + 8), ld_##T(x, i + 8));              \
			a3 = vfmaq_f32(a3, ld_##T(w, i + 12), ld_##T(x, i + 12));            \
		}                                                                            \
		for (; i + 4 <= n; i += 4)                                                   \
			a0 = vfmaq_f32(a0, ld_##T(w, i), ld_##T(x, i));                      \
		float s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));       \
		for (; i < n; i++)                                                           \
			s += el_##T(w, i) * el_##T(x, i);                                    \
		return s;                                                                    \
	}
FDOT(f32)
FDOT(bf16)

/* F16 in the reference's order (nf_kref_dot_f16): 16 lanes as four 4-lane
 * chains, then lanes l and l+8 added, then l and l+4, then the pair tree. */
static float fdot_f16(size_t n, const void *w, const void *x)
{
	if (n % 16)
		return nf_kref_dot_f16(n, w, x);
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
	for (size_t i = 0; i < n; i += 16) {
		a0 = vfmaq_f32(a0, ld_f16(w, i), ld_f16(x, i));
		a1 = vfmaq_f32(a1, ld_f16(w, i + 4), ld_f16(x, i + 4));
		a2 = vfmaq_f32(a2, ld_f16(w, i + 8), ld_f16(x, i + 8));
		a3 = vfmaq_f32(a3, ld_f16(w, i + 12), ld_f16(x, i + 12));
	}
	return nq_reduce8(vaddq_f32(a0, a2), vaddq_f32(a1, a3));
}

/* F16 in ggml_vec_dot_f16's order (nf_kref_dot_f16v): its four 16-lane
 * chains as sixteen 4-lane ones (a<4j + q>: chain j, lanes 4q..4q+3),
 * combined per lane as the reference, reduced as fdot_f16, the tail's f32
 * products added in double. The sixteen are named registers: as an array
 * GCC kept them on the stack, a load and a store around every fma. */
#define F16V_FMA(k) a##k = vfmaq_f32(a##k, ld_f16(w, i + 4 * (k)), ld_f16(x, i + 4 * (k)))
static float fdot_f16v(size_t n, const void *w, const void *x)
{
	float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
	float32x4_t a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
	size_t np = n & ~(size_t)63;
	for (size_t i = 0; i < np; i += 64) {
		/* the empty asm keeps GCC from hoisting all 32 loads ahead
		 * of the fmas, which spilled their values to the stack */
		F16V_FMA(0); F16V_FMA(1); F16V_FMA(2); F16V_FMA(3);
		__asm__ volatile("" ::: "memory");
		F16V_FMA(4); F16V_FMA(5); F16V_FMA(6); F16V_FMA(7);
		__asm__ volatile("" ::: "memory");
		F16V_FMA(8); F16V_FMA(9); F16V_FMA(10); F16V_FMA(11);
		__asm__ volatile("" ::: "memory");
		F16V_FMA(12); F16V_FMA(13); F16V_FMA(14); F16V_FMA(15);
	}
	float32x4_t c0 = vaddq_f32(vaddq_f32(a0, a8), vaddq_f32(a4, a12));
	float32x4_t c1 = vaddq_f32(vaddq_f32(a1, a9), vaddq_f32(a5, a13));
	float32x4_t c2 = vaddq_f32(vaddq_f32(a2, a10), vaddq_f32(a6, a14));
	float32x4_t c3 = vaddq_f32(vaddq_f32(a3, a11), vaddq_f32(a7, a15));
	double s = nq_reduce8(vaddq_f32(c0, c2), vaddq_f32(c1, c3));
	for (size_t i = np; i < n; i++)
		s += (double)(el_f16(w, i) * el_f16(x, i));
	return (float)s;
}
#undef F16V_FMA

#define FOPS(T) FMM(T) FAX(T)
#define FMM(T)                                                                               \
	void nf_kneon_gemv_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,     \
			       const void *xq, float *y)                                     \
	{                                                                                    \
		for (size_t r = 0; r < nrows; r++)                                           \
			y[r] = fdot_##T(n, (const char *)w + r * row_bytes, xq);             \
	}                                                                                    \
	/* gemm row by row through the same dot: the bits of gemv */                  \
	void nf_kneon_gemm_##T(size_t n, size_t nrows, const void *w, size_t row_bytes,     \
			       size_t nb, const void *xq, size_t xq_stride, float *y, size_t ldy) \
	{                                                                                    \
		for (size_t b = 0; b < nb; b++)                                              \
			nf_kneon_gemv_##T(n, nrows, w, row_bytes, (const char *)xq + b * xq_stride, \
					  y + b * ldy);                                      \
	}                                                                                    \
	void nf_kneon_gemv_list_##T(size_t n, size_t nrows, const void *const *rows,        \
				    const void *xq, float *y)                                \
	{                                                                                    \
		for (size_t r = 0; r < nrows; r++)                                           \
			y[r] = fdot_##T(n, rows[r], xq);                                     \
	}
#define FAX(T)                                                                               \
	void nf_kneon_axpy_##T(size_t n, float a, const void *wrow, float *y)               \
	{                                                                                    \
		size_t i = 0;                                                                \
		for (; i + 4 <= n; i += 4)                                                   \
			vst1q_f32(y + i, vfmaq_n_f32(vld1q_f32(y + i), ld_##T(wrow, i), a)); \
		for (; i < n; i++)                                                           \
			y[i] = fmaf(a, el_##T(wrow, i), y[i]);                               \
	}                                                                                    \
	/* columns in slices of 8; 16 outputs stay in registers while each column     \
	 * of the slice is added in order; the tail one fma at a time, same order */ \
	void nf_kneon_axpy_list_##T(size_t n, size_t ncols, const float *a,                 \
				    const void *const *cols, float *y)                       \
	{                                                                                    \
		for (size_t c0 = 0; c0 < ncols; c0 += 8) {                                   \
			size_t cn = ncols - c0 < 8 ? ncols - c0 : 8;                         \
			const void *const *cc = cols + c0;                                   \
			const float *ac = a + c0;                                            \
			size_t i = 0;                                                        \
			for (; i + 16 <= n; i += 16) {                                       \
				float32x4_t o0 = vld1q_f32(y + i), o1 = vld1q_f32(y + i + 4); \
				float32x4_t o2 = vld1q_f32(y + i + 8), o3 = vld1q_f32(y + i + 12); \
				for (size_t c = 0; c < cn; c++) {                            \
					o0 = vfmaq_n_f32(o0, ld_##T(cc[c], i), ac[c]);       \
					o1 = vfmaq_n_f32(o1, ld_##T(cc[c], i + 4), ac[c]);   \
					o2 = vfmaq_n_f32(o2, ld_##T(cc[c], i + 8), ac[c]);   \
					o3 = vfmaq_n_f32(o3, ld_##T(cc[c], i + 12), ac[c]);  \
				}                                                            \
				vst1q_f32(y + i, o0);                                        \
				vst1q_f32(y + i + 4, o1);                                    \
				vst1q_f32(y + i + 8, o2);                                    \
				vst1q_f32(y + i + 12, o3);                                   \
			}                                                                    \
			for (; i < n; i++)                                                   \
				for (size_t c = 0; c < cn; c++)                              \
					y[i] = fmaf(ac[c], el_##T(cc[c], i), y[i]);          \
		}                                                                            \
	}
FOPS(f32)
FOPS(f16)
FOPS(bf16)
FMM(f16v)

/* ---- quantized axpy ---------------------------------------------------------- */

/* o[0..4) += a * (q * d) for a block's 16 signed bytes, as four f32 vectors:
 * the weight q * d is exact in f32, then one fma (the reference's bits). */
static inline void qfma16(int8x16_t q, float d, float a, float32x4_t o[4])
{
	int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
	int32x4_t v[4] = { vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo),
			   vmovl_s16(vget_low_s16(hi)), vmovl_high_s16(hi) };
	for (int k = 0; k < 4; k++)
		o[k] = vfmaq_n_f32(o[k], vmulq_n_f32(vcvtq_f32_s32(v[k]), d), a);
}

#define QAXPY(T, WBLOCK)                                                                     \
	void nf_kneon_axpy_##T(size_t n, float a, const void *wrow, float *y)               \
	{                                                                                    \
		const WBLOCK *b = wrow;                                                      \
		for (size_t i = 0; i < n / NF_QK; i++) {                                     \
			int8x16_t q0, q1;                                                    \
			nq_##T##_unpack(b + i, &q0, &q1);                                     \
			float d = h2f(b[i].d), *o = y + i * NF_QK;                           \
			float32x4_t v[8];                                                    \
			for (int k = 0; k < 8; k++)                                          \
				v[k] = vld1q_f32(o + 4 * k);                                 \
			qfma16(q0, d, a, v);                                                 \
			qfma16(q1, d, a, v + 4);                                             \
			for (int k = 0; k < 8; k++)                                          \
				vst1q_f32(o + 4 * k, v[k]);                                  \
		}                                                                            \
	}                                                                                    \
	/* per block of 32 outputs, the 8 registers stay loaded while each column    \
	 * adds its fma, in column order: the chain axpy column by column gives */     \
	void nf_kneon_axpy_list_##T(size_t n, size_t ncols, const float *a,                 \
				    const void *const *cols, float *y)                       \
	{                                                                                    \
		size_t nb = n / NF_QK;                                                       \
		for (size_t c0 = 0; c0 < ncols; c0 += 8) {                                   \
			size_t cn = ncols - c0 < 8 ? ncols - c0 : 8;                         \
			for (size_t i = 0; i < nb; i++) {                                    \
				float *o = y + i * NF_QK;                                    \
				float32x4_t v[8];                                            \
				for (int k = 0; k < 8; k++)                                  \
					v[k] = vld1q_f32(o + 4 * k);                         \
				for (size_t c = 0; c < cn; c++) {                            \
					const WBLOCK *b = (const WBLOCK *)cols[c0 + c] + i;  \
					int8x16_t q0, q1;                                    \
					nq_##T##_unpack(b, &q0, &q1);                         \
					float d = h2f(b->d);                                 \
					qfma16(q0, d, a[c0 + c], v);                         \
					qfma16(q1, d, a[c0 + c], v + 4);                     \
				}                                                            \
				for (int k = 0; k < 8; k++)                                  \
					vst1q_f32(o + 4 * k, v[k]);                          \
			}                                                                    \
		}                                                                            \
	}
QAXPY(q8_0, struct nf_block_q8_0)
QAXPY(q4_0, struct nf_block_q4_0)

/* ---- vector ops ---------------------------------------------------------------- */


void nf_kneon_axpy_f32v(size_t n, float a, const float *x, float *y)
{
	nf_kneon_axpy_f32(n, a, x, y);
}

/* As the reference: squares in f32 summed in double (here two 2-lane
 * chains, so within rounding of it), mean and scale in f32. */
void nf_kneon_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps)
{
	float64x2_t s0 = vdupq_n_f64(0.0), s1 = s0;
	size_t i = 0;
	for (; i + 4 <= n; i += 4) {
		float32x4_t v = vld1q_f32(x + i);
		float32x4_t sq = vmulq_f32(v, v);
		s0 = vaddq_f64(s0, vcvt_f64_f32(vget_low_f32(sq)));
		s1 = vaddq_f64(s1, vcvt_high_f64_f32(sq));
	}
	double sum = vaddvq_f64(vaddq_f64(s0, s1));
	for (; i < n; i++)
		sum += (double)(x[i] * x[i]);
	float mean = (float)(sum / (double)n);
	float scale = 1.0f / sqrtf(mean + eps);
	for (i = 0; i + 4 <= n; i += 4) {
		float32x4_t v = vmulq_n_f32(vld1q_f32(x + i), scale);
		if (w)
			v = vmulq_f32(v, vld1q_f32(w + i));
		vst1q_f32(out + i, v);
	}
	for (; i < n; i++)
		out[i] = w ? (x[i] * scale) * w[i] : x[i] * scale;
}

/*
 * ggml's AVX-512 expf on 4 lanes, step for step as nf_expf_ggml, so
 * the same bits (kernels_avx2.c's expf_ggml8): a lane with |n| > 126 or a
 * NaN sends the 4 lanes to the C reference.
 */
static inline float32x4_t expf_ggml4(float32x4_t x)
{
	const float32x4_t r = vdupq_n_f32(0x1.8p23f);
	float32x4_t z = vfmaq_f32(r, x, vdupq_n_f32(0x1.715476p+0f));
	float32x4_t n = vsubq_f32(z, r);
	float32x4_t b = vfmsq_f32(vfmsq_f32(x, n, vdupq_n_f32(0x1.62e4p-1f)), n, vdupq_n_f32(0x1.7f7d1cp-20f));
	uint32x4_t ok = vcleq_f32(vabsq_f32(n), vdupq_n_f32(126.0f));
	if (vminvq_u32(ok) == 0) {
		float v[4];
		vst1q_f32(v, x);
		for (int l = 0; l < 4; l++)
			v[l] = nf_expf_ggml(v[l]);
		return vld1q_f32(v);
	}
	float32x4_t u = vmulq_f32(b, b);
	float32x4_t j = vfmaq_f32(vfmaq_f32(vdupq_n_f32(1.0f), vdupq_n_f32(0x1.ffffecp-1f), b),
				  vfmaq_f32(vfmaq_f32(vdupq_n_f32(0x1.fffdb6p-2f), vdupq_n_f32(0x1.555e66p-3f), b),
					    vfmaq_f32(vdupq_n_f32(0x1.573e2ep-5f), vdupq_n_f32(0x1.0e4020p-7f), b), u),
				  u);
	int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
	return vmulq_f32(j, vreinterpretq_f32_s32(e));
}

/* nf_sum16 of the 16 values in a (0..3), b, c, d (12..15) */
static inline float sum16(float32x4_t a, float32x4_t b, float32x4_t c, float32x4_t d)
{
	float32x4_t lo = vaddq_f32(a, c), hi = vaddq_f32(b, d); /* t8[0..3], t8[4..7] */
	float32x4_t t4 = vaddq_f32(lo, hi);
	return (vgetq_lane_f32(t4, 0) + vgetq_lane_f32(t4, 2)) + (vgetq_lane_f32(t4, 1) + vgetq_lane_f32(t4, 3));
}

/* nf_kref_silu_mul's bits */
void nf_kneon_silu_mul(float *g, const float *u, size_t n)
{
	const float32x4_t one = vdupq_n_f32(1.0f), zero = vdupq_n_f32(0.0f);
	size_t i = 0;
	for (; i + 16 <= n; i += 16)
		for (size_t h = i; h < i + 16; h += 4) {
			float32x4_t v = vld1q_f32(g + h);
			float32x4_t s = vdivq_f32(v, vaddq_f32(one, expf_ggml4(vsubq_f32(zero, v))));
			if (u)
				s = vmulq_f32(s, vld1q_f32(u + h));
			vst1q_f32(g + h, s);
		}
	if (i < n)
		nf_kref_silu_mul(g + i, u ? u + i : NULL, n - i);
}

/* nf_kref_softmax's bits */
void nf_kneon_softmax(float *x, size_t n)
{
	if (!n)
		return;
	size_t i = 0;
	float32x4_t mv = vdupq_n_f32(-INFINITY);
	for (; i + 4 <= n; i += 4)
		mv = vmaxq_f32(mv, vld1q_f32(x + i));
	float max = vmaxvq_f32(mv);
	for (; i < n; i++)
		max = fmaxf(max, x[i]);
	mv = vdupq_n_f32(max);
	double sum = 0.0;
	for (i = 0; i + 16 <= n; i += 16) {
		float32x4_t e[4];
		for (int q = 0; q < 4; q++) {
			e[q] = expf_ggml4(vsubq_f32(vld1q_f32(x + i + 4 * q), mv));
			vst1q_f32(x + i + 4 * q, e[q]);
		}
		sum += (double)sum16(e[0], e[1], e[2], e[3]);
	}
	for (; i < n; i++) {
		x[i] = expf(x[i] - max);
		sum += (double)x[i];
	}
	float inv = (float)(1.0 / sum);
	for (i = 0; i + 4 <= n; i += 4)
		vst1q_f32(x + i, vmulq_n_f32(vld1q_f32(x + i), inv));
	for (; i < n; i++)
		x[i] *= inv;
}

/* nf_kref_dot_f32's bits: the four 16-lane chains as sixteen 4-lane ones */
float nf_kneon_dot_f32v(const float *a, const float *b, size_t n)
{
	size_t np = n & ~(size_t)63;
	float sum = 0.0f;
	if (np) {
		float32x4_t acc[16];
		for (int j = 0; j < 16; j++)
			acc[j] = vdupq_n_f32(0.0f);
		for (size_t i = 0; i < np; i += 64)
			for (int j = 0; j < 16; j++)
				acc[j] = vfmaq_f32(acc[j], vld1q_f32(a + i + 4 * j), vld1q_f32(b + i + 4 * j));
		float32x4_t c[4];
		for (int q = 0; q < 4; q++)
			c[q] = vaddq_f32(vaddq_f32(acc[q], acc[8 + q]), vaddq_f32(acc[4 + q], acc[12 + q]));
		sum = sum16(c[0], c[1], c[2], c[3]);
	}
	for (size_t i = np; i < n; i++)
		sum += a[i] * b[i];
	return sum;
}

const struct nf_kernels nf_kernels_table_neon = {
	.isa = "neon",
	NF_KNEON_SHARED_ENTRIES,
	NF_KNEON_QUANT_ENTRIES,
	NF_KNEON_KQUANT_ENTRIES,
	NF_KREF_LEGACY_ENTRIES,
};
