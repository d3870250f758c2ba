/*
 * serve_engine.c - the model behind `nflash serve` (see serve_engine.h).
 *
 * The engine (nf_engine_open) owns the model, the neuron cache, the sparse
 * FFN engine and a context, the host: every evaluation runs on it
 * (nf_ctx_eval_seqs), whichever slot it is for. Slot 0's KV cache is the
 * host's; every other slot is a context of its own that holds a KV cache
 * and logits only (n_batch 1, one thread: no scratch to speak of).
 *
 * Invariants: all slots have the host's n_ctx and KV type; with a budget,
 * every slot's bytes are inside it, at every moment (the split is decided
 * by a dry run, the engine opened once); the fixed overhead is measured
 * once, at the first open; only the scheduler thread calls in.
 */
#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/cache.h"
#include "nflash/engine.h"
#include "nflash/gguf.h"
#include "nflash/model.h"
#include "nflash/sparse.h"
#include "nflash/tokenizer.h"
#include "cli.h"
#include "serve_engine.h"

struct serve_engine {
	struct nf_engine_opts opts;  /* from the flags; overhead set by the first open */
	unsigned n_slots;
	bool batch;
	struct nf_engine *eng;       /* NULL after a failed reopen */
	struct nf_ctx *host;         /* the engine's context */
	struct nf_ctx **slots;       /* [0]: host */
	struct nf_ctx **rows;        /* a step's sequences (n_rows or n_slots entries) */
	int32_t *ids;                /* a decode step's tokens (n_slots) */
	uint32_t n_rows;             /* the host's n_batch */
	struct nf_tok *tok;
	uint64_t slot_bytes;
	uint64_t engine_budget;      /* of opts.budget, what the engine gets beside the slots (0: all) */
	char *chat_template;
	struct serve_engine_stats base;  /* counters of engines closed by reopen */
	uint64_t steps, step_slots, batch_hist[SERVE_BATCH_BUCKETS];
};

static double mib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0);
}

/* A KV cache over the host's model, as large as the host's. */
static int open_slot(struct serve_engine *e, unsigned i)
{
	struct nf_diag d = { 0 };
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = nf_ctx_n_ctx(e->host);
	cp.n_batch = 1;
	cp.n_threads = 1;
	cp.kv_type = (enum nf_kv_type)nf_engine_opts(e->eng)->kv_type;
	int rc = nf_ctx_open(nf_engine_model(e->eng), &cp, &e->slots[i], &d);
	if (rc < 0)
		nf_cli_err("serve: slot %u: %s", i, nf_diag_msg(&d, rc));
	return rc;
}

static void close_all(struct serve_engine *e)
{
	for (unsigned i = 1; i < e->n_slots; i++) {
		nf_ctx_close(e->slots[i]);
		e->slots[i] = NULL;
	}
	e->slots[0] = e->host = NULL;
	nf_engine_close(e->eng);
	e->eng = NULL;
	free(e->rows);
	e->rows = NULL;
	/* give the heap's free memory back to the system: a reopen must not
	 * pay for what the closed engine left in the allocator */
	malloc_trim(0);
}

/* Open the engine with budget and every slot. Returns an exit code. */
static int open_engine(struct serve_engine *e, uint64_t budget)
{
	struct nf_engine_opts o = e->opts;
	struct nf_diag d = { 0 };
	o.budget = budget;
	int rc = nf_engine_open(&o, &e->eng, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	struct nf_engine_info ei;
	nf_engine_info(e->eng, &ei);
	if (!e->opts.overhead)
		e->opts.overhead = ei.overhead;   /* measured now, kept for every reopen */
	e->host = e->slots[0] = nf_engine_ctx(e->eng);
	e->n_rows = nf_ctx_n_batch(e->host);
	e->rows = calloc(e->n_rows > e->n_slots ? e->n_rows : e->n_slots, sizeof(*e->rows));
	if (!e->rows) {
		nf_cli_err("serve: out of memory");
		return NF_EXIT_FAIL;
	}
	e->slot_bytes = 0;
	for (unsigned i = 1; i < e->n_slots; i++) {
		if (open_slot(e, i) < 0)
			return NF_EXIT_FAIL;
		e->slot_bytes = nf_ctx_bytes(e->slots[i]);
	}
	return NF_EXIT_OK;
}

/*
 * What the engine gets of a budget beside n_slots - 1 further KV caches: a
 * dry run (nf_engine_opts.size_only: the model and a context, nothing
 * else) tells what the engine would take and the context length, one slot
 * context of that length what a KV cache takes; the engine gets the
 * budget less the slots' share when both do not fit. The dry run also
 * measures the fixed overhead, before anything else is allocated. Opening
 * the real engine first and reopening it smaller would hold the first
 * engine beside the slots for a moment: above the budget.
 */
static int split_budget(struct serve_engine *e)
{
	uint64_t budget = e->opts.budget;
	struct nf_engine_opts o = e->opts;
	struct nf_diag d = { 0 };
	o.size_only = true;
	o.log = NULL;
	int rc = nf_engine_open(&o, &e->eng, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	struct nf_engine_info ei;
	nf_engine_info(e->eng, &ei);
	e->opts.overhead = ei.overhead;
	e->host = nf_engine_ctx(e->eng);
	int ret = NF_EXIT_FAIL;
	if (open_slot(e, 1) < 0)
		goto done;
	e->slot_bytes = nf_ctx_bytes(e->slots[1]);
	uint64_t extra = (uint64_t)(e->n_slots - 1) * e->slot_bytes;
	uint64_t used = ei.weights + ei.arena + ei.attn_buffers + ei.reserved + ei.overhead;
	ret = NF_EXIT_USAGE;
	if (extra >= budget) {
		nf_cli_err("--memory-budget %.1f MiB cannot hold %u slots' KV caches of %.1f MiB each (-c %u); "
			   "lower --parallel or -c", mib(budget), e->n_slots, mib(e->slot_bytes), ei.n_ctx);
		goto done;
	}
	/* the engine takes no more than the model needs: a roomy budget
	 * holds the slots beside it as it is */
	e->engine_budget = used + extra > budget ? budget - extra : budget;
	ret = NF_EXIT_OK;
done:
	close_all(e);
	return ret;
}

/* Open the engine and every slot from e->opts. Returns an exit code. */
static int open_all(struct serve_engine *e)
{
	/* the plan made for the user's budget, whatever the slots take of it */
	if (!e->opts.plan_for)
		e->opts.plan_for = e->opts.budget;
	if (e->opts.budget && e->n_slots > 1 && !e->engine_budget) {
		int ret = split_budget(e);
		if (ret != NF_EXIT_OK)
			return ret;
	}
	int ret = open_engine(e, e->engine_budget ? e->engine_budget : e->opts.budget);
	if (ret != NF_EXIT_OK && e->engine_budget && e->engine_budget < e->opts.budget)
		nf_cli_err("--memory-budget %.1f MiB: %u slots' KV caches take %.1f MiB of it; lower --parallel or -c",
			   mib(e->opts.budget), e->n_slots, mib(e->opts.budget - e->engine_budget));
	return ret;
}

int serve_engine_open(const struct nf_model_cli *mc, unsigned n_slots, bool batch, struct serve_engine **out)
{
	if (n_slots == 0)
		n_slots = 1;
	struct serve_engine *e = calloc(1, sizeof(*e));
	struct nf_ctx **slots = calloc(n_slots, sizeof(*slots));
	int32_t *ids = calloc(n_slots, sizeof(*ids));
	if (!e || !slots || !ids) {
		free(e);
		free(slots);
		free(ids);
		nf_cli_err("serve: out of memory");
		return NF_EXIT_FAIL;
	}
	if (!mc->path) {
		free(e);
		free(slots);
		free(ids);
		nf_cli_err("serve: no model: give -m FILE");
		return NF_EXIT_USAGE;
	}
	nf_model_cli_engine_opts(mc, &e->opts);
	e->slots = slots;
	e->ids = ids;
	e->n_slots = n_slots;
	e->batch = batch;
	int ret = open_all(e);
	if (ret != NF_EXIT_OK)
		goto fail;
	const struct nf_gguf *g = nf_model_gguf(nf_engine_model(e->eng));
	struct nf_diag td = { 0 };
	int trc = nf_tok_open(g, &e->tok, &td);
	if (trc < 0) {
		nf_cli_warn("%s; only token-id prompts are served", nf_diag_msg(&td, trc));
		e->tok = NULL;
	}
	const char *t = NULL;
	if (nf_gguf_get_str(g, "tokenizer.chat_template", &t) == 0 && t && !(e->chat_template = strdup(t))) {
		ret = NF_EXIT_FAIL;
		goto fail;
	}
	struct nf_engine_info ei;
	nf_engine_info(e->eng, &ei);
	fprintf(stderr, "nflash: serve: %u slot%s, -c %u, attention %s; decode steps %s", n_slots,
		n_slots > 1 ? "s" : "", ei.n_ctx, ei.attn_streamed ? "streamed" : "in memory",
		batch ? "batched" : "one slot at a time");
	if (n_slots > 1)
		fprintf(stderr, "; %u further KV caches x %.1f MiB", n_slots - 1, mib(e->slot_bytes));
	fputc('\n', stderr);
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
	close_all(e);
	if (open_all(e) != NF_EXIT_OK) {
		close_all(e);
		return -EIO;
	}
	return 0;
}

void serve_engine_close(struct serve_engine *e)
{
	if (!e)
		return;
	close_all(e);
	nf_tok_close(e->tok);
	free(e->chat_template);
	free(e->slots);
	free(e->ids);
	free(e);
}

void serve_engine_info(const struct serve_engine *e, struct serve_engine_info *out)
{
	const struct nf_model_hparams *hp = nf_model_hparams(nf_engine_model(e->eng));
	struct nf_engine_info ei;
	nf_engine_info(e->eng, &ei);
	memset(out, 0, sizeof(*out));
	out->n_vocab = hp->n_vocab;
	out->n_ctx = nf_ctx_n_ctx(e->host);
	out->n_slots = e->n_slots;
	out->eos_id = hp->eos_id;
	out->tok = e->tok;
	out->chat_template = e->chat_template;
	out->slot_bytes = e->slot_bytes;
	out->streamed = nf_engine_cache(e->eng) != NULL;
	out->attn_streamed = ei.attn_streamed;
	out->batch = e->batch;
}

int serve_engine_eval(struct serve_engine *e, unsigned slot, const int32_t *ids, size_t n)
{
	if (slot >= e->n_slots)
		return NF_EUSAGE;
	if (n > nf_ctx_n_ctx(e->slots[slot]) - nf_ctx_n_past(e->slots[slot]))
		return NF_EBUDGET;
	for (size_t off = 0; off < n; off += e->n_rows) {
		size_t nb = n - off < e->n_rows ? n - off : e->n_rows;
		for (size_t i = 0; i < nb; i++)
			e->rows[i] = e->slots[slot];
		int rc = nf_ctx_eval_seqs(e->host, e->rows, ids + off, nb);
		if (rc < 0)
			return rc;
	}
	return 0;
}

/* Count a decode step of n slots. */
static void count_step(struct serve_engine *e, size_t n)
{
	unsigned k = 0;
	while (k + 1 < SERVE_BATCH_BUCKETS && n > (1u << k))
		k++;
	e->batch_hist[k]++;
	e->steps++;
	e->step_slots += n;
}

int serve_engine_decode(struct serve_engine *e, struct serve_decode *items, size_t n)
{
	if (!e->batch || n == 1) {
		for (size_t i = 0; i < n; i++) {
			items[i].rc = serve_engine_eval(e, items[i].slot, &items[i].id, 1);
			count_step(e, 1);
		}
		return 0;
	}
	/* one step for all: a row per slot (more than the host's n_batch
	 * are split by nf_ctx_eval_seqs) */
	int rc = 0;
	for (size_t i = 0; i < n && rc == 0; i++) {
		if (items[i].slot >= e->n_slots) {
			rc = NF_EUSAGE;
			break;
		}
		e->rows[i] = e->slots[items[i].slot];
		e->ids[i] = items[i].id;
	}
	if (rc == 0)
		rc = nf_ctx_eval_seqs(e->host, e->rows, e->ids, n);
	count_step(e, n);
	for (size_t i = 0; i < n; i++)
		items[i].rc = rc;
	return 0;
}

const float *serve_engine_logits(const struct serve_engine *e, unsigned slot)
{
	return nf_ctx_logits(e->slots[slot]);
}

uint32_t serve_engine_n_past(const struct serve_engine *e, unsigned slot)
{
	return nf_ctx_n_past(e->slots[slot]);
}

void serve_engine_reset(struct serve_engine *e, unsigned slot)
{
	nf_ctx_reset(e->slots[slot]);
}

void serve_engine_stats(const struct serve_engine *e, struct serve_engine_stats *out)
{
	*out = e->base;
	out->steps = e->steps;
	out->step_slots = e->step_slots;
	memcpy(out->batch_hist, e->batch_hist, sizeof(out->batch_hist));
	struct nf_cache *cache = e->eng ? nf_engine_cache(e->eng) : NULL;
	if (cache) {
		struct nf_cache_stats cs;
		nf_cache_stats_get(cache, &cs);
		out->lookups += cs.lookups;
		out->hits_hot += cs.hits_hot;
		out->hits_cold += cs.hits_cold;
		out->misses += cs.misses;
		out->requests += cs.requests + cs.hot_requests;
		out->bytes_read += cs.bytes_read;
		out->errors += cs.errors;
	}
	struct nf_sparse *sp = e->eng ? nf_engine_sparse(e->eng) : NULL;
	if (sp) {
		struct nf_sparse_stats ss;
		nf_sparse_stats_get(sp, &ss);
		out->t_ffn += ss.t_ffn;
		out->t_wait += ss.t_wait;
	}
}
