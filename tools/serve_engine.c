/*
 * serve_engine.c - the model behind `nflash serve` (see serve_engine.h).
 *
 * Slot 0 is the context nf_model_cli_open() builds; every other slot is a
 * context of its own (KV cache, scratch, pool) over the same model, with a
 * sparse FFN engine of its own reading through the same neuron cache.
 *
 * Invariants: all slots have equal parameters (n_ctx, batch, KV type,
 * threads, FFN mode); with a budget, every slot's bytes are inside it; only
 * the scheduler thread calls in.
 */
#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/cache.h"
#include "nflash/gguf.h"
#include "nflash/model.h"
#include "nflash/sparse.h"
#include "nflash/tokenizer.h"
#include "cli.h"
#include "serve_engine.h"

struct serve_slot {
	struct nf_ctx *ctx;
	struct nf_sparse *sparse;    /* NULL for slot 0 (mc->sparse) */
};

struct serve_engine {
	struct nf_model_cli *mc;
	struct nf_tok *tok;
	unsigned n_slots;
	struct serve_slot *slots;
	uint64_t slot_bytes;
	char *chat_template;
	struct serve_engine_stats base;  /* counters of engines closed by reopen */
};

static double mib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0);
}

static struct nf_sparse *slot_sparse(const struct serve_engine *e, unsigned i)
{
	return i == 0 ? e->mc->sparse : e->slots[i].sparse;
}

/* A context and FFN engine like slot 0's. */
static int open_slot(struct serve_engine *e, unsigned i)
{
	struct nf_model_cli *mc = e->mc;
	struct nf_diag d = { 0 };
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = nf_ctx_n_ctx(mc->ctx);
	cp.n_batch = nf_ctx_n_batch(mc->ctx);
	cp.n_threads = nf_ctx_n_threads(mc->ctx);
	cp.kv_type = mc->kv_type;
	int rc = nf_ctx_open(mc->model, &cp, &e->slots[i].ctx, &d);
	if (rc < 0) {
		nf_cli_err("serve: slot %u: %s", i, nf_diag_msg(&d, rc));
		return rc;
	}
	enum nf_sparse_mode mode = nf_sparse_mode_of(mc->sparse);
	if (mode == NF_SPARSE_OFF)
		return 0;
	struct nf_sparse_params sp;
	nf_sparse_params_init(&sp);
	sp.mode = mode;
	sp.threshold_set = true;
	sp.threshold = nf_sparse_threshold(mc->sparse);
	sp.cache = mc->cache;
	sp.hot_after = 0;      /* slot 0's engine keeps the shared hot segment */
	rc = nf_sparse_open(e->slots[i].ctx, &sp, &e->slots[i].sparse, &d);
	if (rc < 0)
		nf_cli_err("serve: slot %u: %s", i, nf_diag_msg(&d, rc));
	return rc;
}

static void close_slots(struct serve_engine *e)
{
	for (unsigned i = 1; i < e->n_slots; i++) {
		nf_sparse_close(e->slots[i].sparse);
		nf_ctx_close(e->slots[i].ctx);
		e->slots[i] = (struct serve_slot){ 0 };
	}
}

/* Give the heap's free memory back to the system after closing a model:
 * the engine counts the resident set at open as fixed overhead, so a
 * reopen must not pay for what the closed one left in the allocator. */
static void trim_heap(void)
{
	malloc_trim(0);
}

/* Open the model and every slot from e->mc's flags. Returns an exit code. */
static int open_all(struct serve_engine *e)
{
	struct nf_model_cli *mc = e->mc;
	unsigned n_slots = e->n_slots;
	uint64_t budget = mc->budget;
	int ret = nf_model_cli_open(mc);
	if (ret != NF_EXIT_OK)
		return ret;
	ret = NF_EXIT_USAGE;
	if (n_slots > 1 && mc->attn_streamed) {
		nf_cli_err("--parallel %u: attention is streamed under this --memory-budget, which serves one "
			   "slot for now; give --parallel 1 or a larger budget", n_slots);
		return ret;
	}
	e->slot_bytes = nf_ctx_bytes(mc->ctx) + nf_sparse_bytes(mc->sparse);
	uint64_t extra = (uint64_t)(n_slots - 1) * e->slot_bytes;
	struct nf_engine_info ei;
	nf_engine_info(mc->engine, &ei);
	uint64_t used = ei.weights + ei.arena + ei.attn_buffers + ei.reserved + ei.overhead;
	if (budget && extra && used + extra > budget) {
		/* every slot's KV cache and scratch inside the budget: reopen
		 * with the other slots' share taken off what the cache gets
		 * (the engine takes no more than the model needs, so a roomy
		 * budget holds the slots without this) */
		nf_model_cli_close(mc);
		trim_heap();
		if (extra >= budget) {
			nf_cli_err("--memory-budget %.1f MiB cannot hold %u slots of %.1f MiB (KV cache and "
				   "scratch for -c %ld each); lower --parallel or -c", mib(budget), n_slots,
				   mib(e->slot_bytes), mc->n_ctx);
			return ret;
		}
		mc->budget = budget - extra;
		ret = nf_model_cli_open(mc);
		mc->budget = budget;
		if (ret != NF_EXIT_OK) {
			nf_cli_err("--memory-budget %.1f MiB: %u slots take %.1f MiB of it (KV cache and scratch); "
				   "lower --parallel or -c", mib(budget), n_slots, mib(extra));
			return ret;
		}
	}
	/* the context may have been fitted smaller to the reduced budget */
	e->slot_bytes = nf_ctx_bytes(mc->ctx) + nf_sparse_bytes(mc->sparse);
	e->slots[0].ctx = mc->ctx;
	for (unsigned i = 1; i < n_slots; i++)
		if (open_slot(e, i) < 0)
			return NF_EXIT_FAIL;
	return NF_EXIT_OK;
}

int serve_engine_open(struct nf_model_cli *mc, unsigned n_slots, struct serve_engine **out)
{
	if (n_slots == 0)
		n_slots = 1;
	struct serve_engine *e = calloc(1, sizeof(*e));
	struct serve_slot *slots = calloc(n_slots, sizeof(*slots));
	if (!e || !slots) {
		free(e);
		free(slots);
		nf_cli_err("serve: out of memory");
		return NF_EXIT_FAIL;
	}
	e->mc = mc;
	e->slots = slots;
	e->n_slots = n_slots;
	int ret = open_all(e);
	if (ret != NF_EXIT_OK)
		goto fail;
	struct nf_diag td = { 0 };
	int trc = nf_tok_open(nf_model_gguf(mc->model), &e->tok, &td);
	if (trc < 0) {
		nf_cli_warn("%s; only token-id prompts are served", nf_diag_msg(&td, trc));
		e->tok = NULL;
	}
	const char *t = NULL;
	if (nf_gguf_get_str(nf_model_gguf(mc->model), "tokenizer.chat_template", &t) == 0 && t &&
	    !(e->chat_template = strdup(t))) {
		ret = NF_EXIT_FAIL;
		goto fail;
	}
	fprintf(stderr, "nflash: serve: %u slot%s x %.1f MiB (KV cache and scratch for -c %u each)\n", n_slots,
		n_slots > 1 ? "s" : "", mib(e->slot_bytes), nf_ctx_n_ctx(mc->ctx));
	*out = e;
	return NF_EXIT_OK;
fail:
	serve_engine_close(e);
	return ret;
}

int serve_engine_reopen(struct serve_engine *e)
{
	/* the counters go on from where the old engine left them */
	struct serve_engine_stats now;
	serve_engine_stats(e, &now);
	e->base = now;
	close_slots(e);
	nf_model_cli_close(e->mc);
	e->slots[0].ctx = NULL;
	trim_heap();
	int ret = open_all(e);
	if (ret != NF_EXIT_OK) {
		close_slots(e);
		nf_model_cli_close(e->mc);
		e->slots[0].ctx = NULL;
		return -EIO;
	}
	return 0;
}

void serve_engine_close(struct serve_engine *e)
{
	if (!e)
		return;
	close_slots(e);
	nf_tok_close(e->tok);
	nf_model_cli_close(e->mc);
	free(e->chat_template);
	free(e->slots);
	free(e);
}

void serve_engine_info(const struct serve_engine *e, struct serve_engine_info *out)
{
	const struct nf_model_hparams *hp = nf_model_hparams(e->mc->model);
	memset(out, 0, sizeof(*out));
	out->n_vocab = hp->n_vocab;
	out->n_ctx = nf_ctx_n_ctx(e->mc->ctx);
	out->n_slots = e->n_slots;
	out->eos_id = hp->eos_id;
	out->tok = e->tok;
	out->chat_template = e->chat_template;
	out->slot_bytes = e->slot_bytes;
	out->streamed = e->mc->cache != NULL;
}

int serve_engine_eval(struct serve_engine *e, unsigned slot, const int32_t *ids, size_t n)
{
	if (slot >= e->n_slots)
		return NF_EUSAGE;
	return nf_ctx_eval(e->slots[slot].ctx, ids, n);
}

int serve_engine_decode(struct serve_engine *e, struct serve_decode *items, size_t n)
{
	/* one slot after the other for now; a batched step (each layer's
	 * union of active neurons read once for all items) goes here */
	for (size_t i = 0; i < n; i++)
		items[i].rc = serve_engine_eval(e, items[i].slot, &items[i].id, 1);
	return 0;
}

const float *serve_engine_logits(const struct serve_engine *e, unsigned slot)
{
	return nf_ctx_logits(e->slots[slot].ctx);
}

uint32_t serve_engine_n_past(const struct serve_engine *e, unsigned slot)
{
	return nf_ctx_n_past(e->slots[slot].ctx);
}

void serve_engine_reset(struct serve_engine *e, unsigned slot)
{
	nf_ctx_reset(e->slots[slot].ctx);
}

void serve_engine_stats(const struct serve_engine *e, struct serve_engine_stats *out)
{
	*out = e->base;
	if (e->mc->cache) {
		struct nf_cache_stats cs;
		nf_cache_stats_get(e->mc->cache, &cs);
		out->lookups += cs.lookups;
		out->hits_hot += cs.hits_hot;
		out->hits_cold += cs.hits_cold;
		out->misses += cs.misses;
		out->requests += cs.requests + cs.hot_requests;
		out->bytes_read += cs.bytes_read;
		out->errors += cs.errors;
	}
	for (unsigned i = 0; i < e->n_slots && e->slots[i].ctx; i++) {
		struct nf_sparse *sp = slot_sparse(e, i);
		if (!sp)
			continue;
		struct nf_sparse_stats ss;
		nf_sparse_stats_get(sp, &ss);
		out->t_ffn += ss.t_ffn;
		out->t_wait += ss.t_wait;
	}
}
