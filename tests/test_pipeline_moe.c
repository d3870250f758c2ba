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

static void store_open(struct from_store *f, const char *gguf, const struct nf_io_fault_rule *fault)
{
	pl_import(gguf, f->sp, sizeof(f->sp));
	f->m = pl_load(f->sp, false, false);
	cr_assert(!nf_model_ffn_in_memory(f->m));
	uint64_t min = nf_cache_min_bytes(nf_model_store(f->m));
	f->cache = pl_open_cache(f->sp, &f->store, min, fault, 0);
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
	/* 8 + 5 tokens, each through 2 routed experts per layer */
	cr_expect_eq(st.ffn_calls, 13ull * hp->n_layer * 2, "%llu expert calls", (unsigned long long)st.ffn_calls);
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
