/*
 * tools/model_cli.h - flags and set-up shared by the commands that run a
 * model (generate, eval): -m, -c, -t, -b, --kv-type, and opening the model
 * and its context with errors that name the file or flag.
 *
 * Not thread-safe; used from the command's main thread.
 */
#ifndef NFLASH_TOOLS_MODEL_CLI_H
#define NFLASH_TOOLS_MODEL_CLI_H

#include <stdio.h>

#include "nflash/engine.h"
#include "nflash/model.h"
#include "nflash/cache.h"
#include "nflash/sparse.h"
#include "nflash/stream.h"

struct nf_json;

struct nf_model_cli {
	const char *path;       /* -m */
	long n_ctx;             /* -c, 0: the model's */
	long n_threads;         /* -t, 0: all CPUs */
	long n_batch;           /* -b, 0: the plan's or 512 */
	int kv_type;            /* --kv-type (enum nf_kv_type), -1: the plan's or f16 */
	int sparse_mode;        /* --sparse-mode, -1: default (auto) */
	bool threshold_set;     /* --sparse-threshold */
	double threshold;
	uint64_t budget;        /* --memory-budget, 0: none */
	bool stats;             /* --stats */
	bool recall;            /* --recall */
	const char *ffn_store;  /* --ffn-store: FFN bundles from this store */
	const char *io_backend; /* --io (an I/O backend) */
	bool io_mmap;           /* --io mmap: dense from the GGUF's mapping, no prefault */
	long qd;                /* --qd */
	long read_gap;          /* --read-gap (-1: the cache's default) */
	bool stream_attn;       /* --stream-attn: stream attention even if it fits */
	long attn_pin;          /* --attn-pin-layers: when streamed, keep the first N pinned */
	bool profile;           /* --profile: count active neurons, store them in the store */
	long cold_slots;        /* --cold-slots: smallest cold segment (0: one layer; -1: auto) */
	long replan_moves;      /* --replan-moves: online re-planning (-1: default; 0: off) */
	int route_prefetch;     /* --route-prefetch on|off (-1: default) */
	int gate_first;         /* --gate-first on|off (-1: default) */
	int repack;             /* --repack on|off (-1: default, on) */
	uint64_t profile_rec;   /* of which the co-activation record (in reserved) */
	/* filled by nf_model_cli_open (the engine owns them) */
	struct nf_engine *engine;
	struct nf_model *model;
	struct nf_ctx *ctx;
	struct nf_sparse *sparse;
	struct nf_cache *cache;
	double load_s;
	uint64_t reserved;      /* KV cache + scratch + engine tables */
	uint64_t kv_lent;       /* of the KV cache, the unwritten part lent to the hot segment */
	uint64_t overhead;      /* fixed overhead beside the budget */
	struct nf_sparse_stats last; /* at the previous per-token report */
	struct nf_cache_stats clast;
	bool attn_streamed;     /* attention read per layer per step (nf_ctx_stream_attn) */
	struct nf_stream_stats alast;
	double t_last;
};

void nf_model_cli_init(struct nf_model_cli *mc);

/*
 * If argv[*i] is one of the shared flags, parse it (advancing *i past its
 * value) and return 1; return 0 if it is not one of them; NF_EUSAGE after
 * printing an error naming the flag.
 */
int nf_model_cli_flag(struct nf_model_cli *mc, int argc, char **argv, int *i);

/* Help lines for the shared flags. */
void nf_model_cli_help(FILE *f);

/*
 * Load the model and open a context. Returns an exit code: NF_EXIT_OK,
 * NF_EXIT_USAGE (no -m, a bad -c/-t for this model) or NF_EXIT_FAIL (the
 * file is bad), after printing the error.
 */
int nf_model_cli_open(struct nf_model_cli *mc);
/* The engine options mc's flags give (what nf_model_cli_open opens), for
 * a front end that opens the engine itself (the server). */
void nf_model_cli_engine_opts(const struct nf_model_cli *mc, struct nf_engine_opts *o);
void nf_model_cli_close(struct nf_model_cli *mc);
/* What made evaluation fail with rc: the store's object and offset when a
 * read or checksum failed, else nf_strerror(rc). */
const char *nf_model_cli_strerror(const struct nf_model_cli *mc, int rc);

/* --stats: one line on f for the tokens since the previous call (label
 * names them), and the totals; JSON: the "stats" object and vm_hwm_bytes
 * at top level. */
void nf_model_cli_stats_step(struct nf_model_cli *mc, FILE *f, const char *label);
void nf_model_cli_stats_total(struct nf_model_cli *mc, FILE *f, double t_total);
void nf_model_cli_stats_json(struct nf_model_cli *mc, struct nf_json *j, double t_total);
/* Calibration tokens (per FFN) recorded for the co-activation layout,
 * sampled over the whole run. */
#define NF_PROFILE_SIG_TOKENS 512

/*
 * --profile: store the neurons' firing counts gathered by the cache since
 * open (tokens: how many tokens were evaluated), and the co-activation
 * layout planned from up to NF_PROFILE_SIG_TOKENS of them per FFN,
 * sampled over the run
 * (nflash/coact.h), in the store the FFN came from, as a new generation.
 * Prints where; returns an exit code. No-op without --profile.
 */

int nf_model_cli_profile_save(struct nf_model_cli *mc, uint64_t tokens);
/* Peak resident set (VmHWM) of this process in bytes, 0 if unknown. */
uint64_t nf_model_cli_vm_hwm(void);

#endif
