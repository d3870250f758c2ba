/*
 * nflash/model.h - a LLaMA-family transformer on GGUF weights.
 *
 * Two objects, as in llama.cpp:
 *  - struct nf_model: hyperparameters and weights of one GGUF file, read
 *    in place from a read-only mapping. Immutable after load; many
 *    contexts may share one model.
 *  - struct nf_ctx: everything one sequence needs to run: KV cache (F32 or
 *    F16), scratch for a batch of up to n_batch tokens, the thread pool and
 *    the kernel table. All of it is allocated by nf_ctx_open(); running the
 *    model never allocates.
 *
 *	struct nf_model *m;
 *	struct nf_diag d = {0};
 *	if (nf_model_load("tiny.gguf", NULL, &m, &d) < 0) die(d.msg);
 *	struct nf_ctx_params cp = nf_ctx_defaults();
 *	cp.n_threads = 2;
 *	struct nf_ctx *c;
 *	nf_ctx_open(m, &cp, &c, &d);
 *	nf_ctx_eval(c, prompt, n_prompt);               // prefill, batched (gemm)
 *	const float *logits = nf_ctx_logits(c);          // last position
 *	int32_t next = nf_sampler_argmax(logits, nf_model_hparams(m)->n_vocab);
 *	nf_ctx_eval(c, &next, 1);                        // decode (gemv)
 *	nf_ctx_close(c); nf_model_free(m);
 *
 * Each layer is attention then FFN, and the FFN is reached only through
 * struct nf_ffn_ops, so the pipeline can replace a layer's dense FFN with a
 * sparse or streamed one (nf_ctx_set_ffn) without touching attention.
 *
 * Thread-safety: a model is read-only and may be shared. A context is used
 * by one thread at a time (it drives its own pool).
 */
#ifndef NFLASH_MODEL_H
#define NFLASH_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_gguf;
struct nf_kernels;
struct nf_pool;

enum nf_ffn_act {
	NF_FFN_SILU,   /* SwiGLU: silu(gate) * up */
	NF_FFN_RELU,   /* ReGLU: relu(gate) * up */
	NF_FFN_DRELU,  /* relu(gate) * relu(up) (TurboSparse, Bamboo) */
};

/* "silu", "relu", "drelu". */
const char *nf_ffn_act_name(enum nf_ffn_act a);

struct nf_model_hparams {
	char arch[32];          /* general.architecture ("llama") */
	uint32_t n_vocab;
	uint32_t n_embd;
	uint32_t n_layer;
	uint32_t n_head;
	uint32_t n_head_kv;     /* query head h reads KV head h / (n_head / n_head_kv) */
	uint32_t head_dim;      /* n_embd / n_head */
	uint32_t n_rot;         /* rope.dimension_count; equals head_dim */
	uint32_t n_ff;          /* per expert for MoE */
	uint32_t n_ctx_train;   /* context_length */
	uint32_t n_expert;      /* 0: dense FFN */
	uint32_t n_expert_used;
	float rope_freq_base;
	float rope_freq_scale; /* 1 / rope.scaling.factor */
	float rms_eps;
	enum nf_ffn_act act;
	const char *act_source; /* which metadata decided act (static string) */
	bool powerinfer;        /* PWRI file: predictors and ffn_down_t */
	float sparse_threshold; /* powerinfer.sparse_threshold (0 when absent) */
	int32_t bos_id, eos_id; /* -1 when absent */
};

/*
 * A weight matrix as the kernels see it: nrows rows of n values of dtype,
 * row_bytes apart, starting at data. For the 3-D expert tensors, expert e's
 * matrix starts at data + e * expert_bytes.
 */
struct nf_weight {
	const char *name;      /* the GGUF tensor name (owned by the reader) */
	const void *data;
	uint32_t dtype;        /* enum nf_dtype */
	int kt;                /* enum nf_ktype */
	uint32_t n;            /* row length (input dimension) */
	uint32_t nrows;        /* output dimension */
	size_t row_bytes;
	uint32_t n_expert;     /* 1 for 2-D tensors */
	size_t expert_bytes;
	/* 1: rows repacked into 8-row groups (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K:
	 * struct nf_block_q4_0x8 etc., nf_model_repack); read only through
	 * the kernels' gemv_x8/gemm_x8. */
	uint32_t packed;
};

/* Expert e's matrix of a stacked 3-D weight, as a 2-D view (data NULL
 * stays NULL; a 2-D weight's expert 0 is itself). */
struct nf_weight nf_weight_expert(const struct nf_weight *w, uint32_t e);

/* One layer's weights. Unused matrices have data == NULL. */
struct nf_layer_weights {
	const float *attn_norm;          /* n_embd */
	struct nf_weight wq, wk, wv, wo;
	const float *ffn_norm;           /* n_embd */
	/* dense FFN: down is [n_embd rows x n_ff], or, in PowerInfer files,
	 * down_t is [n_ff rows x n_embd] (row j = down column j) */
	struct nf_weight gate, up, down, down_t;
	/* MoE: router [n_expert x n_embd] (F32), experts stacked in 3-D */
	struct nf_weight router, gate_exps, up_exps, down_exps;
	/* PowerInfer predictor (parsed, unused by the dense path) */
	struct nf_weight fc1, fc2;
};

struct nf_model;

/* Load options; NULL means defaults. */
struct nf_model_opts {
	bool prefault;  /* touch every weight page at load (default true) */
	/* Store-backed models only: read every FFN bundle at load and unpack
	 * them into GGUF-layout matrices, so the built-in dense/MoE FFN runs
	 * (a simple, correct provider; costs the whole FFN in memory). Without
	 * it the FFN weights stay in the store for the pipeline to stream, and
	 * the built-in FFN refuses to run (nf_ctx_eval returns NF_EUNSUPPORTED)
	 * until nf_ctx_set_ffn() gives every layer a provider. */
	bool store_unpack_ffn;
	/* Store-backed models only: leave the attention matrices (attn_q,
	 * attn_k, attn_v, attn_output of every layer) in the store. They are
	 * bound without data; nf_ctx_eval returns NF_EUNSUPPORTED until
	 * nf_model_attn_load() reads them or the context streams them
	 * (nf_ctx_stream_attn). Lets a caller decide after sizing the budget. */
	bool store_defer_attn;
};

/*
 * nf_model_load - open the GGUF at path (mapped read-only), read the
 * hyperparameters from its metadata and bind every tensor the architecture
 * needs, checking names, shapes and types.
 * path may also be a store made by `nflash import` (recognised by its
 * magic): the hyperparameters and vocabulary come from its metadata blob,
 * every dense object is read with O_DIRECT into aligned memory (checksums
 * verified) and bound as the GGUF tensor of the same name; the FFN weights
 * stay in the store (see nf_model_ffn_layout) unless opts->store_unpack_ffn. Returns 0 and *out (free with
 * nf_model_free), or: NF_ENOTFOUND (a required key or tensor is missing),
 * NF_EFORMAT (bad shape or value), NF_EUNSUPPORTED (architecture, tensor type,
 * rope scaling type or activation not handled), or the reader's errors;
 * diag names the file and the key/tensor.
 */
int nf_model_load(const char *path, const struct nf_model_opts *opts, struct nf_model **out,
		  struct nf_diag *diag);
/* Accepts NULL. */
void nf_model_free(struct nf_model *m);

/* What nf_model_repack may repack. */
enum {
	NF_REPACK_ATTN = 1,   /* attn_q, attn_k, attn_v, attn_output of every layer */
	NF_REPACK_FFN = 2,    /* ffn_gate, ffn_up, ffn_down of dense layers */
	NF_REPACK_OUTPUT = 4, /* output.weight, unless tied to the embedding */
};

/*
 * nf_model_repack - copy the Q4_0, Q8_0, Q4_K, Q5_K and Q6_K matrices
 * named by what (a mask of NF_REPACK_*) into 8-row groups (struct
 * nf_block_q4_0x8 etc.) in
 * anonymous memory the model owns, for the best kernel table's gemv_x8 and
 * gemm_x8 (docs/KERNELS.md), which give the same bits as the plain
 * rows, faster. The weights' data then point there and the file's pages
 * are dropped from the process, so the memory held stays the weights'
 * size (nf_model_weight_bytes is unchanged). A store-backed model's
 * matrices (pinned in its cache) are repacked where they lie, a group at a
 * time through a small scratch: no memory added. Matrices whose rows are
 * read other than by nf_ctx's products
 * (the sparse FFN's row gathers) must not be named: pass NF_REPACK_FFN
 * only when the built-in dense FFN runs. A no-op (returns 0) for the
 * types where the table has no such kernel (the arm64 tables, AVX-512's
 * Q4_0/Q8_0), and for matrices of other types, without a
 * multiple of 8 rows or packed already. Uses one thread per CPU. Call before
 * the first evaluation; not thread-safe. Returns the number of matrices
 * repacked, -ENOMEM, -ENOSPC (more than 4 calls that repacked), or
 * another -errno from mmap.
 */
int nf_model_repack(struct nf_model *m, unsigned what);

const struct nf_model_hparams *nf_model_hparams(const struct nf_model *m);
const struct nf_layer_weights *nf_model_layer(const struct nf_model *m, uint32_t il);
/* The GGUF reader (for the tokenizer's vocabulary and other metadata). */
const struct nf_gguf *nf_model_gguf(const struct nf_model *m);
/* Total bytes of weight data bound by the model. */
uint64_t nf_model_weight_bytes(const struct nf_model *m);

/*
 * Attention weights. nf_model_attn_bytes: bytes of every layer's attn_q,
 * attn_k, attn_v and attn_output, in memory or not. nf_model_attn_in_memory:
 * false while some layer's attention is deferred (store_defer_attn);
 * nf_model_attn_layers_in_memory: how many leading layers have theirs.
 * nf_model_attn_load: read the deferred attention of layers [0, n_layers)
 * (UINT32_MAX: all) into memory (O_DIRECT, checksums verified) and bind
 * it; the other layers stay deferred, for a stream. Once per model.
 * Returns 0 (at once if nothing is deferred there), NF_EUSAGE (called
 * before with fewer layers), -ENOMEM or the read's error (d names the
 * object; the model stays deferred). Not thread-safe: call before any
 * context runs or streams.
 */
uint64_t nf_model_attn_bytes(const struct nf_model *m);
/* Bytes of dense weights one decode step reads: every layer's attention,
 * predictors, routers and norms, the output matrix and one embedding row
 * (not the FFN; not the whole embedding table). For the planner's cost
 * model. */
uint64_t nf_model_step_dense_bytes(const struct nf_model *m);
/* True when the token embedding stays in the store (a store whose output
 * matrix is not tied to it): a forward step reads its tokens' rows, so its
 * bytes are not in nf_model_weight_bytes. */
bool nf_model_embd_in_store(const struct nf_model *m);
bool nf_model_attn_in_memory(const struct nf_model *m);
uint32_t nf_model_attn_layers_in_memory(const struct nf_model *m);
int nf_model_attn_load(struct nf_model *m, uint32_t n_layers, struct nf_diag *diag);

/* ---- store-backed models: the FFN seam for the pipeline ------------------ */

struct nf_store;
struct nf_store_object;
struct nf_bundle_layout;
struct nf_cache;

/*
 * nf_model_store - the store m was loaded from (owned by m, open for its
 * lifetime, immutable: share it, open I/O contexts on it), or NULL for a
 * model loaded from a GGUF.
 */
struct nf_store *nf_model_store(const struct nf_model *m);
/*
 * nf_model_cache - the cache a store-backed model reads through (owned by
 * m; NULL for a GGUF): its dense objects are pinned in it, and an engine
 * adds the FFN segments (nf_cache_ffn_setup) and streams attention
 * (nf_stream_open) on it, so every read of the store goes through one I/O
 * context (nflash/cache.h).
 */
struct nf_cache *nf_model_cache(const struct nf_model *m);

/*
 * nf_model_ffn_in_memory - true when the built-in FFN can run: a GGUF
 * model, or a store-backed one loaded with store_unpack_ffn.
 */
bool nf_model_ffn_in_memory(const struct nf_model *m);

/*
 * nf_model_ffn_layout - for a store-backed model, the FFN object of
 * (layer, expert) (expert 0 for dense FFNs), its bundle layout, and for a
 * QCOL down part the n_ff/32 x n_embd fp16 scales (pinned in memory, owned
 * by m; NULL for ROW). Any out pointer may be NULL. *down_transposed (may be
 * NULL) says the source was PowerInfer's ffn_down_t. Validated at load:
 * dim == n_embd, n_bundles == n_ff, gate/up type and down part exact.
 * Returns 0, NF_ENOTFOUND (not a store-backed model) or NF_EUSAGE (layer
 * or expert out of range). Thread-safe (m is immutable).
 */
int nf_model_ffn_layout(const struct nf_model *m, uint32_t layer, uint32_t expert,
			const struct nf_store_object **obj, struct nf_bundle_layout *layout,
			const uint16_t **scales, bool *down_transposed);

/*
 * nf_model_hparams_read - the hyperparameter part of nf_model_load, for
 * tools that only report (documented in docs/MODEL.md).
 */
int nf_model_hparams_read(const struct nf_gguf *g, struct nf_model_hparams *hp,
			  struct nf_diag *diag);

/* ---- context --------------------------------------------------------- */

enum nf_kv_type { NF_KV_F32, NF_KV_F16 };

struct nf_ctx_params {
	uint32_t n_ctx;       /* 0: the model's context_length */
	uint32_t n_batch;     /* max tokens per forward step (prefill); default 512 */
	int n_threads;        /* default 0: all CPUs of the node */
	enum nf_kv_type kv_type;
	const struct nf_kernels *kernels; /* NULL: nf_kernels_get() */
	/* Run every row of a step through the last layer's FFN (activation
	 * records). Default false: as llama.cpp, only the rows whose logits
	 * are taken (each sequence's last) go on after its attention, which
	 * is also what keeps llama.cpp's bits for F16 weights. */
	bool all_rows;
};

struct nf_ctx_params nf_ctx_defaults(void);

struct nf_ctx;

/*
 * nf_ctx_open - allocate KV cache, scratch and pool for model m (which must
 * outlive the context). Returns 0, NF_EUSAGE for bad params (n_batch 0,
 * n_threads < 0), -ENOMEM, or the pool's error. Close with nf_ctx_close().
 */
int nf_ctx_open(const struct nf_model *m, const struct nf_ctx_params *p, struct nf_ctx **out,
		struct nf_diag *diag);
/* Accepts NULL. */
void nf_ctx_close(struct nf_ctx *c);

/*
 * nf_ctx_eval - run n tokens at positions n_past .. n_past+n-1, appending
 * their keys and values to the cache, in chunks of up to n_batch tokens
 * (matrix-matrix products; a single token uses matrix-vector products).
 * Afterwards nf_ctx_logits() holds the logits of the last token.
 * Returns 0, NF_EUSAGE if an id is outside the vocabulary or n is 0, NF_EBUDGET
 * if the context would overflow n_ctx (nothing is run), an FFN
 * implementation's error, the attention stream's read error, or
 * NF_EUNSUPPORTED (attention deferred and not streamed).
 */
int nf_ctx_eval(struct nf_ctx *c, const int32_t *ids, size_t n);

/*
 * nf_ctx_eval_seqs - token ids[i] appended to sequence seqs[i], for many
 * sequences in one step: PowerInfer-2's dynamic batch. A sequence is a
 * context over the same model, with the same KV type and an n_ctx no
 * larger than c's; only its KV cache, n_past and logits are used (open it
 * with n_batch 1 and one thread to keep it small), and it may be c
 * itself. Every step runs on c: its scratch, threads, FFN providers and
 * attention stream, the rows of all sequences together (matrix-matrix
 * products, one FFN call per layer: the sparse engine reads the union of
 * the rows' neurons once from its cache); attention reads each row's own
 * sequence. Rows of one sequence go in order at its next positions (a
 * prompt), and a step holds at most n_batch rows (more are split). Each
 * sequence's logits are those of its last row, in its own context.
 * Results equal each sequence evaluated alone with nf_ctx_eval, bit for
 * bit. Returns as nf_ctx_eval (NF_EBUDGET when any sequence would
 * overflow its n_ctx, nothing run; NF_EUSAGE for a sequence c cannot
 * serve); on an error every sequence in the call must be reset.
 */
int nf_ctx_eval_seqs(struct nf_ctx *c, struct nf_ctx *const *seqs, const int32_t *ids, size_t n);

/* n_vocab logits of the last evaluated token (valid until the next eval). */
const float *nf_ctx_logits(const struct nf_ctx *c);
/* Tokens in the KV cache. */
uint32_t nf_ctx_n_past(const struct nf_ctx *c);
uint32_t nf_ctx_n_ctx(const struct nf_ctx *c);
int nf_ctx_n_threads(const struct nf_ctx *c);
/* Most tokens one forward step (and so one FFN call) carries. */
uint32_t nf_ctx_n_batch(const struct nf_ctx *c);
const struct nf_kernels *nf_ctx_kernels(const struct nf_ctx *c);
/* The model the context runs. */
const struct nf_model *nf_ctx_model(const struct nf_ctx *c);
/* Bytes nf_ctx_open allocated (KV cache, scratch), and of them the KV cache. */
uint64_t nf_ctx_bytes(const struct nf_ctx *c);
uint64_t nf_ctx_bytes_kv(const struct nf_ctx *c);
/* Forget the cache: the next eval starts at position 0. */
void nf_ctx_reset(struct nf_ctx *c);

/*
 * The KV cache is one anonymous mapping whose pages become resident only
 * as positions are written: a context of n tokens holds
 * nf_ctx_kv_bytes_at(c, n) of it. A budgeted engine lends the rest to its
 * neuron cache and takes it back as the context fills (docs/PIPELINE.md
 * "The KV cache fills"): before a step writes past the positions already
 * covered, grow(user, n) is called with n, the positions the step needs
 * (this context's own rows only); a negative return fails the eval with
 * that code before anything is written. NULL clears the hook.
 */
typedef int (*nf_ctx_kv_grow_fn)(void *user, uint32_t n_tokens);
void nf_ctx_set_kv_grow(struct nf_ctx *c, nf_ctx_kv_grow_fn grow, void *user, uint32_t covered);
/* Resident bytes of the KV cache once positions [0, n) are written. */
uint64_t nf_ctx_kv_bytes_at(const struct nf_ctx *c, uint32_t n);

/* ---- streamed attention (docs/PIPELINE.md) -------------------------------- */

struct nf_stream_opts;
struct nf_stream_stats;

/*
 * nf_ctx_stream_attn - read each layer's attention matrices (q, k, v,
 * output) from the model's store at every forward step through
 * o->n_slots rotating buffers of one layer each (nflash/stream.h): layer
 * L + 1 is read while layer L computes. Streams the layers whose attention
 * is not in memory (nf_model_attn_load of the first layers pins those);
 * if every layer's is in memory, streams them all anyway. o may be
 * NULL for defaults (2 buffers). Returns 0, NF_EUSAGE (already streaming),
 * NF_EUNSUPPORTED (the model is not store-backed), or the stream's open
 * errors. A read error fails the nf_ctx_eval that needed the layer, and
 * every eval after it (errors stick). The buffers are freed by
 * nf_ctx_close.
 */
int nf_ctx_stream_attn(struct nf_ctx *c, const struct nf_stream_opts *o, struct nf_diag *d);
/* Bytes the buffers of an attention stream of n_slots would take for model
 * m (one layer's matrices each, block-rounded); 0 if m is not store-backed. */
uint64_t nf_model_attn_stream_bytes(const struct nf_model *m, uint32_t n_slots);
/* Bytes of the attention stream's buffers (0 when not streaming). */
uint64_t nf_ctx_attn_stream_bytes(const struct nf_ctx *c);
/* The stream's counters: returns true and fills *out when streaming. */
bool nf_ctx_attn_stats(const struct nf_ctx *c, struct nf_stream_stats *out);

/* ---- the FFN seam ------------------------------------------------------ */

/* One FFN call: nb tokens, each n_embd floats, rows n_embd apart. */
struct nf_ffn_io {
	uint32_t layer;
	size_t nb;
	const float *resid; /* residual stream entering the FFN block (predictors read this) */
	const float *x;     /* ffn_norm(resid): the FFN input */
	float *out;         /* FFN output, written (not accumulated) */
};

/* What an FFN implementation may use while it runs: the context's pool
 * and kernels, and the model's weights. */
struct nf_ffn_env {
	const struct nf_model *model;
	const struct nf_kernels *k;
	struct nf_pool *pool;   /* NULL when the context runs on one thread */
};

/*
 * An FFN implementation. forward() must not allocate; it writes io->out for
 * all nb tokens and returns 0 or a negative code (which aborts the eval).
 */
struct nf_ffn_ops {
	const char *name;
	int (*forward)(void *self, const struct nf_ffn_env *env, const struct nf_ffn_io *io);
};

/*
 * nf_ctx_set_ffn - replace layer il's FFN (ops NULL restores the built-in
 * dense or MoE FFN). self is passed to ops->forward and is owned by the
 * caller. Returns 0 or NF_EUSAGE for a bad layer.
 */
int nf_ctx_set_ffn(struct nf_ctx *c, uint32_t il, const struct nf_ffn_ops *ops, void *self);

/* The built-in FFN of layer il (dense SwiGLU/ReGLU/dReLU or MoE), run on
 * the context's scratch; a replacement may call it for layers it skips. */
int nf_ctx_ffn_builtin(struct nf_ctx *c, const struct nf_ffn_io *io);

/*
 * nf_ctx_moe_route - the router of MoE layer io->layer for io's tokens, as
 * the built-in FFN routes (llama.cpp's rule: softmax, top n_expert_used,
 * ties to the lower id, weights renormalised). *sel and *w get nb x
 * n_expert_used expert ids and weights in rank order, in the context's
 * scratch (valid until its next forward step). Returns 0 or NF_EUSAGE.
 */
int nf_ctx_moe_route(struct nf_ctx *c, const struct nf_ffn_io *io, const int32_t **sel, const float **w);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_MODEL_H */
