/*
 * test_pipeline_moe.c - mixtures of experts run sparsely: each routed
 * expert through the sparse engine as the FFN (layer, expert), in exact
 * mode against the built-in dense MoE FFN and in predictor mode against a
 * dense computation restricted to each expert's predicted set (computed
 * here, in double), in memory and from a store under a budget that forces
 * re-reads; per-expert statistics; a read error during an expert's read.
 * Models: tiny synthetic ReLU mixtures (4 experts, 2 routed).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/cache.h"
#include "nflash/dtype.h"
#include "nflash/model.h"
#include "nflash/sampler.h"
#include "nflash/sparse.h"
#include "nflash/store.h"
#include "util_pipeline.h"

#define EXACT_TOL 1e-5
#define N_EXPERT 4



/* The model at gguf imported into a store (path into sp), the store-backed
 * model loaded, and the smallest cache the store accepts (one FFN of cold
 * slots: every routed expert is read again at every token). */
struct from_store {
	char sp[256];
	struct nf_model *m;
	struct nf_store *store;
	struct nf_cache *cache;
};

static void store_open_with(struct from_store *f, const char *gguf, const struct nf_io_fault_rule *fault,
			    bool gate_objects)
{
	pl_import_with(gguf, f->sp, sizeof(f->sp), gate_objects);
	f->m = pl_load(f->sp, false, false);
	cr_assert(!nf_model_ffn_in_memory(f->m));
	uint64_t min = nf_cache_min_bytes(nf_model_store(f->m));
	f->cache = pl_open_cache(f->sp, &f->store, min, fault, 0);
}

static void store_open(struct from_store *f, const char *gguf, const struct nf_io_fault_rule *fault)
{
	store_open_with(f, gguf, fault, false);
}

static void store_close(struct from_store *f)
{
	nf_cache_close(f->cache);
	nf_store_close(f->store);
	nf_model_free(f->m);
	unlink(f->sp);
}

/* ---- exact mode == the built-in dense MoE FFN ------------------------------------ */

static void check_exact(const char *act, uint32_t dtype)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-exact");
	cr_assert_eq(pl_synth_tiny_moe(p, act, dtype, false, N_EXPERT), 0);
	struct nf_model *m = pl_load(p, true, false);
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	cr_assert_eq(hp->n_expert, N_EXPERT);
	uint32_t nv = hp->n_vocab;
	float *a = malloc(nv * sizeof(float)), *b = malloc(nv * sizeof(float)), *e = malloc(nv * sizeof(float));
	int32_t ga[6], gb[6];
	const char *what = nf_dtype_name(dtype);

	/* the built-in FFN, then the engine's exact mode in memory */
	struct nf_ctx *c = pl_open_ctx(m, 2);
	pl_run(c, pl_prompt, 8, a, ga, 6);
	struct nf_sparse *s = pl_engine(c, NF_SPARSE_AUTO, NULL);
	cr_assert_eq(nf_sparse_mode_of(s), NF_SPARSE_EXACT, "%s %s: auto is not exact for experts", act, what);
	pl_run(c, pl_prompt, 8, e, gb, 6);
	double md = pl_max_diff(a, e, nv);
	cr_expect(md <= EXACT_TOL, "%s %s: exact experts in memory vs the built-in FFN %.3g", act, what, md);
	cr_expect_arr_eq(ga, gb, sizeof(ga), "%s %s: greedy differs in memory", act, what);
	struct nf_sparse_stats st;
	nf_sparse_stats_get(s, &st);
	/* 8 + 5 tokens, each through 2 routed experts per layer, but the
	 * last layer's: the prompt's last token and the 5 (its rows cut to
	 * those whose logits are taken, as llama.cpp) */
	cr_expect_eq(st.ffn_calls, (13ull * (hp->n_layer - 1) + 6) * 2, "%llu expert calls",
		     (unsigned long long)st.ffn_calls);
	nf_sparse_close(s);
	nf_ctx_close(c);

	/* from a store, one FFN of cache: the same bits as in memory */
	struct from_store f;
	store_open(&f, p, NULL);
	c = pl_open_ctx(f.m, 2);
	s = pl_engine(c, NF_SPARSE_EXACT, f.cache);
	pl_run(c, pl_prompt, 8, b, gb, 6);
	cr_expect(!memcmp(b, e, nv * sizeof(float)), "%s %s: exact experts from the store vs in memory %.3g", act,
		  what, pl_max_diff(b, e, nv));
	cr_expect_arr_eq(ga, gb, sizeof(ga), "%s %s: greedy differs from the store", act, what);
	struct nf_cache_stats cs;
	nf_cache_stats_reset(f.cache);
	int32_t id = gb[5];
	cr_assert_eq(nf_ctx_eval(c, &id, 1), 0);
	nf_cache_stats_get(f.cache, &cs);
	cr_expect(cs.misses > 0 && cs.errors == 0, "%s %s: no re-reads under a one-FFN budget", act, what);
	nf_sparse_close(s);
	nf_ctx_close(c);
	store_close(&f);
	free(a);
	free(b);
	free(e);
	nf_model_free(m);
	unlink(p);
}

Test(pipeline_moe, exact_equals_dense)
{
	check_exact("relu", NF_DTYPE_F32);
	check_exact("drelu", NF_DTYPE_F16);
	check_exact("relu", NF_DTYPE_Q8_0);  /* down in the QCOL form */
	check_exact("relu", NF_DTYPE_Q4_K);  /* K-quant QCOL down: ggml's dense order */
}

/* ---- predictor mode == dense restricted to each expert's predicted set ------------ */

/*
 * Per FFN call: the reference (routing as the built-in FFN, then per
 * routed expert its own predictor fc2 . relu(fc1 . resid) >= threshold,
 * and the dense FFN of that expert over the predicted neurons only, every
 * product in double, inputs rounded as the kernels round them), then the
 * engine on the same input; the engine's output goes on. Tolerance
 * relative to the output: where activations are rounded (Q8_0 down) one
 * last-bit difference can move an activation by one step.
 */
struct moe_ref {
	struct nf_ctx *c;
	const struct nf_model *m;
	float threshold;
	const struct nf_ffn_ops *ops;
	void *self;
	float *tmp;
	double worst;
	uint64_t predicted, routed;
	size_t calls;
};

/* Expert e of layer L on token (x, resid) restricted to its predicted set,
 * times w, added into acc (n_embd doubles). */
static void ref_expert(struct moe_ref *R, const struct nf_layer_weights *L, uint32_t e, double w, const float *x,
		       const float *resid, double *acc)
{
	const struct nf_model_hparams *hp = nf_model_hparams(R->m);
	uint32_t E = hp->n_embd, F = hp->n_ff;
	struct nf_weight fc1 = nf_weight_expert(&L->fc1, e), fc2 = nf_weight_expert(&L->fc2, e);
	struct nf_weight g = nf_weight_expert(&L->gate_exps, e), u = nf_weight_expert(&L->up_exps, e);
	struct nf_weight dn = nf_weight_expert(&L->down_exps, e);
	uint32_t rank = fc1.nrows, big = E > F ? E : F;
	float *row = malloc(big * sizeof(float)), *hr = malloc(E * sizeof(float)), *xr = malloc(E * sizeof(float));
	float *h1 = calloc(rank, sizeof(float)), *h1r = malloc(rank * sizeof(float));
	float *a = calloc(F, sizeof(float)), *ar = malloc(F * sizeof(float));
	pl_round_for(fc1.dtype, resid, hr, E);
	for (uint32_t i = 0; i < rank; i++) {
		double v = pl_dotd(&fc1, i, hr, row);
		h1[i] = v > 0 ? (float)v : 0.0f;
	}
	pl_round_for(fc2.dtype, h1, h1r, rank);
	pl_round_for(u.dtype, x, xr, E);
	for (uint32_t j = 0; j < F; j++) {
		if (!(pl_dotd(&fc2, j, h1r, row) >= R->threshold))
			continue;
		R->predicted++;
		double gv = pl_dotd(&g, j, xr, row), uv = pl_dotd(&u, j, xr, row);
		if (hp->act == NF_FFN_DRELU)
			uv = uv > 0 ? uv : 0;
		a[j] = (float)((gv > 0 ? gv : 0) * uv);
	}
	/* the activations as fed to the (regular) down matrix */
	pl_round_for(dn.dtype, a, ar, F);
	for (uint32_t r = 0; r < E; r++)
		acc[r] += w * pl_dotd(&dn, r, ar, row);
	free(row);
	free(hr);
	free(xr);
	free(h1);
	free(h1r);
	free(a);
	free(ar);
}

static int moe_cmp_forward(void *self, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	struct moe_ref *R = self;
	const struct nf_model_hparams *hp = nf_model_hparams(R->m);
	const struct nf_layer_weights *L = nf_model_layer(R->m, io->layer);
	size_t E = hp->n_embd, U = hp->n_expert_used;
	const int32_t *sel;
	const float *w;
	int rc = nf_ctx_moe_route(R->c, io, &sel, &w);
	if (rc < 0)
		return rc;
	double *acc = calloc(E, sizeof(double));
	for (size_t b = 0; b < io->nb; b++) {
		memset(acc, 0, E * sizeof(double));
		for (size_t k = 0; k < U; k++)
			ref_expert(R, L, (uint32_t)sel[b * U + k], w[b * U + k], io->x + b * E, io->resid + b * E, acc);
		for (size_t r = 0; r < E; r++)
			R->tmp[b * E + r] = (float)acc[r];
		R->routed += U;
	}
	free(acc);
	if ((rc = R->ops->forward(R->self, env, io)) < 0)
		return rc;
	double mx = 0, md = 0;
	for (size_t i = 0; i < io->nb * E; i++) {
		mx = fmax(mx, fabs(R->tmp[i]));
		md = fmax(md, fabs((double)R->tmp[i] - io->out[i]));
	}
	R->worst = fmax(R->worst, md / fmax(mx, 1e-30));
	R->calls++;
	return 0;
}

static void check_predictor(uint32_t dtype, double tol)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-pred");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", dtype, true, N_EXPERT), 0);
	struct nf_model *m = pl_load(p, true, false);
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	uint32_t nv = hp->n_vocab, E = hp->n_embd;
	const char *what = nf_dtype_name(dtype);
	cr_assert(nf_model_layer(m, 0)->fc1.data && nf_model_layer(m, 0)->fc1.n_expert == N_EXPERT,
		  "%s: no per-expert predictors bound", what);

	struct nf_ctx *c = pl_open_ctx(m, 2);
	struct nf_sparse *s = pl_engine(c, NF_SPARSE_AUTO, NULL);
	cr_assert_eq(nf_sparse_mode_of(s), NF_SPARSE_PREDICTOR, "%s: auto is not predictor", what);
	struct moe_ref R = { .c = c, .m = m, .threshold = nf_sparse_threshold(s),
			     .tmp = calloc((size_t)64 * E, sizeof(float)) };
	nf_sparse_ffn_ops(s, &R.ops, &R.self);
	static const struct nf_ffn_ops cmp_ops = { .name = "compare", .forward = moe_cmp_forward };
	for (uint32_t il = 0; il < hp->n_layer; il++)
		nf_ctx_set_ffn(c, il, &cmp_ops, &R);
	cr_assert_eq(nf_ctx_eval(c, pl_prompt, 8), 0);
	for (int t = 0; t < 4; t++) {
		int32_t id = nf_sampler_argmax(nf_ctx_logits(c), nv);
		cr_assert_eq(nf_ctx_eval(c, &id, 1), 0);
	}
	cr_expect_eq(R.calls, 5 * hp->n_layer, "%zu calls", R.calls);
	cr_expect(R.worst <= tol, "%s: experts vs dense restricted to each predicted set: %.3g of the output", what,
		  R.worst);
	struct nf_sparse_stats st;
	nf_sparse_stats_get(s, &st);
	cr_expect_eq(st.ffn_calls, R.routed, "%s: %llu expert calls, %llu routed", what,
		     (unsigned long long)st.ffn_calls, (unsigned long long)R.routed);
	cr_expect_eq(st.neurons_active, R.predicted, "%s: engine computed %llu neurons, the reference predicted %llu",
		     what, (unsigned long long)st.neurons_active, (unsigned long long)R.predicted);
	cr_expect(R.predicted > 0 && R.predicted < st.neurons_total / 2, "%s: %llu predicted of %llu", what,
		  (unsigned long long)R.predicted, (unsigned long long)st.neurons_total);
	nf_sparse_close(s);

	/* from a store, one FFN of cache: the same bits as in memory */
	float *a = malloc(nv * sizeof(float)), *b = malloc(nv * sizeof(float));
	int32_t ga[6], gb[6];
	s = pl_engine(c, NF_SPARSE_PREDICTOR, NULL);
	pl_run(c, pl_prompt, 8, a, ga, 6);
	nf_sparse_close(s);
	nf_ctx_close(c);
	struct from_store f;
	store_open(&f, p, NULL);
	c = pl_open_ctx(f.m, 2);
	s = pl_engine(c, NF_SPARSE_AUTO, f.cache);
	cr_expect_eq(nf_sparse_mode_of(s), NF_SPARSE_PREDICTOR, "%s: auto from the store is not predictor", what);
	pl_run(c, pl_prompt, 8, b, gb, 6);
	cr_expect(!memcmp(a, b, nv * sizeof(float)), "%s: predicted experts from the store vs in memory %.3g", what,
		  pl_max_diff(a, b, nv));
	cr_expect_arr_eq(ga, gb, sizeof(ga), "%s: greedy differs from the store", what);
	/* a one-FFN cache holds both routed experts' predicted sets: each
	 * generated token's experts were requested together (the prompt ran
	 * as a batch per expert) */
	nf_sparse_stats_get(s, &st);
	cr_expect(st.moe_together >= 5ull * hp->n_layer, "%s: %llu tokens' experts requested together", what,
		  (unsigned long long)st.moe_together);
	nf_sparse_close(s);
	nf_ctx_close(c);
	store_close(&f);
	free(a);
	free(b);
	free(R.tmp);
	nf_model_free(m);
	unlink(p);
}

Test(pipeline_moe, predictor_equals_dense_restricted_to_predicted_sets)
{
	check_predictor(NF_DTYPE_F32, 1e-4);
	check_predictor(NF_DTYPE_Q8_0, 1e-2);
}

/* ---- per-expert statistics (--stats, --json) ---------------------------------------- */

/* The numbers after each "key": in json from p on, into v (at most n). */
static size_t json_all(const char *p, const char *key, unsigned long long *v, size_t n)
{
	char k[64];
	size_t got = 0;
	snprintf(k, sizeof(k), "\"%s\":", key);
	while (got < n && (p = strstr(p, k)) != NULL) {
		p += strlen(k);
		v[got++] = strtoull(p, NULL, 10);
	}
	return got;
}

Test(pipeline_moe, stats_report_experts)
{
	char p[256], sp[256], cmd[1024];
	static char out[1 << 16], err[1 << 16];
	pl_tmp_path(p, sizeof(p), "moe-stats");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", NF_DTYPE_Q8_0, true, N_EXPERT), 0);
	pl_import(p, sp, sizeof(sp));
	snprintf(cmd, sizeof(cmd), "generate -m %s -p Hello -n 3 --seed 1 --json --stats --route-prefetch on", sp);
	int rc = pl_run_cli(cmd, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "%s\n%s", out, err);
	cr_expect(strstr(err, "layer 0 experts (tokens routed, cache hit rate): e0 ") &&
			  strstr(err, "layer 1 experts"),
		  "--stats: no per-expert lines:\n%s", err);
	/* every token routed to 2 experts in each of the 2 layers; in the
	 * last one, of the prompt only its last token (rows cut as llama.cpp) */
	unsigned long long evals = pl_json_u64(out, "prompt_tokens") + pl_json_u64(out, "gen_evals");
	unsigned long long last = 1 + pl_json_u64(out, "gen_evals");
	const char *xs = strstr(out, "\"experts\":[");
	cr_assert(xs, "--json: no experts array:\n%s", out);
	unsigned long long layer[16], routed[16], lookups[16], hits[16], sum[2] = { 0 }, lk = 0, ht = 0;
	cr_assert_eq(json_all(xs, "layer", layer, 16), 2 * N_EXPERT);
	cr_assert_eq(json_all(xs, "routed", routed, 16), 2 * N_EXPERT);
	cr_assert_eq(json_all(xs, "lookups", lookups, 16), 2 * N_EXPERT);
	cr_assert_eq(json_all(xs, "hits", hits, 16), 2 * N_EXPERT);
	for (size_t i = 0; i < 2 * N_EXPERT; i++) {
		cr_assert_lt(layer[i], 2);
		sum[layer[i]] += routed[i];
		lk += lookups[i];
		ht += hits[i];
		cr_expect(hits[i] <= lookups[i], "expert %zu: %llu hits of %llu", i, hits[i], lookups[i]);
	}
	cr_expect(sum[0] == 2 * evals && sum[1] == 2 * last, "routed %llu, %llu for %llu and %llu tokens", sum[0],
		  sum[1], evals, last);
	/* the experts' lookups and hits add up to the cache's */
	cr_expect_eq(lk, pl_json_u64(out, "lookups"));
	cr_expect_eq(ht, pl_json_u64(out, "lookups") - pl_json_u64(out, "misses"));
	cr_expect(ht > 0 && ht < lk, "hits %llu of %llu", ht, lk);
	/* route-ahead, measured: each generated token's layer 1 experts
	 * guessed from layer 0 (the prompt, a batch, guesses nothing) */
	unsigned long long guesses = pl_json_u64(out, "route_guesses");
	cr_expect_eq(guesses, 2 * pl_json_u64(out, "gen_evals"));
	cr_expect(pl_json_u64(out, "route_guess_hits") <= guesses);
	cr_expect(strstr(err, "route-ahead guess"), "--stats: no route-ahead line:\n%s", err);
	/* route-ahead prefetch on (predictor mode's default is off): every
	 * guess read ahead */
	cr_expect_eq(pl_json_u64(out, "route_prefetches"), guesses);
	/* (found bundles include those a read bridged between two asked for,
	 * counted in gap_bundles) */
	cr_expect(pl_json_u64(out, "route_prefetch_reads") > 0 &&
			  pl_json_u64(out, "route_prefetch_hits") <=
				  pl_json_u64(out, "route_prefetch_neurons") + pl_json_u64(out, "gap_bundles"),
		  "--json: route-ahead prefetch counters:\n%s", out);
	cr_expect(strstr(err, "route-ahead prefetch: "), "--stats: no prefetch line:\n%s", err);
	/* a value that is neither on nor off is refused, naming the flag */
	snprintf(cmd, sizeof(cmd), "generate -m %s -p Hello -n 1 --route-prefetch maybe", sp);
	rc = pl_run_cli(cmd, out, sizeof(out), err, sizeof(err));
	cr_expect(rc != 0 && strstr(err, "--route-prefetch: 'maybe' is neither on nor off"), "%d %s", rc, err);
	unlink(sp);
	unlink(p);
}

/* ---- route-ahead prefetch and gate-first reads ------------------------------------- */

/* An engine on c reading from cache; returns its open result (s set on success). */
static float ahead_min_right; /* nf_sparse_params' (0: the default) */

static int engine_with(struct nf_ctx *c, struct nf_cache *cache, enum nf_sparse_mode mode, bool route_prefetch,
		       bool gate_first, struct nf_sparse **s, char *msg, size_t len)
{
	struct nf_sparse_params sp;
	nf_sparse_params_init(&sp);
	sp.ahead_min_right = ahead_min_right;
	sp.mode = mode;
	sp.cache = cache;
	sp.route_prefetch = route_prefetch;
	sp.gate_first = gate_first;
	struct nf_diag d = { 0 };
	int rc = nf_sparse_open(c, &sp, s, &d);
	snprintf(msg, len, "%s", d.msg);
	return rc;
}

/* The prompt and 5 greedy tokens (6 ids) from a fresh import of gguf under
 * a one-FFN cache (every routed FFN read again at every token). */
struct store_run {
	float *lg;
	int32_t ids[6];
	struct nf_cache_stats cs;
	struct nf_sparse_stats st;
	struct nf_model_hparams hp;
	enum nf_sparse_mode mode;
};

static void run_from_store(const char *gguf, bool gate_objects, bool route_prefetch, bool gate_first,
			   struct store_run *r)
{
	char msg[512];
	struct from_store f;
	store_open_with(&f, gguf, NULL, gate_objects);
	r->hp = *nf_model_hparams(f.m);
	r->lg = malloc(r->hp.n_vocab * sizeof(float));
	struct nf_ctx *c = pl_open_ctx(f.m, 2);
	struct nf_sparse *s = NULL;
	cr_assert_eq(engine_with(c, f.cache, NF_SPARSE_AUTO, route_prefetch, gate_first, &s, msg, sizeof(msg)), 0,
		     "%s", msg);
	r->mode = nf_sparse_mode_of(s);
	pl_run(c, pl_prompt, 8, r->lg, r->ids, 6);
	nf_cache_stats_get(f.cache, &r->cs);
	nf_sparse_stats_get(s, &r->st);
	cr_expect_eq(r->cs.errors, 0);
	nf_sparse_close(s);
	nf_ctx_close(c);
	store_close(&f);
}

/* Runs a and b gave the same bits. */
static void expect_same_run(const struct store_run *a, const struct store_run *b, const char *what)
{
	uint32_t nv = a->hp.n_vocab;
	cr_expect(!memcmp(a->lg, b->lg, nv * sizeof(float)), "%s: logits differ (%.3g)", what,
		  pl_max_diff(a->lg, b->lg, nv));
	cr_expect_arr_eq(a->ids, b->ids, sizeof(a->ids), "%s: greedy ids differ", what);
}

/*
 * With and without reading layer L+1's guessed experts ahead: the same
 * bits (a wrong guess costs reads only), and with it the prefetched reads
 * counted and found by the next layer's requests.
 */
static void check_prefetch(bool predictor, uint32_t dtype)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-pf");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", dtype, predictor, N_EXPERT), 0);
	const char *what = predictor ? "predictor, route-ahead prefetch" : "exact, route-ahead prefetch";
	struct store_run r[2];
	for (int k = 0; k < 2; k++) {
		run_from_store(p, false, k == 1, false, &r[k]);
		cr_assert_eq(r[k].mode, predictor ? NF_SPARSE_PREDICTOR : NF_SPARSE_EXACT);
		cr_assert_gt(r[k].st.route_guesses, 0);
	}
	const struct nf_cache_stats *cs = &r[1].cs;
	cr_expect(r[0].cs.prefetch_requests == 0 && r[0].st.route_prefetches == 0, "%s: prefetched while off", what);
	/* every guess (each decode token, layers 1..) read ahead */
	cr_expect_eq(r[1].st.route_prefetches, r[1].st.route_guesses, "%s: %llu experts prefetched, %llu guessed", what,
		     (unsigned long long)r[1].st.route_prefetches, (unsigned long long)r[1].st.route_guesses);
	/* (found bundles include those a read bridged between two asked for,
	 * counted in gap_bundles) */
	cr_expect(cs->prefetch_requests > 0 && cs->prefetch_hits > 0 && cs->prefetch_hits <= cs->hits_cold &&
			  cs->prefetch_hits <= cs->prefetch_neurons + cs->gap_bundles &&
			  cs->prefetch_bytes <= cs->bytes_read,
		  "%s: %llu prefetch reads of %llu bundles, %llu found", what, (unsigned long long)cs->prefetch_requests,
		  (unsigned long long)cs->prefetch_neurons, (unsigned long long)cs->prefetch_hits);
	cr_log_info("%s: %llu/%llu guessed, %llu of %llu prefetched bundles found", what,
		    (unsigned long long)r[1].st.route_guess_hits, (unsigned long long)r[1].st.route_guesses,
		    (unsigned long long)cs->prefetch_hits, (unsigned long long)cs->prefetch_neurons);
	expect_same_run(&r[0], &r[1], what);
	free(r[0].lg);
	free(r[1].lg);
	unlink(p);
}

Test(pipeline_moe, route_prefetch_keeps_the_bits_and_is_counted)
{
	check_prefetch(true, NF_DTYPE_Q8_0);
	check_prefetch(false, NF_DTYPE_F32);
}

/*
 * A dense FFN in predictor mode from a store: with and without reading
 * layer L+1's predicted neurons ahead (layer-ahead), the same bits, and
 * with it every decode layer but the last read ahead, counted, and found
 * by the next layer's requests. Exact mode never reads ahead (it has no
 * guess).
 */
static void check_layer_ahead(uint32_t dtype)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "dense-la");
	cr_assert_eq(pl_synth_tiny(p, "relu", dtype, true), 0);
	char what[64];
	snprintf(what, sizeof(what), "dense %s, layer-ahead", nf_dtype_name(dtype));
	struct store_run r[2];
	for (int k = 0; k < 2; k++) {
		run_from_store(p, false, k == 1, false, &r[k]);
		cr_assert_eq(r[k].mode, NF_SPARSE_PREDICTOR);
	}
	const struct nf_cache_stats *cs = &r[1].cs;
	cr_expect(r[0].cs.prefetch_requests == 0 && r[0].st.route_prefetches == 0, "%s: read ahead while off", what);
	/* 5 decode tokens (the prompt is one batch, never read ahead), each
	 * layer but the last */
	uint64_t want = 5ull * (r[1].hp.n_layer - 1);
	cr_expect_eq(r[1].st.route_prefetches, want, "%s: %llu layers read ahead, want %llu", what,
		     (unsigned long long)r[1].st.route_prefetches, (unsigned long long)want);
	/* (found bundles include those a read bridged between two asked for) */
	cr_expect(cs->prefetch_requests > 0 && cs->prefetch_hits > 0 && cs->prefetch_hits <= cs->hits_cold &&
			  cs->prefetch_bytes <= cs->bytes_read,
		  "%s: %llu prefetch reads of %llu bundles, %llu found", what, (unsigned long long)cs->prefetch_requests,
		  (unsigned long long)cs->prefetch_neurons, (unsigned long long)cs->prefetch_hits);
	cr_log_info("%s: %llu bundles found of %llu asked for; %llu of %llu guessed neurons computed", what,
		    (unsigned long long)cs->prefetch_hits, (unsigned long long)cs->prefetch_neurons,
		    (unsigned long long)r[1].st.ahead_right, (unsigned long long)r[1].st.ahead_guessed);
	cr_expect(!r[1].st.ahead_stopped, "%s: stopped", what);
	expect_same_run(&r[0], &r[1], what);
	free(r[0].lg);
	free(r[1].lg);
	unlink(p);
}

Test(pipeline_moe, layer_ahead_keeps_the_bits_and_is_counted)
{
	check_layer_ahead(NF_DTYPE_Q8_0);
	check_layer_ahead(NF_DTYPE_Q4_0);
}

/*
 * Layer-ahead checks each guess against the masks of the layer it was made
 * for, and stops for good after NF_SPARSE_AHEAD_WARM tokens' guesses when
 * too few of the guessed neurons were computed: asked for more than all of
 * them (ahead_min_right 1.5), it reads ahead for 4 of the 5 decode tokens,
 * says it stopped, and the bits stay those of a run without it.
 */
Test(pipeline_moe, layer_ahead_stops_when_its_guesses_are_wrong)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "dense-la-stop");
	cr_assert_eq(pl_synth_tiny(p, "relu", NF_DTYPE_Q8_0, true), 0);
	struct store_run r[2];
	run_from_store(p, false, false, false, &r[0]);
	ahead_min_right = 1.5f;
	run_from_store(p, false, true, false, &r[1]);
	ahead_min_right = 0.0f;
	uint32_t nl = r[1].hp.n_layer;
	cr_expect_eq(r[1].st.route_prefetches, (uint64_t)NF_SPARSE_AHEAD_WARM * (nl - 1), "%llu layers read ahead",
		     (unsigned long long)r[1].st.route_prefetches);
	cr_expect(r[1].st.ahead_stopped, "layer-ahead did not stop");
	cr_expect(!r[0].st.ahead_stopped && r[0].st.ahead_guessed == 0, "off, yet guessed");
	/* each guessed layer was checked: the counts add up */
	cr_expect(r[1].st.ahead_guessed > 0 && r[1].st.ahead_right <= r[1].st.ahead_guessed &&
			  r[1].st.ahead_right <= r[1].st.ahead_needed,
		  "guessed %llu, right %llu, needed %llu", (unsigned long long)r[1].st.ahead_guessed,
		  (unsigned long long)r[1].st.ahead_right, (unsigned long long)r[1].st.ahead_needed);
	expect_same_run(&r[0], &r[1], "layer-ahead stopped");
	free(r[0].lg);
	free(r[1].lg);
	unlink(p);
}

/*
 * A read that bridges gaps takes cold slots for the bundles between the
 * misses. With a token's routed experts requested together under the
 * smallest cold segment (one FFN), the first expert's bridged reads once
 * took the slots the second expert's misses needed, and decode failed
 * with "memory budget too small" (the 47B Mixtral shape under 4 GiB with
 * the plan's read gap 16). Now the later experts' slots are reserved: any
 * gap gives the bits of gap 0, in predictor mode (where the experts go
 * together) and in exact mode.
 */
static void run_with_gap(const char *gguf, uint32_t gap, struct store_run *r)
{
	char msg[512], sp[256];
	pl_import_with(gguf, sp, sizeof(sp), false);
	struct nf_model *m = pl_load(sp, false, false);
	struct nf_store *st = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(sp, NULL, &st, &d), 0, "%s", d.msg);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = nf_cache_min_bytes(nf_model_store(m));
	o.max_gap = gap;
	o.io.quiet = true;
	struct nf_cache *cache = NULL;
	cr_assert_eq(nf_cache_open(st, &o, &cache, &d), 0, "%s", d.msg);
	r->hp = *nf_model_hparams(m);
	r->lg = malloc(r->hp.n_vocab * sizeof(float));
	struct nf_ctx *c = pl_open_ctx(m, 2);
	struct nf_sparse *s = NULL;
	cr_assert_eq(engine_with(c, cache, NF_SPARSE_AUTO, false, false, &s, msg, sizeof(msg)), 0, "%s", msg);
	r->mode = nf_sparse_mode_of(s);
	pl_run(c, pl_prompt, 8, r->lg, r->ids, 6);
	nf_cache_stats_get(cache, &r->cs);
	nf_sparse_stats_get(s, &r->st);
	cr_expect_eq(r->cs.errors, 0);
	nf_sparse_close(s);
	nf_ctx_close(c);
	nf_cache_close(cache);
	nf_store_close(st);
	nf_model_free(m);
	unlink(sp);
}

Test(pipeline_moe, wide_read_gaps_leave_room_for_every_routed_expert)
{
	for (int predictor = 1; predictor >= 0; predictor--) {
		char p[256];
		pl_tmp_path(p, sizeof(p), "moe-gap");
		cr_assert_eq(pl_synth_tiny_moe(p, "relu", NF_DTYPE_Q8_0, predictor, N_EXPERT), 0);
		struct store_run r[2];
		run_with_gap(p, 0, &r[0]);
		run_with_gap(p, 1024, &r[1]);
		/* (exact mode reads every bundle of an expert: one run, no gaps) */
		if (predictor) {
			cr_expect(r[1].st.moe_together > 0, "the experts were never requested together");
			cr_expect(r[1].cs.gap_bundles > 0, "no read bridged a gap");
		}
		expect_same_run(&r[0], &r[1], predictor ? "predictor, gap 1024 vs 0" : "exact, gap 1024 vs 0");
		free(r[0].lg);
		free(r[1].lg);
		unlink(p);
	}
}

/*
 * Exact mode from a store imported with --gate-objects, with and without
 * gate-first reads: the same bits (the chunks are cut as exact mode cuts
 * them and each gate is the bits a chunk computes), the gate rows read
 * once per routed FFN of each generated token, fewer bundle bytes. A
 * mixture (a token's experts together) or a dense model (one FFN a layer).
 */
static void check_gate_first(bool moe, const char *act, uint32_t dtype)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-gf");
	cr_assert_eq(moe ? pl_synth_tiny_moe(p, act, dtype, false, N_EXPERT) : pl_synth_tiny(p, act, dtype, false), 0);
	char what[64];
	snprintf(what, sizeof(what), "%s %s %s, gate-first", moe ? "moe" : "dense", act, nf_dtype_name(dtype));
	struct store_run r[2];
	for (int k = 0; k < 2; k++) {
		run_from_store(p, true, false, k == 1, &r[k]);
		cr_assert_eq(r[k].mode, NF_SPARSE_EXACT);
	}
	const struct nf_model_hparams *hp = &r[0].hp;
	/* each of the 5 generated tokens reads each layer's routed FFNs' gate
	 * rows once; the prompt runs as a batch (whole bundles), but an expert
	 * routed only one prompt token runs it as a token (gate rows read), and
	 * so does the last layer, which runs only the prompt's last token */
	uint64_t decode = 5ull * hp->n_layer * (moe ? hp->n_expert_used : 1);
	uint64_t most = decode + (moe ? (uint64_t)hp->n_layer * N_EXPERT : 1), reads = r[1].st.gate_reads;
	cr_expect(r[0].st.gate_reads == 0 && reads >= decode && reads <= most,
		  "%s: %llu gate reads, %llu for the generated tokens", what, (unsigned long long)reads,
		  (unsigned long long)decode);
	uint64_t b0 = r[0].cs.bytes_read - r[0].cs.hot_bytes, b1 = r[1].cs.bytes_read - r[1].cs.hot_bytes;
	cr_expect_lt(b1, b0, "%s: read %llu B of bundles, exact mode %llu B", what, (unsigned long long)b1,
		     (unsigned long long)b0);
	cr_log_info("%s: %llu B of bundles and %llu B of gate rows, exact mode %llu B", what, (unsigned long long)b1,
		    (unsigned long long)r[1].st.gate_bytes, (unsigned long long)b0);
	expect_same_run(&r[0], &r[1], what);
	free(r[0].lg);
	free(r[1].lg);
	unlink(p);
}

Test(pipeline_moe, gate_first_keeps_exact_bits_and_reads_fewer_bundles)
{
	check_gate_first(true, "relu", NF_DTYPE_F32);
	check_gate_first(true, "drelu", NF_DTYPE_F16);
	check_gate_first(true, "relu", NF_DTYPE_Q8_0);
	check_gate_first(false, "relu", NF_DTYPE_Q8_0);
}

/* Gate-first needs exact mode and a store with gate rows: anything else is
 * refused, naming the flag and what to do. */
Test(pipeline_moe, gate_first_refuses_what_it_cannot_do)
{
	char p[256], msg[512];
	pl_tmp_path(p, sizeof(p), "moe-gfno");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", NF_DTYPE_Q8_0, true, N_EXPERT), 0);
	struct from_store f;
	store_open(&f, p, NULL);
	struct nf_ctx *c = pl_open_ctx(f.m, 2);
	struct nf_sparse *s = NULL;
	/* predictor mode (the default with predictors) */
	cr_expect_eq(engine_with(c, f.cache, NF_SPARSE_AUTO, false, true, &s, msg, sizeof(msg)), NF_EUSAGE);
	cr_expect(strstr(msg, "--gate-first") && strstr(msg, "exact"), "%s", msg);
	/* exact, but no gate rows in the store */
	cr_expect_eq(engine_with(c, f.cache, NF_SPARSE_EXACT, false, true, &s, msg, sizeof(msg)), NF_EUSAGE);
	cr_expect(strstr(msg, "--gate-objects"), "%s", msg);
	nf_ctx_close(c);
	store_close(&f);
	unlink(p);
}

/*
 * `nflash import` writes gate rows by default where exact mode runs (a
 * ReLU/dReLU FFN with no predictor) and nowhere else, `--no-gate-objects`
 * skips them; an unplanned run of such a store reads gates first by
 * default (gate reads counted), with the ids `--gate-first off` gives.
 */
static void ids_of(const char *json, char *ids, size_t n)
{
	const char *a = strstr(json, "\"ids\""), *b = a ? strchr(a, ']') : NULL;
	cr_assert(a && b, "no ids in %s", json);
	snprintf(ids, n, "%.*s", (int)(b - a), a);
}

Test(pipeline_moe, import_writes_gate_rows_where_exact_mode_runs)
{
	char g[256], gp[256], s[256], out[16384], err[8192], cmd[1024], ids[2][4096];
	pl_tmp_path(g, sizeof(g), "gr-relu");
	pl_tmp_path(gp, sizeof(gp), "gr-pred");
	pl_tmp_path(s, sizeof(s), "gr-store");
	cr_assert_eq(pl_synth_tiny(g, "relu", NF_DTYPE_Q8_0, false), 0);
	cr_assert_eq(pl_synth_tiny(gp, "relu", NF_DTYPE_Q8_0, true), 0);
	const struct {
		const char *gguf, *flag;
		unsigned long long want;
	} c[] = { { gp, "", 0 }, { g, "--no-gate-objects", 0 }, { g, "", 2 } };
	for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
		snprintf(cmd, sizeof(cmd), "import %s %s --force --json %s", c[i].gguf, s, c[i].flag);
		cr_assert_eq(pl_run_cli(cmd, out, sizeof(out), err, sizeof(err)), 0, "%s: %s", cmd, err);
		cr_expect_eq(pl_json_u64(out, "gate_rows_objects"), c[i].want, "%s: %s", cmd, out);
	}
	for (int k = 0; k < 2; k++) {
		snprintf(cmd, sizeof(cmd), "generate -m %s -p 'Once upon a time' -n 6 --temp 0 --json --stats %s", s,
			 k ? "--gate-first off" : "");
		cr_assert_eq(pl_run_cli(cmd, out, sizeof(out), err, sizeof(err)), 0, "%s: %s", cmd, err);
		unsigned long long gr = pl_json_u64(out, "gate_reads");
		cr_expect(k ? gr == 0 : gr >= 5 * 2, "%s: %llu gate-rows reads", cmd, gr);
		ids_of(out, ids[k], sizeof(ids[k]));
	}
	cr_expect_str_eq(ids[0], ids[1]);
	unlink(g);
	unlink(gp);
	unlink(s);
}

/* ---- a read error during an expert's read ------------------------------------------ */

/* The prompt, then one token, through a one-FFN cache whose read number
 * nth fails (UINT64_MAX: none): the return codes of both evals, the
 * logits after each that succeeded, and the reads each made. */
struct fault_run {
	int rc_prompt, rc_next;
	uint64_t reads_prompt, reads_next;
};

static void run_with_fault(const char *gguf, uint64_t nth, float *lp, float *ln, struct fault_run *r)
{
	struct nf_io_fault_rule rule = { .kind = NF_IO_FAULT_EIO, .nth = nth };
	struct from_store f;
	store_open(&f, gguf, nth == UINT64_MAX ? NULL : &rule);
	uint32_t nv = nf_model_hparams(f.m)->n_vocab;
	struct nf_ctx *c = pl_open_ctx(f.m, 2);
	struct nf_sparse *s = pl_engine(c, NF_SPARSE_PREDICTOR, f.cache);
	struct nf_cache_stats cs;
	memset(r, 0, sizeof(*r));
	r->rc_next = 1;
	r->rc_prompt = nf_ctx_eval(c, pl_prompt, 8);
	nf_cache_stats_get(f.cache, &cs);
	r->reads_prompt = cs.requests;
	if (r->rc_prompt == 0) {
		memcpy(lp, nf_ctx_logits(c), nv * sizeof(float));
		int32_t id = nf_sampler_argmax(lp, nv);
		r->rc_next = nf_ctx_eval(c, &id, 1);
		nf_cache_stats_get(f.cache, &cs);
		r->reads_next = cs.requests - r->reads_prompt;
		if (r->rc_next == 0)
			memcpy(ln, nf_ctx_logits(c), nv * sizeof(float));
	}
	nf_sparse_close(s);
	nf_ctx_close(c);
	store_close(&f);
}

Test(pipeline_moe, read_error_fails_that_request)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-eio");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", NF_DTYPE_Q8_0, true, N_EXPERT), 0);
	struct nf_model *m = pl_load(p, false, false);
	uint32_t nv = nf_model_hparams(m)->n_vocab;
	nf_model_free(m);
	float *gp = malloc(nv * sizeof(float)), *gn = malloc(nv * sizeof(float));
	float *lp = malloc(nv * sizeof(float)), *ln = malloc(nv * sizeof(float));
	struct fault_run good, r;
	run_with_fault(p, UINT64_MAX, gp, gn, &good);
	cr_assert(good.rc_prompt == 0 && good.rc_next == 0);
	cr_assert(good.reads_prompt > 2 && good.reads_next > 2, "reads %llu, %llu",
		  (unsigned long long)good.reads_prompt, (unsigned long long)good.reads_next);
	/* an expert's read of the prompt fails: that eval fails with EIO */
	run_with_fault(p, good.reads_prompt / 2, lp, ln, &r);
	cr_expect_eq(r.rc_prompt, -EIO, "prompt with a failing expert read: %d (%s)", r.rc_prompt,
		     nf_strerror(r.rc_prompt));
	/* one of the next token's: the prompt's logits are right, the token's eval fails */
	run_with_fault(p, good.reads_prompt + good.reads_next / 2, lp, ln, &r);
	cr_expect_eq(r.rc_prompt, 0);
	cr_expect(!memcmp(lp, gp, nv * sizeof(float)), "the prompt before the failing read changed");
	cr_expect_eq(r.rc_next, -EIO, "token with a failing expert read: %d (%s)", r.rc_next, nf_strerror(r.rc_next));
	/* a fresh cache computes the same logits again */
	run_with_fault(p, UINT64_MAX, lp, ln, &r);
	cr_expect(r.rc_prompt == 0 && r.rc_next == 0 && !memcmp(ln, gn, nv * sizeof(float)));
	free(gp);
	free(gn);
	free(lp);
	free(ln);
	unlink(p);
}

/* ---- a batch reads each expert's union once ------------------------------------------ */

/* The prompt ids[0..n) from a fresh import of gguf under a one-FFN cache,
 * in steps of n_batch tokens: the requests and bytes it read. */
static void prompt_reads(const char *gguf, enum nf_sparse_mode mode, const int32_t *ids, uint32_t n, uint32_t n_ctx,
			 uint32_t n_batch, uint64_t *reqs, uint64_t *bytes)
{
	struct from_store f;
	store_open(&f, gguf, NULL);
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_threads = 2;
	cp.n_ctx = n_ctx;
	cp.n_batch = n_batch;
	struct nf_ctx *c = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_ctx_open(f.m, &cp, &c, &d), 0, "%s", d.msg);
	struct nf_sparse *s = pl_engine(c, mode, f.cache);
	cr_assert_eq(nf_ctx_eval(c, ids, n), 0);
	struct nf_cache_stats cs;
	nf_cache_stats_get(f.cache, &cs);
	cr_expect_eq(cs.errors, 0);
	*reqs = cs.requests;
	*bytes = cs.bytes_read;
	nf_sparse_close(s);
	nf_ctx_close(c);
	store_close(&f);
}

/* Way 0 read fewer requests and bytes than way 1. */
static void expect_fewer_reads(const char *what, const uint64_t *reqs, const uint64_t *bytes)
{
	cr_expect(reqs[0] < reqs[1] && bytes[0] < bytes[1], "%s: %llu B in %llu requests against %llu B in %llu", what,
		  (unsigned long long)bytes[0], (unsigned long long)reqs[0], (unsigned long long)bytes[1],
		  (unsigned long long)reqs[1]);
	cr_log_info("%s: %llu B in %llu requests against %llu B in %llu", what, (unsigned long long)bytes[0],
		    (unsigned long long)reqs[0], (unsigned long long)bytes[1], (unsigned long long)reqs[1]);
}

/* The prompt as one batch through a one-FFN cache: per expert its tokens'
 * union in one request, fewer reads and bytes than the same prompt token
 * by token (n_batch 1; its attention sums differ, so only reads are
 * compared; the batch's logits equal memory's in the tests above). */
Test(pipeline_moe, batch_reads_each_experts_union_once)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-batch");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", NF_DTYPE_F32, false, N_EXPERT), 0);
	uint64_t reqs[2], bytes[2];
	for (int k = 0; k < 2; k++)
		prompt_reads(p, NF_SPARSE_EXACT, pl_prompt, 8, 64, k ? 1 : 512, &reqs[k], &bytes[k]);
	expect_fewer_reads("MoE prompt of 8, a batch against token by token", reqs, bytes);
	unlink(p);
}

/* A forward step of 96 prompt tokens gathers each expert's tokens of the
 * whole step (its union read once), so it reads in fewer requests and
 * bytes than the same prompt as two steps of 48 (each reading each
 * expert's union; their attention sums differ, so only reads compare). */
Test(pipeline_moe, a_step_reads_each_experts_union_once)
{
	char p[256];
	pl_tmp_path(p, sizeof(p), "moe-step");
	cr_assert_eq(pl_synth_tiny_moe(p, "relu", NF_DTYPE_Q8_0, true, N_EXPERT), 0);
	int32_t ids[96];
	for (int i = 0; i < 96; i++)
		ids[i] = pl_prompt[i % 8] + i / 8;
	uint64_t reqs[2], bytes[2];
	for (int k = 0; k < 2; k++)
		prompt_reads(p, NF_SPARSE_PREDICTOR, ids, 96, 128, k ? 48 : 512, &reqs[k], &bytes[k]);
	expect_fewer_reads("MoE prompt of 96, one step against two of 48", reqs, bytes);
	unlink(p);
}
