/*
 * test_compute_kernels.c - the kernel tables: the reference against
 * double-precision formulas, and every ISA's every entry against the
 * reference on odd sizes. A build has only its target's SIMD tables
 * (x86-64: avx2, avx512; arm64: neon, neon-dot); the others skip.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/kernels.h"

static const char *const isas[] = { "scalar", "avx2", "avx512", "avx512-256", "neon", "neon-dot" };
static const enum nf_ktype all_kt[] = { NF_KT_F32, NF_KT_F16, NF_KT_BF16, NF_KT_Q8_0, NF_KT_Q4_0,
					NF_KT_Q2_K, NF_KT_Q3_K, NF_KT_Q4_K, NF_KT_Q5_K, NF_KT_Q6_K,
					NF_KT_Q4_0L, NF_KT_F16V, NF_KT_Q4_1, NF_KT_Q5_0, NF_KT_Q5_1 };
_Static_assert(sizeof(all_kt) / sizeof(all_kt[0]) == NF_KT_COUNT, "every ktype tested");
static const uint32_t kt_dtype[NF_KT_COUNT] = {
	[NF_KT_F32] = NF_DTYPE_F32, [NF_KT_F16] = NF_DTYPE_F16, [NF_KT_BF16] = NF_DTYPE_BF16,
	[NF_KT_Q8_0] = NF_DTYPE_Q8_0, [NF_KT_Q4_0] = NF_DTYPE_Q4_0,
	[NF_KT_Q2_K] = NF_DTYPE_Q2_K, [NF_KT_Q3_K] = NF_DTYPE_Q3_K, [NF_KT_Q4_K] = NF_DTYPE_Q4_K,
	[NF_KT_Q5_K] = NF_DTYPE_Q5_K, [NF_KT_Q6_K] = NF_DTYPE_Q6_K, [NF_KT_Q4_0L] = NF_DTYPE_Q4_0,
	[NF_KT_F16V] = NF_DTYPE_F16, [NF_KT_Q4_1] = NF_DTYPE_Q4_1, [NF_KT_Q5_0] = NF_DTYPE_Q5_0,
	[NF_KT_Q5_1] = NF_DTYPE_Q5_1,
};

/* Row lengths a type can hold: multiples of its block (256 for K-quants). */
static bool fits(enum nf_ktype kt, size_t n)
{
	return n % nf_dtype_block_len(kt_dtype[kt]) == 0;
}

struct rng { uint64_t s; };

static float rnd(struct rng *r)
{
	r->s = r->s * 6364136223846793005ull + 1442695040888963407ull;
	return (float)((r->s >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f; /* [-1, 1) */
}

/* Fill n floats with a per-32-block scale spread so blocks differ in amax;
 * block 1 (if any) is all zeros to reach the amax == 0 path. */
static void fill(struct rng *r, float *x, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		size_t b = i / 32;
		float scale = (b == 1) ? 0.0f : ldexpf(1.0f, (int)(b % 7) - 3);
		x[i] = rnd(r) * scale;
	}
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);
	cr_assert_not_null(p);
	return p;
}

/* Sum of w*x and of |w*x| in double on the dequantized operands; for
 * Q4_1/Q5_1 (Q8_1 activations) the min term as ggml defines it, m_w times
 * the block's stored s = d_x * sum(q_x) (fp16), not sum(m_w * x). */
static void exact_dot(enum nf_ktype kt, size_t n, const void *w, const void *xq,
		      double *dot, double *absdot)
{
	if (nf_ktype_dot_dtype(kt) == NF_DTYPE_Q8_1) {
		const struct nf_block_q8_1 *xb = xq;
		size_t bs = nf_dtype_block_size(kt_dtype[kt]);
		double s = 0, a = 0;
		for (size_t b = 0; b < n / 32; b++) {
			const char *wb = (const char *)w + b * bs;
			uint8_t q[32];
			nf_quant5_unpack(kt_dtype[kt], wb, q);
			double dw = nf_fp16_to_fp32(((const uint16_t *)wb)[0]);
			double m = nf_fp16_to_fp32(((const uint16_t *)wb)[1]);
			double dx = nf_fp16_to_fp32(xb[b].d), sx = nf_fp16_to_fp32(xb[b].s);
			for (int i = 0; i < 32; i++) {
				s += dw * q[i] * dx * xb[b].qs[i];
				a += fabs(dw * q[i] * dx * xb[b].qs[i]);
			}
			s += m * sx;
			a += fabs(m * sx);
		}
		*dot = s;
		*absdot = a;
		return;
	}
	float *wf = xmalloc(n * sizeof(float)), *xf = xmalloc(n * sizeof(float));
	nf_dequantize_row(kt_dtype[kt], w, wf, n);
	nf_dequantize_row(nf_ktype_dot_dtype(kt), xq, xf, n);
	double s = 0, a = 0;
	for (size_t i = 0; i < n; i++) {
		s += (double)wf[i] * xf[i];
		a += fabs((double)wf[i] * xf[i]);
	}
	*dot = s;
	*absdot = a;
	free(wf);
	free(xf);
}

static const struct nf_kernels *isa_or_skip(const char *isa)
{
	const struct nf_kernels *k = nf_kernels_isa(isa);
	if (!k)
		cr_skip_test("ISA %s not available on this CPU or build", isa);
	cr_assert_str_eq(k->isa, isa);
	return k;
}

static void quant_row(enum nf_ktype kt, const float *src, void *dst, size_t n)
{
	nf_quantize_row(kt_dtype[kt], src, dst, n);
}

/*
 * The two Q4_0 orders of the reference, written out: NF_KT_Q4_0 as
 * llama.cpp's repacked kernels (one fma of the block's integer sum per
 * block), NF_KT_Q4_0L as ggml's vec_dot (8 lanes, hsum at the end); and
 * the two differ on some row, so neither can stand in for the other.
 */
static bool same_bits(float a, float b)
{
	return !memcmp(&a, &b, sizeof(a));
}

Test(kernels, q4_0_orders)
{
	const size_t n = 4096, nrows = 64, nb = n / 32;
	struct rng r = { 41 };
	float *w = xmalloc(n * nrows * sizeof(float)), *x = xmalloc(n * sizeof(float));
	for (size_t i = 0; i < n * nrows; i++)
		w[i] = rnd(&r);
	for (size_t i = 0; i < n; i++)
		x[i] = rnd(&r) * 3.0f;
	struct nf_block_q4_0 *wq = xmalloc(nrows * nb * sizeof(*wq));
	struct nf_block_q8_0 *xq = xmalloc(nb * sizeof(*xq));
	for (size_t i = 0; i < nrows; i++)
		nf_quantize_row(NF_DTYPE_Q4_0, w + i * n, wq + i * nb, n);
	const struct nf_kernels *k = nf_kernels_ref();
	k->act_prepare[NF_KT_Q4_0](x, xq, n);
	float yb[64], yl[64];
	k->gemv[NF_KT_Q4_0](n, nrows, wq, nb * sizeof(*wq), xq, yb);
	k->gemv[NF_KT_Q4_0L](n, nrows, wq, nb * sizeof(*wq), xq, yl);
	int differ = 0;
	for (size_t row = 0; row < nrows; row++) {
		const struct nf_block_q4_0 *b = wq + row * nb;
		float acc = 0.0f, lane[8] = { 0 };
		for (size_t i = 0; i < nb; i++) {
			int32_t s = 0, l[8] = { 0 };
			for (int j = 0; j < 32; j++) {
				int q = j < 16 ? (b[i].qs[j] & 15) - 8 : (b[i].qs[j - 16] >> 4) - 8;
				s += q * xq[i].qs[j];
				l[j / 4] += q * xq[i].qs[j];
			}
			float d = nf_fp16_to_fp32(b[i].d) * nf_fp16_to_fp32(xq[i].d);
			acc = fmaf((float)s, d, acc);
			for (int j = 0; j < 8; j++)
				lane[j] = fmaf(d, (float)l[j], lane[j]);
		}
		float hs = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
		cr_assert(same_bits(yb[row], acc), "row %zu: block order %a, want %a", row, yb[row], acc);
		cr_assert(same_bits(yl[row], hs), "row %zu: lane order %a, want %a", row, yl[row], hs);
		differ += !same_bits(acc, hs);
	}
	cr_assert(differ > 0, "the two orders gave the same bits on all %zu rows", nrows);
	free(w);
	free(x);
	free(wq);
	free(xq);
}

/*
 * F16's two orders, written out as ggml sums them: NF_KT_F16 as llamafile's
 * tinyBLAS (one 16-lane fma chain, _mm512_reduce_add_ps), NF_KT_F16V as
 * ggml_vec_dot_f16 (four 16-lane chains per 64 values, the tail in
 * double); every table gives these bits, and the two differ on some row.
 */
static float reduce16(const float *v)
{
	float h[8], q[4];
	for (int l = 0; l < 8; l++)
		h[l] = v[l] + v[l + 8];
	for (int l = 0; l < 4; l++)
		q[l] = h[l] + h[l + 4];
	return (q[0] + q[2]) + (q[1] + q[3]);
}

Test(kernels, f16_orders)
{
	const size_t ns[] = { 4096, 4096 + 48, 40 }, nrows = 32;
	struct rng r = { 43 };
	int differ = 0;
	for (size_t ni = 0; ni < 3; ni++) {
		size_t n = ns[ni];
		float *wf = xmalloc(n * sizeof(float)), *xf = xmalloc(n * sizeof(float));
		uint16_t *w = xmalloc(nrows * n * 2), *xh = xmalloc(n * 2);
		for (size_t i = 0; i < nrows; i++) {
			fill(&r, wf, n);
			nf_quantize_row(NF_DTYPE_F16, wf, w + i * n, n);
		}
		fill(&r, xf, n);
		nf_kernels_ref()->act_prepare[NF_KT_F16V](xf, xh, n);
		float want_rows[32];
		for (size_t row = 0; row < nrows; row++) {
			const uint16_t *a = w + row * n;
			float t[16] = { 0 }, v[4][16] = { { 0 } };
			size_t np = n & ~(size_t)63;
			for (size_t i = 0; i + 16 <= n && n % 16 == 0; i += 16)
				for (int l = 0; l < 16; l++)
					t[l] = fmaf(nf_fp16_to_fp32(a[i + l]), nf_fp16_to_fp32(xh[i + l]), t[l]);
			for (size_t i = 0; i < np; i++)
				v[i % 64 / 16][i % 16] = fmaf(nf_fp16_to_fp32(a[i]), nf_fp16_to_fp32(xh[i]),
							       v[i % 64 / 16][i % 16]);
			for (int l = 0; l < 16; l++)
				v[0][l] = (v[0][l] + v[2][l]) + (v[1][l] + v[3][l]);
			double s = reduce16(v[0]);
			for (size_t i = np; i < n; i++)
				s += (double)(nf_fp16_to_fp32(a[i]) * nf_fp16_to_fp32(xh[i]));
			float want_v = (float)s, want_t = n % 16 ? want_v : reduce16(t);
			want_rows[row] = want_v;
			for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
				const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
				if (!k)
					continue;
				float yt, yv;
				k->gemv[NF_KT_F16](n, 1, a, 0, xh, &yt);
				k->gemv[NF_KT_F16V](n, 1, a, 0, xh, &yv);
				cr_assert(same_bits(yt, want_t), "%s n %zu row %zu: tinyBLAS order %a, want %a", k->isa,
					  n, row, yt, want_t);
				cr_assert(same_bits(yv, want_v), "%s n %zu row %zu: vec_dot order %a, want %a", k->isa,
					  n, row, yv, want_v);
			}
			differ += !same_bits(want_t, want_v);
		}
		/* several rows at once (the kernels run rows side by side), and a
		 * count that leaves a remainder */
		for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
			const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
			if (!k)
				continue;
			const size_t counts[] = { nrows, 7 };
			for (size_t ci = 0; ci < 2; ci++) {
				float y[32];
				k->gemv[NF_KT_F16V](n, counts[ci], w, n * 2, xh, y);
				for (size_t row = 0; row < counts[ci]; row++)
					cr_assert(same_bits(y[row], want_rows[row]),
						  "%s n %zu, %zu rows: row %zu %a, want %a", k->isa, n, counts[ci],
						  row, y[row], want_rows[row]);
			}
		}
		free(wf);
		free(xf);
		free(w);
		free(xh);
	}
	cr_assert(differ > 0, "the two F16 orders gave the same bits on every row");
}

Test(kernels, type_mapping)
{
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_F16, 4096, false), NF_KT_F16);
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_F16, 4096, true), NF_KT_F16V, "PowerInfer's ggml: vec_dot");
	cr_assert_eq(nf_ktype_column(NF_KT_F16, 1), NF_KT_F16V, "one column: vec_dot");
	cr_assert_eq(nf_ktype_column(NF_KT_F16, 2), NF_KT_F16, "two or more: tinyBLAS");
	cr_assert_eq(nf_ktype_column(NF_KT_Q4_0, 1), NF_KT_Q4_0);
	cr_assert_eq(nf_ktype_dot_dtype(NF_KT_F16V), NF_DTYPE_F16);
	cr_assert_eq(nf_ktype_of(NF_DTYPE_Q4_0), NF_KT_Q4_0);
	cr_assert_eq(nf_ktype_of(NF_DTYPE_BF16), NF_KT_BF16);
	cr_assert_eq(nf_ktype_of(12345), -1);
	cr_assert_eq(nf_ktype_dot_dtype(NF_KT_Q4_0), NF_DTYPE_Q8_0);
	cr_assert_eq(nf_ktype_dot_dtype(NF_KT_Q4_0L), NF_DTYPE_Q8_0);
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_Q4_0, 4096, false), NF_KT_Q4_0);
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_Q4_0, 4100, false), NF_KT_Q4_0L, "rows not a multiple of 8");
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_Q4_0, 4096, true), NF_KT_Q4_0L);
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_Q8_0, 4100, true), NF_KT_Q8_0);
	cr_assert_eq(nf_ktype_matrix(NF_DTYPE_Q4_K, 4096, true), NF_KT_Q4_K);
	cr_assert_eq(nf_ktype_dot_dtype(NF_KT_F16), NF_DTYPE_F16);
	cr_assert_eq(nf_ktype_dot_dtype(NF_KT_F32), NF_DTYPE_F32);
	cr_assert_eq(nf_act_size(NF_KT_Q4_0, 4096), 4096 / 32 * 34);
	cr_assert_eq(nf_act_size(NF_KT_F16, 100), 200);
	cr_assert_eq(nf_act_size(NF_KT_F32, 100), 400);
	const struct nf_kernels *k = nf_kernels_get();
	cr_assert_not_null(k);
	cr_assert_eq(k, nf_kernels_get(), "chosen once");
	cr_assert_not_null(nf_kernels_isa("scalar"));
	cr_assert_null(nf_kernels_isa("amx"));
	cr_assert_null(nf_kernels_isa(NULL));
}

/* NFLASH_ISA forces a table. The choice is made once per process, and
 * Criterion runs every test in a process of its own, so setenv here is seen
 * by the first nf_kernels_get() call. */
Test(kernels, env_forces_scalar)
{
	setenv("NFLASH_ISA", "scalar", 1);
	cr_assert_str_eq(nf_kernels_get()->isa, "scalar");
}

Test(kernels, env_unknown_falls_back)
{
	setenv("NFLASH_ISA", "no-such-isa", 1);
	const struct nf_kernels *k = nf_kernels_get();
	cr_assert_not_null(k);
	cr_assert_not_null(nf_kernels_isa(k->isa));
}

/* The Q8_0 activation rule: d = amax/127, q = x*127/amax rounded to
 * nearest with ties to even (as ggml's _mm256_round_ps path). */
Test(kernels, q8_0_prepare_rounds_ties_to_even)
{
	float x[64] = { 0 };
	x[0] = 127.0f;  /* amax: id = 1 exactly */
	x[1] = 2.5f;
	x[2] = -3.5f;
	x[3] = 0.5f;
	x[4] = -0.5f;
	x[5] = 1.5f;
	x[6] = -126.5f;
	/* second block all zero: d = 0, q = 0 */
	struct nf_block_q8_0 q[2];
	memset(q, 0x55, sizeof(q));
	nf_kernels_ref()->act_prepare[NF_KT_Q8_0](x, q, 64);
	cr_assert_eq(nf_fp16_to_fp32(q[0].d), nf_fp16_to_fp32(nf_fp32_to_fp16(1.0f)));
	int8_t want[7] = { 127, 2, -4, 0, 0, 2, -126 };
	for (int i = 0; i < 7; i++)
		cr_assert_eq(q[0].qs[i], want[i], "q[%d] = %d, want %d", i, q[0].qs[i], want[i]);
	cr_assert_eq(q[1].d, 0);
	for (int i = 0; i < 32; i++)
		cr_assert_eq(q[1].qs[i], 0);
}

/* The reference's matrix products against the same products in double. */
Test(kernels, ref_gemv_matches_double)
{
	const struct nf_kernels *k = nf_kernels_ref();
	struct rng r = { 1 };
	const size_t ns[] = { 32, 96, 256, 4096 + 32, 4096 + 256 };
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			size_t n = ns[ni], rows = 5;
			if (!fits(kt, n))
				continue;
			size_t rb = nf_dtype_row_size(kt_dtype[kt], n);
			float *x = xmalloc(n * sizeof(float)), *wf = xmalloc(n * sizeof(float));
			char *w = xmalloc(rows * rb), *xq = xmalloc(nf_act_size(kt, n));
			float y[5];
			fill(&r, x, n);
			for (size_t i = 0; i < rows; i++) {
				fill(&r, wf, n);
				quant_row(kt, wf, w + i * rb, n);
			}
			k->act_prepare[kt](x, xq, n);
			k->gemv[kt](n, rows, w, rb, xq, y);
			for (size_t i = 0; i < rows; i++) {
				double e, a;
				exact_dot(kt, n, w + i * rb, xq, &e, &a);
				cr_assert(fabs(y[i] - e) <= 1e-5 * a + 1e-30,
					  "kt %d n %zu row %zu: %g vs %g", kt, n, i, y[i], e);
			}
			free(x);
			free(wf);
			free(w);
			free(xq);
		}
	}
}

Test(kernels, ref_vector_ops_match_double)
{
	const struct nf_kernels *k = nf_kernels_ref();
	struct rng r = { 2 };
	size_t n = 333;
	float x[333], w[333], o[333], g[333], u[333];
	for (size_t i = 0; i < n; i++) {
		x[i] = rnd(&r) * 4;
		w[i] = rnd(&r);
		u[i] = rnd(&r);
	}
	double ss = 0;
	for (size_t i = 0; i < n; i++)
		ss += (double)x[i] * x[i];
	double sc = 1.0 / sqrt(ss / n + 1e-5);
	k->rmsnorm(o, x, w, n, 1e-5f);
	for (size_t i = 0; i < n; i++)
		cr_assert(fabs(o[i] - x[i] * sc * w[i]) <= 1e-6 * fabs(x[i] * sc) + 1e-7);

	memcpy(g, x, sizeof(g));
	k->softmax(g, n);
	double mx = -INFINITY, sum = 0;
	for (size_t i = 0; i < n; i++)
		mx = fmax(mx, x[i]);
	for (size_t i = 0; i < n; i++)
		sum += exp(x[i] - mx);
	for (size_t i = 0; i < n; i++)
		cr_assert(fabs(g[i] - exp(x[i] - mx) / sum) <= 1e-6 * exp(x[i] - mx) / sum + 1e-9);

	memcpy(g, x, sizeof(g));
	k->silu_mul(g, u, n);
	for (size_t i = 0; i < n; i++) {
		double s = x[i] / (1 + exp(-(double)x[i])) * u[i];
		cr_assert(fabs(g[i] - s) <= 1e-6 * fabs(s) + 1e-7, "silu %zu", i);
	}
	memcpy(g, x, sizeof(g));
	k->relu_mul(g, u, n);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(g[i], x[i] > 0 ? x[i] * u[i] : 0.0f * u[i]);
	memcpy(g, x, sizeof(g));
	k->drelu_mul(g, u, n);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(g[i], (x[i] > 0 ? x[i] : 0) * (u[i] > 0 ? u[i] : 0));
	memcpy(g, x, sizeof(g));
	k->relu_mul(g, NULL, n);
	for (size_t i = 0; i < n; i++)
		cr_assert_eq(g[i], x[i] > 0 ? x[i] : 0);
}

Test(kernels, rope_matches_double)
{
	const size_t n_head = 3, hd = 64;
	const int64_t positions[] = { 0, 1, 7, 100, 100 };
	struct rng r = { 3 };
	float ff[32]; /* LLaMA 3.1-style factors: 1 for fast pairs, up to 8 for slow ones */
	for (size_t i = 0; i < 32; i++)
		ff[i] = i < 8 ? 1.0f : i < 24 ? 1.0f + (float)(i - 8) * 0.4375f : 8.0f;
	for (size_t pi = 0; pi < 5; pi++) {
		float x[3 * 64], y[3 * 64];
		for (size_t i = 0; i < n_head * hd; i++)
			x[i] = y[i] = rnd(&r);
		float fs = pi == 3 ? 0.25f : 1.0f;
		nf_rope(y, n_head, hd, positions[pi], 10000.0f, fs, pi == 4 ? ff : NULL);
		for (size_t h = 0; h < n_head; h++)
			for (size_t i = 0; i < hd; i += 2) {
				double th = positions[pi] * fs * pow(10000.0, -(double)i / hd) / (pi == 4 ? ff[i / 2] : 1);
				double x0 = x[h * hd + i], x1 = x[h * hd + i + 1];
				double e0 = x0 * cos(th) - x1 * sin(th), e1 = x0 * sin(th) + x1 * cos(th);
				cr_assert(fabs(y[h * hd + i] - e0) < 2e-5 && fabs(y[h * hd + i + 1] - e1) < 2e-5,
					  "pos %lld head %zu pair %zu", (long long)positions[pi], h, i);
			}
	}
}

/* ---- every ISA against the reference ------------------------------------- */

static void check_prepare(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 4 };
	const size_t n = 4096 + 96;
	float *x = xmalloc(n * sizeof(float));
	fill(&r, x, n);
	/* ties for the rounding mode: amax 127 in block 0, halves elsewhere */
	x[0] = 127.0f;
	for (int i = 1; i < 32; i++)
		x[i] = (float)(i - 16) + 0.5f;
	/* Q8_K: two values of the largest magnitude in a block, the first wins */
	x[300] = -50.0f;
	x[310] = 50.0f;
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		for (size_t m = 32; m <= n; m += (m < 256 ? 32 : 1024)) {
			if (!fits(kt, m))
				continue;
			size_t sz = nf_act_size(kt, m);
			unsigned char *a = xmalloc(sz + 16), *b = xmalloc(sz + 16);
			memset(a, 0xa5, sz + 16);
			memset(b, 0xa5, sz + 16);
			ref->act_prepare[kt](x, a, m);
			k->act_prepare[kt](x, b, m);
			cr_assert(!memcmp(a, b, sz + 16), "%s act_prepare kt %d n %zu differs",
				  k->isa, kt, m);
			free(a);
			free(b);
		}
	}
	free(x);
}

/*
 * Q8_0, Q4_0 and F16 products sum in llama.cpp's order on every ISA (the
 * model's fidelity depends on it: activations are re-rounded every layer,
 * so one ulp can flip a rounding downstream), hence identical bits; F32 and
 * BF16 only agree within rounding.
 */
static bool exact_order(enum nf_ktype kt)
{
	return kt != NF_KT_F32 && kt != NF_KT_BF16;
}

static void check_matmul(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 5 };
	const size_t ns[] = { 32, 64, 96, 160, 256, 544, 768, 4096 + 32 };
	const size_t rows_max = 19, nb_max = 9;
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			size_t n = ns[ni];
			if (!fits(kt, n))
				continue;
			size_t rb = nf_dtype_row_size(kt_dtype[kt], n) + 64; /* padded rows */
			size_t as = nf_act_size(kt, n), xs = as + 32;
			float *xf = xmalloc(n * sizeof(float)), *wf = xmalloc(n * sizeof(float));
			char *w = xmalloc(rows_max * rb), *xq = xmalloc(nb_max * xs);
			memset(w, 0, rows_max * rb);
			memset(xq, 0, nb_max * xs);
			for (size_t i = 0; i < rows_max; i++) {
				fill(&r, wf, n);
				quant_row(kt, wf, w + i * rb, n);
			}
			for (size_t b = 0; b < nb_max; b++) {
				fill(&r, xf, n);
				ref->act_prepare[kt](xf, xq + b * xs, n);
			}
			double bound[9][19], exact[9][19];
			for (size_t b = 0; b < nb_max; b++)
				for (size_t i = 0; i < rows_max; i++)
					exact_dot(kt, n, w + i * rb, xq + b * xs, &exact[b][i], &bound[b][i]);
			float ya[19], yb[19];
			const size_t row_counts[] = { 1, 3, 5, 8, 13, 19 };
			for (size_t ri = 0; ri < 6; ri++) {
				size_t rows = row_counts[ri];
				ref->gemv[kt](n, rows, w, rb, xq, ya);
				k->gemv[kt](n, rows, w, rb, xq, yb);
				for (size_t i = 0; i < rows; i++)
					cr_assert(exact_order(kt) ? !memcmp(&ya[i], &yb[i], sizeof(float))
								  : fabs(ya[i] - yb[i]) <= 1e-5 * bound[0][i] + 1e-30,
						  "%s gemv kt %d n %zu rows %zu row %zu: %.9g vs ref %.9g",
						  k->isa, kt, n, rows, i, yb[i], ya[i]);
			}
			const size_t nbs[] = { 1, 2, 4, 5, 9 };
			size_t ldy = rows_max + 3;
			float *ga = xmalloc(nb_max * ldy * sizeof(float));
			float *gb = xmalloc(nb_max * ldy * sizeof(float));
			for (size_t bi = 0; bi < 5; bi++)
				for (size_t ri = 0; ri < 6; ri++) {
					size_t nb = nbs[bi], rows = row_counts[ri];
					for (size_t i = 0; i < nb_max * ldy; i++)
						ga[i] = gb[i] = -7.0f;
					ref->gemm[kt](n, rows, w, rb, nb, xq, xs, ga, ldy);
					k->gemm[kt](n, rows, w, rb, nb, xq, xs, gb, ldy);
					for (size_t b = 0; b < nb_max; b++)
						for (size_t i = 0; i < ldy; i++) {
							float a = ga[b * ldy + i], c = gb[b * ldy + i];
							if (b >= nb || i >= rows) {
								cr_assert_eq(c, -7.0f, "%s gemm wrote outside y", k->isa);
								continue;
							}
							cr_assert(exact_order(kt) ? !memcmp(&a, &c, sizeof(float))
										  : fabs(a - c) <= 1e-5 * bound[b][i] + 1e-30,
								  "%s gemm kt %d n %zu nb %zu rows %zu [%zu,%zu]: %.9g vs ref %.9g",
								  k->isa, kt, n, nb, rows, b, i, c, a);
							cr_assert(fabs(a - exact[b][i]) <= 1e-5 * bound[b][i] + 1e-30);
						}
				}
			free(ga);
			free(gb);
			free(xf);
			free(wf);
			free(w);
			free(xq);
		}
	}
}

static void check_axpy(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 6 };
	const size_t ns[] = { 32, 96, 512, 4096 + 32 };
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		for (size_t ni = 0; ni < 4; ni++) {
			size_t n = ns[ni];
			if (!fits(kt, n))
				continue;
			float *wf = xmalloc(n * sizeof(float)), *ya = xmalloc(n * sizeof(float));
			float *yb = xmalloc(n * sizeof(float));
			void *w = xmalloc(nf_dtype_row_size(kt_dtype[kt], n));
			fill(&r, wf, n);
			quant_row(kt, wf, w, n);
			for (size_t i = 0; i < n; i++)
				ya[i] = yb[i] = rnd(&r);
			float a = rnd(&r) * 3;
			ref->axpy[kt](n, a, w, ya);
			k->axpy[kt](n, a, w, yb);
			/* one fma of exact weight values: bit-identical on every ISA */
			for (size_t i = 0; i < n; i++)
				cr_assert(!memcmp(&ya[i], &yb[i], sizeof(float)),
					  "%s axpy kt %d n %zu [%zu]: %.9g vs %.9g", k->isa, kt, n, i, yb[i], ya[i]);
			free(wf);
			free(ya);
			free(yb);
			free(w);
		}
	}
}

static void check_vector_ops(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 7 };
	const size_t ns[] = { 1, 7, 33, 4096 + 35 };
	for (size_t ni = 0; ni < 4; ni++) {
		size_t n = ns[ni];
		float *x = xmalloc(n * sizeof(float)), *u = xmalloc(n * sizeof(float));
		float *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
		float *w = xmalloc(n * sizeof(float));
		for (size_t i = 0; i < n; i++) {
			x[i] = rnd(&r) * 8;
			u[i] = rnd(&r);
			w[i] = rnd(&r);
		}
		/* the ends of exp's range and beyond */
		const float ends[] = { -100.0f, 100.0f, 0.0f, -87.5f, 88.5f, -20.0f, 20.0f };
		for (size_t i = 0; n > 16 && i < sizeof(ends) / sizeof(ends[0]); i++)
			x[9 + i] = ends[i];
		ref->rmsnorm(a, x, w, n, 1e-6f);
		k->rmsnorm(b, x, w, n, 1e-6f);
		for (size_t i = 0; i < n; i++)
			cr_assert(fabsf(a[i] - b[i]) <= 1e-6f * fabsf(a[i]) + 1e-30f, "%s rmsnorm", k->isa);
		memcpy(b, x, n * sizeof(float));
		k->rmsnorm(b, b, NULL, n, 1e-6f); /* aliased, no weight */
		ref->rmsnorm(a, x, NULL, n, 1e-6f);
		for (size_t i = 0; i < n; i++)
			cr_assert(fabsf(a[i] - b[i]) <= 1e-6f * fabsf(a[i]) + 1e-30f, "%s rmsnorm alias", k->isa);

		/* softmax, SiLU and the f32 dot follow llama.cpp's AVX-512 order
		 * and expf on every table: the reference's bits exactly, over
		 * scores in [-16, 16], then with the ends of exp's range (the
		 * SIMD tables' fallback lanes) and -inf (attention's padding) */
		for (size_t i = 0; i < n; i++)
			a[i] = b[i] = u[i] * 16;
		ref->softmax(a, n);
		k->softmax(b, n);
		cr_assert(memcmp(a, b, n * sizeof(float)) == 0, "%s softmax bits (n %zu)", k->isa, n);
		memcpy(a, x, n * sizeof(float));
		if (n > 40)
			a[40] = -INFINITY;
		memcpy(b, a, n * sizeof(float));
		ref->softmax(a, n);
		k->softmax(b, n);
		cr_assert(memcmp(a, b, n * sizeof(float)) == 0, "%s softmax bits, ends (n %zu)", k->isa, n);
		cr_assert(n <= 40 || a[40] == 0.0f);

		void (*acts[3])(float *, const float *, size_t) = { k->silu_mul, k->relu_mul, k->drelu_mul };
		void (*racts[3])(float *, const float *, size_t) = { ref->silu_mul, ref->relu_mul, ref->drelu_mul };
		for (int f = 0; f < 3; f++)
			for (int gate = 0; gate < 2; gate++) {
				memcpy(a, x, n * sizeof(float));
				memcpy(b, x, n * sizeof(float));
				racts[f](a, gate ? u : NULL, n);
				acts[f](b, gate ? u : NULL, n);
				cr_assert(memcmp(a, b, n * sizeof(float)) == 0, "%s act %d gate %d bits (n %zu)",
					  k->isa, f, gate, n);
			}

		double s = 0, sa = 0;
		for (size_t i = 0; i < n; i++) {
			s += (double)x[i] * u[i];
			sa += fabs((double)x[i] * u[i]);
		}
		cr_assert(fabs(k->dot_f32(x, u, n) - s) <= 1e-5 * sa + 1e-30, "%s dot_f32", k->isa);
		for (size_t m = 1; m <= n && m <= 200; m += 13) {
			float dr = ref->dot_f32(x, u, m), dk = k->dot_f32(x, u, m);
			cr_assert(memcmp(&dr, &dk, sizeof(dr)) == 0, "%s dot_f32 bits (n %zu): %a vs %a", k->isa, m,
				  dk, dr);
		}
		memcpy(a, u, n * sizeof(float));
		memcpy(b, u, n * sizeof(float));
		ref->axpy_f32(n, 0.37f, x, a);
		k->axpy_f32(n, 0.37f, x, b);
		for (size_t i = 0; i < n; i++)
			cr_assert(fabsf(a[i] - b[i]) <= 1e-6f * (fabsf(a[i]) + fabsf(x[i])), "%s axpy_f32", k->isa);
		free(x);
		free(u);
		free(a);
		free(b);
		free(w);
	}
}

/* Rows at every (element-aligned) offset in a cache line: SIMD versions stream
 * rows with aligned loads where the address allows and must agree with the
 * reference whatever the offset. */
static void check_row_offsets(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 8 };
	float *xf = xmalloc((4096 + 256) * sizeof(float)), *wf = xmalloc((4096 + 256) * sizeof(float));
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		const size_t n = fits(kt, 4096 + 96) ? 4096 + 96 : 4096 + 256;
		size_t rb = nf_dtype_row_size(kt_dtype[kt], n);
		unsigned char *buf = aligned_alloc(64, (rb + 128 + 63) & ~(size_t)63);
		unsigned char *xq = xmalloc(nf_act_size(kt, n));
		cr_assert_not_null(buf);
		fill(&r, xf, n);
		fill(&r, wf, n);
		ref->act_prepare[kt](xf, xq, n);
		/* element alignment: 4 for f32, 2 for the rest (fp16 scales) */
		size_t step = kt == NF_KT_F32 ? 4 : 2;
		for (size_t off = 0; off < 64; off += step) {
			memset(buf, 0x7f, rb + 128);
			quant_row(kt, wf, buf + off, n);
			float a, b;
			double e, bound;
			ref->gemv[kt](n, 1, buf + off, rb, xq, &a);
			k->gemv[kt](n, 1, buf + off, rb, xq, &b);
			exact_dot(kt, n, buf + off, xq, &e, &bound);
			cr_assert(exact_order(kt) ? !memcmp(&a, &b, sizeof(float)) : fabs(a - b) <= 1e-5 * bound + 1e-30,
				  "%s gemv kt %d at offset %zu: %.9g vs ref %.9g",
				  k->isa, kt, off, b, a);
		}
		free(buf);
		free(xq);
	}
	free(xf);
	free(wf);
}

/*
 * gemv_list over rows at scattered (element-aligned) addresses: each row's
 * result has the bits of the same table's gemv on that row alone, and
 * agrees with the reference's list (bit for bit where the order is fixed).
 */
static void check_gemv_list(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 9 };
	const size_t ns[] = { 32, 96, 256, 4096 + 32, 4096 + 256, 16384 + 64 };
	const size_t counts[] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 16, 17, 32, 33 };
	enum { MAXR = 33 };
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		size_t step = kt == NF_KT_F32 ? 4 : 2;
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			size_t n = ns[ni], rb = nf_dtype_row_size(kt_dtype[kt], n), slot = rb + 128;
			if (!fits(kt, n))
				continue;
			unsigned char *buf = aligned_alloc(64, (MAXR * slot + 63) & ~(size_t)63);
			unsigned char *xq = xmalloc(nf_act_size(kt, n));
			float *xf = xmalloc(n * sizeof(float)), *wf = xmalloc(n * sizeof(float));
			cr_assert_not_null(buf);
			memset(buf, 0x7f, MAXR * slot);
			fill(&r, xf, n);
			ref->act_prepare[kt](xf, xq, n);
			const void *rows[MAXR];
			/* rows in shuffled slots at varying offsets */
			for (size_t i = 0; i < MAXR; i++) {
				size_t sl = (i * 7 + 3) % MAXR, off = (i * 5 * step) % 64;
				rows[i] = buf + sl * slot + off;
				fill(&r, wf, n);
				quant_row(kt, wf, buf + sl * slot + off, n);
			}
			for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
				size_t cnt = counts[ci];
				float ya[MAXR + 1], yb[MAXR + 1], yc[MAXR + 1];
				ya[cnt] = yb[cnt] = -7.0f;
				ref->gemv_list[kt](n, cnt, rows, xq, ya);
				k->gemv_list[kt](n, cnt, rows, xq, yb);
				cr_assert_eq(yb[cnt], -7.0f, "%s gemv_list wrote past y", k->isa);
				for (size_t i = 0; i < cnt; i++) {
					k->gemv[kt](n, 1, rows[i], rb, xq, &yc[i]);
					cr_assert(!memcmp(&yb[i], &yc[i], sizeof(float)),
						  "%s gemv_list kt %d n %zu rows %zu row %zu: %.9g, gemv %.9g",
						  k->isa, kt, n, cnt, i, yb[i], yc[i]);
					double e, bound;
					exact_dot(kt, n, rows[i], xq, &e, &bound);
					/* rows past 16384 values: the AVX2 gemv sums them in
					 * chunks (the long-row fallback), so only close */
					bool same = exact_order(kt) && n <= 16384;
					cr_assert(same ? !memcmp(&ya[i], &yb[i], sizeof(float))
						       : fabs(ya[i] - yb[i]) <= 1e-5 * bound + 1e-30,
						  "%s gemv_list kt %d n %zu row %zu: %.9g vs ref %.9g",
						  k->isa, kt, n, i, yb[i], ya[i]);
				}
			}
			free(buf);
			free(xq);
			free(xf);
			free(wf);
		}
	}
}

/* axpy_list: the bits of axpy column by column in ascending order, on the
 * same table and on the reference. */
static void check_axpy_list(const struct nf_kernels *k, const struct nf_kernels *ref)
{
	struct rng r = { 10 };
	const size_t ns[] = { 32, 37, 96, 256, 4096 + 32 };
	const size_t counts[] = { 0, 1, 5, 8, 9, 20 };
	enum { MAXC = 20 };
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		enum nf_ktype kt = all_kt[t];
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			size_t n = ns[ni];
			if (!fits(kt, n))
				continue;
			size_t rb = nf_dtype_row_size(kt_dtype[kt], n);
			char *w = xmalloc(MAXC * (rb + 8));
			float *wf = xmalloc(n * sizeof(float)), *y0 = xmalloc(n * sizeof(float));
			float *ya = xmalloc(n * sizeof(float)), *yb = xmalloc(n * sizeof(float));
			float *yc = xmalloc(n * sizeof(float));
			const void *cols[MAXC];
			float a[MAXC];
			for (size_t c = 0; c < MAXC; c++) {
				/* columns in reverse memory order, 2-byte offsets */
				cols[c] = w + (MAXC - 1 - c) * (rb + 8) + (kt == NF_KT_F32 ? 4 : 2) * (c % 3);
				fill(&r, wf, n);
				quant_row(kt, wf, (void *)cols[c], n);
				a[c] = rnd(&r) * 3;
			}
			a[2] = 0.0f;
			for (size_t i = 0; i < n; i++)
				y0[i] = rnd(&r);
			for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
				size_t cnt = counts[ci];
				memcpy(ya, y0, n * sizeof(float));
				memcpy(yb, y0, n * sizeof(float));
				memcpy(yc, y0, n * sizeof(float));
				ref->axpy_list[kt](n, cnt, a, cols, ya);
				k->axpy_list[kt](n, cnt, a, cols, yb);
				for (size_t c = 0; c < cnt; c++)
					k->axpy[kt](n, a[c], cols[c], yc);
				for (size_t i = 0; i < n; i++) {
					cr_assert(!memcmp(&yb[i], &yc[i], sizeof(float)),
						  "%s axpy_list kt %d n %zu cols %zu [%zu]: %.9g, axpy %.9g",
						  k->isa, kt, n, cnt, i, yb[i], yc[i]);
					cr_assert(!memcmp(&yb[i], &ya[i], sizeof(float)),
						  "%s axpy_list kt %d n %zu cols %zu [%zu]: %.9g vs ref %.9g",
						  k->isa, kt, n, cnt, i, yb[i], ya[i]);
				}
			}
			free(w);
			free(wf);
			free(y0);
			free(ya);
			free(yb);
			free(yc);
		}
	}
}

static void check_isa(const char *isa)
{
	const struct nf_kernels *k = isa_or_skip(isa), *ref = nf_kernels_ref();
	for (size_t t = 0; t < NF_KT_COUNT; t++) {
		cr_assert_not_null(k->act_prepare[t]);
		cr_assert_not_null(k->gemv[t]);
		cr_assert_not_null(k->gemm[t]);
		cr_assert_not_null(k->axpy[t]);
		cr_assert_not_null(k->gemv_list[t]);
		cr_assert_not_null(k->axpy_list[t]);
	}
	check_prepare(k, ref);
	check_matmul(k, ref);
	check_row_offsets(k, ref);
	check_axpy(k, ref);
	check_gemv_list(k, ref);
	check_axpy_list(k, ref);
	check_vector_ops(k, ref);
}

Test(kernels, scalar_matches_ref) { check_isa(isas[0]); }
Test(kernels, avx2_matches_ref) { check_isa(isas[1]); }
Test(kernels, avx512_matches_ref) { check_isa(isas[2]); }
Test(kernels, neon_matches_ref) { check_isa(isas[3]); }
Test(kernels, neondot_matches_ref) { check_isa(isas[4]); }

/*
 * K-quant products on blocks of random bytes (every scale, min, quant and
 * high-bit pattern the formats can hold, not only what the encoder makes;
 * d and dmin set to sane fp16 values) against Q8_K activations, one block
 * of them random bytes too (quants down to -128, bsums their sums): every
 * SIMD table's gemv, gemm and gemv_list give the reference's bits.
 */
static void kquant_random_block(struct rng *r, enum nf_ktype kt, unsigned char *blk)
{
	size_t bs = nf_dtype_block_size(kt_dtype[kt]), dof = 0;
	for (size_t i = 0; i < bs; i++)
		blk[i] = (unsigned char)(rnd(r) * 128 + 128);
	switch (kt) {
	case NF_KT_Q2_K: dof = offsetof(struct nf_block_q2_K, d); break;
	case NF_KT_Q3_K: dof = offsetof(struct nf_block_q3_K, d); break;
	case NF_KT_Q4_K: dof = offsetof(struct nf_block_q4_K, d); break;
	case NF_KT_Q5_K: dof = offsetof(struct nf_block_q5_K, d); break;
	default: dof = offsetof(struct nf_block_q6_K, d); break;
	}
	uint16_t d = nf_fp32_to_fp16(ldexpf(1.0f + rnd(r) * 0.5f, -8 - (int)(r->s >> 60) % 4));
	uint16_t dmin = nf_fp32_to_fp16(ldexpf(1.0f + rnd(r) * 0.5f, -9));
	memcpy(blk + dof, &d, 2);
	if (kt == NF_KT_Q2_K || kt == NF_KT_Q4_K || kt == NF_KT_Q5_K)
		memcpy(blk + dof + 2, &dmin, 2);
}

/* A Q8_K block of random bytes (down to -128) with consistent sums. */
static void q8_K_random_block(struct rng *r, struct nf_block_q8_K *raw)
{
	raw->d = 0.01f;
	for (int j = 0; j < NF_QK_K / 16; j++) {
		int s = 0;
		for (int i = 0; i < 16; i++) {
			raw->qs[16 * j + i] = (int8_t)(int)floorf(rnd(r) * 128);
			s += raw->qs[16 * j + i];
		}
		raw->bsums[j] = (int16_t)s;
	}
}

Test(kernels, kquant_any_bits_match_ref, .timeout = 120)
{
	const struct nf_kernels *ref = nf_kernels_ref();
	const enum nf_ktype kts[] = { NF_KT_Q2_K, NF_KT_Q3_K, NF_KT_Q4_K, NF_KT_Q5_K, NF_KT_Q6_K };
	enum { N = 4 * NF_QK_K, ROWS = 5, NB = 3 };
	int tables = 0;
	for (size_t ii = 1; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
		const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
		if (!k)
			continue;
		tables++;
		struct rng r = { 21 };
		for (size_t t = 0; t < sizeof(kts) / sizeof(kts[0]); t++) {
			enum nf_ktype kt = kts[t];
			size_t bs = nf_dtype_block_size(kt_dtype[kt]), rb = N / NF_QK_K * bs;
			unsigned char *w = xmalloc(ROWS * rb);
			struct nf_block_q8_K x[NB][N / NF_QK_K];
			float xf[N];
			for (size_t i = 0; i < ROWS * N / NF_QK_K; i++)
				kquant_random_block(&r, kt, w + i * bs);
			for (size_t b = 0; b < NB; b++) {
				fill(&r, xf, N);
				ref->act_prepare[kt](xf, x[b], N);
			}
			q8_K_random_block(&r, &x[NB - 1][2]);
			const void *rows[ROWS];
			for (size_t i = 0; i < ROWS; i++)
				rows[i] = w + (ROWS - 1 - i) * rb;
			float ya[NB][ROWS], yb[NB][ROWS];
			ref->gemm[kt](N, ROWS, w, rb, NB, x, sizeof(x[0]), &ya[0][0], ROWS);
			k->gemm[kt](N, ROWS, w, rb, NB, x, sizeof(x[0]), &yb[0][0], ROWS);
			cr_assert(!memcmp(ya, yb, sizeof(ya)), "%s gemm kt %d on random blocks", k->isa, kt);
			for (size_t b = 0; b < NB; b++) {
				k->gemv[kt](N, ROWS, w, rb, x[b], yb[b]);
				for (size_t i = 0; i < ROWS; i++)
					cr_assert(!memcmp(&ya[b][i], &yb[b][i], sizeof(float)),
						  "%s gemv kt %d token %zu row %zu: %.9g vs ref %.9g", k->isa, kt, b, i,
						  yb[b][i], ya[b][i]);
				k->gemv_list[kt](N, ROWS, rows, x[b], yb[b]);
				for (size_t i = 0; i < ROWS; i++)
					cr_assert(!memcmp(&ya[b][ROWS - 1 - i], &yb[b][i], sizeof(float)),
						  "%s gemv_list kt %d token %zu row %zu", k->isa, kt, b, i);
			}
			free(w);
		}
	}
	if (!tables)
		cr_skip_test("no SIMD kernel table on this CPU or build");
}

/*
 * kcol_madd (the sparse FFN's K-quant down columns): the reference against
 * the formula with each value's bits read one by one, and every table
 * against the reference, bit for bit, for 2..6 bits, with the type's
 * offsets, 1 to 259 rows, columns allocated to their exact size (so a read
 * past them shows under ASan), scales and activations over their ranges.
 */
Test(kernels, kcol_madd_matches_ref)
{
	const int32_t offs[] = { 0, 4, 0, 0, 32 }; /* Q2_K..Q6_K */
	const size_t ns[] = { 1, 7, 8, 15, 16, 17, 31, 32, 64, 100, 256, 259 };
	struct rng r = { 23 };
	for (uint32_t bits = 2; bits <= 6; bits++)
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			size_t n = ns[ni], nbytes = (n * bits + 7) / 8;
			uint8_t *col = xmalloc(nbytes);
			int16_t *sc = xmalloc(n * sizeof(int16_t));
			int32_t *a0 = xmalloc(n * sizeof(int32_t)), *want = xmalloc(n * sizeof(int32_t));
			int32_t *got = xmalloc(n * sizeof(int32_t));
			for (size_t i = 0; i < nbytes; i++)
				col[i] = (uint8_t)(rnd(&r) * 128 + 128);
			for (size_t i = 0; i < n; i++) {
				sc[i] = (int16_t)floorf(rnd(&r) * 128);
				a0[i] = (int32_t)(rnd(&r) * 1e6f);
			}
			int32_t off = offs[bits - 2], xq = ni % 3 == 0 ? -128 : (int32_t)floorf(rnd(&r) * 128);
			for (size_t i = 0; i < n; i++) {
				uint32_t raw = 0;
				for (uint32_t k = 0; k < bits; k++) {
					size_t bit = i * bits + k;
					raw |= (uint32_t)((col[bit / 8] >> (bit % 8)) & 1) << k;
				}
				want[i] = a0[i] + sc[i] * (((int32_t)raw - off) * xq);
			}
			for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
				const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
				if (!k)
					continue;
				cr_assert_not_null(k->kcol_madd);
				memcpy(got, a0, n * sizeof(int32_t));
				k->kcol_madd(bits, off, col, n, sc, xq, got);
				for (size_t i = 0; i < n; i++)
					cr_assert_eq(got[i], want[i], "%s kcol_madd bits %u n %zu row %zu: %d vs %d",
						     k->isa, bits, n, i, got[i], want[i]);
			}
			free(col);
			free(sc);
			free(a0);
			free(want);
			free(got);
		}
}

/*
 * qcol_down (the sparse FFN's Q4_0/Q8_0 down parts in the QCOL form): the
 * reference against the formula written out here, and every table against
 * the reference, bit for bit: 0 to 32 columns, rows 32 to 4096 (every
 * tail of the SIMD tiles), quants at +-127 (the int16 sums' extreme),
 * columns allocated to their exact size (a read past them shows under
 * ASan), out starting at -0.0 and at values of both signs.
 */
Test(kernels, qcol_down_matches_ref)
{
	const size_t ns[] = { 32, 64, 96, 128, 160, 224, 4096 };
	const size_t ncs[] = { 0, 1, 3, 16, 31, 32 };
	struct rng r = { 29 };
	for (int q4 = 0; q4 <= 1; q4++)
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++)
			for (size_t ci = 0; ci < sizeof(ncs) / sizeof(ncs[0]); ci++) {
				size_t n = ns[ni], nc = ncs[ci], cb = q4 ? n / 2 : n;
				enum nf_ktype kt = q4 ? NF_KT_Q4_0 : NF_KT_Q8_0;
				int8_t q[32];
				void *cols[32];
				uint16_t *sc = xmalloc(n * sizeof(uint16_t));
				float *o0 = xmalloc(n * sizeof(float)), *want = xmalloc(n * sizeof(float));
				float *got = xmalloc(n * sizeof(float));
				bool extreme = ci % 2 == 1;
				for (size_t c = 0; c < nc; c++) {
					uint8_t *col = xmalloc(cb);
					for (size_t i = 0; i < cb; i++)
						col[i] = extreme ? (q4 ? 0x00 : 0x81) : (uint8_t)(rnd(&r) * 128 + 128);
					cols[c] = col;
					q[c] = extreme ? 127 : (int8_t)fmaxf(-127.0f, floorf(rnd(&r) * 127.5f));
				}
				for (size_t i = 0; i < n; i++) {
					sc[i] = nf_fp32_to_fp16(rnd(&r) * 0.01f);
					o0[i] = i % 7 == 0 ? -0.0f : rnd(&r);
				}
				float dx = 0.03125f + rnd(&r) * 0.001f;
				for (size_t i = 0; i < n; i++) {
					int32_t acc = 0;
					for (size_t c = 0; c < nc; c++) {
						const uint8_t *col = cols[c];
						int32_t w = q4 ? (int32_t)((col[i / 2] >> (i % 2 ? 4 : 0)) & 15) - 8
							       : (int32_t)(int8_t)col[i];
						acc += q[c] * w;
					}
					/* one step of the dense chain: fma with d_w * d_x */
					want[i] = fmaf((float)acc, nf_fp16_to_fp32(sc[i]) * dx, o0[i]);
				}
				for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
					const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
					if (!k)
						continue;
					cr_assert_not_null(k->qcol_down[kt]);
					memcpy(got, o0, n * sizeof(float));
					k->qcol_down[kt](n, nc, q, (const void *const *)cols, sc, dx, got);
					cr_assert_eq(memcmp(got, want, n * sizeof(float)), 0,
						     "%s qcol_down %s n %zu ncols %zu differs from the formula", k->isa,
						     q4 ? "q4_0" : "q8_0", n, nc);
				}
				for (size_t c = 0; c < nc; c++)
					free(cols[c]);
				free(sc);
				free(o0);
				free(want);
				free(got);
			}
}

/* On arm64 the choice follows the CPU: sdot where it has it. */
Test(kernels, arm64_picks_by_hwcap)
{
#if defined(__aarch64__)
	const struct nf_kernels *dot = nf_kernels_isa("neon-dot");
	cr_assert_not_null(nf_kernels_isa("neon"), "every arm64 CPU has Advanced SIMD");
	const char *want = getenv("NFLASH_ISA");
	if (!want || !*want)
		cr_assert_str_eq(nf_kernels_get()->isa, dot ? "neon-dot" : "neon");
	else
		cr_assert_str_eq(nf_kernels_get()->isa, want);
	cr_assert_null(nf_kernels_isa("avx2"));
#else
	cr_assert_null(nf_kernels_isa("neon"));
	cr_assert_null(nf_kernels_isa("neon-dot"));
	cr_skip_test("not an arm64 build: only checked that the NEON tables are absent");
#endif
}

/*
 * Matrices in 8-row groups (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K): repack and
 * unpack are inverses; every table that has gemv_x8/gemm_x8 for a type
 * (the reference's own group kernels included) gives the reference's bits
 * on the plain rows (its gemv/gemm), on rows of 1 to over 512 blocks (Q4_0,
 * Q8_0) or 1 to 66 super-blocks (K-quants; the kernels' table chunking),
 * for 8 to 40 rows and 1 to 17 activation rows, never writing outside y.
 * K-quant rows alternate between the encoder's blocks and blocks of random
 * bytes (every scale, min and quant pattern the formats hold).
 */
static void check_x8(enum nf_ktype kt, int *tables)
{
	const struct nf_kernels *ref = nf_kernels_ref();
	struct rng r = { 13 };
	const bool kq = nf_dtype_block_len(kt_dtype[kt]) == NF_QK_K;
	const size_t ns_q[] = { 32, 96, 4096 + 32, 16384 + 64 }, ns_k[] = { 256, 768, 4096 + 256, 16384 + 512 };
	const size_t *ns = kq ? ns_k : ns_q;
	const size_t row_counts[] = { 8, 16, 24, 40 }, nbs[] = { 1, 2, 5, 9, 17 };
	for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
		const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
		if (!k || !k->gemv_x8[kt])
			continue;
		cr_assert_not_null(k->gemm_x8[kt]);
		(*tables)++;
		for (size_t ni = 0; ni < 4; ni++) {
			size_t n = ns[ni], rb = nf_dtype_row_size(kt_dtype[kt], n), rows_max = 40, nb_max = 17;
			size_t as = nf_act_size(kt, n);
			float *xf = xmalloc(n * sizeof(float));
			char *w = xmalloc(rows_max * rb), *wp = xmalloc(rows_max * rb), *back = xmalloc(rows_max * rb);
			char *xq = xmalloc(nb_max * as);
			for (size_t i = 0; i < rows_max; i++) {
				fill(&r, xf, n);
				quant_row(kt, xf, w + i * rb, n);
				size_t bs = nf_dtype_block_size(kt_dtype[kt]);
				for (size_t j = 0; kq && i % 2 && j < n / NF_QK_K; j++)
					kquant_random_block(&r, kt, (unsigned char *)w + i * rb + j * bs);
			}
			for (size_t b = 0; b < nb_max; b++) {
				fill(&r, xf, n);
				ref->act_prepare[kt](xf, xq + b * as, n);
			}
			if (kq) /* token 1's first Q8_K block: random bytes down to -128 */
				q8_K_random_block(&r, (struct nf_block_q8_K *)(xq + as));
			nf_repack_x8(kt, wp, w, n, rows_max);
			cr_assert(memcmp(wp, w, rows_max * rb), "repack changed nothing");
			nf_unpack_x8(kt, back, wp, n, rows_max);
			cr_assert(!memcmp(back, w, rows_max * rb), "kt %d n %zu: unpack(repack(w)) != w", kt, n);
			size_t ldy = rows_max + 3;
			float *ya = xmalloc(nb_max * ldy * sizeof(float)), *yb = xmalloc(nb_max * ldy * sizeof(float));
			for (size_t ri = 0; ri < sizeof(row_counts) / sizeof(row_counts[0]); ri++) {
				size_t rows = row_counts[ri];
				/* a repacked matrix's first rows are its first groups */
				yb[rows] = -7.0f;
				ref->gemv[kt](n, rows, w, rb, xq, ya);
				k->gemv_x8[kt](n, rows, wp, xq, yb);
				cr_assert_eq(yb[rows], -7.0f, "%s gemv_x8 wrote past y", k->isa);
				for (size_t i = 0; i < rows; i++)
					cr_assert(!memcmp(&ya[i], &yb[i], sizeof(float)),
						  "%s gemv_x8 kt %d n %zu rows %zu row %zu: %.9g vs ref %.9g",
						  k->isa, kt, n, rows, i, yb[i], ya[i]);
				for (size_t bi = 0; bi < sizeof(nbs) / sizeof(nbs[0]); bi++) {
					size_t nb = nbs[bi];
					for (size_t i = 0; i < nb_max * ldy; i++)
						ya[i] = yb[i] = -7.0f;
					ref->gemm[kt](n, rows, w, rb, nb, xq, as, ya, ldy);
					k->gemm_x8[kt](n, rows, wp, nb, xq, as, yb, ldy);
					for (size_t i = 0; i < nb_max * ldy; i++)
						cr_assert(!memcmp(&ya[i], &yb[i], sizeof(float)),
							  "%s gemm_x8 kt %d n %zu rows %zu nb %zu at %zu: %.9g vs ref %.9g",
							  k->isa, kt, n, rows, nb, i, yb[i], ya[i]);
				}
			}
			free(xf);
			free(w);
			free(wp);
			free(back);
			free(xq);
			free(ya);
			free(yb);
		}
	}
}

Test(kernels, x8_matches_ref, .timeout = 180)
{
	int tables = 0;
	check_x8(NF_KT_Q4_0, &tables);
	check_x8(NF_KT_Q4_0L, &tables);
	check_x8(NF_KT_Q8_0, &tables);
	check_x8(NF_KT_Q4_K, &tables);
	check_x8(NF_KT_Q5_K, &tables);
	check_x8(NF_KT_Q6_K, &tables);
	if (!tables)
		cr_skip_test("no kernel table with 8-row group kernels on this CPU");
}

/*
 * Every table's gemm gives each token the bits its gemv gives that token
 * alone, for every type: a decode step of several sequences batched must
 * give each the logits it gets alone (engine::decode_step_of_many_...).
 * The AVX-512 F32/BF16 gemv once summed in another order than its gemm.
 */
Test(kernels, gemm_token_equals_gemv_bits, .timeout = 120)
{
	const enum nf_ktype kts[] = { NF_KT_F32, NF_KT_F16, NF_KT_BF16, NF_KT_Q8_0, NF_KT_Q4_0, NF_KT_Q4_0L,
				      NF_KT_Q4_K, NF_KT_Q6_K, NF_KT_F16V };
	const size_t ns[] = { 256, 768, 4096 + 256 }, nrows = 13, nbat = 6;
	struct rng r = { 29 };
	int tables = 0;
	for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
		const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
		if (!k)
			continue;
		tables++;
		for (size_t ti = 0; ti < sizeof(kts) / sizeof(kts[0]); ti++) {
			enum nf_ktype kt = kts[ti];
			for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
				size_t n = ns[ni], rb = nf_dtype_row_size(kt_dtype[kt], n), as = nf_act_size(kt, n);
				float *xf = xmalloc(n * sizeof(float)), *yb = xmalloc(nbat * nrows * sizeof(float));
				float *y1 = xmalloc(nrows * sizeof(float));
				char *w = xmalloc(nrows * rb), *xq = xmalloc(nbat * as);
				for (size_t i = 0; i < nrows; i++) {
					fill(&r, xf, n);
					quant_row(kt, xf, w + i * rb, n);
				}
				for (size_t b = 0; b < nbat; b++) {
					fill(&r, xf, n);
					k->act_prepare[kt](xf, xq + b * as, n);
				}
				k->gemm[kt](n, nrows, w, rb, nbat, xq, as, yb, nrows);
				for (size_t b = 0; b < nbat; b++) {
					k->gemv[kt](n, nrows, w, rb, xq + b * as, y1);
					for (size_t i = 0; i < nrows; i++)
						cr_assert(!memcmp(&y1[i], &yb[b * nrows + i], sizeof(float)),
							  "%s kt %d n %zu token %zu row %zu: gemv %.9g, gemm %.9g", k->isa,
							  kt, n, b, i, y1[i], yb[b * nrows + i]);
				}
				free(xf);
				free(yb);
				free(y1);
				free(w);
				free(xq);
			}
		}
	}
	cr_assert_gt(tables, 0);
}
