/*
 * nflash/sparse.h - the sparse FFN: computes only the neurons a token
 * activates, from neuron bundles served in memory or by the segmented cache
 * (nflash/cache.h), through the model's FFN seam (nf_ctx_set_ffn).
 *
 * Modes (enum nf_sparse_mode):
 *  - PREDICTOR: PowerInfer's fc1/fc2 predictor reads the residual entering
 *    the FFN block; neuron j is computed iff fc2 . relu(fc1 . resid) >= the
 *    threshold. Only predicted neurons contribute, computed exactly as
 *    PowerInfer does (docs/PIPELINE.md): every product's input rounded to
 *    the weight's dot type, the activation vector fed to a F16 down rounded
 *    to fp16, to a quantized down quantized to Q8_0 along n_ff (per 32
 *    neurons: a data dependency of that group, not a barrier).
 *  - EXACT: ReLU/dReLU without a predictor: gate rows first, then up and
 *    down only for neurons whose gate is > 0 (dReLU: and up > 0). Equals
 *    the dense output up to summation order.
 *  - DENSE: every neuron through the same path (SiLU models).
 *
 * Work unit: a chunk of consecutive 32-neuron groups (a group is one Q8_0
 * block of the activation vector), closed once it holds 64 active neurons;
 * chunk bounds depend on the layer's masks only. Workers of the context's
 * pool take chunks as they become ready (all in memory: at once; from a
 * cache: when their last pending bundle lands), compute gate/up, the
 * activations and the down contributions of the chunk as one unit, into
 * that chunk's output row; the rows are summed in chunk order when every
 * chunk of the layer is done, so the result does not depend on thread
 * count or read completion order.
 *
 *	struct nf_sparse_params sp;
 *	nf_sparse_params_init(&sp);
 *	sp.mode = NF_SPARSE_AUTO;
 *	struct nf_sparse *s;
 *	if (nf_sparse_open(ctx, &sp, &s, &diag) < 0) ...
 *	nf_ctx_eval(ctx, ids, n);        // FFNs now run sparse
 *	nf_sparse_close(s);              // restores the built-in FFNs
 *
 * Everything forward() needs is allocated by nf_sparse_open(); nothing on
 * the eval path allocates. MoE layers keep the built-in FFN (not yet sparse).
 *
 * Thread-safety: one engine per context; used by the context's thread.
 */
#ifndef NFLASH_SPARSE_H
#define NFLASH_SPARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_ctx;
struct nf_cache;

enum nf_sparse_mode {
	NF_SPARSE_AUTO = 0,  /* predictor if the file has one, exact for ReLU/dReLU, else dense */
	NF_SPARSE_PREDICTOR,
	NF_SPARSE_EXACT,
	NF_SPARSE_DENSE,
	NF_SPARSE_OFF,       /* the built-in dense FFN (no engine) */
};

/* "auto", "predictor", "exact", "dense", "off". */
const char *nf_sparse_mode_name(enum nf_sparse_mode m);
/* Parse a name; -1 when unknown. */
int nf_sparse_mode_parse(const char *name);

struct nf_sparse_params {
	enum nf_sparse_mode mode;
	bool threshold_set;       /* use threshold instead of the file's */
	float threshold;
	/* FFN bytes from this cache (bundles of the store it reads); NULL:
	 * the model's in-memory weights. The cache must outlive the engine. */
	struct nf_cache *cache;
	/* Measure predictor recall (computes every gate: costs a dense gate
	 * pass per layer; in-memory only). */
	bool measure_recall;
	/* With a cache: fill its hot segment from the online counts after this
	 * many tokens, and again every 16 times as many (0: never). */
	uint32_t hot_after;
	/* With a cache: every NF_SPARSE_REPLAN_TOKENS tokens, move up to this
	 * many neurons that now fire clearly more than hot ones of their FFN
	 * from the cold segment into the hot one (nf_cache_rebalance: memcpy,
	 * no I/O), and halve the counts every NF_SPARSE_DECAY_TOKENS tokens,
	 * so the hot set follows the text (online re-planning; 0: off). */
	uint32_t replan_moves;
	/* With a cache, a mixture of experts in decode: as soon as layer L's
	 * reads are out, read ahead (nf_cache_prefetch) the neurons layer
	 * L+1's guessed experts would compute (layer L+1's router and those
	 * experts' predictors applied to layer L's FFN input; exact and dense
	 * experts: all their neurons), so that their reads overlap layer L's
	 * compute and layer L+1's attention. A dense FFN in predictor mode
	 * likewise (layer-ahead): layer L+1's predictor applied to layer L's
	 * FFN input, its predicted neurons read ahead. A wrong guess costs
	 * reads, never output bits. 1 on, 0 off (nf_sparse_params_init), -1
	 * the measured default: on for exact and dense experts and for a dense
	 * FFN, off for experts in predictor mode (docs/PIPELINE.md). */
	int route_prefetch;
	/* Layer-ahead stops for the rest of the run once, after its guesses
	 * of NF_SPARSE_AHEAD_WARM tokens, fewer than this share of the
	 * neurons it guessed were then computed: its wrong reads would cost
	 * more than its right ones save (0: NF_SPARSE_AHEAD_MIN_RIGHT). */
	float ahead_min_right;
	/* Exact mode from a cache whose store has every FFN's gate rows as an
	 * object (`nflash import --gate-objects`): per token and FFN read the
	 * gate rows whole, then only the bundles of neurons whose gate is
	 * positive (same output bits as exact mode; route_prefetch is then
	 * off). NF_EUSAGE when the mode is not exact or an object is missing. */
	bool gate_first;
	/* Predictor mode: record, per FFN, the predictor's hidden layer over
	 * the tokens it predicts for (their count, sum and sum of outer
	 * products; nf_sparse_pred_record): a calibration run's view of how
	 * the neurons' scores move together (nf_coact_embed). */
	bool record_moments;
};

/* Tokens between two re-planning steps, and between two halvings of the
 * cache's counts. */
#define NF_SPARSE_AHEAD_WARM 4u
#define NF_SPARSE_AHEAD_MIN_RIGHT 0.5f
#define NF_SPARSE_REPLAN_TOKENS 16u
#define NF_SPARSE_DECAY_TOKENS 64u

void nf_sparse_params_init(struct nf_sparse_params *p);

/* Counters since open (or the last reset). Times in seconds, summed over
 * FFN calls on the calling thread. */
struct nf_sparse_stats {
	uint64_t ffn_calls;       /* (layer, token) pairs */
	uint64_t neurons_total;   /* n_ff per call */
	uint64_t neurons_active;  /* computed */
	uint64_t groups_ready_now;    /* active groups whose chunk's bytes were all hits */
	uint64_t groups_ready_later;  /* active groups whose chunk waited for a read */
	double t_ffn;             /* wall time inside the sparse FFN */
	double t_wait;            /* of which the caller waited for reads with nothing to compute */
	double t_io;              /* per layer with misses: first submit to last completion, summed */
	uint64_t hot_loads;       /* hot segment refills */
	double t_hot;             /* spent refilling it (not in t_ffn) */
	/* recall: of the neurons that fire (gate > 0), how many were predicted */
	uint64_t recall_fired, recall_hit;
	/* a cold segment smaller than a layer's misses: a token's request
	 * split into windows of chunks, a batch halved */
	uint64_t windows, batch_splits;
	/* mixture of experts from a cache: tokens whose routed experts were
	 * requested together (all their misses in flight at once) */
	uint64_t moe_together;
	/* mixture of experts, decode: the next layer's router applied to this
	 * layer's FFN input guesses its experts (what a route-ahead prefetch
	 * would read); of route_guesses routed experts, route_guess_hits were
	 * guessed; with route_prefetch, route_prefetches guessed experts
	 * (a dense FFN: layers) were read ahead (the cache's stats count
	 * their reads and hits) */
	uint64_t route_guesses, route_guess_hits, route_prefetches;
	/* layer-ahead (a dense FFN): of ahead_guessed neurons guessed for the
	 * layers it read ahead, ahead_right were then computed; those layers
	 * computed ahead_needed; ahead_stopped: it stopped itself
	 * (ahead_min_right) */
	uint64_t ahead_guessed, ahead_right, ahead_needed;
	bool ahead_stopped;
	/* gate-first: gate-rows objects read, their bytes */
	uint64_t gate_reads, gate_bytes;
};

/* One expert (layer, expert) of a mixture of experts. */
struct nf_sparse_expert_stats {
	uint64_t routed;          /* tokens routed to it */
	uint64_t neurons_active;  /* neurons it computed, over those tokens */
	uint64_t lookups, hits;   /* from a cache: its neurons asked for, and found in memory */
};

struct nf_sparse;

/*
 * nf_sparse_open - build the engine for ctx's model and install it on
 * every dense layer. Returns 0 and *out, or NF_EUSAGE (mode PREDICTOR on a
 * model without fc1/fc2, EXACT on a SiLU model, cache geometry not matching
 * the model), NF_EUNSUPPORTED (a weight type with no bundle form), -ENOMEM;
 * diag says which. With mode OFF nothing is installed and *out is an engine
 * that only reports.
 */
int nf_sparse_open(struct nf_ctx *ctx, const struct nf_sparse_params *p, struct nf_sparse **out,
		   struct nf_diag *diag);
/* Per-expert statistics of a mixture of experts: n_layer x n_expert
 * entries, layer-major (index layer * n_expert + expert), since open or the
 * last nf_sparse_stats_reset; NULL for a dense model or mode OFF. */
const struct nf_sparse_expert_stats *nf_sparse_expert_stats(const struct nf_sparse *s);

/*
 * nf_sparse_pred_record - what record_moments gathered for FFN (layer,
 * expert) since open: the predictor's hidden layer z = ReLU(fc1 . resid)
 * of each token it predicted for (decode and batches alike; not the
 * layer-ahead guesses): *n tokens, sum[rank] of z and sq[rank * rank] of
 * z z^T (row-major). Returns the FFN's rank, or 0 (nothing recorded: not
 * asked, not predictor mode, no predictor in that layer).
 */
uint32_t nf_sparse_pred_record(const struct nf_sparse *s, uint32_t layer, uint32_t expert, uint64_t *n,
			       const double **sum, const double **sq);
/* FFN (layer, expert)'s fc2 as f32: rows[j * rank + i] is neuron j's
 * weight of hidden unit i, j < n_ff (rank: nf_sparse_pred_record's).
 * Returns 0, or NF_EUNSUPPORTED (no predictor, or a packed one). */
int nf_sparse_pred_fc2(const struct nf_sparse *s, uint32_t layer, uint32_t expert, float *rows);

/* Restores the built-in FFNs and frees. Accepts NULL. */
void nf_sparse_close(struct nf_sparse *s);

/* The mode in use (AUTO resolved). */
enum nf_sparse_mode nf_sparse_mode_of(const struct nf_sparse *s);
/* The threshold in use (predictor mode). */
float nf_sparse_threshold(const struct nf_sparse *s);
/* Bytes the engine allocated (tables, per-thread scratch). */
uint64_t nf_sparse_bytes(const struct nf_sparse *s);
/* The bytes nf_sparse_open would allocate for ctx's model reading bundles
 * of geometry g through a cache (the same arithmetic, nothing allocated):
 * what a budget must leave for the engine's tables and scratch. 0 when g's
 * type has no kernel. */
struct nf_cache_geom;
uint64_t nf_sparse_bytes_for(const struct nf_ctx *ctx, const struct nf_cache_geom *g);
/* The fewest cold slots the engine can run on for a store of geometry g:
 * one chunk of whole 256-neuron super-blocks (319) for K-quant QCOL downs,
 * else 1. Sizing code must not give a cache fewer. */
uint32_t nf_sparse_min_cold_slots(const struct nf_cache_geom *g);
/* The bytes gate-first exact mode adds (its gate-rows buffers) for ctx's
 * model over bundles of geometry g. */
uint64_t nf_sparse_gate_first_bytes(const struct nf_ctx *ctx, const struct nf_cache_geom *g);

/* The FFN ops the engine installed and their self, for callers that wrap
 * them (tests comparing against a reference, tracing). */
struct nf_ffn_ops;
void nf_sparse_ffn_ops(const struct nf_sparse *s, const struct nf_ffn_ops **ops, void **self);

void nf_sparse_stats_get(const struct nf_sparse *s, struct nf_sparse_stats *out);
void nf_sparse_stats_reset(struct nf_sparse *s);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_SPARSE_H */
