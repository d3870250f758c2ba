/*
 * nflash/plan.h - the offline planner: measure the device and the model,
 * lay out the store, choose every setting for a memory budget and predict
 * what it will do (`nflash plan`, docs/PLAN.md).
 *
 * A plan is plain data stored in the store (nflash/store.h, struct
 * nf_store_plan; docs/FORMAT.md item 20). nf_engine_open follows the entry
 * for its budget (the nearest at or below); a setting given explicitly
 * overrides it.
 *
 *	struct nf_plan_opts o;
 *	nf_plan_opts_default(&o);
 *	o.store = "7b.nfl";
 *	uint64_t budgets[] = { 2ull << 30 };
 *	o.budgets = budgets;
 *	o.n_budgets = 1;
 *	struct nf_store_plan *p;
 *	if (nf_plan_run(&o, &p, &diag) < 0) ...   // p is also in the store now
 *	nf_store_plan_free(p);
 *
 * Thread-safety: one planner per store at a time; it uses the machine's
 * CPUs and the store's device while it measures.
 */
#ifndef NFLASH_PLAN_H
#define NFLASH_PLAN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "nflash/error.h"
#include "nflash/store.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_plan_progress {
	/* label names the step; called with done 0 first and done == total last */
	void (*fn)(void *arg, const char *label, uint64_t done, uint64_t total);
	void *arg;
};

/* ---- measuring the device and the kernels ------------------------------------- */

struct nf_plan_device_opts {
	int io_backend;            /* enum nf_io_backend, -1: auto */
	double seconds;            /* for the whole read curve (default 12) */
	int n_threads;             /* kernels: up to this many threads (0: all CPUs) */
	const struct nf_plan_progress *progress;
	/* Where the reads go: NULL, uniformly over the store's data area; or
	 * each read at one of these n_offsets byte offsets (drawn at random;
	 * aligned down to the I/O context's alignment and to 4 KiB, and kept
	 * inside the data area): the offsets a calibration run read, so that
	 * the curve is the one decode meets on a device where place matters
	 * (a virtual disk over a host's page cache, a drive's own DRAM cache,
	 * a tiered volume); on plain flash the two are the same. */
	const uint64_t *offsets;
	size_t n_offsets;
	/* Kernels: the model's Q4_0 matrices sum in ggml's vec_dot order
	 * (NF_KT_Q4_0L: a PowerInfer file), so that is the kernel measured for
	 * Q4_0; false: llama.cpp's repacked order (NF_KT_Q4_0). */
	bool q4_0_vec_dot;
};
void nf_plan_device_opts_default(struct nf_plan_device_opts *o);

/*
 * nf_plan_measure_device - random O_DIRECT reads of the store's FFN span
 * through the engine's own I/O backend, by request size (4 KiB to 1 MiB)
 * and queue depth (1 to 256): MB/s, CPU time per request, latency; the
 * gemv GB/s of the store's weight types on 1..n threads, and the memory-read
 * bandwidth. Fills p's points, rates and mem_read_gb_s (allocated; free
 * with nf_store_plan_free). Returns 0 or a negative error (d says which).
 */
int nf_plan_measure_device(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			   struct nf_diag *d);
/* Its two halves: the read curve alone (p's points) and the kernel rates
 * and memory bandwidth alone (p's rates, mem_read_gb_s). */
int nf_plan_measure_reads(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			  struct nf_diag *d);
int nf_plan_measure_kernels(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			    struct nf_diag *d);
/*
 * nf_plan_points_median - out's points become passes[0]'s, each figure
 * (MB/s, CPU per request, latency) the median over the passes that
 * measured that size and depth: read curves measured minutes apart on a
 * shared device, merged so that one slow or fast minute does not set the
 * plan. Returns 0, -EINVAL without points, or -ENOMEM.
 */
int nf_plan_points_median(const struct nf_store_plan *const *passes, uint32_t n_passes, struct nf_store_plan *out);
/* The median of v[0..n) (v is sorted; the mean of the middle two for even
 * n; 0 for n == 0). */
double nf_plan_median(double *v, size_t n);

/* The device's MB/s for reads of req_bytes at qd: interpolated between the
 * measured points (log of size and depth); 0 without points. */
double nf_plan_device_mb_s(const struct nf_store_plan *p, double req_bytes, uint32_t qd);
/* CPU microseconds per request and mean latency (microseconds), likewise. */
double nf_plan_device_cpu_us(const struct nf_store_plan *p, double req_bytes, uint32_t qd);
double nf_plan_device_lat_us(const struct nf_store_plan *p, double req_bytes, uint32_t qd);
/* gemv GB/s of dtype on threads (the nearest measured thread count; the
 * fastest type measured if dtype was not); 0 without rates. */
double nf_plan_kernel_gb_s(const struct nf_store_plan *p, uint32_t dtype, uint32_t threads);
/* CPU seconds per byte of the crc32c check reads get on completion, timed
 * now on a 128 MiB buffer (beyond the caches, as bytes a device just
 * wrote into memory are): the best of two passes. 0 without memory. */
double nf_plan_verify_s_per_byte(void);

/* ---- the cost model ----------------------------------------------------------------- */

/* What the cost model needs of a model under one budget and read gap. */
struct nf_plan_model {
	uint32_t n_layer;
	uint32_t stride;            /* bytes per bundle slot read */
	uint32_t threads;           /* compute threads */
	uint32_t ffn_dtype, dense_dtype;
	double dense_bytes;         /* dense weights one decode step reads (nf_model_step_dense_bytes) */
	double attn_stream_bytes;   /* attention read from the store per step (streamed layers) */
	/* the rate those reads reach beside the FFN's, MB/s (the planner's
	 * decode probe of a streamed plan); 0: the device curve's 1 MiB
	 * reads at depth 8 */
	double attn_mb_s;
	double compute_bytes_per_neuron; /* bundle bytes the kernels read per computed neuron */
	const double *active;       /* [n_layer] neurons computed per token */
	const double *runs;         /* [n_layer] read requests per token (the misses' runs) */
	const double *bundles;      /* [n_layer] bundles those requests read */
	/* The engine's own ceiling on reads per second (the planner's decode
	 * probe): a layer's reads take at least runs / engine_iops; 0: none */
	double engine_iops;
	/* and its fixed cost per FFN layer beside reads and compute (the
	 * predictor, scheduling, the reduction), seconds; 0: none */
	double layer_overhead_s;
	/* seconds per byte read for the crc32c check each read gets where it
	 * completes, one thread at a time (the engine probe's verify_ms, or
	 * nf_plan_verify_s_per_byte); 0: none */
	double verify_s_per_byte;
};

/*
 * nf_plan_predict - the predicted cost of one decode token with model m
 * read at queue depth qd, from dev's device points and kernel rates (an
 * nf_store_plan as measured). Per layer, clusters compute as their reads
 * land, so a layer takes the longer of its compute (the active neurons'
 * bytes at the FFN kernel's GB/s, plus the reads' CPU time shared over
 * the threads and their checksums') and its reads (bytes at the device's MB/s for that request size
 * and depth, plus one latency); dense compute comes on top. Streamed
 * attention's reads overlap all of that, but share the device with the
 * FFN's: the token takes the longer of the compute path and the device's
 * time for both. Fills e's predictions (tok_per_s, io_wait_share,
 * bytes_per_token, reads_per_token, t_*).
 */
void nf_plan_predict(const struct nf_store_plan *dev, const struct nf_plan_model *m, uint32_t qd,
		     struct nf_store_plan_entry *e);

/*
 * nf_plan_gap_search - the read gap, measured (docs/PLAN.md "The read gap,
 * measured"). From gaps[k0], the cost model's choice among gaps[0..n_gaps)
 * (ascending): decode it and its neighbours once each; a neighbour margin
 * faster (0.03: 3%) is decoded again, then gaps[k0], and taken if the
 * faster of its rounds still wins; then on in that direction, the next gap
 * decoded and taken the same way, until one does not win or the list ends.
 * round(arg, k, &best_s) decodes gaps[k] once more and gives the fastest
 * of all its rounds, in seconds a token; it returns 0, -EAGAIN or
 * NF_EBUDGET where gaps[k] cannot run (that gap is passed over), or
 * another negative error, which ends the search. best0 > 0: gaps[k0]'s
 * fastest round so far (it is not decoded first). The rounds go to log
 * ("gap G T ms, ..."; NUL-terminated, truncated at log_len); *taken: the
 * index taken (k0: kept). Returns 0; 1 where gaps[k0] cannot run (nothing
 * decided); -EINVAL for k0 out of range; or round's error.
 */
typedef int (*nf_plan_gap_round_fn)(void *arg, size_t k, double *best_s);
int nf_plan_gap_search(const uint32_t *gaps, size_t n_gaps, size_t k0, double best0, double margin,
		       nf_plan_gap_round_fn round, void *arg, size_t *taken, char *log, size_t log_len);

/* ---- the whole planner ----------------------------------------------------------- */

struct nf_plan_opts {
	const char *store;          /* the store to plan; required */
	const uint64_t *budgets;    /* memory budgets to plan for; required */
	uint32_t n_budgets;
	const char *calibration;    /* text file; NULL: the built-in text */
	uint32_t calib_tokens;      /* calibration tokens (default 512) */
	/* Of them, how many the model writes itself, sampled (temperature 0.8,
	 * a fixed seed) after the text's: decode reads the neurons of the
	 * tokens the model writes, which fire otherwise than read text's.
	 * -1 (default): seven eighths (the text is the prompt); 0: the text
	 * only. */
	int calib_generate;
	bool relayout;              /* lay the store out in the co-activation order (default true) */
	bool keep_copy;             /* keep the store as it was beside, as STORE.orig (default false) */
	/* The relayout's bundle alignment (store block size): 0 (default) the
	 * device's O_DIRECT alignment, at least 512, so bundles are packed as
	 * closely as reads allow; a power of two in [512, 1M] forces one. */
	uint32_t bundle_align;
	bool remeasure;             /* measure the device again even if the store has it */
	int n_threads;              /* 0: all CPUs */
	/* What a run of the engine holds before it allocates, counted in each
	 * budget (nf_engine_opts.overhead); 0 (default): this process's now,
	 * before it measures and calibrates */
	uint64_t overhead;
	struct nf_plan_device_opts device;
	FILE *log;                  /* what it does, step by step; NULL: nothing */
	const struct nf_plan_progress *progress;
};
void nf_plan_opts_default(struct nf_plan_opts *o);

/*
 * nf_plan_run - plan o->store for each of o->budgets:
 *  1. measure the device and kernels (reused from the store's plan unless
 *     o->remeasure);
 *  2. run the calibration text with the profile's recording (activation
 *     counts and co-activation per FFN) and store the profile;
 *  3. lay the store out in the co-activation order, its bundles packed at
 *     o->bundle_align (default: as closely as the device's O_DIRECT
 *     alignment allows), crash-safely in place
 *     (a copy is written beside it and renamed over it; nothing is left
 *     behind but with o->keep_copy);
 *  4. for each budget choose the settings that minimise the predicted
 *     token time (read gap, queue depth, cold segment, context, attention
 *     pinned or streamed), and predict tokens/s, the I/O wait share and the
 *     bytes read per token;
 *  5. store the plans (with any earlier ones for other budgets).
 * Returns 0 and *out (the plans stored; free with nf_store_plan_free), or a
 * negative error with d naming the cause; the store is then as it was or
 * has the new profile (a valid store either way).
 */
int nf_plan_run(const struct nf_plan_opts *o, struct nf_store_plan **out, struct nf_diag *d);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_PLAN_H */
