/*
 * kernels_avx512_x8.c - AVX-512 products of Q4_0 and Q8_0 matrices held in
 * 8-row groups (nf_repack_x8, struct nf_block_q4_0x8 / q8_0x8), for the
 * AVX-512 table (kernels_avx512.c): matrices held in memory are repacked at
 * load into these groups, and nothing changes on disk.
 *
 * A 512-bit register
 * holds one lane of 16 rows: elements 0-7 lane j of group g's rows,
 * elements 8-15 lane j of group g + 1's (one 32-byte load of each group,
 * joined with VINSERTI64X4). Every row of the register then meets the same
 * activation bytes, so lane j's activation is one dword of the Q8_0 block
 * broadcast (VPDPBUSD's {1to16} operand), and its correction for unsigned
 * weights one int32 broadcast that starts the sum:
 *   Q4_0: load m holds lanes m (low nibbles) and m + 4 (high nibbles);
 *         lane = dpbusd(-8 * sum x, q, x);
 *   Q8_0: load j holds lane j; lane = dpbusd(-128 * sum x, w ^ 0x80, x).
 * Both sums are exact. Per block and lane acc_j = fma(d_w * d_x, lane_j,
 * acc_j), and at the end ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), element
 * by element: the reference's chain and hsum8, so the same bits. A gemm
 * keeps GX_TOK tokens' accumulators in registers (8 each) beside the 8
 * unpacked lane registers, so a block is unpacked once per tile (the
 * chain below: GX_TOKC tokens, one accumulator each). An odd
 * group count leaves the last group to the AVX2 group kernel (same bits).
 *
 * NF_KT_Q4_0 (llama.cpp's repacked chain, "chain" below) takes the same
 * lane registers but sums the 8 lanes of a block as integers (two dpbusd
 * chains from the block's whole correction, then their sum: exact), and
 * keeps one accumulator per row: acc = fma(d_w * d_x, isum, acc).
 *
 * Invariants:
 * 1. Every result has the bits of the reference's gemv/gemm on the plain
 *    rows (kernels::x8_matches_ref).
 * 2. No allocation: the activation tables live on the stack, 20 KiB per
 *    gemv and 80 KiB per gemm call (512 blocks for 1 or 4 tokens).
 * 3. Only compiled with the AVX-512 flags; handed out through the AVX-512
 *    table only after cpuid confirmed them.
 */
#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

#include "kernels_impl.h"

#define INLINE static inline __attribute__((always_inline))

#define GX_CHUNK 512 /* activation blocks per table (16384 values; 36 B each) */
#define GX_TOK 2     /* tokens per gemm tile (8 accumulators each) */
#define GX_TOKC 4    /* tokens per gemm tile of NF_KT_Q4_0's chain (1 accumulator each) */
#define GX_PAIRS 4   /* group pairs (64 rows) a gemm keeps in L2 while tiles pass */
#ifndef GX_PF
#define GX_PF 2048   /* bytes ahead prefetched in each group's stream (gemv) */
#endif
#ifndef GY_PF
#define GY_PF 2048   /* bytes ahead prefetched in the one stream (gy_gemv_q4_0c) */
#endif
#define GX_BS(q8) ((q8) ? sizeof(struct nf_block_q8_0x8) : sizeof(struct nf_block_q4_0x8))

struct gx_tab {
	int32_t corr[8]; /* -8 (Q4_0) or -128 (Q8_0) times the sum of lane j's 4 values */
	int32_t corr_sum; /* the 8 summed (chain) */
	float dx;
};

static void gx_table(int q8, const struct nf_block_q8_0 *x, size_t nb, struct gx_tab *t)
{
	const __m256i ones = _mm256_set1_epi8(1), k = _mm256_set1_epi16(q8 ? -128 : -8);
	for (size_t i = 0; i < nb; i++) {
		__m256i xv = _mm256_loadu_si256((const __m256i *)x[i].qs);
		_mm256_storeu_si256((__m256i *)t[i].corr, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, xv), k));
		int32_t cs = 0;
		for (int j = 0; j < 8; j++)
			cs += t[i].corr[j];
		t[i].corr_sum = cs;
		t[i].dx = _cvtsh_ss(x[i].d);
	}
}

INLINE __m512i gx_join(const uint8_t *a, const uint8_t *b)
{
	return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
				  _mm256_loadu_si256((const __m256i *)b), 1);
}

/* The 8 lane registers of block qs a (group g) and b (group g + 1). */
INLINE void gx_lanes(int q8, const uint8_t *a, const uint8_t *b, __m512i l[8])
{
	if (q8) {
		const __m512i s = _mm512_set1_epi8((char)0x80);
		_Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
			l[j] = _mm512_xor_si512(gx_join(a + 32 * j, b + 32 * j), s);
		return;
	}
	const __m512i m4 = _mm512_set1_epi8(0x0f);
	_Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
		__m512i p = gx_join(a + 32 * m, b + 32 * m);
		l[m] = _mm512_and_si512(p, m4);
		l[m + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
	}
}

/* The 16 rows' d_w (the blocks' first 16 bytes are the 8 fp16 scales). */
INLINE __m512 gx_dw(const uint8_t *a, const uint8_t *b)
{
	__m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
					    _mm_loadu_si128((const __m128i *)b), 1);
	return _mm512_cvtph_ps(h);
}

INLINE void gx_step(int chain, const __m512i l[8], __m512 s, const int8_t *xqs, const struct gx_tab *t, __m512 acc[8])
{
	if (chain) {
		__m512i va = _mm512_set1_epi32(t->corr_sum), vb = _mm512_setzero_si512();
		_Pragma("GCC unroll 4") for (int j = 0; j < 8; j += 2) {
			int32_t x0, x1;
			memcpy(&x0, xqs + 4 * j, sizeof(x0));
			memcpy(&x1, xqs + 4 * j + 4, sizeof(x1));
			va = _mm512_dpbusd_epi32(va, l[j], _mm512_set1_epi32(x0));
			vb = _mm512_dpbusd_epi32(vb, l[j + 1], _mm512_set1_epi32(x1));
		}
		acc[0] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_add_epi32(va, vb)), acc[0]);
		return;
	}
	_Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
		int32_t xv;
		memcpy(&xv, xqs + 4 * j, sizeof(xv));
		__m512i v = _mm512_dpbusd_epi32(_mm512_set1_epi32(t->corr[j]), l[j], _mm512_set1_epi32(xv));
		acc[j] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(v), acc[j]);
	}
}

INLINE void gx_store(int chain, const __m512 a[8], float *y)
{
	if (chain) {
		_mm512_storeu_ps(y, a[0]);
		return;
	}
	__m512 t0 = _mm512_add_ps(a[0], a[4]), t1 = _mm512_add_ps(a[1], a[5]);
	__m512 t2 = _mm512_add_ps(a[2], a[6]), t3 = _mm512_add_ps(a[3], a[7]);
	_mm512_storeu_ps(y, _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3)));
}

/* acc += blocks [0, nb) of the group pair at a, b against x (table t); both
 * streams prefetched GX_PF bytes ahead into L1 (the 32-byte loads at 144-
 * or 272-byte strides straddle cache lines). */
INLINE void gx_blocks1(int q8, int chain, const uint8_t *a, const uint8_t *b, const struct nf_block_q8_0 *x,
		       const struct gx_tab *t, size_t nb, __m512 acc[8])
{
	const size_t bs = GX_BS(q8);
	for (size_t i = 0; i < nb; i++, a += bs, b += bs) {
		for (size_t o = 0; o < bs; o += 64) {
			_mm_prefetch((const char *)a + GX_PF + o, _MM_HINT_T0);
			_mm_prefetch((const char *)b + GX_PF + o, _MM_HINT_T0);
		}
		__m512i l[8];
		gx_lanes(q8, a + 16, b + 16, l);
		__m512 s = _mm512_mul_ps(gx_dw(a, b), _mm512_set1_ps(t[i].dx));
		gx_step(chain, l, s, x[i].qs, &t[i], acc);
	}
}

INLINE void gx_gemv(int q8, int chain, size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	const size_t nb = n / NF_QK, gb = nb * GX_BS(q8), ng = nrows / 8;
	struct gx_tab t[GX_CHUNK];
	if (nb <= GX_CHUNK)
		gx_table(q8, x, nb, t);
	for (size_t g = 0; g + 1 < ng; g += 2) {
		const uint8_t *a = (const uint8_t *)w + g * gb;
		__m512 acc[8];
		for (int j = 0; j < 8; j++)
			acc[j] = _mm512_setzero_ps();
		for (size_t c = 0; c < nb; c += GX_CHUNK) {
			size_t cn = nb - c < GX_CHUNK ? nb - c : GX_CHUNK;
			if (nb > GX_CHUNK)
				gx_table(q8, x + c, cn, t);
			gx_blocks1(q8, chain, a + c * GX_BS(q8), a + gb + c * GX_BS(q8), x + c, t, cn, acc);
		}
		gx_store(chain, acc, y + 8 * g);
	}
	if (ng % 2)
		nf_kernels_table_avx2.gemv_x8[q8 ? NF_KT_Q8_0 : chain ? NF_KT_Q4_0 : NF_KT_Q4_0L](
			n, 8, (const uint8_t *)w + (ng - 1) * gb, xq, y + 8 * (ng - 1));
}

/* One group pair against NT (1, GX_TOK or GX_TOKC) tokens: blocks [c, c + cn) with
 * tables tab[t] (indexed from c). */
INLINE void gx_tile(int q8, int chain, int NT, const uint8_t *a, const uint8_t *b, const struct nf_block_q8_0 *const xs[],
		    const struct gx_tab *const tab[], size_t cn, __m512 acc[][8])
{
	const size_t bs = GX_BS(q8);
	for (size_t i = 0; i < cn; i++, a += bs, b += bs) {
		__m512i l[8];
		gx_lanes(q8, a + 16, b + 16, l);
		__m512 dw = gx_dw(a, b);
		_Pragma("GCC unroll 4") for (int t = 0; t < NT; t++)
			gx_step(chain, l, _mm512_mul_ps(dw, _mm512_set1_ps(tab[t][i].dx)), xs[t][i].qs, &tab[t][i],
				acc[t]);
	}
}

INLINE void gx_pair(int q8, int chain, int NT, size_t nb, const uint8_t *a, const uint8_t *b, const struct nf_block_q8_0 *const x0[],
		    struct gx_tab (*tab)[GX_CHUNK], bool tab_ready, float *y, size_t ldy)
{
	__m512 acc[GX_TOKC][8];
	for (int t = 0; t < NT; t++)
		for (int j = 0; j < 8; j++)
			acc[t][j] = _mm512_setzero_ps();
	for (size_t c = 0; c < nb; c += GX_CHUNK) {
		size_t cn = nb - c < GX_CHUNK ? nb - c : GX_CHUNK;
		const struct nf_block_q8_0 *xs[GX_TOKC];
		const struct gx_tab *tp[GX_TOKC];
		for (int t = 0; t < NT; t++) {
			xs[t] = x0[t] + c;
			if (!tab_ready)
				gx_table(q8, xs[t], cn, tab[t]);
			tp[t] = tab[t];
		}
		gx_tile(q8, chain, NT, a + c * GX_BS(q8), b + c * GX_BS(q8), xs, tp, cn, acc);
	}
	for (int t = 0; t < NT; t++)
		gx_store(chain, acc[t], y + t * ldy);
}

INLINE void gx_gemm(int q8, int chain, size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
		    float *y, size_t ldy)
{
	const size_t nb = n / NF_QK, gb = nb * GX_BS(q8), ng = nrows / 8, np = ng / 2;
	/* the chain keeps one accumulator per token: four tokens a tile share
	 * each unpacked block; the lane forms keep eight, so two */
	const int tile = chain ? GX_TOKC : GX_TOK;
	struct gx_tab tab[GX_TOKC][GX_CHUNK];
	for (size_t p0 = 0; p0 < np; p0 += GX_PAIRS) {
		size_t p1 = p0 + GX_PAIRS < np ? p0 + GX_PAIRS : np;
		for (size_t t0 = 0; t0 < nbat; t0 += (size_t)tile) {
			int nt = nbat - t0 < (size_t)tile ? (int)(nbat - t0) : tile;
			const struct nf_block_q8_0 *x0[GX_TOKC];
			for (int t = 0; t < nt; t++) {
				x0[t] = (const struct nf_block_q8_0 *)((const char *)xq + (t0 + t) * xq_stride);
				if (nb <= GX_CHUNK)
					gx_table(q8, x0[t], nb, tab[t]);
			}
			for (size_t p = p0; p < p1; p++) {
				const uint8_t *a = (const uint8_t *)w + 2 * p * gb;
				float *yp = y + t0 * ldy + 16 * p;
				if (nt == tile && chain)
					gx_pair(q8, chain, GX_TOKC, nb, a, a + gb, x0, tab, nb <= GX_CHUNK, yp, ldy);
				else if (nt == tile)
					gx_pair(q8, chain, GX_TOK, nb, a, a + gb, x0, tab, nb <= GX_CHUNK, yp, ldy);
				else /* the batch's last tokens, one at a time */
					for (int t = 0; t < nt; t++)
						gx_pair(q8, chain, 1, nb, a, a + gb, x0 + t, tab + t, nb <= GX_CHUNK,
							yp + (size_t)t * ldy, ldy);
			}
		}
	}
	if (ng % 2)
		nf_kernels_table_avx2.gemm_x8[q8 ? NF_KT_Q8_0 : chain ? NF_KT_Q4_0 : NF_KT_Q4_0L](
			n, 8, (const uint8_t *)w + (ng - 1) * gb, nbat, xq, xq_stride, y + 8 * (ng - 1), ldy);
}

/*
 * NF_KT_Q4_0's chain in one 256-bit stream: group by group, one register
 * per lane of the group's 8 rows (as the AVX2 group kernel), the lane's
 * activation one broadcast dword into VPDPBUSD (AVX512-VL), the block's 8
 * lanes summed as integers in two chains from its whole correction, then
 * acc = fma(d_w * d_x, isum, acc): the same bits as the pair kernel. One
 * sequential stream per call, where the pair kernel runs two.
 */
static void gy_gemv_q4_0c(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	const struct nf_block_q8_0 *x = xq;
	const size_t bs = sizeof(struct nf_block_q4_0x8), nb = n / NF_QK, gb = nb * bs, ng = nrows / 8;
	const __m256i m4 = _mm256_set1_epi8(0x0f);
	struct gx_tab t[GX_CHUNK];
	if (nb <= GX_CHUNK)
		gx_table(0, x, nb, t);
	for (size_t g = 0; g < ng; g++) {
		const uint8_t *b = (const uint8_t *)w + g * gb;
		__m256 acc = _mm256_setzero_ps();
		for (size_t c = 0; c < nb; c += GX_CHUNK) {
			size_t cn = nb - c < GX_CHUNK ? nb - c : GX_CHUNK;
			if (nb > GX_CHUNK)
				gx_table(0, x + c, cn, t);
			const struct nf_block_q8_0 *xc = x + c;
			for (size_t i = 0; i < cn; i++, b += bs) {
				for (size_t o = 0; o < bs; o += 64)
					_mm_prefetch((const char *)b + GY_PF + o, _MM_HINT_T0);
				__m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)),
							 _mm256_set1_ps(t[i].dx));
				__m256i va = _mm256_set1_epi32(t[i].corr_sum), vb = _mm256_setzero_si256();
				_Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
					__m256i p = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * m));
					int32_t x0, x1;
					memcpy(&x0, xc[i].qs + 4 * m, sizeof(x0));
					memcpy(&x1, xc[i].qs + 4 * m + 16, sizeof(x1));
					va = _mm256_dpbusd_epi32(va, _mm256_and_si256(p, m4), _mm256_set1_epi32(x0));
					vb = _mm256_dpbusd_epi32(vb, _mm256_and_si256(_mm256_srli_epi16(p, 4), m4),
								 _mm256_set1_epi32(x1));
				}
				acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(va, vb)), acc);
			}
		}
		_mm256_storeu_ps(y + 8 * g, acc);
	}
}

void nf_kavx512_gemv_x8_Q4_0(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	gx_gemv(0, 0, n, nrows, w, xq, y);
}

void nf_kavx512_gemv_x8_Q4_0c(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	gx_gemv(0, 1, n, nrows, w, xq, y);
}

void nf_kavx512_gemv_x8_Q4_0y(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	gy_gemv_q4_0c(n, nrows, w, xq, y);
}

void nf_kavx512_gemv_x8_Q8_0(size_t n, size_t nrows, const void *w, const void *xq, float *y)
{
	gx_gemv(1, 0, n, nrows, w, xq, y);
}

void nf_kavx512_gemm_x8_Q4_0(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			 float *y, size_t ldy)
{
	gx_gemm(0, 0, n, nrows, w, nbat, xq, xq_stride, y, ldy);
}

void nf_kavx512_gemm_x8_Q4_0c(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			  float *y, size_t ldy)
{
	gx_gemm(0, 1, n, nrows, w, nbat, xq, xq_stride, y, ldy);
}

void nf_kavx512_gemm_x8_Q8_0(size_t n, size_t nrows, const void *w, size_t nbat, const void *xq, size_t xq_stride,
			 float *y, size_t ldy)
{
	gx_gemm(1, 0, n, nrows, w, nbat, xq, xq_stride, y, ldy);
}
