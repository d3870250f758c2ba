/*
 * sparse_impl.h - private to compute/ffn_sparse.c and compute/sparse_*.c:
 * the sparse FFN engine's state and the functions its parts share.
 *
 *   ffn_sparse.c    names, the forward entry point, set-up and tear-down
 *   sparse_chunk.c  computing a chunk of groups (gate, up, act, down; QCOL
 *                   and K-quant downs)
 *   sparse_sched.c  the ready list and the workers that take ready chunks
 *   sparse_token.c  one token: predictor, masks, chunks, cache windows
 *   sparse_batch.c  a batch of tokens from the cache (prefill)
 *   sparse_moe.c    mixture-of-experts layers (routing, experts in turn)
 * Invariants of the engine (every part keeps them):
 *  1. Arithmetic follows ggml/PowerInfer: gate/up inputs rounded to their
 *     weight's dot type (act_prepare); the activation of a neuron fed to a
 *     float down row is rounded to that row's dot type (fp16 for F16); for
 *     a quantized down (ROW from ffn_down_t, or QCOL) the activations of a
 *     group are quantized together as one Q8_0 block, and neuron i's
 *     coefficient is d * q[i] (PowerInfer's axpy_q4_0_q8_0; QCOL: ggml's
 *     integer dot). Inactive neurons have activation 0 in that block.
 *  2. The work unit is a chunk: consecutive groups, closed once it holds
 *     CHUNK_NEURONS active neurons (the last one may hold fewer), so its
 *     bounds depend on the masks only. A chunk is computed by one thread,
 *     start to end (gate, up, act, down), only once all its active
 *     neurons' bytes are in memory: the Q8_0 block of a group depends on
 *     exactly that group, and a chunk is whole groups, so no barrier per
 *     matrix exists. A chunk adds its neurons' down contributions in
 *     ascending neuron order (one fma chain per element, as axpy neuron by
 *     neuron) into its own output row; when the layer's chunks are done the
 *     rows are summed in chunk order (rows split over the threads). So the
 *     output does not depend on the thread count nor on the order reads
 *     completed: store-backed equals in-memory bit for bit.
 *  3. Everything is allocated in nf_sparse_open(); forward() never
 *     allocates.
 *  4. Chunks are taken through one atomic counter over the ready list, so
 *     any thread may take any ready chunk; with a cache, a thread with
 *     nothing to do reaps completions (the cache serialises that) and
 *     appends the chunks they complete.
 *  5. A batch of tokens (prefill) from a cache makes one request per layer
 *     for the union of its tokens' neurons, so a long prompt reads the FFN
 *     as large sequential runs; each thread owns a slice of the tokens and
 *     walks the groups in group order as they land, each token cutting its
 *     own chunks from its own masks and adding each closed chunk straight
 *     into its output: the same sums in the same order as invariant 2, so
 *     a batch equals its tokens one by one, bit for bit.
 *  6. Mixture-of-experts layers route as the built-in FFN and run each
 *     routed expert as the FFN (layer, expert) through this same machinery
 *     in the engine's mode: its table is tabs[layer * nx + expert] (bytes
 *     in memory, or bundles of FFN object (layer, expert) through the
 *     cache; its own predictor), and each expert keeps invariants 1-2 and
 *     7, so exact experts from a store equal them in memory bit for bit.
 *     The experts' outputs are summed in rank order with the router's
 *     weights, as the built-in FFN sums them. From a cache a token's
 *     experts are masked and requested together when they fit (tagged
 *     requests, all misses in flight at once); a completion of rank k not
 *     being computed counts down xpend[k] only, and rank k's chunks start
 *     from what is still pending when it is computed (no thread reaps
 *     while cur_k changes), so the sums are those of invariant 2. A batch
 *     from a cache runs per expert: all its tokens of the forward step (at
 *     most the context's n_batch) gathered as one batch of that expert
 *     (invariant 5: its union read once per step), outputs combined per
 *     token in rank order.
 *  7. K-quant down matrices (QCOL of Q2_K..Q6_K, types may differ per
 *     layer): chunks compute gate, up and the activations only, into the
 *     token's activation vector; chunks close only at 256-neuron
 *     super-block boundaries (kgroups), so a window of chunks holds whole
 *     super-blocks. Once a window's chunks are done (a batch: once every
 *     group landed) the down product runs in ggml's dense order
 *     (nf_sp_kdown_rows): the activations as Q8_K blocks, per row one chain
 *     of lane accumulators over the super-blocks in ascending order. Where
 *     every neuron runs, the output is llama.cpp's dense product bit for
 *     bit; skipped neurons contribute what a zero activation does.
 *     Q4_0 and Q8_0 QCOL downs (a llama.cpp file's) wait the same way and
 *     run in the order of llama.cpp's dense product (nf_sp_qdown_rows):
 *     the activations as Q8_0 blocks, per row one fma chain over the
 *     blocks in ascending order (Q4_0 of a multiple of 8 rows: the
 *     repacked chain) or 8 lane chains summed as hsum_float_8 (Q8_0, and
 *     Q4_0 of other row counts: vec_dot's lanes). Until session 35 each
 *     chunk summed its groups into its own row (two roundings a group)
 *     and the rows were added in chunk order: a Q4_0 file of n_embd 256
 *     from its store was 0.05 off the same file in memory.
 *  8. F16 down columns (not PowerInfer's ffn_down_t) wait for the layer's
 *     activations as K-quant ones do (invariant 7: s->kact, rounded to
 *     fp16), and then run in the order llama.cpp's product takes
 *     (nf_sp_fdown_rows): with one column (s->one_col: a forward of one
 *     token, or any expert, which ggml's mul_mat_id computes by vec_dot)
 *     or rows not a multiple of 16, vec_dot_f16's four 16-lane chains
 *     (neuron i into lane i % 64 below F & ~63, the rest in double); else
 *     tinyBLAS's one 16-lane chain (lane i % 16). The gate and up rows take
 *     F16's one-column kernel in the first case (nf_ktype_column). So a
 *     batch of F16 tokens no longer equals its tokens one by one bit for
 *     bit (invariant 5), as in llama.cpp; it equals llama.cpp's batch.
 */
#ifndef NF_SPARSE_IMPL_H
#define NF_SPARSE_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "nflash/bundle.h"
#include "nflash/cache.h"
#include "nflash/dtype.h"
#include "nflash/kernels.h"
#include "nflash/model.h"
#include "nflash/pool.h"
#include "nflash/sparse.h"

#define GROUP 32u
/* Active neurons a chunk collects before it closes: 64 keeps ~20 chunks
 * per layer at 13% activity (their output rows stay in L2, and two
 * threads still balance) and the gather kernels' lists long. */
#ifndef CHUNK_NEURONS
#define CHUNK_NEURONS 64u
#endif
/* a chunk closes at a group boundary (K-quant downs: a 256-neuron one) */
#define CHUNK_MAX (CHUNK_NEURONS + NF_QK_K - 1u)

enum down_form { DOWN_ROW, DOWN_QCOL };

/* One FFN (layer, expert): its predictor, its down type, and where its
 * neuron bytes live when served from memory (tabs[layer * nx + expert]). */
struct layer_tab {
	bool sparse;                 /* false: built-in FFN */
	const char *gate, *up, *down;
	size_t gate_stride, up_stride, down_stride;
	const uint16_t *scales;      /* QCOL: [n_ff / 32][n_embd] fp16; K: block heads */
	uint32_t dt_down;            /* this layer's down type (K-quants vary per layer) */
	int kt_down;
	void *owned;                 /* transposed / repacked down (ours) */
	struct nf_weight fc1, fc2;   /* predictor (this expert's view); data NULL: none */
};

struct group_state {
	uint32_t chunk;              /* the chunk it belongs to (if active) */
	atomic_uint pending;         /* batches: bundles not yet in memory */
};

struct chunk_state {
	uint32_t g0, g1;             /* groups [g0, g1); inactive ones are skipped */
	uint32_t n_groups;           /* active groups among them */
	atomic_uint pending;         /* bundles not yet in memory */
};

struct nf_sparse;

/* What the cache's callbacks receive (nf_sp_on_ready): the engine, and for
 * the routed experts of a token requested together, the expert's rank k
 * (UINT32_MAX: the FFN being computed). */
struct sp_tag {
	struct nf_sparse *s;
	uint32_t k;
};

struct nf_sparse {
	struct nf_ctx *ctx;
	const struct nf_model *m;
	const struct nf_kernels *k;
	enum nf_sparse_mode mode;
	float threshold;
	bool measure_recall;
	struct nf_cache *cache;
	uint32_t cap;                /* cache: most misses one request may have (its cold slots) */
	uint32_t E, F, n_groups, n_layer;
	uint32_t last_mask;          /* neurons of the last group that exist */
	enum nf_ffn_act act;
	bool has_gate;
	uint32_t dt_gu, dt_down;     /* dtypes */
	int kt_gu, kt_down;
	enum down_form form;
	uint32_t kgroups;            /* groups per chunk boundary: 8 with K-quant downs, else 1 */
	float *kact;                 /* QCOL downs: the layer's activations (n_ff) */
	struct nf_block_q8_K *kx;    /* and as Q8_K blocks (n_ff / 256) */
	struct nf_block_q8_0 *qx;    /* or as Q8_0 blocks (n_ff / 32) */
	float *kacc;                 /* per row: the dense product's accumulators (n_embd x KACC;
	                                Q4_0/Q8_0: lane-major, 8 x n_embd) */
	float *bkact;                /* batches: each token's activations (n_batch x n_ff) */
	struct nf_block_q8_K *bkx;   /* batches, per thread: kx, qx and kacc */
	struct nf_block_q8_0 *bqx;
	float *bkacc;
	bool fdown;                  /* F16 downs in llama.cpp's order (invariant 8) */
	bool one_col;                /* this call's products have one column (invariant 8) */
	bool fclosed;                /* vec_dot order: the rows' chains summed into facc */
	float *flanes;               /* F16 down: lane accumulators (64 x n_embd, lane-major) */
	double *facc;                /* and the rows' sums past the chains (n_embd) */
	float *bflanes;              /* batches, per thread: flanes and facc */
	double *bfacc;
	uint32_t down_off_bundle;    /* cache bundles: byte offset of the down row */
	uint32_t up_off_bundle;
	struct layer_tab *tabs;      /* n_layer x nx */
	uint32_t nx;                 /* FFNs per layer: max(1, n_expert) */
	struct nf_ffn_ops ops;
	uint64_t bytes;
	bool count_only;             /* a sizing pass: zalloc counts, allocates nothing */

	/* per call scratch */
	void *xq;                    /* x prepared for gate/up */
	void *hq;                    /* predictor input prepared */
	float *h1;                   /* fc1 output (rank) */
	float *score;                /* fc2 output, then gate values for recall (n_ff) */
	uint32_t rank;
	uint32_t *gmask;             /* n_groups: neurons to compute (bit i: neuron 32g + i) */
	struct group_state *groups;  /* n_groups */
	struct chunk_state *chunks;  /* max_chunks */
	uint32_t max_chunks, n_chunks;
	uint32_t *ready;             /* chunk ids in the order they became ready */
	atomic_uint n_ready, next;   /* appended / taken */
	const void **ptrs;           /* cache: bundle address per neuron (n_ff) */
	const void **cur_ptrs;       /* those of the FFN being computed (ptrs, or xptrs + k * n_ff) */
	struct sp_tag tag0;          /* callbacks of the FFN being computed */
	uint32_t *req;               /* cache: neuron ids requested (n_ff) */
	atomic_int err;

	/* per thread */
	int nth;
	float *gout;                 /* max_chunks x E: each chunk's down contribution */
	size_t act_stride;           /* bytes of per-thread activation scratch */
	char *tscratch;              /* nth x act_stride */

	struct nf_sparse_stats st;
	struct nf_sparse_expert_stats *xst; /* mixture of experts: n_layer x n_expert */
	uint32_t hot_after;
	uint32_t replan_moves;       /* online re-planning: most moves per layer and step (0: off) */
	bool replan_now;             /* this forward step re-plans each layer after it */
	uint64_t tokens, next_hot;
	double t_req;                /* this layer: request time */
	_Atomic double t_last_ready; /* and its last completion (set by reapers) */
	/* batches (prefill) from a cache: one request per layer for the
	 * union of the tokens' neurons, groups consumed in group order */
	bool in_batch;
	uint32_t n_batch;            /* most tokens per call */
	size_t xq_size;              /* bytes of one prepared input */
	char *bxq;                   /* n_batch prepared inputs */
	uint32_t *bmask;             /* n_batch x n_groups neuron masks */
	uint32_t *bchunk;            /* n_batch x 2: open chunk's first group, active neurons */
	float *bsum;                 /* nth x E: one chunk's contribution */
	size_t cur_nb;
	/* mixture of experts: each token's routed experts run one after the
	 * other, each the FFN (layer, expert) in the engine's mode */
	uint32_t n_expert, n_expert_used;
	uint32_t cur_expert;
	const struct layer_tab *cur_tab; /* (cur_layer, cur_expert) */
	const uint16_t *cur_scales;  /* QCOL scales of (cur_layer, cur_expert) */
	float *eout;                 /* n_expert_used x E: each routed expert's output */
	/* from a cache: a token's routed experts requested together (their
	 * misses all in flight at once), then computed in rank order */
	bool together;               /* this token's experts were requested together */
	uint32_t cur_k;              /* rank being computed (UINT32_MAX: none) */
	struct sp_tag *xtag;         /* n_expert_used */
	uint32_t *xmask;             /* n_expert_used x n_groups: each expert's masks */
	atomic_uint *xpend;          /* n_expert_used x n_groups: neurons not yet landed */
	const void **xptrs;          /* n_expert_used x n_ff: bundle addresses */
	uint64_t *xactive;           /* n_expert_used: active neurons */
	int32_t *guess;              /* n_expert_used: experts guessed for layer guess_layer */
	uint32_t guess_layer;        /* UINT32_MAX: no guess */
	bool route_prefetch;         /* read the guessed experts' neurons ahead (nf_cache_prefetch) */
	bool layer_ahead;            /* dense FFN, predictor mode: read layer+1's guess ahead */
	uint32_t *la_mask;           /* n_groups: the neurons guessed for layer la_layer */
	uint32_t la_layer;           /* UINT32_MAX: no guess pending */
	float la_min_right;          /* stop below this share of guessed neurons computed */
	uint64_t la_checks;          /* layers whose guess was checked */
	uint64_t la_guessed, la_right; /* over those layers (not reset with the stats) */
	bool la_stopped;
	bool decode_now;             /* this call is one token (decode) */
	/* gate-first exact mode (a store with gate-rows objects): a token's
	 * routed FFNs' gate rows read whole first (gbuf, one per rank), the
	 * gate of every neuron computed from them (the bits gemv_list gives in
	 * a chunk), then only the positive ones' bundles requested; chunks are
	 * cut as in exact mode (every neuron counted), so the output is exact
	 * mode's, bit for bit */
	bool gate_first;
	/* record_moments: per FFN (layer * nx + expert), mom_stride doubles:
	 * tokens, sum of z[rank], sum of z z^T[rank * rank] (NULL: off) */
	double *mom;
	size_t mom_stride;
	const struct nf_store_object **gobj; /* n_layer x nx: gate-rows objects */
	char *gbuf;                  /* max(1, n_expert_used) x gbuf_stride, I/O aligned */
	size_t gbuf_stride;
	atomic_int *gdone;           /* per buffer: 1 in flight, 0 landed, < 0 failed */
	uint32_t *gheld;             /* per buffer: the FFN (layer * nx + expert) it holds, or UINT32_MAX */
	const char *cur_gate;        /* nf_sp_token_masks: gate rows of the FFN masked (NULL: none) */
	/* from a cache, a batch: each expert's tokens gathered (x, resid, out:
	 * n_batch x E each), run as one batch of that expert (its union read
	 * once), their outputs by slot (n_batch x n_expert_used x E) */
	float *bx, *beout;
	uint32_t *bslot;             /* n_batch: slot b * U + k of each gathered token */
	const float *cur_x;          /* token being computed */
	float *cur_out;              /* its FFN output */
	uint32_t cur_layer;
};


/*
 * K-quant QCOL down, in ggml's dense order (kernels_ref.c, dot_kquant), so
 * that store-backed and in-memory runs equal llama.cpp's dense product
 * bit for bit where every neuron is computed: the layer's activations
 * (s->kact, inactive neurons 0) are quantized to Q8_K per super-block
 * (s->kx); per row r, super-blocks in ascending order continue the row's
 * lane accumulators (s->kacc: 8 lanes, 4 Q4_K min lanes, the Q5_K min
 * sum), each lane the exact integer sum over the neurons with a nonzero
 * q_x (the others contribute 0, as in the dense sum).
 */
#define KACC 13

struct kdown_job {
	struct nf_sparse *s;
	uint32_t dt, kb0, kb1;       /* super-blocks (Q4_0/Q8_0: groups) */
	float *out;                  /* final pass: the layer's output */
};

/*
 * Tokens x[0..nb) of one layer with a cache: one request for every neuron
 * any of them needs (for a long prompt nearly the whole FFN: adjacent
 * misses coalesce into reads of up to max_coalesce bytes, the FFN read as
 * large sequential extents), and compute proceeds group by group as those
 * reads land. Same results, bit for bit, as the tokens one at a time.
 */
#define BATCH_TOO_BIG 1

static inline double nf_sp_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline struct layer_tab *nf_sp_tab(const struct nf_sparse *s, uint32_t layer, uint32_t expert)
{
	return &s->tabs[(size_t)layer * s->nx + expert];
}

void nf_sp_kdown_worker(void *arg, int ith, int nth);
/* K-quant down of super-blocks [kb0, kb1) for rows [r0, r1): Q8_K
 * activations kx, row accumulators kacc (n_embd x KACC) continued; then
 * the rows' outputs from their accumulators. */
void nf_sp_kdown_rows(const struct nf_sparse *s, uint32_t dt, const struct nf_block_q8_K *kx, float *kacc,
		      uint32_t kb0, uint32_t kb1, uint32_t r0, uint32_t r1);
void nf_sp_kdown_finish(uint32_t dt, const float *kacc, uint32_t r0, uint32_t r1, float *out);
/* Q4_0 / Q8_0 QCOL down of groups [g0, g1) for rows [r0, r1) (multiples
 * of 32, or r1 = n_embd): Q8_0 activations qx, lane-major accumulators acc
 * (8 x n_embd) continued; then the rows' outputs (invariant 7). */
void nf_sp_qdown_rows(const struct nf_sparse *s, uint32_t dt, const struct nf_block_q8_0 *qx, float *acc,
		      uint32_t g0, uint32_t g1, uint32_t r0, uint32_t r1);
void nf_sp_qdown_finish(const struct nf_sparse *s, uint32_t dt, const float *acc, uint32_t r0, uint32_t r1,
			float *out);
/* A QCOL down of this layer's type waits for the layer's activations
 * (invariant 7): every QCOL down, K-quant, Q4_0 or Q8_0. */
static inline bool nf_sp_is_kdown(const struct nf_sparse *s, uint32_t dt_down)
{
	(void)dt_down;
	return s->form == DOWN_QCOL;
}
/* Invariant 8 applies to this down type. */
static inline bool nf_sp_is_fdown(const struct nf_sparse *s, uint32_t dt_down)
{
	return s->fdown && dt_down == NF_DTYPE_F16;
}
/* Invariant 8's vec_dot order (one column, or rows tinyBLAS refuses);
 * else tinyBLAS's. */
static inline bool nf_sp_fdown_vec(const struct nf_sparse *s)
{
	return s->one_col || s->F % 16;
}
/* The gate/up kernel of this call: F16's one-column one when s->one_col. */
static inline int nf_sp_kt_gu(const struct nf_sparse *s)
{
	return nf_ktype_column(s->kt_gu, s->one_col ? 1 : 2);
}
/* F16 down (invariant 8) of neurons [i0, i1) with activations act, rows
 * [r0, r1), into lanes (lane-major, 64 x n_embd) and facc; closed: the
 * chains were summed already (a neuron at or past F & ~63 was added). */
void nf_sp_fdown_rows(const struct nf_sparse *s, const float *act, float *lanes, double *facc, bool closed,
		      uint32_t i0, uint32_t i1, uint32_t r0, uint32_t r1);
void nf_sp_fdown_finish(const struct nf_sparse *s, const float *lanes, double *facc, bool closed, uint32_t r0,
			uint32_t r1, float *out);
/* Token path: F16 down of groups [g0, g1) (rows over the threads), then
 * s->fclosed updated; with out, the finishing pass instead. */
void nf_sp_fdown_blocks(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t g0, uint32_t g1, float *out);
/* kact: where a K-quant down's activations go (n_ff floats of the token) */
void nf_sp_chunk_compute(struct nf_sparse *s, uint32_t g0, uint32_t g1, const uint32_t *mask, const void *xq,
			  float *out, char *scratch, float *kact);
void nf_sp_ready_push(struct nf_sparse *s, uint32_t ci);
void nf_sp_on_ready(void *user, const uint32_t *neurons, uint32_t n, int result);
bool nf_sp_reap_some(struct nf_sparse *s, int ith);
void nf_sp_worker(void *arg, int ith, int nth);
void nf_sp_run_workers(struct nf_sparse *s, const struct nf_ffn_env *env, nf_pool_fn fn);
void nf_sp_run_job(const struct nf_ffn_env *env, nf_pool_fn fn, void *arg);
void nf_sp_kdown_blocks(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t dt, uint32_t g0,
			 uint32_t g1);
void nf_sp_reduce_worker(void *arg, int ith, int nth);
void nf_sp_record_moments(struct nf_sparse *s, uint32_t layer, uint32_t expert);
void nf_sp_predict(struct nf_sparse *s, const struct layer_tab *t, const float *resid);
/* FFN (layer, s->cur_expert)'s masks for token x into s->gmask (x prepared
 * into s->xq); returns the active neurons. */
uint64_t nf_sp_token_masks(struct nf_sparse *s, uint32_t layer, const float *x, const float *resid);
/* Gate-first: the gate rows of FFNs (layer, experts[k]) into gate buffers
 * k < n, read together; returns 0 or the first failed read's error. */
int nf_sp_gate_fetch(struct nf_sparse *s, uint32_t layer, const int32_t *experts, uint32_t n);
/* Gate-first: the gate rows of FFN (layer, s->cur_expert), from a buffer
 * that holds them or read into buffer 0; NULL if that read failed. */
const char *nf_sp_gate_rows(struct nf_sparse *s, uint32_t layer);
uint32_t nf_sp_group_mask(const struct nf_sparse *s, uint32_t gi);
void nf_sp_measure_recall(struct nf_sparse *s);
int nf_sp_token_forward(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t layer,
			 const float *x, const float *resid, float *out);
int nf_sp_batch_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io);
int nf_sp_tokens_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io);
int nf_sp_moe_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io);

#endif /* NF_SPARSE_IMPL_H */
