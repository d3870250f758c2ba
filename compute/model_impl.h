/*
 * model_impl.h - private structures of the transformer (compute/model*.c,
 * compute/attention.c, compute/ffn.c). Not installed.
 *
 * Invariants:
 *  1. struct nf_model is immutable after nf_model_load(); weights point into
 *     the GGUF reader's read-only mapping, which the model owns.
 *  2. struct nf_ctx owns every buffer forward needs, sized at open for
 *     n_batch tokens and n_ctx positions; nothing on the eval path allocates.
 *  3. Buffers of nb tokens are row-major: token b's row starts at b * width.
 */
#ifndef NFLASH_COMPUTE_MODEL_IMPL_H
#define NFLASH_COMPUTE_MODEL_IMPL_H

#include <stdint.h>

#include "nflash/kernels.h"
#include "nflash/model.h"
#include "nflash/pool.h"

struct nf_store_object;
struct nf_io_ctx;

/* A store-backed model's FFN of one (layer, expert). */
struct nf_model_ffn {
	const struct nf_store_object *obj;
	const uint16_t *scales;     /* QCOL: into the dense memory; else NULL */
};

/* Calls of nf_model_repack that may add matrices (one mapping each). */
#define NF_REPACK_MAPS 4

struct nf_model {
	struct nf_gguf *g;          /* the GGUF, or the store's metadata blob */
	/* store-backed models (compute/model_store.c); all NULL/0 for a GGUF */
	struct nf_store *store;
	struct nf_cache *cache;     /* the door to the store: dense objects pinned in it */
	const void *meta;           /* the metadata blob g parses (pinned) */
	void *ffn_mem;              /* unpacked FFN matrices (store_unpack_ffn) */
	struct nf_gguf_tensor *st;  /* dense objects (and unpacked FFNs) as tensors */
	char (*st_names)[64];       /* names of the unpacked FFN tensors */
	size_t n_st;
	struct nf_model_ffn *ffn;   /* n_layer x max(1, n_expert) */
	bool ffn_unpacked;
	/* store_defer_attn: attention objects not read at load (data NULL
	 * until nf_model_attn_load; a context may stream them instead) */
	bool attn_deferred;
	uint32_t attn_in_mem;       /* layers [0, attn_in_mem) have their attention in memory */
	const struct nf_store_object **attn_obj; /* n_layer x 4: q, k, v, output */
	uint64_t attn_bytes;        /* bytes of the attention weights */
	/* the token embedding left in the store (untied output): tok_embd has
	 * no data, a forward step reads its rows (model_store.c invariant 5) */
	const struct nf_store_object *embd_obj;
	struct nf_model_hparams hp;
	struct nf_weight tok_embd;
	struct nf_weight output;    /* token_embd itself when the file ties them */
	const float *output_norm;
	const float *rope_freqs;    /* head_dim / 2 RoPE frequency factors (LLaMA 3.1+), or NULL */
	struct nf_layer_weights *layers;
	uint64_t weight_bytes;
	/* nf_model_repack's anonymous mappings (the repacked matrices) */
	struct { void *p; size_t len; } packed[NF_REPACK_MAPS];
	int n_packed_maps;
};

/* One matrix product: y[b * ldy + r] = W row r . x row b, b < nb. */
struct nf_mm {
	const struct nf_weight *w;  /* a 2-D weight (or one expert's view) */
	float *y;
	size_t ldy;
};

struct nf_ctx_layer_ffn {
	const struct nf_ffn_ops *ops;
	void *self;
};

struct nf_stream;

struct nf_ctx {
	const struct nf_model *m;
	struct nf_stream *attn;     /* streamed attention (nf_ctx_stream_attn), or NULL */
	uint32_t attn_first;        /* first streamed layer (stream group 0) */
	const struct nf_kernels *k;
	struct nf_pool *pool;       /* NULL with one thread */
	int n_threads;
	uint32_t n_ctx, n_batch, n_past;
	/* the rows of the forward step under way (n_batch each): row b is a
	 * token of sequence row_seq[b] (this context, or another whose KV
	 * cache it uses: nf_ctx_eval_seqs) at position row_pos[b] */
	struct nf_ctx **row_seq;
	uint32_t *row_pos;
	enum nf_kv_type kv_type;
	bool all_rows;           /* nf_ctx_params.all_rows */
	size_t kv_elt;              /* bytes per cached value */
	uint32_t kv_dim;            /* n_head_kv * head_dim */
	void **kcache, **vcache;    /* per layer: n_ctx x kv_dim, page-aligned in kv_map */
	void *kv_map;               /* one anonymous mapping: resident only as rows are written */
	size_t kv_map_bytes, kv_buf_bytes; /* the mapping; one layer's K (or V) buffer in it */
	/* the KV high-water: positions [0, kv_fill) of this context were
	 * written or promised (nf_ctx_set_kv_grow); kv_grow is asked before a
	 * step writes past it */
	uint32_t kv_fill;
	nf_ctx_kv_grow_fn kv_grow;
	void *kv_grow_user;
	struct nf_ctx_layer_ffn *ffn;

	/* scratch, n_batch token rows each */
	float *x;       /* residual, n_embd */
	float *xn;      /* normalised, n_embd */
	float *q;       /* n_head * head_dim */
	float *kn, *vn; /* kv_dim */
	float *att;     /* attention output, n_embd */
	float *tmp;     /* projection output, n_embd */
	float *g, *u;   /* FFN gate/up (also one expert's), n_ff */
	void *xq;       /* prepared activations, xq_row bytes per token */
	size_t xq_row;
	float *logits;  /* n_vocab */
	/* the embedding rows of a step, read from the store (m->embd_obj),
	 * embd_cap at a time: embd_cap x embd_span aligned bytes, and where
	 * each row starts */
	void *embd_buf;
	size_t embd_span, embd_cap;
	const void **embd_rows;

	/* attention, per thread */
	float *scores;  /* n_threads x scores_row: n_ctx_pad scores, then 16 x head_dim value chains */
	size_t n_ctx_pad, scores_row; /* n_ctx rounded up to 16 */
	void *qh;       /* n_threads x head_dim prepared query (F16 cache) */
	size_t qh_row;

	/* MoE */
	float *router;      /* n_batch x n_expert */
	int32_t *sel;       /* n_batch x n_expert_used */
	float *selw;        /* n_batch x n_expert_used */
	int32_t *tok_of;    /* gathered token rows for one expert */
	int32_t *slot_of;   /* slot (b * n_expert_used + j) of each gathered row */
	float *xg;          /* gathered expert inputs, n_batch x n_embd */
	float *eg;          /* one expert's outputs, n_batch x n_embd */
	float *eout;        /* n_batch x n_expert_used x n_embd: per-slot expert outputs */

	struct nf_ffn_env env;
	uint64_t bytes;     /* allocated by nf_ctx_open (KV cache and scratch) */
	uint64_t bytes_kv;  /* of which the KV cache */
};

/* A tensor by name: from the GGUF, or from a store's dense objects. */
const struct nf_gguf_tensor *nf_model_find_tensor(const struct nf_model *m, const char *name);

/* compute/model_store.c: open the store at path into m (m->store, m->meta,
 * m->g, m->st, dense objects read and verified; with defer_attn the
 * attention objects are left in the store, their tensors' data NULL). */
int nf_model_store_open(struct nf_model *m, const char *path, bool defer_attn,
			struct nf_diag *diag);
/* True for the names of the attention matrices a stream may hold:
 * blk.N.attn_q/k/v/output.weight. */
bool nf_model_is_attn_name(const char *name);
/* After the hyperparameters are known: check every FFN object against them,
 * fill m->ffn, and with unpack read and unpack the FFNs into m->st. */
int nf_model_store_ffn(struct nf_model *m, bool unpack, struct nf_diag *diag);
/* Free what nf_model_store_open / _ffn allocated. */
void nf_model_store_free(struct nf_model *m);
/* True if the file at path starts with the store magic. */
bool nf_model_path_is_store(const char *path);

/* Runs fn over the context's threads (inline with one thread). */
void nf_ctx_run(struct nf_ctx *c, nf_pool_fn fn, void *arg);

/*
 * The products mm[0..n_mm) (at most 4) of the same input: nb rows of x, ldx
 * floats apart, each weight's row length long. Activations are prepared
 * once per distinct dot type into c->xq (in parallel over tokens), then the
 * rows of every matrix are split over the threads.
 */
void nf_ctx_matmul(struct nf_ctx *c, const struct nf_mm *mm, size_t n_mm, const float *x,
		   size_t ldx, size_t nb);
/* The same, polling the cache (nf_cache_poll) between chunks, at most
 * every 0.1 ms, when poll is not NULL: attention's products, so that the
 * FFN's reads that land go on feeding the device (docs/PIPELINE.md
 * "Keeping the disk fed through attention"). Same bits. */
struct nf_cache;
void nf_ctx_matmul_polling(struct nf_ctx *c, const struct nf_mm *mm, size_t n_mm, const float *x,
			   size_t ldx, size_t nb, struct nf_cache *poll);

/* Runs fn(arg, b0, b1) on slices [b0, b1) of n items over the threads. */
void nf_ctx_parallel(struct nf_ctx *c, size_t n, void (*fn)(void *arg, size_t b0, size_t b1),
		     void *arg);

/* Attention block of layer il on c->x for nb rows, row b a token of
 * sequence c->row_seq[b] at position c->row_pos[b] (its keys and values go
 * to that sequence's cache); adds its output to c->x. Returns 0, or the
 * stream's read error (c->attn), or NF_EUNSUPPORTED (attention deferred
 * and not streamed). */
int nf_attention(struct nf_ctx *c, uint32_t il, size_t nb);

/* Built-in FFNs (compute/ffn.c). */
int nf_ffn_dense(struct nf_ctx *c, const struct nf_ffn_io *io);
int nf_ffn_moe(struct nf_ctx *c, const struct nf_ffn_io *io);

/* Row range [r0, r1) of n rows for thread ith of nth, in multiples of align. */
static inline void nf_split(size_t n, size_t align, int ith, int nth, size_t *r0, size_t *r1)
{
	size_t units = (n + align - 1) / align;
	size_t a = units * (size_t)ith / (size_t)nth, b = units * (size_t)(ith + 1) / (size_t)nth;
	*r0 = a * align < n ? a * align : n;
	*r1 = b * align < n ? b * align : n;
}

#endif
