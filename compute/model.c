/*
 * model.c - loading a LLaMA-family GGUF: hyperparameters from metadata,
 * weights bound in place from the read-only mapping (see nflash/model.h,
 * docs/MODEL.md for the keys).
 *
 * Invariants:
 *  1. Every tensor the forward pass touches is checked here: present,
 *     shape equal to what the hyperparameters imply, a type the kernels
 *     handle, and its data inside the mapping. forward() trusts the model.
 *  2. Errors name the file and the key or tensor; nothing is half-built:
 *     on failure everything is released and *out is untouched.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nflash/model.h" /* declares struct nf_gguf before gguf.h uses it */
#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/kernels.h"
#include "nflash/store.h"
#include "model_impl.h"

const char *nf_ffn_act_name(enum nf_ffn_act a)
{
	switch (a) {
	case NF_FFN_SILU: return "silu";
	case NF_FFN_RELU: return "relu";
	case NF_FFN_DRELU: return "drelu";
	}
	return "unknown";
}

/* ---- hyperparameters ---------------------------------------------------- */

struct hp_reader {
	const struct nf_gguf *g;
	const char *arch;
	struct nf_diag *diag;
};

static int key_u32(struct hp_reader *r, const char *suffix, bool required, uint32_t def,
		   uint32_t *out)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.%s", r->arch, suffix);
	int rc = nf_gguf_get_u32(r->g, key, out);
	if (rc == NF_ENOTFOUND && !required) {
		*out = def;
		return 0;
	}
	if (rc == NF_ENOTFOUND)
		return nf_diag_fail(r->diag, rc, "%s: missing key %s", nf_gguf_path(r->g), key);
	if (rc < 0)
		return nf_diag_fail(r->diag, rc, "%s: key %s: not an unsigned 32-bit integer",
				    nf_gguf_path(r->g), key);
	return 0;
}

static int key_f32(struct hp_reader *r, const char *suffix, bool required, float def, float *out)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.%s", r->arch, suffix);
	int rc = nf_gguf_get_f32(r->g, key, out);
	if (rc == NF_ENOTFOUND && !required) {
		*out = def;
		return 0;
	}
	if (rc == NF_ENOTFOUND)
		return nf_diag_fail(r->diag, rc, "%s: missing key %s", nf_gguf_path(r->g), key);
	if (rc < 0 || !isfinite(*out))
		return nf_diag_fail(r->diag, rc < 0 ? rc : NF_EFORMAT, "%s: key %s: not a finite float",
				    nf_gguf_path(r->g), key);
	return 0;
}

static int decide_activation(const struct nf_gguf *g, struct nf_model_hparams *hp,
			     struct nf_diag *diag)
{
	const char *s;
	int rc = nf_gguf_get_str(g, "nflash.ffn_activation", &s);
	if (rc == 0) {
		hp->act_source = "nflash.ffn_activation";
		if (!strcmp(s, "silu"))
			hp->act = NF_FFN_SILU;
		else if (!strcmp(s, "relu"))
			hp->act = NF_FFN_RELU;
		else if (!strcmp(s, "drelu"))
			hp->act = NF_FFN_DRELU;
		else
			return nf_diag_fail(diag, NF_EUNSUPPORTED,
					    "%s: key nflash.ffn_activation: unknown activation '%s' "
					    "(silu, relu or drelu)", nf_gguf_path(g), s);
		return 0;
	}
	if (rc != NF_ENOTFOUND)
		return nf_diag_fail(diag, rc, "%s: key nflash.ffn_activation: not a string",
				    nf_gguf_path(g));
	if (hp->powerinfer) {
		hp->act = NF_FFN_RELU;
		hp->act_source = "PowerInfer file (magic PWRI)";
	} else {
		hp->act = NF_FFN_SILU;
		hp->act_source = "default for architecture llama";
	}
	return 0;
}

int nf_model_hparams_read(const struct nf_gguf *g, struct nf_model_hparams *hp,
			  struct nf_diag *diag)
{
	memset(hp, 0, sizeof(*hp));
	const char *path = nf_gguf_path(g), *arch;
	int rc = nf_gguf_get_str(g, "general.architecture", &arch);
	if (rc < 0)
		return nf_diag_fail(diag, rc, "%s: key general.architecture: %s", path,
				    rc == NF_ENOTFOUND ? "missing" : "not a string");
	if (strcmp(arch, "llama"))
		return nf_diag_fail(diag, NF_EUNSUPPORTED,
				    "%s: key general.architecture: '%s' is not supported (llama)",
				    path, arch);
	snprintf(hp->arch, sizeof(hp->arch), "%s", arch);
	struct hp_reader r = { .g = g, .arch = arch, .diag = diag };

	if ((rc = key_u32(&r, "embedding_length", true, 0, &hp->n_embd)) < 0 ||
	    (rc = key_u32(&r, "block_count", true, 0, &hp->n_layer)) < 0 ||
	    (rc = key_u32(&r, "feed_forward_length", true, 0, &hp->n_ff)) < 0 ||
	    (rc = key_u32(&r, "attention.head_count", true, 0, &hp->n_head)) < 0 ||
	    (rc = key_u32(&r, "attention.head_count_kv", false, hp->n_head, &hp->n_head_kv)) < 0 ||
	    (rc = key_u32(&r, "context_length", false, 2048, &hp->n_ctx_train)) < 0 ||
	    (rc = key_u32(&r, "expert_count", false, 0, &hp->n_expert)) < 0 ||
	    (rc = key_u32(&r, "expert_used_count", false, 0, &hp->n_expert_used)) < 0 ||
	    (rc = key_u32(&r, "vocab_size", false, 0, &hp->n_vocab)) < 0 ||
	    (rc = key_f32(&r, "attention.layer_norm_rms_epsilon", false, 1e-5f, &hp->rms_eps)) < 0 ||
	    (rc = key_f32(&r, "rope.freq_base", false, 10000.0f, &hp->rope_freq_base)) < 0)
		return rc;

#define HP_CHECK(cond, what)                                                              \
	do {                                                                              \
		if (!(cond))                                                              \
			return nf_diag_fail(diag, NF_EFORMAT, "%s: %s.%s", path, arch, what); \
	} while (0)
	HP_CHECK(hp->n_embd > 0 && hp->n_embd <= (1u << 20), "embedding_length: out of range");
	HP_CHECK(hp->n_layer > 0 && hp->n_layer <= 4096, "block_count: out of range");
	HP_CHECK(hp->n_ff > 0 && hp->n_ff <= (1u << 22), "feed_forward_length: out of range");
	HP_CHECK(hp->n_head > 0 && hp->n_embd % hp->n_head == 0,
		 "attention.head_count: must divide embedding_length");
	HP_CHECK(hp->n_head_kv > 0 && hp->n_head % hp->n_head_kv == 0,
		 "attention.head_count_kv: must divide attention.head_count");
	hp->head_dim = hp->n_embd / hp->n_head;
	HP_CHECK(hp->head_dim % 2 == 0, "attention.head_count: head dimension must be even");
	HP_CHECK(hp->n_ctx_train > 0, "context_length: must be positive");
	HP_CHECK(hp->rms_eps > 0, "attention.layer_norm_rms_epsilon: must be positive");
	HP_CHECK(hp->rope_freq_base > 0, "rope.freq_base: must be positive");

	uint32_t kl, vl;
	if ((rc = key_u32(&r, "attention.key_length", false, hp->head_dim, &kl)) < 0 ||
	    (rc = key_u32(&r, "attention.value_length", false, hp->head_dim, &vl)) < 0 ||
	    (rc = key_u32(&r, "rope.dimension_count", false, hp->head_dim, &hp->n_rot)) < 0)
		return rc;
	if (kl != hp->head_dim || vl != hp->head_dim)
		return nf_diag_fail(diag, NF_EUNSUPPORTED,
				    "%s: %s.attention.key_length/value_length %u/%u differ from "
				    "embedding_length / head_count = %u", path, arch, kl, vl, hp->head_dim);
	if (hp->n_rot != hp->head_dim)
		return nf_diag_fail(diag, NF_EUNSUPPORTED,
				    "%s: %s.rope.dimension_count %u: partial rotary embeddings are "
				    "not supported (head dimension %u)", path, arch, hp->n_rot, hp->head_dim);

	/* RoPE scaling: linear only (freq_scale = 1 / factor). */
	char key[128];
	const char *stype;
	snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
	if (nf_gguf_get_str(g, key, &stype) == 0 && strcmp(stype, "none") && strcmp(stype, "linear"))
		return nf_diag_fail(diag, NF_EUNSUPPORTED,
				    "%s: key %s: rope scaling '%s' is not supported (none, linear)",
				    path, key, stype);
	float factor;
	if ((rc = key_f32(&r, "rope.scaling.factor", false, 0.0f, &factor)) < 0)
		return rc;
	if (factor == 0.0f && (rc = key_f32(&r, "rope.scale_linear", false, 0.0f, &factor)) < 0)
		return rc;
	HP_CHECK(factor >= 0, "rope.scaling.factor: must not be negative");
	hp->rope_freq_scale = factor > 0 ? 1.0f / factor : 1.0f;

	if (hp->n_expert > 0) {
		HP_CHECK(hp->n_expert <= 1024, "expert_count: out of range");
		HP_CHECK(hp->n_expert_used > 0 && hp->n_expert_used <= hp->n_expert,
			 "expert_used_count: must be in 1..expert_count");
	} else {
		hp->n_expert_used = 0;
	}
#undef HP_CHECK

	hp->powerinfer = nf_gguf_is_powerinfer(g);
	hp->sparse_threshold = 0.0f;
	rc = nf_gguf_get_f32(g, "powerinfer.sparse_threshold", &hp->sparse_threshold);
	if (rc < 0 && rc != NF_ENOTFOUND)
		return nf_diag_fail(diag, rc, "%s: key powerinfer.sparse_threshold: not a float", path);
	if ((rc = decide_activation(g, hp, diag)) < 0)
		return rc;

	uint32_t id;
	hp->bos_id = nf_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id) == 0 ? (int32_t)id : -1;
	hp->eos_id = nf_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &id) == 0 ? (int32_t)id : -1;
	return 0;
}

/* ---- tensors ------------------------------------------------------------- */

const struct nf_gguf_tensor *nf_model_find_tensor(const struct nf_model *m, const char *name)
{
	if (!m->store)
		return nf_gguf_find_tensor(m->g, name);
	for (size_t i = 0; i < m->n_st; i++)
		if (!strcmp(m->st[i].name, name))
			return &m->st[i];
	return NULL;
}

/* The file the weights come from, for messages. */
static const char *model_path(const struct nf_model *m)
{
	return m->store ? nf_store_path(m->store) : nf_gguf_path(m->g);
}

struct binder {
	struct nf_model *m;
	struct nf_diag *diag;
	bool unmapped_ok;   /* a deferred attention matrix: data may be NULL */
};

static int bind_raw(struct binder *b, const char *name, bool required, uint32_t n_dims,
		    const uint64_t *ne, const struct nf_gguf_tensor **out)
{
	const char *path = model_path(b->m);
	const struct nf_gguf_tensor *t = nf_model_find_tensor(b->m, name);
	*out = NULL;
	if (!t) {
		if (!required)
			return 0;
		return nf_diag_fail(b->diag, NF_ENOTFOUND, "%s: missing tensor %s", path, name);
	}
	for (uint32_t d = 0; d < NF_GGUF_MAX_DIMS; d++) {
		uint64_t want = d < n_dims ? ne[d] : 1;
		if (t->ne[d] != want)
			return nf_diag_fail(b->diag, NF_EFORMAT,
					    "%s: tensor %s: shape [%llu, %llu, %llu] where "
					    "[%llu, %llu, %llu] was expected", path, name,
					    (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
					    (unsigned long long)t->ne[2], (unsigned long long)ne[0],
					    (unsigned long long)(n_dims > 1 ? ne[1] : 1),
					    (unsigned long long)(n_dims > 2 ? ne[2] : 1));
	}
	if (!t->data && !b->unmapped_ok)
		return nf_diag_fail(b->diag, NF_EFORMAT, "%s: tensor %s: data not mapped", path, name);
	*out = t;
	if (t->data)
		b->m->weight_bytes += t->size;
	return 0;
}

/* A 1-D F32 vector of n values. */
static int bind_vec(struct binder *b, const char *name, uint32_t n, const float **out)
{
	const struct nf_gguf_tensor *t;
	uint64_t ne[1] = { n };
	int rc = bind_raw(b, name, true, 1, ne, &t);
	if (rc < 0)
		return rc;
	if (t->type != NF_DTYPE_F32)
		return nf_diag_fail(b->diag, NF_EUNSUPPORTED, "%s: tensor %s: type %s, expected f32",
				    model_path(b->m), name, nf_dtype_name(t->type));
	*out = t->data;
	return 0;
}

/* A matrix of nrows rows of n values, stacked n_expert times (0: 2-D). */
static int bind_mat(struct binder *b, const char *name, bool required, uint32_t n,
		    uint32_t nrows, uint32_t n_expert, struct nf_weight *w)
{
	const struct nf_gguf_tensor *t;
	uint64_t ne[3] = { n, nrows, n_expert };
	memset(w, 0, sizeof(*w));
	int rc = bind_raw(b, name, required, n_expert ? 3 : 2, ne, &t);
	if (rc < 0 || !t)
		return rc;
	/* llama.cpp repacks (and so sums in NF_KT_Q4_0's order) every Q4_0
	 * matrix of a multiple of 8 rows, a tied output's too */
	int kt = nf_ktype_matrix(t->type, nrows, b->m->hp.powerinfer);
	size_t row = nf_dtype_row_size(t->type, n);
	if (kt < 0 || row == 0)
		return nf_diag_fail(b->diag, NF_EUNSUPPORTED,
				    "%s: tensor %s: type %s has no matrix kernel for rows of %u",
				    model_path(b->m), name, nf_dtype_name(t->type), n);
	*w = (struct nf_weight){
		.name = t->name, .data = t->data, .dtype = t->type, .kt = kt, .n = n,
		.nrows = nrows, .row_bytes = row, .n_expert = n_expert ? n_expert : 1,
		.expert_bytes = row * nrows,
	};
	return 0;
}

/* A dense FFN: gate, up and down (or PowerInfer's transposed down_t). */
static int bind_dense_ffn(struct binder *b, uint32_t il, struct nf_layer_weights *L)
{
	const struct nf_model_hparams *hp = &b->m->hp;
	uint32_t E = hp->n_embd, F = hp->n_ff;
	char nm[96];
	int rc;
#define NAME(s) (snprintf(nm, sizeof(nm), "blk.%u.%s.weight", il, s), nm)
	if ((rc = bind_mat(b, NAME("ffn_gate"), true, E, F, 0, &L->gate)) < 0 ||
	    (rc = bind_mat(b, NAME("ffn_up"), true, E, F, 0, &L->up)) < 0 ||
	    (rc = bind_mat(b, NAME("ffn_down"), false, F, E, 0, &L->down)) < 0)
		return rc;
	if (!L->down.data) {
		/* PowerInfer stores the down matrix transposed: row j is column j. */
		if ((rc = bind_mat(b, NAME("ffn_down_t"), false, E, F, 0, &L->down_t)) < 0)
			return rc;
		if (!L->down_t.data)
			return nf_diag_fail(b->diag, NF_ENOTFOUND,
					    "%s: missing tensor blk.%u.ffn_down.weight "
					    "(nor blk.%u.ffn_down_t.weight)", model_path(b->m), il, il);
	}
#undef NAME
	return 0;
}

/* Predictor: fc1 [n_embd -> r], fc2 [r -> n_ff], r from fc1's shape; one
 * per expert (3-D, n_expert X) in a mixture of experts. */
static int bind_predictor(struct binder *b, uint32_t il, uint32_t X, struct nf_layer_weights *L)
{
	const struct nf_model_hparams *hp = &b->m->hp;
	char nm[96];
	int rc;
	snprintf(nm, sizeof(nm), "blk.%u.fc1.weight", il);
	const struct nf_gguf_tensor *fc1 = nf_model_find_tensor(b->m, nm);
	if (!fc1)
		return 0;
	uint32_t rank = fc1->ne[1] <= UINT32_MAX ? (uint32_t)fc1->ne[1] : 0;
	if ((rc = bind_mat(b, nm, true, hp->n_embd, rank, X, &L->fc1)) < 0)
		return rc;
	snprintf(nm, sizeof(nm), "blk.%u.fc2.weight", il);
	return bind_mat(b, nm, true, rank, hp->n_ff, X, &L->fc2);
}

static int bind_layer(struct binder *b, uint32_t il, struct nf_layer_weights *L)
{
	const struct nf_model_hparams *hp = &b->m->hp;
	uint32_t E = hp->n_embd, KV = hp->n_head_kv * hp->head_dim, F = hp->n_ff;
	char nm[96];
	int rc;
#define NAME(s) (snprintf(nm, sizeof(nm), "blk.%u.%s.weight", il, s), nm)
	if ((rc = bind_vec(b, NAME("attn_norm"), E, &L->attn_norm)) < 0)
		return rc;
	/* A store's attention may be left there (store_defer_attn): bound
	 * without data, its objects kept for nf_model_attn_load or a stream. */
	b->unmapped_ok = b->m->attn_deferred;
	if ((rc = bind_mat(b, NAME("attn_q"), true, E, E, 0, &L->wq)) < 0 ||
	    (rc = bind_mat(b, NAME("attn_k"), true, E, KV, 0, &L->wk)) < 0 ||
	    (rc = bind_mat(b, NAME("attn_v"), true, E, KV, 0, &L->wv)) < 0 ||
	    (rc = bind_mat(b, NAME("attn_output"), true, E, E, 0, &L->wo)) < 0)
		return rc;
	b->unmapped_ok = false;
	if (b->m->store) {
		const struct nf_weight *w[4] = { &L->wq, &L->wk, &L->wv, &L->wo };
		for (size_t k = 0; k < 4; k++) {
			const struct nf_store_object *o = nf_store_object_find(b->m->store, w[k]->name);
			if (!o || o->kind != NF_STORE_KIND_DENSE)
				return nf_diag_fail(b->diag, NF_ENOTFOUND, "%s: no dense object %s",
						    model_path(b->m), w[k]->name);
			b->m->attn_obj[(size_t)il * 4 + k] = o;
			b->m->attn_bytes += (uint64_t)w[k]->row_bytes * w[k]->nrows;
		}
	}
	if ((rc = bind_vec(b, NAME("ffn_norm"), E, &L->ffn_norm)) < 0)
		return rc;
	/* A store-backed model's FFN matrices stay in the store (m->ffn). */
	bool ffn_here = !b->m->store || b->m->ffn_unpacked;
	if (hp->n_expert) {
		uint32_t X = hp->n_expert;
		if ((rc = bind_mat(b, NAME("ffn_gate_inp"), true, E, X, 0, &L->router)) < 0 ||
		    (rc = bind_predictor(b, il, X, L)) < 0)
			return rc;
		if (!ffn_here)
			return 0;
		if ((rc = bind_mat(b, NAME("ffn_gate_exps"), true, E, F, X, &L->gate_exps)) < 0 ||
		    (rc = bind_mat(b, NAME("ffn_up_exps"), true, E, F, X, &L->up_exps)) < 0 ||
		    (rc = bind_mat(b, NAME("ffn_down_exps"), true, F, E, X, &L->down_exps)) < 0)
			return rc;
		return 0;
	}
	if (ffn_here && (rc = bind_dense_ffn(b, il, L)) < 0)
		return rc;
	if ((rc = bind_predictor(b, il, 0, L)) < 0)
		return rc;
#undef NAME
	return 0;
}

static void prefault(const struct nf_model *m)
{
	/* One read per page of every tensor, so the first token does not pay
	 * for page faults. */
	volatile unsigned char sink = 0;
	for (size_t i = 0; i < nf_gguf_n_tensors(m->g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(m->g, i);
		const unsigned char *p = t->data;
		if (!p)
			continue;
		for (uint64_t off = 0; off < t->size; off += 4096)
			sink ^= p[off];
	}
	(void)sink;
}

int nf_model_load(const char *path, const struct nf_model_opts *opts, struct nf_model **out,
		  struct nf_diag *diag)
{
	int rc = -ENOMEM;
	struct nf_model *m = calloc(1, sizeof(*m));
	if (!m)
		return nf_diag_fail(diag, rc, "%s: out of memory", path);
	if (nf_model_path_is_store(path))
		rc = nf_model_store_open(m, path, opts && opts->store_defer_attn, diag);
	else
		rc = nf_gguf_open(path, NF_GGUF_MMAP, &m->g, diag);
	if (rc < 0)
		goto fail;
	rc = nf_model_hparams_read(m->g, &m->hp, diag);
	if (rc < 0)
		goto fail;
	if (m->store && (rc = nf_model_store_ffn(m, opts && opts->store_unpack_ffn, diag)) < 0)
		goto fail;
	struct nf_model_hparams *hp = &m->hp;
	struct binder b = { .m = m, .diag = diag };

	/* The vocabulary size comes from the embedding if the key is absent. */
	const struct nf_gguf_tensor *te = nf_model_find_tensor(m, "token_embd.weight");
	if (!te) {
		rc = nf_diag_fail(diag, NF_ENOTFOUND, "%s: missing tensor token_embd.weight", path);
		goto fail;
	}
	if (hp->n_vocab == 0) {
		if (te->ne[1] == 0 || te->ne[1] > INT32_MAX) {
			rc = nf_diag_fail(diag, NF_EFORMAT, "%s: tensor token_embd.weight: bad vocabulary size",
					  path);
			goto fail;
		}
		hp->n_vocab = (uint32_t)te->ne[1];
	}
	b.unmapped_ok = m->embd_obj != NULL;   /* rows read per step (model_store.c) */
	rc = bind_mat(&b, "token_embd.weight", true, hp->n_embd, hp->n_vocab, 0, &m->tok_embd);
	b.unmapped_ok = false;
	if (rc < 0 ||
	    (rc = bind_vec(&b, "output_norm.weight", hp->n_embd, &m->output_norm)) < 0 ||
	    (rc = bind_mat(&b, "output.weight", false, hp->n_embd, hp->n_vocab, 0, &m->output)) < 0)
		goto fail;
	if (!m->output.data)
		m->output = m->tok_embd;  /* tied embeddings */
	/* LLaMA 3.1's RoPE scaling: one frequency factor per rotated pair */
	if (nf_model_find_tensor(m, "rope_freqs.weight")) {
		if ((rc = bind_vec(&b, "rope_freqs.weight", hp->head_dim / 2, &m->rope_freqs)) < 0)
			goto fail;
		for (uint32_t i = 0; i < hp->head_dim / 2; i++)
			if (!(m->rope_freqs[i] > 0.0f) || isinf(m->rope_freqs[i])) {
				rc = nf_diag_fail(diag, NF_EFORMAT,
						  "%s: tensor rope_freqs.weight: factor %u is %g, expected a "
						  "positive finite number", path, i, (double)m->rope_freqs[i]);
				goto fail;
			}
	}
	m->layers = calloc(hp->n_layer, sizeof(*m->layers));
	if (m->store)
		m->attn_obj = calloc((size_t)hp->n_layer * 4, sizeof(*m->attn_obj));
	if (!m->layers || (m->store && !m->attn_obj)) {
		rc = nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
		goto fail;
	}
	for (uint32_t il = 0; il < hp->n_layer; il++)
		if ((rc = bind_layer(&b, il, &m->layers[il])) < 0)
			goto fail;
	if (!opts || opts->prefault)
		prefault(m);
	*out = m;
	return 0;
fail:
	nf_model_free(m);
	return rc;
}

/* A matrix nf_model_repack can put into 8-row groups for table k. */
static bool repackable(const struct nf_weight *w, const struct nf_kernels *k)
{
	if (!w->data || w->packed || !nf_x8_supported((enum nf_ktype)w->kt) || !k->gemv_x8[w->kt] ||
	    !k->gemm_x8[w->kt])
		return false;
	return w->n_expert == 1 && w->nrows % 8 == 0 && w->row_bytes == nf_dtype_row_size(w->dtype, w->n);
}

struct repack_item {
	struct nf_weight *w;
	unsigned char *dst;
};

struct repack_job {
	struct repack_item *it;
	size_t n;
	int nth;
	int ith;
	unsigned char *scratch;   /* in place: one group's rows, else NULL */
};

/* Thread ith of nth: its share of every matrix's groups. */
static void *repack_worker(void *arg)
{
	struct repack_job *j = arg;
	for (size_t i = 0; i < j->n; i++) {
		const struct nf_weight *w = j->it[i].w;
		size_t g = w->nrows / 8, g0 = g * (size_t)j->ith / (size_t)j->nth;
		size_t g1 = g * (size_t)(j->ith + 1) / (size_t)j->nth, off = g0 * 8 * w->row_bytes;
		if (!j->scratch) {
			nf_repack_x8((enum nf_ktype)w->kt, j->it[i].dst + off, (const unsigned char *)w->data + off,
				     w->n, (g1 - g0) * 8);
			continue;
		}
		/* a group's 8-row form takes the bytes of its 8 rows: each
		 * group through the scratch, back where it was */
		size_t gb = 8 * w->row_bytes;
		for (size_t q = g0; q < g1; q++) {
			nf_repack_x8((enum nf_ktype)w->kt, j->scratch, j->it[i].dst + q * gb, w->n, 8);
			memcpy(j->it[i].dst + q * gb, j->scratch, gb);
		}
	}
	return NULL;
}

/* The items' groups over one thread per CPU (at most 8); in place each
 * thread has a scratch of one group of the widest matrix. */
static int repack_run(struct repack_item *it, size_t n, bool in_place)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	int nth = ncpu < 1 ? 1 : ncpu > 8 ? 8 : (int)ncpu;
	pthread_t th[8];
	struct repack_job jobs[8];
	unsigned char *scratch = NULL;
	size_t gb = 0;
	for (size_t i = 0; in_place && i < n; i++)
		gb = 8 * it[i].w->row_bytes > gb ? 8 * it[i].w->row_bytes : gb;
	if (in_place && !(scratch = malloc(gb * (size_t)nth)))
		return -ENOMEM;
	int started = 1;
	for (int t = 0; t < nth; t++)
		jobs[t] = (struct repack_job){ .it = it, .n = n, .nth = nth, .ith = t,
					       .scratch = scratch ? scratch + gb * (size_t)t : NULL };
	for (int t = 1; t < nth && pthread_create(&th[t], NULL, repack_worker, &jobs[t]) == 0; t++)
		started = t + 1;
	for (int t = started; t < nth; t++) /* threads that did not start: done here */
		repack_worker(&jobs[t]);
	repack_worker(&jobs[0]);
	for (int t = 1; t < started; t++)
		pthread_join(th[t], NULL);
	free(scratch);
	return 0;
}

int nf_model_repack(struct nf_model *m, unsigned what)
{
	const struct nf_kernels *k = nf_kernels_get();
	/* a store's pinned matrices are the model's own buffers: repacked
	 * where they lie, no memory added */
	bool in_place = m->store != NULL;
	if (!in_place && !m->g)
		return 0;
	/* the matrices, in a list, and the bytes they take */
	size_t cap = (size_t)m->hp.n_layer * 7 + 1, n = 0, bytes = 0;
	struct repack_item *it = calloc(cap, sizeof(*it));
	if (!it)
		return -ENOMEM;
	for (uint32_t il = 0; il < m->hp.n_layer; il++) {
		struct nf_layer_weights *L = &m->layers[il];
		struct nf_weight *ws[7] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down };
		for (int i = 0; i < 7; i++)
			if ((what & (i < 4 ? NF_REPACK_ATTN : NF_REPACK_FFN)) && repackable(ws[i], k))
				it[n++].w = ws[i];
	}
	if ((what & NF_REPACK_OUTPUT) && m->output.data != m->tok_embd.data && repackable(&m->output, k))
		it[n++].w = &m->output;
	int rc = 0;
	if (!n)
		goto done;
	if (in_place) {
		for (size_t i = 0; i < n; i++)
			it[i].dst = (unsigned char *)(uintptr_t)it[i].w->data;
		rc = repack_run(it, n, true);
		for (size_t i = 0; rc == 0 && i < n; i++)
			it[i].w->packed = 1;
		rc = rc < 0 ? rc : (int)n;
		goto done;
	}
	if (m->n_packed_maps == NF_REPACK_MAPS) {
		rc = -ENOSPC;
		goto done;
	}
	for (size_t i = 0; i < n; i++)
		bytes += (it[i].w->row_bytes * it[i].w->nrows + 63) & ~(size_t)63;
	/* anonymous memory the model owns; not MADV_HUGEPAGE: with the
	 * kernel's defrag=madvise the faults compacted memory for seconds */
	void *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		rc = -errno;
		goto done;
	}
	m->packed[m->n_packed_maps].p = mem;
	m->packed[m->n_packed_maps++].len = bytes;
	unsigned char *p = mem;
	for (size_t i = 0; i < n; i++) {
		it[i].dst = p;
		p += (it[i].w->row_bytes * it[i].w->nrows + 63) & ~(size_t)63;
	}
	(void)repack_run(it, n, false);
	/* the file's pages are no longer read: drop them from this process
	 * (they stay in the page cache, reclaimable) */
	size_t pg = (size_t)sysconf(_SC_PAGESIZE);
	for (size_t i = 0; i < n; i++) {
		struct nf_weight *w = it[i].w;
		uintptr_t a = ((uintptr_t)w->data + pg - 1) & ~(uintptr_t)(pg - 1);
		uintptr_t e = ((uintptr_t)w->data + w->row_bytes * w->nrows) & ~(uintptr_t)(pg - 1);
		if (e > a)
			madvise((void *)a, e - a, MADV_DONTNEED);
		w->data = it[i].dst;
		w->packed = 1;
	}
	rc = (int)n;
done:
	free(it);
	return rc;
}

void nf_model_free(struct nf_model *m)
{
	if (!m)
		return;
	free(m->layers);
	for (int i = 0; i < m->n_packed_maps; i++)
		munmap(m->packed[i].p, m->packed[i].len);
	nf_gguf_close(m->g);
	nf_model_store_free(m);
	free(m);
}

const struct nf_model_hparams *nf_model_hparams(const struct nf_model *m)
{
	return &m->hp;
}

const struct nf_layer_weights *nf_model_layer(const struct nf_model *m, uint32_t il)
{
	return il < m->hp.n_layer ? &m->layers[il] : NULL;
}

struct nf_store *nf_model_store(const struct nf_model *m)
{
	return m->store;
}

struct nf_cache *nf_model_cache(const struct nf_model *m)
{
	return m->cache;
}

bool nf_model_ffn_in_memory(const struct nf_model *m)
{
	return !m->store || m->ffn_unpacked;
}

const struct nf_gguf *nf_model_gguf(const struct nf_model *m)
{
	return m->g;
}

uint64_t nf_model_weight_bytes(const struct nf_model *m)
{
	return m->weight_bytes;
}

bool nf_model_attn_in_memory(const struct nf_model *m)
{
	return !m->attn_deferred;
}

uint32_t nf_model_attn_layers_in_memory(const struct nf_model *m)
{
	return m->attn_deferred ? m->attn_in_mem : m->hp.n_layer;
}

uint64_t nf_model_attn_bytes(const struct nf_model *m)
{
	if (m->store)
		return m->attn_bytes;
	uint64_t b = 0;
	for (uint32_t il = 0; il < m->hp.n_layer; il++) {
		const struct nf_layer_weights *L = &m->layers[il];
		b += (uint64_t)L->wq.row_bytes * L->wq.nrows + (uint64_t)L->wk.row_bytes * L->wk.nrows +
		     (uint64_t)L->wv.row_bytes * L->wv.nrows + (uint64_t)L->wo.row_bytes * L->wo.nrows;
	}
	return b;
}

bool nf_model_embd_in_store(const struct nf_model *m)
{
	return m->embd_obj != NULL;
}

uint64_t nf_model_step_dense_bytes(const struct nf_model *m)
{
	uint64_t b = nf_model_attn_bytes(m) + (uint64_t)m->output.row_bytes * m->output.nrows;
	for (uint32_t il = 0; il < m->hp.n_layer; il++) {
		const struct nf_layer_weights *L = &m->layers[il];
		/* a mixture of experts runs the predictors of its routed experts */
		uint64_t np = m->hp.n_expert ? m->hp.n_expert_used : 1;
		b += np * ((uint64_t)L->fc1.row_bytes * L->fc1.nrows + (uint64_t)L->fc2.row_bytes * L->fc2.nrows) +
		     (uint64_t)L->router.row_bytes * L->router.nrows + 2ull * m->hp.n_embd * sizeof(float);
	}
	return b + (m->tok_embd.row_bytes ? m->tok_embd.row_bytes : (uint64_t)m->hp.n_embd * sizeof(float));
}
