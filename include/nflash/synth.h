/*
 * nflash/synth.h - synthetic sparse LLaMA-family models, written as GGUF.
 *
 * Real ReLU-sparse models cannot be downloaded everywhere, yet benchmarks and
 * end-to-end tests need models whose FFN activations are sparse the way real
 * ones are. This module writes such models: LLaMA-architecture (optionally
 * Mixtral-style MoE) GGUF files whose FFN neurons fire because their actual
 * gate pre-activation, computed from the actual hidden state, is positive.
 * docs/SYNTH.md explains the construction; in short:
 *
 *  - channel 0 of the residual stream is a constant (set by the embeddings,
 *    written by no layer); gate rows read it as a per-neuron bias;
 *  - channels [tok_begin, tok_begin + n_tok) carry the token's features,
 *    also written by no layer; gates read only those and channel 0, so the
 *    sign of a gate pre-activation is a function of the token, which makes
 *    firing probabilities exactly calibratable (RMSNorm, uniform norm
 *    weights and the Q8_0 activation rounding keep the sign);
 *  - per-neuron firing probabilities follow a power law of exponent skew,
 *    scaled so that the mean is 1 - sparsity; hot neurons are scattered
 *    over the layer by a seeded permutation;
 *  - each gate matrix is low rank on purpose (gate = B * A), so PowerInfer's
 *    predictor fc1 = [A; -A], fc2 = [B, -B] reproduces its sign.
 *
 *	struct nf_synth_params p;
 *	struct nf_diag d = {0};
 *	nf_synth_params_init(&p);
 *	if (nf_synth_shape(&p, "7b", &d) == 0 && nf_synth_validate(&p, &d) == 0)
 *		rc = nf_synth_write(&p, "model.gguf", &d);
 *
 * Output is deterministic: the same parameters give the same bytes, whatever
 * the number of threads (every value is a function of the seed and its
 * position; the low-rank gate is computed exactly on integers).
 *
 * Thread-safety: the functions are reentrant; nf_synth_write uses
 * p->n_threads threads of its own internally.
 */
#ifndef NFLASH_SYNTH_H
#define NFLASH_SYNTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"

#ifdef __cplusplus
extern "C" {
#endif

enum nf_synth_act {
	NF_SYNTH_ACT_RELU,   /* relu(gate) * up */
	NF_SYNTH_ACT_DRELU,  /* relu(gate) * relu(up) */
	NF_SYNTH_ACT_SILU,   /* silu(gate) * up; "firing" means gate > 0 */
};

/* Channel 0 of the residual stream is the constant bias channel; the token
 * feature channels start at the next quant block so that the bias sits
 * alone in its block (Q4_0/Q8_0 then store it exactly). */
#define NF_SYNTH_BIAS_CHANNEL 0u
#define NF_SYNTH_TOK_BEGIN 32u
/* Value of the bias channel in every embedding row. */
#define NF_SYNTH_BIAS_VALUE 8.0f

struct nf_synth_params {
	const char *shape;          /* "tiny", "7b", ... or "custom" (informational) */
	uint32_t n_embd, n_ff, n_layer, n_head, n_head_kv;
	uint32_t n_expert, n_expert_used; /* 0, 0 for a dense model */
	uint32_t n_vocab, n_ctx;
	float rope_base, rms_eps;
	enum nf_synth_act act;
	double sparsity;            /* share of neurons that do NOT fire per token, (0,1) */
	double skew;                /* power-law exponent of firing probability by rank, >= 0 */
	uint32_t dtype;             /* enum nf_dtype of the 2-D weights */
	uint64_t seed;
	bool predictor;             /* PowerInfer flavour (PWRI, fc1/fc2, ffn_down_t) */
	uint32_t pred_rank;         /* fc1 output width r: even, >= 4; gate rank is r/2 - 1 */
	const char *vocab_path;     /* GGUF whose tokenizer.* keys are copied, or NULL: byte-level */
	int n_threads;              /* generation threads, >= 1 */
	/* Called after each chunk of tensor data with bytes written so far. */
	void (*progress)(void *arg, uint64_t done, uint64_t total);
	void *progress_arg;
};

/* nf_synth_params_init - defaults: tiny shape, relu, sparsity 0.9, skew 1,
 * f32, seed 1, predictor on, r = 64, 1 thread. */
void nf_synth_params_init(struct nf_synth_params *p);

/* The LLaMA-2 SentencePiece vocabulary (32000 tokens) the 7b, 13b and
 * mixtral-8x7b shapes copy, relative to the repository root. */
#define NF_SYNTH_LLAMA_VOCAB "../shared/testdata/vocab/ggml-vocab-llama-spm.gguf"

/*
 * nf_synth_shape - set the dimensions and vocabulary of a named shape:
 * "tiny", "7b", "13b", "mixtral-8x7b"; "custom" keeps the current
 * dimensions. Shapes with the 32000-token LLaMA vocabulary set vocab_path
 * to NF_SYNTH_LLAMA_VOCAB (a constant; the caller may point it elsewhere),
 * tiny sets it to NULL (byte-level). Returns 0, or NF_EUSAGE naming the
 * shape.
 */
int nf_synth_shape(struct nf_synth_params *p, const char *name, struct nf_diag *d);

/*
 * nf_synth_validate - check the parameters: dimensions multiples of the
 * quant block (32 for every type, since the construction aligns channel
 * groups to blocks), heads dividing n_embd, sparsity in (0,1), ...
 * Returns 0 or NF_EUSAGE with a message naming the flag (--dim, --ffn,
 * --sparsity, ...).
 */
int nf_synth_validate(const struct nf_synth_params *p, struct nf_diag *d);

/* Number of token-feature channels for a model of width n_embd. */
uint32_t nf_synth_n_tok(uint32_t n_embd);

/* Bytes of tensor data nf_synth_write will write (for progress and df checks). */
uint64_t nf_synth_data_bytes(const struct nf_synth_params *p);

/*
 * nf_synth_write - generate the model and write it to path (through the
 * GGUF writer's temporary file; nothing appears under path on failure).
 * Memory stays within one layer's construction state plus a few chunk
 * buffers. Returns 0 or a negative code with a message in d.
 */
int nf_synth_write(const struct nf_synth_params *p, const char *path, struct nf_diag *d);

/*
 * nf_synth_power_law - firing probabilities by rank: prob[k] = min(cap,
 * c * (k+1)^-skew) with c chosen so that the mean over n is mean; cap is
 * max(0.98, 1 - (1-mean)/4) (at most 0.999). Probabilities are clamped to
 * [1e-6, cap]. Returns 0, or NF_EUSAGE if mean is not in (0,1).
 */
int nf_synth_power_law(double *prob, size_t n, double mean, double skew);

/* nf_synth_probit - inverse of the standard normal CDF, p in (0,1). */
double nf_synth_probit(double p);

/* nf_synth_quantize_row - nf_quantize_row with the same bytes, faster for
 * Q4_0 and Q8_0 (what the generator uses). */
void nf_synth_quantize_row(uint32_t type, const float *src, void *dst, size_t n);

/* Name of an activation ("relu", "drelu", "silu"); parse returns -1 if unknown. */
const char *nf_synth_act_name(enum nf_synth_act a);
int nf_synth_act_parse(const char *s);

/* ---- measuring sparsity ----------------------------------------------------
 *
 * An accumulator of per-token firing masks, layer by layer, from which the
 * report's statistics are derived. Whoever runs the model (the report, a
 * test) feeds it; it knows nothing of how firing was measured.
 *
 *	struct nf_synth_stats *s;
 *	nf_synth_stats_open(n_layer, n_ff, &s);
 *	for each token, for each layer:
 *		nf_synth_stats_add(s, layer, fired, predicted, n_ff);
 *	nf_synth_stats_layer(s, layer, &ls);
 *	nf_synth_stats_close(s);
 *
 * Not thread-safe: one thread feeds it.
 */
struct nf_synth_stats;

struct nf_synth_layer_stats {
	uint64_t tokens;
	double sparsity;     /* 1 - mean fired / computed neurons */
	double top1_share;   /* share of all firings by the 1% most frequent neurons */
	double top10_share;
	double top20_share;
	double overlap;      /* mean |A_t & A_t-1| / |A_t| over consecutive tokens */
	double recall;       /* |fired & predicted| / |fired| (NAN without predictions) */
	double precision;    /* |fired & predicted| / |predicted| (NAN without predictions) */
	double skew;         /* fitted power-law exponent of firing frequency by rank */
};

/* n_neurons: neurons per layer (n_expert * n_ff for MoE). 0 or -ENOMEM. */
int nf_synth_stats_open(uint32_t n_layer, uint32_t n_neurons, struct nf_synth_stats **out);
void nf_synth_stats_close(struct nf_synth_stats *s);
/*
 * One token's masks for one layer: fired[i], predicted[i] are 0/1 bytes
 * over the layer's neurons (predicted may be NULL); n_computed is how many
 * neurons the token could fire (U * n_ff for MoE: only routed experts).
 * Call layers of a token in any order, tokens in sequence.
 */
void nf_synth_stats_add(struct nf_synth_stats *s, uint32_t layer, const uint8_t *fired,
			const uint8_t *predicted, uint32_t n_computed);
void nf_synth_stats_layer(const struct nf_synth_stats *s, uint32_t layer,
			  struct nf_synth_layer_stats *out);

/*
 * nf_synth_fit_skew - least-squares slope of -log(freq) against log(rank)
 * over neurons whose frequency (count / tokens) is in [0.01, 0.5], the
 * part of the curve neither capped nor lost in sampling noise. NAN if
 * fewer than 8 such neurons.
 */
double nf_synth_fit_skew(const uint64_t *counts, size_t n, uint64_t tokens);

/* The i-th token of the report's seeded random stream: uniform over
 * [3, n_vocab) (no <unk>, <s>, </s>), a function of (seed, i). */
int32_t nf_synth_token(uint64_t seed, uint64_t i, uint32_t n_vocab);

/* ---- the report -------------------------------------------------------------- */

struct nf_synth_report_opts {
	uint32_t n_tokens;    /* tokens of the stream, >= 2 */
	uint64_t seed;        /* of the token stream (nf_synth_token) */
	int n_threads;        /* compute threads (0: all CPUs) */
	uint32_t window;      /* tokens per sequence (0: min(context length, 256)); the
			       * KV cache is reset between windows */
	void (*progress)(void *arg, uint64_t done, uint64_t total);
	void *progress_arg;
};

struct nf_synth_report {
	uint32_t n_layer, n_neurons;  /* neurons per layer (all experts) */
	uint64_t tokens;
	bool predictor;               /* the file has fc1/fc2 */
	float threshold;
	const char *act;              /* activation the runtime applied (static) */
	struct nf_synth_layer_stats *layers;   /* n_layer, owned */
	struct nf_synth_layer_stats mean;      /* means over layers */
};

/*
 * nf_synth_report_run - load the model at path (any LLaMA-family GGUF the
 * runtime loads: synthetic, llama.cpp or PowerInfer), run it densely over
 * o->n_tokens tokens of the seeded random stream (uniform ids in
 * [3, n_vocab), in windows of o->window tokens), and measure in every FFN
 * call which neurons fire (gate pre-activation > 0; for dReLU also up > 0)
 * and, if the file has predictors, which ones PowerInfer's predictor
 * selects (fc2 . ReLU(fc1 . resid) >= powerinfer.sparse_threshold, on the
 * residual entering the FFN block). For MoE, only routed experts count.
 * Returns 0 and fills *out (free with nf_synth_report_free), or a negative
 * code with a message in d.
 */
int nf_synth_report_run(const char *path, const struct nf_synth_report_opts *o,
			struct nf_synth_report *out, struct nf_diag *d);
void nf_synth_report_free(struct nf_synth_report *r);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_SYNTH_H */
