/*
 * nflash/engine.h - the one entry point every front end opens a model
 * through: a GGUF or a store, sized to a memory budget, ready to evaluate.
 *
 * nf_engine_open loads the model, fits the context to the budget (when no
 * context length is given), opens the store's neuron cache and decides what
 * the budget pins and what it streams (attention pinned or streamed per
 * layer, the hot and cold segments, the cold segment's size), then installs
 * the sparse FFN engine on the context. generate, eval, the benches and the
 * server hold no sizing or policy of their own: they fill nf_engine_opts
 * from their flags and read the result back.
 *
 *	struct nf_engine_opts o;
 *	nf_engine_opts_default(&o);
 *	o.path = "7b.nfl";
 *	o.budget = 2ull << 30;                  // the whole process, overhead included
 *	struct nf_engine *e;
 *	struct nf_diag d = { 0 };
 *	if (nf_engine_open(&o, &e, &d) < 0) ... // d.msg names the file or the flag
 *	nf_ctx_eval(nf_engine_ctx(e), ids, n);
 *	nf_engine_close(e);
 *
 * Memory (docs/PIPELINE.md "Memory budget"): the budget is a limit on the
 * whole process, not a reservation. The engine takes what the model needs,
 * at most the budget: dense weights, the KV cache and scratch, the sparse
 * engine's tables (nf_sparse_bytes_for), the neuron cache's arena (no larger
 * than the store's FFN bundles plus the cold minimum) and a fixed overhead
 * (the resident set at open, measured, plus NF_ENGINE_SLACK).
 *
 * Thread-safety: an engine is used from one thread at a time; its context
 * runs its own compute threads.
 */
#ifndef NFLASH_ENGINE_H
#define NFLASH_ENGINE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "nflash/cache.h"
#include "nflash/error.h"
#include "nflash/model.h"
#include "nflash/sparse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes the budget keeps for what the engine does not allocate itself:
 * compute threads' stacks, I/O rings, allocator headers. The fixed overhead
 * is this plus the process's resident set when nf_engine_open starts
 * (program, libraries, the caller's own memory), measured. */
#define NF_ENGINE_SLACK (8ull << 20)

/* The smallest context nf_engine_open fits to a budget (tokens). */
#define NF_ENGINE_MIN_CTX 256u

struct nf_engine_opts {
	const char *path;       /* GGUF (llama.cpp or PowerInfer) or store; required */
	const char *ffn_store;  /* a GGUF's FFN bundles from this store (NULL: none) */
	uint64_t budget;        /* whole-process memory limit in bytes (0: none) */
	uint32_t n_ctx;         /* context length (0: the model's, lowered to fit the budget) */
	uint32_t n_batch;       /* prompt tokens per forward step (0: the plan's, or 512) */
	int n_threads;          /* compute threads (0: the plan's, or all CPUs of the node) */
	int kv_type;            /* enum nf_kv_type (-1: the plan's, or NF_KV_F16 as llama.cpp) */
	int sparse_mode;        /* enum nf_sparse_mode, or -1: the default for the model */
	bool threshold_set;     /* threshold overrides the file's predictor threshold */
	float threshold;
	int io_backend;         /* enum nf_io_backend, or -1: auto */
	/* called for every read of the cache's I/O context that completes
	 * (nf_io_opts on_read: offset, length, result, latency), from the
	 * thread that reaps it; the planner records where a calibration reads */
	void (*on_read)(void *user, uint64_t offset, uint32_t len, int64_t res, uint64_t lat_ns);
	void *on_read_user;
	bool io_mmap;           /* dense from the GGUF's mapping, no prefault, no budget */
	uint32_t qd;            /* reads in flight (0: the plan's, or the cache's default) */
	int read_gap;           /* misses joined up to this many slots apart (-1: the plan's, or default) */
	bool stream_attn;       /* stream attention even when it fits (or when the plan says so) */
	uint32_t attn_pin;      /* when streamed, keep the first N layers' attention pinned */
	int cold_slots;         /* smallest cold segment (0: one layer; -1: the plan's, or auto) */
	/* Follow the store's plan for this budget (docs/PLAN.md; default true):
	 * every setting left unset above takes the plan's value. */
	bool use_plan;
	/* The budget whose plan to follow (0: budget). A front end that keeps
	 * part of its budget for itself (the server's further slots' KV
	 * caches) passes the whole budget here and the rest in budget: the
	 * plan made for the user's figure is followed, and the cache takes
	 * what is left (its cold segment shrinks by itself). */
	uint64_t plan_for;
	/* Decide and size everything, open nothing beyond the model and the
	 * context: nf_engine_info tells what a real open would take (the
	 * planner's dry run). The engine cannot evaluate. */
	bool size_only;
	/* The fixed overhead to count (0: measure it, the resident set at open
	 * plus NF_ENGINE_SLACK): a dry run in a process that holds more than
	 * the real run will passes the real run's. */
	uint64_t overhead;
	int replan_moves;       /* online re-planning: moves per step, every 16 tokens (-1: 1024; 0: off) */
	/* from a store, decode: read layer L+1's guessed experts (a dense FFN
	 * in predictor mode: its predicted neurons) ahead (nf_sparse_params
	 * route_prefetch; -1: the plan's when it measured it, else on for
	 * exact and dense experts and for a dense FFN, off for experts in
	 * predictor mode; 0: off; 1: on) */
	int route_prefetch;
	/* exact mode from a store imported with --gate-objects: read each
	 * routed FFN's gate rows first, then only the bundles of neurons whose
	 * gate is positive (nf_sparse_params gate_first; -1 (default): the
	 * plan's, else on for a dense ReLU/dReLU FFN in exact mode whose
	 * store holds every layer's gate rows, off otherwise; 0: off; 1: on) */
	int gate_first;
	/* keep the dense matrices in their plain rows: no 8-row groups
	 * (nf_model_repack), for A/B runs; the same bits either way */
	bool no_repack;
	bool profile;           /* calibration run: count firings, record co-activation */
	uint32_t profile_sig_tokens; /* requests per FFN the co-activation record keeps */
	/* the hot-set sizes (slots, the whole model) of other budgets the
	 * layout is to serve as well (nf_coact_order_cuts); NULL: this run's */
	const uint64_t *profile_cuts;
	uint32_t n_profile_cuts;
	/* where nf_coact_profile_save writes its lines (the layout chosen per
	 * FFN, the profile stored); NULL: log. `nflash plan` passes its own
	 * log here, its calibration engine's log staying NULL */
	FILE *profile_log;
	bool measure_recall;    /* the sparse engine measures predictor recall (in memory) */
	FILE *log;              /* informational lines ("memory: ..."); NULL: none */
};

void nf_engine_opts_default(struct nf_engine_opts *o);

/* What nf_engine_open decided and allocated (bytes unless said). */
struct nf_engine_info {
	uint64_t budget;         /* as given (0: none) */
	uint64_t weights;        /* dense weights held in memory, pinned attention included */
	uint64_t arena;          /* the neuron cache's arena (0: no store) */
	uint64_t attn_buffers;   /* streamed attention's buffers (0: pinned) */
	uint64_t reserved;       /* KV cache, scratch, the sparse engine's tables, the profile record */
	/* of reserved's KV cache, the unwritten part lent to the hot segment
	 * (in arena until the context fills: docs/PIPELINE.md "The KV cache fills") */
	uint64_t kv_lent;
	uint64_t profile_rec;    /* of reserved: --profile's co-activation record */
	uint64_t profile_extra;  /* what a calibration run holds beyond a normal run's */
	uint64_t overhead;       /* VmRSS at open + NF_ENGINE_SLACK */
	uint32_t n_ctx;          /* the context length in use */
	bool n_ctx_fitted;       /* lowered from the model's to fit the budget */
	bool streamed;           /* the FFN is read through the neuron cache */
	bool attn_streamed;      /* attention read per layer per step */
	uint32_t attn_pinned_layers; /* layers whose attention is in memory */
	uint32_t hot_slots, cold_slots; /* the cache's segments, in bundles */
	uint32_t cold_min_slots; /* the smallest cold segment decided (0: one layer) */
	uint32_t stride;         /* bytes per bundle slot */
	uint32_t qd, read_gap;   /* in use */
	/* the plan followed: its budget (0: none), or why none was */
	uint64_t plan_budget;
	double plan_tok_per_s;   /* the plan's predicted decode tokens/s (0: none followed) */
	bool plan_overridden;    /* a setting given by the caller differs from the plan's */
	char plan_note[160];
	double load_s;           /* seconds nf_engine_open took */
};

struct nf_engine;

/*
 * nf_engine_open - load o->path, open its context and FFN engine within
 * o->budget. Returns 0 and *out, or NF_EUSAGE (an option does not fit this
 * model: d names the flag), NF_EBUDGET (the budget is below the minimum:
 * d states the minimum and what would lower it), the loader's errors (d
 * names the file), or -ENOMEM. Nothing is left allocated on failure.
 */
int nf_engine_open(const struct nf_engine_opts *o, struct nf_engine **out, struct nf_diag *d);
/* Frees everything the engine opened. NULL allowed. */
void nf_engine_close(struct nf_engine *e);

struct nf_model *nf_engine_model(const struct nf_engine *e);
struct nf_ctx *nf_engine_ctx(const struct nf_engine *e);
/* The sparse FFN engine (NULL when the built-in dense FFN runs). */
struct nf_sparse *nf_engine_sparse(const struct nf_engine *e);
/* The neuron cache and the store it reads (NULL without a store). */
struct nf_cache *nf_engine_cache(const struct nf_engine *e);
struct nf_store *nf_engine_store(const struct nf_engine *e);
/* The path of that store (o->path or o->ffn_store). */
const char *nf_engine_store_path(const struct nf_engine *e);
const struct nf_engine_opts *nf_engine_opts(const struct nf_engine *e);
void nf_engine_info(const struct nf_engine *e, struct nf_engine_info *out);
/* Peak resident set (VmHWM) of this process in bytes, 0 if unknown. */
uint64_t nf_engine_vm_hwm(void);
/* The fixed overhead nf_engine_open would count now: the resident set
 * (VmRSS) rounded up to 4 MiB, plus NF_ENGINE_SLACK. */
uint64_t nf_engine_overhead_now(void);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_ENGINE_H */
