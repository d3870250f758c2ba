/*
 * tools/serve_engine.h - the model behind `nflash serve`, seen through one
 * small interface: open with n slots (each its own KV cache over one shared
 * model and neuron cache), evaluate tokens on a slot, read its logits,
 * reset it, read the storage counters.
 *
 * This is the one place that knows how a model is opened: through the
 * library's engine entry point (nflash/engine.h) with the options the
 * shared model flags give (tools/model_cli.h parses them).
 *
 * The engine's context runs every step; each slot is a KV cache (slot 0's
 * is the engine context's own, the others are contexts with no scratch of
 * their own). A decode step takes the set of slots that each want one
 * token evaluated (serve_engine_decode) and runs them as one batch
 * (nf_ctx_eval_seqs: PowerInfer-2's dynamic batch, each layer's union of
 * active neurons read once), or one after the other with batching off.
 * Every output equals the slot's output run alone: a slot's evaluation
 * depends only on its own tokens.
 *
 * Not thread-safe: one thread (the server's scheduler) drives the engine.
 */
#ifndef NFLASH_TOOLS_SERVE_ENGINE_H
#define NFLASH_TOOLS_SERVE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model_cli.h"

struct nf_tok;
struct serve_engine;

struct serve_engine_info {
	uint32_t n_vocab;
	uint32_t n_ctx;              /* per slot */
	unsigned n_slots;
	int32_t eos_id;
	const struct nf_tok *tok;    /* NULL when the file has no vocabulary */
	const char *chat_template;   /* tokenizer.chat_template, NULL if none */
	uint64_t slot_bytes;         /* a further slot's KV cache (and logits) */
	bool streamed;               /* FFN read from a store through the cache */
	bool attn_streamed;          /* attention read per layer per step */
	bool batch;                  /* decode steps run their slots as one batch */
};

/* Decode-step sizes counted per bucket: 1, 2, 4, ..., 64, more. */
#define SERVE_BATCH_BUCKETS 8

/* Storage and compute counters since open, summed over slots. */
struct serve_engine_stats {
	uint64_t lookups, hits_hot, hits_cold, misses;
	uint64_t requests, bytes_read, errors;
	double t_ffn, t_wait;        /* seconds in the sparse FFN, and waiting for reads there */
	/* decode steps (one forward pass each) and the slots they carried;
	 * batch_hist[k]: steps of at most 2^k slots (and more than 2^(k-1)) */
	uint64_t steps, step_slots, batch_hist[SERVE_BATCH_BUCKETS];
};

/* One slot's part of a decode step: evaluate id on slot; rc is set. */
struct serve_decode {
	unsigned slot;
	int32_t id;
	int rc;
};

/*
 * serve_engine_open - open the model mc's flags describe (-m, -c, -t,
 * --memory-budget, ...) with n_slots slots; batch false runs decode steps
 * one slot after the other (the A/B of batching). With a budget, all
 * slots' KV caches are counted in it (the neuron cache gets what is
 * left). Returns an exit code from cli.h after printing an error naming
 * the flag or file. mc is read only (it must outlive the engine).
 */
int serve_engine_open(const struct nf_model_cli *mc, unsigned n_slots, bool batch, struct serve_engine **out);
void serve_engine_close(struct serve_engine *e);

void serve_engine_info(const struct serve_engine *e, struct serve_engine_info *out);

/* Evaluate n tokens on slot (a prompt: batched). 0 or a negative errno /
 * nflash error; after an error the slot must be reset. */
int serve_engine_eval(struct serve_engine *e, unsigned slot, const int32_t *ids, size_t n);
/* One decode step over n slots (distinct), batched unless batching is
 * off. Returns 0; each item's rc says how its slot fared (a batch fails
 * or succeeds as a whole). */
int serve_engine_decode(struct serve_engine *e, struct serve_decode *items, size_t n);
/* Logits of slot's last evaluated token (n_vocab floats). */
const float *serve_engine_logits(const struct serve_engine *e, unsigned slot);
uint32_t serve_engine_n_past(const struct serve_engine *e, unsigned slot);
/* Empty slot's KV cache for the next request. */
void serve_engine_reset(struct serve_engine *e, unsigned slot);

/* Counters since open, reopens included (they never go back). */
void serve_engine_stats(const struct serve_engine *e, struct serve_engine_stats *out);

/*
 * serve_engine_reopen - close the model, its cache and every slot, and
 * open them again from the same flags, with the fixed overhead measured
 * at the first open (the process now holds more, which is not the
 * model's): how the server gets past an I/O
 * error, which sticks to the store's I/O context until it is closed. Every
 * slot's KV cache is lost. Returns 0, or -EIO when the open failed (the
 * error is printed); the engine then has no model and only
 * serve_engine_reopen, serve_engine_stats and serve_engine_close may be
 * called. The tokenizer and chat template stay.
 */
int serve_engine_reopen(struct serve_engine *e);

#endif
