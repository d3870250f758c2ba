/*
 * profile_save.c - the end of a calibration run (`--profile`): the cache's
 * firing counts and the co-activation layout planned from its record,
 * written into the store (nf_coact_profile_save, nflash/coact.h).
 *
 * Invariants: the store is updated crash-safely as a new generation
 * (nf_store_update_profile) or not at all; every order stored is a
 * permutation (nf_coact_order).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nflash/coact.h"
#include "nflash/engine.h"
#include "nflash/sparse.h"
#include "nflash/store.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void progress(const struct nf_coact_progress *pr, uint64_t done, uint64_t total)
{
	if (pr && pr->fn)
		pr->fn(pr->arg, "planning the layout", done, total);
}

/* NFLASH_COACT_SCORES=off: chain by firing records alone (A/B runs) */
static bool scores_on(void)
{
	const char *v = getenv("NFLASH_COACT_SCORES");
	return !v || strcmp(v, "off") != 0;
}

float *nf_coact_ffn_vec(struct nf_engine *e, uint32_t layer, uint32_t expert, uint32_t *dim)
{
	const struct nf_sparse *sp = nf_engine_sparse(e);
	uint64_t n = 0;
	const double *sum = NULL, *sq = NULL;
	uint32_t r = nf_sparse_pred_record(sp, layer, expert, &n, &sum, &sq);
	struct nf_cache_geom g;
	if (!r || n < 2 || !nf_engine_cache(e) || !scores_on())
		return NULL;
	nf_cache_geometry(nf_engine_cache(e), &g);
	float *fc2 = malloc((size_t)g.n_neurons * r * sizeof(float));
	float *vec = malloc((size_t)g.n_neurons * r * sizeof(float));
	if (!fc2 || !vec || nf_sparse_pred_fc2(sp, layer, expert, fc2) < 0 ||
	    nf_coact_embed(fc2, g.n_neurons, r, n, sum, sq, vec) < 0) {
		free(fc2);
		free(vec);
		return NULL;
	}
	free(fc2);
	*dim = r;
	return vec;
}

uint32_t nf_coact_gap(const struct nf_engine *e)
{
	int rg = nf_engine_opts(e)->read_gap;
	return rg >= 0 ? (uint32_t)rg : 4;
}

/* Plan every FFN's co-activation layout from the cache's record into
 * p->order. The head is the share of neurons the cache keeps hot under this
 * budget. In predictor mode each FFN's layout is chained by firing bitmaps
 * or by the predictor's scores (nf_coact_embed), whichever serves the
 * record's odd tokens better when planned from its even ones
 * (nf_coact_holdout). Writes what the layout saves on the calibration
 * tokens themselves, and the held-out choice, to log. Returns 0 or -ENOMEM
 * (no order then). */
static int plan_orders(struct nf_engine *e, struct nf_store_profile *p, uint64_t head_slots, const uint64_t *extra,
		       uint32_t n_extra, const struct nf_coact_progress *pr, FILE *log)
{
	struct nf_cache *cache = nf_engine_cache(e);
	struct nf_store *store = nf_engine_store(e);
	struct nf_cache_geom g;
	nf_cache_geometry(cache, &g);
	uint32_t n_ffn = 0, gap = nf_coact_gap(e);
	for (uint32_t i = 0; i < p->n_objects; i++)
		n_ffn += p->counts[i] != NULL;
	if (!n_ffn || !(p->order = calloc(p->n_objects, sizeof(*p->order))))
		return -ENOMEM;
	/* the head of each FFN: its share of head_slots, the hot set a run
	 * will load (nf_cache_hot_quota) */
	uint32_t *quota = calloc((size_t)g.n_layer * g.n_expert, sizeof(uint32_t));
	if (!quota)
		return -ENOMEM;
	nf_cache_hot_quota(cache, head_slots, quota);
	/* and each other hot set's (extra): the layout is cut at every one,
	 * each part chained on its own */
	size_t n_fe = (size_t)g.n_layer * g.n_expert;
	n_extra = extra ? n_extra : 0;
	uint32_t *xq = n_extra ? calloc(n_fe * n_extra, sizeof(uint32_t)) : NULL;
	uint32_t *cuts = malloc((n_extra + 1) * sizeof(uint32_t));
	if ((n_extra && !xq) || !cuts) {
		free(xq);
		free(cuts);
		free(quota);
		return -ENOMEM;
	}
	for (uint32_t k = 0; k < n_extra; k++)
		nf_cache_hot_quota(cache, extra[k], xq + k * n_fe);
	double t0 = now_s();
	double by_count = 0, coact = 0, held_in = 0, held_out = 0;
	uint32_t tokens_max = 0, head_sum = 0, done = 0, n_vec = 0, n_scores = 0;
	int rc = 0;
	progress(pr, 0, n_ffn);
	for (uint32_t i = 0; i < p->n_objects && rc == 0; i++) {
		const struct nf_store_object *ob = nf_store_object_get(store, i);
		if (!p->counts[i])
			continue;
		uint32_t n = p->lens[i], tokens, words, dim = 0;
		uint32_t head = quota[ob->layer * g.n_expert + ob->expert];
		const uint64_t *sig = nf_cache_signatures(cache, ob->layer, ob->expert, &tokens, &words);
		float *vec = sig && tokens >= 4 ? nf_coact_ffn_vec(e, ob->layer, ob->expert, &dim) : NULL;
		const float *used_vec = NULL;
		rc = -ENOMEM;
		if (!(p->order[i] = malloc((size_t)n * sizeof(uint32_t))) ||
		    nf_coact_order(p->counts[i], NULL, 0, n, head, p->order[i]) < 0)
			goto next;
		if (sig && tokens)
			by_count += nf_coact_runs(sig, words, tokens, n, p->order[i], head, gap);
		if (nf_coact_order(p->counts[i], sig, words, n, head, p->order[i]) < 0)
			goto next;
		if (vec) {
			double ir, ib, or_, ob_, cr[2];
			bool scores = false;
			n_vec++;
			if (nf_coact_holdout(sig, words, tokens, n, p->order[i], head, vec, dim, gap, &gap, 1, &ir, &ib,
					     &or_, &ob_, &scores, cr) < 0)
				goto next;
			held_in += cr[0];
			held_out += scores ? cr[1] : cr[0];
			if (scores) {
				n_scores++;
				used_vec = vec;
				if (nf_coact_order_vec(p->counts[i], vec, dim, n, head, p->order[i]) < 0)
					goto next;
			}
		}
		if (n_extra) {
			/* this FFN's cuts, ascending, each once */
			uint32_t fe = ob->layer * g.n_expert + ob->expert, nc = 0;
			cuts[nc++] = head;
			for (uint32_t k = 0; k < n_extra; k++) {
				uint32_t c = xq[k * n_fe + fe], at = nc;
				while (at > 0 && cuts[at - 1] > c)
					at--;
				if (at > 0 && cuts[at - 1] == c)
					continue;
				memmove(cuts + at + 1, cuts + at, (nc - at) * sizeof(*cuts));
				cuts[at] = c;
				nc++;
			}
			if (nc > 1 && nf_coact_order_cuts(p->counts[i], used_vec ? NULL : sig, words, used_vec, dim, n, cuts,
							  nc, p->order[i]) < 0)
				goto next;
		}
		if (sig && tokens)
			coact += nf_coact_runs(sig, words, tokens, n, p->order[i], head, gap);
		tokens_max = tokens > tokens_max ? tokens : tokens_max;
		head_sum += head < n ? head : n;
		rc = 0;
	next:
		free(vec);
		progress(pr, ++done, n_ffn);
	}
	free(xq);
	free(cuts);
	if (rc < 0) {
		progress(pr, n_ffn, n_ffn);
		free(quota);
		return -ENOMEM;
	}
	if (log) {
		fprintf(log,
			"nflash: co-activation layout of %u FFNs planned in %.1f s from %u calibration tokens: after "
			"the %u most frequent neurons per FFN (mean), a calibration token's reads (gap %u) %.0f by count "
			"-> %.0f co-activated\n",
			n_ffn, now_s() - t0, tokens_max, head_sum / n_ffn, gap, by_count, coact);
		if (n_vec)
			fprintf(log,
				"nflash: co-activation layout: planned from the even calibration tokens, the odd ones' "
				"reads (gap %u) %.0f chained by firing record, %.0f by the better of it and the "
				"predictor's scores; scores taken for %u of %u FFNs\n",
				gap, held_in, held_out, n_scores, n_vec);
	}
	free(quota);
	return 0;
}

static int profile_save(struct nf_engine *e, uint64_t tokens, uint64_t head_slots, const uint64_t *extra,
			uint32_t n_extra, const struct nf_coact_progress *pr, struct nf_diag *d)
{
	const struct nf_engine_opts *o = nf_engine_opts(e);
	struct nf_cache *cache = nf_engine_cache(e);
	struct nf_store *store = nf_engine_store(e);
	const char *path = nf_engine_store_path(e);
	if (!o->profile || !cache || !store)
		return nf_diag_fail(d, NF_EUSAGE, "--profile: the engine was not opened for a calibration run");
	struct nf_store_profile *p = NULL;
	int rc = nf_store_profile_alloc(store, &p);
	if (rc < 0)
		return nf_diag_fail(d, rc, "--profile: %s", nf_strerror(rc));
	for (uint32_t i = 0; i < p->n_objects; i++) {
		const struct nf_store_object *ob = nf_store_object_get(store, i);
		const uint32_t *cnt =
			ob->kind == NF_STORE_KIND_FFN ? nf_cache_counts(cache, ob->layer, ob->expert) : NULL;
		if (cnt && p->counts[i])
			memcpy(p->counts[i], cnt, (size_t)p->lens[i] * sizeof(uint32_t));
	}
	enum nf_sparse_mode m = nf_sparse_mode_of(nf_engine_sparse(e));
	p->source = m == NF_SPARSE_PREDICTOR ? NF_STORE_PROFILE_PREDICTOR
		    : m == NF_SPARSE_EXACT   ? NF_STORE_PROFILE_EXACT
					     : NF_STORE_PROFILE_DENSE;
	p->tokens = tokens;
	FILE *log = o->profile_log ? o->profile_log : o->log;
	if (plan_orders(e, p, head_slots, extra, n_extra, pr, log) < 0) {
		if (log)
			fprintf(log, "nflash: warning: --profile: no memory to plan the co-activation layout; "
				     "storing counts only\n");
		for (uint32_t i = 0; p->order && i < p->n_objects; i++)
			free(p->order[i]);
		free(p->order);
		p->order = NULL;
	}
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	p->created_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	rc = nf_store_update_profile(path, NULL, p, d);
	nf_store_profile_free(p);
	if (rc < 0)
		return nf_diag_prefix(d, rc, "--profile");
	if (log)
		fprintf(log, "nflash: profile of %llu tokens (%s mode) stored in %s\n", (unsigned long long)tokens,
			nf_sparse_mode_name(m), path);
	return 0;
}

int nf_coact_profile_save(struct nf_engine *e, uint64_t tokens, const struct nf_coact_progress *pr,
			  struct nf_diag *d)
{
	struct nf_cache *cache = nf_engine_cache(e);
	if (!nf_engine_opts(e)->profile || !cache || !nf_engine_store(e))
		return nf_diag_fail(d, NF_EUSAGE, "--profile: the engine was not opened for a calibration run");
	/* the head: the hot set a run under this budget will load, counting
	 * what only this calibration run holds (KV cache, record) as hot;
	 * the cuts: each other budget's (nf_engine_opts.profile_cuts) */
	struct nf_engine_info info;
	struct nf_cache_layout cl;
	struct nf_cache_geom g;
	nf_engine_info(e, &info);
	nf_cache_layout_get(cache, &cl);
	nf_cache_geometry(cache, &g);
	const struct nf_engine_opts *eo = nf_engine_opts(e);
	return profile_save(e, tokens, cl.hot_slots + info.profile_extra / g.stride, eo->profile_cuts,
			    eo->n_profile_cuts, pr, d);
}

int nf_coact_profile_recut(struct nf_engine *e, uint64_t tokens, const uint64_t *hot_slots, uint32_t n,
			   const struct nf_coact_progress *pr, struct nf_diag *d)
{
	if (!hot_slots || !n)
		return nf_diag_fail(d, NF_EUSAGE, "--profile: no hot set to cut the layout at");
	/* the largest hot set is the head, the others cuts */
	uint32_t top = 0;
	for (uint32_t k = 1; k < n; k++)
		top = hot_slots[k] > hot_slots[top] ? k : top;
	uint64_t *extra = malloc((n > 1 ? n - 1 : 1) * sizeof(*extra));
	if (!extra)
		return nf_diag_fail(d, -ENOMEM, "--profile: out of memory");
	uint32_t ne = 0;
	for (uint32_t k = 0; k < n; k++)
		if (k != top)
			extra[ne++] = hot_slots[k];
	int rc = profile_save(e, tokens, hot_slots[top], extra, ne, pr, d);
	free(extra);
	return rc;
}
