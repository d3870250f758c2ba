/*
 * ffn_sparse.c - the sparse FFN engine (nflash/sparse.h): predictor, exact
 * two-phase and dense modes over 32-neuron groups, from the model's
 * in-memory weights or from the segmented cache.
 *
 * Invariants:
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
 *  6. Mixture-of-experts layers (from a cache only) route as the built-in
 *     FFN and run each routed expert as a dense FFN of (layer, expert).
 *  7. K-quant down matrices (QCOL of Q2_K..Q6_K, types may differ per
 *     layer): the activations of a 256-neuron super-block are quantized
 *     together to Q8_K (ggml's rule), so chunks close only at super-block
 *     boundaries (kgroups) and a chunk holds whole super-blocks; per row
 *     the block's integer sum of sc * q_w * q_x over the active neurons
 *     and the min term from the Q8_K sums give the block's contribution.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
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

/* Where one layer's neuron bytes live when served from memory. */
struct layer_tab {
	bool sparse;                 /* false: built-in FFN (MoE) */
	const char *gate, *up, *down;
	size_t gate_stride, up_stride, down_stride;
	const uint16_t *scales;      /* QCOL: [n_ff / 32][n_embd] fp16; K: block heads */
	uint32_t dt_down;            /* this layer's down type (K-quants vary per layer) */
	int kt_down;
	const uint16_t **xscales;    /* MoE from a cache: scales per expert */
	void *owned;                 /* transposed / repacked down (ours) */
	const struct nf_weight *fc1, *fc2;
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
	float *kact;                 /* K-quant downs: the layer's activations (n_ff) */
	struct nf_block_q8_K *kx;    /* and as Q8_K blocks (n_ff / 256) */
	float *kacc;                 /* per row: the dense product's accumulators (n_embd x KACC) */
	uint32_t down_off_bundle;    /* cache bundles: byte offset of the down row */
	uint32_t up_off_bundle;
	struct layer_tab *tabs;
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
	uint32_t *req;               /* cache: neuron ids requested (n_ff) */
	atomic_int err;

	/* per thread */
	int nth;
	float *gout;                 /* max_chunks x E: each chunk's down contribution */
	size_t act_stride;           /* bytes of per-thread activation scratch */
	char *tscratch;              /* nth x act_stride */

	struct nf_sparse_stats st;
	uint32_t hot_after;
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
	/* mixture of experts (from a cache only): each token's routed experts
	 * run as dense FFNs one after the other */
	uint32_t n_expert, n_expert_used;
	uint32_t cur_expert;
	const uint16_t *cur_scales;  /* QCOL scales of (cur_layer, cur_expert) */
	float *eout;                 /* n_expert_used x E: each routed expert's output */
	const float *cur_x;          /* token being computed */
	float *cur_out;              /* its FFN output */
	uint32_t cur_layer;
};

/* ---- names ------------------------------------------------------------------ */

static const char *const mode_names[] = {
	[NF_SPARSE_AUTO] = "auto", [NF_SPARSE_PREDICTOR] = "predictor",
	[NF_SPARSE_EXACT] = "exact", [NF_SPARSE_DENSE] = "dense", [NF_SPARSE_OFF] = "off",
};

const char *nf_sparse_mode_name(enum nf_sparse_mode m)
{
	return (unsigned)m <= NF_SPARSE_OFF ? mode_names[m] : "?";
}

int nf_sparse_mode_parse(const char *name)
{
	for (int i = 0; i <= NF_SPARSE_OFF; i++)
		if (!strcmp(name, mode_names[i]))
			return i;
	return -1;
}

void nf_sparse_params_init(struct nf_sparse_params *p)
{
	memset(p, 0, sizeof(*p));
	p->mode = NF_SPARSE_AUTO;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- group compute ----------------------------------------------------------- */

/* Addresses of neuron j's gate row, up row and down part. */
static void neuron_addr(const struct nf_sparse *s, uint32_t layer, uint32_t j, const char **g,
			const char **u, const char **d)
{
	if (s->cache) {
		const char *p = s->ptrs[j];
		*g = p;
		*u = p + s->up_off_bundle;
		*d = p + s->down_off_bundle;
		return;
	}
	const struct layer_tab *t = &s->tabs[layer];
	*g = t->gate ? t->gate + (size_t)j * t->gate_stride : NULL;
	*u = t->up + (size_t)j * t->up_stride;
	*d = t->down + (size_t)j * t->down_stride;
}

static float act1(enum nf_ffn_act act, float g, float u, bool has_gate)
{
	if (!has_gate)
		return act == NF_FFN_SILU ? u / (1.0f + expf(-u)) : (u > 0.0f ? u : 0.0f);
	switch (act) {
	case NF_FFN_RELU:
		return (g > 0.0f ? g : 0.0f) * u;
	case NF_FFN_DRELU:
		return (g > 0.0f ? g : 0.0f) * (u > 0.0f ? u : 0.0f);
	default:
		return g / (1.0f + expf(-g)) * u;
	}
}

/* Adds group gi's QCOL down contribution (activations a) into out. */
static void qcol_down(const struct nf_sparse *s, uint32_t gi, const float *a, const uint32_t *ids,
		      const void *const *dp, uint32_t n, float *out, char *scratch)
{
	uint32_t E = s->E;
	struct nf_block_q8_0 blk;
	nf_quantize_row_q8_0(a, &blk, GROUP);
	float dx = nf_fp16_to_fp32(blk.d);
	if (dx == 0.0f)
		return;
	int32_t *acc = (int32_t *)scratch;
	memset(acc, 0, E * sizeof(int32_t));
	for (uint32_t j = 0; j < n; j++) {
		int32_t q = blk.qs[ids[j] % GROUP];
		if (!dp[j] || q == 0)
			continue;
		if (s->dt_down == NF_DTYPE_Q8_0) {
			const int8_t *c = dp[j];
			for (uint32_t r = 0; r < E; r++)
				acc[r] += q * c[r];
		} else {
			const uint8_t *c = dp[j];
			for (uint32_t r = 0; r < E; r += 2) {
				acc[r] += q * ((int32_t)(c[r / 2] & 0x0f) - 8);
				acc[r + 1] += q * ((int32_t)(c[r / 2] >> 4) - 8);
			}
		}
	}
	const uint16_t *sc = s->cur_scales + (size_t)gi * E;
	for (uint32_t r = 0; r < E; r++)
		out[r] += nf_fp16_to_fp32(sc[r]) * dx * (float)acc[r];
}

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

static void kdown_rows(const struct nf_sparse *s, uint32_t dt, uint32_t kb0, uint32_t kb1,
		       uint32_t r0, uint32_t r1)
{
	uint32_t E = s->E, layer = s->cur_layer, bits = nf_kquant_bits(dt);
	int32_t off = nf_kquant_offset(dt);
	size_t bs = nf_dtype_block_size(dt), hb = nf_bundle_head_bytes(dt), qoff, qlen;
	nf_kquant_quant_span(dt, &qoff, &qlen);
	uint8_t blk[256];
	memset(blk, 0, sizeof(blk));
	for (uint32_t kb = kb0; kb < kb1; kb++) {
		const struct nf_block_q8_K *x = &s->kx[kb];
		if (x->d == 0.0f)
			continue; /* no neuron of the block is active: adds exact zeros */
		uint32_t nz = 0, lane[NF_QK_K], sub[NF_QK_K];
		int32_t qx[NF_QK_K];
		const uint8_t *col[NF_QK_K];
		for (uint32_t i = 0; i < NF_QK_K; i++) {
			if (!x->qs[i])
				continue;
			const char *g, *u, *d;
			neuron_addr(s, layer, kb * NF_QK_K + i, &g, &u, &d);
			lane[nz] = (i % 32) / 4;
			sub[nz] = i / 16;
			qx[nz] = x->qs[i];
			col[nz++] = (const uint8_t *)d;
		}
		const uint8_t *heads = (const uint8_t *)s->cur_scales + (size_t)kb * E * hb;
		for (uint32_t r = r0; r < r1; r++) {
			const uint8_t *h = heads + (size_t)r * hb;
			struct nf_kblock k;
			float *acc = s->kacc + (size_t)r * KACC;
			memcpy(blk, h, qoff);
			memcpy(blk + qoff + qlen, h + qoff, bs - qoff - qlen);
			nf_kblock_unpack_scales(dt, blk, &k);
			const float dd = x->d * k.d, dmin = -x->d * k.dmin;
			if (dt == NF_DTYPE_Q2_K) {
				for (int m = 0; m < 8; m++)
					acc[m] = fmaf(dmin, (float)(k.mn[2 * m] * x->bsums[2 * m] +
								    k.mn[2 * m + 1] * x->bsums[2 * m + 1]), acc[m]);
			} else if (dt == NF_DTYPE_Q4_K || dt == NF_DTYPE_Q5_K) {
				int32_t tot = 0;
				for (int q = 0; q < 4; q++) {
					int32_t p = k.mn[4 * q] * (x->bsums[4 * q] + x->bsums[4 * q + 1]) +
						    k.mn[4 * q + 2] * (x->bsums[4 * q + 2] + x->bsums[4 * q + 3]);
					tot += p;
					if (dt == NF_DTYPE_Q4_K)
						acc[8 + q] = fmaf(dmin, (float)p, acc[8 + q]);
				}
				if (dt == NF_DTYPE_Q5_K)
					acc[12] = fmaf(dmin, (float)tot, acc[12]);
			}
			int32_t li[8] = { 0 };
			for (uint32_t j = 0; j < nz; j++)
				li[lane[j]] += k.sc[sub[j]] *
					       (((int32_t)nf_bundle_kcol_get(col[j], r, bits) - off) * qx[j]);
			for (int m = 0; m < 8; m++)
				acc[m] = fmaf(dd, (float)li[m], acc[m]);
		}
	}
}

struct kdown_job {
	struct nf_sparse *s;
	uint32_t dt, kb0, kb1;
	float *out;                  /* final pass: the layer's output */
};

static void kdown_worker(void *arg, int ith, int nth)
{
	struct kdown_job *j = arg;
	uint32_t E = j->s->E, r0 = (uint32_t)((uint64_t)E * ith / nth), r1 = (uint32_t)((uint64_t)E * (ith + 1) / nth);
	if (!j->out) {
		kdown_rows(j->s, j->dt, j->kb0, j->kb1, r0, r1);
		return;
	}
	for (uint32_t r = r0; r < r1; r++) {
		const float *a = j->s->kacc + (size_t)r * KACC;
		float t[4];
		for (int i = 0; i < 4; i++)
			t[i] = a[i] + a[i + 4];
		float v = (t[0] + t[2]) + (t[1] + t[3]);
		if (j->dt == NF_DTYPE_Q4_K)
			v += (a[8] + a[10]) + (a[9] + a[11]);
		else if (j->dt == NF_DTYPE_Q5_K)
			v += a[12];
		j->out[r] = v;
	}
}

/* Computes the neurons of groups [g0, g1) of the current layer that mask
 * (indexed by group) selects, for the token whose prepared input is xq,
 * into out (E floats). */
static void chunk_compute(struct nf_sparse *s, uint32_t g0, uint32_t g1, const uint32_t *mask, const void *xq,
			  float *out, char *scratch)
{
	const struct nf_kernels *k = s->k;
	uint32_t layer = s->cur_layer, E = s->E;
	uint32_t ids[CHUNK_MAX], n = 0;
	float gv[2 * CHUNK_MAX], coef[CHUNK_MAX], *uv;
	const void *gp[2 * CHUNK_MAX], *up[CHUNK_MAX], *dp[CHUNK_MAX], *cols[CHUNK_MAX];
	for (uint32_t gi = g0; gi < g1; gi++) {
		uint32_t m = mask[gi];
		while (m) {
			uint32_t j = gi * GROUP + (uint32_t)__builtin_ctz(m);
			const char *g, *u, *d;
			m &= m - 1;
			neuron_addr(s, layer, j, &g, &u, &d);
			ids[n] = j;
			gp[n] = g;
			up[n] = u;
			dp[n] = d;
			gv[n] = 0.0f;
			n++;
		}
	}
	/* gate and up rows in one gather call for the chunk (exact mode:
	 * gate rows first, dropping the neurons whose gate is not positive,
	 * then the up rows of the others); each row the same sum as gemv alone */
	if (!n)
		return;
	if (s->has_gate && s->mode != NF_SPARSE_EXACT) {
		memcpy(gp + n, up, n * sizeof(*up));
		k->gemv_list[s->kt_gu](E, 2 * n, gp, xq, gv);
		uv = gv + n;
	} else {
		if (s->has_gate) {
			k->gemv_list[s->kt_gu](E, n, gp, xq, gv);
			uint32_t kept = 0;
			for (uint32_t j = 0; j < n; j++) {
				if (!(gv[j] > 0.0f))
					continue;
				ids[kept] = ids[j];
				up[kept] = up[j];
				dp[kept] = dp[j];
				gv[kept] = gv[j];
				kept++;
			}
			n = kept;
		}
		uv = gv + CHUNK_MAX;
		if (n)
			k->gemv_list[s->kt_gu](E, n, up, xq, uv);
	}

	/* per group (K-quant QCOL: per super-block): activations, rounded or
	 * quantized as one block, then the group's (coefficient, down part)
	 * pairs in neuron order */
	const struct layer_tab *tab = &s->tabs[layer];
	uint32_t dt_down = tab->dt_down;
	bool kcol = s->form == DOWN_QCOL && nf_dtype_is_kquant(dt_down);
	uint32_t unit = kcol ? NF_QK_K : GROUP;
	uint32_t ncols = 0;
	for (uint32_t j0 = 0; j0 < n;) {
		uint32_t gi = ids[j0] / unit, j1 = j0;
		float a[NF_QK_K];
		memset(a, 0, unit * sizeof(float));
		for (; j1 < n && ids[j1] / unit == gi; j1++) {
			if (s->mode == NF_SPARSE_EXACT && s->act == NF_FFN_DRELU && !(uv[j1] > 0.0f)) {
				dp[j1] = NULL;
				continue;
			}
			a[ids[j1] % unit] = act1(s->act, gv[j1], uv[j1], s->has_gate);
		}
		if (kcol) {
			/* the down product waits for the layer's activations (kdown_rows) */
			for (uint32_t j = j0; j < j1; j++)
				if (dp[j])
					s->kact[ids[j]] = a[ids[j] % unit];
		} else if (s->form == DOWN_QCOL) {
			qcol_down(s, gi, a, ids + j0, dp + j0, j1 - j0, out, scratch);
		} else if (nf_dtype_block_len(dt_down) > 1) {
			/* PowerInfer: the activation vector quantized to Q8_0;
			 * neuron i contributes d * q[i] times its dequantized down row */
			struct nf_block_q8_0 blk;
			nf_quantize_row_q8_0(a, &blk, GROUP);
			float d = nf_fp16_to_fp32(blk.d);
			for (uint32_t j = j0; j < j1; j++) {
				int8_t q = blk.qs[ids[j] % GROUP];
				if (dp[j] && q != 0) {
					coef[ncols] = d * (float)q;
					cols[ncols++] = dp[j];
				}
			}
		} else {
			/* float down rows: the activations rounded to the row's dot type */
			float ar[GROUP];
			k->act_prepare[tab->kt_down](a, scratch, GROUP);
			nf_dequantize_row(nf_ktype_dot_dtype(tab->kt_down), scratch, ar, GROUP);
			for (uint32_t j = j0; j < j1; j++) {
				float v = ar[ids[j] % GROUP];
				if (dp[j] && v != 0.0f) {
					coef[ncols] = v;
					cols[ncols++] = dp[j];
				}
			}
		}
		j0 = j1;
	}
	if (ncols)
		k->axpy_list[tab->kt_down](E, ncols, coef, cols, out);
}

/* ---- the ready list ------------------------------------------------------------ */

static void ready_push(struct nf_sparse *s, uint32_t ci)
{
	uint32_t at = atomic_fetch_add(&s->n_ready, 1);
	__atomic_store_n(&s->ready[at], ci, __ATOMIC_RELEASE);
}

/* Cache completion: bundles of neurons[0..n) are in memory (or failed). */
static void on_ready(void *user, const uint32_t *neurons, uint32_t n, int result)
{
	struct nf_sparse *s = user;
	if (result < 0) {
		int expect = 0;
		atomic_compare_exchange_strong(&s->err, &expect, result);
	}
	if (s->cache)
		atomic_store(&s->t_last_ready, now_s());
	if (s->in_batch) {
		/* a batch consumes groups in order: count per group */
		for (uint32_t k = 0; k < n; k++)
			atomic_fetch_sub(&s->groups[neurons[k] / GROUP].pending, 1);
		return;
	}
	for (uint32_t k = 0; k < n; k++) {
		uint32_t ci = s->groups[neurons[k] / GROUP].chunk;
		if (atomic_fetch_sub(&s->chunks[ci].pending, 1) == 1)
			ready_push(s, ci);
	}
}

/* Reap completions (serialised by the cache); thread 0 times its waits.
 * Returns false after recording an error. */
static bool reap_some(struct nf_sparse *s, int ith)
{
	double t0 = ith == 0 ? now_s() : 0.0;
	int rc = nf_cache_reap(s->cache, on_ready, s);
	if (ith == 0)
		s->st.t_wait += now_s() - t0;
	if (rc < 0) {
		int expect = 0;
		atomic_compare_exchange_strong(&s->err, &expect, rc);
		return false;
	}
	return true;
}

static void worker(void *arg, int ith, int nth)
{
	(void)nth;
	struct nf_sparse *s = arg;
	char *scratch = s->tscratch + (size_t)ith * s->act_stride;
	for (;;) {
		if (atomic_load(&s->err))
			return;
		uint32_t taken = atomic_load(&s->next);
		if (taken >= s->n_chunks)
			return;
		if (taken < atomic_load(&s->n_ready)) {
			if (!atomic_compare_exchange_weak(&s->next, &taken, taken + 1))
				continue;
			/* the slot may be claimed before its id is stored */
			uint32_t ci;
			while ((ci = __atomic_load_n(&s->ready[taken], __ATOMIC_ACQUIRE)) == UINT32_MAX)
				;
			float *out = s->gout + (size_t)ci * s->E;
			memset(out, 0, s->E * sizeof(float));
			const struct chunk_state *c = &s->chunks[ci];
			chunk_compute(s, c->g0, c->g1, s->gmask, s->xq, out, scratch);
			continue;
		}
		/* Nothing ready: reap completions. */
		if (!reap_some(s, ith))
			return;
	}
}

static void run_workers(struct nf_sparse *s, const struct nf_ffn_env *env, nf_pool_fn fn)
{
	if (env->pool)
		nf_pool_run(env->pool, fn, s);
	else
		fn(s, 0, 1);
}

static void run_job(const struct nf_ffn_env *env, nf_pool_fn fn, void *arg)
{
	if (env->pool)
		nf_pool_run(env->pool, fn, arg);
	else
		fn(arg, 0, 1);
}

/* K-quant down of the super-blocks holding groups [g0, g1): their Q8_K
 * activations, then every row's accumulators, rows split over threads. */
static void kdown_blocks(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t dt, uint32_t g0,
			 uint32_t g1)
{
	struct kdown_job j = { .s = s, .dt = dt, .kb0 = g0 / s->kgroups,
			       .kb1 = (g1 + s->kgroups - 1) / s->kgroups };
	nf_quantize_row_q8_K(s->kact + (size_t)j.kb0 * NF_QK_K, s->kx + j.kb0, (size_t)(j.kb1 - j.kb0) * NF_QK_K);
	run_job(env, kdown_worker, &j);
}

/* out = sum of the chunks' contributions in chunk order, each thread a
 * slice of the rows: the same sums whatever the thread count or the order
 * in which chunks became ready. */
static void reduce_worker(void *arg, int ith, int nth)
{
	struct nf_sparse *s = arg;
	size_t E = s->E, r0 = E * (size_t)ith / (size_t)nth, r1 = E * (size_t)(ith + 1) / (size_t)nth;
	float *out = s->cur_out;
	for (size_t r = r0; r < r1; r++)
		out[r] = 0.0f;
	for (uint32_t ci = 0; ci < s->n_chunks; ci++) {
		const float *g = s->gout + (size_t)ci * E;
		for (size_t r = r0; r < r1; r++)
			out[r] += g[r];
	}
}

/* ---- one token ------------------------------------------------------------------- */

static void predict(struct nf_sparse *s, const struct layer_tab *t, const float *resid)
{
	const struct nf_kernels *k = s->k;
	k->act_prepare[t->fc1->kt](resid, s->hq, s->E);
	k->gemv[t->fc1->kt](t->fc1->n, t->fc1->nrows, t->fc1->data, t->fc1->row_bytes, s->hq, s->h1);
	for (uint32_t i = 0; i < s->rank; i++)
		s->h1[i] = s->h1[i] > 0.0f ? s->h1[i] : 0.0f;
	k->act_prepare[t->fc2->kt](s->h1, s->hq, s->rank);
	k->gemv[t->fc2->kt](t->fc2->n, t->fc2->nrows, t->fc2->data, t->fc2->row_bytes, s->hq, s->score);
}

/* Neurons of group gi to compute: the predicted ones (score >= threshold,
 * after predict()), or every neuron that exists. */
static uint32_t group_mask(const struct nf_sparse *s, uint32_t gi)
{
	uint32_t m = 0, valid = gi + 1 < s->n_groups ? UINT32_MAX : s->last_mask;
	if (s->mode != NF_SPARSE_PREDICTOR)
		return valid;
	for (uint32_t i = 0; i < GROUP; i++)
		if ((valid >> i & 1u) && s->score[gi * GROUP + i] >= s->threshold)
			m |= 1u << i;
	return m;
}

/* Gate values of every neuron (in memory) for recall. */
static void measure_recall(struct nf_sparse *s, uint32_t layer)
{
	const struct layer_tab *t = &s->tabs[layer];
	if (s->cache || !t->gate)
		return;
	for (uint32_t gi = 0; gi < s->n_groups; gi++)
		for (uint32_t i = 0; i < GROUP && gi * GROUP + i < s->F; i++) {
			uint32_t j = gi * GROUP + i;
			float gv;
			s->k->gemv[s->kt_gu](s->E, 1, t->gate + (size_t)j * t->gate_stride, 0, s->xq, &gv);
			if (gv > 0.0f) {
				s->st.recall_fired++;
				s->st.recall_hit += (s->gmask[gi] >> i) & 1u;
			}
		}
}

static int token_forward(struct nf_sparse *s, const struct nf_ffn_env *env, uint32_t layer,
			 const float *x, const float *resid, float *out)
{
	const struct layer_tab *t = &s->tabs[layer];
	uint64_t later0 = s->st.groups_ready_later;
	s->cur_layer = layer;
	s->cur_scales = t->xscales ? t->xscales[s->cur_expert] : t->scales;
	s->cur_x = x;
	s->k->act_prepare[s->kt_gu](x, s->xq, s->E);
	if (s->mode == NF_SPARSE_PREDICTOR)
		predict(s, t, resid);
	bool kq = s->form == DOWN_QCOL && nf_dtype_is_kquant(t->dt_down);
	if (kq) {
		memset(s->kact, 0, s->F * sizeof(float));
		memset(s->kacc, 0, (size_t)s->E * KACC * sizeof(float));
	}

	uint64_t active = 0;
	atomic_store(&s->n_ready, 0);
	atomic_store(&s->next, 0);
	atomic_store(&s->err, 0);
	/* masks, and chunks: consecutive groups up to CHUNK_NEURONS active
	 * neurons, cut from the masks alone (invariant 2) */
	uint32_t nc = 0, in_chunk = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		uint32_t m = group_mask(s, gi);
		s->gmask[gi] = m;
		if (!m)
			continue;
		uint32_t pc = (uint32_t)__builtin_popcount(m);
		active += pc;
		struct chunk_state *c = &s->chunks[nc];
		if (!in_chunk) {
			c->g0 = gi;
			c->n_groups = 0;
		}
		c->g1 = gi + 1;
		c->n_groups++;
		s->groups[gi].chunk = nc;
		in_chunk += pc;
		if (in_chunk >= CHUNK_NEURONS && (gi + 1) % s->kgroups == 0) {
			atomic_store(&c->pending, in_chunk + 1u);
			nc++;
			in_chunk = 0;
		}
	}
	if (in_chunk)
		atomic_store(&s->chunks[nc++].pending, in_chunk + 1u);
	s->n_chunks = nc;
	for (uint32_t i = 0; i < nc; i++)
		s->ready[i] = UINT32_MAX;
	if (s->measure_recall && s->mode == NF_SPARSE_PREDICTOR)
		measure_recall(s, layer);

	if (!s->cache) {
		for (uint32_t ci = 0; ci < nc; ci++) {
			ready_push(s, ci);
			s->st.groups_ready_now += s->chunks[ci].n_groups;
		}
		run_workers(s, env, worker);
		if (kq && nc)
			kdown_blocks(s, env, t->dt_down, s->chunks[0].g0, s->chunks[nc - 1].g1);
	} else {
		/* one request for the layer; when its misses could outnumber the
		 * cold slots, windows of whole chunks, each requested, computed
		 * and released before the next (same sums: each chunk has its own
		 * output, reduced in chunk order below) */
		uint32_t n = 0;
		for (uint32_t gi = 0; gi < s->n_groups; gi++) {
			uint32_t m = s->gmask[gi];
			for (uint32_t i = 0; i < GROUP; i++)
				if (m & (1u << i))
					s->req[n++] = gi * GROUP + i;
		}
		bool whole = nf_cache_cold_needed(s->cache, layer, s->cur_expert, s->req, n) <= s->cap;
		uint32_t c0 = 0;
		while (c0 < nc) {
			uint32_t c1 = nc, w = n, first = 0;
			if (!whole) {
				/* the longest run of chunks from c0 with at most cap neurons */
				uint32_t at = 0;
				for (c1 = c0; c1 < nc; c1++) {
					uint32_t k = 0;
					for (uint32_t gi = s->chunks[c1].g0; gi < s->chunks[c1].g1; gi++)
						k += (uint32_t)__builtin_popcount(s->gmask[gi]);
					if (c1 > c0 && at + k > s->cap)
						break;
					at += k;
				}
				for (uint32_t ci = 0; ci < c0; ci++)
					for (uint32_t gi = s->chunks[ci].g0; gi < s->chunks[ci].g1; gi++)
						first += (uint32_t)__builtin_popcount(s->gmask[gi]);
				w = at;
				s->st.windows++;
			}
			atomic_store(&s->n_ready, 0);
			atomic_store(&s->next, 0);
			for (uint32_t i = 0; i < c1 - c0; i++)
				s->ready[i] = UINT32_MAX;
			s->n_chunks = c1 - c0;
			s->t_req = now_s();
			atomic_store(&s->t_last_ready, 0.0);
			uint64_t later = s->st.groups_ready_later;
			int rc = nf_cache_request(s->cache, layer, s->cur_expert, s->req + first, w, s->ptrs, on_ready, s);
			/* drop the guard count: chunks whose bundles were all hits are ready now */
			for (uint32_t ci = c0; ci < c1; ci++) {
				if (atomic_fetch_sub(&s->chunks[ci].pending, 1) == 1) {
					ready_push(s, ci);
					s->st.groups_ready_now += s->chunks[ci].n_groups;
				} else {
					s->st.groups_ready_later += s->chunks[ci].n_groups;
				}
			}
			if (rc < 0) {
				/* what was submitted must land before its slots are reused */
				nf_cache_release(s->cache);
				s->n_chunks = nc;
				return rc;
			}
			run_workers(s, env, worker);
			if (kq && !atomic_load(&s->err))
				kdown_blocks(s, env, t->dt_down, s->chunks[c0].g0, s->chunks[c1 - 1].g1);
			/* every read must have landed before its slots are reused */
			rc = nf_cache_release(s->cache);
			int err = atomic_load(&s->err);
			double last = atomic_load(&s->t_last_ready);
			if (s->st.groups_ready_later > later && last > s->t_req)
				s->st.t_io += last - s->t_req;
			if (err < 0 || rc < 0) {
				s->n_chunks = nc;
				return err < 0 ? err : rc;
			}
			c0 = c1;
		}
		s->n_chunks = nc;
	}
	(void)later0;
	if (!s->cache && atomic_load(&s->err) < 0)
		return atomic_load(&s->err);
	s->cur_out = out;
	if (kq) {
		struct kdown_job kj = { .s = s, .dt = t->dt_down, .out = out };
		run_job(env, kdown_worker, &kj);
	} else {
		run_workers(s, env, reduce_worker);
	}
	s->st.ffn_calls++;
	s->st.neurons_total += s->F;
	s->st.neurons_active += active;
	return 0;
}

/* ---- a batch of tokens from the cache (prefill) ------------------------------------ */

/*
 * Thread ith's share of a batch: tokens [b0, b1). Walks the layer's groups
 * in group order, waiting (reaping) until each group's bundles are in
 * memory; each token cuts its own chunks from its own masks exactly as
 * token_forward does, and a chunk that closes is computed and added to the
 * token's output at once: out = 0, then += each chunk in chunk order, the
 * sums reduce_worker makes for one token.
 */
static void batch_worker(void *arg, int ith, int nth)
{
	struct nf_sparse *s = arg;
	size_t nb = s->cur_nb, E = s->E;
	size_t b0 = nb * (size_t)ith / (size_t)nth, b1 = nb * (size_t)(ith + 1) / (size_t)nth;
	char *scratch = s->tscratch + (size_t)ith * s->act_stride;
	float *g = s->bsum + (size_t)ith * E;
	for (size_t b = b0; b < b1; b++) {
		memset(s->cur_out + b * E, 0, E * sizeof(float));
		s->bchunk[2 * b] = 0;
		s->bchunk[2 * b + 1] = 0;
	}
	for (uint32_t gi = 0; gi <= s->n_groups; gi++) {
		bool last = gi == s->n_groups;
		if (!last && !s->gmask[gi])
			continue;
		while (!last && atomic_load(&s->groups[gi].pending) != 0)
			if (atomic_load(&s->err) || !reap_some(s, ith))
				return;
		for (size_t b = b0; b < b1; b++) {
			const uint32_t *bm = s->bmask + b * s->n_groups;
			uint32_t *open = s->bchunk + 2 * b;
			if (!last) {
				if (!bm[gi])
					continue;
				if (!open[1])
					open[0] = gi;
				open[1] += (uint32_t)__builtin_popcount(bm[gi]);
				if (open[1] < CHUNK_NEURONS || (gi + 1) % s->kgroups)
					continue;
			} else if (!open[1]) {
				continue;
			}
			memset(g, 0, E * sizeof(float));
			chunk_compute(s, open[0], last ? s->n_groups : gi + 1, bm, s->bxq + b * s->xq_size, g, scratch);
			float *out = s->cur_out + b * E;
			for (size_t r = 0; r < E; r++)
				out[r] += g[r];
			open[1] = 0;
		}
	}
}

/*
 * Tokens x[0..nb) of one layer with a cache: one request for every neuron
 * any of them needs (for a long prompt nearly the whole FFN: adjacent
 * misses coalesce into reads of up to max_coalesce bytes, the FFN read as
 * large sequential extents), and compute proceeds group by group as those
 * reads land. Same results, bit for bit, as the tokens one at a time.
 */
#define BATCH_TOO_BIG 1

static int batch_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	const struct layer_tab *t = &s->tabs[io->layer];
	uint64_t later0 = s->st.groups_ready_later, active = 0;
	s->cur_layer = io->layer;
	s->cur_scales = t->scales;
	s->cur_nb = io->nb;
	s->cur_out = io->out;
	memset(s->gmask, 0, s->n_groups * sizeof(uint32_t));
	for (size_t b = 0; b < io->nb; b++) {
		s->k->act_prepare[s->kt_gu](io->x + b * s->E, s->bxq + b * s->xq_size, s->E);
		if (s->mode == NF_SPARSE_PREDICTOR)
			predict(s, t, io->resid + b * s->E);
		uint32_t *bm = s->bmask + b * s->n_groups;
		for (uint32_t gi = 0; gi < s->n_groups; gi++) {
			uint32_t m = group_mask(s, gi);
			bm[gi] = m;
			s->gmask[gi] |= m;
			active += (uint64_t)__builtin_popcount(m);
		}
	}
	uint32_t n = 0;
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		uint32_t m = s->gmask[gi];
		for (uint32_t i = 0; i < GROUP; i++)
			if (m & (1u << i))
				s->req[n++] = gi * GROUP + i;
	}
	/* more misses than cold slots: the caller halves the batch */
	if (nf_cache_cold_needed(s->cache, io->layer, 0, s->req, n) > s->cap)
		return BATCH_TOO_BIG;
	/* for the online hot set, count each token's own neurons; the request
	 * of the union counts once more, standing in for the last */
	for (size_t b = 0; b + 1 < io->nb; b++) {
		const uint32_t *bm = s->bmask + b * s->n_groups;
		uint32_t k = 0;
		for (uint32_t gi = 0; gi < s->n_groups; gi++)
			for (uint32_t m = bm[gi]; m; m &= m - 1)
				s->req[n + k++] = gi * GROUP + (uint32_t)__builtin_ctz(m);
		nf_cache_count(s->cache, io->layer, 0, s->req + n, k);
	}
	atomic_store(&s->err, 0);
	for (uint32_t gi = 0; gi < s->n_groups; gi++)
		atomic_store(&s->groups[gi].pending, (unsigned)__builtin_popcount(s->gmask[gi]));
	s->in_batch = true;
	s->t_req = now_s();
	atomic_store(&s->t_last_ready, 0.0);
	int rc = nf_cache_request(s->cache, io->layer, 0, s->req, n, s->ptrs, on_ready, s);
	for (uint32_t gi = 0; gi < s->n_groups; gi++) {
		if (!s->gmask[gi])
			continue;
		if (atomic_load(&s->groups[gi].pending) == 0)
			s->st.groups_ready_now++;
		else
			s->st.groups_ready_later++;
	}
	if (rc >= 0) {
		run_workers(s, env, batch_worker);
		rc = 0;
	}
	int err = atomic_load(&s->err);
	int rrc = nf_cache_release(s->cache);
	s->in_batch = false;
	if (!err)
		err = rc < 0 ? rc : rrc < 0 ? rrc : 0;
	double last = atomic_load(&s->t_last_ready);
	if (s->st.groups_ready_later > later0 && last > s->t_req)
		s->st.t_io += last - s->t_req;
	if (err < 0)
		return err;
	s->st.ffn_calls += io->nb;
	s->st.neurons_total += (uint64_t)s->F * io->nb;
	s->st.neurons_active += active;
	return 0;
}

/* ---- mixture of experts from a cache --------------------------------------------- */

/*
 * Each token: the router (the built-in FFN's, nf_ctx_moe_route), then each
 * routed expert in rank order as a dense FFN through the cache (one request
 * for its neurons), then out = sum over ranks of w * expert(x), summed as
 * the built-in FFN does.
 */
static int moe_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	const int32_t *sel;
	const float *w;
	int rc = nf_ctx_moe_route(s->ctx, io, &sel, &w);
	size_t E = s->E, U = s->n_expert_used;
	for (size_t b = 0; b < io->nb && rc == 0; b++) {
		for (size_t k = 0; k < U && rc == 0; k++) {
			s->cur_expert = (uint32_t)sel[b * U + k];
			rc = token_forward(s, env, io->layer, io->x + b * E, io->resid + b * E, s->eout + k * E);
		}
		float *o = io->out + b * E;
		for (size_t i = 0; i < E && rc == 0; i++) {
			float acc = 0.0f;
			for (size_t k = 0; k < U; k++)
				acc += s->eout[k * E + i] * w[b * U + k];
			o[i] = acc;
		}
	}
	s->cur_expert = 0;
	return rc;
}

/* Tokens of io: from a cache as one batch, or halves of it while the
 * union's misses outnumber the cold slots (each token's sums are its own,
 * so any split gives the same output), else one at a time. */
static int tokens_forward(struct nf_sparse *s, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	/* K-quant downs: token by token (their exact down needs a layer's
	 * activations per token; the batch path keeps none) */
	if (s->cache && io->nb > 1 && io->nb <= s->n_batch && s->kgroups == 1) {
		int rc = batch_forward(s, env, io);
		if (rc != BATCH_TOO_BIG)
			return rc;
		s->st.batch_splits++;
		size_t h = io->nb / 2, E = s->E;
		struct nf_ffn_io a = *io, b = *io;
		a.nb = h;
		b.nb = io->nb - h;
		b.x += h * E;
		b.resid += h * E;
		b.out += h * E;
		if ((rc = tokens_forward(s, env, &a)) < 0)
			return rc;
		return tokens_forward(s, env, &b);
	}
	int rc = 0;
	for (size_t b = 0; b < io->nb && rc == 0; b++)
		rc = token_forward(s, env, io->layer, io->x + b * s->E, io->resid + b * s->E, io->out + b * s->E);
	return rc;
}

static int sparse_forward(void *self, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	struct nf_sparse *s = self;
	if (!s->tabs[io->layer].sparse)
		return nf_ctx_ffn_builtin(s->ctx, io);
	int rc = 0;
	if (s->cache && s->hot_after && io->layer == 0) {
		/* between tokens: no slot of any layer is in use */
		if (s->tokens >= s->next_hot) {
			double th = now_s();
			if ((rc = nf_cache_hot_load(s->cache)) < 0)
				return rc;
			s->st.hot_loads++;
			s->st.t_hot += now_s() - th;
			s->next_hot = s->tokens + 16ull * s->hot_after;
		}
		s->tokens += io->nb;
	}
	double t0 = now_s();
	if (s->n_expert)
		rc = moe_forward(s, env, io);
	else
		rc = tokens_forward(s, env, io);
	s->st.t_ffn += now_s() - t0;
	return rc;
}

/* ---- set-up ------------------------------------------------------------------------ */

/* calloc counted in s->bytes; in a sizing pass (nf_sparse_bytes_for) only
 * counted, returning a pointer that is never dereferenced */
static void *zalloc(struct nf_sparse *s, size_t n)
{
	if (s->count_only) {
		s->bytes += n;
		return s;
	}
	void *p = calloc(1, n ? n : 1);
	if (p)
		s->bytes += n;
	return p;
}

/* The per-call, per-thread and batch scratch: everything forward() needs
 * beyond the layer tables, sized from s's geometry (E, F, kt_gu, n_expert,
 * threads) and ctx's batch. The one place this arithmetic lives: the
 * engine sizes its budget from it (nf_sparse_bytes_for). */
static int scratch(struct nf_sparse *s, const struct nf_ctx *ctx)
{
	const struct nf_model *m = nf_ctx_model(ctx);
	size_t xq = nf_act_size(s->kt_gu, s->E);
	size_t hq = 0;
	if (s->rank) {
		const struct nf_layer_weights *L = nf_model_layer(m, 0);
		size_t a = nf_act_size(L->fc1.kt, s->E), b = nf_act_size(L->fc2.kt, s->rank);
		hq = a > b ? a : b;
	}
	s->act_stride = (size_t)s->E * sizeof(int32_t) + 256;
	s->xq_size = (xq + 63) & ~(size_t)63;
	s->n_batch = s->cache && !s->n_expert ? nf_ctx_n_batch(ctx) : 0;
	/* every chunk but the last holds CHUNK_NEURONS active neurons or more */
	s->max_chunks = s->F / CHUNK_NEURONS + 1;
	if (!(s->xq = zalloc(s, xq)) || !(s->hq = zalloc(s, hq + 64)) ||
	    !(s->h1 = zalloc(s, (s->rank + 1) * sizeof(float))) ||
	    !(s->score = zalloc(s, s->F * sizeof(float))) ||
	    !(s->groups = zalloc(s, s->n_groups * sizeof(*s->groups))) ||
	    !(s->gmask = zalloc(s, s->n_groups * sizeof(uint32_t))) ||
	    !(s->chunks = zalloc(s, s->max_chunks * sizeof(*s->chunks))) ||
	    !(s->ready = zalloc(s, s->max_chunks * sizeof(uint32_t))) ||
	    !(s->ptrs = zalloc(s, s->F * sizeof(void *))) ||
	    !(s->req = zalloc(s, 2ull * s->F * sizeof(uint32_t))) ||
	    !(s->gout = zalloc(s, (size_t)s->max_chunks * s->E * sizeof(float))) ||
	    !(s->tscratch = zalloc(s, (size_t)s->nth * s->act_stride)) ||
	    (s->n_expert && !(s->eout = zalloc(s, (size_t)s->n_expert_used * s->E * sizeof(float)))))
		return -ENOMEM;
	if (s->kgroups > 1 &&
	    (!(s->kact = zalloc(s, s->F * sizeof(float))) ||
	     !(s->kx = zalloc(s, (size_t)(s->F / NF_QK_K) * sizeof(struct nf_block_q8_K))) ||
	     !(s->kacc = zalloc(s, (size_t)s->E * KACC * sizeof(float)))))
		return -ENOMEM;
	if (s->n_batch > 1 &&
	    (!(s->bxq = zalloc(s, (size_t)s->n_batch * s->xq_size)) ||
	     !(s->bmask = zalloc(s, (size_t)s->n_batch * s->n_groups * sizeof(uint32_t))) ||
	     !(s->bchunk = zalloc(s, (size_t)s->n_batch * 2 * sizeof(uint32_t))) ||
	     !(s->bsum = zalloc(s, (size_t)s->nth * s->E * sizeof(float)))))
		return -ENOMEM;
	return 0;
}

/* Repack a regular down matrix [E rows x F] into per-neuron parts. */
static int tab_down_regular(struct nf_sparse *s, struct layer_tab *t, const struct nf_weight *w)
{
	uint32_t E = s->E, F = s->F;
	if (w->dtype == NF_DTYPE_F32 || w->dtype == NF_DTYPE_F16 || w->dtype == NF_DTYPE_BF16) {
		size_t esz = w->dtype == NF_DTYPE_F32 ? 4 : 2;
		char *o = zalloc(s, (size_t)F * E * esz);
		if (!o)
			return -ENOMEM;
		for (uint32_t r = 0; r < E; r++) {
			const char *row = (const char *)w->data + (size_t)r * w->row_bytes;
			for (uint32_t j = 0; j < F; j++)
				memcpy(o + ((size_t)j * E + r) * esz, row + (size_t)j * esz, esz);
		}
		t->owned = o;
		t->down = o;
		t->down_stride = (size_t)E * esz;
		return 0;
	}
	if (nf_dtype_is_kquant(w->dtype)) {
		/* K-quant QCOL: bit-packed columns and the blocks' heads, as a
		 * store holds them (nflash/bundle.h) */
		struct nf_bundle_src src = { .down = w->data, .dtype_down = w->dtype, .n_embd = E, .n_ff = F };
		uint64_t shape[2];
		struct nf_bundle_layout L = { .dtype = w->dtype, .dim = E, .n_neurons = F,
					      .down_form = NF_DOWN_QCOL, .down_dtype = w->dtype };
		L.down_bytes = (uint32_t)((uint64_t)E * nf_kquant_bits(w->dtype) / 8);
		L.bundle_bytes = L.stride = L.down_bytes;
		nf_bundle_scales_shape(&L, shape);
		size_t colb = (size_t)F * L.down_bytes;
		char *o = zalloc(s, colb + (size_t)(shape[0] * shape[1]) * sizeof(uint16_t));
		if (!o)
			return -ENOMEM;
		if (!s->count_only) {
			nf_bundle_pack_down_columns(&src, &L, 0, F, o);
			nf_bundle_pack_scales(&src, (uint16_t *)(o + colb));
		}
		t->owned = o;
		t->down = o;
		t->down_stride = L.down_bytes;
		t->scales = (const uint16_t *)(o + colb);
		return 0;
	}
	/* quantized: QCOL columns and fp16 scales d[b][r] */
	bool q8 = w->dtype == NF_DTYPE_Q8_0;
	size_t col = q8 ? E : E / 2;
	char *o = zalloc(s, (size_t)F * col + (size_t)(F / GROUP) * E * sizeof(uint16_t));
	if (!o)
		return -ENOMEM;
	uint16_t *sc = (uint16_t *)(o + (size_t)F * col);
	for (uint32_t r = 0; r < E; r++) {
		const char *row = (const char *)w->data + (size_t)r * w->row_bytes;
		for (uint32_t b = 0; b < F / GROUP; b++) {
			int8_t q[GROUP];
			if (q8) {
				const struct nf_block_q8_0 *blk = (const struct nf_block_q8_0 *)row + b;
				sc[(size_t)b * E + r] = blk->d;
				memcpy(q, blk->qs, GROUP);
			} else {
				const struct nf_block_q4_0 *blk = (const struct nf_block_q4_0 *)row + b;
				sc[(size_t)b * E + r] = blk->d;
				for (uint32_t i = 0; i < GROUP / 2; i++) {
					q[i] = (int8_t)((blk->qs[i] & 0x0f) - 8);
					q[i + GROUP / 2] = (int8_t)((blk->qs[i] >> 4) - 8);
				}
			}
			for (uint32_t i = 0; i < GROUP; i++) {
				char *c = o + (size_t)(b * GROUP + i) * col;
				if (q8) {
					c[r] = (char)q[i];
				} else {
					uint8_t nib = (uint8_t)(q[i] + 8);
					uint8_t *byte = (uint8_t *)c + r / 2;
					*byte = (r & 1) ? (uint8_t)((*byte & 0x0f) | (nib << 4))
							: (uint8_t)((*byte & 0xf0) | nib);
				}
			}
		}
	}
	t->owned = o;
	t->down = o;
	t->down_stride = col;
	t->scales = sc;
	return 0;
}

static enum nf_sparse_mode resolve_mode(const struct nf_model_hparams *hp, bool has_pred,
					enum nf_sparse_mode m)
{
	if (m != NF_SPARSE_AUTO)
		return m;
	if (has_pred)
		return NF_SPARSE_PREDICTOR;
	return hp->act == NF_FFN_SILU ? NF_SPARSE_DENSE : NF_SPARSE_EXACT;
}

int nf_sparse_open(struct nf_ctx *ctx, const struct nf_sparse_params *p, struct nf_sparse **out,
		   struct nf_diag *diag)
{
	const struct nf_model *m = nf_ctx_model(ctx);
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	int rc = -ENOMEM;
	struct nf_sparse *s = calloc(1, sizeof(*s));
	if (!s)
		return nf_diag_fail(diag, -ENOMEM, "sparse engine: out of memory");
	s->bytes = sizeof(*s);
	s->ctx = ctx;
	s->m = m;
	s->k = nf_ctx_kernels(ctx);
	s->E = hp->n_embd;
	s->F = hp->n_ff;
	s->n_layer = hp->n_layer;
	s->act = hp->act;
	s->cache = p->cache;
	if (s->cache) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(s->cache, &cl);
		s->cap = cl.cold_slots;
	}
	s->nth = nf_ctx_n_threads(ctx) > 0 ? nf_ctx_n_threads(ctx) : 1;
	s->ops = (struct nf_ffn_ops){ .name = "sparse", .forward = sparse_forward };

	bool has_pred = !hp->n_expert;
	for (uint32_t il = 0; il < hp->n_layer; il++)
		has_pred &= nf_model_layer(m, il)->fc1.data != NULL;
	s->mode = resolve_mode(hp, has_pred, p->mode);
	s->threshold = p->threshold_set ? p->threshold : hp->sparse_threshold;
	s->measure_recall = p->measure_recall;
	s->hot_after = p->hot_after;
	s->next_hot = p->hot_after;
	if (s->mode == NF_SPARSE_OFF) {
		*out = s;
		return 0;
	}
	if (hp->n_expert && (!s->cache || s->mode != NF_SPARSE_DENSE)) {
		rc = nf_diag_fail(diag, NF_EUNSUPPORTED,
				  s->cache ? "--sparse-mode %s: the experts of a mixture-of-experts model stream from "
					     "the store as dense FFNs only (--sparse-mode dense)"
					   : "--sparse-mode %s: mixture-of-experts FFNs are not sparse in memory (use "
					     "--sparse-mode off)",
				  nf_sparse_mode_name(s->mode));
		goto fail;
	}
	s->n_expert = hp->n_expert;
	s->n_expert_used = hp->n_expert_used;
	if (s->mode == NF_SPARSE_PREDICTOR && !has_pred) {
		rc = nf_diag_fail(diag, NF_EUSAGE,
				  "--sparse-mode predictor: the model has no predictor (blk.N.fc1/fc2)");
		goto fail;
	}
	if (s->mode == NF_SPARSE_EXACT && hp->act == NF_FFN_SILU) {
		rc = nf_diag_fail(diag, NF_EUSAGE,
				  "--sparse-mode exact: needs a ReLU or dReLU model; this one is %s",
				  nf_ffn_act_name(hp->act));
		goto fail;
	}
	s->n_groups = (s->F + GROUP - 1) / GROUP;
	s->last_mask = s->F % GROUP ? (1u << (s->F % GROUP)) - 1u : UINT32_MAX;

	const struct nf_layer_weights *L0 = nf_model_layer(m, 0);
	bool quant_down;
	if (s->cache) {
		/* the bundles' geometry comes from the store */
		struct nf_cache_geom g;
		nf_cache_geometry(s->cache, &g);
		if (g.dim != s->E || g.n_neurons != s->F || g.n_layer < hp->n_layer) {
			rc = nf_diag_fail(diag, NF_EUSAGE,
					  "sparse FFN: the store's bundles (dim %u, %u neurons, %u layers) do not match the "
					  "model (n_embd %u, n_ff %u, %u layers)",
					  g.dim, g.n_neurons, g.n_layer, s->E, s->F, hp->n_layer);
			goto fail;
		}
		s->has_gate = g.has_gate;
		s->dt_gu = g.dtype;
		s->dt_down = g.down_dtype;
		s->form = g.down_form == NF_CACHE_DOWN_QCOL ? DOWN_QCOL : DOWN_ROW;
		s->up_off_bundle = g.has_gate ? g.row_bytes : 0;
		s->down_off_bundle = g.down_off;
		if (L0->up.data && (L0->up.dtype != s->dt_gu || (L0->gate.data != NULL) != s->has_gate)) {
			rc = nf_diag_fail(diag, NF_EUSAGE, "sparse FFN: the store's bundles are %s, the model's FFN %s",
					  nf_dtype_name(s->dt_gu), nf_dtype_name(L0->up.dtype));
			goto fail;
		}
	} else {
		s->has_gate = L0->gate.data != NULL;
		s->dt_gu = L0->up.dtype;
		const struct nf_weight *dw = L0->down_t.data ? &L0->down_t : &L0->down;
		s->dt_down = dw->dtype;
		bool q = nf_dtype_block_len(s->dt_down) > 1;
		s->form = (!L0->down_t.data && q) ? DOWN_QCOL : DOWN_ROW;
		if (!L0->up.data) {
			rc = nf_diag_fail(diag, NF_EUSAGE,
					  "sparse FFN: the model's FFN weights are not in memory (a store): give a cache");
			goto fail;
		}
	}
	quant_down = nf_dtype_block_len(s->dt_down) > 1;
	s->kgroups = s->form == DOWN_QCOL && nf_dtype_is_kquant(s->dt_down) ? NF_QK_K / GROUP : 1;
	if (quant_down && s->F % (GROUP * s->kgroups)) {
		rc = nf_diag_fail(diag, NF_EFORMAT, "sparse FFN: %s down with n_ff %u not a multiple of %u",
				  nf_dtype_name(s->dt_down), s->F, GROUP * s->kgroups);
		goto fail;
	}
	if (s->cache && s->kgroups > 1 && s->cap < CHUNK_MAX) {
		rc = nf_diag_fail(diag, NF_EBUDGET,
				  "sparse FFN: a %s down needs a cold segment of at least %u bundles (one chunk of "
				  "whole 256-neuron super-blocks); the cache has %u (--cold-slots)",
				  nf_dtype_name(s->dt_down), CHUNK_MAX, s->cap);
		goto fail;
	}
	s->kt_gu = nf_ktype_of(s->dt_gu);
	s->kt_down = nf_ktype_of(s->dt_down);
	if (s->kt_gu < 0 || s->kt_down < 0 || (!s->cache && s->has_gate && L0->gate.dtype != s->dt_gu)) {
		rc = nf_diag_fail(diag, NF_EUNSUPPORTED, "sparse FFN: weight types %s/%s have no bundle form",
				  nf_dtype_name(s->dt_gu), nf_dtype_name(s->dt_down));
		goto fail;
	}

	if (!(s->tabs = zalloc(s, hp->n_layer * sizeof(*s->tabs))))
		goto nomem;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		struct layer_tab *t = &s->tabs[il];
		t->sparse = true;
		t->fc1 = L->fc1.data ? &L->fc1 : NULL;
		t->fc2 = L->fc2.data ? &L->fc2 : NULL;
		if (t->fc2 && t->fc2->nrows != s->F) {
			rc = nf_diag_fail(diag, NF_EFORMAT, "blk.%u.fc2: %u outputs, n_ff is %u", il, t->fc2->nrows, s->F);
			goto fail;
		}
		if (t->fc1)
			s->rank = t->fc1->nrows > s->rank ? t->fc1->nrows : s->rank;
		/* K-quant downs may change type from layer to layer (llama-quantize's
		 * _M recipes); any other type is the same in every layer */
		t->dt_down = s->dt_down;
		struct nf_bundle_layout bl;
		if (s->cache && nf_model_ffn_layout(m, il, 0, NULL, &bl, NULL, NULL) == 0)
			t->dt_down = bl.down_dtype;
		else if (!s->cache)
			t->dt_down = L->down_t.data ? L->down_t.dtype : L->down.dtype;
		t->kt_down = nf_ktype_of(t->dt_down);
		if (t->dt_down != s->dt_down &&
		    (!nf_dtype_is_kquant(t->dt_down) || !nf_dtype_is_kquant(s->dt_down) || s->form != DOWN_QCOL ||
		     t->kt_down < 0)) {
			rc = nf_diag_fail(diag, NF_EUNSUPPORTED,
					  "sparse FFN: layer %u's down matrix is %s, layer 0's %s (only K-quant down "
					  "matrices may differ per layer)", il, nf_dtype_name(t->dt_down),
					  nf_dtype_name(s->dt_down));
			goto fail;
		}
		if (s->cache) {
			if (s->form != DOWN_QCOL)
				continue;
			uint32_t nx = s->n_expert ? s->n_expert : 1;
			if (s->n_expert && !(t->xscales = zalloc(s, nx * sizeof(*t->xscales))))
				goto nomem;
			for (uint32_t e = 0; e < nx; e++) {
				const uint16_t *sc = NULL;
				if (nf_model_ffn_layout(m, il, e, NULL, NULL, &sc, NULL) < 0 || !sc) {
					rc = nf_diag_fail(diag, NF_EUNSUPPORTED,
							  "sparse FFN: layer %u expert %u: QCOL bundles need their scales: run "
							  "the store itself (-m STORE), not a GGUF with --ffn-store", il, e);
					goto fail;
				}
				if (s->n_expert)
					t->xscales[e] = sc;
				else
					t->scales = sc;
			}
			continue;
		}
		t->gate = L->gate.data;
		t->gate_stride = L->gate.row_bytes;
		t->up = L->up.data;
		t->up_stride = L->up.row_bytes;
		if (L->up.dtype != s->dt_gu) {
			rc = nf_diag_fail(diag, NF_EUNSUPPORTED, "sparse FFN: layer %u has other weight types than layer 0", il);
			goto fail;
		}
		if (L->down_t.data) {
			t->down = L->down_t.data;
			t->down_stride = L->down_t.row_bytes;
		} else if ((rc = tab_down_regular(s, t, &L->down)) < 0) {
			goto nomem;
		}
	}

	if (scratch(s, ctx) < 0)
		goto nomem;

	for (uint32_t il = 0; il < hp->n_layer; il++)
		nf_ctx_set_ffn(ctx, il, &s->ops, s);
	*out = s;
	return 0;
nomem:
	if (rc == -ENOMEM || rc == 0)
		rc = nf_diag_fail(diag, -ENOMEM, "sparse engine: out of memory");
fail:
	nf_sparse_close(s);
	return rc;
}

uint64_t nf_sparse_bytes_for(const struct nf_ctx *ctx, const struct nf_cache_geom *g)
{
	const struct nf_model *m = nf_ctx_model(ctx);
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	struct nf_sparse s = { .count_only = true, .bytes = sizeof(struct nf_sparse) };
	s.cache = (struct nf_cache *)&s; /* only tested for NULL: "from a cache" */
	s.E = hp->n_embd;
	s.F = hp->n_ff;
	s.n_layer = hp->n_layer;
	s.n_expert = hp->n_expert;
	s.n_expert_used = hp->n_expert_used;
	s.nth = nf_ctx_n_threads(ctx) > 0 ? nf_ctx_n_threads(ctx) : 1;
	s.n_groups = (s.F + GROUP - 1) / GROUP;
	s.kgroups = g->down_form == NF_CACHE_DOWN_QCOL && nf_dtype_is_kquant(g->down_dtype) ? NF_QK_K / GROUP : 1;
	s.kt_gu = nf_ktype_of(g->dtype);
	if (s.kt_gu < 0)
		return 0;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		if (L->fc1.data && L->fc1.nrows > s.rank)
			s.rank = L->fc1.nrows;
	}
	zalloc(&s, hp->n_layer * sizeof(struct layer_tab));
	if (s.n_expert && g->down_form == NF_CACHE_DOWN_QCOL)
		zalloc(&s, (size_t)hp->n_layer * s.n_expert * sizeof(const uint16_t *));
	scratch(&s, ctx);
	return s.bytes;
}

void nf_sparse_close(struct nf_sparse *s)
{
	if (!s)
		return;
	if (s->tabs) {
		for (uint32_t il = 0; il < s->n_layer; il++) {
			nf_ctx_set_ffn(s->ctx, il, NULL, NULL);
			free(s->tabs[il].owned);
			free(s->tabs[il].xscales);
		}
	}
	free(s->tabs);
	free(s->xq);
	free(s->hq);
	free(s->h1);
	free(s->score);
	free(s->groups);
	free(s->chunks);
	free(s->ready);
	free(s->ptrs);
	free(s->req);
	free(s->gout);
	free(s->tscratch);
	free(s->kact);
	free(s->kx);
	free(s->kacc);
	free(s->gmask);
	free(s->bxq);
	free(s->bmask);
	free(s->bchunk);
	free(s->bsum);
	free(s->eout);
	free(s);
}

enum nf_sparse_mode nf_sparse_mode_of(const struct nf_sparse *s)
{
	return s->mode;
}

float nf_sparse_threshold(const struct nf_sparse *s)
{
	return s->threshold;
}

uint64_t nf_sparse_bytes(const struct nf_sparse *s)
{
	return s->bytes;
}

void nf_sparse_stats_get(const struct nf_sparse *s, struct nf_sparse_stats *out)
{
	*out = s->st;
}

void nf_sparse_stats_reset(struct nf_sparse *s)
{
	memset(&s->st, 0, sizeof(s->st));
}
void nf_sparse_ffn_ops(const struct nf_sparse *s, const struct nf_ffn_ops **ops, void **self)
{
	*ops = &s->ops;
	*self = (void *)s;
}
