/*
 * test_pipeline_profile.c - activation profiles end to end on a tiny
 * synthetic ReLU model with a predictor: `generate --profile` stores the
 * counts and the co-activation layout planned from the run in the store;
 * `store relayout` writes a copy in that layout (hot first) whose
 * store-backed output equals the original store's and the GGUF's (logits
 * within 1e-5, same greedy ids); the cache preloads the hot set from the
 * profile at open, in fewer and larger reads from the relayouted copy,
 * and learns it online without one; a scrambled profile over QCOL bundles
 * (regular llama Q4_0, exact mode) keeps the output, through the cache and
 * unpacked.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/bundle.h"
#include "nflash/cache.h"
#include "nflash/dtype.h"
#include "nflash/model.h"
#include "nflash/sparse.h"
#include "nflash/store.h"
#include "util_pipeline.h"
#include "util_storage.h"

int nf_cmd_generate(int argc, char **argv);

#define TOL 1e-5
#define NG 8

/* Logits after pl_prompt and NG greedy ids: in memory (cache NULL) or
 * through a cache of arena bytes over the model's store. */
static void run_model(const char *path, uint64_t arena, float *lg, int32_t *greedy,
		      struct nf_cache_stats *cs_open, struct nf_cache_layout *cl)
{
	struct nf_model *m = pl_load(path, true, arena == 1);   /* 1: a store unpacked into memory */
	struct nf_ctx *c = pl_open_ctx(m, 2);
	struct nf_sparse_params sp;
	nf_sparse_params_init(&sp);
	struct nf_cache *cache = NULL;
	struct nf_diag d = { 0 };
	if (nf_model_store(m) && arena > 1) {
		struct nf_cache_opts o;
		nf_cache_opts_default(&o);
		o.arena_bytes = arena;
		o.io.quiet = true;
		int rc = nf_cache_open(nf_model_store(m), &o, &cache, &d);
		cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
		nf_cache_stats_get(cache, cs_open);
		nf_cache_layout_get(cache, cl);
		sp.cache = cache;
	}
	struct nf_sparse *s = NULL;
	cr_assert_eq(nf_sparse_open(c, &sp, &s, &d), 0, "%s", d.msg);
	cr_assert(nf_sparse_mode_of(s) == NF_SPARSE_PREDICTOR || nf_sparse_mode_of(s) == NF_SPARSE_EXACT);
	pl_run(c, pl_prompt, 8, lg, greedy, NG);
	nf_sparse_close(s);
	nf_cache_close(cache);
	nf_ctx_close(c);
	nf_model_free(m);
}

static void cleanup(float *a, float *b, float *c, const char *p0, const char *p1, const char *p2)
{
	free(a);
	free(b);
	free(c);
	unlink(p0);
	unlink(p1);
	unlink(p2);
}

Test(pipeline, profile_relayout_same_output_fewer_hot_reads, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	char gguf[256], store[256], hot[256], out[4096];
	pl_tmp_path(gguf, sizeof(gguf), "prof.gguf");
	pl_tmp_path(hot, sizeof(hot), "prof-hot.nfl");
	cr_assert_eq(pl_synth_tiny(gguf, "relu", NF_DTYPE_Q4_0, true), 0);
	pl_import(gguf, store, sizeof(store));

	/* calibration on other tokens than the comparison's prompt */
	char *argv[] = { "generate", "-m", store, "--ids", "11,22,33,44,55", "-n", "40", "--temp", "0",
			 "--ignore-eos", "--print-ids", "--memory-budget", "64M", "--profile", NULL };
	int ec = ts_run_cmd(nf_cmd_generate, argv, out, sizeof(out));
	cr_assert_eq(ec, 0, "%s", out);
	cr_assert(strstr(out, "profile of 44 tokens (predictor mode) stored in"), "%s", out);
	cr_assert(strstr(out, "co-activation layout of 2 FFNs planned"), "%s", out);

	struct nf_store *s = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_store_profile *p = NULL;
	cr_assert_eq(nf_store_profile_read(s, &p, &d), 0, "%s", d.msg);
	cr_expect_eq(p->tokens, 44);
	cr_expect_eq(p->source, NF_STORE_PROFILE_PREDICTOR);
	uint32_t n_ffn = 0;
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (!p->counts[i])
			continue;
		n_ffn++;
		uint32_t mx = 0, mn = UINT32_MAX;
		for (uint32_t j = 0; j < p->lens[i]; j++) {
			mx = p->counts[i][j] > mx ? p->counts[i][j] : mx;
			mn = p->counts[i][j] < mn ? p->counts[i][j] : mn;
		}
		cr_expect(mx <= 44 && mx > mn, "object %u: counts in [%u, %u]", i, mn, mx);
		/* the planned layout: a permutation, the most frequent first */
		cr_assert(p->order && p->order[i], "object %u has no co-activation order", i);
		cr_assert(nf_store_profile_order_valid(p->order[i], p->lens[i]));
		cr_expect_eq(p->counts[i][p->order[i][0]], mx, "object %u: slot 0 is not the hottest", i);
	}
	cr_expect_eq(n_ffn, nf_store_info(s)->n_ffn);
	uint64_t min = nf_cache_min_bytes(s);
	nf_store_close(s);

	int rc = nf_store_relayout(store, hot, NULL, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	/* the copy is in that layout */
	cr_assert_eq(nf_store_open(hot, NULL, &s, &d), 0, "%s", d.msg);
	for (uint32_t i = 0; i < p->n_objects; i++)
		for (uint32_t r = 0; p->counts[i] && r < p->lens[i]; r++)
			cr_assert_eq(nf_store_object_get(s, i)->perm[p->order[i][r]], r, "object %u slot %u", i, r);
	nf_store_close(s);
	nf_store_profile_free(p);

	/* same output: GGUF in memory, the store, the hot-first copy; a cache
	 * of three layers' worth, half of it hot */
	struct nf_model *gm = pl_load(gguf, false, false);
	uint32_t nv = nf_model_hparams(gm)->n_vocab;
	nf_model_free(gm);
	float *a = malloc(nv * sizeof(float)), *b = malloc(nv * sizeof(float)), *c = malloc(nv * sizeof(float));
	int32_t ga[NG], gb[NG], gc[NG];
	struct nf_cache_stats sb, sc, x;
	struct nf_cache_layout lb, lc, y;
	run_model(gguf, 0, a, ga, &x, &y);
	run_model(store, 3 * min, b, gb, &sb, &lb);
	run_model(hot, 3 * min, c, gc, &sc, &lc);
	double db = pl_max_diff(a, b, nv), dc = pl_max_diff(a, c, nv), dbc = pl_max_diff(b, c, nv);
	cr_expect(db <= TOL && dc <= TOL && dbc <= TOL, "store %.3g, hot-first %.3g off the GGUF; %.3g apart", db,
		  dc, dbc);
	cr_expect_arr_eq(ga, gb, sizeof(ga));
	cr_expect_arr_eq(ga, gc, sizeof(ga));

	/* the hot set came from the profile, the same bytes, fewer and larger reads */
	cr_expect(lb.hot_from_profile && lc.hot_from_profile);
	cr_expect_eq(sb.hot_bytes, sc.hot_bytes);
	cr_expect_gt(sb.hot_bytes, 0);
	cr_expect_lt(sc.hot_requests * 4, sb.hot_requests, "hot-first: %llu reads, neuron order: %llu",
		     (unsigned long long)sc.hot_requests, (unsigned long long)sb.hot_requests);
	/* one read per layer when a layer's hot set fits one max_coalesce */
	if ((uint64_t)lc.hot_slots * (lc.hot / (lc.hot_slots ? lc.hot_slots : 1)) / 2 <= (1u << 20))
		cr_expect_leq(sc.hot_requests, 2);

	/* without the profile: learned online, nothing loaded at open */
	cr_assert_eq(nf_store_open(hot, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = 3 * min;
	o.io.quiet = true;
	o.use_profile = false;
	struct nf_cache *cache = NULL;
	cr_assert_eq(nf_cache_open(s, &o, &cache, &d), 0, "%s", d.msg);
	nf_cache_layout_get(cache, &y);
	nf_cache_stats_get(cache, &x);
	cr_expect(!y.hot_from_profile);
	cr_expect_eq(x.hot_bytes, 0);
	nf_cache_close(cache);
	nf_store_close(s);

	cleanup(a, b, c, hot, store, gguf);
}

/* A regular llama Q4_0 FFN (QCOL down with its scales object, exact mode)
 * under a scrambled profile, copied at another bundle alignment (512, the
 * import's being 4096): the relayout moves and repacks every bundle, the
 * output stays that of the GGUF, through the cache and unpacked into
 * memory. */
Test(pipeline, profile_relayout_of_qcol_bundles_keeps_exact_output, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	char gguf[256], store[256], hot[256];
	pl_tmp_path(gguf, sizeof(gguf), "prof3.gguf");
	pl_tmp_path(hot, sizeof(hot), "prof3-hot.nfl");
	cr_assert_eq(pl_synth_tiny(gguf, "relu", NF_DTYPE_Q4_0, false), 0);
	pl_import(gguf, store, sizeof(store));
	struct nf_store *s = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_store_profile *p = NULL;
	cr_assert_eq(nf_store_profile_alloc(s, &p), 0);
	bool qcol = false;
	for (uint32_t i = 0; i < p->n_objects; i++) {
		for (uint32_t j = 0; j < p->lens[i]; j++)
			p->counts[i][j] = (j * 2654435761u + i) % 97;
		if (p->counts[i])
			qcol |= nf_store_object_get(s, i)->down_form == NF_DOWN_QCOL;
	}
	uint64_t min = nf_store_info(s)->n_ffn ? nf_cache_min_bytes(s) : 0;
	nf_store_close(s);
	cr_assert(qcol, "the tiny Q4_0 llama model should import with QCOL down parts");
	struct nf_store_relayout_opts o = { .profile = p, .block_size = 512 };
	int rc = nf_store_relayout(store, hot, &o, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	cr_assert_eq(nf_store_open(hot, NULL, &s, &d), 0, "%s", d.msg);
	cr_expect_eq(nf_store_info(s)->block_size, 512u);
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_FFN)
			cr_expect_eq(ob->stride, (ob->bundle_bytes + 511) / 512 * 512, "%s: stride %u", ob->name,
				     ob->stride);
	}
	nf_store_close(s);
	o.block_size = 768;
	char bad[300];
	snprintf(bad, sizeof(bad), "%s.bad", hot);
	cr_expect_eq(nf_store_relayout(store, bad, &o, &d), NF_EUSAGE, "a block size of 768 was taken");
	cr_expect(access(bad, F_OK) != 0);
	nf_store_profile_free(p); /* o.profile, used by both relayouts */

	struct nf_model *gm = pl_load(gguf, false, false);
	uint32_t nv = nf_model_hparams(gm)->n_vocab;
	nf_model_free(gm);
	float *a = malloc(nv * sizeof(float)), *b = malloc(nv * sizeof(float)), *c = malloc(nv * sizeof(float));
	int32_t ga[NG], gb[NG], gc[NG];
	struct nf_cache_stats x;
	struct nf_cache_layout y;
	run_model(gguf, 0, a, ga, &x, &y);
	run_model(hot, 2 * min, b, gb, &x, &y);
	cr_expect(y.hot_from_profile);
	run_model(hot, 1, c, gc, &x, &y);
	double db = pl_max_diff(a, b, nv), dc = pl_max_diff(a, c, nv);
	cr_expect(db <= TOL && dc <= TOL, "hot-first store %.3g (cache), %.3g (unpacked) off the GGUF", db, dc);
	cr_expect_arr_eq(ga, gb, sizeof(ga));
	cr_expect_arr_eq(ga, gc, sizeof(ga));
	cleanup(a, b, c, hot, store, gguf);
}

Test(pipeline, profile_needs_a_store)
{
	char gguf[256], out[4096];
	pl_tmp_path(gguf, sizeof(gguf), "prof2.gguf");
	cr_assert_eq(pl_synth_tiny(gguf, "relu", NF_DTYPE_F32, true), 0);
	char *argv[] = { "generate", "-m", gguf, "--ids", "1,2", "-n", "2", "--profile", NULL };
	int ec = ts_run_cmd(nf_cmd_generate, argv, out, sizeof(out));
	cr_expect_eq(ec, 2, "%s", out);
	cr_expect(strstr(out, "--profile counts the neurons read through a store"), "%s", out);
	unlink(gguf);
}
