/*
 * plan.c - the offline planner (nflash/plan.h, docs/PLAN.md): measure the
 * device and the model, lay the store out, choose the settings for each
 * memory budget by minimising the predicted token time, store the plans.
 *
 * Invariants:
 *  1. The settings a plan records are those the engine decides itself for
 *     that budget (its dry run, nf_engine_opts.size_only) plus what the
 *     cost model chose (queue depth, read gap): a planned run computes
 *     exactly what an unplanned run with the same flags computes.
 *  2. The model's figures come from the calibration run on this store:
 *     per FFN, which neurons fired for each calibration token, evaluated
 *     under the layout the store will have and each budget's hot set.
 *  3. The store is always valid: the profile is written as a new
 *     generation, the relayout is a complete, verified copy renamed over
 *     the store, the plan a new generation (each crash-safe).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <libgen.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nflash/cache.h"
#include "nflash/coact.h"
#include "nflash/engine.h"
#include "nflash/plan.h"
#include "nflash/sampler.h"
#include "nflash/sparse.h"
#include "nflash/store.h"
#include "nflash/stream.h"
#include "nflash/tokenizer.h"

/* Read gaps and queue depths the planner chooses from. */
static const uint32_t k_gaps[] = { 0, 1, 2, 4, 8, 16 };
/* deepest first: a shallower queue must predict 20% faster to be taken
 * (choose; measured on the 7B at 2 GiB, EPYC: qd 256 decoded 2.07-2.26
 * tok/s, qd 32 1.76-1.77, where the device curve alone saw no difference) */
static const uint32_t k_qds[] = { 256, 128, 64, 32 };
#define N_GAPS (sizeof(k_gaps) / sizeof(k_gaps[0]))
#define N_QDS (sizeof(k_qds) / sizeof(k_qds[0]))

/* Calibration text when none is given: plain prose of the kind a chat or
 * story model reads. */
static const char k_calibration[] =
	"The harbour was quiet in the early morning, and the fishing boats rocked gently against the pier. "
	"An old man sat on a wooden crate, mending a net with slow, patient hands. Children ran along the "
	"sea wall, shouting to each other about the ships they could see far out on the water. In the town "
	"above, the baker opened his shutters and the smell of fresh bread drifted down the narrow streets.\n"
	"Scientists measure the speed of a chemical reaction by watching how quickly the reactants disappear. "
	"Temperature, pressure and the presence of a catalyst all change the rate, and a careful experiment "
	"controls each of them in turn. The results are written in a notebook, plotted on a graph, and compared "
	"with the predictions of a simple model.\n"
	"To install the program, download the archive, unpack it into a folder of your choice, and run the "
	"setup script. If the script reports a missing library, install it with your package manager and try "
	"again. Questions can be sent to the mailing list, where volunteers answer most of them within a day.\n"
	"Once upon a time there was a little fox who lived at the edge of a great forest. Every evening she "
	"climbed the hill behind her den to watch the sun go down, and every evening she wondered what lay on "
	"the other side of the mountains. One spring morning she decided to find out.\n"
	"The committee met on Tuesday to discuss the budget for the coming year. After a long debate, the "
	"members agreed to spend more on the library and the public gardens, and less on new office furniture. "
	"The decision will be reviewed in the autumn, when the first figures are available.\n";

void nf_plan_opts_default(struct nf_plan_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->calib_tokens = 512;
	o->calib_generate = -1;
	o->relayout = true;
	nf_plan_device_opts_default(&o->device);
}

static void logf_(const struct nf_plan_opts *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(const struct nf_plan_opts *o, const char *fmt, ...)
{
	if (!o->log)
		return;
	va_list ap;
	va_start(ap, fmt);
	fputs("nflash: plan: ", o->log);
	vfprintf(o->log, fmt, ap);
	fputc('\n', o->log);
	va_end(ap);
}

/* NFLASH_PLAN_RECUT=off: keep the layout cut at unplanned runs' hot sets
 * (A/B runs) */
static bool recut_on(void)
{
	const char *v = getenv("NFLASH_PLAN_RECUT");
	return !v || strcmp(v, "off") != 0;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- the cost model --------------------------------------------------------------------- */

void nf_plan_predict(const struct nf_store_plan *dev, const struct nf_plan_model *m, uint32_t qd,
		     struct nf_store_plan_entry *e)
{
	uint32_t th = m->threads ? m->threads : 1;
	double gbs_dense = nf_plan_kernel_gb_s(dev, m->dense_dtype, th) * 1e9;
	double gbs_ffn = nf_plan_kernel_gb_s(dev, m->ffn_dtype, th) * 1e9;
	/* the weights a token touches stream from memory: no kernel runs them
	 * faster than the memory read (plans made before session 12 probed
	 * the kernels over a 64 MB set, which can sit in a large L3: 55 GB/s
	 * for Q4_0 on 2 threads of the AVX-512 EPYC, whose memory reads 24-32
	 * GB/s) */
	double mem = dev->mem_read_gb_s * 1e9;
	if (mem > 0 && gbs_dense > mem)
		gbs_dense = mem;
	if (mem > 0 && gbs_ffn > mem)
		gbs_ffn = mem;
	double t_dense = gbs_dense > 0 ? m->dense_bytes / gbs_dense : 0;
	double t_ffn = 0, t_io = 0, t_layers = 0, bytes = 0, reads = 0;
	for (uint32_t l = 0; l < m->n_layer; l++) {
		double R = m->runs[l], N = m->bundles[l];
		double b = N * m->stride;
		double comp = gbs_ffn > 0 ? m->active[l] * m->compute_bytes_per_neuron / gbs_ffn : 0;
		double io = 0, lat = 0, cpu = 0;
		if (R > 0) {
			double req = b / R;
			uint32_t depth = R < qd ? (uint32_t)ceil(R) : qd;
			double mbs = nf_plan_device_mb_s(dev, req, depth);
			io = mbs > 0 ? b / (mbs * 1e6) : 0;
			/* the engine cannot issue and take back reads faster
			 * than its measured ceiling, whatever the device could */
			if (m->engine_iops > 0 && R / m->engine_iops > io)
				io = R / m->engine_iops;
			/* a layer's queue starts empty: its first read waits
			 * the latency of an idle device, not the curve's mean
			 * under a full queue (which at depth 256 is Little's
			 * law's 5 ms, and made every deep queue look slow) */
			lat = nf_plan_device_lat_us(dev, req, 1) * 1e-6;
			/* submitting and reaping take the compute threads'
			 * CPUs; the crc32c of every byte read runs where the
			 * reads complete, one thread at a time (9 GB/s on the
			 * AVX-512 EPYC: 15% of a mixture's decode at 512 MiB,
			 * where reads bridge wide gaps), as the engine probe
			 * took it off its FFN time */
			cpu = R * nf_plan_device_cpu_us(dev, req, depth) * 1e-6 / th + b * m->verify_s_per_byte;
		}
		/* within a layer, clusters compute as their reads land: the
		 * layer takes the longer of its compute and its reads (plus the
		 * first read's latency) */
		double c = comp + cpu, r = R > 0 ? io + lat : 0;
		t_layers += (c > r ? c : r) + m->layer_overhead_s;
		t_ffn += c + m->layer_overhead_s; /* as the engine counts compute: all but the I/O wait */
		t_io += r;
		bytes += b;
		reads += R;
	}
	double t_attn_io = 0;
	if (m->attn_stream_bytes > 0) {
		/* a layer's attention goes out as 1 MiB reads, a group of
		 * them at once (docs/PIPELINE.md "Streamed attention") */
		double mbs = m->attn_mb_s > 0 ? m->attn_mb_s : nf_plan_device_mb_s(dev, 1 << 20, 8);
		t_attn_io = mbs > 0 ? m->attn_stream_bytes / (mbs * 1e6) : 0;
		bytes += m->attn_stream_bytes;
	}
	/* The compute path: dense work, then each layer's FFN as its reads
	 * land. Streamed attention reads layer L + 1 through all of layer
	 * L's work, attention and FFN alike, on the device that serves the
	 * FFN's reads too: the token takes at least the device's time for
	 * both (on the 7B at 1 GiB, 1.2 GB of attention a token, the FFN's
	 * 6800 small reads waited behind it, and the old sum of dense time
	 * or stream time, whichever longer, and the FFN's, was 1.4x the runs) */
	double t_cpu = t_dense + t_layers, t_dev = t_attn_io + t_io;
	double t = t_cpu > t_dev ? t_cpu : t_dev;
	e->t_dense_s = t_dense;
	e->t_ffn_s = t_ffn;
	e->t_io_s = t_io + t_attn_io;
	e->t_token_s = t;
	e->tok_per_s = t > 0 ? 1.0 / t : 0;
	double wait = t - (t_dense + t_ffn);
	e->io_wait_share = t > 0 ? (wait < 0 ? 0 : wait / t > 1 ? 1 : wait / t) : 0;
	e->bytes_per_token = bytes;
	e->reads_per_token = reads;
}

/* ---- calibration -------------------------------------------------------------------------- */

/* The calibration's first want tokens: the text through the model's
 * tokenizer, else (no vocabulary) a deterministic sequence of ids; room
 * for o->calib_tokens in *out. */
static int calib_ids(const struct nf_plan_opts *o, struct nf_engine *e, size_t want, int32_t **out, size_t *n,
		     struct nf_diag *d)
{
	char *text = NULL;
	size_t len = 0;
	if (o->calibration) {
		FILE *f = fopen(o->calibration, "rb");
		if (!f)
			return nf_diag_fail(d, -errno, "--calibration %s: %s", o->calibration, nf_strerror(-errno));
		fseek(f, 0, SEEK_END);
		long sz = ftell(f);
		fseek(f, 0, SEEK_SET);
		text = malloc(sz > 0 ? (size_t)sz + 1 : 1);
		len = text ? fread(text, 1, sz > 0 ? (size_t)sz : 0, f) : 0;
		fclose(f);
		if (!text)
			return -ENOMEM;
		if (!len) {
			free(text);
			return nf_diag_fail(d, NF_EUSAGE, "--calibration %s: the file is empty", o->calibration);
		}
	}
	const char *src = text ? text : k_calibration;
	size_t slen = text ? len : sizeof(k_calibration) - 1;
	int32_t *ids = malloc((o->calib_tokens > want ? o->calib_tokens : want) * sizeof(int32_t));
	if (!ids) {
		free(text);
		return -ENOMEM;
	}
	size_t got = 0;
	struct nf_tok *tok = NULL;
	struct nf_diag td = { 0 };
	const struct nf_model_hparams *hp = nf_model_hparams(nf_engine_model(e));
	if (nf_tok_open(nf_model_gguf(nf_engine_model(e)), &tok, &td) == 0) {
		/* repeat the text until there are enough tokens */
		size_t cap = slen + 16, n_text = 0;
		int32_t *tmp = malloc(cap * sizeof(int32_t));
		if (tmp && nf_tok_encode(tok, src, slen, 0, tmp, cap, &n_text) == 0 && n_text)
			for (size_t i = 0; got < want; i++)
				ids[got++] = tmp[i % n_text] < (int32_t)hp->n_vocab ? tmp[i % n_text] : 1;
		free(tmp);
		nf_tok_close(tok);
	}
	if (!got) {
		uint64_t x = 0x2545f4914f6cdd1dull;
		for (; got < want; got++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			ids[got] = (int32_t)(3 + x % (hp->n_vocab > 3 ? hp->n_vocab - 3 : 1));
		}
	}
	free(text);
	*out = ids;
	*n = got;
	return 0;
}

/* ---- what each budget costs ------------------------------------------------------------- */

struct budget_plan {
	uint64_t budget;
	struct nf_store_plan_entry chosen; /* the best plan found for it */
	/* when chosen streams attention: the best with attention pinned in a
	 * shorter context (SHORT_CTX tokens), which a decode probe weighs
	 * against it (measure_context) */
	struct nf_store_plan_entry alt;
	bool has_alt;
	struct nf_engine_info info;   /* the engine's dry run at this budget */
	uint64_t dense_bytes, attn_stream_bytes;
	double *active;               /* [n_layer] */
	double *runs, *bundles;       /* [N_GAPS][n_layer] */
};

static void budget_free(struct budget_plan *b)
{
	free(b->active);
	free(b->runs);
	free(b->bundles);
	b->active = b->runs = b->bundles = NULL;
}

/* The engine's own decisions at budget b (nothing opened but the model and
 * context). */
/* One way to spend a budget: the prompt batch, attention streamed or left
 * to the engine, and the smallest cold segment (-1: the engine's rule). */
struct variant {
	uint32_t n_batch;
	bool stream_attn;
	int cold_slots;
	uint32_t n_ctx; /* 0: the engine's fit */
};

static int dry_run(const struct nf_plan_opts *o, uint64_t overhead, const struct variant *v, struct budget_plan *b,
		   struct nf_diag *d)
{
	struct nf_engine_opts eo;
	nf_engine_opts_default(&eo);
	eo.path = o->store;
	eo.budget = b->budget;
	eo.n_batch = v->n_batch;
	eo.stream_attn = v->stream_attn;
	eo.cold_slots = v->cold_slots;
	eo.n_ctx = v->n_ctx;
	eo.n_threads = o->n_threads;
	eo.use_plan = false;
	eo.size_only = true;
	eo.overhead = overhead;
	struct nf_engine *e = NULL;
	int rc = nf_engine_open(&eo, &e, d);
	if (rc < 0)
		return rc;
	nf_engine_info(e, &b->info);
	const struct nf_model *m = nf_engine_model(e);
	b->dense_bytes = nf_model_step_dense_bytes(m);
	if (b->info.attn_streamed) {
		uint32_t L = nf_model_hparams(m)->n_layer;
		uint64_t attn = nf_model_attn_bytes(m);
		b->attn_stream_bytes = attn / L * (L - b->info.attn_pinned_layers);
	}
	nf_engine_close(e);
	return 0;
}

/*
 * The calibration record as the cache will meet it: per FFN (in layer
 * order) and calibration token, the store slots of the neurons that fired,
 * ascending, under the layout the store will have.
 */
struct replay {
	/* tokens: the longest FFN record (the replay's loop); calib: the
	 * calibration tokens, what per-token figures divide by (an expert of
	 * a mixture is requested only by the tokens routed to it: its record
	 * is shorter, and it costs in proportion) */
	uint32_t n_ffn, tokens, calib;
	uint32_t *nt;        /* [n_ffn]: requests recorded (tokens of this FFN) */
	uint32_t *layer;     /* [n_ffn] */
	uint32_t *expert;    /* [n_ffn] */
	uint32_t *n;         /* [n_ffn]: its neurons */
	uint32_t **off;      /* [n_ffn][tokens + 1]: into slots[f] */
	uint32_t **slots;    /* [n_ffn]: fired slots, token after token */
	uint32_t **cnt;      /* [n_ffn][n]: tokens of the record each slot fired in */
	uint32_t *obj;       /* [n_ffn]: the store object */
	/* the layout's holdout per gap (layout_holdout): a new token's runs
	 * and bundles per miss over the calibration's own (factors, at least
	 * 1), and a new token's runs and bundles per miss (rates, 0: none) */
	double hold_runs[N_GAPS], hold_bundles[N_GAPS];
	double rate_runs[N_GAPS], rate_bundles[N_GAPS];
};

static void replay_free(struct replay *r)
{
	for (uint32_t f = 0; f < r->n_ffn; f++) {
		free(r->off ? r->off[f] : NULL);
		free(r->slots ? r->slots[f] : NULL);
		free(r->cnt ? r->cnt[f] : NULL);
	}
	free(r->cnt);
	free(r->obj);
	free(r->layer);
	free(r->expert);
	free(r->nt);
	free(r->n);
	free(r->off);
	free(r->slots);
	memset(r, 0, sizeof(*r));
}

static int replay_build(struct nf_engine *cal, uint32_t *const *order, uint32_t n_calib, struct replay *r)
{
	struct nf_cache *c = nf_engine_cache(cal);
	struct nf_store *s = nf_engine_store(cal);
	struct nf_cache_geom g;
	nf_cache_geometry(c, &g);
	uint32_t n_obj = nf_store_object_count(s);
	memset(r, 0, sizeof(*r));
	r->layer = calloc(n_obj, sizeof(uint32_t));
	r->expert = calloc(n_obj, sizeof(uint32_t));
	r->n = calloc(n_obj, sizeof(uint32_t));
	r->nt = calloc(n_obj, sizeof(uint32_t));
	r->obj = calloc(n_obj, sizeof(uint32_t));
	r->calib = n_calib;
	for (size_t k = 0; k < N_GAPS; k++)
		r->hold_runs[k] = r->hold_bundles[k] = 1.0, r->rate_runs[k] = r->rate_bundles[k] = 0;
	r->off = calloc(n_obj, sizeof(uint32_t *));
	r->slots = calloc(n_obj, sizeof(uint32_t *));
	r->cnt = calloc(n_obj, sizeof(uint32_t *));
	if (!r->layer || !r->expert || !r->n || !r->nt || !r->obj || !r->off || !r->slots || !r->cnt)
		return -ENOMEM;
	/* FFNs in layer order, as a token meets them */
	for (uint32_t l = 0; l < g.n_layer; l++)
		for (uint32_t i = 0; i < n_obj; i++) {
			const struct nf_store_object *ob = nf_store_object_get(s, i);
			if (ob->kind != NF_STORE_KIND_FFN || ob->layer != l || !order[i])
				continue;
			uint32_t tokens, words;
			const uint64_t *sig = nf_cache_signatures(c, ob->layer, ob->expert, &tokens, &words);
			if (!sig || !tokens)
				continue;
			tokens = tokens < words * 64u ? tokens : words * 64u;
			if (tokens > r->tokens)
				r->tokens = tokens;
			uint32_t f = r->n_ffn++, n = ob->n_bundles;
			r->nt[f] = tokens;
			r->obj[f] = i;
			r->layer[f] = l;
			r->expert[f] = ob->expert;
			r->n[f] = n;
			uint64_t total = 0;
			for (uint64_t k = 0; k < (uint64_t)n * words; k++)
				total += (uint64_t)__builtin_popcountll(sig[k]);
			r->off[f] = calloc((size_t)tokens + 1, sizeof(uint32_t));
			r->slots[f] = malloc((total ? total : 1) * sizeof(uint32_t));
			r->cnt[f] = calloc(n ? n : 1, sizeof(uint32_t));
			if (!r->off[f] || !r->slots[f] || !r->cnt[f])
				return -ENOMEM;
			uint32_t at = 0;
			for (uint32_t t = 0; t < tokens; t++) {
				r->off[f][t] = at;
				for (uint32_t slot = 0; slot < n; slot++) {
					uint32_t j = order[i][slot];
					if (sig[(size_t)j * words + t / 64] >> (t % 64) & 1) {
						r->slots[f][at++] = slot;
						r->cnt[f][slot]++;
					}
				}
			}
			r->off[f][tokens] = at;

		}
	return 0;
}

/*
 * The layout's holdout. The co-activation layout is planned from the
 * calibration tokens, so replaying those same tokens finds each token's
 * rare neurons side by side, in runs that a new token's misses do not form:
 * on a 4-layer store of the Mixtral shape the replay put a token's misses
 * in 424 runs where the engine made 1657 requests for as many misses
 * (docs/PLAN.md, "Why a mixture's reads are under-predicted"). So up to
 * HOLD_FFNS FFNs, spread over the layers, are laid out again from their
 * even calibration tokens alone and costed on their odd tokens against
 * both layouts (nf_coact_holdout). Per gap, the held-out layout's runs and
 * bundles per miss over the in-sample layout's are the factors that
 * layer_costs scales its replay by. They are never below 1: a layout does
 * not serve new tokens better than the tokens it was planned from.
 */
#define HOLD_FFNS 8

static int layout_holdout(const struct nf_plan_opts *o, struct nf_engine *cal, uint32_t *const *order,
			  struct replay *r)
{
	struct nf_cache *c = nf_engine_cache(cal);
	struct nf_cache_geom g;
	struct nf_cache_layout cl;
	struct nf_engine_info info;
	nf_cache_geometry(c, &g);
	nf_cache_layout_get(c, &cl);
	nf_engine_info(cal, &info);
	/* the head each layout was planned with (nf_coact_profile_save) */
	uint32_t *quota = calloc((size_t)g.n_layer * g.n_expert, sizeof(uint32_t));
	if (!quota)
		return -ENOMEM;
	nf_cache_hot_quota(c, cl.hot_slots + info.profile_extra / g.stride, quota);
	double in_r[N_GAPS] = { 0 }, in_b[N_GAPS] = { 0 }, out_r[N_GAPS] = { 0 }, out_b[N_GAPS] = { 0 };
	double t0 = now_s();
	uint32_t step = r->n_ffn > HOLD_FFNS ? r->n_ffn / HOLD_FFNS : 1, used = 0;
	int rc = 0;
	for (uint32_t f = step / 2; f < r->n_ffn && rc == 0; f += step) {
		uint32_t tokens, words;
		const uint64_t *sig = nf_cache_signatures(c, r->layer[f], r->expert[f], &tokens, &words);
		double ir[N_GAPS], ib[N_GAPS], or_[N_GAPS], ob[N_GAPS];
		if (!sig || r->nt[f] < 4 || !r->n[f])
			continue;
		/* held out as nf_coact_profile_save chose: by firing record or
		 * by the predictor's scores, whichever served the odd tokens */
		uint32_t dim = 0;
		float *vec = nf_coact_ffn_vec(cal, r->layer[f], r->expert[f], &dim);
		rc = nf_coact_holdout(sig, words, r->nt[f], r->n[f], order[r->obj[f]],
				      quota[r->layer[f] * g.n_expert + r->expert[f]], vec, dim, nf_coact_gap(cal), k_gaps,
				      N_GAPS, ir, ib, or_, ob, NULL, NULL);
		free(vec);
		for (size_t k = 0; rc == 0 && k < N_GAPS; k++) {
			in_r[k] += ir[k];
			in_b[k] += ib[k];
			out_r[k] += or_[k];
			out_b[k] += ob[k];
		}
		used += rc == 0;
	}
	free(quota);
	if (rc < 0)
		return rc;
	if (in_b[0] <= 0 || out_b[0] <= 0)
		return 0;
	for (size_t k = 0; k < N_GAPS; k++) {
		double fr = in_r[k] > 0 ? (out_r[k] / out_b[0]) / (in_r[k] / in_b[0]) : 1;
		double fb = in_b[k] > 0 ? (out_b[k] / out_b[0]) / (in_b[k] / in_b[0]) : 1;
		r->hold_runs[k] = fr > 1 ? fr : 1;
		r->hold_bundles[k] = fb > 1 ? fb : 1;
		r->rate_runs[k] = out_r[k] / out_b[0];
		r->rate_bundles[k] = out_b[k] / out_b[0];
	}
	logf_(o,
	      "layout holdout (%u FFNs, %.1f s): a new token's misses take %.2f reads each at gap 0 (the "
	      "calibration's own %.2f), %.2f at gap %u (%.2f)",
	      used, now_s() - t0, out_r[0] / out_b[0], in_r[0] / in_b[0], out_r[N_GAPS - 1] / out_b[0],
	      k_gaps[N_GAPS - 1], in_r[N_GAPS - 1] / in_b[0]);
	return 0;
}

/*
 * Per layer: neurons computed, and the reads and bundles a token's misses
 * cost under each gap, replaying the calibration tokens through a model of
 * the cache budget b keeps: the hot set (each FFN's quota, the first slots
 * of its layout) and a cold segment of b's cold slots shared by every FFN,
 * least recently used out first (the cache's CLOCK approximated). A miss
 * is read with the bundles a gap bridges, and all of them enter the cold
 * segment, as in the cache.
 *
 * Each token is replayed against the hot set the calibration would have
 * chosen without it (leave one out): the hot set is the run's hottest
 * neurons, so replaying a token that helped choose them counts its rare
 * neurons as hot and predicts too few reads. A hot neuron that fired in
 * token t stays hot without t when its count less one still beats the
 * quota's threshold count theta (the least count the hot set holds); at
 * theta it is one of the tie group, of which a share q_frac fits, and a
 * hash of (FFN, slot) decides. Measured on the 47B Mixtral shape under
 * 12 GiB, where the quota holds every neuron that ever fired: the replay
 * without it predicted 630 reads a token, the runs made 7-10K (hit rate
 * 0.75, not 1): the neurons that fire once in the calibration are the
 * share of a new token's neurons no hot set has. Figures are per calibration token: an FFN
 * requested by fewer tokens (a mixture's expert, routed to some) adds its
 * requests' costs divided by all the tokens, so a layer's figure is the
 * sum over its routed experts.
 */
/* Leave one out: is a hot neuron whose count without this token is c
 * still hot (above), see layer_costs. */
static bool loo_hot(uint32_t c, uint32_t theta, double qfrac, uint32_t f, uint32_t slot)
{
	if (c != theta)
		return c > theta;
	uint32_t h = (f + 1) * 0x9e3779b1u ^ (slot + 1) * 0x85ebca77u;
	h ^= h >> 15;
	h *= 0x2c1b3c6du;
	h ^= h >> 12;
	return (double)h / 4294967296.0 < qfrac;
}

static int layer_costs(struct nf_engine *cal, const struct replay *r, struct budget_plan *b)
{
	struct nf_cache *c = nf_engine_cache(cal);
	struct nf_cache_geom g;
	nf_cache_geometry(c, &g);
	uint32_t L = g.n_layer, T = r->tokens;
	double per = r->calib > T ? (double)r->calib : (double)T;   /* the divisor of per-token figures */
	uint32_t *quota = calloc((size_t)g.n_layer * g.n_expert, sizeof(uint32_t));
	uint64_t *base = calloc((size_t)r->n_ffn + 1, sizeof(uint64_t));
	b->active = calloc(L, sizeof(double));
	b->runs = calloc(N_GAPS * (size_t)L, sizeof(double));
	b->bundles = calloc(N_GAPS * (size_t)L, sizeof(double));
	uint32_t *prev = NULL, *next = NULL, *theta = NULL;
	double *qfrac = NULL;
	int rc = -ENOMEM;
	if (!quota || !base || !b->active || !b->runs || !b->bundles || !T)
		goto out;
	for (uint32_t f = 0; f < r->n_ffn; f++)
		base[f + 1] = base[f] + r->n[f];
	/* the cold segment: an LRU list over every bundle of every FFN; node
	 * NIL is the list head, prev == NONE means not cached */
	uint64_t N = base[r->n_ffn], NIL = N;
	const uint32_t NONE = UINT32_MAX;
	if (N >= UINT32_MAX || !(prev = malloc((N + 1) * sizeof(uint32_t))) || !(next = malloc((N + 1) * sizeof(uint32_t))))
		goto out;
	nf_cache_hot_quota(c, b->info.hot_slots, quota);
	for (uint32_t f = 0; f < r->n_ffn; f++)
		b->active[r->layer[f]] += (double)(r->off[f][r->nt[f]] - r->off[f][0]) / per;
	/* leave one out: each FFN's threshold count and the share of its tie
	 * group that the quota holds */
	theta = calloc(r->n_ffn ? r->n_ffn : 1, sizeof(uint32_t));
	qfrac = calloc(r->n_ffn ? r->n_ffn : 1, sizeof(double));
	if (!theta || !qfrac)
		goto out;
	for (uint32_t f = 0; f < r->n_ffn; f++) {
		uint32_t hot = quota[r->layer[f] * g.n_expert + r->expert[f]], th = UINT32_MAX;
		hot = hot < r->n[f] ? hot : r->n[f];
		for (uint32_t s0 = 0; s0 < hot; s0++)
			th = r->cnt[f][s0] < th ? r->cnt[f][s0] : th;
		uint64_t above = 0, at = 0;
		for (uint32_t s0 = 0; hot && s0 < r->n[f]; s0++) {
			above += r->cnt[f][s0] > th;
			at += r->cnt[f][s0] == th;
		}
		theta[f] = th;
		qfrac[f] = !hot || !at ? 0.0 : ((double)hot - (double)above) / (double)at;
	}
	for (size_t k = 0; k < N_GAPS; k++) {
		uint32_t gap = k_gaps[k];
		uint64_t used = 0, cap = b->info.cold_slots;
		for (uint64_t i = 0; i < N; i++)
			prev[i] = NONE;
		prev[NIL] = next[NIL] = (uint32_t)NIL;
#define UNLINK(x) (next[prev[x]] = next[x], prev[next[x]] = prev[x])
#define PUSH_MRU(x) (prev[x] = prev[NIL], next[x] = (uint32_t)NIL, next[prev[NIL]] = (x), prev[NIL] = (x))
		for (uint32_t t = 0; t < T; t++)
			for (uint32_t f = 0; f < r->n_ffn; f++) {
				if (t >= r->nt[f])
					continue;
				uint32_t hot = quota[r->layer[f] * g.n_expert + r->expert[f]];
				uint32_t last = 0, runs = 0, read = 0, miss = 0;
				bool open = false;
				for (uint32_t a = r->off[f][t]; a < r->off[f][t + 1]; a++) {
					uint32_t slot = r->slots[f][a];
					uint32_t x = (uint32_t)(base[f] + slot);
					if (slot < hot && loo_hot(r->cnt[f][slot] - 1, theta[f], qfrac[f], f, slot))
						continue;
					if (prev[x] != NONE) { /* a cold hit: most recently used now */
						UNLINK(x);
						PUSH_MRU(x);
						continue;
					}
					uint32_t from = slot;
					miss++;
					if (open && slot - last <= gap + 1)
						from = last + 1;
					else
						runs++;
					open = true;
					last = slot;
					for (uint32_t s2 = from; s2 <= slot; s2++) {
						uint32_t y = (uint32_t)(base[f] + s2);
						read++;
						if (prev[y] != NONE || s2 < hot || !cap)
							continue;
						if (used == cap) { /* evict the least recently used */
							uint32_t v = next[NIL];
							UNLINK(v);
							prev[v] = NONE;
							used--;
						}
						PUSH_MRU(y);
						used++;
					}
				}
				/* the holdout's factor, up to a new token's own
				 * rate: the replay's runs per miss are above the
				 * in-sample layout's alone (cold hits split runs),
				 * and a factor near ten (a mixture's experts) would
				 * count more reads than misses */
				double rr = fmin(r->hold_runs[k] * runs, fmax(runs, r->rate_runs[k] * miss));
				double rb = fmin(r->hold_bundles[k] * read, fmax(read, r->rate_bundles[k] * miss));
				b->runs[k * L + r->layer[f]] += rr / per;
				b->bundles[k * L + r->layer[f]] += rb / per;
			}
#undef UNLINK
#undef PUSH_MRU
	}
	rc = 0;
out:
	free(prev);
	free(next);
	free(theta);
	free(qfrac);
	free(base);
	free(quota);
	return rc;
}

/* The layout each FFN will have: the profile's order with a relayout,
 * else the store's slots as they are. */
static int layouts(const struct nf_plan_opts *o, struct nf_engine *cal, uint32_t ***out, struct nf_diag *d)
{
	struct nf_store *s = nf_engine_store(cal);
	uint32_t n_obj = nf_store_object_count(s);
	uint32_t **order = calloc(n_obj, sizeof(*order));
	if (!order)
		return -ENOMEM;
	struct nf_store_profile *p = NULL;
	if (o->relayout) {
		/* the profile just stored, read from the store the engine reads
		 * (same generation: the engine's store was opened before) */
		struct nf_store *fresh = NULL;
		int rc = nf_store_open(o->store, NULL, &fresh, d);
		if (rc < 0) {
			free(order);
			return rc;
		}
		rc = nf_store_profile_read(fresh, &p, d);
		nf_store_close(fresh);
		if (rc < 0) {
			free(order);
			return rc;
		}
	}
	for (uint32_t i = 0; i < n_obj; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_FFN)
			continue;
		if (!(order[i] = malloc((size_t)ob->n_bundles * sizeof(uint32_t))))
			break;
		if (p && p->order && p->order[i])
			memcpy(order[i], p->order[i], (size_t)ob->n_bundles * sizeof(uint32_t));
		else
			for (uint32_t j = 0; j < ob->n_bundles; j++)
				order[i][ob->perm[j]] = j;
	}
	nf_store_profile_free(p);
	*out = order;
	return 0;
}

/* ---- relayout in place ------------------------------------------------------------------ */

static void relayout_progress(void *user, uint64_t done, uint64_t total)
{
	const struct nf_plan_opts *o = user;
	if (o->progress && o->progress->fn)
		o->progress->fn(o->progress->arg, "laying out the store", done, total);
}

static int fsync_dir_of(const char *path)
{
	char *dup = strdup(path);
	if (!dup)
		return -ENOMEM;
	int fd = open(dirname(dup), O_RDONLY | O_DIRECTORY);
	free(dup);
	if (fd < 0)
		return -errno;
	int rc = fsync(fd) < 0 ? -errno : 0;
	close(fd);
	return rc;
}

/* The relayout's block size: o->bundle_align, else the smallest the
 * device's O_DIRECT reads of the store allow (at least 512): bundles
 * packed that closely cost fewer bytes per neuron read and cached. */
static int relayout_align(const struct nf_plan_opts *o, uint32_t *out, struct nf_diag *d)
{
	if (o->bundle_align) {
		*out = o->bundle_align;
		return 0;
	}
	struct nf_store *s = NULL;
	struct nf_io_ctx *io = NULL;
	struct nf_io_opts io_o;
	nf_io_opts_default(&io_o);
	io_o.quiet = true;
	int rc = nf_store_open(o->store, NULL, &s, d);
	if (rc == 0 && (rc = nf_io_ctx_open(s, &io_o, &io, d)) == 0) {
		uint32_t a = nf_io_ctx_align(io);
		*out = a > NF_STORE_BLOCK_MIN ? a : NF_STORE_BLOCK_MIN;
	}
	nf_io_ctx_close(io);
	nf_store_close(s);
	return rc;
}

/* A complete, verified copy in the profile's layout beside the store,
 * renamed over it: the store is the old one or the new one, never half. */
static int relayout_in_place(const struct nf_plan_opts *o, bool keep_copy, struct nf_diag *d)
{
	size_t n = strlen(o->store) + 64;
	char *tmp = malloc(n), *orig = malloc(n);
	int rc;
	if (!tmp || !orig) {
		rc = -ENOMEM;
		goto out;
	}
	snprintf(tmp, n, "%s.nflash-plan-%ld.tmp", o->store, (long)getpid());
	snprintf(orig, n, "%s.orig", o->store);
	unlink(tmp);
	struct nf_store_relayout_opts ro = { .progress = relayout_progress, .progress_user = (void *)o };
	if ((rc = relayout_align(o, &ro.block_size, d)) < 0 || (rc = nf_store_relayout(o->store, tmp, &ro, d)) < 0)
		goto out;
	if (keep_copy && link(o->store, orig) < 0) {
		rc = nf_diag_fail(d, -errno, "%s: keeping the copy as %s: %s", o->store, orig, nf_strerror(-errno));
		unlink(tmp);
		goto out;
	}
	if (rename(tmp, o->store) < 0) {
		rc = nf_diag_fail(d, -errno, "%s: replacing it with its relayout %s: %s", o->store, tmp,
				  nf_strerror(-errno));
		unlink(tmp);
		goto out;
	}
	if ((rc = fsync_dir_of(o->store)) < 0)
		nf_diag_fail(d, rc, "%s: syncing its directory: %s", o->store, nf_strerror(rc));
out:
	free(tmp);
	free(orig);
	return rc;
}

/* *same: every FFN of the store at path already in its profile's order. */
static int laid_out_so(const char *path, bool *same, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	struct nf_store_profile *p = NULL;
	*same = false;
	int rc = nf_store_open(path, NULL, &s, d);
	if (rc < 0)
		return rc;
	if ((rc = nf_store_profile_read(s, &p, d)) < 0) {
		nf_store_close(s);
		return rc;
	}
	bool ok = p->order != NULL;
	for (uint32_t i = 0; ok && i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_FFN || !p->order[i])
			continue;
		for (uint32_t r = 0; ok && r < ob->n_bundles; r++)
			ok = ob->perm[p->order[i][r]] == r;
	}
	*same = ok;
	nf_store_profile_free(p);
	nf_store_close(s);
	return 0;
}

/* ---- the planner ---------------------------------------------------------------------------- */

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* What the cost model takes beside a candidate's own figures: the same
 * for every budget of one plan. */
struct cost_in {
	const struct nf_store_plan *dev;
	uint32_t n_layer, ffn_dtype, dense_dtype, threads;
	double neuron_bytes, engine_iops, layer_s, verify_spb;
};

/* The cost model's view of candidate b read with gap k_gaps[k]. */
static void model_of(const struct cost_in *ci, const struct budget_plan *b, size_t k, struct nf_plan_model *m)
{
	*m = (struct nf_plan_model){
		.n_layer = ci->n_layer, .stride = b->info.stride, .threads = ci->threads,
		.dense_bytes = (double)b->dense_bytes, .attn_stream_bytes = (double)b->attn_stream_bytes,
		.ffn_dtype = ci->ffn_dtype, .dense_dtype = ci->dense_dtype, .active = b->active,
		.runs = b->runs + k * ci->n_layer, .bundles = b->bundles + k * ci->n_layer,
		.compute_bytes_per_neuron = ci->neuron_bytes, .engine_iops = ci->engine_iops,
		.layer_overhead_s = ci->layer_s, .verify_s_per_byte = ci->verify_spb,
	};
}

/* Choose qd and gap for b; the entry records them and the engine's own
 * decisions. */
static void choose(const struct cost_in *ci, const struct budget_plan *b, struct nf_store_plan_entry *best)
{
	const struct nf_engine_info *info = &b->info;
	memset(best, 0, sizeof(*best));
	best->t_token_s = INFINITY;
	for (size_t k = 0; k < N_GAPS; k++)
		for (size_t q = 0; q < N_QDS; q++) {
			struct nf_plan_model m;
			model_of(ci, b, k, &m);
			struct nf_store_plan_entry e = { 0 };
			nf_plan_predict(ci->dev, &m, k_qds[q], &e);

			/* 1% better to take a wider gap; 20% (the model's own
			 * accuracy) to take a shallower queue than the best's:
			 * one point of a shared disk's curve moves by half
			 * from pass to pass (64 KiB reads at depth 32: 1679
			 * MB/s, at 256: 909, in one pass), and a queue of 32
			 * predicted 14% faster from it decoded 35% slower */
			double margin = best->t_token_s != INFINITY && k_qds[q] < best->qd ? 0.8 : 0.99;
			if (e.t_token_s < best->t_token_s * margin || best->t_token_s == INFINITY) {
				*best = e;
				best->qd = k_qds[q];
				best->read_gap = k_gaps[k];
			}
		}
	best->budget = b->budget;
	best->n_ctx = info->n_ctx;
	best->kv_type = NF_KV_F16;
	best->n_threads = 0;
	best->cold_slots = info->cold_min_slots;
	best->hot_slots = info->hot_slots;
	if (info->attn_streamed) {
		best->flags |= NF_STORE_PLAN_F_STREAM_ATTN;
		best->attn_pin = info->attn_pinned_layers;
	}
}

/* The engine's own pace, from short decodes of the calibration's last
 * tokens (the first PROBE_WARM of PROBE_TOKENS as warm-up), every miss its
 * own read (gap 0) at queue depth 256: per token, the reads and the time
 * in the FFN layers (their reads, and what of their work does not hide
 * behind them). One decode under the smallest budget that opens with
 * attention pinned (streamed attention's reads would share the time),
 * many reads; one under the largest budget that fits beside the
 * calibration engine in free memory, few. Then FFN time per token, less
 * the crc32c checks' (priced per byte apart: a read that bridges a gap
 * checks every bundle it brings), = reads / ceiling + layers x a fixed
 * cost per layer (predictor, scheduling, reduction), solved from the two;
 * the checks' seconds per byte come from the first decode (or, when it
 * cannot run, from timing nf_crc32c). On a 2-vCPU virtual machine the engine
 * took back 36-50K reads a second of 11 KiB and of 20 KiB alike, where
 * the device curve allowed more of the smaller (the CPUs that submit,
 * reap and compute set the pace: without the ceiling the model took a
 * read gap of 1 where 4 decoded 1.2x faster), and at 3 GiB, with few
 * reads, each layer cost 2 ms more than its reads and compute (the
 * predictions were 1.45x the runs'). */
#define PROBE_TOKENS 24
#define PLAN_PASSES 3   /* device passes and engine probe pairs, medians taken */
#define PROBE_WARM 8
struct probe {
	double reads, t_ffn;   /* per measured token: reads, FFN time less the checksums' */
	double bytes, verify;  /* per measured token: bytes read, seconds of crc32c over them */
};

/* Per measured token of a decode probe: streamed attention's bytes and
 * the seconds compute waited for them (0 and 0 when attention is pinned);
 * wait: the share of the token's time that compute waited for reads of
 * any kind, the FFN's and attention's (what plan predicts as the I/O wait
 * share, and generate --json reports as io_wait_share + attn_wait_share). */
struct attn_probe {
	double bytes, t_wait, wait;
};

/* Decode ids[0..PROBE_TOKENS) one token at a time; the counters and the
 * wall time per token of the last PROBE_TOKENS - PROBE_WARM; attention's
 * stream too if ap. */
static int probe_decode(struct nf_engine *e, const int32_t *ids, struct nf_cache_stats *cs,
			struct nf_sparse_stats *ss, struct attn_probe *ap, double *t_tok)
{
	struct nf_cache *c = nf_engine_cache(e);
	struct nf_sparse *sp = nf_engine_sparse(e);
	struct nf_stream_stats a0 = { 0 }, a1 = { 0 };
	bool streamed = false;
	double t0 = now_s();
	for (size_t i = 0; i < PROBE_TOKENS; i++) {
		if (i == PROBE_WARM) {
			nf_cache_stats_reset(c);
			nf_sparse_stats_reset(sp);
			streamed = nf_ctx_attn_stats(nf_engine_ctx(e), &a0);
			t0 = now_s();
		}
		int rc = nf_ctx_eval(nf_engine_ctx(e), &ids[i], 1);
		if (rc < 0)
			return rc;
	}
	*t_tok = (now_s() - t0) / (PROBE_TOKENS - PROBE_WARM);
	nf_cache_stats_get(c, cs);
	nf_sparse_stats_get(sp, ss);
	if (ap) {
		*ap = (struct attn_probe){ 0 };
		if (streamed && nf_ctx_attn_stats(nf_engine_ctx(e), &a1)) {
			ap->bytes = (double)(a1.bytes_read - a0.bytes_read) / (PROBE_TOKENS - PROBE_WARM);
			ap->t_wait = (a1.t_wait - a0.t_wait) / (PROBE_TOKENS - PROBE_WARM);
		}
		double w = *t_tok > 0 ? (ss->t_wait / (PROBE_TOKENS - PROBE_WARM) + ap->t_wait) / *t_tok : 0;
		ap->wait = w < 0 ? 0 : w > 1 ? 1 : w;
	}
	return 0;
}

static int probe_one(const struct nf_plan_opts *o, uint64_t overhead, uint64_t budget, bool need_pinned,
		     const int32_t *ids, struct probe *out)
{
	struct nf_engine *e = NULL;
	struct nf_diag d = { 0 };
	struct nf_engine_opts eo;
	nf_engine_opts_default(&eo);
	eo.path = o->store;
	eo.budget = budget;
	eo.n_threads = o->n_threads;
	eo.n_ctx = PROBE_TOKENS + 8;
	eo.use_plan = false;
	eo.read_gap = 0;
	eo.qd = 256;
	eo.overhead = overhead;
	int rc = nf_engine_open(&eo, &e, &d);
	if (rc < 0)
		return rc;
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	struct nf_cache *c = nf_engine_cache(e);
	struct nf_sparse *sp = nf_engine_sparse(e);
	rc = -EAGAIN;
	if ((need_pinned && info.attn_streamed) || !c || !sp)
		goto out;
	struct nf_cache_stats cs;
	struct nf_sparse_stats ss;
	double t_tok;
	if ((rc = probe_decode(e, ids, &cs, &ss, NULL, &t_tok)) < 0)
		goto out;
	out->reads = (double)cs.requests / (PROBE_TOKENS - PROBE_WARM);
	out->bytes = (double)cs.bytes_read / (PROBE_TOKENS - PROBE_WARM);
	out->verify = (double)cs.verify_ns * 1e-9 / (PROBE_TOKENS - PROBE_WARM);
	out->t_ffn = ss.t_ffn / (PROBE_TOKENS - PROBE_WARM) - out->verify;
	rc = 0;
out:
	nf_engine_close(e);
	return rc;
}

/*
 * What the cost model does not weigh, measured (docs/PLAN.md "Measured
 * choices"): read-ahead (a mixture's guessed experts, a dense FFN's next
 * layer's predicted neurons; --route-prefetch), and gate-first
 * reads for exact mode on a store imported with --gate-objects. Each
 * variant decodes PROBE_TOKENS tokens under the budget with the settings
 * chosen for it, in turn with the others, CHOICE_ROUNDS times; the fastest
 * mean wins if it beats the engine's default by CHOICE_MARGIN, is decoded
 * once more, and the median of its three decodes is the token time
 * predicted (the model's parts scaled to it).
 */
#define CHOICE_ROUNDS 2
#define CHOICE_MARGIN 0.03

/* A decode's rounds: seconds a token of each (the first MAX_ROUNDS), the
 * mean and the fastest, and the stream's figures, means over the rounds;
 * n: rounds taken (0: none). */
#define MAX_ROUNDS 8
struct stream_meas {
	double t, best, ts[MAX_ROUNDS], ws[MAX_ROUNDS]; /* ws: each round's wait share */
	struct attn_probe a;
	int n;
};

/* One more round of decode into m. */
static void meas_add(struct stream_meas *m, double t, const struct attn_probe *ap)
{
	if (m->n < MAX_ROUNDS) {
		m->ts[m->n] = t;
		m->ws[m->n] = ap->wait;
	}
	m->best = m->n && m->best < t ? m->best : t;
	m->t = (m->t * m->n + t) / (m->n + 1);
	m->a.bytes = (m->a.bytes * m->n + ap->bytes) / (m->n + 1);
	m->a.t_wait = (m->a.t_wait * m->n + ap->t_wait) / (m->n + 1);
	m->n++;
}

/* The median of m's rounds' token times (of two, their mean), or of their
 * wait shares: one slow decode, which a shared host's noise gives now and
 * then, does not set it. */
static double median_of(const double *r, int n)
{
	n = n < MAX_ROUNDS ? n : MAX_ROUNDS;
	double v[MAX_ROUNDS];
	memcpy(v, r, (size_t)n * sizeof(double));
	for (int i = 1; i < n; i++)
		for (int k = i; k > 0 && v[k] < v[k - 1]; k--) {
			double x = v[k];
			v[k] = v[k - 1];
			v[k - 1] = x;
		}
	return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double meas_median(const struct stream_meas *m)
{
	return median_of(m->ts, m->n);
}

struct choice {
	int route, gate;            /* the engine options tried */
	double t, bytes;            /* per token, summed over the rounds */
	bool ok;
	bool whole_cold;            /* a layer of cold slots, not the entry's part of one */
};

/* One variant's decode at entry pe's settings: seconds and bytes (bundles
 * and gate rows) per token. NF_EUSAGE: the variant cannot run here. */
static int decode_probe(const struct nf_plan_opts *o, uint64_t overhead, const struct nf_store_plan_entry *pe,
			const struct choice *v, const int32_t *ids, double *t_tok, double *bytes_tok,
			enum nf_sparse_mode *mode, struct attn_probe *ap, uint32_t *hot_slots)
{
	struct nf_engine *e = NULL;
	struct nf_diag d = { 0 };
	struct nf_engine_opts eo;
	nf_engine_opts_default(&eo);
	eo.path = o->store;
	eo.budget = pe->budget;
	eo.n_threads = o->n_threads;
	eo.use_plan = false;
	eo.overhead = overhead;
	eo.n_ctx = pe->n_ctx;
	eo.kv_type = (int)pe->kv_type;
	eo.n_batch = pe->n_batch;
	eo.qd = pe->qd;
	eo.read_gap = (int)pe->read_gap;
	eo.cold_slots = v->whole_cold ? 0 : (int)pe->cold_slots;
	eo.stream_attn = pe->flags & NF_STORE_PLAN_F_STREAM_ATTN;
	eo.attn_pin = pe->attn_pin;
	eo.route_prefetch = v->route;
	eo.gate_first = v->gate;
	int rc = nf_engine_open(&eo, &e, &d);
	if (rc < 0)
		return rc;
	struct nf_cache *c = nf_engine_cache(e);
	struct nf_sparse *sp = nf_engine_sparse(e);
	rc = -EAGAIN;
	if (!c || !sp)
		goto out;
	*mode = nf_sparse_mode_of(sp);
	if (hot_slots) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(c, &cl);
		*hot_slots = cl.hot_slots;
	}
	struct nf_cache_stats cs;
	struct nf_sparse_stats ss;
	if ((rc = probe_decode(e, ids, &cs, &ss, ap, t_tok)) < 0)
		goto out;
	*bytes_tok = (double)(cs.bytes_read + ss.gate_bytes) / (PROBE_TOKENS - PROBE_WARM);
	rc = 0;
out:
	nf_engine_close(e);
	return rc;
}

/* True when the store holds gate rows (import --gate-objects). */
static bool has_gate_rows(const char *path)
{
	struct nf_store *s = NULL;
	bool yes = false;
	if (nf_store_open(path, NULL, &s, NULL) < 0)
		return false;
	for (uint32_t i = 0; i < nf_store_object_count(s) && !yes; i++)
		yes = nf_store_is_gate_rows_name(nf_store_object_get(s, i)->name);
	nf_store_close(s);
	return yes;
}

static int measure_choices(const struct nf_plan_opts *o, uint64_t overhead, bool moe, bool gate_rows,
			   const int32_t *ids, struct nf_store_plan_entry *pe, struct nf_diag *d)
{
	/* plain reads first (what the cost model models), then read-ahead (a
	 * mixture's guessed experts, or a dense FFN's next layer in predictor
	 * mode: the first probe says which mode), then gate-first (refused
	 * but in exact mode), then, where the entry keeps part of a layer of
	 * cold slots, read-ahead with a whole layer: room for the next layer's
	 * reads beside this one's, at the hot segment's expense */
	enum { NV = 4 };
	struct choice v[NV] = { { 0, 0, 0, 0, true, false },
				{ 1, 0, 0, 0, true, false },
				{ 0, 1, 0, 0, gate_rows, false },
				{ 1, 0, 0, 0, pe->cold_slots != 0, true } };
	uint32_t hot_whole = 0;
	enum nf_sparse_mode mode = NF_SPARSE_PREDICTOR;
	struct stream_meas rounds[NV] = { { 0 } };
	for (int r = 0; r < CHOICE_ROUNDS; r++)
		for (int k = 0; k < NV; k++) {
			if (!v[k].ok)
				continue;
			double t = 0, b = 0;
			struct attn_probe ap;
			if ((k == 1 || k == 3) && !moe && mode != NF_SPARSE_PREDICTOR) {
				v[k].ok = false; /* a dense FFN reads ahead in predictor mode only */
				continue;
			}
			int rc = decode_probe(o, overhead, pe, &v[k], ids, &t, &b, &mode, &ap, k == 3 ? &hot_whole : NULL);
			if (rc == NF_EUSAGE && k == 2) { /* no gate rows, or not exact mode */
				v[k].ok = false;
				continue;
			}
			if (rc < 0) {
				if (k == 0)
					return rc == -EAGAIN ? 0 : nf_diag_fail(d, rc, "%s: probing a decode under %.1f MiB",
										  o->store, (double)pe->budget / 1048576.0);
				v[k].ok = false;
				continue;
			}
			v[k].t += t / CHOICE_ROUNDS;
			v[k].bytes += b / CHOICE_ROUNDS;
			meas_add(&rounds[k], t, &ap);
		}
	if (!v[1].ok && !v[2].ok && !v[3].ok)
		return 0;
	/* the engine's default: read-ahead on, but off for experts in
	 * predictor mode */
	int def = moe && mode == NF_SPARSE_PREDICTOR ? 0 : 1, best = def;
	if (!v[def].ok)
		best = def = 0;
	for (int k = 0; k < NV; k++)
		if (v[k].ok && v[k].t < v[best].t * (1.0 - CHOICE_MARGIN))
			best = k;
	char what[200];
	int n = snprintf(what, sizeof(what), "plain reads %.1f ms", v[0].t * 1e3);
	if (v[1].ok)
		n += snprintf(what + n, sizeof(what) - (size_t)n, ", read-ahead %.1f ms", v[1].t * 1e3);
	if (v[2].ok)
		n += snprintf(what + n, sizeof(what) - (size_t)n, ", gate-first %.1f ms", v[2].t * 1e3);
	if (v[3].ok)
		snprintf(what + n, sizeof(what) - (size_t)n, ", read-ahead with a layer of cold slots %.1f ms",
			 v[3].t * 1e3);
	static const char *const won[NV] = { "plain reads", "read-ahead on", "gate-first",
					     "read-ahead on, a layer of cold slots" };
	/* The winner once more: its prediction is the median of three
	 * decodes. The 7B's 1 GiB plan of session 22 took the mean of two,
	 * 944 ms a token, and the benchmark's runs took 730; another plan
	 * of the same store decoded 754 */
	double t, bb;
	enum nf_sparse_mode m2;
	struct attn_probe ap;
	if (decode_probe(o, overhead, pe, &v[best], ids, &t, &bb, &m2, &ap, NULL) == 0)
		meas_add(&rounds[best], t, &ap);
	double t_pred = meas_median(&rounds[best]);
	logf_(o, "%.1f MiB: a decode token measured with %s (means of %d): %s; %s, the median of %d: %.1f ms",
	      (double)pe->budget / 1048576.0, what, CHOICE_ROUNDS, won[best], won[best], rounds[best].n,
	      t_pred * 1e3);
	if (best == 2)
		pe->flags |= NF_STORE_PLAN_F_GATE_FIRST;
	else
		pe->flags |= NF_STORE_PLAN_F_ROUTE_SET | (best % 2 ? NF_STORE_PLAN_F_ROUTE_ON : 0);
	if (best == 3) {
		pe->cold_slots = 0;
		pe->hot_slots = hot_whole;
	}
	/* The token time predicted is the one decodes of these settings
	 * measured (the median of three); the model's parts are scaled to it,
	 * and the I/O wait share predicted is the median of the same decodes'
	 * (until session 31 it was the cost model's, scaled with the rest: on
	 * the Xeon of session 30 it said 0.21, 0.11 and 0.00 at 1, 1.5 and 2
	 * GiB where the benchmark's runs waited 0.48, 0.38 and 0.12 of their
	 * time). (Until session 21 the
	 * model's time for plain reads was scaled by the measured ratio of the
	 * choice to plain reads: on the Zen 4 EPYC the model priced plain
	 * reads 1.36x too fast at 1.5 and 2 GiB, 223 against 303 ms at 2 GiB,
	 * and predicted 1.28-1.30x the benchmark's speed, where the decodes
	 * measured here were within 3-9% of it; docs/PLAN.md "Measured,
	 * session 21".) */
	double f = pe->t_token_s > 0 ? t_pred / pe->t_token_s : 1.0;
	pe->t_token_s = t_pred;
	pe->t_dense_s *= f;
	pe->t_ffn_s *= f;
	pe->t_io_s *= f;
	pe->io_wait_share = median_of(rounds[best].ws, rounds[best].n);
	pe->tok_per_s = pe->t_token_s > 0 ? 1.0 / pe->t_token_s : 0;
	if (v[0].bytes > 0)
		pe->bytes_per_token *= v[best].bytes / v[0].bytes;
	return 0;
}

/*
 * Where the engine's context fit leaves attention streamed, the search
 * also finds the best plan with attention pinned in a context of
 * SHORT_CTX tokens (budget_plan.alt): every token then reads its FFN
 * misses alone, not behind the attention's megabytes. The cost model
 * prices streamed attention from the device curve's large reads, which a
 * throttled virtual disk serves at burst or at its sustained rate from one
 * pass to the next (1 MiB reads at depth 8: 1.7 to 7.4 GB/s within one
 * plan; the 7B at 1.5 GiB predicted 3.69 tok/s streamed and decoded 1.6-1.8,
 * its FFN reads queued behind attention's), so the two are decoded in turn,
 * CHOICE_ROUNDS times each, and the shorter context is taken only when it
 * is CTX_MARGIN faster: a shorter context costs the user prompt room.
 */
#define SHORT_CTX 128u
#define CTX_MARGIN 0.10

static int measure_context(const struct nf_plan_opts *o, uint64_t overhead, const int32_t *ids,
			   struct budget_plan *b, struct stream_meas *sm, struct nf_diag *d)
{
	if (!b->has_alt)
		return 0;
	const struct choice plain = { 0, 0, 0, 0, true, false };
	double t[2] = { 0, 0 };
	struct stream_meas acc = { 0 };
	for (int r = 0; r < CHOICE_ROUNDS; r++)
		for (int k = 0; k < 2; k++) {
			double tt = 0, bb = 0;
			enum nf_sparse_mode mode;
			struct attn_probe ap;
			int rc = decode_probe(o, overhead, k ? &b->alt : &b->chosen, &plain, ids, &tt, &bb, &mode, &ap, NULL);
			if (rc < 0) {
				if (k == 1 || rc == -EAGAIN)
					return 0; /* keep the engine's context */
				return nf_diag_fail(d, rc, "%s: probing a decode under %.1f MiB", o->store,
						    (double)b->budget / 1048576.0);
			}
			t[k] += tt / CHOICE_ROUNDS;
			if (k == 0)
				meas_add(&acc, tt, &ap);
		}
	bool take = t[1] < t[0] * (1.0 - CTX_MARGIN);
	if (!take)
		*sm = acc;
	logf_(o, "%.1f MiB: a decode token measured with -c %u, attention streamed, %.1f ms; with -c %u, attention "
		 "pinned, %.1f ms (means of %d): %s", (double)b->budget / 1048576.0, b->chosen.n_ctx, t[0] * 1e3,
	      b->alt.n_ctx, t[1] * 1e3, CHOICE_ROUNDS, take ? "the shorter context taken" : "the engine's context kept");
	if (take)
		b->chosen = b->alt;
	return 0;
}

/*
 * Streamed attention's pace, measured where the plan streams it. The
 * device curve's 1 MiB reads are a burst figure one pass and a sustained
 * one the next on a throttled virtual disk (at depth 8: 1.3 to 7.4 GB/s
 * between two plans of the 7B), and a token that streams 1.2 GB of
 * attention meets the sustained one, beside its FFN's reads. So the
 * chosen plan is decoded (measure_context's and measure_gap's rounds, and
 * more up to STREAM_ROUNDS), and the stream's rate is solved from the cost
 * model's own terms for the median round. When the token
 * took longer than the compute path (by STREAM_BOUND), it is the device's
 * time for the stream and the FFN's reads: the FFN's as predicted, the
 * rest the stream's. Else the stream kept up, and its rate is at least what
 * that leaves (the curve's, if higher). The entry is predicted again at
 * that rate. Compute's own waits for attention do not tell: on the 7B at
 * 1 GiB the stream's groups were ready when asked (0.0 ms of 728), while
 * the FFN's small reads waited behind them.
 */
#define STREAM_BOUND 0.05
#define STREAM_ROUNDS 3

static int measure_stream(const struct nf_plan_opts *o, uint64_t overhead, const int32_t *ids,
			  const struct cost_in *ci, struct budget_plan *b, struct stream_meas *sm)
{
	struct nf_store_plan_entry *pe = &b->chosen;
	if (!(pe->flags & NF_STORE_PLAN_F_STREAM_ATTN) || !b->attn_stream_bytes || !b->active)
		return 0;
	const struct choice plain = { 0, 0, 0, 0, true, false };
	for (int r = sm->n; r < STREAM_ROUNDS; r++) {
		double tt = 0, bb = 0;
		enum nf_sparse_mode mode;
		struct attn_probe ap;
		int rc = decode_probe(o, overhead, pe, &plain, ids, &tt, &bb, &mode, &ap, NULL);
		if (rc < 0)
			return rc == -EAGAIN || rc == NF_EBUDGET ? 0 : rc;
		meas_add(sm, tt, &ap); /* beside measure_context's and measure_gap's rounds */
	}
	double t_meas = meas_median(sm);
	if (t_meas <= 0 || sm->a.bytes <= 0)
		return 0;
	size_t k = 0;
	while (k + 1 < N_GAPS && k_gaps[k] != pe->read_gap)
		k++;
	struct nf_plan_model m;
	model_of(ci, b, k, &m);
	double curve = nf_plan_device_mb_s(ci->dev, 1 << 20, 8);
	/* the compute path and the FFN's reads alone: the stream free */
	struct nf_store_plan_entry e0 = { 0 };
	m.attn_mb_s = 1e12;
	nf_plan_predict(ci->dev, &m, pe->qd, &e0);
	double left = t_meas - e0.t_io_s, floor_s = 0.1 * t_meas;
	double mbs = m.attn_stream_bytes / ((left > floor_s ? left : floor_s) * 1e6);
	bool bound = t_meas > e0.t_token_s * (1.0 + STREAM_BOUND);
	if (!bound && curve > mbs)
		mbs = curve;
	m.attn_mb_s = mbs;
	struct nf_store_plan_entry e = *pe;
	nf_plan_predict(ci->dev, &m, pe->qd, &e);
	logf_(o, "%.1f MiB: attention streamed %.0f MB a token at %.0f MB/s beside the FFN's reads (decodes of -c %u: "
		 "the median of %d %.1f ms a token, their mean %.1f, %.1f ms of it waiting for attention; the device "
		 "curve's 1 MiB reads: %.0f MB/s): predicted %.2f tok/s, not %.2f",
	      (double)b->budget / 1048576.0, sm->a.bytes / 1e6, mbs, pe->n_ctx, sm->n, t_meas * 1e3, sm->t * 1e3,
	      sm->a.t_wait * 1e3, curve, e.tok_per_s, pe->tok_per_s);
	pe->tok_per_s = e.tok_per_s;
	pe->io_wait_share = e.io_wait_share;
	pe->t_io_s = e.t_io_s;
	pe->t_token_s = e.t_token_s;
	return 0;
}

/*
 * The read gap, measured. The search prices each gap's reads on the device
 * curve and the engine probe's read pace, each a figure of the minute it
 * was measured in, and a wider gap trades reads for bytes at exactly the
 * rates that move most from minute to minute. On the 7B shape at 1.5 GiB
 * (session 15) it took a gap of 8, 512 MiB read a token, that the curve's
 * burst rate priced at an I/O wait of 0.21; the runs waited 0.37-0.44 of
 * their time and decoded 0.87x the hand-tuned gap of 4. So the gap chosen
 * and its neighbours in k_gaps (one narrower, one wider) are decoded in
 * turn; when a neighbour was GAP_MARGIN faster, that neighbour and the
 * chosen gap are decoded again, in the other order, and the neighbour is
 * taken if the faster of each one's two rounds still says so: the host's
 * noise only ever adds time, and the first decode after the calibration
 * can be the slowest (the 7B at 1 GiB: gap 8 decoded 1121 ms a token, then
 * 501; gap 16 603, then 534), which a mean would hold against the gap
 * chosen, always decoded first. A neighbour taken, the walk goes on in its
 * direction, the next gap decoded and taken the same way, until one does
 * not win: the 7B at 2 GiB (session 39) took gap 1 over the model's 0
 * (189 against 196 ms) and never decoded 2. The entry then holds
 * the model's prediction for the gap taken, and measure_stream prices a
 * streamed attention's reads from the decodes of that gap. Skipped where
 * a token is predicted to read less than once a layer: there the gap has
 * nothing to join.
 */
#define GAP_MARGIN 0.03

/* Append to log[0..len) at *w, truncating at the end. */
static void logcat(char *log, size_t len, size_t *w, const char *fmt, ...)
{
	if (*w + 1 >= len)
		return;
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(log + *w, len - *w, fmt, ap);
	va_end(ap);
	if (n > 0)
		*w = *w + (size_t)n < len ? *w + (size_t)n : len - 1;
}

static bool cannot_run(int rc)
{
	return rc == -EAGAIN || rc == NF_EBUDGET;
}

int nf_plan_gap_search(const uint32_t *gaps, size_t n_gaps, size_t k0, double best0, double margin,
		       nf_plan_gap_round_fn round, void *arg, size_t *taken, char *log, size_t log_len)
{
	size_t k[3] = { k0, 0, 0 }, w = 0;
	double t[3] = { best0, 0, 0 };
	bool ok[3] = { true, true, true };
	uint32_t n = 1;
	int rc;
	*taken = k0;
	if (log_len)
		log[0] = 0;
	if (k0 >= n_gaps)
		return -EINVAL;
	if (k0 > 0)
		k[n++] = k0 - 1;
	if (k0 + 1 < n_gaps)
		k[n++] = k0 + 1;
	for (uint32_t j = 0; j < n; j++) {
		if (j == 0 && best0 > 0)
			continue; /* decoded before (measure_context) */
		rc = round(arg, k[j], &t[j]);
		if (cannot_run(rc)) {
			if (j == 0)
				return 1;
			ok[j] = false;
		} else if (rc < 0) {
			return rc;
		}
	}
	uint32_t alt = 0;
	for (uint32_t j = 1; j < n; j++)
		if (ok[j] && t[j] < t[alt] * (1.0 - margin))
			alt = j;
	for (uint32_t j = 0; j < n; j++)
		if (ok[j])
			logcat(log, log_len, &w, "%sgap %u %.1f ms", j ? ", " : "", gaps[k[j]], t[j] * 1e3);
	size_t cur = k0;
	double tc = t[0];
	if (alt) {
		/* again, the neighbour first this time */
		rc = round(arg, k[alt], &t[alt]);
		if (rc == 0)
			rc = round(arg, k0, &t[0]);
		if (rc < 0 && !cannot_run(rc))
			return rc;
		if (rc == 0) {
			logcat(log, log_len, &w, "; again, the faster of two: gap %u %.1f ms, gap %u %.1f ms", gaps[k[alt]],
			       t[alt] * 1e3, gaps[k0], t[0] * 1e3);
			if (t[alt] < t[0] * (1.0 - margin)) {
				cur = k[alt];
				tc = t[alt];
			}
		}
	}
	/* on in the direction taken, each further gap taken as the neighbour was */
	while (cur != k0 && (cur > k0 ? cur + 1 < n_gaps : cur > 0)) {
		size_t nx = cur > k0 ? cur + 1 : cur - 1;
		double tn = 0;
		rc = round(arg, nx, &tn);
		if (cannot_run(rc))
			break;
		if (rc < 0)
			return rc;
		double first = tn;
		bool wins = tn < tc * (1.0 - margin), again = false;
		if (wins) {
			rc = round(arg, cur, &tc);
			if (rc == 0)
				rc = round(arg, nx, &tn);
			if (rc < 0 && !cannot_run(rc))
				return rc;
			again = rc == 0;
			wins = again && tn < tc * (1.0 - margin);
		}
		logcat(log, log_len, &w, "; on to gap %u %.1f ms", gaps[nx], first * 1e3);
		if (again)
			logcat(log, log_len, &w, ", the faster of two %.1f against gap %u %.1f", tn * 1e3, gaps[cur],
			       tc * 1e3);
		if (!wins)
			break;
		cur = nx;
		tc = tn;
	}
	*taken = cur;
	return 0;
}

/* measure_gap's decodes: the chosen settings, each gap's rounds */
struct gap_probe {
	const struct nf_plan_opts *o;
	uint64_t overhead;
	const int32_t *ids;
	struct nf_store_plan_entry e;
	struct stream_meas m[N_GAPS];
	size_t last;                /* the gap index decoded last */
};

/* nf_plan_gap_round_fn: one more decode with read gap k_gaps[k]. */
static int gap_round(void *arg, size_t k, double *best)
{
	struct gap_probe *g = arg;
	const struct choice plain = { 0, 0, 0, 0, true, false };
	struct nf_store_plan_entry e = g->e;
	e.read_gap = k_gaps[k];
	g->last = k;
	double tt = 0, bb = 0;
	enum nf_sparse_mode mode;
	struct attn_probe ap;
	int rc = decode_probe(g->o, g->overhead, &e, &plain, g->ids, &tt, &bb, &mode, &ap, NULL);
	if (rc < 0)
		return rc;
	meas_add(&g->m[k], tt, &ap);
	*best = g->m[k].best;
	return 0;
}

/* sm: measure_context's decodes of the chosen settings (n = 0: none); on
 * return, the decodes of the settings kept, for measure_stream. */
static int measure_gap(const struct nf_plan_opts *o, uint64_t overhead, const int32_t *ids, const struct cost_in *ci,
		       struct budget_plan *b, struct stream_meas *sm, struct nf_diag *d)
{
	struct nf_store_plan_entry *pe = &b->chosen;
	if (!b->active || !b->runs || pe->reads_per_token < ci->n_layer)
		return 0;
	size_t k0 = 0;
	while (k0 + 1 < N_GAPS && k_gaps[k0] != pe->read_gap)
		k0++;
	struct gap_probe g = { .o = o, .overhead = overhead, .ids = ids, .e = *pe };
	g.m[k0] = *sm;
	char what[512];
	size_t take = k0;
	int rc = nf_plan_gap_search(k_gaps, N_GAPS, k0, sm->n ? sm->best : 0, GAP_MARGIN, gap_round, &g, &take, what,
				    sizeof(what));
	if (rc == 1)
		return 0; /* the chosen gap cannot run here: nothing measured */
	if (rc < 0)
		return nf_diag_fail(d, rc, "%s: probing a decode under %.1f MiB with read gap %u", o->store,
				    (double)b->budget / 1048576.0, k_gaps[g.last]);
	if (take == k0) {
		*sm = g.m[k0];
		logf_(o, "%.1f MiB: read gap %u and its neighbours, a decode token each: %s: gap %u kept",
		      (double)b->budget / 1048576.0, pe->read_gap, what, pe->read_gap);
		return 0;
	}
	struct nf_plan_model m;
	model_of(ci, b, take, &m);
	struct nf_store_plan_entry e = { 0 };
	nf_plan_predict(ci->dev, &m, pe->qd, &e);
	logf_(o, "%.1f MiB: read gap %u and its neighbours, a decode token each: %s: gap %u taken, predicted %.2f "
		 "tok/s, not %.2f",
	      (double)b->budget / 1048576.0, pe->read_gap, what, k_gaps[take], e.tok_per_s, pe->tok_per_s);
	pe->read_gap = k_gaps[take];
	pe->tok_per_s = e.tok_per_s;
	pe->io_wait_share = e.io_wait_share;
	pe->bytes_per_token = e.bytes_per_token;
	pe->reads_per_token = e.reads_per_token;
	pe->t_dense_s = e.t_dense_s;
	pe->t_ffn_s = e.t_ffn_s;
	pe->t_io_s = e.t_io_s;
	pe->t_token_s = e.t_token_s;
	*sm = g.m[take];
	return 0;
}

/* The engine probe's figures, solved from one pair of probes */
struct probe_fit {
	double iops, layer_s, verify_spb;
	bool solved;                /* from two budgets; else iops from the smaller alone */
};

/* Which budgets the probes run under: the smallest that runs with
 * pinned attention (lo) and the largest that fits beside the calibration
 * engine (hi); found by the first pair, kept by the others. The budgets
 * planned come first; where none of them pins attention (a plan of 1 GiB
 * alone for the 7B), or none above lo fits, budgets of PROBE_EXTRA times the
 * largest are tried too. The probe is of the engine's own pace, and
 * streamed attention's reads would share its time: under the 7B's 1 GiB
 * it took back 32K reads a second, against 172K with attention pinned.
 * Only where no budget pins it does lo stream. */
#define N_EXTRA 3
static const double k_extra[N_EXTRA] = { 1.5, 2.0, 3.0 };
struct probe_state {
	uint64_t *b;
	uint32_t n, n_listed, ilo, ihi;
	bool searched, lo_streams;
};

/* Memory a new allocation can have: MemAvailable (free pages and the page
 * cache the kernel would drop for it). Free pages alone leave out the page
 * cache that files read earlier hold: with 13.9 GB of it and 9.8 GB free
 * on a 24 GB machine, the 7B's probe at 3 GiB did not run beside the
 * calibration engine, and the model lost its fixed cost per layer. */
static double avail_bytes(void)
{
	double pages = (double)sysconf(_SC_AVPHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
	FILE *f = fopen("/proc/meminfo", "r");
	if (!f)
		return pages;
	char line[128];
	unsigned long long kb = 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
			break;
	fclose(f);
	return kb ? (double)kb * 1024.0 : pages;
}

/* Memory this process's memory cgroup still allows (its limit less its
 * usage), v1 or v2; HUGE_VAL without a limit. */
static double cgroup_room(void)
{
	FILE *f = fopen("/proc/self/cgroup", "r");
	if (!f)
		return HUGE_VAL;
	char line[512], v1[400] = "", v2[400] = "";
	while (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = 0;
		char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
		if (!b)
			continue;
		*a = *b = 0;
		if (!strcmp(a + 1, "memory"))
			snprintf(v1, sizeof(v1), "%s", b + 1);
		else if (!strcmp(line, "0") && a[1] == 0)
			snprintf(v2, sizeof(v2), "%s", b + 1);
	}
	fclose(f);
	char lim[512], use[512];
	if (v1[0]) {
		snprintf(lim, sizeof(lim), "/sys/fs/cgroup/memory%s/memory.limit_in_bytes", v1);
		snprintf(use, sizeof(use), "/sys/fs/cgroup/memory%s/memory.usage_in_bytes", v1);
	} else if (v2[0]) {
		snprintf(lim, sizeof(lim), "/sys/fs/cgroup%s/memory.max", v2);
		snprintf(use, sizeof(use), "/sys/fs/cgroup%s/memory.current", v2);
	} else {
		return HUGE_VAL;
	}
	unsigned long long l = 0, u = 0;
	FILE *fl = fopen(lim, "r"), *fu = fopen(use, "r");
	int ok = fl && fu && fscanf(fl, "%llu", &l) == 1 && fscanf(fu, "%llu", &u) == 1;
	if (fl)
		fclose(fl);
	if (fu)
		fclose(fu);
	/* "max" (v2) or a page-rounded LLONG_MAX (v1): no limit */
	if (!ok || l >= (1ull << 62))
		return HUGE_VAL;
	return l > u ? (double)(l - u) : 0.0;
}

/*
 * The calibration's budget. It runs under the largest planned budget,
 * unless attention would stream there with the calibration's context
 * (calib_tokens + 1 positions): every calibration token would then read
 * the whole of attention (the 7B synth store planned for 1.5 GiB alone:
 * 512 tokens x 1208 MB, about ten minutes of a 1.1 GB/s disk where a
 * calibration with attention pinned takes two). The calibration records
 * which neurons fire; the budget only sets how fast it reads them. So the
 * budget is raised to one that pins attention, when the memory this
 * process may still take (MemAvailable, and its memory cgroup's room)
 * holds it with a quarter to spare; otherwise it stays, and the log says
 * so. *why gets the reason for the log, empty when it stays.
 */
static uint64_t calib_budget(const struct nf_engine_opts *eo, uint64_t largest, char *why, size_t why_len)
{
	struct nf_engine_opts so = *eo;
	so.size_only = true;
	so.on_read = NULL;
	so.profile_log = NULL;
	so.budget = largest;
	why[0] = 0;
	struct nf_engine *e = NULL;
	struct nf_diag sd = { 0 };
	if (nf_engine_open(&so, &e, &sd) < 0)
		return largest; /* the calibration's own open reports it */
	struct nf_engine_info si;
	nf_engine_info(e, &si);
	uint64_t attn = nf_model_attn_bytes(nf_engine_model(e));
	nf_engine_close(e);
	if (!si.attn_streamed)
		return largest;
	/* what the engine holds beside the arena with attention pinned, then
	 * upwards until its own fit pins attention */
	so.budget = 0;
	if (nf_engine_open(&so, &e, &sd) < 0)
		return largest;
	nf_engine_info(e, &si);
	nf_engine_close(e);
	uint64_t step = 64ull << 20, want = si.weights + si.reserved + si.overhead + step, ov = si.overhead;
	bool pinned = false;
	for (int i = 0; i < 16 && !pinned; i++, want += step) {
		so.budget = want;
		if (nf_engine_open(&so, &e, &sd) < 0)
			continue;
		nf_engine_info(e, &si);
		nf_engine_close(e);
		pinned = !si.attn_streamed;
	}
	if (!pinned)
		return largest;
	want -= step;
	double room = avail_bytes(), cg = cgroup_room();
	room = cg < room ? cg : room;
	if ((double)(want - ov) <= 0.75 * room) {
		snprintf(why, why_len,
			 "calibration under %.1f MiB, not the largest budget's %.1f MiB: attention pinned, where it "
			 "would stream there (%.0f MB a token)",
			 want / 1048576.0, largest / 1048576.0, attn / 1e6);
		return want;
	}
	snprintf(why, why_len,
		 "calibration under %.1f MiB with attention streamed (%.0f MB a token, slow): pinning it needs "
		 "%.1f MiB, more than 3/4 of the memory available (%.0f MiB)",
		 largest / 1048576.0, attn / 1e6, want / 1048576.0, room / 1048576.0);
	return largest;
}

static int probe_pair(const struct nf_plan_opts *o, uint64_t overhead, const uint64_t *budgets,
		      const int32_t *ids, uint32_t n_layer, struct probe_state *ps, struct probe_fit *f)
{
	struct probe lo = { 0 }, hi = { 0 };
	*f = (struct probe_fit){ 0 };
	if (!ps->searched) {
		ps->searched = true;
		if (!(ps->b = malloc((o->n_budgets + N_EXTRA) * sizeof(*ps->b))))
			return -EAGAIN;
		uint64_t top = 0;
		for (uint32_t i = 0; i < o->n_budgets; i++) {
			ps->b[ps->n++] = budgets[i];
			top = budgets[i] > top ? budgets[i] : top;
		}
		ps->n_listed = ps->n;
		for (uint32_t k = 0; k < N_EXTRA; k++)
			ps->b[ps->n++] = (uint64_t)(k_extra[k] * (double)top) >> 20 << 20;
		ps->ilo = ps->ihi = ps->n;
		for (uint32_t i = 0; i < ps->n && ps->ilo == ps->n; i++)
			if (probe_one(o, overhead, ps->b[i], true, ids, &lo) == 0)
				ps->ilo = i;
		for (uint32_t i = 0; i < ps->n_listed && ps->ilo == ps->n; i++)
			if (probe_one(o, overhead, ps->b[i], false, ids, &lo) == 0)
				ps->ilo = i, ps->lo_streams = true;
		if (ps->ilo == ps->n)
			return -EAGAIN;
		double avail = avail_bytes();
		for (int pass = 0; pass < 2 && ps->ihi == ps->n; pass++) {
			uint32_t from = pass ? ps->n : ps->n_listed, to = pass ? ps->n_listed : 0;
			for (uint32_t i = from; i-- > to && i > ps->ilo && ps->ihi == ps->n;)
				if ((double)ps->b[i] + (1u << 30) < avail && ps->b[i] > ps->b[ps->ilo] &&
				    probe_one(o, overhead, ps->b[i], true, ids, &hi) == 0)
					ps->ihi = i;
		}
		if (ps->ihi == ps->n)
			logf_(o, "engine probe: no budget above %.1f MiB decoded with attention pinned beside the "
				 "calibration engine (%.0f MiB available): no fixed cost per layer",
			      ps->b[ps->ilo] / 1048576.0, avail / 1048576.0);
	} else {
		if (ps->ilo == ps->n || probe_one(o, overhead, ps->b[ps->ilo], !ps->lo_streams, ids, &lo) < 0)
			return -EAGAIN;
		if (ps->ihi < ps->n && probe_one(o, overhead, ps->b[ps->ihi], true, ids, &hi) < 0)
			hi = (struct probe){ 0 };
	}
	if (lo.reads < 100 || lo.t_ffn <= 0)
		return -EAGAIN;
	f->iops = lo.reads / lo.t_ffn;
	if (lo.bytes > 0 && lo.verify > 0)
		f->verify_spb = lo.verify / lo.bytes;
	if (ps->ihi < ps->n && hi.t_ffn > 0 && lo.reads > 2 * hi.reads && lo.t_ffn > hi.t_ffn) {
		double per_read = (lo.t_ffn - hi.t_ffn) / (lo.reads - hi.reads);
		double fixed = (hi.t_ffn - hi.reads * per_read) / n_layer;
		if (per_read > 0 && fixed > 0) {
			f->iops = 1.0 / per_read;
			f->layer_s = fixed;
			f->solved = true;
		}
	}
	logf_(o, "engine probe: %.0f reads and %.1f ms of FFN a token under %.1f MiB, %.0f and %.1f ms under "
		 "%.1f MiB: %.0f reads/s, %.2f ms a layer beside them, crc32c checks at %.1f GB/s",
	      lo.reads, lo.t_ffn * 1e3, ps->b[ps->ilo] / 1048576.0, hi.reads, hi.t_ffn * 1e3,
	      ps->ihi < ps->n ? ps->b[ps->ihi] / 1048576.0 : 0.0, f->iops, f->layer_s * 1e3,
	      f->verify_spb > 0 ? 1e-9 / f->verify_spb : 0.0);
	return 0;
}

/* Where the calibration read: a uniform sample (reservoir) of the byte
 * offsets of its completed reads, for the device curve to read at. */
#define READ_SAMPLE 16384
struct read_sample {
	pthread_mutex_t mu;
	uint64_t off[READ_SAMPLE];
	uint64_t seen, rng;
	bool frozen;
};

static void sample_read(void *user, uint64_t offset, uint32_t len, int64_t res, uint64_t lat_ns)
{
	struct read_sample *rs = user;
	(void)len, (void)lat_ns;
	if (res <= 0)
		return;
	pthread_mutex_lock(&rs->mu);
	if (!rs->frozen) {
		if (rs->seen < READ_SAMPLE) {
			rs->off[rs->seen] = offset;
		} else {
			rs->rng ^= rs->rng << 13, rs->rng ^= rs->rng >> 7, rs->rng ^= rs->rng << 17;
			uint64_t k = rs->rng % (rs->seen + 1);
			if (k < READ_SAMPLE)
				rs->off[k] = offset;
		}
		rs->seen++;
	}
	pthread_mutex_unlock(&rs->mu);
}

/* Freeze the sample; the number of offsets it holds. */
static size_t sample_freeze(struct read_sample *rs)
{
	pthread_mutex_lock(&rs->mu);
	rs->frozen = true;
	size_t n = rs->seen < READ_SAMPLE ? rs->seen : READ_SAMPLE;
	pthread_mutex_unlock(&rs->mu);
	return n;
}

/* The figures of several probe pairs: the median of those solved from
 * two budgets (else of the single-budget ones), each figure apart. */
static size_t probe_median(const struct probe_fit *f, uint32_t n, double *iops, double *layer_s, double *verify_spb)
{
	double a[PLAN_PASSES], b[PLAN_PASSES], c[PLAN_PASSES];
	size_t na = 0, nc = 0, n_solved = 0;
	for (uint32_t i = 0; i < n; i++)
		n_solved += f[i].solved;
	for (uint32_t i = 0; i < n; i++) {
		if (f[i].iops > 0 && (f[i].solved || !n_solved)) {
			a[na] = f[i].iops;
			b[na++] = f[i].layer_s;
		}
		if (f[i].verify_spb > 0)
			c[nc++] = f[i].verify_spb;
	}
	if (na) {
		*iops = nf_plan_median(a, na);
		*layer_s = nf_plan_median(b, na);
	}
	if (nc)
		*verify_spb = nf_plan_median(c, nc);
	return na;
}

/* The device, the kernels and the engine's own read rate, measured on
 * the store as the runs will find it: after the calibration has read it
 * (a virtual disk whose host caches what was read lately answers ten
 * times faster than one read cold: measured first, the curve was the cold
 * one, and the predictions a third of the runs'), before the relayout
 * writes it whole (the minute after that write met a drained device).
 * A shared device's speed moves from minute to minute (on the 2-vCPU
 * virtual machine the same plan's runs moved 1.7x within ten minutes, and
 * one 12-second curve read 160 MB/s at 4 KiB where the runs met 250), so
 * the read curve is measured in PLAN_PASSES passes, each followed by a
 * pair of engine probes, and every figure is the median over the passes.
 * Without --remeasure the earlier plan's curve and rates are kept; the
 * engine is probed anyway. */
static int measure_step(const struct nf_plan_opts *o, struct nf_store_plan *old, struct nf_store_plan *np,
			uint64_t overhead, const uint64_t *budgets, const int32_t *ids, size_t n_ids, uint32_t n_layer,
			bool q4_0_vec_dot, struct read_sample *rs, double *iops, double *layer_s, double *verify_spb,
			struct nf_diag *d)
{
	struct nf_store *s = NULL;
	struct nf_store_plan pass[PLAN_PASSES] = { 0 };
	const struct nf_store_plan *pp[PLAN_PASSES];
	struct probe_fit fit[PLAN_PASSES];
	struct probe_state ps = { 0 };
	uint32_t n_fit = 0;
	double t0 = now_s(), t_dev = 0;   /* t_dev: the device's and kernels' passes alone */
	bool reuse = old && old->n_points && old->n_rates && !o->remeasure;
	int rc = 0;
	*iops = *layer_s = 0;
	*verify_spb = nf_plan_verify_s_per_byte();
	if (reuse) {
		np->points = old->points, np->n_points = old->n_points;
		np->rates = old->rates, np->n_rates = old->n_rates;
		np->mem_read_gb_s = old->mem_read_gb_s;
		np->created_ns = old->created_ns;
		old->points = NULL, old->rates = NULL;
		logf_(o, "device and kernels as measured before (--remeasure measures again)");
	} else if ((rc = nf_store_open(o->store, NULL, &s, d)) < 0) {
		return rc;
	}
	struct nf_plan_device_opts dop = o->device;
	dop.q4_0_vec_dot = q4_0_vec_dot;
	dop.n_threads = o->n_threads;
	dop.progress = o->progress;
	dop.seconds = o->device.seconds / PLAN_PASSES;
	size_t n_at = sample_freeze(rs);
	if (!reuse && !dop.offsets && n_at >= 256) {
		dop.offsets = rs->off;
		dop.n_offsets = n_at;
		logf_(o, "device reads at %zu offsets the calibration read (of its %llu reads), where decode's will go",
		      n_at, (unsigned long long)rs->seen);
	}
	bool can_probe = n_ids >= PROBE_TOKENS && n_layer;
	if (can_probe)
		ids += n_ids - PROBE_TOKENS;
	for (uint32_t k = 0; k < PLAN_PASSES; k++) {
		if (!reuse) {
			double t1 = now_s();
			if ((rc = nf_plan_measure_reads(s, &dop, &pass[k], d)) < 0)
				goto out;
			t_dev += now_s() - t1;
			pp[k] = &pass[k];
			logf_(o, "device, pass %u of %u: 4 KiB reads %.0f MB/s at queue depth 32, 1 MiB %.0f MB/s at 8",
			      k + 1, PLAN_PASSES, nf_plan_device_mb_s(&pass[k], 4096, 32),
			      nf_plan_device_mb_s(&pass[k], 1 << 20, 8));
		}
		if (can_probe && probe_pair(o, overhead, budgets, ids, n_layer, &ps, &fit[n_fit]) == 0)
			n_fit++;
		else
			can_probe = false;  /* it will not run this time either */
	}
	free(ps.b);
	ps.b = NULL;
	size_t n_used = probe_median(fit, n_fit, iops, layer_s, verify_spb);
	if (n_used)
		logf_(o, "engine probe, median of %zu of %u pairs%s: %.0f reads/s, %.2f ms a layer beside them, "
			 "crc32c checks at %.1f GB/s",
		      n_used, n_fit, n_used < n_fit ? " (those solved from two budgets)" : "", *iops, *layer_s * 1e3,
		      *verify_spb > 0 ? 1e-9 / *verify_spb : 0.0);
	if (reuse)
		return 0;
	double t1 = now_s();
	if ((rc = nf_plan_points_median(pp, PLAN_PASSES, np)) < 0 ||
	    (rc = nf_plan_measure_kernels(s, &dop, np, d)) < 0)
		goto out;
	t_dev += now_s() - t1;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	np->created_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	logf_(o, "device and kernels measured in %.1f s (%.1f s with the engine probes): 4 KiB reads %.0f MB/s at "
		 "queue depth 32, 1 MiB %.0f MB/s at 8 (medians of %u passes); memory read %.1f GB/s",
	      t_dev, now_s() - t0, nf_plan_device_mb_s(np, 4096, 32), nf_plan_device_mb_s(np, 1 << 20, 8), PLAN_PASSES,
	      np->mem_read_gb_s);
out:
	free(ps.b);
	for (uint32_t k = 0; k < PLAN_PASSES; k++)
		free(pass[k].points);
	nf_store_close(s);
	if (rc == -ENOMEM)
		rc = nf_diag_fail(d, rc, "plan: out of memory");
	return rc;
}

int nf_plan_run(const struct nf_plan_opts *o, struct nf_store_plan **out, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	struct nf_store_plan *old = NULL, *np = NULL;
	struct nf_engine *cal = NULL;
	struct budget_plan *bp = NULL;
	uint32_t **order = NULL, n_obj = 0;
	struct replay rp = { 0 };
	int32_t *ids = NULL;
	uint64_t *budgets = NULL, *cut_slots = NULL;
	uint32_t n_cut_slots = 0;
	struct read_sample *rs = NULL;
	struct nf_sampler *smp = NULL;
	int rc;
	*out = NULL;
	if (!o->store || !o->n_budgets)
		return nf_diag_fail(d, NF_EUSAGE, "plan: a store and at least one --memory-budget are required");
	/* what a run of the engine holds before it allocates: this process
	 * now, before it measures and calibrates */
	uint64_t overhead = o->overhead ? o->overhead : nf_engine_overhead_now();
	if ((rc = nf_store_open(o->store, NULL, &s, d)) < 0)
		return rc;
	if (!(np = calloc(1, sizeof(*np))) || !(budgets = malloc(o->n_budgets * sizeof(uint64_t))) ||
	    !(bp = calloc(o->n_budgets, sizeof(*bp)))) {
		rc = nf_diag_fail(d, -ENOMEM, "plan: out of memory");
		goto out;
	}
	memcpy(budgets, o->budgets, o->n_budgets * sizeof(uint64_t));
	qsort(budgets, o->n_budgets, sizeof(uint64_t), cmp_u64);
	if (nf_store_has_plan(s)) {
		struct nf_diag od = { 0 };
		int orc = nf_store_plan_read(s, &old, &od);
		if (orc < 0)
			logf_(o, "warning: %s; the earlier plans are dropped", nf_diag_msg(&od, orc));
	}
	nf_store_close(s);
	s = NULL;

	/* the hot sets of the smaller budgets, as the engine sizes them: the
	 * layout is cut at each (nf_coact_order_cuts), so every budget's
	 * misses fall in chained parts, not among the neurons only a larger
	 * budget keeps hot, which a single head leaves in count order */
	if (!(cut_slots = calloc(o->n_budgets, sizeof(uint64_t)))) {
		rc = nf_diag_fail(d, -ENOMEM, "plan: out of memory");
		goto out;
	}
	for (size_t i = 0; i + 1 < o->n_budgets; i++) {
		struct nf_engine_opts so;
		nf_engine_opts_default(&so);
		so.path = o->store;
		so.budget = budgets[i];
		so.n_threads = o->n_threads;
		so.use_plan = false;
		so.size_only = true;
		so.overhead = overhead;
		struct nf_engine *se = NULL;
		struct nf_diag sd = { 0 };
		if (nf_engine_open(&so, &se, &sd) == 0) {
			struct nf_engine_info si;
			nf_engine_info(se, &si);
			cut_slots[n_cut_slots++] = si.hot_slots;
			nf_engine_close(se);
		}
	}

	/* 1. the model: a calibration run under the largest budget, with the
	 * profile's recording */
	malloc_trim(0);
	struct nf_engine_opts eo;
	nf_engine_opts_default(&eo);
	eo.profile_cuts = cut_slots;
	eo.n_profile_cuts = n_cut_slots;
	eo.path = o->store;
	eo.budget = budgets[o->n_budgets - 1];
	eo.n_threads = o->n_threads;
	eo.profile = true;
	eo.profile_sig_tokens = o->calib_tokens;
	eo.n_ctx = o->calib_tokens + 1;
	eo.use_plan = false;
	eo.overhead = overhead;
	if (!(rs = calloc(1, sizeof(*rs)))) {
		rc = nf_diag_fail(d, -ENOMEM, "plan: out of memory");
		goto out;
	}
	pthread_mutex_init(&rs->mu, NULL);
	rs->rng = 0x2545f4914f6cdd1dull;
	eo.on_read = sample_read;
	eo.on_read_user = rs;
	eo.profile_log = o->log; /* the layout chosen per FFN */
	char why[256];
	eo.budget = calib_budget(&eo, eo.budget, why, sizeof(why));
	if (why[0])
		logf_(o, "%s", why);
	double t0 = now_s();
	if ((rc = nf_engine_open(&eo, &cal, d)) < 0)
		goto out;
	/* the text, then the model's own continuation of it */
	size_t n_gen = o->calib_generate < 0 ? o->calib_tokens - o->calib_tokens / 8 : (size_t)o->calib_generate;
	n_gen = n_gen < o->calib_tokens ? n_gen : o->calib_tokens - 1;
	size_t n_text = 0, n_ids = o->calib_tokens;
	if ((rc = calib_ids(o, cal, n_ids - n_gen, &ids, &n_text, d)) < 0)
		goto out;
	struct nf_ctx *ctx = nf_engine_ctx(cal);
	struct nf_sampler_params spp = nf_sampler_defaults();
	spp.seed = 7;
	if (n_gen && (rc = nf_sampler_open(&spp, nf_model_hparams(nf_engine_model(cal))->n_vocab, &smp)) < 0) {
		rc = nf_diag_fail(d, rc, "plan: calibration sampler: %s", nf_strerror(rc));
		goto out;
	}
	for (size_t i = 0; i < n_ids; i++) {
		if (i >= n_text) {
			ids[i] = nf_sampler_sample(smp, nf_ctx_logits(ctx));
			nf_sampler_accept(smp, ids[i]);
		}
		if ((rc = nf_ctx_eval(ctx, &ids[i], 1)) < 0) {
			rc = nf_diag_fail(d, rc, "%s: calibration token %zu: %s", o->store, i, nf_strerror(rc));
			goto out;
		}
		if (o->progress && o->progress->fn)
			o->progress->fn(o->progress->arg, "calibrating", i + 1, n_ids);
	}
	logf_(o, "%zu calibration tokens in %.1f s (%zu of %s, %zu the model's own continuation)", n_ids,
	      now_s() - t0, n_text, o->calibration ? o->calibration : "the built-in text", n_ids - n_text);
	struct nf_coact_progress cpr = { o->progress ? o->progress->fn : NULL, o->progress ? o->progress->arg : NULL };
	if ((rc = nf_coact_profile_save(cal, n_ids, &cpr, d)) < 0)
		goto out;
	/* 2a. each FFN's layout, as it will be */
	if ((rc = layouts(o, cal, &order, d)) < 0)
		goto out;
	n_obj = nf_store_object_count(nf_engine_store(cal));

	/* 2b. the device and the kernels, as the runs will find them (the
	 * calibration has read the store), and the engine's own read rate,
	 * before the relayout writes the whole store: on a virtual disk the
	 * minute after that write met a drained device (47B Mixtral shape:
	 * the probe took back 11.5K reads a second, the runs minutes later
	 * 63K), and so may a flash device whose write cache is full */
	double engine_iops = 0, layer_s = 0, verify_spb = 0;
	if ((rc = measure_step(o, old, np, overhead, budgets, ids, n_ids,
			       nf_model_hparams(nf_engine_model(cal))->n_layer,
			       nf_model_hparams(nf_engine_model(cal))->powerinfer, rs, &engine_iops, &layer_s,
			       &verify_spb, d)) < 0)
		goto out;

	/* 3. lay the store out now, so that the dry runs below size the
	 * cache for the bundles as they will be (the relayout may pack them
	 * closer); the calibration engine keeps the old file open for the
	 * replay, whose slots are the new layout's already */
	if (o->relayout) {
		t0 = now_s();
		if ((rc = relayout_in_place(o, o->keep_copy, d)) < 0)
			goto out;
		logf_(o, "store laid out in the co-activation order in %.1f s%s", now_s() - t0,
		      o->keep_copy ? " (the old layout kept as .orig)" : "");
	}

	/* 4. every budget: the engine's dry run, then the reads its hot set
	 * and cold segment leave under each gap, replaying the calibration */
	if ((rc = replay_build(cal, order, (uint32_t)n_ids, &rp)) < 0 ||
	    (rc = layout_holdout(o, cal, order, &rp)) < 0) {
		rc = nf_diag_fail(d, rc, "plan: no memory to replay the calibration tokens");
		goto out;
	}
	uint32_t n_layer = nf_model_hparams(nf_engine_model(cal))->n_layer;
	struct nf_cache_geom g;
	nf_cache_geometry(nf_engine_cache(cal), &g);
	uint32_t dense_dtype = nf_model_layer(nf_engine_model(cal), 0)->wq.dtype;
	uint32_t threads = (uint32_t)nf_ctx_n_threads(ctx);
	/* bytes the kernels read per computed neuron: the bundle without
	 * its padding (gate row, up row, down column) */
	double neuron_bytes = g.stride;
	for (uint32_t i = 0; i < n_obj; i++) {
		const struct nf_store_object *ob = nf_store_object_get(nf_engine_store(cal), i);
		if (ob->kind == NF_STORE_KIND_FFN) {
			neuron_bytes = ob->bundle_bytes;
			break;
		}
	}
	/* The settings tried per budget, each through the engine's own dry
	 * run and the calibration replay, the fastest prediction taken:
	 *  - prompt batch sizes: a smaller batch's scratch leaves the cache
	 *    (or pinned attention) more of the budget, at the cost of prefill,
	 *    which the cost model does not weigh;
	 *  - attention as the engine decides, or streamed (its bytes go to
	 *    the cache, every token reads it);
	 *  - the smallest cold segment: the engine's rule, one layer, a
	 *    quarter of one, or its floor (more of the budget hot).
	 * A candidate must predict 1% faster than the one before it to be
	 * taken, so the engine's own choices win ties. */
	const struct cost_in ci = { np, n_layer, g.dtype, dense_dtype, threads, neuron_bytes, engine_iops, layer_s,
				    verify_spb };
	static const uint32_t k_batches[] = { 512, 64, 16 };
	uint32_t quarter = g.n_neurons / 4 > 256 ? g.n_neurons / 4 : 256;
	const int k_colds[] = { -1, 0, (int)quarter, 128 };
	uint32_t n_ok = 0;
	for (uint32_t i = 0; i < o->n_budgets; i++) {
		struct nf_diag bd = { 0 };
		bool found = false, found_windowed = false;
		bool alt_windowed = false;
		uint32_t def_ctx = 0;
		struct {
			uint32_t n_batch;
			struct nf_engine_info info;
		} seen[2 * 3 * 2 * 4];
		uint32_t n_seen = 0;
		for (int cx = 0; cx < 2; cx++)
		for (size_t nb = 0; nb < sizeof(k_batches) / sizeof(k_batches[0]); nb++)
			for (int st = 0; st < 2; st++)
				for (size_t kc = 0; kc < sizeof(k_colds) / sizeof(k_colds[0]); kc++) {
					/* the shorter context only where the engine's
					 * fit streams attention, and only pinned */
					if (cx == 1 && (st == 1 || !found || def_ctx <= SHORT_CTX ||
							!(bp[i].chosen.flags & NF_STORE_PLAN_F_STREAM_ATTN)))
						continue;
					struct variant v = { k_batches[nb], st == 1, k_colds[kc], cx ? SHORT_CTX : 0 };
					struct budget_plan cand = { .budget = budgets[i] };
					struct nf_diag vd = { 0 };
					if ((rc = dry_run(o, overhead, &v, &cand, &vd)) < 0) {
						if (rc != NF_EBUDGET) {
							nf_diag_fail(d, rc, "%s", nf_diag_msg(&vd, rc));
							goto out;
						}
						if (cx == 0 && kc == 0 && st == 0)
							bd = vd;   /* the engine's own choice: its message */
						continue;
					}
					if (cx == 0 && !def_ctx)
						def_ctx = cand.info.n_ctx;
					if (cx == 1 && cand.info.attn_streamed) {
						budget_free(&cand);
						continue;
					}
					/* the same decisions reached another way: replayed already */
					bool dup = false;
					for (uint32_t k = 0; k < n_seen && !dup; k++)
						dup = seen[k].n_batch == v.n_batch &&
						      seen[k].info.n_ctx == cand.info.n_ctx &&
						      seen[k].info.attn_streamed == cand.info.attn_streamed &&
						      seen[k].info.attn_pinned_layers == cand.info.attn_pinned_layers &&
						      seen[k].info.cold_slots == cand.info.cold_slots &&
						      seen[k].info.hot_slots == cand.info.hot_slots;
					if (dup || n_seen == sizeof(seen) / sizeof(seen[0])) {
						budget_free(&cand);
						continue;
					}
					seen[n_seen].n_batch = v.n_batch;
					seen[n_seen++].info = cand.info;
					if ((rc = layer_costs(cal, &rp, &cand)) < 0) {
						budget_free(&cand);
						goto out;
					}
					/* A cold segment smaller than a token's neurons in
					 * its busiest layer (half again, for the tokens
					 * above the mean) splits every token's chunks into
					 * windows, whose cost the model does not weigh: on
					 * the 7B shape at 2 GiB the 128-slot floor tripled
					 * the FFN compute (7.2 s against 2.6 s for 24
					 * tokens) and halved the speed the replay
					 * favoured it for. Such a candidate is taken only
					 * when no other fits. */
					double busiest = 0;
					for (uint32_t l = 0; l < n_layer; l++)
						busiest = cand.active[l] > busiest ? cand.active[l] : busiest;
					bool windowed = cand.info.cold_slots && cand.info.cold_slots < 1.5 * busiest;
					struct nf_store_plan_entry e;
					choose(&ci, &cand, &e);
					e.n_batch = k_batches[nb];
					if (cx == 1) {
						budget_free(&cand);
						bool better = !bp[i].has_alt ||
							      (windowed == alt_windowed
								       ? e.t_token_s < bp[i].alt.t_token_s * 0.99
								       : !windowed);
						if (better) {
							bp[i].alt = e;
							bp[i].has_alt = true;
							alt_windowed = windowed;
						}
						continue;
					}
					bool better = !found || (windowed == found_windowed
									 ? e.t_token_s < bp[i].chosen.t_token_s * 0.99
									 : !windowed);
					if (better) {
						/* its figures stay for the stream probe's
						 * second prediction (measure_stream) */
						budget_free(&bp[i]);
						bp[i].info = cand.info;
						bp[i].dense_bytes = cand.dense_bytes;
						bp[i].attn_stream_bytes = cand.attn_stream_bytes;
						bp[i].active = cand.active;
						bp[i].runs = cand.runs;
						bp[i].bundles = cand.bundles;
						bp[i].chosen = e;
						found = true;
						found_windowed = windowed;
					} else {
						budget_free(&cand);
					}
				}
		/* a budget below the minimum is reported, the others planned */
		if (!found) {
			logf_(o, "not planned: %s", nf_diag_msg(&bd, NF_EBUDGET));
			continue;
		}
		bp[i].budget = budgets[i];
		n_ok++;
	}
	rc = 0;
	if (!n_ok) {
		rc = nf_diag_fail(d, NF_EBUDGET, "%s: no budget could be planned (each is below the minimum)", o->store);
		goto out;
	}
	/* 4a. the layout cut again where the chosen settings' hot sets end,
	 * and written once more: the cuts above are an unplanned run's hot
	 * sets, and a plan's settings (a cold segment smaller than the
	 * engine's, the KV cache's loan) keep more hot. A hot set past its cut
	 * loads in many small reads, and the neurons it holds split the runs
	 * its misses were chained in: the 7B shape's 2 GiB plan kept 3,056
	 * neurons of each FFN hot where the layout was cut at 1,502, loaded
	 * them in 32,814 reads (641 at its own cut) and decoded 0.92x the
	 * store profiled at that budget. NFLASH_PLAN_RECUT=off skips it. */
	if (o->relayout && recut_on()) {
		uint64_t *hs = calloc(o->n_budgets, sizeof(*hs));
		uint32_t n_hs = 0;
		if (!hs) {
			rc = nf_diag_fail(d, -ENOMEM, "plan: out of memory");
			goto out;
		}
		for (uint32_t i = 0; i < o->n_budgets; i++)
			if (bp[i].budget && bp[i].chosen.hot_slots)
				hs[n_hs++] = bp[i].chosen.hot_slots;
		if (n_hs) {
			t0 = now_s();
			bool same = false;
			if ((rc = nf_coact_profile_recut(cal, n_ids, hs, n_hs, &cpr, d)) < 0 ||
			    (rc = laid_out_so(o->store, &same, d)) < 0 ||
			    (!same && (rc = relayout_in_place(o, false, d)) < 0)) {
				free(hs);
				goto out;
			}
			if (same)
				logf_(o, "the layout cut at the %u chosen hot sets is the store's already", n_hs);
			else
				logf_(o, "store laid out again, its layout cut at the %u chosen hot sets, in %.1f s",
				      n_hs, now_s() - t0);
		}
		free(hs);
	}
	nf_engine_close(cal);
	cal = NULL;

	/* 4b. the choices the model does not weigh, measured */
	bool gate_rows = has_gate_rows(o->store);
	if (n_ids >= PROBE_TOKENS)
		for (uint32_t i = 0; i < o->n_budgets; i++) {
			if (!bp[i].budget || (i && budgets[i] == budgets[i - 1]))
				continue;
			struct stream_meas sm = { 0 };
			if ((rc = measure_context(o, overhead, ids + n_ids - PROBE_TOKENS, &bp[i], &sm, d)) < 0)
				goto out;
			if ((rc = measure_gap(o, overhead, ids + n_ids - PROBE_TOKENS, &ci, &bp[i], &sm, d)) < 0)
				goto out;
			if ((rc = measure_stream(o, overhead, ids + n_ids - PROBE_TOKENS, &ci, &bp[i], &sm)) < 0) {
				rc = nf_diag_fail(d, rc, "%s: probing a decode under %.1f MiB", o->store,
						  (double)bp[i].budget / 1048576.0);
				goto out;
			}
			if ((rc = measure_choices(o, overhead, g.n_expert > 1, gate_rows, ids + n_ids - PROBE_TOKENS,
						  &bp[i].chosen, d)) < 0)
				goto out;
		}

	/* 5. choose and predict; keep earlier plans for other budgets */
	uint32_t n_keep = 0;
	for (uint32_t i = 0; old && i < old->n_entries; i++) {
		bool replaced = false;
		for (uint32_t k = 0; k < o->n_budgets; k++)
			replaced |= old->entries[i].budget == budgets[k];
		n_keep += !replaced;
	}
	np->entries = calloc(n_keep + o->n_budgets, sizeof(*np->entries));
	if (!np->entries) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t i = 0; i < o->n_budgets; i++) {
		if (!bp[i].budget || (i && budgets[i] == budgets[i - 1]))
			continue;
		np->entries[np->n_entries++] = bp[i].chosen;
	}
	for (uint32_t i = 0; old && i < old->n_entries; i++) {
		bool replaced = false;
		for (uint32_t k = 0; k < o->n_budgets; k++)
			replaced |= old->entries[i].budget == budgets[k];
		if (!replaced)
			np->entries[np->n_entries++] = old->entries[i];
	}
	/* ascending budgets */
	for (uint32_t i = 1; i < np->n_entries; i++)
		for (uint32_t k = i; k > 0 && np->entries[k].budget < np->entries[k - 1].budget; k--) {
			struct nf_store_plan_entry t = np->entries[k];
			np->entries[k] = np->entries[k - 1];
			np->entries[k - 1] = t;
		}
	if ((rc = nf_store_update_plan(o->store, NULL, np, d)) < 0)
		goto out;
	*out = np;
	np = NULL;
	rc = 0;
out:
	replay_free(&rp);
	for (uint32_t i = 0; order && i < n_obj; i++)
		free(order[i]);
	free(order);
	for (uint32_t i = 0; bp && i < o->n_budgets; i++)
		budget_free(&bp[i]);
	free(bp);
	free(budgets);
	free(ids);
	nf_sampler_close(smp);
	nf_engine_close(cal);
	free(cut_slots);
	if (rs) {
		pthread_mutex_destroy(&rs->mu);
		free(rs);
	}
	nf_store_close(s);
	nf_store_plan_free(old);
	nf_store_plan_free(np);
	return rc;
}
