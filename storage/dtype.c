/*
 * dtype.c - element type table, fp16/bf16 conversion, reference quantizers.
 *
 * Invariant: encodings are bit-exact with ggml (round-to-nearest-even fp16
 * like F16C; Q4_0/Q8_0 rounding as ggml's quantize_row_*_ref), because the
 * fidelity tests compare against llama.cpp to 1e-6. K-quant layouts and
 * dequantization are ggml's; K-quant encoders are plain min/max fits (any
 * valid encoding serves synth and tests), Q8_K is ggml's reference rule.
 */
#include <math.h>
#include <string.h>
#include <strings.h>

#include "nflash/dtype.h"

bool nf_dtype_is_kquant(uint32_t t)
{
	return t >= NF_DTYPE_Q2_K && t <= NF_DTYPE_Q6_K;
}

bool nf_dtype_is_legacy(uint32_t t)
{
	return t == NF_DTYPE_Q4_1 || t == NF_DTYPE_Q5_0 || t == NF_DTYPE_Q5_1;
}

bool nf_dtype_valid(uint32_t t)
{
	return t == NF_DTYPE_F32 || t == NF_DTYPE_F16 || t == NF_DTYPE_Q4_0 ||
	       t == NF_DTYPE_Q8_0 || t == NF_DTYPE_BF16 || nf_dtype_is_kquant(t) ||
	       t == NF_DTYPE_Q8_K || nf_dtype_is_legacy(t) || t == NF_DTYPE_Q8_1;
}

const char *nf_dtype_name(uint32_t t)
{
	switch (t) {
	case NF_DTYPE_F32: return "f32";
	case NF_DTYPE_F16: return "f16";
	case NF_DTYPE_Q4_0: return "q4_0";
	case NF_DTYPE_Q8_0: return "q8_0";
	case NF_DTYPE_Q4_1: return "q4_1";
	case NF_DTYPE_Q5_0: return "q5_0";
	case NF_DTYPE_Q5_1: return "q5_1";
	case NF_DTYPE_Q8_1: return "q8_1";
	case NF_DTYPE_BF16: return "bf16";
	case NF_DTYPE_Q2_K: return "q2_K";
	case NF_DTYPE_Q3_K: return "q3_K";
	case NF_DTYPE_Q4_K: return "q4_K";
	case NF_DTYPE_Q5_K: return "q5_K";
	case NF_DTYPE_Q6_K: return "q6_K";
	case NF_DTYPE_Q8_K: return "q8_K";
	default: return "unknown";
	}
}

int nf_dtype_parse(const char *name)
{
	static const uint32_t all[] = { NF_DTYPE_F32, NF_DTYPE_F16, NF_DTYPE_Q4_0,
					NF_DTYPE_Q8_0, NF_DTYPE_BF16, NF_DTYPE_Q2_K,
					NF_DTYPE_Q3_K, NF_DTYPE_Q4_K, NF_DTYPE_Q5_K,
					NF_DTYPE_Q6_K, NF_DTYPE_Q8_K, NF_DTYPE_Q4_1,
					NF_DTYPE_Q5_0, NF_DTYPE_Q5_1, NF_DTYPE_Q8_1 };
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		if (!strcasecmp(name, nf_dtype_name(all[i])))
			return (int)all[i];
	return -1;
}

size_t nf_dtype_block_len(uint32_t t)
{
	switch (t) {
	case NF_DTYPE_F32: case NF_DTYPE_F16: case NF_DTYPE_BF16: return 1;
	case NF_DTYPE_Q4_0: case NF_DTYPE_Q8_0: case NF_DTYPE_Q4_1: case NF_DTYPE_Q5_0:
	case NF_DTYPE_Q5_1: case NF_DTYPE_Q8_1: return NF_QK;
	case NF_DTYPE_Q2_K: case NF_DTYPE_Q3_K: case NF_DTYPE_Q4_K: case NF_DTYPE_Q5_K:
	case NF_DTYPE_Q6_K: case NF_DTYPE_Q8_K: return NF_QK_K;
	default: return 0;
	}
}

size_t nf_dtype_block_size(uint32_t t)
{
	switch (t) {
	case NF_DTYPE_F32: return 4;
	case NF_DTYPE_F16: case NF_DTYPE_BF16: return 2;
	case NF_DTYPE_Q4_0: return sizeof(struct nf_block_q4_0);
	case NF_DTYPE_Q8_0: return sizeof(struct nf_block_q8_0);
	case NF_DTYPE_Q4_1: return sizeof(struct nf_block_q4_1);
	case NF_DTYPE_Q5_0: return sizeof(struct nf_block_q5_0);
	case NF_DTYPE_Q5_1: return sizeof(struct nf_block_q5_1);
	case NF_DTYPE_Q8_1: return sizeof(struct nf_block_q8_1);
	case NF_DTYPE_Q2_K: return sizeof(struct nf_block_q2_K);
	case NF_DTYPE_Q3_K: return sizeof(struct nf_block_q3_K);
	case NF_DTYPE_Q4_K: return sizeof(struct nf_block_q4_K);
	case NF_DTYPE_Q5_K: return sizeof(struct nf_block_q5_K);
	case NF_DTYPE_Q6_K: return sizeof(struct nf_block_q6_K);
	case NF_DTYPE_Q8_K: return sizeof(struct nf_block_q8_K);
	default: return 0;
	}
}

size_t nf_dtype_row_size(uint32_t t, uint64_t n)
{
	size_t bl = nf_dtype_block_len(t);
	if (!bl || n % bl)
		return 0;
	return (size_t)(n / bl) * nf_dtype_block_size(t);
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float nf_fp16_to_fp32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f;
	uint32_t man = h & 0x3ff;
	if (exp == 0) {
		if (man == 0)
			return bits_f32(sign);
		/* subnormal: man * 2^-24 */
		float v = (float)man * 0x1p-24f;
		return sign ? -v : v;
	}
	if (exp == 31)
		return bits_f32(sign | 0x7f800000u | (man << 13));
	return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t nf_fp32_to_fp16(float f)
{
	uint32_t x = f32_bits(f);
	uint32_t sign = (x >> 16) & 0x8000;
	uint32_t ax = x & 0x7fffffffu;
	if (ax >= 0x7f800000u) /* inf or nan */
		return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
	if (ax >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
		return (uint16_t)(sign | 0x7c00);
	if (ax < 0x38800000u) { /* below 2^-14: subnormal or zero */
		/* value / 2^-24, rounded to nearest even */
		float v = bits_f32(ax) * 0x1p24f;
		uint32_t r = (uint32_t)nearbyintf(v);
		return (uint16_t)(sign | r);
	}
	uint32_t exp = ((ax >> 23) - 112) << 10;
	uint32_t man = (ax >> 13) & 0x3ff;
	uint32_t rest = ax & 0x1fff;
	uint32_t h = exp | man;
	if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
		h++;
	return (uint16_t)(sign | h);
}

float nf_bf16_to_fp32(uint16_t h)
{
	return bits_f32((uint32_t)h << 16);
}

uint16_t nf_fp32_to_bf16(float f)
{
	uint32_t x = f32_bits(f);
	if ((x & 0x7fffffffu) > 0x7f800000u) /* nan: keep it quiet */
		return (uint16_t)((x >> 16) | 64);
	return (uint16_t)((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

/* ggml's reference Q8 block (quantize_row_q8_0_ref, q8_1_ref): returns d
 * (f32) and the quants' sum */
static float q8_ref_block(const float *v, int8_t qs[NF_QK], int *sum)
{
	float amax = 0;
	for (int j = 0; j < NF_QK; j++)
		amax = fmaxf(amax, fabsf(v[j]));
	float d = amax / 127.0f;
	float id = d ? 1.0f / d : 0.0f;
	*sum = 0;
	for (int j = 0; j < NF_QK; j++) {
		qs[j] = (int8_t)roundf(v[j] * id);
		*sum += qs[j];
	}
	return d;
}

void nf_quantize_row_q8_0(const float *x, struct nf_block_q8_0 *y, size_t n)
{
	int sum;
	for (size_t b = 0; b < n / NF_QK; b++)
		y[b].d = nf_fp32_to_fp16(q8_ref_block(x + b * NF_QK, y[b].qs, &sum));
}

void nf_quantize_row_q4_0(const float *x, struct nf_block_q4_0 *y, size_t n)
{
	for (size_t b = 0; b < n / NF_QK; b++) {
		const float *v = x + b * NF_QK;
		float amax = 0, max = 0;
		for (int j = 0; j < NF_QK; j++) {
			if (amax < fabsf(v[j])) {
				amax = fabsf(v[j]);
				max = v[j];
			}
		}
		float d = max / -8.0f;
		float id = d ? 1.0f / d : 0.0f;
		y[b].d = nf_fp32_to_fp16(d);
		for (int j = 0; j < NF_QK / 2; j++) {
			float x0 = v[j] * id, x1 = v[NF_QK / 2 + j] * id;
			uint8_t q0 = (uint8_t)fminf(15.0f, (float)(int8_t)(x0 + 8.5f));
			uint8_t q1 = (uint8_t)fminf(15.0f, (float)(int8_t)(x1 + 8.5f));
			y[b].qs[j] = (uint8_t)(q0 | (q1 << 4));
		}
	}
}

/* min and max of a 32-value block, as ggml's reference loop finds them */
static void block_min_max(const float *v, float *mn, float *mx)
{
	float lo = 3.402823466e+38f, hi = -3.402823466e+38f;
	for (int j = 0; j < NF_QK; j++) {
		if (v[j] < lo)
			lo = v[j];
		if (v[j] > hi)
			hi = v[j];
	}
	*mn = lo;
	*mx = hi;
}

static void set_qh(uint8_t qh[4], const uint8_t q[NF_QK])
{
	uint32_t h = 0;
	for (int j = 0; j < NF_QK; j++)
		h |= (uint32_t)((q[j] >> 4) & 1) << j;
	memcpy(qh, &h, 4);
}

static void set_qs(uint8_t qs[NF_QK / 2], const uint8_t q[NF_QK])
{
	for (int j = 0; j < NF_QK / 2; j++)
		qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + NF_QK / 2] & 0x0f) << 4));
}

/* ggml's quantize_row_q4_1_ref, q5_0_ref and q5_1_ref */
static void quantize_row_legacy(uint32_t t, const float *x, void *y, size_t n)
{
	for (size_t b = 0; b < n / NF_QK; b++) {
		const float *v = x + b * NF_QK;
		uint8_t q[NF_QK];
		if (t == NF_DTYPE_Q5_0) {
			float amax = 0.0f, max = 0.0f;
			for (int j = 0; j < NF_QK; j++)
				if (amax < fabsf(v[j])) {
					amax = fabsf(v[j]);
					max = v[j];
				}
			float d = max / -16.0f, id = d ? 1.0f / d : 0.0f;
			for (int j = 0; j < NF_QK; j++) {
				int8_t r = (int8_t)(v[j] * id + 16.5f);
				q[j] = (uint8_t)(r < 31 ? r : 31);
			}
			struct nf_block_q5_0 *o = (struct nf_block_q5_0 *)y + b;
			o->d = nf_fp32_to_fp16(d);
			set_qh(o->qh, q);
			set_qs(o->qs, q);
			continue;
		}
		float mn, mx;
		block_min_max(v, &mn, &mx);
		int top = t == NF_DTYPE_Q4_1 ? 15 : 31;
		float d = (mx - mn) / (float)top, id = d ? 1.0f / d : 0.0f;
		for (int j = 0; j < NF_QK; j++) {
			float s = (v[j] - mn) * id;
			if (t == NF_DTYPE_Q4_1) {
				int8_t r = (int8_t)(s + 0.5f);
				q[j] = (uint8_t)(r < 15 ? r : 15);
			} else {
				q[j] = (uint8_t)(s + 0.5f);
			}
		}
		if (t == NF_DTYPE_Q4_1) {
			struct nf_block_q4_1 *o = (struct nf_block_q4_1 *)y + b;
			o->d = nf_fp32_to_fp16(d);
			o->m = nf_fp32_to_fp16(mn);
			set_qs(o->qs, q);
		} else {
			struct nf_block_q5_1 *o = (struct nf_block_q5_1 *)y + b;
			o->d = nf_fp32_to_fp16(d);
			o->m = nf_fp32_to_fp16(mn);
			set_qh(o->qh, q);
			set_qs(o->qs, q);
		}
	}
}

void nf_quant5_unpack(uint32_t t, const void *blk, uint8_t q[NF_QK])
{
	const uint8_t *qs, *qh = NULL;
	if (t == NF_DTYPE_Q4_1) {
		qs = ((const struct nf_block_q4_1 *)blk)->qs;
	} else if (t == NF_DTYPE_Q5_0) {
		qs = ((const struct nf_block_q5_0 *)blk)->qs;
		qh = ((const struct nf_block_q5_0 *)blk)->qh;
	} else {
		qs = ((const struct nf_block_q5_1 *)blk)->qs;
		qh = ((const struct nf_block_q5_1 *)blk)->qh;
	}
	uint32_t h = 0;
	if (qh)
		memcpy(&h, qh, 4);
	for (int j = 0; j < NF_QK / 2; j++) {
		q[j] = (uint8_t)((qs[j] & 0x0f) | (((h >> j) & 1) << 4));
		q[j + NF_QK / 2] = (uint8_t)((qs[j] >> 4) | (((h >> (j + NF_QK / 2)) & 1) << 4));
	}
}

void nf_dequantize_row(uint32_t t, const void *src, float *dst, size_t n)
{
	switch (t) {
	case NF_DTYPE_F32:
		memcpy(dst, src, n * sizeof(float));
		break;
	case NF_DTYPE_F16: {
		const uint16_t *s = src;
		for (size_t i = 0; i < n; i++)
			dst[i] = nf_fp16_to_fp32(s[i]);
		break;
	}
	case NF_DTYPE_BF16: {
		const uint16_t *s = src;
		for (size_t i = 0; i < n; i++)
			dst[i] = nf_bf16_to_fp32(s[i]);
		break;
	}
	case NF_DTYPE_Q8_0: {
		const struct nf_block_q8_0 *b = src;
		for (size_t i = 0; i < n / NF_QK; i++) {
			float d = nf_fp16_to_fp32(b[i].d);
			for (int j = 0; j < NF_QK; j++)
				dst[i * NF_QK + j] = b[i].qs[j] * d;
		}
		break;
	}
	case NF_DTYPE_Q4_0: {
		const struct nf_block_q4_0 *b = src;
		for (size_t i = 0; i < n / NF_QK; i++) {
			float d = nf_fp16_to_fp32(b[i].d);
			for (int j = 0; j < NF_QK / 2; j++) {
				dst[i * NF_QK + j] = ((b[i].qs[j] & 0x0f) - 8) * d;
				dst[i * NF_QK + j + NF_QK / 2] = ((b[i].qs[j] >> 4) - 8) * d;
			}
		}
		break;
	}
	case NF_DTYPE_Q4_1: case NF_DTYPE_Q5_0: case NF_DTYPE_Q5_1: {
		/* ggml's dequantize_row_q4_1/q5_0/q5_1: q * d + m, (q - 16) * d */
		size_t bs = nf_dtype_block_size(t);
		for (size_t i = 0; i < n / NF_QK; i++) {
			const void *b = (const char *)src + i * bs;
			uint8_t q[NF_QK];
			nf_quant5_unpack(t, b, q);
			float d = nf_fp16_to_fp32(*(const uint16_t *)b);
			float m = t == NF_DTYPE_Q5_0 ? 0.0f : nf_fp16_to_fp32(((const uint16_t *)b)[1]);
			for (int j = 0; j < NF_QK; j++)
				dst[i * NF_QK + j] = t == NF_DTYPE_Q5_0 ? ((int)q[j] - 16) * d : q[j] * d + m;
		}
		break;
	}
	case NF_DTYPE_Q8_1: {
		const struct nf_block_q8_1 *b = src;
		for (size_t i = 0; i < n / NF_QK; i++) {
			float d = nf_fp16_to_fp32(b[i].d);
			for (int j = 0; j < NF_QK; j++)
				dst[i * NF_QK + j] = b[i].qs[j] * d;
		}
		break;
	}
	case NF_DTYPE_Q8_K: {
		const struct nf_block_q8_K *b = src;
		for (size_t i = 0; i < n / NF_QK_K; i++)
			for (int j = 0; j < NF_QK_K; j++)
				dst[i * NF_QK_K + j] = b[i].d * b[i].qs[j];
		break;
	}
	default:
		if (nf_dtype_is_kquant(t)) {
			size_t bs = nf_dtype_block_size(t);
			struct nf_kblock kb;
			for (size_t i = 0; i < n / NF_QK_K; i++) {
				nf_kblock_unpack(t, (const char *)src + i * bs, &kb);
				nf_kblock_dequantize(&kb, dst + i * NF_QK_K);
			}
		}
		break;
	}
}

void nf_quantize_row(uint32_t t, const float *src, void *dst, size_t n)
{
	switch (t) {
	case NF_DTYPE_F32:
		memcpy(dst, src, n * sizeof(float));
		break;
	case NF_DTYPE_F16: {
		uint16_t *d = dst;
		for (size_t i = 0; i < n; i++)
			d[i] = nf_fp32_to_fp16(src[i]);
		break;
	}
	case NF_DTYPE_BF16: {
		uint16_t *d = dst;
		for (size_t i = 0; i < n; i++)
			d[i] = nf_fp32_to_bf16(src[i]);
		break;
	}
	case NF_DTYPE_Q8_0:
		nf_quantize_row_q8_0(src, dst, n);
		break;
	case NF_DTYPE_Q4_0:
		nf_quantize_row_q4_0(src, dst, n);
		break;
	case NF_DTYPE_Q8_K:
		nf_quantize_row_q8_K(src, dst, n);
		break;
	case NF_DTYPE_Q4_1: case NF_DTYPE_Q5_0: case NF_DTYPE_Q5_1:
		quantize_row_legacy(t, src, dst, n);
		break;
	case NF_DTYPE_Q8_1: {
		/* ggml's quantize_row_q8_1_ref: s = d * sum(q) */
		struct nf_block_q8_1 *y = dst;
		for (size_t b = 0; b < n / NF_QK; b++) {
			int sum;
			float d = q8_ref_block(src + b * NF_QK, y[b].qs, &sum);
			y[b].d = nf_fp32_to_fp16(d);
			y[b].s = nf_fp32_to_fp16((float)sum * d);
		}
		break;
	}
	default:
		if (nf_dtype_is_kquant(t))
			nf_quantize_row_kquant(t, src, dst, n);
		break;
	}
}
