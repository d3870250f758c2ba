/*
 * dtype_kquant.c - ggml's K-quant super-blocks (Q2_K..Q6_K) and Q8_K: the
 * integer form every other module works on (struct nf_kblock), packing,
 * dequantization and encoders.
 *
 * Invariants:
 * 1. nf_kblock_unpack and nf_kblock_pack are exact inverses on every block
 *    pack accepts, and unpack reads every bit ggml's layout defines, so a
 *    block's values survive unpack -> pack bit for bit (bundles rely on it).
 * 2. Dequantization is ggml's dequantize_row_qN_K: (d * sc) * q - dmin * m
 *    in f32 with one rounding per operation, no fused multiply-add.
 * 3. nf_quantize_row_q8_K is ggml's quantize_row_q8_K_ref bit for bit
 *    (llama.cpp on x86 uses it for activations): iscale = -127 / (the value
 *    of largest magnitude, first one on ties), q = round-half-even of
 *    iscale * x, d = 1 / iscale.
 * 4. The weight encoders are plain per-sub-block min/max fits: they make
 *    valid blocks for synthetic models and tests, not ggml's searched ones.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "nflash/dtype.h"

/* ggml's nearest_int: round half to even for |f| < 2^22 */
static inline int nearest(float f)
{
	return (int)nearbyintf(f);
}

static inline int clampi(int v, int lo, int hi)
{
	return v < lo ? lo : v > hi ? hi : v;
}

/* 8 six-bit scales and 8 six-bit mins in 12 bytes (q4_K, q5_K) */
static void scales_k4_get(const uint8_t *s, int j, int *sc, int *m)
{
	if (j < 4) {
		*sc = s[j] & 63;
		*m = s[j + 4] & 63;
	} else {
		*sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
		*m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
	}
}

static void scales_k4_put(uint8_t *s, const int16_t *sc16, const int16_t *mn16)
{
	for (int j = 0; j < 4; j++) {
		int sl = sc16[2 * j], ml = mn16[2 * j];
		int sh = sc16[2 * (j + 4)], mh = mn16[2 * (j + 4)];
		s[j] = (uint8_t)((sl & 63) | ((sh >> 4) << 6));
		s[j + 4] = (uint8_t)((ml & 63) | ((mh >> 4) << 6));
		s[j + 8] = (uint8_t)((sh & 0xf) | ((mh & 0xf) << 4));
	}
}

/* 16 six-bit scales in 12 bytes (q3_K), stored + 32 */
static int scale_k3_get(const uint8_t *s, int i)
{
	int lo = i < 8 ? s[i % 8] & 0xf : s[i % 8] >> 4;
	int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
	return (lo | (hi << 4)) - 32;
}

static void scales_k3_put(uint8_t *s, const int16_t *sc16)
{
	memset(s, 0, NF_K_SCALE_SIZE);
	for (int i = 0; i < 16; i++) {
		int v = sc16[i] + 32;
		s[i % 8] |= (uint8_t)((v & 0xf) << (i < 8 ? 0 : 4));
		s[8 + i % 4] |= (uint8_t)(((v >> 4) & 3) << (2 * (i / 4)));
	}
}

void nf_kblock_unpack_scales(uint32_t t, const void *blk, struct nf_kblock *o)
{
	memset(o->mn, 0, sizeof(o->mn));
	o->dmin = 0.0f;
	switch (t) {
	case NF_DTYPE_Q2_K: {
		const struct nf_block_q2_K *b = blk;
		o->d = nf_fp16_to_fp32(b->d);
		o->dmin = nf_fp16_to_fp32(b->dmin);
		for (int j = 0; j < 16; j++) {
			o->sc[j] = b->scales[j] & 0xf;
			o->mn[j] = b->scales[j] >> 4;
		}
		break;
	}
	case NF_DTYPE_Q3_K: {
		const struct nf_block_q3_K *b = blk;
		o->d = nf_fp16_to_fp32(b->d);
		for (int j = 0; j < 16; j++)
			o->sc[j] = (int16_t)scale_k3_get(b->scales, j);
		break;
	}
	case NF_DTYPE_Q4_K:
	case NF_DTYPE_Q5_K: {
		const struct nf_block_q4_K *b4 = blk;
		o->d = nf_fp16_to_fp32(b4->d);
		o->dmin = nf_fp16_to_fp32(b4->dmin);
		for (int j = 0; j < 8; j++) {
			int sc, m;
			scales_k4_get(b4->scales, j, &sc, &m);
			o->sc[2 * j] = o->sc[2 * j + 1] = (int16_t)sc;
			o->mn[2 * j] = o->mn[2 * j + 1] = (int16_t)m;
		}
		break;
	}
	case NF_DTYPE_Q6_K: {
		const struct nf_block_q6_K *b = blk;
		o->d = nf_fp16_to_fp32(b->d);
		for (int j = 0; j < 16; j++)
			o->sc[j] = b->scales[j];
		break;
	}
	default:
		memset(o, 0, sizeof(*o));
		break;
	}
}

void nf_kblock_unpack(uint32_t t, const void *blk, struct nf_kblock *o)
{
	nf_kblock_unpack_scales(t, blk, o);
	if (!nf_dtype_is_kquant(t))
		return;
	int off = nf_kquant_offset(t);
	for (uint32_t i = 0; i < NF_QK_K; i++)
		o->q[i] = (int8_t)((int)nf_kquant_get(t, blk, i) - off);
}

int nf_kblock_pack(uint32_t t, const struct nf_kblock *in, void *blk)
{
	switch (t) {
	case NF_DTYPE_Q2_K: {
		struct nf_block_q2_K *b = blk;
		memset(b, 0, sizeof(*b));
		b->d = nf_fp32_to_fp16(in->d);
		b->dmin = nf_fp32_to_fp16(in->dmin);
		for (int j = 0; j < 16; j++) {
			if (in->sc[j] < 0 || in->sc[j] > 15 || in->mn[j] < 0 || in->mn[j] > 15)
				return -1;
			b->scales[j] = (uint8_t)(in->sc[j] | (in->mn[j] << 4));
		}
		for (int i = 0; i < NF_QK_K; i++) {
			if (in->q[i] < 0 || in->q[i] > 3)
				return -1;
			b->qs[32 * (i / 128) + i % 32] |= (uint8_t)(in->q[i] << (2 * ((i % 128) / 32)));
		}
		return 0;
	}
	case NF_DTYPE_Q3_K: {
		struct nf_block_q3_K *b = blk;
		memset(b, 0, sizeof(*b));
		b->d = nf_fp32_to_fp16(in->d);
		for (int j = 0; j < 16; j++)
			if (in->sc[j] < -32 || in->sc[j] > 31)
				return -1;
		scales_k3_put(b->scales, in->sc);
		for (int i = 0; i < NF_QK_K; i++) {
			if (in->q[i] < -4 || in->q[i] > 3)
				return -1;
			int v = in->q[i] + 4;
			b->qs[32 * (i / 128) + i % 32] |= (uint8_t)((v & 3) << (2 * ((i % 128) / 32)));
			b->hmask[i % 32] |= (uint8_t)((v >> 2) << (i / 32));
		}
		return 0;
	}
	case NF_DTYPE_Q4_K:
	case NF_DTYPE_Q5_K: {
		struct nf_block_q4_K *b4 = blk;
		struct nf_block_q5_K *b5 = blk;
		int qmax = t == NF_DTYPE_Q4_K ? 15 : 31;
		memset(blk, 0, nf_dtype_block_size(t));
		b4->d = nf_fp32_to_fp16(in->d);
		b4->dmin = nf_fp32_to_fp16(in->dmin);
		for (int j = 0; j < 16; j++)
			if (in->sc[j] < 0 || in->sc[j] > 63 || in->mn[j] < 0 || in->mn[j] > 63 ||
			    in->sc[j] != in->sc[j ^ 1] || in->mn[j] != in->mn[j ^ 1])
				return -1;
		scales_k4_put(b4->scales, in->sc, in->mn);
		uint8_t *qs = t == NF_DTYPE_Q4_K ? b4->qs : b5->qs;
		for (int i = 0; i < NF_QK_K; i++) {
			if (in->q[i] < 0 || in->q[i] > qmax)
				return -1;
			int c = i / 64, l = i % 32, hi = (i % 64) >= 32;
			qs[32 * c + l] |= (uint8_t)((in->q[i] & 0xf) << (4 * hi));
			if (t == NF_DTYPE_Q5_K)
				b5->qh[l] |= (uint8_t)((in->q[i] >> 4) << (2 * c + hi));
		}
		return 0;
	}
	case NF_DTYPE_Q6_K: {
		struct nf_block_q6_K *b = blk;
		memset(b, 0, sizeof(*b));
		b->d = nf_fp32_to_fp16(in->d);
		for (int j = 0; j < 16; j++) {
			if (in->sc[j] < -128 || in->sc[j] > 127)
				return -1;
			b->scales[j] = (int8_t)in->sc[j];
		}
		for (int i = 0; i < NF_QK_K; i++) {
			if (in->q[i] < -32 || in->q[i] > 31)
				return -1;
			int v = in->q[i] + 32;
			int h = i / 128, k = (i % 128) / 32, l = i % 32;
			b->ql[64 * h + 32 * (k & 1) + l] |= (uint8_t)((v & 0xf) << (k < 2 ? 0 : 4));
			b->qh[32 * h + l] |= (uint8_t)((v >> 4) << (2 * k));
		}
		return 0;
	}
	default:
		return -1;
	}
}

uint32_t nf_kquant_bits(uint32_t t)
{
	return nf_dtype_is_kquant(t) ? t - NF_DTYPE_Q2_K + 2 : 0;
}

int nf_kquant_offset(uint32_t t)
{
	return t == NF_DTYPE_Q3_K ? 4 : t == NF_DTYPE_Q6_K ? 32 : 0;
}

void nf_kquant_quant_span(uint32_t t, size_t *qoff, size_t *qlen)
{
	switch (t) {
	case NF_DTYPE_Q2_K: *qoff = offsetof(struct nf_block_q2_K, qs); *qlen = NF_QK_K / 4; break;
	case NF_DTYPE_Q3_K: *qoff = 0; *qlen = NF_QK_K / 8 + NF_QK_K / 4; break;
	case NF_DTYPE_Q4_K: *qoff = offsetof(struct nf_block_q4_K, qs); *qlen = NF_QK_K / 2; break;
	case NF_DTYPE_Q5_K: *qoff = offsetof(struct nf_block_q5_K, qh); *qlen = NF_QK_K / 8 + NF_QK_K / 2; break;
	case NF_DTYPE_Q6_K: *qoff = 0; *qlen = NF_QK_K / 2 + NF_QK_K / 4; break;
	default: *qoff = 0; *qlen = 0; break;
	}
}

/* Where value i's bits live: up to two (byte, shift, width) fields, low
 * bits first, as the layouts in nflash/dtype.h say. */
struct qfield { uint32_t byte, shift, width; };

static int kq_fields(uint32_t t, uint32_t i, struct qfield f[2])
{
	uint32_t l = i % 32;
	switch (t) {
	case NF_DTYPE_Q2_K:
	case NF_DTYPE_Q3_K: {
		uint32_t qs = t == NF_DTYPE_Q2_K ? offsetof(struct nf_block_q2_K, qs)
						 : offsetof(struct nf_block_q3_K, qs);
		f[0] = (struct qfield){ (uint32_t)qs + 32 * (i / 128) + l, 2 * ((i % 128) / 32), 2 };
		if (t == NF_DTYPE_Q2_K)
			return 1;
		f[1] = (struct qfield){ (uint32_t)offsetof(struct nf_block_q3_K, hmask) + l, i / 32, 1 };
		return 2;
	}
	case NF_DTYPE_Q4_K:
	case NF_DTYPE_Q5_K: {
		uint32_t c = i / 64, hi = (i % 64) >= 32;
		uint32_t qs = t == NF_DTYPE_Q4_K ? offsetof(struct nf_block_q4_K, qs)
						 : offsetof(struct nf_block_q5_K, qs);
		f[0] = (struct qfield){ qs + 32 * c + l, 4 * hi, 4 };
		if (t == NF_DTYPE_Q4_K)
			return 1;
		f[1] = (struct qfield){ (uint32_t)offsetof(struct nf_block_q5_K, qh) + l, 2 * c + hi, 1 };
		return 2;
	}
	case NF_DTYPE_Q6_K: {
		uint32_t h = i / 128, k = (i % 128) / 32;
		f[0] = (struct qfield){ (uint32_t)offsetof(struct nf_block_q6_K, ql) + 64 * h + 32 * (k & 1) + l,
					k < 2 ? 0 : 4, 4 };
		f[1] = (struct qfield){ (uint32_t)offsetof(struct nf_block_q6_K, qh) + 32 * h + l, 2 * k, 2 };
		return 2;
	}
	default:
		return 0;
	}
}

uint32_t nf_kquant_get(uint32_t t, const void *blk, uint32_t i)
{
	const uint8_t *b = blk;
	struct qfield f[2];
	uint32_t v = 0, at = 0;
	for (int k = 0, n = kq_fields(t, i, f); k < n; k++) {
		v |= ((uint32_t)(b[f[k].byte] >> f[k].shift) & ((1u << f[k].width) - 1)) << at;
		at += f[k].width;
	}
	return v;
}

void nf_kquant_set(uint32_t t, void *blk, uint32_t i, uint32_t raw)
{
	uint8_t *b = blk;
	struct qfield f[2];
	for (int k = 0, n = kq_fields(t, i, f); k < n; k++) {
		uint32_t mask = ((1u << f[k].width) - 1) << f[k].shift;
		b[f[k].byte] = (uint8_t)((b[f[k].byte] & ~mask) | ((raw << f[k].shift) & mask));
		raw >>= f[k].width;
	}
}

void nf_kblock_dequantize(const struct nf_kblock *kb, float *y)
{
	for (int j = 0; j < 16; j++) {
		float dl = kb->d * (float)kb->sc[j];
		float ml = kb->dmin * (float)kb->mn[j];
		for (int l = 0; l < 16; l++)
			y[16 * j + l] = dl * (float)kb->q[16 * j + l] - ml;
	}
}

void nf_quantize_row_q8_K(const float *x, struct nf_block_q8_K *y, size_t n)
{
	for (size_t b = 0; b < n / NF_QK_K; b++, x += NF_QK_K) {
		float max = 0.0f, amax = 0.0f;
		for (int j = 0; j < NF_QK_K; j++)
			if (fabsf(x[j]) > amax) {
				amax = fabsf(x[j]);
				max = x[j];
			}
		if (amax == 0.0f) {
			memset(&y[b], 0, sizeof(y[b]));
			continue;
		}
		const float iscale = -127.0f / max;
		for (int j = 0; j < NF_QK_K; j++) {
			int v = nearest(iscale * x[j]);
			y[b].qs[j] = (int8_t)(v < 127 ? v : 127);
		}
		for (int j = 0; j < NF_QK_K / 16; j++) {
			int s = 0;
			for (int i = 0; i < 16; i++)
				s += y[b].qs[16 * j + i];
			y[b].bsums[j] = (int16_t)s;
		}
		y[b].d = 1.0f / iscale;
	}
}

/* fp16 round trip, so that the fit uses the scale the block will hold */
static float half(float f)
{
	return nf_fp16_to_fp32(nf_fp32_to_fp16(f));
}

/*
 * Fit one super-block: per sub-block of sbs values a scale (and for types
 * with mins a min <= 0), the scales quantized to [0, smax] (symmetric:
 * [-smax-1, smax]) against d = max / smax, then q in [qlo, qhi].
 */
static void fit_block(uint32_t t, const float *x, struct nf_kblock *kb)
{
	int sbs = (t == NF_DTYPE_Q4_K || t == NF_DTYPE_Q5_K) ? 32 : 16;
	bool affine = t != NF_DTYPE_Q3_K && t != NF_DTYPE_Q6_K;
	int qlo, qhi, smax;
	switch (t) {
	case NF_DTYPE_Q2_K: qlo = 0; qhi = 3; smax = 15; break;
	case NF_DTYPE_Q3_K: qlo = -4; qhi = 3; smax = 31; break;
	case NF_DTYPE_Q4_K: qlo = 0; qhi = 15; smax = 63; break;
	case NF_DTYPE_Q5_K: qlo = 0; qhi = 31; smax = 63; break;
	default: qlo = -32; qhi = 31; smax = 127; break;
	}
	float scale[16], mins[16], maxs = 0.0f, maxm = 0.0f;
	int nsb = NF_QK_K / sbs;
	for (int s = 0; s < nsb; s++) {
		const float *v = x + s * sbs;
		float lo = 0.0f, hi = 0.0f, amax = 0.0f;
		for (int i = 0; i < sbs; i++) {
			lo = fminf(lo, v[i]);
			hi = fmaxf(hi, v[i]);
			amax = fmaxf(amax, fabsf(v[i]));
		}
		scale[s] = affine ? (hi - lo) / (float)qhi : amax / (float)(-qlo);
		mins[s] = affine ? -lo : 0.0f;
		maxs = fmaxf(maxs, scale[s]);
		maxm = fmaxf(maxm, mins[s]);
	}
	kb->d = half(maxs / (float)smax);
	kb->dmin = affine ? half(maxm / (float)smax) : 0.0f;
	for (int s = 0; s < nsb; s++) {
		int sc = kb->d > 0.0f ? clampi(nearest(scale[s] / kb->d), affine ? 0 : -smax - 1, smax) : 0;
		int m = kb->dmin > 0.0f ? clampi(nearest(mins[s] / kb->dmin), 0, smax) : 0;
		float dl = kb->d * (float)sc, ml = kb->dmin * (float)m;
		for (int k = 0; k < sbs / 16; k++) {
			kb->sc[s * sbs / 16 + k] = (int16_t)sc;
			kb->mn[s * sbs / 16 + k] = (int16_t)m;
		}
		for (int i = 0; i < sbs; i++) {
			int q = dl > 0.0f ? nearest((x[s * sbs + i] + ml) / dl) : 0;
			kb->q[s * sbs + i] = (int8_t)clampi(q, qlo, qhi);
		}
	}
}

void nf_quantize_row_kquant(uint32_t t, const float *x, void *y, size_t n)
{
	size_t bs = nf_dtype_block_size(t);
	struct nf_kblock kb;
	for (size_t b = 0; b < n / NF_QK_K; b++) {
		memset(&kb, 0, sizeof(kb));
		fit_block(t, x + b * NF_QK_K, &kb);
		nf_kblock_pack(t, &kb, (char *)y + b * bs);
	}
}
