/*
 * test_compute_engine.c - the library entry point (nflash/engine.h): a
 * budget is a limit, not a reservation; the context is fitted to it when
 * none is given; the stated minimum is exact; the KV cache is f16 by
 * default; planned and unplanned engines give the same bits.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/cache.h"
#include "nflash/coact.h"
#include "nflash/dtype.h"
#include "nflash/engine.h"
#include "nflash/kernels.h"
#include "nflash/model.h"
#include "nflash/sampler.h"
#include "nflash/sparse.h"
#include "nflash/store.h"
#include "nflash/stream.h"
#include "util_pipeline.h"
#include "util_ref.h"

#define MODELS "../shared/testdata/models/"

static char gguf[256], store[256];

static void make_model(uint32_t n_ctx)
{
	pl_make_wide_model("engine", n_ctx, gguf, store, sizeof(gguf));
}

static void drop_model(void)
{
	unlink(gguf);
	unlink(store);
}

static uint64_t store_ffn_bytes(const char *path)
{
	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(path, NULL, &s, &d), 0, "%s", d.msg);
	uint64_t all = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_FFN)
			all += (uint64_t)ob->n_bundles * ob->stride;
	}
	nf_store_close(s);
	return all;
}

static int open_engine(const char *path, uint64_t budget, uint32_t n_ctx, struct nf_engine **e,
		       struct nf_diag *d)
{
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.path = path;
	o.budget = budget;
	o.n_ctx = n_ctx;
	o.n_threads = 2;
	memset(d, 0, sizeof(*d));
	return nf_engine_open(&o, e, d);
}

/* Options opening the test store with a context of n_ctx on two threads. */
static void store_opts(struct nf_engine_opts *o, uint32_t n_ctx)
{
	nf_engine_opts_default(o);
	o->path = store;
	o->n_ctx = n_ctx;
	o->n_threads = 2;
}

/* The "at least X MiB" of a budget error, in bytes (rounded up to whole
 * KiB as printed with one decimal of MiB: the caller adds a margin). */
static double stated_min_mib(const char *msg)
{
	const char *p = strstr(msg, "at least ");
	cr_assert(p, "no minimum in: %s", msg);
	return strtod(p + 9, NULL);
}

Test(engine, kv_cache_is_f16_by_default_and_the_context_is_the_models)
{
	struct nf_engine *e;
	struct nf_diag d;
	int rc = open_engine(MODELS "tiny-llama-q8_0.gguf", 0, 0, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	const struct nf_model_hparams *hp = nf_model_hparams(nf_engine_model(e));
	cr_expect_eq(info.n_ctx, hp->n_ctx_train);
	cr_expect(!info.n_ctx_fitted);
	cr_expect_eq(nf_engine_opts(e)->kv_type, NF_KV_F16);
	/* 2 (K and V) x layers x ctx x kv dim x 2 bytes, each buffer on whole pages */
	uint64_t buf = (uint64_t)info.n_ctx * (hp->n_embd / hp->n_head * hp->n_head_kv) * 2;
	uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
	uint64_t kv = 2ull * hp->n_layer * ((buf + pg - 1) / pg * pg);
	cr_expect_eq(nf_ctx_bytes_kv(nf_engine_ctx(e)), kv);
	nf_engine_close(e);
}

Test(engine, budget_is_a_limit_not_a_reservation, .fini = drop_model)
{
	make_model(256);
	uint64_t ffn = store_ffn_bytes(store);
	struct nf_engine *e;
	struct nf_diag d;
	/* far more than the model: the arena holds the FFN bundles, not 1T */
	int rc = open_engine(store, 1ull << 40, 0, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	cr_expect(info.arena <= ffn + (64ull << 20), "arena %llu for %llu bytes of FFN bundles",
		  (unsigned long long)info.arena, (unsigned long long)ffn);
	cr_expect(nf_engine_vm_hwm() < (2ull << 30), "VmHWM %llu", (unsigned long long)nf_engine_vm_hwm());
	nf_engine_close(e);
	/* no budget: the same, not twice the FFN */
	rc = open_engine(store, 0, 0, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	nf_engine_info(e, &info);
	cr_expect(info.arena <= ffn + (64ull << 20), "arena %llu for %llu bytes of FFN bundles",
		  (unsigned long long)info.arena, (unsigned long long)ffn);
	nf_engine_close(e);
}

Test(engine, context_fitted_to_the_budget_when_not_given, .fini = drop_model)
{
	/* a long training context: its KV cache alone would take the budget */
	make_model(32768);
	struct nf_engine *e;
	struct nf_diag d;
	int rc = open_engine(store, 160ull << 20, 0, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	cr_expect(info.n_ctx_fitted);
	cr_expect(info.n_ctx >= NF_ENGINE_MIN_CTX && info.n_ctx < 32768, "n_ctx %u", info.n_ctx);
	cr_expect((info.n_ctx & (info.n_ctx - 1)) == 0, "n_ctx %u is not a power of two", info.n_ctx);
	/* the loan is in both the arena and the KV cache reserved */
	cr_expect(info.weights + info.arena + info.attn_buffers + info.reserved + info.overhead <=
		  info.budget + info.kv_lent);
	/* the fitted engine runs */
	int32_t ids[] = { 1, 278, 263, 13 };
	cr_expect_eq(nf_ctx_eval(nf_engine_ctx(e), ids, 4), 0);
	nf_engine_close(e);
	/* a -c given is kept, and a budget it does not fit is refused naming -c */
	rc = open_engine(store, 160ull << 20, 32768, &e, &d);
	cr_expect_eq(rc, NF_EBUDGET, "%s", nf_diag_msg(&d, rc));
	cr_expect(strstr(d.msg, "-c 32768") != NULL, "%s", d.msg);
}

/* The file's text, whole (the caller frees it). */
static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f, "%s", path);
	static char buf[1 << 16];
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	return strdup(buf);
}

/*
 * Under a budget the KV cache's unwritten part is lent to the hot segment
 * and given back as the context fills (docs/PIPELINE.md "The KV cache
 * fills"): a prompt that fills the context runs within the budget, in a
 * fresh process, with the logits of a run without a budget, bit for bit.
 */
Test(engine, kv_loan_is_given_back_as_the_context_fills, .fini = drop_model)
{
	if (access(PL_NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built", PL_NFLASH);
	make_model(2048);
	static char ids[16384], args[20000], out[1 << 16], err[1 << 16];
	size_t at = 0;
	for (int i = 0; i < 2040; i++)
		at += (size_t)snprintf(ids + at, sizeof(ids) - at, "%s%d", i ? "," : "", 1 + (i * 37) % 250);
	char la[256], lb[256];
	pl_tmp_path(la, sizeof(la), "loan-a");
	pl_tmp_path(lb, sizeof(lb), "loan-b");
	snprintf(args, sizeof(args), "eval -m %s --ids %s -c 2048 -b 256 -t 2 --logits %s", store, ids, la);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 0, "%s", err);
	snprintf(args, sizeof(args), "eval -m %s --ids 1,2 -c 2048 -t 2 --memory-budget 4M", store);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 1, "%s", err);
	/* room beyond the minimum for a loan's lasting cost, less than the
	 * FFN: the cache is the budget's */
	unsigned long long budget = (unsigned long long)((stated_min_mib(err) + 6.0) * 1048576.0);
	cr_assert(budget < store_ffn_bytes(store), "%llu", budget);
	snprintf(args, sizeof(args), "eval -m %s --ids %s -c 2048 -b 256 -t 2 --memory-budget %llu --json --logits %s",
		 store, ids, budget, lb);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 0, "%s", err);
	cr_expect(strstr(err, "on the KV cache's unwritten") != NULL, "no loan: %s", err);
	cr_expect(pl_json_u64(out, "kv_lent_bytes") > (2ull << 20), "%s", out);
	/* all of it given back: the context is full */
	cr_expect_eq(pl_json_u64(out, "hot_slots_on_loan"), 0, "%s", out);
	unsigned long long hwm = pl_json_u64(out, "vm_hwm_bytes");
	cr_expect(hwm <= budget, "VmHWM %llu > budget %llu", hwm, budget);
	char *a = slurp(la), *b = slurp(lb);
	cr_expect_str_eq(a, b, "logits differ with the loan");
	free(a);
	free(b);
	unlink(la);
	unlink(lb);
}

/* The minimum, as a user meets it: fresh processes, so the fixed overhead
 * (the resident set at open) is the same in each. */
Test(engine, stated_minimum_runs_and_a_mebibyte_less_is_refused, .fini = drop_model)
{
	if (access(PL_NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built", PL_NFLASH);
	make_model(256);
	static char out[1 << 16], err[1 << 16];
	char args[1024];
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13 -c 128 -t 2 --memory-budget 4M --json", store);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 1, "%s", err);
	double min_mib = stated_min_mib(err);
	/* the message rounds to 0.1 MiB: 0.1 MiB more runs, and stays within */
	unsigned long long min = (unsigned long long)((min_mib + 0.1) * 1048576.0);
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13 -c 128 -t 2 --memory-budget %llu --json", store,
		 min);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 0, "%.1f MiB stated, refused: %s",
		     min_mib, err);
	unsigned long long hwm = pl_json_u64(out, "vm_hwm_bytes");
	cr_expect(hwm <= min, "VmHWM %llu > budget %llu", hwm, min);
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13 -c 128 -t 2 --memory-budget %llu --json", store,
		 min - (1ull << 20));
	cr_expect_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 1, "1 MiB below the minimum ran: %s",
		     err);
	cr_expect(strstr(err, "at least") != NULL, "%s", err);
}

Test(engine, bad_options_name_the_flag)
{
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	struct nf_engine *e;
	struct nf_diag d = { 0 };
	cr_expect_eq(nf_engine_open(&o, &e, &d), NF_EUSAGE);
	cr_expect(strstr(d.msg, "-m") != NULL, "%s", d.msg);
	o.path = MODELS "tiny-llama-q8_0.gguf";
	o.stream_attn = true;
	memset(&d, 0, sizeof(d));
	cr_expect_eq(nf_engine_open(&o, &e, &d), NF_EUSAGE);
	cr_expect(strstr(d.msg, "--stream-attn") != NULL, "%s", d.msg);
	o.stream_attn = false;
	o.path = "/nonexistent/model.gguf";
	memset(&d, 0, sizeof(d));
	cr_expect_lt(nf_engine_open(&o, &e, &d), 0);
	cr_expect(strstr(d.msg, "/nonexistent/model.gguf") != NULL, "%s", d.msg);
}

/* Any budget at or above the true minimum runs, in every mode: the cold
 * segment shrinks by itself (as --cold-slots does by hand), with the same
 * output. */
Test(engine, cold_segment_shrinks_to_fit_the_budget_in_exact_mode, .fini = drop_model)
{
	make_model(256);
	struct nf_engine_opts o;
	store_opts(&o, 64);
	o.sparse_mode = NF_SPARSE_EXACT;
	o.overhead = 24ull << 20; /* a fresh process's, not this test's */
	o.budget = 4ull << 20;
	struct nf_engine *e;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, NF_EBUDGET, "%s", nf_diag_msg(&d, rc));
	double min_mib = stated_min_mib(d.msg);
	cr_expect(strstr(d.msg, "smallest cold segment") != NULL, "%s", d.msg);
	o.budget = (uint64_t)((min_mib + 0.1) * 1048576.0);
	memset(&d, 0, sizeof(d));
	rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, 0, "%.1f MiB stated, refused: %s", min_mib, nf_diag_msg(&d, rc));
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	const struct nf_model_hparams *hp = nf_model_hparams(nf_engine_model(e));
	cr_expect(info.cold_slots < hp->n_ff, "cold %u slots: not shrunk", info.cold_slots);
	cr_expect(info.weights + info.arena + info.attn_buffers + info.reserved + info.overhead <= o.budget);
	uint32_t nv = hp->n_vocab;
	float *a = malloc(nv * sizeof(float)), *b = malloc(nv * sizeof(float));
	int32_t ga[4], gb[4];
	pl_run(nf_engine_ctx(e), pl_prompt, 8, a, ga, 4);
	nf_engine_close(e);
	/* the same engine without a budget: a whole layer cold */
	o.budget = 0;
	rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	pl_run(nf_engine_ctx(e), pl_prompt, 8, b, gb, 4);
	nf_engine_close(e);
	cr_expect(!memcmp(a, b, nv * sizeof(float)), "a shrunk cold segment changed the logits");
	cr_expect(!memcmp(ga, gb, sizeof(ga)));
	free(a);
	free(b);
	/* 1 MiB below the minimum is refused */
	o.budget = (uint64_t)((min_mib + 0.1) * 1048576.0) - (1ull << 20);
	memset(&d, 0, sizeof(d));
	cr_expect_eq(nf_engine_open(&o, &e, &d), NF_EBUDGET);
}

/* Online re-planning: a hot set that no longer fits the text (here: the
 * profile's counts turned upside down, the hot set made of the coldest
 * neurons) is corrected between tokens by moving neurons from the cold
 * segment to the hot one, with the same bits as a run that does not. */
static double hot_share_of(struct nf_engine *e, const int32_t *ids, size_t n, int32_t *out_ids, float *last)
{
	struct nf_ctx *ctx = nf_engine_ctx(e);
	struct nf_cache *c = nf_engine_cache(e);
	uint32_t nv = nf_model_hparams(nf_engine_model(e))->n_vocab;
	struct nf_cache_stats a, b;
	nf_ctx_reset(ctx);
	cr_assert_eq(nf_ctx_eval(ctx, ids, 8), 0);
	int32_t id = 0;
	struct nf_cache_stats w0, w1;
	nf_cache_stats_get(c, &w0);
	char line[512];
	size_t at = 0;
	for (size_t i = 0; i < n; i++) {
		if (i == n / 2)
			nf_cache_stats_get(c, &a);
		id = nf_sampler_argmax(nf_ctx_logits(ctx), nv);
		out_ids[i] = id;
		cr_assert_eq(nf_ctx_eval(ctx, &id, 1), 0);
		if ((i + 1) % 16 == 0) {
			/* the hot hit rate of each 16 tokens, for the record */
			nf_cache_stats_get(c, &w1);
			uint64_t lk = w1.lookups - w0.lookups;
			at += (size_t)snprintf(line + at, sizeof(line) - at, " %.3f",
					       lk ? (double)(w1.hits_hot - w0.hits_hot) / (double)lk : 0.0);
			w0 = w1;
		}
	}
	cr_log_info("hot hit rate per 16 tokens:%s", line);
	nf_cache_stats_get(c, &b);
	memcpy(last, nf_ctx_logits(ctx), nv * sizeof(float));
	uint64_t look = b.lookups - a.lookups;
	return look ? (double)(b.hits_hot - a.hits_hot) / (double)look : 0;
}

/* A calibration run (nf_engine_opts.profile) of the wide model under 80
 * MiB (with the kernel allowance, 5 MiB, and the load's tables); its
 * options in *o. */
static struct nf_engine *open_calibration(struct nf_engine_opts *o)
{
	make_model(256);
	store_opts(o, 224);
	o->overhead = 24ull << 20;
	o->budget = 80ull << 20;
	o->profile = true;
	struct nf_engine *e;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(o, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	return e;
}

/*
 * A calibration run in predictor mode records the predictor's hidden layer
 * of every token (nf_sparse_pred_record), and from it each neuron's place
 * among the others (nf_coact_ffn_vec: unit rows, or zeros); the profile it
 * saves holds a layout that is a permutation. A run without --profile
 * records nothing.
 */
Test(engine, calibration_records_the_predictors_hidden_layer, .fini = drop_model)
{
	struct nf_engine_opts o;
	struct nf_engine *e = open_calibration(&o);
	struct nf_diag d = { 0 };
	int rc;
	cr_assert_eq(nf_sparse_mode_of(nf_engine_sparse(e)), NF_SPARSE_PREDICTOR);
	int32_t calib[24];
	for (int i = 0; i < 24; i++)
		calib[i] = 3 + (i * 37) % 300;
	cr_assert_eq(nf_ctx_eval(nf_engine_ctx(e), calib, 16), 0);
	for (int i = 16; i < 24; i++)
		cr_assert_eq(nf_ctx_eval(nf_engine_ctx(e), &calib[i], 1), 0);
	const struct nf_model_hparams *hp = nf_model_hparams(nf_engine_model(e));
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		uint64_t n = 0;
		const double *sum = NULL, *sq = NULL;
		uint32_t r = nf_sparse_pred_record(nf_engine_sparse(e), il, 0, &n, &sum, &sq);
		cr_assert_gt(r, 0, "layer %u: nothing recorded", il);
		cr_assert_eq(n, 24, "layer %u: %llu tokens recorded", il, (unsigned long long)n);
		double moved = 0;
		for (uint32_t i = 0; i < r; i++) {
			cr_assert_geq(sum[i], 0.0, "ReLU's output is never negative");
			cr_assert_geq(sq[(size_t)i * r + i], 0.0);
			cr_assert_float_eq(sq[(size_t)i * r + (r - 1 - i)], sq[(size_t)(r - 1 - i) * r + i], 1e-9);
			moved += sq[(size_t)i * r + i] - sum[i] * sum[i] / (double)n;
		}
		cr_assert_gt(moved, 0.0, "layer %u: the hidden layer never moved", il);
		uint32_t dim = 0;
		float *vec = nf_coact_ffn_vec(e, il, 0, &dim);
		cr_assert_not_null(vec);
		cr_assert_eq(dim, r);
		uint32_t units = 0;
		for (uint32_t j = 0; j < hp->n_ff; j++) {
			double nn = 0;
			for (uint32_t k = 0; k < dim; k++)
				nn += (double)vec[(size_t)j * dim + k] * vec[(size_t)j * dim + k];
			cr_assert(nn < 1e-12 || fabs(nn - 1.0) < 1e-5, "neuron %u: |vec|^2 = %g", j, nn);
			units += nn > 0.5;
		}
		cr_assert_gt(units, hp->n_ff / 2, "layer %u: %u of %u neurons placed", il, units, hp->n_ff);
		free(vec);
	}
	cr_assert_eq(nf_coact_profile_save(e, 24, NULL, &d), 0, "%s", d.msg);
	nf_engine_close(e);
	struct nf_store *s;
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_store_profile *p = NULL;
	cr_assert_eq(nf_store_profile_read(s, &p, &d), 0, "%s", d.msg);
	cr_assert_not_null(p->order);
	for (uint32_t i = 0; i < p->n_objects; i++)
		if (p->counts[i])
			cr_assert(nf_store_profile_order_valid(p->order[i], p->lens[i]), "object %u", i);
	nf_store_profile_free(p);
	nf_store_close(s);

	/* a run that is not a calibration records nothing */
	o.profile = false;
	rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	cr_assert_eq(nf_ctx_eval(nf_engine_ctx(e), calib, 4), 0);
	uint64_t n = 0;
	const double *sum = NULL, *sq = NULL;
	cr_assert_eq(nf_sparse_pred_record(nf_engine_sparse(e), 0, 0, &n, &sum, &sq), 0);
	uint32_t dim = 0;
	cr_assert_null(nf_coact_ffn_vec(e, 0, 0, &dim));
	nf_engine_close(e);
}

/* (count desc, id asc): the hot set's order (nflash/coact.h) */
static bool hotter(const uint32_t *cnt, uint32_t a, uint32_t b)
{
	return cnt[a] != cnt[b] ? cnt[a] > cnt[b] : a < b;
}

/*
 * nf_coact_profile_recut cuts the layout at each hot set given: for every
 * one, each FFN's first slots (its share, nf_cache_hot_quota) hold exactly
 * the neurons a hot set of that size loads, so it loads as a prefix and
 * its misses fall in the chained parts after it. What nf_coact_profile_save
 * gave (the calibration budget's own head) is not cut there.
 */
Test(engine, a_recut_layout_puts_each_hot_set_first, .fini = drop_model)
{
	struct nf_engine_opts o;
	struct nf_engine *e = open_calibration(&o);
	struct nf_diag d = { 0 };
	int32_t calib[32];
	for (int i = 0; i < 32; i++)
		calib[i] = 3 + (i * 53) % 300;
	cr_assert_eq(nf_ctx_eval(nf_engine_ctx(e), calib, 32), 0);
	struct nf_cache_geom g;
	nf_cache_geometry(nf_engine_cache(e), &g);
	uint64_t all = (uint64_t)g.n_layer * g.n_neurons;
	/* two hot sets, neither the calibration budget's own */
	uint64_t cuts[2] = { all * 3 / 5, all / 7 };
	cr_expect_eq(nf_coact_profile_recut(e, 32, cuts, 0, NULL, &d), NF_EUSAGE);
	cr_assert_eq(nf_coact_profile_recut(e, 32, cuts, 2, NULL, &d), 0, "%s", d.msg);
	uint32_t *quota = calloc((size_t)g.n_layer * g.n_expert * 2, sizeof(uint32_t));
	cr_assert_not_null(quota);
	cr_assert_eq(nf_cache_hot_quota(nf_engine_cache(e), cuts[0], quota), 0);
	cr_assert_eq(nf_cache_hot_quota(nf_engine_cache(e), cuts[1], quota + g.n_layer * g.n_expert), 0);
	nf_engine_close(e);

	struct nf_store *s;
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_store_profile *p = NULL;
	cr_assert_eq(nf_store_profile_read(s, &p, &d), 0, "%s", d.msg);
	cr_assert_not_null(p->order);
	uint32_t checked = 0, inside = 0;
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (!p->counts[i])
			continue;
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		const uint32_t *cnt = p->counts[i], *ord = p->order[i];
		uint32_t n = p->lens[i];
		cr_assert(nf_store_profile_order_valid(ord, n), "object %u", i);
		for (int k = 0; k < 2; k++) {
			uint32_t q = quota[k * g.n_layer * g.n_expert + ob->layer * g.n_expert + ob->expert];
			cr_assert_leq(q, n);
			inside += q > 0 && q < n;
			/* the prefix's last (in hot order) is hotter than the rest's first */
			uint32_t worst = q ? ord[0] : 0, best = q < n ? ord[q] : 0;
			for (uint32_t r = 1; r < q; r++)
				worst = hotter(cnt, worst, ord[r]) ? ord[r] : worst;
			for (uint32_t r = q + 1; r < n; r++)
				best = hotter(cnt, ord[r], best) ? ord[r] : best;
			if (q && q < n)
				cr_expect(hotter(cnt, worst, best),
					  "object %u, cut %d at %u of %u: neuron %u (%u firings) in the prefix, %u (%u) after it",
					  i, k, q, n, worst, cnt[worst], best, cnt[best]);
			checked++;
		}
	}
	cr_expect_gt(checked, 0);
	cr_expect_gt(inside, 0, "no cut fell inside an FFN");
	nf_store_profile_free(p);
	nf_store_close(s);
	free(quota);
}

Test(engine, online_replanning_recovers_a_wrong_hot_set_with_the_same_bits, .fini = drop_model)
{
	struct nf_engine_opts o;
	struct nf_engine *e = open_calibration(&o);
	struct nf_diag d = { 0 };
	int rc;
	int32_t calib[32];
	for (int i = 0; i < 32; i++)
		calib[i] = 3 + (i * 37) % 300;
	cr_assert_eq(nf_ctx_eval(nf_engine_ctx(e), calib, 32), 0);
	cr_assert_eq(nf_coact_profile_save(e, 32, NULL, &d), 0, "%s", d.msg);
	nf_engine_close(e);
	/* turn the counts upside down: the hot set becomes the coldest neurons */
	struct nf_store *s;
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_store_profile *p = NULL;
	cr_assert_eq(nf_store_profile_read(s, &p, &d), 0, "%s", d.msg);
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (p->order) {
			free(p->order[i]);
			p->order[i] = NULL;
		}
		uint32_t mx = 0;
		for (uint32_t j = 0; p->counts[i] && j < p->lens[i]; j++)
			mx = p->counts[i][j] > mx ? p->counts[i][j] : mx;
		for (uint32_t j = 0; p->counts[i] && j < p->lens[i]; j++)
			p->counts[i][j] = mx - p->counts[i][j];
	}
	free(p->order);
	p->order = NULL;
	nf_store_close(s);
	cr_assert_eq(nf_store_update_profile(store, NULL, p, &d), 0, "%s", d.msg);
	nf_store_profile_free(p);

	o.profile = false;
	int32_t ids_off[192], ids_on[192];
	uint32_t nv = 0;
	float *l_off = NULL, *l_on = NULL;
	double share[2];
	for (int on = 0; on < 2; on++) {
		o.replan_moves = on ? 4096 : 0;
		memset(&d, 0, sizeof(d));
		rc = nf_engine_open(&o, &e, &d);
		cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
		if (!nv) {
			nv = nf_model_hparams(nf_engine_model(e))->n_vocab;
			l_off = malloc(nv * sizeof(float));
			l_on = malloc(nv * sizeof(float));
		}
		share[on] = hot_share_of(e, pl_prompt, 192, on ? ids_on : ids_off, on ? l_on : l_off);
		struct nf_cache_stats cs;
		nf_cache_stats_get(nf_engine_cache(e), &cs);
		if (on)
			cr_expect(cs.promotions > 0, "no neuron was promoted");
		else
			cr_expect_eq(cs.promotions, 0);
		nf_engine_close(e);
	}
	cr_expect(!memcmp(ids_off, ids_on, sizeof(ids_on)), "re-planning changed the greedy ids");
	cr_expect(!memcmp(l_off, l_on, nv * sizeof(float)), "re-planning changed the logits");
	cr_expect(share[1] > share[0] + 0.05, "hot hit rate over the last 96 tokens: %.3f without re-planning, %.3f with",
		  share[0], share[1]);
	free(l_off);
	free(l_on);
}

/* A K-quant store (Q4_K_M: Q4_K and Q6_K downs) under the smallest budget
 * the engine states: the cold segment keeps one chunk of whole 256-neuron
 * super-blocks (nf_sparse_min_cold_slots) and is still less than a layer,
 * and the logits are llama.cpp's (F32 KV cache, as the reference). */
Test(engine, kquant_store_under_the_smallest_budget)
{
	const char *kgguf = "../shared/testdata/kquant/tiny-llama-q4_k_m.gguf";
	struct nf_ref r;
	if (nf_ref_load("../shared/testdata/kquant/tiny-llama-q4_k_m.ref.txt", &r, NULL) < 0)
		cr_skip_test("no ../shared/testdata/kquant");
	char sp[256];
	pl_import(kgguf, sp, sizeof(sp));
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.path = sp;
	o.n_ctx = 64;
	o.n_threads = 2;
	o.kv_type = NF_KV_F32;
	o.overhead = 24ull << 20;
	o.budget = 4ull << 20;
	struct nf_engine *e;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, NF_EBUDGET, "%s", nf_diag_msg(&d, rc));
	o.budget = (uint64_t)((stated_min_mib(d.msg) + 0.1) * 1048576.0);
	memset(&d, 0, sizeof(d));
	rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	const struct nf_model_hparams *hp = nf_model_hparams(nf_engine_model(e));
	cr_expect(info.cold_slots >= 319 && info.cold_slots < hp->n_ff, "cold %u slots", info.cold_slots);
	float *lg = malloc(hp->n_vocab * sizeof(float));
	int32_t g[8];
	pl_run(nf_engine_ctx(e), r.input, r.n_input, lg, g, 8);
	double md = pl_max_diff(r.logits, lg, hp->n_vocab);
	cr_expect(md <= 1e-3, "%.3g off llama.cpp", md);
	cr_expect(!memcmp(g, r.greedy, sizeof(g)), "greedy ids differ from llama.cpp's");
	nf_engine_close(e);
	free(lg);
	unlink(sp);
	nf_ref_free(&r);
}

/*
 * One decode step of many sequences (nf_ctx_eval_seqs): three sequences,
 * each its own KV cache, decoded together as one batch through the
 * engine's context, give the logits each gives alone (nf_ctx_eval), bit
 * for bit, and the cache is asked for each layer's union of their neurons
 * once (fewer lookups than the three one after the other). With attention
 * in memory and streamed (only the engine's context has a stream).
 */
#define SEQS 3
#define SEQ_STEPS 6

static uint32_t argmax(const float *v, uint32_t n)
{
	uint32_t b = 0;
	for (uint32_t i = 1; i < n; i++)
		if (v[i] > v[b])
			b = i;
	return b;
}

/* Prompts, then SEQ_STEPS greedy tokens of every sequence, batched or
 * one sequence at a time; logits of every step into lg; cache lookups
 * of the decode steps returned. */
static uint64_t run_seqs(struct nf_engine *e, struct nf_ctx **seq, bool batched, float *lg, uint32_t nv)
{
	static const int32_t prompts[SEQS][5] = { { 1, 15, 200, 7, 99 }, { 1, 300, 42 }, { 1, 8, 8, 120 } };
	static const size_t lens[SEQS] = { 5, 3, 4 };
	struct nf_ctx *host = nf_engine_ctx(e);
	struct nf_ctx *rows[8];
	int32_t ids[SEQS];
	for (int s = 0; s < SEQS; s++) {
		nf_ctx_reset(seq[s]);
		for (size_t i = 0; i < lens[s]; i++)
			rows[i] = seq[s];
		cr_assert_eq(nf_ctx_eval_seqs(host, rows, prompts[s], lens[s]), 0);
		ids[s] = (int32_t)argmax(nf_ctx_logits(seq[s]), nv);
	}
	struct nf_cache_stats c0, c1;
	nf_cache_stats_get(nf_engine_cache(e), &c0);
	for (int t = 0; t < SEQ_STEPS; t++) {
		if (batched) {
			cr_assert_eq(nf_ctx_eval_seqs(host, seq, ids, SEQS), 0);
		} else {
			for (int s = 0; s < SEQS; s++)
				cr_assert_eq(seq[s] == host ? nf_ctx_eval(host, &ids[s], 1) :
							      nf_ctx_eval_seqs(host, &seq[s], &ids[s], 1), 0);
		}
		for (int s = 0; s < SEQS; s++) {
			memcpy(lg + ((size_t)t * SEQS + s) * nv, nf_ctx_logits(seq[s]), nv * sizeof(float));
			ids[s] = (int32_t)argmax(nf_ctx_logits(seq[s]), nv);
			cr_assert_eq(nf_ctx_n_past(seq[s]), lens[s] + (size_t)t + 1);
		}
	}
	nf_cache_stats_get(nf_engine_cache(e), &c1);
	return c1.lookups - c0.lookups;
}

Test(engine, decode_step_of_many_sequences_equals_each_alone, .fini = drop_model, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	make_model(256);
	for (int streamed = 0; streamed < 2; streamed++) {
		struct nf_engine_opts o;
		store_opts(&o, 64);
		o.stream_attn = streamed;
		o.replan_moves = 0;    /* the hot set stays put between the two runs */
		struct nf_engine *e;
		struct nf_diag d = { 0 };
		int rc = nf_engine_open(&o, &e, &d);
		cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
		struct nf_engine_info ei;
		nf_engine_info(e, &ei);
		cr_assert_eq(ei.attn_streamed, streamed);
		struct nf_ctx *host = nf_engine_ctx(e), *seq[SEQS] = { host };
		struct nf_ctx_params cp = nf_ctx_defaults();
		cp.n_ctx = nf_ctx_n_ctx(host);
		cp.n_batch = 1;
		cp.n_threads = 1;
		cp.kv_type = (enum nf_kv_type)nf_engine_opts(e)->kv_type;
		for (int s = 1; s < SEQS; s++)
			cr_assert_eq(nf_ctx_open(nf_engine_model(e), &cp, &seq[s], &d), 0, "%s", d.msg);
		uint32_t nv = nf_model_hparams(nf_engine_model(e))->n_vocab;
		size_t n = (size_t)SEQ_STEPS * SEQS * nv;
		float *alone = malloc(n * sizeof(float)), *together = malloc(n * sizeof(float));
		cr_assert(alone && together);
		uint64_t l_alone = run_seqs(e, seq, false, alone, nv);
		uint64_t l_together = run_seqs(e, seq, true, together, nv);
		cr_expect_eq(memcmp(alone, together, n * sizeof(float)), 0,
			     "a batched decode step differs from the sequences alone (attention %s)",
			     streamed ? "streamed" : "in memory");
		cr_expect_lt(l_together, l_alone, "the batch did not ask for the union of its neurons once");
		/* one sequence's tokens over its context: nothing runs */
		struct nf_ctx *rows[64];
		int32_t ids[64];
		for (int i = 0; i < 64; i++) {
			rows[i] = i == 0 ? seq[0] : seq[1];
			ids[i] = 1;
		}
		cr_expect_eq(nf_ctx_eval_seqs(host, rows, ids, 64), NF_EBUDGET);
		cr_expect_eq(nf_ctx_n_past(seq[0]), 5 + SEQ_STEPS, "a sequence advanced in a refused step");
		cr_expect_eq(nf_ctx_n_past(seq[1]), 3 + SEQ_STEPS, "a sequence advanced in a refused step");
		free(alone);
		free(together);
		for (int s = 1; s < SEQS; s++)
			nf_ctx_close(seq[s]);
		nf_engine_close(e);
	}
}

/* Compute reaches the store through one door: the model's cache holds
 * the dense weights (pinned segment), gets the FFN segments from the
 * engine, and the streamed attention reads through it. */
Test(engine, one_door_the_models_cache_serves_dense_ffn_and_streamed_attention, .fini = drop_model)
{
	make_model(64);
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.path = store;
	o.n_ctx = 64;
	o.n_threads = 2;
	o.stream_attn = true;
	struct nf_engine *e;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(&o, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_cache *c = nf_engine_cache(e);
	cr_assert_not_null(c);
	cr_expect_eq(c, nf_model_cache(nf_engine_model(e)), "the engine opened a second cache");
	struct nf_cache_layout cl;
	nf_cache_layout_get(c, &cl);
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	cr_expect(info.attn_streamed);
	/* every dense object but attention (streamed) and the token embedding
	 * (its rows read per step: the output matrix is its own), and the
	 * metadata, pinned */
	struct nf_store *s = nf_model_store(nf_engine_model(e));
	cr_expect(nf_model_embd_in_store(nf_engine_model(e)));
	uint64_t want = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		bool attn = strstr(ob->name, ".attn_") && !strstr(ob->name, ".attn_norm");
		if (ob->kind != NF_STORE_KIND_FFN && !attn && strcmp(ob->name, "token_embd.weight"))
			want += (nf_store_object_buf_size(ob, nf_cache_align(c)) + 4095) / 4096 * 4096;
	}
	cr_expect_eq(cl.pinned_used, want, "pinned %llu bytes, dense objects %llu", (unsigned long long)cl.pinned_used,
		     (unsigned long long)want);
	int32_t ids[4] = { 1, 278, 263, 13 };
	cr_assert_eq(nf_ctx_eval(nf_engine_ctx(e), ids, 4), 0);
	struct nf_stream_stats as;
	cr_assert(nf_ctx_attn_stats(nf_engine_ctx(e), &as));
	struct nf_cache_stats cs;
	nf_cache_stats_get(c, &cs);
	cr_expect(as.bytes_read > 0 && cs.lookups > 0, "attention read %llu bytes, %llu FFN lookups",
		  (unsigned long long)as.bytes_read, (unsigned long long)cs.lookups);
	nf_engine_close(e);
}

/* What the engine says its pinned dense weights take is what the store's
 * dense objects take: every one of them is pinned, the QCOL down scales
 * objects (n_embd x n_ff/32 f16 per FFN, 896 MiB on a Mixtral shape) as
 * much as attention, so a budget counts them; all but the token embedding
 * of an untied output, whose rows are read per step. */
Test(engine, weights_count_every_pinned_dense_object, .timeout = 60 * NF_TEST_SLOWDOWN)
{
	char g[256], st[256];
	pl_tmp_path(g, sizeof(g), "eng-pinned.gguf");
	cr_assert_eq(pl_synth_tiny_moe(g, "relu", NF_DTYPE_Q4_0, true, 4), 0);
	pl_import(g, st, sizeof(st));
	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(st, NULL, &s, &d), 0, "%s", d.msg);
	uint64_t dense = 0, scales = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_DENSE ||
		    (!strcmp(ob->name, "token_embd.weight") && nf_store_object_find(s, "output.weight")))
			continue;
		dense += ob->length;
		if (strstr(ob->name, ".down_scales"))
			scales += ob->length;
	}
	nf_store_close(s);
	cr_assert(scales > 0, "the tiny Q4_0 mixture should import with QCOL down scales");
	struct nf_engine *e;
	int rc = open_engine(st, 1ull << 30, 64, &e, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	cr_expect(!info.attn_streamed);
	cr_expect_eq(info.weights, dense, "weights %llu, the store's dense objects %llu (scales %llu)",
		     (unsigned long long)info.weights, (unsigned long long)dense, (unsigned long long)scales);
	nf_engine_close(e);
	unlink(g);
	unlink(st);
}

/* A store's pinned attention and output go into the kernels' 8-row groups
 * where they lie (nf_model_repack in place): the same bits as the plain
 * rows (--repack off), batched and token by token, and no more memory. */
static void check_store_repacked(const char *gguf_path, const char *stem)
{
	char st[256];
	pl_import(gguf_path, st, sizeof(st));
	struct nf_engine *e[2];
	struct nf_diag d = { 0 };
	for (int k = 0; k < 2; k++) {
		struct nf_engine_opts o;
		nf_engine_opts_default(&o);
		o.path = st;
		o.budget = 1ull << 30;
		o.n_ctx = 64;
		o.n_threads = 2;
		o.no_repack = k == 1;
		int rc = nf_engine_open(&o, &e[k], &d);
		cr_assert_eq(rc, 0, "%s: %s", stem, nf_diag_msg(&d, rc));
	}
	const struct nf_weight *wq = &nf_model_layer(nf_engine_model(e[0]), 0)->wq;
	bool kernels = nf_kernels_get()->gemv_x8[wq->kt] != NULL;
	cr_expect_eq(wq->packed, kernels, "%s: wq packed %d, the table has 8-row kernels: %d", stem, wq->packed,
		     kernels);
	cr_expect(!nf_model_layer(nf_engine_model(e[1]), 0)->wq.packed, "%s: --repack off packed wq", stem);
	struct nf_engine_info ia, ib;
	nf_engine_info(e[0], &ia);
	nf_engine_info(e[1], &ib);
	cr_expect_eq(ia.weights, ib.weights, "%s: repacking changed the weights' bytes", stem);
	uint32_t nv = nf_model_hparams(nf_engine_model(e[0]))->n_vocab;
	float *la = malloc(nv * sizeof(float)), *lb = malloc(nv * sizeof(float));
	cr_assert(la && lb);
	int32_t ids[6] = { 1, 27, 26, 13, 45, 29 };
	for (int step = 0; step < 3; step++) {
		/* a batch of 4, then two single tokens */
		const int32_t *at = step == 0 ? ids : ids + 3 + step;
		size_t n = step == 0 ? 4 : 1;
		for (int k = 0; k < 2; k++) {
			int rc = nf_ctx_eval(nf_engine_ctx(e[k]), at, n);
			cr_assert_eq(rc, 0, "%s: eval: %d", stem, rc);
			memcpy(k ? lb : la, nf_ctx_logits(nf_engine_ctx(e[k])), nv * sizeof(float));
		}
		for (uint32_t i = 0; i < nv; i++)
			cr_assert(!memcmp(&la[i], &lb[i], sizeof(float)), "%s step %d logit %u: packed %.9g, plain %.9g",
				  stem, step, i, la[i], lb[i]);
	}
	free(la);
	free(lb);
	nf_engine_close(e[0]);
	nf_engine_close(e[1]);
	unlink(st);
}

Test(engine, store_pinned_matrices_in_8_row_groups_same_bits, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	char g[256];
	pl_tmp_path(g, sizeof(g), "eng-repack.gguf");
	cr_assert_eq(pl_synth_tiny(g, "relu", NF_DTYPE_Q4_0, true), 0);
	check_store_repacked(g, "tiny q4_0 synth");
	unlink(g);
	const char *kq = "../shared/testdata/kquant/tiny-llama-q4_k_m.gguf";
	if (access(kq, R_OK) == 0)
		check_store_repacked(kq, "tiny-llama-q4_k_m");
}
