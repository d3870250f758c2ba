/*
 * synth_write.c - the synthetic-model generator: builds the tensor list,
 * derives every weight from the seed, and streams the GGUF file.
 *
 * Invariants:
 *  1. Every value is a pure function of (seed, tensor kind, layer, expert,
 *     position): a counter-based generator (wyrand's mixer on seed + index)
 *     feeds each row independently, so threads can split rows in any way
 *     and the bytes do not change.
 *  2. The low-rank gate B * A has integer factors with |B|,|A| <= 127 and
 *     rank <= 2047/2, so every partial sum is an integer below 2^24 and is
 *     exact in float whatever the summation order or ISA.
 *  3. No layer writes to the bias channel or to the token channels: rows of
 *     attn_output and of ffn_down (columns of ffn_down_t) are zero there,
 *     which Q4_0/Q8_0/F16 store exactly. Gate rows (and dReLU up rows) read
 *     only those channels, so whether a neuron fires is decided by the
 *     token, with the probability the construction chose.
 *  4. Memory: one layer's construction state (A, B, per-neuron bias and
 *     scale, for every expert) plus two chunk buffers; tensors are streamed.
 *  5. The predictor file and the --no-predictor file differ only in the
 *     magic, the powerinfer.* key, the fc1/fc2 tensors and the layout of the
 *     down matrix (ffn_down_t vs ffn_down: the same real matrix, each
 *     quantized along its own rows); every other tensor is byte-identical.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/synth.h"
#include "synth_gate.h"

#define CHUNK_BYTES (8u << 20)
#define LAYER_GLOBAL 0xffffu

/* ---- counter-based random numbers -------------------------------------- */

enum kind {
	K_EMBD = 1, K_OUTPUT, K_NORM, K_Q, K_K, K_V, K_O, K_ROUTER,
	K_GATE, K_UP, K_DOWN, K_DOWN_T, K_FC1, K_FC2,
	K_LAT_A, K_LAT_B, K_PERM,
};

static inline uint64_t mum(uint64_t a, uint64_t b)
{
	__uint128_t r = (__uint128_t)a * b;
	return (uint64_t)(r >> 64) ^ (uint64_t)r;
}

/* The ctr-th 64-bit random number of stream key. */
static inline uint64_t rnd(uint64_t key, uint64_t ctr)
{
	uint64_t s = key + (ctr + 1) * 0xa0761d6478bd642fULL;
	return mum(s, s ^ 0xe7037ed1a0b428dbULL);
}

static uint64_t stream_key(uint64_t seed, enum kind k, uint32_t layer, uint32_t expert)
{
	uint64_t a = mum(seed ^ 0x8ebc6af09c88c6e3ULL, 0x589965cc75374cc3ULL);
	uint64_t b = ((uint64_t)k << 40) | ((uint64_t)layer << 16) | expert;
	return mum(a ^ b, 0x1d8e4e27c47d124fULL) + b;
}

/* n values (n even) uniform in [-scale, scale), from counters base, base+1, ... */
static void fill_uniform(uint64_t key, uint64_t base, float *out, size_t n, float scale)
{
	const float s = scale * 0x1p-31f;
	for (size_t i = 0; i < n; i += 2) {
		uint64_t z = rnd(key, base + i / 2);
		out[i] = (float)(int32_t)(uint32_t)z * s;
		out[i + 1] = (float)(int32_t)(uint32_t)(z >> 32) * s;
	}
}

/* Uniform integer in [-127, 127]. */
static inline float int127(uint64_t z)
{
	return (float)((int)((z >> 32) % 255u) - 127);
}

/* ---- quantization ---------------------------------------------------------- */

/*
 * The same bytes as nf_quantize_row_q4_0/q8_0 (ggml's reference rounding),
 * written so the compiler can vectorize them and without libm calls in the
 * inner loop: the generator spends most of its time here.
 */
/* max |v[j]| over a block, as the bit pattern of a non-negative float
 * (whose integer order is the float order): an integer reduction the
 * compiler vectorizes. */
static inline uint32_t block_amax_bits(const float *v)
{
	uint32_t u[NF_QK], m = 0;
	memcpy(u, v, sizeof(u));
	for (int j = 0; j < NF_QK; j++) {
		uint32_t a = u[j] & 0x7fffffffu;
		m = a > m ? a : m;
	}
	return m;
}

static void quant_q4_0(const float *x, struct nf_block_q4_0 *y, size_t n)
{
	for (size_t b = 0; b < n / NF_QK; b++) {
		const float *v = x + b * NF_QK;
		uint32_t m = block_amax_bits(v);
		float max = 0;
		if (m == 0) {   /* all zeros: d = 0 / -8 = -0, every q = 8 */
			y[b].d = 0x8000;
			memset(y[b].qs, 0x88, sizeof(y[b].qs));
			continue;
		}
		/* the first value of largest magnitude, sign included */
		for (int j = 0; j < NF_QK; j++) {
			uint32_t u;
			memcpy(&u, &v[j], 4);
			if ((u & 0x7fffffffu) == m) {
				max = v[j];
				break;
			}
		}
		float d = max / -8.0f;
		float id = d != 0 ? 1.0f / d : 0.0f;
		int q[NF_QK];
		y[b].d = nf_fp32_to_fp16(d);
		for (int j = 0; j < NF_QK; j++) {
			int t = (int)(v[j] * id + 8.5f);
			q[j] = t > 15 ? 15 : t;
		}
		for (int j = 0; j < NF_QK / 2; j++)
			y[b].qs[j] = (uint8_t)(q[j] | (q[NF_QK / 2 + j] << 4));
	}
}

static void quant_q8_0(const float *x, struct nf_block_q8_0 *y, size_t n)
{
	for (size_t b = 0; b < n / NF_QK; b++) {
		const float *v = x + b * NF_QK;
		uint32_t m = block_amax_bits(v);
		float amax;
		if (m == 0) {
			y[b].d = 0;
			memset(y[b].qs, 0, sizeof(y[b].qs));
			continue;
		}
		memcpy(&amax, &m, 4);
		float d = amax / 127.0f;
		float id = d != 0 ? 1.0f / d : 0.0f;
		y[b].d = nf_fp32_to_fp16(d);
		for (int j = 0; j < NF_QK; j++) {
			/* roundf (half away from zero), exactly: t - trunc(t) is exact */
			float t = v[j] * id;
			int q = (int)t;
			float f = t - (float)q;
			q += (f >= 0.5f) - (f <= -0.5f);
			y[b].qs[j] = (int8_t)q;
		}
	}
}

void nf_synth_quantize_row(uint32_t type, const float *src, void *dst, size_t n)
{
	if (type == NF_DTYPE_Q4_0)
		quant_q4_0(src, dst, n);
	else if (type == NF_DTYPE_Q8_0)
		quant_q8_0(src, dst, n);
	else
		nf_quantize_row(type, src, dst, n);
}

/* ---- the tensor list ----------------------------------------------------- */

struct tdesc {
	char name[64];
	uint32_t type, n_dims;
	uint64_t ne[3];
	enum kind kind;
	uint32_t layer;
};

struct tlist {
	struct tdesc *t;
	size_t n, cap;
};

static int tl_add(struct tlist *l, enum kind kind, uint32_t layer, uint32_t type,
		  uint32_t n_dims, uint64_t ne0, uint64_t ne1, uint64_t ne2, const char *fmt)
{
	if (l->n == l->cap) {
		size_t cap = l->cap ? 2 * l->cap : 64;
		struct tdesc *t = realloc(l->t, cap * sizeof(*t));
		if (!t)
			return -ENOMEM;
		l->t = t;
		l->cap = cap;
	}
	struct tdesc *t = &l->t[l->n++];
	memset(t, 0, sizeof(*t));
	if (layer == LAYER_GLOBAL)
		snprintf(t->name, sizeof(t->name), "%s", fmt);
	else
		snprintf(t->name, sizeof(t->name), fmt, layer);
	t->type = type;
	t->n_dims = n_dims;
	t->ne[0] = ne0;
	t->ne[1] = ne1;
	t->ne[2] = ne2;
	t->kind = kind;
	t->layer = layer;
	return 0;
}

static uint32_t pred_type(const struct nf_synth_params *p)
{
	return p->dtype == NF_DTYPE_F32 ? NF_DTYPE_F32 : NF_DTYPE_F16;
}

/* PowerInfer's sample stores the transposed down matrix in F16 for float
 * models (its axpy wants F16 or a quantized type). */
static uint32_t down_t_type(const struct nf_synth_params *p)
{
	return (p->dtype == NF_DTYPE_F32 || p->dtype == NF_DTYPE_F16) ? NF_DTYPE_F16 : p->dtype;
}

static int build_tensors(const struct nf_synth_params *p, struct tlist *l)
{
	const uint32_t d = p->n_embd, ff = p->n_ff, T = p->dtype, E = p->n_expert;
	const uint32_t hd = d / p->n_head, kvd = hd * p->n_head_kv, r = p->pred_rank;
	const uint32_t G = LAYER_GLOBAL;
	int rc = 0;
#define ADD(...) do { if ((rc = tl_add(l, __VA_ARGS__)) < 0) return rc; } while (0)
	ADD(K_EMBD, G, T, 2, d, p->n_vocab, 1, "token_embd.weight");
	for (uint32_t i = 0; i < p->n_layer; i++) {
		ADD(K_NORM, i, NF_DTYPE_F32, 1, d, 1, 1, "blk.%u.attn_norm.weight");
		ADD(K_Q, i, T, 2, d, d, 1, "blk.%u.attn_q.weight");
		ADD(K_K, i, T, 2, d, kvd, 1, "blk.%u.attn_k.weight");
		ADD(K_V, i, T, 2, d, kvd, 1, "blk.%u.attn_v.weight");
		ADD(K_O, i, T, 2, d, d, 1, "blk.%u.attn_output.weight");
		ADD(K_NORM, i, NF_DTYPE_F32, 1, d, 1, 1, "blk.%u.ffn_norm.weight");
		if (E) {
			ADD(K_ROUTER, i, NF_DTYPE_F32, 2, d, E, 1, "blk.%u.ffn_gate_inp.weight");
			ADD(K_GATE, i, T, 3, d, ff, E, "blk.%u.ffn_gate_exps.weight");
			ADD(K_UP, i, T, 3, d, ff, E, "blk.%u.ffn_up_exps.weight");
			ADD(K_DOWN, i, T, 3, ff, d, E, "blk.%u.ffn_down_exps.weight");
			if (p->predictor) {
				ADD(K_FC1, i, pred_type(p), 3, d, r, E, "blk.%u.fc1.weight");
				ADD(K_FC2, i, pred_type(p), 3, r, ff, E, "blk.%u.fc2.weight");
			}
			continue;
		}
		ADD(K_GATE, i, T, 2, d, ff, 1, "blk.%u.ffn_gate.weight");
		ADD(K_UP, i, T, 2, d, ff, 1, "blk.%u.ffn_up.weight");
		if (p->predictor) {
			ADD(K_DOWN_T, i, down_t_type(p), 2, d, ff, 1, "blk.%u.ffn_down_t.weight");
			ADD(K_FC1, i, pred_type(p), 2, d, r, 1, "blk.%u.fc1.weight");
			ADD(K_FC2, i, pred_type(p), 2, r, ff, 1, "blk.%u.fc2.weight");
		} else {
			ADD(K_DOWN, i, T, 2, ff, d, 1, "blk.%u.ffn_down.weight");
		}
	}
	ADD(K_NORM, G, NF_DTYPE_F32, 1, d, 1, 1, "output_norm.weight");
	ADD(K_OUTPUT, G, T, 2, d, p->n_vocab, 1, "output.weight");
#undef ADD
	return 0;
}

static uint64_t tensor_bytes(const struct tdesc *t)
{
	return nf_dtype_row_size(t->type, t->ne[0]) * t->ne[1] * t->ne[2];
}

uint64_t nf_synth_data_bytes(const struct nf_synth_params *p)
{
	struct tlist l = { 0 };
	uint64_t sum = 0;
	if (build_tensors(p, &l) == 0)
		for (size_t i = 0; i < l.n; i++)
			sum += tensor_bytes(&l.t[i]);
	free(l.t);
	return sum;
}

/* ---- construction state ------------------------------------------------ */

/* One expert's (or a dense layer's) FFN: the gate is gate_j = s_j * (B_j A)
 * on the token channels plus gbias_j on the bias channel. */
struct expert_state {
	float *A;       /* R x n_tok, integers in [-127, 127] */
	float *B;       /* n_ff x R, integers in [-127, 127] */
	float *gbias;   /* n_ff: gate's bias-channel weight */
	float *ubias;   /* n_ff: up's bias-channel weight (dReLU) */
	float *scale;   /* n_ff: s_j = 1 / ||B_j A||, set while the gate is generated */
};

struct gen {
	const struct nf_synth_params *p;
	uint32_t d, n_tok, R, n_exp, layer;
	bool avx2;          /* use the AVX2 gate kernel (same bytes, faster) */
	float sigma_e;      /* rms of the token-channel embedding values as stored */
	float threshold;    /* powerinfer.sparse_threshold */
	float sigma_down;   /* std of down weights */
	double *gate_probit;/* by rank: probit of the gate's firing probability */
	double *up_probit;  /* by rank: probit of up > 0 (dReLU) */
	struct expert_state *ex;
};

static void gen_free(struct gen *g)
{
	if (g->ex)
		for (uint32_t e = 0; e < g->n_exp; e++) {
			free(g->ex[e].A);
			free(g->ex[e].B);
			free(g->ex[e].gbias);
			free(g->ex[e].ubias);
			free(g->ex[e].scale);
		}
	free(g->ex);
	free(g->gate_probit);
	free(g->up_probit);
}

static int gen_init(struct gen *g, const struct nf_synth_params *p)
{
	memset(g, 0, sizeof(*g));
	g->p = p;
	g->d = p->n_embd;
	g->n_tok = nf_synth_n_tok(p->n_embd);
	g->R = p->pred_rank / 2 - 1;
	g->n_exp = p->n_expert ? p->n_expert : 1;
	g->layer = LAYER_GLOBAL;
	g->avx2 = nf_synth_gate_avx2_ok() &&
		  !getenv("NFLASH_SYNTH_NO_AVX2");
	const uint32_t ff = p->n_ff;
	double n_active = (1.0 - p->sparsity) * ff * (p->n_expert ? p->n_expert_used : 1);
	if (n_active < 1)
		n_active = 1;
	g->sigma_down = (float)(1.0 / sqrt((double)p->n_layer * n_active));

	double *prob = malloc(ff * sizeof(double));
	g->gate_probit = malloc(ff * sizeof(double));
	g->up_probit = malloc(ff * sizeof(double));
	g->ex = calloc(g->n_exp, sizeof(*g->ex));
	int rc = -ENOMEM;
	if (!prob || !g->gate_probit || !g->up_probit || !g->ex)
		goto out;
	for (uint32_t e = 0; e < g->n_exp; e++) {
		struct expert_state *x = &g->ex[e];
		x->A = malloc((size_t)g->R * g->n_tok * sizeof(float));
		x->B = malloc((size_t)ff * g->R * sizeof(float));
		x->gbias = malloc(ff * sizeof(float));
		x->ubias = malloc(ff * sizeof(float));
		x->scale = malloc(ff * sizeof(float));
		if (!x->A || !x->B || !x->gbias || !x->ubias || !x->scale)
			goto out;
	}
	if ((rc = nf_synth_power_law(prob, ff, 1.0 - p->sparsity, p->skew)) < 0)
		goto out;
	for (uint32_t k = 0; k < ff; k++) {
		/* dReLU fires iff gate > 0 and up > 0; the two read independent
		 * random directions, so P = P(gate) * P(up). Up is mostly on
		 * (>= 0.8) so a predictor of the gate stays precise. */
		double q = 1.0;
		if (p->act == NF_SYNTH_ACT_DRELU) {
			q = sqrt(prob[k]);
			if (q < 0.8)
				q = 0.8;
		}
		g->gate_probit[k] = nf_synth_probit(prob[k] / q);
		g->up_probit[k] = nf_synth_probit(q < 1 ? q : 0.999999);
	}
	rc = 0;
out:
	free(prob);
	return rc;
}

/* Build layer's A, B, rank permutation and biases for every expert. */
static void gen_layer(struct gen *g, uint32_t layer, uint32_t *perm)
{
	const struct nf_synth_params *p = g->p;
	const uint32_t ff = p->n_ff;
	const float k_bias = g->sigma_e / NF_SYNTH_BIAS_VALUE;
	g->layer = layer;
	for (uint32_t e = 0; e < g->n_exp; e++) {
		struct expert_state *x = &g->ex[e];
		uint64_t ka = stream_key(p->seed, K_LAT_A, layer, e);
		uint64_t kb = stream_key(p->seed, K_LAT_B, layer, e);
		uint64_t kp = stream_key(p->seed, K_PERM, layer, e);
		for (size_t i = 0; i < (size_t)g->R * g->n_tok; i++)
			x->A[i] = int127(rnd(ka, i));
		for (size_t i = 0; i < (size_t)ff * g->R; i++)
			x->B[i] = int127(rnd(kb, i));
		/* perm[j] = firing rank of neuron j (Fisher-Yates). */
		for (uint32_t j = 0; j < ff; j++)
			perm[j] = j;
		for (uint32_t j = ff - 1; j > 0; j--) {
			uint32_t k = (uint32_t)(((rnd(kp, j) >> 32) * (uint64_t)(j + 1)) >> 32);
			uint32_t t = perm[j];
			perm[j] = perm[k];
			perm[k] = t;
		}
		for (uint32_t j = 0; j < ff; j++) {
			x->gbias[j] = (float)(g->gate_probit[perm[j]] * k_bias);
			x->ubias[j] = (float)(g->up_probit[perm[j]] * k_bias);
			x->scale[j] = 0;
		}
	}
}

static inline bool is_reserved(const struct gen *g, uint64_t c)
{
	return c == NF_SYNTH_BIAS_CHANNEL ||
	       (c >= NF_SYNTH_TOK_BEGIN && c < NF_SYNTH_TOK_BEGIN + g->n_tok);
}

/* Gate row j of expert x (d floats); also records its scale. tmp: n_tok floats. */
static void gate_row(const struct gen *g, struct expert_state *x, uint32_t j, float *out,
		     float *tmp)
{
	const uint32_t nt = g->n_tok, R = g->R;
	const float *b = x->B + (size_t)j * R;
	if (g->avx2) {
		nf_synth_gate_row_avx2(x->A, b, R, nt, tmp);
	} else {
		memset(tmp, 0, nt * sizeof(float));
		for (uint32_t k = 0; k < R; k++) {
			const float bk = b[k], *a = x->A + (size_t)k * nt;
			for (uint32_t c = 0; c < nt; c++)
				tmp[c] += bk * a[c];
		}
	}
	double ss = 0;   /* integers: exact in double in any order */
	for (uint32_t c = 0; c < nt; c++)
		ss += (double)tmp[c] * tmp[c];
	float s = ss > 0 ? (float)(1.0 / sqrt(ss)) : 0.0f;
	x->scale[j] = s;
	memset(out, 0, g->d * sizeof(float));
	out[NF_SYNTH_BIAS_CHANNEL] = x->gbias[j];
	for (uint32_t c = 0; c < nt; c++)
		out[NF_SYNTH_TOK_BEGIN + c] = tmp[c] * s;
}

/*
 * Grid tensors: the purely random matrices (attention, up for ReLU/SiLU,
 * down, output) hold integers k times a power-of-two step delta, so that
 * Q4_0/Q8_0 blocks can be written directly (no float round trip) and so
 * that both layouts of the down matrix are exactly the same real matrix:
 * in every 32-block of a down row or column one element ("the pattern",
 * where (c + j) % 32 == 0, plus (1, j) for j % 32 == 0 since channel 0 is
 * reserved) has magnitude K + 1, which makes ggml's own quantizer pick
 * scale delta and reproduce every value exactly along either axis. The
 * pattern's sign alternates by block so the matrix has zero mean.
 */
static bool is_grid(const struct gen *g, enum kind k)
{
	switch (k) {
	case K_OUTPUT: case K_Q: case K_K: case K_V: case K_O: case K_DOWN: case K_DOWN_T:
		return true;
	case K_UP:
		return g->p->act != NF_SYNTH_ACT_DRELU;
	default:
		return false;
	}
}

static int grid_K(const struct gen *g, enum kind k)
{
	bool q4 = g->p->dtype == NF_DTYPE_Q4_0;
	if (k == K_DOWN || k == K_DOWN_T)
		return q4 ? 7 : 126;
	return q4 ? 7 : 127;
}

static float grid_delta(const struct gen *g, enum kind k)
{
	const struct nf_synth_params *p = g->p;
	double sigma;
	switch (k) {
	case K_OUTPUT: sigma = 2.0 / sqrt((double)g->d); break;
	case K_O: sigma = 1.0 / sqrt((double)g->d * p->n_layer); break;
	case K_DOWN: case K_DOWN_T: sigma = g->sigma_down; break;
	default: sigma = 1.0 / sqrt((double)g->d); break;
	}
	double K = grid_K(g, k);
	return (float)exp2(round(log2(sigma / sqrt(K * (K + 1) / 3.0))));
}

/* Uniform integer in [-K, K] from one random byte. */
static inline int8_t kbyte(unsigned b, int K)
{
	return (int8_t)((int)((b * (unsigned)(2 * K + 1)) >> 8) - K);
}

typedef uint8_t nf_vu8 __attribute__((vector_size(16)));
typedef int8_t nf_vi8 __attribute__((vector_size(16)));
typedef uint16_t nf_vu16 __attribute__((vector_size(32)));
typedef int16_t nf_vi16 __attribute__((vector_size(32)));

/* Turn random bytes into uniform integers in [-K, K], in place; n is a
 * multiple of 16. Written with vector types: it runs on every weight. */
static void kbytes(int8_t *k, size_t n, int K)
{
	const uint16_t m = (uint16_t)(2 * K + 1);
	for (size_t i = 0; i < n; i += 16) {
		nf_vu8 b;
		memcpy(&b, k + i, 16);
		nf_vu16 w = __builtin_convertvector(b, nf_vu16);
		w = (w * m) >> 8;
		nf_vi16 s = (nf_vi16)w - (int16_t)K;
		nf_vi8 r = __builtin_convertvector(s, nf_vi8);
		memcpy(k + i, &r, 16);
	}
}

/* Down element (c, j) uses byte (c * ff + j) % 8 of 64-bit number
 * (c * ff + j) / 8: rows of ffn_down read eight elements per number.
 * Pattern elements: (c + j) % 32 == 0, and (1, j) for j % 32 == 0. */
static inline int8_t down_sign_k(uint64_t c, uint64_t j, int K)
{
	return (int8_t)((((c >> 5) + (j >> 5)) & 1) ? -(K + 1) : K + 1);
}

/* The integers of row `row` of grid tensor t (t->ne[0] of them). */
static void grid_row(const struct gen *g, const struct tdesc *t, uint64_t row, int8_t *k)
{
	const uint64_t n = t->ne[0], ff = g->p->n_ff;
	const uint32_t e = (uint32_t)(row / t->ne[1]);
	const uint64_t j = row % t->ne[1];
	const uint64_t key = stream_key(g->p->seed, t->kind == K_DOWN_T ? K_DOWN : t->kind,
					t->layer, e);
	const int K = grid_K(g, t->kind);

	if (t->kind == K_DOWN) {         /* row = output channel j, element i = neuron */
		if (is_reserved(g, j)) {
			memset(k, 0, n);
			return;
		}
		for (uint64_t i = 0; i < n; i += 8) {
			uint64_t z = rnd(key, (j * ff + i) / 8);
			memcpy(k + i, &z, 8);
		}
		kbytes(k, n, K);
		for (uint64_t i = (32 - j % 32) % 32; i < n; i += 32)
			k[i] = down_sign_k(j, i, K);
		if (j == 1)
			for (uint64_t i = 0; i < n; i += 32)
				k[i] = down_sign_k(j, i, K);
		return;
	}
	if (t->kind == K_DOWN_T) {       /* row = neuron j, element c = channel */
		for (uint64_t c = 0; c < n; c++)
			k[c] = (int8_t)(rnd(key, (c * ff + j) / 8) >> (8 * (j % 8)));
		kbytes(k, n, K);
		for (uint64_t c = (32 - j % 32) % 32; c < n; c += 32)
			k[c] = down_sign_k(c, j, K);
		if (j % 32 == 0)
			k[1] = down_sign_k(1, j, K);
		k[NF_SYNTH_BIAS_CHANNEL] = 0;
		memset(k + NF_SYNTH_TOK_BEGIN, 0, g->n_tok);
		return;
	}
	if (t->kind == K_O && is_reserved(g, j)) {
		memset(k, 0, n);
		return;
	}
	uint64_t base = (t->kind == K_UP ? j : row) * (n / 8);
	for (uint64_t i = 0; i < n; i += 8) {
		uint64_t z = rnd(key, base + i / 8);
		memcpy(k + i, &z, 8);
	}
	kbytes(k, n, K);
	if (t->kind == K_UP)
		k[NF_SYNTH_BIAS_CHANNEL] = 0;
}

static void grid_floats(const struct gen *g, const struct tdesc *t, uint64_t row, float *out,
			float *tmp)
{
	int8_t *k = (int8_t *)tmp;
	float delta = grid_delta(g, t->kind);
	grid_row(g, t, row, k);
	for (uint64_t i = 0; i < t->ne[0]; i++)
		out[i] = (float)k[i] * delta;
}

/*
 * Encode a grid row directly as Q4_0 or Q8_0. Blocks holding the pattern
 * (or all zeros) get exactly the bytes ggml's quantizer would give for the
 * same values; other blocks use scale delta, a valid encoding of the
 * same values.
 */
static void grid_encode(const struct gen *g, const struct tdesc *t, uint64_t row, void *dst,
			int8_t *k)
{
	const uint64_t n = t->ne[0];
	const float delta = grid_delta(g, t->kind);
	const int K = grid_K(g, t->kind);
	const uint16_t d_pos = nf_fp32_to_fp16(delta), d_neg = nf_fp32_to_fp16(-delta);
	grid_row(g, t, row, k);
	for (uint64_t b = 0; b < n / NF_QK; b++) {
		const int8_t *v = k + b * NF_QK;
		nf_vi8 lo, hi;
		memcpy(&lo, v, 16);
		memcpy(&hi, v + 16, 16);
		nf_vi8 o = lo | hi, e = (lo == (int8_t)(K + 1)) | (hi == (int8_t)(K + 1));
		uint64_t ou[2], eu[2];
		memcpy(ou, &o, 16);
		memcpy(eu, &e, 16);
		bool any = (ou[0] | ou[1]) != 0, plus = (eu[0] | eu[1]) != 0;
		if (t->type == NF_DTYPE_Q4_0) {
			struct nf_block_q4_0 *y = (struct nf_block_q4_0 *)dst + b;
			/* d = -delta when the block's extreme is +8: q = 8 - k */
			uint8_t q[NF_QK];
			y->d = !any ? nf_fp32_to_fp16(-0.0f) : plus ? d_neg : d_pos;
			if (plus)
				for (int i = 0; i < NF_QK; i++)
					q[i] = (uint8_t)(8 - v[i]);
			else
				for (int i = 0; i < NF_QK; i++)
					q[i] = (uint8_t)(v[i] + 8);
			for (int i = 0; i < NF_QK / 2; i++)
				y->qs[i] = (uint8_t)(q[i] | (q[NF_QK / 2 + i] << 4));
		} else {
			struct nf_block_q8_0 *y = (struct nf_block_q8_0 *)dst + b;
			y->d = any ? d_pos : 0;
			memcpy(y->qs, v, NF_QK);
		}
	}
}

/* Row `row` of tensor t as floats (t->ne[0] values). tmp: >= n_ff + n_embd floats. */
static void gen_row(const struct gen *g, const struct tdesc *t, uint64_t row, float *out,
		    float *tmp)
{
	const struct nf_synth_params *p = g->p;
	const uint32_t d = g->d, nt = g->n_tok, R = g->R;
	const uint64_t n = t->ne[0];
	const uint32_t e = (uint32_t)(row / t->ne[1]);
	const uint64_t j = row % t->ne[1];
	const uint64_t key = stream_key(p->seed, t->kind == K_DOWN_T ? K_DOWN : t->kind, t->layer, e);
	const float sq3 = 1.7320508f;
	struct expert_state *x = &g->ex[e < g->n_exp ? e : 0];

	switch (t->kind) {
	case K_EMBD:
		fill_uniform(key, row * (n / 2), out, n, sq3);
		out[NF_SYNTH_BIAS_CHANNEL] = NF_SYNTH_BIAS_VALUE;
		return;
	case K_OUTPUT: case K_Q: case K_K: case K_V: case K_O: case K_DOWN: case K_DOWN_T:
		grid_floats(g, t, row, out, tmp);
		return;
	case K_NORM:
		for (uint64_t i = 0; i < n; i++)
			out[i] = 1.0f;
		return;
	case K_ROUTER:
		fill_uniform(key, row * (n / 2), out, n, sq3 / sqrtf((float)d));
		for (uint64_t c = 0; c < n; c++)
			if (is_reserved(g, c))
				out[c] = 0;
		return;
	case K_GATE:
		gate_row(g, x, (uint32_t)j, out, tmp);
		return;
	case K_UP:
		if (p->act == NF_SYNTH_ACT_DRELU) {
			/* Reads only the token channels (unit norm) and the bias. */
			memset(out, 0, n * sizeof(float));
			fill_uniform(key, j * (nt / 2), out + NF_SYNTH_TOK_BEGIN, nt, sq3);
			double ss = 0;
			for (uint32_t c = 0; c < nt; c++)
				ss += (double)out[NF_SYNTH_TOK_BEGIN + c] * out[NF_SYNTH_TOK_BEGIN + c];
			float s = (float)(1.0 / sqrt(ss));
			for (uint32_t c = 0; c < nt; c++)
				out[NF_SYNTH_TOK_BEGIN + c] *= s;
			out[NF_SYNTH_BIAS_CHANNEL] = x->ubias[j];
			return;
		}
		grid_floats(g, t, row, out, tmp);
		return;
	case K_FC1: {
		/* [A; e_bias; -A; -e_bias] / 127: ReLU of it carries A h both ways. */
		memset(out, 0, n * sizeof(float));
		uint64_t k = j % (R + 1);
		float sign = j < R + 1 ? 1.0f : -1.0f;
		if (k == R) {
			out[NF_SYNTH_BIAS_CHANNEL] = sign;
			return;
		}
		for (uint32_t c = 0; c < nt; c++)
			out[NF_SYNTH_TOK_BEGIN + c] = sign * x->A[k * nt + c] / 127.0f;
		return;
	}
	case K_FC2: {
		/* [B s 127, gbias, -B s 127, -gbias]: fc2 ReLU(fc1 h) = gate row . h */
		const float *b = x->B + j * R;
		float s = x->scale[j] * 127.0f;
		for (uint32_t k = 0; k < R; k++) {
			out[k] = b[k] * s;
			out[R + 1 + k] = -b[k] * s;
		}
		out[R] = x->gbias[j];
		out[2 * R + 1] = -x->gbias[j];
		return;
	}
	default:
		memset(out, 0, n * sizeof(float));
		return;
	}
}

/* ---- calibration pre-pass ---------------------------------------------- */

/*
 * sigma_e: rms of the token-channel embedding values as the file stores
 * them (after quantization), over up to 4096 token rows. The threshold:
 * the predictor computes the exact low-rank gate; the file's gate differs
 * by its quantization error E (and the activation rounding), so a neuron
 * whose exact score is a little below zero may still fire. The threshold
 * sits 2.5 standard deviations of that error (sigma_e * ||E_j||, rms over
 * sampled rows) below zero, plus 1% of sigma_e for fp16 rounding in the
 * predictor itself.
 */
static int calibrate(struct gen *g, uint32_t *perm)
{
	const struct nf_synth_params *p = g->p;
	const uint32_t d = g->d, nt = g->n_tok;
	size_t rb = nf_dtype_row_size(p->dtype, d);
	float *row = malloc(d * sizeof(float)), *deq = malloc(d * sizeof(float));
	float *tmp = malloc((d + p->n_ff) * sizeof(float));
	void *q = malloc(rb);
	int rc = -ENOMEM;
	if (!row || !deq || !tmp || !q)
		goto out;
	struct tdesc emb = { .type = p->dtype, .n_dims = 2, .ne = { d, p->n_vocab, 1 },
			     .kind = K_EMBD, .layer = LAYER_GLOBAL };
	uint32_t nrows = p->n_vocab < 4096 ? p->n_vocab : 4096;
	double ss = 0;
	for (uint32_t t = 0; t < nrows; t++) {
		gen_row(g, &emb, t, row, tmp);
		nf_synth_quantize_row(p->dtype, row, q, d);
		nf_dequantize_row(p->dtype, q, deq, d);
		for (uint32_t c = 0; c < nt; c++)
			ss += (double)deq[NF_SYNTH_TOK_BEGIN + c] * deq[NF_SYNTH_TOK_BEGIN + c];
	}
	g->sigma_e = (float)sqrt(ss / ((double)nrows * nt));

	gen_layer(g, 0, perm);
	uint32_t ng = p->n_ff < 256 ? p->n_ff : 256;
	double es = 0;
	for (uint32_t j = 0; j < ng; j++) {
		gate_row(g, &g->ex[0], j, row, tmp);
		nf_synth_quantize_row(p->dtype, row, q, d);
		nf_dequantize_row(p->dtype, q, deq, d);
		for (uint32_t c = 0; c < nt; c++) {
			double e = (double)deq[NF_SYNTH_TOK_BEGIN + c] - row[NF_SYNTH_TOK_BEGIN + c];
			es += e * e;
		}
	}
	double eps_w = sqrt(es / ng);
	/* Activation rounding: Q8_0 (quantized weights) or fp16 (F16 weights):
	 * relative std of the rounding error of a uniform block. */
	double eps_a = 0;
	if (p->dtype == NF_DTYPE_Q4_0 || p->dtype == NF_DTYPE_Q8_0)
		eps_a = 1.0 / 127.0 / sqrt(12.0) * sqrt(3.0);
	else if (p->dtype == NF_DTYPE_F16)
		eps_a = 1.0 / 2048.0;
	g->threshold = (float)(-g->sigma_e * (2.5 * sqrt(eps_w * eps_w + eps_a * eps_a) + 0.01));
	rc = 0;
out:
	free(row);
	free(deq);
	free(tmp);
	free(q);
	return rc;
}

/* ---- header -------------------------------------------------------------- */

static uint32_t file_type(uint32_t dtype)
{
	switch (dtype) {
	case NF_DTYPE_F16: return 1;
	case NF_DTYPE_Q4_0: return 2;
	case NF_DTYPE_Q8_0: return 7;
	default: return 0;
	}
}

/* SentencePiece-style byte vocabulary: <unk> <s> </s>, the 256 byte tokens,
 * then printable ASCII pieces, then unused fillers. */
static int write_byte_vocab(struct nf_gguf_writer *w, uint32_t n)
{
	char **tok = calloc(n, sizeof(char *));
	float *score = calloc(n, sizeof(float));
	int32_t *type = calloc(n, sizeof(int32_t));
	char *names = calloc(n, 20);
	int rc = -ENOMEM;
	if (!tok || !score || !type || !names)
		goto out;
	for (uint32_t i = 0; i < n; i++) {
		char *s = names + (size_t)i * 20;
		tok[i] = s;
		if (i == 0) {
			strcpy(s, "<unk>");
			type[i] = 2;
		} else if (i == 1 || i == 2) {
			strcpy(s, i == 1 ? "<s>" : "</s>");
			type[i] = 3;
		} else if (i < 259) {
			snprintf(s, 20, "<0x%02X>", i - 3);
			type[i] = 6;
		} else if (i < 259 + 94) {
			s[0] = (char)('!' + (i - 259));
			s[1] = 0;
			type[i] = 1;
			score[i] = -(float)(i - 259);
		} else if (i == 259 + 94) {
			strcpy(s, "\xe2\x96\x81"); /* U+2581, SentencePiece's space */
			type[i] = 1;
			score[i] = 0;
		} else {
			snprintf(s, 20, "<unused%u>", i);
			type[i] = 5;
		}
	}
	if ((rc = nf_gguf_writer_kv_str(w, "tokenizer.ggml.model", "llama")) < 0 ||
	    (rc = nf_gguf_writer_kv_arr_str(w, "tokenizer.ggml.tokens",
					    (const char *const *)tok, n)) < 0 ||
	    (rc = nf_gguf_writer_kv_arr_f32(w, "tokenizer.ggml.scores", score, n)) < 0 ||
	    (rc = nf_gguf_writer_kv_arr_i32(w, "tokenizer.ggml.token_type", type, n)) < 0 ||
	    (rc = nf_gguf_writer_kv_u32(w, "tokenizer.ggml.bos_token_id", 1)) < 0 ||
	    (rc = nf_gguf_writer_kv_u32(w, "tokenizer.ggml.eos_token_id", 2)) < 0 ||
	    (rc = nf_gguf_writer_kv_u32(w, "tokenizer.ggml.unknown_token_id", 0)) < 0 ||
	    (rc = nf_gguf_writer_kv_bool(w, "tokenizer.ggml.add_bos_token", true)) < 0 ||
	    (rc = nf_gguf_writer_kv_bool(w, "tokenizer.ggml.add_eos_token", false)) < 0)
		goto out;
out:
	free(tok);
	free(score);
	free(type);
	free(names);
	return rc;
}

static int copy_vocab(struct nf_gguf_writer *w, const struct nf_synth_params *p,
		      struct nf_diag *d)
{
	struct nf_gguf *v = NULL;
	const struct nf_gguf_kv *toks;
	int rc = nf_gguf_open(p->vocab_path, 0, &v, d);
	if (rc < 0)
		return rc;
	if (nf_gguf_get_arr(v, "tokenizer.ggml.tokens", &toks) < 0) {
		rc = nf_diag_fail(d, NF_EFORMAT, "%s: no tokenizer.ggml.tokens", p->vocab_path);
		goto out;
	}
	if (toks->arr_n != p->n_vocab) {
		rc = nf_diag_fail(d, NF_EUSAGE,
				  "--vocab: %u does not match the %llu tokens of %s", p->n_vocab,
				  (unsigned long long)toks->arr_n, p->vocab_path);
		goto out;
	}
	for (size_t i = 0; i < nf_gguf_n_kv(v); i++) {
		const struct nf_gguf_kv *kv = nf_gguf_kv_at(v, i);
		if (strncmp(kv->key, "tokenizer.", 10))
			continue;
		if ((rc = nf_gguf_writer_kv_copy(w, kv)) < 0) {
			rc = nf_diag_fail(d, rc, "copying %s from %s", kv->key, p->vocab_path);
			goto out;
		}
	}
	rc = 0;
out:
	nf_gguf_close(v);
	return rc;
}

static int write_header(struct nf_gguf_writer *w, const struct nf_synth_params *p,
			const struct gen *g, struct nf_diag *d)
{
	char name[128];
	int rc;
	snprintf(name, sizeof(name), "nflash-synth %s %s %s sparsity %.3f skew %.2f seed %llu",
		 p->shape ? p->shape : "custom", nf_synth_act_name(p->act),
		 nf_dtype_name(p->dtype), p->sparsity, p->skew, (unsigned long long)p->seed);
#define KV(call) do { if ((rc = (call)) < 0) goto fail; } while (0)
	KV(nf_gguf_writer_kv_str(w, "general.architecture", "llama"));
	KV(nf_gguf_writer_kv_str(w, "general.name", name));
	KV(nf_gguf_writer_kv_u32(w, "llama.context_length", p->n_ctx));
	KV(nf_gguf_writer_kv_u32(w, "llama.embedding_length", p->n_embd));
	KV(nf_gguf_writer_kv_u32(w, "llama.block_count", p->n_layer));
	KV(nf_gguf_writer_kv_u32(w, "llama.feed_forward_length", p->n_ff));
	KV(nf_gguf_writer_kv_u32(w, "llama.rope.dimension_count", p->n_embd / p->n_head));
	KV(nf_gguf_writer_kv_u32(w, "llama.attention.head_count", p->n_head));
	KV(nf_gguf_writer_kv_u32(w, "llama.attention.head_count_kv", p->n_head_kv));
	KV(nf_gguf_writer_kv_f32(w, "llama.attention.layer_norm_rms_epsilon", p->rms_eps));
	KV(nf_gguf_writer_kv_f32(w, "llama.rope.freq_base", p->rope_base));
	if (p->n_expert) {
		KV(nf_gguf_writer_kv_u32(w, "llama.expert_count", p->n_expert));
		KV(nf_gguf_writer_kv_u32(w, "llama.expert_used_count", p->n_expert_used));
	}
	KV(nf_gguf_writer_kv_u32(w, "llama.vocab_size", p->n_vocab));
	KV(nf_gguf_writer_kv_u32(w, "general.file_type", file_type(p->dtype)));
	if (p->predictor)
		KV(nf_gguf_writer_kv_f32(w, "powerinfer.sparse_threshold", g->threshold));
	KV(nf_gguf_writer_kv_str(w, "nflash.ffn_activation", nf_synth_act_name(p->act)));
	KV(nf_gguf_writer_kv_u64(w, "nflash.synth.seed", p->seed));
	KV(nf_gguf_writer_kv_f32(w, "nflash.synth.sparsity", (float)p->sparsity));
	KV(nf_gguf_writer_kv_f32(w, "nflash.synth.skew", (float)p->skew));
	KV(nf_gguf_writer_kv_u32(w, "nflash.synth.gate_rank", g->R));
	KV(nf_gguf_writer_kv_u32(w, "nflash.synth.bias_channel", NF_SYNTH_BIAS_CHANNEL));
	KV(nf_gguf_writer_kv_u32(w, "nflash.synth.token_channel_begin", NF_SYNTH_TOK_BEGIN));
	KV(nf_gguf_writer_kv_u32(w, "nflash.synth.token_channel_count", g->n_tok));
	if (p->vocab_path) {
		if ((rc = copy_vocab(w, p, d)) < 0)
			return rc;
	} else {
		KV(write_byte_vocab(w, p->n_vocab));
	}
#undef KV
	return 0;
fail:
	return nf_diag_fail(d, rc, "writing the GGUF header: %s", nf_strerror(rc));
}

/* ---- streaming ------------------------------------------------------------ */

struct chunk_job {
	struct gen *g;
	const struct tdesc *t;
	uint64_t row0, row1;
	size_t row_bytes;
	uint8_t *dst;         /* the chunk buffer; row row0 at offset 0 */
	float *row, *tmp;     /* per-thread scratch */
};

static void *chunk_work(void *arg)
{
	struct chunk_job *j = arg;
	const bool direct = is_grid(j->g, j->t->kind) &&
			    (j->t->type == NF_DTYPE_Q4_0 || j->t->type == NF_DTYPE_Q8_0);
	for (uint64_t r = j->row0; r < j->row1; r++) {
		if (direct) {
			grid_encode(j->g, j->t, r, j->dst + (r - j->row0) * j->row_bytes,
				    (int8_t *)j->tmp);
			continue;
		}
		gen_row(j->g, j->t, r, j->row, j->tmp);
		nf_synth_quantize_row(j->t->type, j->row, j->dst + (r - j->row0) * j->row_bytes,
				j->t->ne[0]);
	}
	return NULL;
}

/* The writer thread: writes one buffer while the next one is generated. */
struct wq {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct nf_gguf_writer *w;
	const uint8_t *buf;   /* pending buffer, NULL when idle */
	size_t len;
	bool stop;
	int err;
};

static void *writer_main(void *arg)
{
	struct wq *q = arg;
	pthread_mutex_lock(&q->mu);
	for (;;) {
		while (!q->buf && !q->stop)
			pthread_cond_wait(&q->cv, &q->mu);
		if (!q->buf)
			break;
		const uint8_t *b = q->buf;
		size_t n = q->len;
		pthread_mutex_unlock(&q->mu);
		int rc = q->err ? 0 : nf_gguf_writer_write(q->w, b, n);
		pthread_mutex_lock(&q->mu);
		if (rc < 0 && !q->err)
			q->err = rc;
		q->buf = NULL;
		pthread_cond_broadcast(&q->cv);
	}
	pthread_mutex_unlock(&q->mu);
	return NULL;
}

/* Wait until the writer is idle; returns its sticky error. */
static int wq_wait(struct wq *q)
{
	pthread_mutex_lock(&q->mu);
	while (q->buf)
		pthread_cond_wait(&q->cv, &q->mu);
	int err = q->err;
	pthread_mutex_unlock(&q->mu);
	return err;
}

static void wq_post(struct wq *q, const uint8_t *buf, size_t len)
{
	pthread_mutex_lock(&q->mu);
	q->buf = buf;
	q->len = len;
	pthread_cond_broadcast(&q->cv);
	pthread_mutex_unlock(&q->mu);
}

int nf_synth_write(const struct nf_synth_params *p, const char *path, struct nf_diag *d)
{
	struct tlist tl = { 0 };
	struct gen g;
	struct nf_gguf_writer *w = NULL;
	struct wq q = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };
	pthread_t writer;
	bool writer_up = false;
	uint8_t *buf[2] = { NULL, NULL };
	uint32_t *perm = NULL;
	int nth = p->n_threads;
	struct chunk_job *jobs = NULL;
	float *scratch = NULL;
	int rc;

	if ((rc = nf_synth_validate(p, d)) < 0)
		return rc;
	if ((rc = gen_init(&g, p)) < 0) {
		gen_free(&g);
		return nf_diag_fail(d, rc, "out of memory for the layer state");
	}
	rc = -ENOMEM;
	size_t scratch_len = (size_t)p->n_ff + p->n_embd + p->pred_rank + 64;
	perm = malloc(p->n_ff * sizeof(uint32_t));
	jobs = calloc((size_t)nth, sizeof(*jobs));
	scratch = malloc((size_t)nth * 2 * scratch_len * sizeof(float));
	buf[0] = malloc(CHUNK_BYTES);
	buf[1] = malloc(CHUNK_BYTES);
	if (!perm || !jobs || !scratch || !buf[0] || !buf[1]) {
		nf_diag_fail(d, rc, "out of memory for chunk buffers");
		goto cleanup;
	}
	if ((rc = build_tensors(p, &tl)) < 0 || (rc = calibrate(&g, perm)) < 0) {
		nf_diag_fail(d, rc, "building the tensor list: %s", nf_strerror(rc));
		goto cleanup;
	}
	if ((rc = nf_gguf_writer_open(path, p->predictor, &w, d)) < 0)
		goto cleanup;
	if ((rc = write_header(w, p, &g, d)) < 0)
		goto cleanup;
	for (size_t i = 0; i < tl.n; i++) {
		const struct tdesc *t = &tl.t[i];
		if ((rc = nf_gguf_writer_tensor(w, t->name, t->type, t->n_dims, t->ne)) < 0) {
			nf_diag_fail(d, rc, "declaring tensor %s", t->name);
			goto cleanup;
		}
	}
	q.w = w;
	if ((rc = -pthread_create(&writer, NULL, writer_main, &q)) < 0) {
		nf_diag_fail(d, rc, "starting the writer thread");
		goto cleanup;
	}
	writer_up = true;

	uint64_t total = 0, done = 0;
	for (size_t i = 0; i < tl.n; i++)
		total += tensor_bytes(&tl.t[i]);
	int cur = 0;
	for (size_t i = 0; i < tl.n; i++) {
		const struct tdesc *t = &tl.t[i];
		if (t->layer != LAYER_GLOBAL && t->layer != g.layer)
			gen_layer(&g, t->layer, perm);
		size_t row_bytes = nf_dtype_row_size(t->type, t->ne[0]);
		uint64_t rows = t->ne[1] * t->ne[2];
		uint64_t per_chunk = CHUNK_BYTES / row_bytes;
		if (per_chunk < 1) {
			rc = nf_diag_fail(d, NF_EUSAGE, "%s: a row is larger than the chunk", t->name);
			goto cleanup;
		}
		for (uint64_t r0 = 0; r0 < rows; r0 += per_chunk) {
			uint64_t r1 = r0 + per_chunk < rows ? r0 + per_chunk : rows;
			uint64_t n = r1 - r0, step = (n + nth - 1) / nth;
			pthread_t tid[256];
			bool started[256] = { false };
			for (int k = 0; k < nth; k++) {
				struct chunk_job *j = &jobs[k];
				j->g = &g;
				j->t = t;
				j->row0 = r0 + k * step < r1 ? r0 + k * step : r1;
				j->row1 = j->row0 + step < r1 ? j->row0 + step : r1;
				j->row_bytes = row_bytes;
				j->dst = buf[cur] + (j->row0 - r0) * row_bytes;
				j->row = scratch + (size_t)k * 2 * scratch_len;
				j->tmp = j->row + scratch_len;
				if (k > 0 && j->row1 > j->row0 &&
				    pthread_create(&tid[k], NULL, chunk_work, j) == 0) {
					started[k] = true;
					continue;
				}
				if (k > 0 && j->row1 > j->row0)
					chunk_work(j); /* could not start a thread: do it here */
			}
			chunk_work(&jobs[0]);
			for (int k = 1; k < nth; k++)
				if (started[k])
					pthread_join(tid[k], NULL);
			if ((rc = wq_wait(&q)) < 0) {
				nf_diag_fail(d, rc, "writing %s: %s", path, nf_strerror(rc));
				goto cleanup;
			}
			wq_post(&q, buf[cur], n * row_bytes);
			cur ^= 1;
			done += n * row_bytes;
			if (p->progress)
				p->progress(p->progress_arg, done, total);
		}
	}
	if ((rc = wq_wait(&q)) < 0) {
		nf_diag_fail(d, rc, "writing %s: %s", path, nf_strerror(rc));
		goto cleanup;
	}
	pthread_mutex_lock(&q.mu);
	q.stop = true;
	pthread_cond_broadcast(&q.cv);
	pthread_mutex_unlock(&q.mu);
	pthread_join(writer, NULL);
	writer_up = false;
	rc = nf_gguf_writer_finish(w, d);
	w = NULL;
cleanup:
	if (writer_up) {
		wq_wait(&q);
		pthread_mutex_lock(&q.mu);
		q.stop = true;
		pthread_cond_broadcast(&q.cv);
		pthread_mutex_unlock(&q.mu);
		pthread_join(writer, NULL);
	}
	nf_gguf_writer_abort(w);
	free(buf[0]);
	free(buf[1]);
	free(scratch);
	free(jobs);
	free(perm);
	free(tl.t);
	gen_free(&g);
	return rc;
}
