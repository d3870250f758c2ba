/*
 * engine.c - the one entry point front ends open a model through
 * (nflash/engine.h): load, fit the context to the budget, size and open the
 * neuron cache, pin or stream attention, install the sparse FFN engine.
 *
 * Invariants:
 *  1. The budget is a limit on the whole process, not a reservation: the
 *     cache's arena is at most what the store's FFN bundles need beside the
 *     cold minimum, and never more than the budget leaves.
 *  2. Every term of the budget is what the module that allocates it states
 *     (nf_ctx_bytes, nf_sparse_bytes_for, nf_cache_meta_bytes_for,
 *     nf_model_attn_stream_bytes); nothing here restates their arithmetic.
 *  3. On failure nothing stays allocated and d names the file or the flag.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nflash/dtype.h"
#include "nflash/engine.h"
#include "nflash/store.h"
#include "nflash/stream.h"

struct nf_engine {
	struct nf_engine_opts o;
	struct nf_model *model;
	struct nf_ctx *ctx;
	struct nf_sparse *sparse;
	struct nf_store *store;      /* opened here for --ffn-store (else the model's) */
	struct nf_cache *cache;      /* the model's (its FFN segments added here), or ours */
	bool own_cache;              /* --ffn-store: a cache of e->store, closed here */
	const char *store_path;
	struct nf_engine_info info;
	uint32_t kv_covered;         /* positions whose KV bytes the cache gave back */
};

/* The KV cache's positions are taken back from the cold segment's loan
 * this many at a time. */
#define KV_STEP 32u

void nf_engine_opts_default(struct nf_engine_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->kv_type = -1;
	o->sparse_mode = -1;
	o->use_plan = true;
	o->io_backend = -1;
	o->read_gap = -1;
	o->cold_slots = -1;
	o->replan_moves = -1;
	o->route_prefetch = -1;
	o->gate_first = -1;
	o->profile_sig_tokens = 512;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A /proc/self/status field in bytes (VmRSS, VmHWM), 0 if unknown. */
static uint64_t proc_status_bytes(const char *key)
{
	FILE *f = fopen("/proc/self/status", "r");
	if (!f)
		return 0;
	char line[256];
	unsigned long long kb = 0;
	size_t n = strlen(key);
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, key, n) && line[n] == ':' && sscanf(line + n + 1, "%llu", &kb) == 1)
			break;
	fclose(f);
	return (uint64_t)kb * 1024;
}

uint64_t nf_engine_vm_hwm(void)
{
	return proc_status_bytes("VmHWM");
}

uint64_t nf_engine_overhead_now(void)
{
	/* rounded up to 4 MiB, so the minimum a message states does not move
	 * with the few hundred KiB a fresh process's resident set varies by
	 * from run to run */
	return ((proc_status_bytes("VmRSS") + (4u << 20) - 1) & ~(uint64_t)((4u << 20) - 1)) + NF_ENGINE_SLACK;
}

static double mib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0);
}

/*
 * What a memory cgroup charges beyond the resident set for a process that
 * fills budget b: page tables (8 bytes per 4 KiB page: b/512, doubled for
 * the tables' own rounding) and 4 MiB of kernel objects (I/O rings,
 * thread stacks, slabs). On the 47B shape at 4 GiB the cgroup counted
 * 11.8 MiB of kernel memory beside a VmHWM of 4089 MiB, and OOM-killed a
 * run that had no room for it.
 */
static uint64_t kernel_allowance(uint64_t b)
{
	return (b / 256 + (4u << 20) + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
}

/* The least budget B with x + kernel_allowance(B) <= B: the minimum to
 * state when x is what a run needs beside the allowance. */
static uint64_t stated_min(uint64_t x)
{
	uint64_t b = (x + (4u << 20)) / 255 * 256;
	while (x + kernel_allowance(b) > b)
		b += 64u << 10;
	return b;
}

static void say(const struct nf_engine *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(const struct nf_engine *e, const char *fmt, ...)
{
	if (!e->o.log)
		return;
	va_list ap;
	va_start(ap, fmt);
	fputs("nflash: ", e->o.log);
	vfprintf(e->o.log, fmt, ap);
	fputc('\n', e->o.log);
	va_end(ap);
}

/* Bytes of the FFN weights (gate, up, down) the model maps. */
static uint64_t ffn_weight_bytes(const struct nf_model *m)
{
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	uint64_t b = 0;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		const struct nf_weight *w[] = { &L->gate, &L->up, &L->down, &L->down_t };
		for (size_t i = 0; i < 4; i++)
			if (w[i]->data)
				b += (uint64_t)w[i]->nrows * w[i]->row_bytes * w[i]->n_expert;
	}
	return b;
}

/* Bytes of every FFN bundle of the store: what a cache holding all of them
 * needs. */
static uint64_t store_ffn_bytes(struct nf_store *s)
{
	uint64_t all = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_FFN)
			all += (uint64_t)ob->n_bundles * ob->stride;
	}
	return all;
}

static uint64_t store_ffn_neurons(struct nf_store *s)
{
	uint64_t n = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_FFN)
			n += ob->n_bundles;
	}
	return n;
}

static bool predictor_mode(const struct nf_engine *e)
{
	int sm = e->o.sparse_mode;
	return (sm == NF_SPARSE_PREDICTOR ||
		((sm < 0 || sm == NF_SPARSE_AUTO) && nf_model_layer(e->model, 0)->fc1.data));
}

/*
 * How a store-backed FFN fits the budget (all bytes): the decision
 * open_cache carries out. Pure arithmetic on the open context.
 */
struct fit {
	uint64_t dense;        /* dense weights in memory but attention */
	uint64_t attn;         /* attention left in the store */
	uint64_t engine;       /* the sparse engine's tables and scratch */
	uint64_t meta;         /* the cache's tables at the arena below */
	uint64_t rec;          /* --profile's co-activation record */
	uint64_t fixed;        /* dense + ctx + engine + rec + overhead (+ attention as decided) */
	uint64_t min_cold;     /* bytes of the smallest cold segment */
	uint32_t cold_slots;   /* 0: one layer */
	const char *cold_what;
	bool stream;           /* attention streamed */
	uint32_t pin;          /* layers of attention pinned */
	uint64_t pin_bytes, sbytes;
	uint64_t need;         /* the minimum this decision needs */
	uint64_t arena;        /* what the cache gets */
	uint64_t lend;         /* the KV cache's unwritten part, lent to the hot segment */
};

/* The smallest cold segment the sparse engine works with: a chunk of up
 * to 95 neurons must fit (the --cold-slots floor). */
#define MIN_COLD_SLOTS 128u

/* f for attention streamed or not and a cold segment of cold_slots (0: one
 * layer): what it fixes, needs, and the arena the budget leaves. */
static void fit_eval(const struct nf_engine *e, struct nf_store *store, uint64_t base, uint32_t sig, bool stream,
		     uint32_t cold_slots, struct fit *f)
{
	const struct nf_engine_opts *o = &e->o;
	uint32_t L = nf_model_hparams(e->model)->n_layer;
	f->cold_slots = cold_slots;
	f->min_cold = nf_cache_min_bytes_for(store, cold_slots);
	/* the cache's tables grow with its slots: the minimum counts those of
	 * the smallest arena, and the arena below leaves room for its own */
	f->meta = nf_cache_meta_bytes_for(store, f->min_cold, sig);
	f->stream = f->attn && stream;
	f->pin = f->stream ? (o->attn_pin < L ? o->attn_pin : L) : L;
	f->pin_bytes = f->attn / L * f->pin;
	if (f->pin == L)
		f->stream = false;
	f->fixed = base + f->meta + (f->stream ? f->sbytes + f->pin_bytes : f->attn);
	f->need = f->fixed + f->min_cold;
	uint64_t all = store_ffn_bytes(store) + f->min_cold;
	if (o->budget) {
		/* what the budget leaves with the tables of that many slots
		 * (counted at the budget's slots: from above); at least the cold
		 * minimum, whose tables the minimum counted */
		uint64_t rest = o->budget > f->fixed - f->meta ? o->budget - (f->fixed - f->meta) : 0;
		uint64_t m = nf_cache_meta_bytes_for(store, rest < all ? rest : all, sig);
		f->arena = rest > m ? rest - m : 0;
		if (f->arena < f->min_cold)
			f->arena = f->min_cold;
	} else {
		f->arena = all;
	}
	if (f->arena > all)
		f->arena = all;
}

/*
 * How the budget is spent. The cold segment: one layer's bundles by
 * default, what a prefill batch or a dense FFN reads at once; with a
 * smaller one the engine halves batches and splits a token's chunks into
 * windows (same output, slower prefill: docs/PIPELINE.md "Cold segment").
 * Attention: pinned, unless it does not fit. The first of these that fits
 * the budget is taken: attention pinned with a layer of cold slots; pinned
 * with a quarter layer (predictor mode, whose decode needs only a token's
 * misses); pinned with the cold segment shrunk to what the budget leaves
 * (at least MIN_COLD_SLOTS); then the same three with attention streamed.
 * --cold-slots N and --stream-attn narrow the choice. When none fits, f
 * holds the last: the true minimum.
 */
static void fit_plan(const struct nf_engine *e, struct nf_store *store, const struct nf_cache_geom *g,
		     struct fit *f)
{
	const struct nf_engine_opts *o = &e->o;
	const struct nf_model_hparams *hp = nf_model_hparams(e->model);
	memset(f, 0, sizeof(*f));
	f->dense = nf_model_weight_bytes(e->model) - ffn_weight_bytes(e->model);
	f->attn = nf_model_attn_in_memory(e->model) ? 0 : nf_model_attn_bytes(e->model);
	f->engine = nf_sparse_bytes_for(e->ctx, g) + (o->gate_first > 0 ? nf_sparse_gate_first_bytes(e->ctx, g) : 0);
	if (o->profile) {
		f->rec = store_ffn_neurons(store) * ((o->profile_sig_tokens + 63) / 64) * 8;
		/* and the predictor's moments (nf_sparse_params.record_moments) */
		const struct nf_weight *fc1 = &nf_model_layer(e->model, 0)->fc1;
		uint64_t r = fc1->data ? fc1->nrows : 0;
		if (r)
			f->rec += (uint64_t)hp->n_layer * (hp->n_expert ? hp->n_expert : 1) * (1 + r + r * r) * 8;
	}
	struct nf_stream_opts so;
	nf_stream_opts_default(&so);
	f->sbytes = nf_model_attn_stream_bytes(e->model, so.n_slots);
	uint64_t base = f->dense + nf_ctx_bytes(e->ctx) + f->engine + f->rec + e->info.overhead;
	uint32_t sig = o->profile ? o->profile_sig_tokens : 0;
	bool cold_auto = o->cold_slots < 0;
	/* K-quant downs compute whole 256-neuron super-blocks: never fewer
	 * cold slots than the sparse engine's chunk of them */
	uint32_t kmin = nf_sparse_min_cold_slots(g);
	uint32_t quarter = hp->n_ff / 4 > 256 ? hp->n_ff / 4 : 256;
	uint32_t floor = MIN_COLD_SLOTS > kmin ? MIN_COLD_SLOTS : kmin;
	quarter = quarter > floor ? quarter : floor;
	floor = g->n_neurons < floor ? g->n_neurons : floor;
	uint32_t upper = predictor_mode(e) && quarter < g->n_neurons ? quarter : g->n_neurons;
	bool evaluated = false;
	for (int streamed = 0; streamed < 2; streamed++) {
		if ((o->stream_attn && !streamed) || (streamed && !f->attn))
			continue;
		/* a layer (or --cold-slots N) */
		fit_eval(e, store, base, sig, streamed, o->cold_slots > 0 ? (uint32_t)o->cold_slots : 0, f);
		f->cold_what = o->cold_slots > 0 ? "the --cold-slots bundles" : "one layer's neurons";
		evaluated = true;
		if (!o->budget || f->need <= o->budget)
			return;
		if (!cold_auto)
			continue;
		if (predictor_mode(e) && quarter < g->n_neurons) {
			fit_eval(e, store, base, sig, streamed, quarter, f);
			f->cold_what = "a quarter of a layer's neurons (predictor mode, tight budget)";
			if (f->need <= o->budget)
				return;
		}
		/* what the budget leaves, down to the floor */
		fit_eval(e, store, base, sig, streamed, floor, f);
		f->cold_what = "the smallest cold segment (the budget leaves no more)";
		if (f->need <= o->budget) {
			uint64_t room = (o->budget - (f->fixed - f->meta)) / g->stride;
			uint32_t c = room > upper ? upper : (uint32_t)room;
			/* the tables of c slots come out of the same room */
			while (c > floor) {
				struct fit t = *f;
				fit_eval(e, store, base, sig, streamed, c, &t);
				if (t.need <= o->budget) {
					*f = t;
					break;
				}
				c -= (c - floor + 15) / 16;
			}
			f->cold_what = "a cold segment shrunk to what the budget leaves";
			return;
		}
	}
	if (!evaluated) { /* --stream-attn with no attention to stream */
		fit_eval(e, store, base, sig, false, o->cold_slots > 0 ? (uint32_t)o->cold_slots : 0, f);
		f->cold_what = o->cold_slots > 0 ? "the --cold-slots bundles" : "one layer's neurons";
	}
}

static int budget_error(const struct nf_engine *e, const struct fit *f, struct nf_diag *d)
{
	const struct nf_engine_opts *o = &e->o;
	uint64_t ctxb = nf_ctx_bytes(e->ctx);
	/* the overhead's kernel allowance as it would be at the minimum */
	uint64_t ka = kernel_allowance(o->budget), need = stated_min(f->need - ka);
	uint64_t over = e->info.overhead - ka + kernel_allowance(need);
	if (f->stream)
		return nf_diag_fail(
			d, NF_EBUDGET,
			"--memory-budget %.1f MiB is too small for %s even with attention streamed: at least %.1f MiB "
			"needed (%.1f MiB pinned dense weights%s + %.1f MiB attention buffers + %.1f MiB KV cache and "
			"scratch for -c %u + %.1f MiB engine and cache tables + %.1f MiB fixed overhead + %.1f MiB: %s "
			"in the cache; a smaller -c or --kv-type f16 lowers the KV cache)",
			mib(o->budget), e->store_path, mib(need), mib(f->dense + f->pin_bytes),
			f->pin ? " with --attn-pin-layers' attention" : "", mib(f->sbytes), mib(ctxb),
			nf_ctx_n_ctx(e->ctx), mib(f->engine + f->meta + f->rec), mib(over), mib(f->min_cold),
			f->cold_what);
	return nf_diag_fail(d, NF_EBUDGET,
			    "--memory-budget %.1f MiB is too small for %s: at least %.1f MiB needed (%.1f MiB dense "
			    "weights + %.1f MiB KV cache and scratch for -c %u + %.1f MiB engine and cache tables + "
			    "%.1f MiB fixed overhead + %.1f MiB: %s in the cache; a smaller -c lowers the KV cache)",
			    mib(o->budget), e->store_path, mib(need), mib(f->dense + f->attn), mib(ctxb),
			    nf_ctx_n_ctx(e->ctx), mib(f->engine + f->meta + f->rec), mib(over), mib(f->min_cold),
			    f->cold_what);
}

/* The cache's options for fit f. */
static void cache_opts(struct nf_engine *e, const struct fit *f, struct nf_cache_opts *co)
{
	const struct nf_engine_opts *o = &e->o;
	nf_cache_opts_default(co);
	co->io.quiet = e->o.log == NULL;
	co->use_profile = !o->profile; /* a calibration run counts from zero */
	if (o->profile) {
		/* the hot segment as large as a run with the profile will have
		 * (its size is the head of the co-activation layout), and the
		 * record the layout is planned from, counted in the budget */
		co->hot_fraction = co->profile_hot_fraction;
		co->sig_tokens = o->profile_sig_tokens;
	}
	if (o->io_backend >= 0)
		co->io.backend = (enum nf_io_backend)o->io_backend;
	co->io.on_read = o->on_read;
	co->io.on_read_user = o->on_read_user;
	if (o->qd)
		co->io.qd = o->qd;
	if (o->read_gap >= 0)
		co->max_gap = (uint32_t)o->read_gap;
	co->min_cold_slots = f->cold_slots;
	co->arena_bytes = f->arena;
	co->lend_bytes = f->lend;
	/* a budget is a limit: the arena is touched now only when it was sized
	 * from the budget, so decode takes no page faults */
	co->prefault = o->budget != 0;
}

/*
 * Under a budget the KV cache is counted whole, but only the positions
 * written are resident (nf_ctx_kv_bytes_at): the rest is lent to the hot
 * segment, and taken back KV_STEP positions at a time as the context
 * fills (kv_grow), so that a short conversation has the cache of a short
 * -c and a long one still fits. The loan's lasting cost (the lent slots'
 * tables, the rounding of a give-back) comes out of the arena; none when
 * the arena holds every bundle already, or is at its minimum.
 */
static void lend_kv(struct nf_engine *e, struct nf_store *store, struct fit *f)
{
	f->lend = 0;
	if (!e->o.budget || e->o.profile)
		return;
	uint32_t n_ctx = nf_ctx_n_ctx(e->ctx);
	uint32_t first = KV_STEP < n_ctx ? KV_STEP : n_ctx;
	uint64_t lend = nf_ctx_bytes_kv(e->ctx) - nf_ctx_kv_bytes_at(e->ctx, first);
	uint64_t all = store_ffn_bytes(store) + f->min_cold;
	if (f->arena >= all)
		return;
	if (lend > all - f->arena)
		lend = all - f->arena;
	uint32_t slots;
	uint64_t cost = nf_cache_lend_cost(store, lend, &slots);
	if (!slots || f->arena < f->min_cold + cost)
		return;
	f->arena -= cost;
	f->lend = lend;
}

static int kv_grow(void *user, uint32_t n)
{
	struct nf_engine *e = user;
	uint32_t n_ctx = nf_ctx_n_ctx(e->ctx);
	if (n <= e->kv_covered)
		return 0;
	uint32_t to = (n + KV_STEP - 1) / KV_STEP * KV_STEP;
	to = to < n_ctx ? to : n_ctx;
	uint64_t bytes = nf_ctx_kv_bytes_at(e->ctx, to) - nf_ctx_kv_bytes_at(e->ctx, e->kv_covered);
	int rc = nf_cache_give_back(e->cache, bytes);
	if (rc < 0)
		return rc;
	e->kv_covered = to;
	return 0;
}

/* Carry out fit f: pin or stream attention, open the cache. */
static int open_cache(struct nf_engine *e, struct nf_store *store, const struct fit *f, struct nf_diag *d)
{
	const struct nf_engine_opts *o = &e->o;
	const struct nf_model_hparams *hp = nf_model_hparams(e->model);
	int rc;
	struct nf_cache_opts co;
	cache_opts(e, f, &co);
	e->info.qd = co.io.qd;
	e->info.read_gap = co.max_gap;
	if (o->profile) {
		/* what this calibration run holds that a run under the same
		 * budget does not: the record, and (mostly) the KV cache of a
		 * long -c; the layout's head counts them as hot */
		e->info.profile_extra = f->rec + nf_ctx_bytes(e->ctx);
		e->info.profile_rec = f->rec;
	}
	if (f->attn && f->pin && (rc = nf_model_attn_load(e->model, f->pin, d)) < 0)
		return rc;
	uint64_t weights = f->dense;
	if (f->stream) {
		struct nf_stream_opts so;
		nf_stream_opts_default(&so);
		if ((rc = nf_ctx_stream_attn(e->ctx, &so, d)) < 0)
			return nf_diag_prefix(d, rc, "%s: streaming attention", e->store_path);
		e->info.attn_streamed = true;
		char pinned[64] = "";
		if (f->pin)
			snprintf(pinned, sizeof(pinned), ", attention of layers 0-%u", f->pin - 1);
		say(e,
		    "attention streamed from the store%s: %u layers x %.1f MiB read at every forward step through "
		    "%u buffers (%.1f MiB); pinned: norms, %soutput%s%s (%.1f MiB, where the pinned set "
		    "would be %.1f MiB)",
		    o->stream_attn ? " (--stream-attn)" : " (the pinned dense weights do not fit the budget)",
		    hp->n_layer - f->pin, mib(f->attn / hp->n_layer), so.n_slots, mib(f->sbytes),
		    nf_model_embd_in_store(e->model) ? "" : "embeddings, ", nf_model_layer(e->model, 0)->fc1.data ? ", predictors" : "", pinned, mib(f->dense + f->pin_bytes),
		    mib(f->dense + f->attn));
		weights += f->pin_bytes;
	} else {
		weights += f->attn;
	}
	e->info.weights = weights;
	/* a store-backed model's own cache gets the FFN segments: one door,
	 * one I/O context, for every read of the store */
	struct nf_cache *mc = store == nf_model_store(e->model) ? nf_model_cache(e->model) : NULL;
	if (mc) {
		if ((rc = nf_cache_ffn_setup(mc, &co, d)) < 0)
			return nf_diag_prefix(d, rc, "%s", e->store_path);
		e->cache = mc;
		return 0;
	}
	if ((rc = nf_cache_open(store, &co, &e->cache, d)) < 0)
		return nf_diag_prefix(d, rc, "%s", e->store_path);
	e->own_cache = true;
	return 0;
}

/*
 * The context length: o->n_ctx, or the model's; with a budget and no
 * n_ctx, the largest power of two (at least NF_ENGINE_MIN_CTX, at most the
 * model's) whose KV cache and scratch take no more than an eighth of the
 * budget, so the rest goes to weights and the neuron cache.
 */
static uint32_t fit_ctx(const struct nf_engine *e, uint32_t n_ctx, uint64_t ctx_bytes)
{
	if (e->o.n_ctx || !e->o.budget || n_ctx <= NF_ENGINE_MIN_CTX || ctx_bytes <= e->o.budget / 8)
		return 0;
	uint32_t c = NF_ENGINE_MIN_CTX;
	/* KV bytes scale with n_ctx; scratch barely does */
	while (c * 2 < n_ctx && (double)ctx_bytes * (c * 2) / n_ctx <= (double)e->o.budget / 8)
		c *= 2;
	return c;
}

static int open_ctx(struct nf_engine *e, uint32_t n_ctx, struct nf_diag *d)
{
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = n_ctx;
	cp.n_batch = e->o.profile ? 1u : e->o.n_batch; /* --profile counts each token */
	cp.n_threads = e->o.n_threads;
	cp.kv_type = (enum nf_kv_type)e->o.kv_type;
	int rc = nf_ctx_open(e->model, &cp, &e->ctx, d);
	if (rc < 0)
		return nf_diag_prefix(d, rc, "%s", e->o.path);
	return 0;
}

/* The sparse engine (and the cache, for a streamed FFN) on the open context. */
static int open_ffn(struct nf_engine *e, struct nf_diag *d)
{
	const struct nf_engine_opts *o = &e->o;
	const struct nf_model_hparams *hp = nf_model_hparams(e->model);
	struct nf_sparse_params sp;
	nf_sparse_params_init(&sp);
	sp.mode = o->sparse_mode < 0 ? NF_SPARSE_AUTO : (enum nf_sparse_mode)o->sparse_mode;
	/* In memory, "dense" by default is the built-in FFN (the same sums);
	 * a mixture of experts runs its routed experts in the same modes as a
	 * dense FFN (predictor with per-expert predictors, else exact for
	 * ReLU/dReLU experts). */
	if (o->sparse_mode < 0) {
		const struct nf_layer_weights *L0 = nf_model_layer(e->model, 0);
		bool pred = L0->fc1.data;
		/* Q4_1/Q5_0/Q5_1 FFNs have no neuron form: the built-in FFN */
		bool legacy = nf_dtype_is_legacy(L0->up.dtype) || nf_dtype_is_legacy(L0->down.dtype) ||
			      (L0->gate.data && nf_dtype_is_legacy(L0->gate.dtype));
		if (!pred && (hp->act == NF_FFN_SILU || legacy))
			sp.mode = NF_SPARSE_OFF;
	}
	sp.threshold_set = o->threshold_set;
	sp.threshold = o->threshold;
	bool streamed = o->ffn_store || !nf_model_ffn_in_memory(e->model);
	e->info.streamed = streamed;
	sp.measure_recall = o->measure_recall && !streamed;
	uint64_t weights = nf_model_weight_bytes(e->model);
	int rc;
	if (streamed) {
		if (sp.mode == NF_SPARSE_OFF)
			sp.mode = NF_SPARSE_DENSE;
		struct nf_store *store = e->store ? e->store : nf_model_store(e->model);
		struct nf_cache_geom g;
		if ((rc = nf_cache_geometry_of(store, &g, d)) < 0)
			return rc;
		struct fit f;
		fit_plan(e, store, &g, &f);
		/* no n_ctx given: lower the context until the minimum fits */
		while (o->budget && f.need > o->budget && !o->n_ctx && nf_ctx_n_ctx(e->ctx) > NF_ENGINE_MIN_CTX) {
			uint32_t c = nf_ctx_n_ctx(e->ctx) / 2;
			nf_ctx_close(e->ctx);
			e->ctx = NULL;
			if ((rc = open_ctx(e, c < NF_ENGINE_MIN_CTX ? NF_ENGINE_MIN_CTX : c, d)) < 0)
				return rc;
			e->info.n_ctx_fitted = true;
			fit_plan(e, store, &g, &f);
		}
		if (o->budget && f.need > o->budget)
			return budget_error(e, &f, d);
		lend_kv(e, store, &f);
		e->info.stride = g.stride;
		e->info.attn_pinned_layers = f.pin;
		e->info.cold_min_slots = f.cold_slots;
		if (o->size_only) {
			struct nf_cache_opts co;
			cache_opts(e, &f, &co);
			e->info.streamed = true;
			e->info.attn_streamed = f.stream;
			e->info.arena = f.arena;
			e->info.weights = f.dense + (f.stream ? f.pin_bytes : f.attn);
			e->info.attn_buffers = f.stream ? f.sbytes : 0;
			e->info.reserved = nf_ctx_bytes(e->ctx) + f.engine + f.rec + f.meta;
			e->info.n_ctx = nf_ctx_n_ctx(e->ctx);
			e->info.qd = co.io.qd;
			e->info.read_gap = co.max_gap;
			if ((rc = nf_cache_split_for(store, &co, &e->info.hot_slots, &e->info.cold_slots)) < 0)
				return rc;
			/* the hot segment as a run starts: with the KV cache's loan */
			uint32_t lent = 0;
			nf_cache_lend_cost(store, f.lend, &lent);
			e->info.hot_slots += lent;
			e->info.arena += (uint64_t)lent * g.stride;
			e->info.kv_lent = f.lend;
			return 0;
		}
		if ((rc = open_cache(e, store, &f, d)) < 0)
			return rc;
		if (f.lend) {
			uint32_t n_ctx = nf_ctx_n_ctx(e->ctx);
			e->kv_covered = KV_STEP < n_ctx ? KV_STEP : n_ctx;
			e->info.kv_lent = f.lend;
			nf_ctx_set_kv_grow(e->ctx, kv_grow, e, e->kv_covered);
		}
		weights = e->info.weights;
		sp.cache = e->cache;
		struct nf_cache_layout cl;
		nf_cache_layout_get(e->cache, &cl);
		/* a profile's hot set is loaded already; else learn it online */
		sp.hot_after = cl.hot_from_profile ? 0 : 4;
		/* then follow the text (a calibration run only counts) */
		sp.replan_moves = o->profile ? 0 : o->replan_moves < 0 ? 1024u : (uint32_t)o->replan_moves;
		/* a calibration run counts only what the text asks for */
		sp.route_prefetch = o->profile ? 0 : o->route_prefetch;
		sp.gate_first = o->gate_first > 0;
		/* a calibration run records how the predictor's scores move together */
		sp.record_moments = o->profile;
		if (cl.profile_error)
			say(e, "warning: %s: the store's profile is not used (%s); the hot set is learned online",
			    e->store_path, nf_strerror(cl.profile_error));
	} else if (o->profile) {
		return nf_diag_fail(d, NF_EUSAGE,
				    "--profile counts the neurons read through a store's cache: give -m STORE (from "
				    "`nflash import`) or --ffn-store STORE");
	}
	if ((rc = nf_sparse_open(e->ctx, &sp, &e->sparse, d)) < 0)
		return nf_diag_prefix(d, rc, "%s", o->path);
	/* The matrices only dense products read go into the kernels' 8-row
	 * groups (same bits, faster; a no-op where the kernels have none): a
	 * GGUF held in memory into memory of the model's, its FFN's too when
	 * the built-in FFN runs it (the sparse FFN gathers plain rows); a
	 * store's pinned attention and output where they lie (streamed
	 * attention layers stay the store's plain rows). */
	bool from_store = nf_model_store(e->model) != NULL;
	if (!o->no_repack && (from_store || (!streamed && !o->io_mmap))) {
		unsigned what = NF_REPACK_ATTN | NF_REPACK_OUTPUT;
		if (!from_store && nf_sparse_mode_of(e->sparse) == NF_SPARSE_OFF)
			what |= NF_REPACK_FFN;
		if ((rc = nf_model_repack(e->model, what)) < 0)
			return nf_diag_fail(d, rc, "%s: repacking Q4_0/Q8_0 matrices: %s", o->path, nf_strerror(rc));
	}
	e->info.reserved = nf_ctx_bytes(e->ctx) + nf_sparse_bytes(e->sparse) + e->info.profile_rec;
	e->info.n_ctx = nf_ctx_n_ctx(e->ctx);
	char fitted[96] = "";
	if (e->info.n_ctx_fitted)
		snprintf(fitted, sizeof(fitted), ", fitted to the budget (the model's is %u; -c N sets it)",
			 hp->n_ctx_train);
	if (streamed) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(e->cache, &cl);
		e->info.arena = cl.arena;
		e->info.hot_slots = cl.hot_slots;
		e->info.cold_slots = cl.cold_slots;
		e->info.attn_buffers = nf_ctx_attn_stream_bytes(e->ctx);
		e->info.reserved += cl.meta;
		char abuf[64] = "";
		if (e->info.attn_streamed)
			snprintf(abuf, sizeof(abuf), " + attention buffers %.1f MiB (streamed)",
				 mib(e->info.attn_buffers));
		char lbuf[128] = "";
		if (e->info.kv_lent)
			snprintf(lbuf, sizeof(lbuf),
				 " of which %u slots on the KV cache's unwritten %.1f MiB, given back as the context "
				 "fills",
				 cl.hot_slots - cl.hot_floor, mib(e->info.kv_lent));
		char rbuf[96] = "";
		if (e->info.profile_rec)
			snprintf(rbuf, sizeof(rbuf), ", --profile's co-activation record %.1f MiB",
				 mib(e->info.profile_rec));
		say(e,
		    "memory: dense weights %.1f MiB (pinned)%s, neuron cache %.1f MiB (hot %.1f MiB / %u slots%s%s, "
		    "cold %.1f MiB / %u slots%s%s), reserved %.1f MiB (KV cache %.1f MiB %s for -c %u%s, scratch and "
		    "tables %.1f MiB%s); fixed overhead %.1f MiB",
		    mib(weights), abuf, mib(cl.arena), mib(cl.hot), cl.hot_slots,
		    cl.hot_from_profile ? " from the profile" : " learned online", lbuf, mib(cl.cold), cl.cold_slots,
		    cl.hugepages ? ", hugepages" : "", cl.numa ? ", NUMA-placed" : "", mib(e->info.reserved),
		    mib(nf_ctx_bytes_kv(e->ctx)), o->kv_type == NF_KV_F16 ? "f16" : "f32", e->info.n_ctx, fitted,
		    mib(e->info.reserved - e->info.profile_rec - nf_ctx_bytes_kv(e->ctx)), rbuf, mib(e->info.overhead));
		/* the loan is counted twice above: in the KV cache and the arena */
		uint64_t total = weights + cl.arena + e->info.attn_buffers + e->info.reserved + e->info.overhead -
				 e->info.kv_lent;
		if (o->budget && total > o->budget)
			return nf_diag_fail(d, NF_EBUDGET,
					    "--memory-budget %.1f MiB: the engine's tables came to %.1f MiB, more than "
					    "planned; at least %.1f MiB needed",
					    mib(o->budget), mib(e->info.reserved), mib(total));
	} else if (o->budget) {
		e->info.weights = weights;
		uint64_t need = weights + e->info.reserved + e->info.overhead;
		say(e,
		    "memory budget %.1f MiB: weights in memory %.1f MiB (pinned), reserved %.1f MiB (KV cache %.1f "
		    "MiB %s for -c %u%s, scratch and tables %.1f MiB); fixed overhead %.1f MiB",
		    mib(o->budget), mib(weights), mib(e->info.reserved), mib(nf_ctx_bytes_kv(e->ctx)),
		    o->kv_type == NF_KV_F16 ? "f16" : "f32", e->info.n_ctx, fitted,
		    mib(e->info.reserved - nf_ctx_bytes_kv(e->ctx)), mib(e->info.overhead));
		if (need > o->budget) {
			uint64_t ka = kernel_allowance(o->budget), min = stated_min(need - ka);
			return nf_diag_fail(d, NF_EBUDGET,
					    "--memory-budget %.1f MiB is too small for %s: at least %.1f MiB needed "
					    "(%.1f MiB of weights held in memory + %.1f MiB KV cache and scratch + "
					    "%.1f MiB fixed overhead; a smaller -c lowers the KV cache, a store from "
					    "`nflash import` streams the FFN)",
					    mib(o->budget), o->path, mib(min), mib(weights), mib(e->info.reserved),
					    mib(e->info.overhead - ka + kernel_allowance(min)));
		}
	} else {
		e->info.weights = weights;
	}
	return 0;
}

/*
 * The store's plan for this budget (nflash/plan.h): every setting the
 * caller left unset takes the plan's value. A damaged plan is never
 * followed: the engine decides at start as without one and says why.
 */
/*
 * Gate-first reads where no plan measured them: on for a dense ReLU/dReLU
 * FFN run in exact mode from a store that holds its gate rows (`nflash
 * import` writes them for such a model). Without them exact mode reads
 * every bundle of every layer a token: on the 7B shape at 2 GiB, 2.4 GB a
 * token at 0.43 tok/s against 0.54 GB at 0.85 tok/s with gate-first
 * (docs/PIPELINE.md). A mixture's exact experts keep whole bundles, which
 * its measurements favoured (a routed expert's misses coalesce).
 */
static int default_gate_first(const struct nf_engine *e)
{
	const struct nf_engine_opts *o = &e->o;
	struct nf_store *s = nf_engine_store(e);
	const struct nf_model_hparams *hp = nf_model_hparams(e->model);
	if (!s || o->profile || o->io_mmap || hp->n_expert || nf_model_layer(e->model, 0)->fc1.data ||
	    (hp->act != NF_FFN_RELU && hp->act != NF_FFN_DRELU) ||
	    (o->sparse_mode >= 0 && o->sparse_mode != NF_SPARSE_EXACT))
		return 0;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_store_object *f = nf_store_ffn_find(s, il, 0);
		if (!f || !nf_store_ffn_gate_rows(s, f))
			return 0;
	}
	return 1;
}

static void apply_plan(struct nf_engine *e)
{
	struct nf_engine_opts *o = &e->o;
	struct nf_store *s = nf_engine_store(e);
	if (!s || o->profile || o->io_mmap)
		return;
	if (!nf_store_has_plan(s)) {
		snprintf(e->info.plan_note, sizeof(e->info.plan_note),
			 "no plan in the store: settings chosen at start (run `nflash plan` for measured ones)");
		return;
	}
	struct nf_store_plan *p = NULL;
	struct nf_diag pd = { 0 };
	int rc = nf_store_plan_read(s, &p, &pd);
	if (rc < 0) {
		say(e, "warning: %s; the plan is not followed", nf_diag_msg(&pd, rc));
		snprintf(e->info.plan_note, sizeof(e->info.plan_note), "the store's plan is damaged: not followed");
		return;
	}
	uint64_t want = o->plan_for ? o->plan_for : o->budget;
	const struct nf_store_plan_entry *pe = nf_store_plan_pick(p, want);
	if (!pe) {
		snprintf(e->info.plan_note, sizeof(e->info.plan_note),
			 "the store's plans are for budgets above %.1f MiB: settings chosen at start", mib(want));
		nf_store_plan_free(p);
		return;
	}
	e->info.plan_budget = pe->budget;
	e->info.plan_tok_per_s = pe->tok_per_s;
	e->info.plan_overridden = (o->n_ctx && o->n_ctx != pe->n_ctx) ||
				  (o->kv_type >= 0 && o->kv_type != (int)pe->kv_type) ||
				  (o->n_batch && o->n_batch != pe->n_batch) || (o->qd && o->qd != pe->qd) ||
				  (o->read_gap >= 0 && o->read_gap != (int)pe->read_gap) ||
				  (o->cold_slots >= 0 && o->cold_slots != (int)pe->cold_slots) ||
				  (o->n_threads && pe->n_threads && o->n_threads != (int)pe->n_threads);
	if (!o->n_ctx)
		o->n_ctx = pe->n_ctx;
	if (o->kv_type < 0)
		o->kv_type = (int)pe->kv_type;
	if (!o->n_batch)
		o->n_batch = pe->n_batch;
	if (!o->n_threads && pe->n_threads)
		o->n_threads = (int)pe->n_threads;
	if (!o->qd)
		o->qd = pe->qd;
	if (o->read_gap < 0)
		o->read_gap = (int)pe->read_gap;
	if (o->cold_slots < 0)
		o->cold_slots = (int)pe->cold_slots;
	if (pe->flags & NF_STORE_PLAN_F_STREAM_ATTN) {
		o->stream_attn = true;
		if (!o->attn_pin)
			o->attn_pin = pe->attn_pin;
	}
	if (o->gate_first < 0)
		o->gate_first = (pe->flags & NF_STORE_PLAN_F_GATE_FIRST) != 0;
	if (o->route_prefetch < 0 && (pe->flags & NF_STORE_PLAN_F_ROUTE_SET))
		o->route_prefetch = (pe->flags & NF_STORE_PLAN_F_ROUTE_ON) != 0;
	snprintf(e->info.plan_note, sizeof(e->info.plan_note),
		 "plan for %.1f MiB: predicted %.2f tok/s, I/O wait %.2f, %.1f MiB read per token", mib(pe->budget),
		 pe->tok_per_s, pe->io_wait_share, pe->bytes_per_token / 1048576.0);
	nf_store_plan_free(p);
}

/* --io mmap runs a GGUF from its mapping: no store, no budget (the page
 * cache, under whatever limit the caller sets, e.g. a cgroup, decides). */
static int mmap_check(const struct nf_engine_opts *o, struct nf_diag *d)
{
	if (o->ffn_store)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--io mmap: cannot be combined with --ffn-store (mmap mode maps the GGUF's own "
				    "weights; drop --io mmap to stream from the store)");
	if (o->budget)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--io mmap: cannot be combined with --memory-budget (the page cache holds the "
				    "weights; limit memory with a cgroup instead)");
	unsigned char magic[4] = { 0 };
	FILE *f = fopen(o->path, "rb");
	if (!f)
		return 0; /* the load names the error */
	size_t n = fread(magic, 1, sizeof(magic), f);
	fclose(f);
	if (n == sizeof(magic) && memcmp(magic, "GGUF", 4) && memcmp(magic, "PWRI", 4))
		return nf_diag_fail(d, NF_EUSAGE,
				    "--io mmap: %s is not a GGUF file (a store from `nflash import` is read with "
				    "O_DIRECT through the neuron cache; mmap mode needs the GGUF)",
				    o->path);
	return 0;
}

int nf_engine_open(const struct nf_engine_opts *opts, struct nf_engine **out, struct nf_diag *d)
{
	double t0 = now_s();
	int rc;
	*out = NULL;
	if (!opts->path)
		return nf_diag_fail(d, NF_EUSAGE, "-m MODEL is required");
	struct nf_engine *e = calloc(1, sizeof(*e));
	if (!e)
		return nf_diag_fail(d, -ENOMEM, "engine: out of memory");
	e->o = *opts;
	struct nf_engine_opts *o = &e->o;
	e->info.budget = o->budget;
	/* what the process holds before the engine allocates (program,
	 * libraries, the caller's own memory), measured, and slack for thread
	 * stacks, I/O rings and allocator headers */
	e->info.overhead = o->overhead ? o->overhead : nf_engine_overhead_now();
	e->store_path = o->ffn_store ? o->ffn_store : o->path;
	if (o->io_mmap && (rc = mmap_check(o, d)) < 0)
		goto fail;
	/* Streamed FFNs (--ffn-store, or a store-backed model's own) are never
	 * brought into memory: a GGUF's FFN pages are not prefaulted, a store's
	 * FFN stays in the store. The built-in FFN (--sparse-mode off, MoE)
	 * needs a store's FFN unpacked (store_unpack_ffn). */
	if (o->io_mmap && o->sparse_mode < 0)
		o->sparse_mode = NF_SPARSE_OFF;
	bool off = o->sparse_mode == NF_SPARSE_OFF;
	if (o->stream_attn && (off || o->ffn_store || o->io_mmap)) {
		rc = nf_diag_fail(d, NF_EUSAGE,
				  "--stream-attn: needs a store (-m OUT.nfl from nflash import) whose FFN is streamed "
				  "(not --sparse-mode off, --ffn-store or --io mmap)");
		goto fail;
	}
	/* A store's attention stays in the store until the budget is sized
	 * (open_cache pins or streams it). */
	struct nf_model_opts mo = { .prefault = !o->ffn_store && !o->io_mmap, .store_unpack_ffn = off,
				    .store_defer_attn = !off };
	if ((rc = nf_model_load(o->path, &mo, &e->model, d)) < 0)
		goto fail;
	/* what a store-backed model holds beside its weights (the store's
	 * object table, permutations and bundle checksums: 30 MiB on the 47B
	 * Mixtral shape) is overhead too; counted, not measured, so that two
	 * opens in one process state the same minimum */
	if (nf_model_store(e->model))
		e->info.overhead += (nf_store_mem_bytes(nf_model_store(e->model)) + (1u << 20) - 1) &
				    ~(uint64_t)((1u << 20) - 1);
	if (o->budget)
		e->info.overhead += kernel_allowance(o->budget);
	if (o->stream_attn && !nf_model_store(e->model)) {
		rc = nf_diag_fail(d, NF_EUSAGE,
				  "--stream-attn: %s is a GGUF; attention is streamed from a store (nflash import)",
				  o->path);
		goto fail;
	}
	if (o->ffn_store && nf_model_store(e->model)) {
		rc = nf_diag_fail(d, NF_EUSAGE, "--ffn-store: %s is a store already; its own bundles are used",
				  o->path);
		goto fail;
	}
	if (o->ffn_store && (rc = nf_store_open(o->ffn_store, NULL, &e->store, d)) < 0) {
		rc = nf_diag_prefix(d, rc, "--ffn-store");
		goto fail;
	}
	if (o->use_plan)
		apply_plan(e);
	if (o->gate_first < 0)
		o->gate_first = default_gate_first(e);
	if (!o->n_batch)
		o->n_batch = 512;
	if (o->kv_type < 0)
		o->kv_type = NF_KV_F16;
	const struct nf_model_hparams *hp = nf_model_hparams(e->model);
	if (o->n_ctx > hp->n_ctx_train)
		say(e, "warning: -c %u exceeds the model's training context %u", o->n_ctx, hp->n_ctx_train);
	if ((rc = open_ctx(e, o->n_ctx, d)) < 0)
		goto fail;
	/* with a budget and no -c, start from a context whose KV cache takes
	 * at most an eighth of the budget */
	uint32_t c = fit_ctx(e, nf_ctx_n_ctx(e->ctx), nf_ctx_bytes(e->ctx));
	if (c) {
		nf_ctx_close(e->ctx);
		e->ctx = NULL;
		if ((rc = open_ctx(e, c, d)) < 0)
			goto fail;
		e->info.n_ctx_fitted = true;
	}
	if ((rc = open_ffn(e, d)) < 0)
		goto fail;
	if (e->info.plan_note[0] && e->info.streamed && !o->size_only)
		say(e, "%s", e->info.plan_note);
	e->info.load_s = now_s() - t0;
	*out = e;
	return 0;
fail:
	nf_engine_close(e);
	return rc;
}

void nf_engine_close(struct nf_engine *e)
{
	if (!e)
		return;
	nf_sparse_close(e->sparse);
	if (e->own_cache)
		nf_cache_close(e->cache);
	nf_store_close(e->store);
	nf_ctx_close(e->ctx);
	nf_model_free(e->model);
	free(e);
}

struct nf_model *nf_engine_model(const struct nf_engine *e) { return e->model; }
struct nf_ctx *nf_engine_ctx(const struct nf_engine *e) { return e->ctx; }
struct nf_sparse *nf_engine_sparse(const struct nf_engine *e) { return e->sparse; }
struct nf_cache *nf_engine_cache(const struct nf_engine *e) { return e->cache; }
struct nf_store *nf_engine_store(const struct nf_engine *e)
{
	return e->store ? e->store : e->model ? nf_model_store(e->model) : NULL;
}
const char *nf_engine_store_path(const struct nf_engine *e) { return e->store_path; }
const struct nf_engine_opts *nf_engine_opts(const struct nf_engine *e) { return &e->o; }
void nf_engine_info(const struct nf_engine *e, struct nf_engine_info *out) { *out = e->info; }
