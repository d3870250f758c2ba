/*
 * test_pipeline_cache.c - the segmented neuron cache on an imported store:
 * bytes served equal the store's, misses of adjacent bundles coalesced into
 * one read, hits afterwards, CLOCK eviction under a one-layer arena, the hot
 * segment (filled from the highest counts over all layers), a too-small
 * arena refused with the minimum, and a failed read
 * reported and forgotten (no later hit on bytes that never arrived).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/cache.h"
#include "nflash/store.h"
#include "util_pipeline.h"

#define MODEL "../shared/testdata/models/tiny-llama-f32.gguf"

struct fx {
	char path[256];
	struct nf_store *store;
	const void *ptrs[4096];
	uint32_t got[4096];
	int results[4096];
	uint32_t n_got;
};

static void ready(void *user, const uint32_t *neurons, uint32_t n, int result)
{
	struct fx *f = user;
	for (uint32_t i = 0; i < n; i++) {
		f->got[f->n_got] = neurons[i];
		f->results[f->n_got++] = result;
	}
}

static void fx_open(struct fx *f, bool shuffle)
{
	memset(f, 0, sizeof(*f));
	if (shuffle) {
		pl_tmp_path(f->path, sizeof(f->path), "cache");
		struct nf_model *m = pl_load(MODEL, false, false);
		char msg[256] = "";
		cr_assert_eq(pl_store_from_model(m, f->path, 8, true, msg, sizeof(msg)), 0, "%s", msg);
		nf_model_free(m);
	} else {
		pl_import(MODEL, f->path, sizeof(f->path));
	}
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(f->path, NULL, &f->store, &d), 0, "%s", d.msg);
}

static void fx_close(struct fx *f)
{
	nf_store_close(f->store);
	unlink(f->path);
}

static struct nf_cache *cache_open_gap(struct fx *f, uint64_t arena, double hot, const struct nf_io_fault_rule *rule,
				       uint32_t max_gap)
{
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.max_gap = max_gap;
	o.arena_bytes = arena;
	o.hot_fraction = hot;
	o.io.quiet = true;
	if (rule) {
		o.io.backend = NF_IO_FAULT;
		o.io.fault.n_rules = 1;
		o.io.fault.rules[0] = *rule;
	}
	struct nf_cache *c = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_cache_open(f->store, &o, &c, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	return c;
}

/* Reads join only adjacent misses (max_gap 0), so request counts are exact. */
static struct nf_cache *cache_open(struct fx *f, uint64_t arena, double hot, const struct nf_io_fault_rule *rule)
{
	return cache_open_gap(f, arena, hot, rule, 0);
}

/* Request, then reap until every neuron was reported. */
static void fetch(struct fx *f, struct nf_cache *c, uint32_t layer, const uint32_t *ids, uint32_t n)
{
	f->n_got = 0;
	int rc = nf_cache_request(c, layer, 0, ids, n, f->ptrs, ready, f);
	cr_assert(rc == 0 || rc == -EIO, "request: %s", nf_strerror(rc));
	while (f->n_got < n) {
		rc = nf_cache_reap(c, ready, f);
		cr_assert(rc >= 0, "reap: %s", nf_strerror(rc));
	}
}

/* The bytes at ptrs[j] are bundle j of layer's FFN object in the file. */
static void check_bytes(struct fx *f, uint32_t layer, const uint32_t *ids, uint32_t n)
{
	const struct nf_store_object *o = nf_store_ffn_find(f->store, layer, 0);
	int fd = open(f->path, O_RDONLY);
	cr_assert(fd >= 0);
	char *buf = malloc(o->stride);
	for (uint32_t k = 0; k < n; k++) {
		uint32_t j = ids[k];
		cr_assert_eq(pread(fd, buf, o->bundle_bytes, (off_t)nf_store_bundle_offset(o, o->perm[j])),
			     (ssize_t)o->bundle_bytes);
		cr_assert(memcmp(buf, f->ptrs[j], o->bundle_bytes) == 0, "layer %u neuron %u: wrong bytes", layer, j);
	}
	free(buf);
	close(fd);
}

Test(pipeline, cache_coalesces_and_hits)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_cache *c = cache_open(&f, 4 * min, 0.0, NULL);
	uint32_t ids[64];
	for (uint32_t i = 0; i < 50; i++)
		ids[i] = 10 + i;
	fetch(&f, c, 0, ids, 50);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.misses, 50);
	cr_expect_eq(st.requests, 1, "50 adjacent bundles took %llu requests", (unsigned long long)st.requests);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], 0);
	check_bytes(&f, 0, ids, 50);
	cr_assert_eq(nf_cache_release(c), 0);
	/* again: all hits, reported inside the request */
	nf_cache_stats_reset(c);
	f.n_got = 0;
	cr_assert_eq(nf_cache_request(c, 0, 0, ids, 50, f.ptrs, ready, &f), 0);
	cr_expect_eq(f.n_got, 50, "hits are reported at once");
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_cold, 50);
	cr_expect_eq(st.requests, 0);
	check_bytes(&f, 0, ids, 50);
	cr_assert_eq(nf_cache_release(c), 0);
	/* two runs with a gap: two requests */
	nf_cache_stats_reset(c);
	uint32_t two[6] = { 100, 101, 102, 110, 111, 112 };
	fetch(&f, c, 1, two, 6);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.requests, 2);
	check_bytes(&f, 1, two, 6);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_close(c);
	fx_close(&f);
}

Test(pipeline, cache_runs_follow_the_permutation)
{
	struct fx f;
	fx_open(&f, true);
	const struct nf_store_object *o = nf_store_ffn_find(f.store, 0, 0);
	struct nf_cache *c = cache_open(&f, 4 * nf_cache_min_bytes(f.store), 0.0, NULL);
	/* neurons whose slots are 20..39: one run, whatever their ids */
	uint32_t ids[20], n = 0;
	for (uint32_t j = 0; j < o->n_bundles; j++)
		if (o->perm[j] >= 20 && o->perm[j] < 40)
			ids[n++] = j;
	cr_assert_eq(n, 20);
	fetch(&f, c, 0, ids, n);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.requests, 1);
	check_bytes(&f, 0, ids, n);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_close(c);
	fx_close(&f);
}

Test(pipeline, cache_clock_evicts_under_one_layer)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	const struct nf_store_object *o = nf_store_ffn_find(f.store, 0, 0);
	uint32_t N = o->n_bundles;
	cr_assert_eq(min, (uint64_t)N * o->stride);
	struct nf_cache *c = cache_open(&f, min, 0.5, NULL);
	struct nf_cache_layout L;
	nf_cache_layout_get(c, &L);
	cr_expect_eq(L.cold_slots, N);
	cr_expect_eq(L.hot_slots, 0);
	uint32_t *ids = malloc(N * sizeof(uint32_t));
	for (uint32_t j = 0; j < N; j++)
		ids[j] = j;
	for (int round = 0; round < 2; round++)
		for (uint32_t layer = 0; layer < 2; layer++) {
			nf_cache_stats_reset(c);
			fetch(&f, c, layer, ids, N);
			struct nf_cache_stats st;
			nf_cache_stats_get(c, &st);
			cr_expect_eq(st.misses, N, "round %d layer %u: %llu misses", round, layer,
				     (unsigned long long)st.misses);
			if (round || layer)
				cr_expect_eq(st.evictions, N);
			check_bytes(&f, layer, ids, N);
			cr_assert_eq(nf_cache_release(c), 0);
		}
	free(ids);
	nf_cache_close(c);
	fx_close(&f);
}

Test(pipeline, cache_hot_segment_from_counts)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	const struct nf_store_object *o = nf_store_ffn_find(f.store, 0, 0);
	struct nf_cache *c = cache_open(&f, 2 * min, 0.5, NULL);
	struct nf_cache_layout L;
	nf_cache_layout_get(c, &L);
	cr_assert(L.hot_slots >= 20, "%u hot slots", L.hot_slots);
	uint32_t *counts = calloc(o->n_bundles, sizeof(uint32_t));
	uint32_t hot[4] = { 3, 4, 5, 90 };
	for (int i = 0; i < 4; i++)
		counts[hot[i]] = 100 + i;
	cr_assert_eq(nf_cache_set_counts(c, 0, counts), 0);
	cr_assert_eq(nf_cache_hot_load(c), 0);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hot_loads, 2, "neurons 3-5 and 90: two runs, %llu reads", (unsigned long long)st.hot_loads);
	nf_cache_stats_reset(c);
	f.n_got = 0;
	cr_assert_eq(nf_cache_request(c, 0, 0, hot, 4, f.ptrs, ready, &f), 0);
	cr_expect_eq(f.n_got, 4);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_hot, 4);
	check_bytes(&f, 0, hot, 4);
	cr_assert_eq(nf_cache_release(c), 0);
	free(counts);
	nf_cache_close(c);
	fx_close(&f);
}

Test(pipeline, cache_refuses_a_too_small_arena)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = min - 1;
	struct nf_cache *c = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_cache_open(f.store, &o, &c, &d), NF_EBUDGET);
	char want[64];
	snprintf(want, sizeof(want), "at least %llu", (unsigned long long)min);
	cr_expect(strstr(d.msg, want), "message does not state the minimum: %s", d.msg);
	cr_expect_null(c);
	fx_close(&f);
}

Test(pipeline, cache_read_error_is_reported_and_forgotten)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_io_fault_rule rule = { .kind = NF_IO_FAULT_EIO, .nth = 0 };
	struct nf_cache *c = cache_open(&f, 2 * min, 0.0, &rule);
	uint32_t ids[8] = { 0, 1, 2, 3, 4, 5, 6, 7 };
	fetch(&f, c, 0, ids, 8);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], -EIO, "neuron %u: result %d", f.got[i], f.results[i]);
	cr_expect_eq(nf_cache_release(c), -EIO);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.errors, 1);
	/* the failed neurons are not cached: asking again misses (and the
	 * context's sticky error fails it again rather than serving garbage) */
	nf_cache_stats_reset(c);
	fetch(&f, c, 0, ids, 8);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_cold, 0);
	cr_expect_eq(st.misses, 8);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_lt(f.results[i], 0);
	nf_cache_release(c);
	nf_cache_close(c);
	fx_close(&f);
}

Test(pipeline, cache_waits_when_the_io_context_is_full)
{
	struct fx f;
	fx_open(&f, false);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = 2 * nf_cache_min_bytes(f.store);
	o.io.quiet = true;
	o.io.max_requests = 2; /* far fewer than the runs below */
	o.max_gap = 0;         /* one read per run */
	struct nf_cache *c = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_cache_open(f.store, &o, &c, &d), 0, "%s", d.msg);
	uint32_t ids[40];
	for (uint32_t i = 0; i < 40; i++)
		ids[i] = 2 * i; /* 40 runs of one bundle */
	fetch(&f, c, 0, ids, 40);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], 0);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.requests, 40);
	check_bytes(&f, 0, ids, 40);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_close(c);
	fx_close(&f);
}

/* max_gap 1: misses one slot apart are one read; the bundle between them
 * is read and cached (a hit afterwards, right bytes) but not reported; a
 * gap holding a cached bundle, or wider than max_gap, splits the read. */
Test(pipeline, cache_bridges_one_bundle_gaps)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_cache *c = cache_open_gap(&f, 4 * min, 0.0, NULL, 1);
	uint32_t odd[5] = { 21, 23, 25, 27, 29 };
	fetch(&f, c, 0, odd, 5);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(f.n_got, 5, "only the requested neurons are reported");
	cr_expect_eq(st.misses, 5);
	cr_expect_eq(st.requests, 1, "5 misses 2 slots apart took %llu requests", (unsigned long long)st.requests);
	cr_expect_eq(st.gap_bundles, 4);
	check_bytes(&f, 0, odd, 5);
	cr_assert_eq(nf_cache_release(c), 0);
	/* the bridged bundles are cached: hits, with the file's bytes */
	nf_cache_stats_reset(c);
	uint32_t even[4] = { 22, 24, 26, 28 };
	f.n_got = 0;
	cr_assert_eq(nf_cache_request(c, 0, 0, even, 4, f.ptrs, ready, &f), 0);
	cr_expect_eq(f.n_got, 4);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_cold, 4);
	check_bytes(&f, 0, even, 4);
	cr_assert_eq(nf_cache_release(c), 0);
	/* 40 is cached: 39 and 41 may not bridge it; 44 is 3 slots from 41 */
	nf_cache_stats_reset(c);
	uint32_t one = 40;
	fetch(&f, c, 0, &one, 1);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_stats_reset(c);
	uint32_t split[3] = { 39, 41, 44 };
	fetch(&f, c, 0, split, 3);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.requests, 3, "a cached bundle or a wide gap must split the read (%llu requests)",
		     (unsigned long long)st.requests);
	cr_expect_eq(st.gap_bundles, 0);
	check_bytes(&f, 0, split, 3);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_close(c);
	fx_close(&f);
}

/* The hot segment goes to the neurons with the highest counts over all
 * FFNs, not an equal share per layer: a layer whose neurons fire more gets
 * more of it, one that fires little leaves its share to the others. */
Test(pipeline, cache_hot_segment_goes_to_the_ffns_that_fire_most)
{
	struct fx f;
	fx_open(&f, true);
	uint64_t min = nf_cache_min_bytes(f.store);
	const struct nf_store_object *o = nf_store_ffn_find(f.store, 0, 0);
	uint32_t N = o->n_bundles;
	struct nf_cache *c = cache_open(&f, min + min / 2, 0.5, NULL);   /* half a layer hot */
	struct nf_cache_layout L;
	nf_cache_layout_get(c, &L);
	uint32_t H = L.hot_slots;
	cr_assert(H >= 20 && H < N, "%u hot slots of %u neurons", H, N);
	struct nf_cache_geom g;
	nf_cache_geometry(c, &g);
	cr_assert_geq(g.n_layer, 2);
	/* layer 1: three neurons fire on every token; layer 0: neuron j has
	 * count j + 1 (all below layer 1's); other layers: nothing */
	uint32_t *counts = calloc(N, sizeof(uint32_t));
	for (uint32_t j = 0; j < N; j++)
		counts[j] = j + 1;
	cr_assert_eq(nf_cache_set_counts(c, 0, counts), 0);
	memset(counts, 0, N * sizeof(uint32_t));
	uint32_t top1[3] = { 7, 30, 31 };
	for (int i = 0; i < 3; i++)
		counts[top1[i]] = 10 * N;
	cr_assert_eq(nf_cache_set_counts(c, 1, counts), 0);
	uint32_t *quota = calloc(g.n_layer, sizeof(uint32_t));
	cr_assert_eq(nf_cache_hot_quota(c, H, quota), 0);
	cr_expect_eq(quota[1], 3);
	cr_expect_eq(quota[0], H - 3, "layer 0 gets the rest: %u of %u", quota[0], H);
	for (uint32_t l = 2; l < g.n_layer; l++)
		cr_expect_eq(quota[l], 0, "layer %u never fired", l);
	/* more slots than neurons that ever fired: every one of them */
	cr_assert_eq(nf_cache_hot_quota(c, 10ull * N * g.n_layer, quota), 0);
	cr_expect(quota[0] == N && quota[1] == 3);

	cr_assert_eq(nf_cache_hot_load(c), 0);
	nf_cache_stats_reset(c);
	/* layer 1's three and layer 0's H - 3 hottest are hits; the next one
	 * of layer 0 is not */
	uint32_t *ids = malloc(N * sizeof(uint32_t));
	for (uint32_t k = 0; k < H - 3; k++)
		ids[k] = N - 1 - k;
	fetch(&f, c, 0, ids, H - 3);
	check_bytes(&f, 0, ids, H - 3);
	cr_assert_eq(nf_cache_release(c), 0);
	fetch(&f, c, 1, top1, 3);
	check_bytes(&f, 1, top1, 3);
	cr_assert_eq(nf_cache_release(c), 0);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_hot, H, "%llu hot hits of %u", (unsigned long long)st.hits_hot, H);
	cr_expect_eq(st.misses, 0);
	uint32_t next = N - 1 - (H - 3);
	fetch(&f, c, 0, &next, 1);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.misses, 1);
	free(ids);
	free(quota);
	free(counts);
	nf_cache_close(c);
	fx_close(&f);
}

/* Tagged requests of two FFNs go out before one release: each reap hands
 * every completion to its own request's tag (not the reaper's user), the
 * bytes are each FFN's, and more neurons in all than an FFN has are
 * refused. */
Test(pipeline, cache_tagged_requests_go_out_together)
{
	struct fx f, g, other;
	fx_open(&f, false);
	memcpy(g.path, f.path, sizeof(g.path));
	g.store = f.store;
	g.n_got = 0;
	other.n_got = 0;
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_cache *c = cache_open(&f, 4 * min, 0.0, NULL);
	struct nf_cache_geom geom;
	nf_cache_geometry(c, &geom);
	uint32_t a[50], b[50];
	for (uint32_t i = 0; i < 50; i++) {
		a[i] = 10 + i;
		b[i] = 100 + i;
	}
	f.n_got = 0;
	cr_assert_eq(nf_cache_request_tagged(c, 0, 0, a, 50, f.ptrs, ready, &f), 0);
	cr_assert_eq(nf_cache_request_tagged(c, 1, 0, b, 50, g.ptrs, ready, &g), 0);
	while (f.n_got + g.n_got < 100)
		cr_assert(nf_cache_reap(c, ready, &other) >= 0);
	cr_expect_eq(other.n_got, 0, "completions went to the reaper's user");
	cr_expect(f.n_got == 50 && g.n_got == 50, "%u and %u reported", f.n_got, g.n_got);
	for (uint32_t i = 0; i < 50; i++)
		cr_expect(f.got[i] >= 10 && f.got[i] < 60 && g.got[i] >= 100 && g.got[i] < 150);
	check_bytes(&f, 0, a, 50);
	check_bytes(&g, 1, b, 50);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.requests, 2);
	/* in all at most one FFN's neurons between releases */
	uint32_t *ids = malloc(geom.n_neurons * sizeof(uint32_t));
	for (uint32_t i = 0; i < geom.n_neurons; i++)
		ids[i] = i;
	cr_expect_eq(nf_cache_request_tagged(c, 0, 0, ids, geom.n_neurons, f.ptrs, ready, &f), NF_EBUDGET);
	cr_assert_eq(nf_cache_release(c), 0);
	free(ids);
	nf_cache_close(c);
	fx_close(&f);
}

/* The co-activation record samples each FFN's requests over the whole
 * run: with room for 64, 150 requests of one FFN (request t asks for
 * neuron t) keep requests 0, 4, 8, ..., 148 in order, and the 10 requests
 * of another FFN (an expert seldom routed) are all kept. */
/* Several requests of one release may pin more cold slots than one FFN has
 * neurons (a token's routed experts, all cold hits): every cold slot can be
 * pinned at once (ASan saw the pinned list overflow before). */
Test(pipeline, cache_requests_of_one_release_may_pin_more_than_one_ffn)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_cache *c = cache_open(&f, 4 * min, 0.0, NULL);
	struct nf_cache_geom geom;
	nf_cache_geometry(c, &geom);
	uint32_t N = geom.n_neurons;
	uint32_t *ids = malloc(N * sizeof(uint32_t));
	for (uint32_t i = 0; i < N; i++)
		ids[i] = i;
	/* layers 0 and 1 into the cold segment, one release each */
	for (uint32_t l = 0; l < 2; l++) {
		fetch(&f, c, l, ids, N);
		cr_assert_eq(nf_cache_release(c), 0);
	}
	/* then both in one release: all cold hits, 2N slots pinned */
	f.n_got = 0;
	cr_assert_eq(nf_cache_request_tagged(c, 0, 0, ids, N, f.ptrs, ready, &f), 0);
	cr_assert_eq(nf_cache_request_tagged(c, 1, 0, ids, N, f.ptrs, ready, &f), 0);
	cr_expect_eq(f.n_got, 2 * N, "%u of %u reported as hits", f.n_got, 2 * N);
	check_bytes(&f, 1, ids, N);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_cold, 2 * (uint64_t)N);
	cr_assert_eq(nf_cache_release(c), 0);
	free(ids);
	nf_cache_close(c);
	fx_close(&f);
}

Test(pipeline, cache_signatures_sample_the_whole_run)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = 4 * min;
	o.sig_tokens = 64;
	o.io.quiet = true;
	struct nf_cache *c = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_cache_open(f.store, &o, &c, &d), 0, "%s", d.msg);
	for (uint32_t t = 0; t < 150; t++) {
		fetch(&f, c, 0, &t, 1);
		cr_assert_eq(nf_cache_release(c), 0);
		if (t < 10) {
			uint32_t j = 3 * t;
			fetch(&f, c, 1, &j, 1);
			cr_assert_eq(nf_cache_release(c), 0);
		}
	}
	uint32_t tokens = 0, words = 0;
	const uint64_t *sig = nf_cache_signatures(c, 0, 0, &tokens, &words);
	cr_assert_not_null(sig);
	cr_expect_eq(words, 1);
	cr_expect_eq(tokens, 38, "%u requests kept of 150", tokens);
	for (uint32_t j = 0; j < 150; j++) {
		uint64_t want = j % 4 ? 0 : 1ull << (j / 4);
		cr_expect_eq(sig[j], want, "neuron %u: %#llx, want %#llx", j, (unsigned long long)sig[j],
			     (unsigned long long)want);
	}
	sig = nf_cache_signatures(c, 1, 0, &tokens, &words);
	cr_expect_eq(tokens, 10);
	for (uint32_t t = 0; t < 10; t++)
		cr_expect_eq(sig[3 * t], 1ull << t);
	nf_cache_close(c);
	fx_close(&f);
}

/* The cache's cold hits, misses and prefetched bundles found since the reset. */
static void expect_found(struct nf_cache *c, uint64_t hits_cold, uint64_t misses, uint64_t prefetch_hits)
{
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect(st.hits_cold == hits_cold && st.misses == misses && st.prefetch_hits == prefetch_hits,
		  "cold hits %llu (expected %llu), misses %llu (%llu), prefetched found %llu (%llu)",
		  (unsigned long long)st.hits_cold, (unsigned long long)hits_cold, (unsigned long long)st.misses,
		  (unsigned long long)misses, (unsigned long long)st.prefetch_hits, (unsigned long long)prefetch_hits);
}

/* Route-ahead reads (nf_cache_prefetch): a later request finds their
 * bundles (waiting for those still in flight), reads only the rest, and
 * gets the store's bytes; slots still filling are never handed out, even
 * when a request needs every cold slot; a failed one caches nothing. */
Test(pipeline, cache_prefetch_is_found_by_later_requests)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	uint32_t N = nf_store_ffn_find(f.store, 0, 0)->n_bundles;
	struct nf_cache *c = cache_open(&f, min, 0.0, NULL);
	uint32_t *ids = malloc(N * sizeof(uint32_t));
	for (uint32_t j = 0; j < N; j++)
		ids[j] = j;
	/* 100 adjacent bundles: one read, reported to no one */
	cr_assert_eq(nf_cache_prefetch(c, 1, 0, ids, 100), 1);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect(st.prefetch_requests == 1 && st.prefetch_neurons == 100 && st.requests == 1 && st.lookups == 0,
		  "prefetch: %llu reads of %llu bundles, %llu requests, %llu lookups",
		  (unsigned long long)st.prefetch_requests, (unsigned long long)st.prefetch_neurons,
		  (unsigned long long)st.requests, (unsigned long long)st.lookups);
	/* half of them asked for at once (the read may still be in flight:
	 * they are reported when it lands) */
	fetch(&f, c, 1, ids + 50, 100);
	check_bytes(&f, 1, ids + 50, 100);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], 0);
	cr_assert_eq(nf_cache_release(c), 0);
	expect_found(c, 50, 50, 50);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.requests, 2);
	/* every cold slot filling for layer 0, then layer 1 asks for all of
	 * them: it waits for the reads, then evicts what they brought */
	nf_cache_stats_reset(c);
	cr_assert_gt(nf_cache_prefetch(c, 0, 0, ids, N), 0);
	fetch(&f, c, 1, ids, N);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], 0);
	check_bytes(&f, 1, ids, N);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.errors, 0);
	cr_expect_eq(st.prefetch_hits, 0);
	nf_cache_close(c);

	/* a failed route-ahead read: a request waiting for it gets the error
	 * (never bytes that did not arrive), and its bundles are misses
	 * afterwards */
	struct nf_io_fault_rule rule = { .kind = NF_IO_FAULT_EIO, .nth = 0 };
	c = cache_open(&f, 2 * min, 0.0, &rule);
	cr_assert_eq(nf_cache_prefetch(c, 0, 0, ids, 8), 1);
	fetch(&f, c, 0, ids, 8);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_lt(f.results[i], 0, "neuron %u: result %d after a failed prefetch", f.got[i], f.results[i]);
	cr_expect_lt(nf_cache_release(c), 0);
	nf_cache_stats_get(c, &st);
	cr_expect_geq(st.errors, 1);
	nf_cache_stats_reset(c);
	fetch(&f, c, 0, ids, 8);
	nf_cache_release(c);
	expect_found(c, 0, 8, 0);
	nf_cache_close(c);
	free(ids);
	fx_close(&f);
}

/* nf_cache_poll (between attention's steps) lands reads without waiting
 * and submits those queued behind them: at queue depth 1, 20 reads ahead
 * land through polls alone, so the request after them finds every bundle
 * in memory and waits for none (without the polls 19 would still be
 * queued); a poll with nothing in flight does nothing. */
Test(pipeline, cache_poll_lands_queued_reads_without_waiting)
{
	struct fx f;
	fx_open(&f, false);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = 2 * nf_cache_min_bytes(f.store);
	o.hot_fraction = 0.0;
	o.max_gap = 0;
	o.io.quiet = true;
	o.io.qd = 1;
	struct nf_cache *c = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_cache_open(f.store, &o, &c, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_cache_poll(c), 0, "nothing in flight");
	cr_assert_eq(nf_cache_poll(NULL), 0);
	uint32_t ids[20];
	for (uint32_t i = 0; i < 20; i++)
		ids[i] = 3 * i; /* 20 reads of one bundle */
	cr_assert_eq(nf_cache_prefetch(c, 0, 0, ids, 20), 20);
	int landed = 0;
	for (int k = 0; landed < 20 && k < 200000; k++) {
		int r = nf_cache_poll(c);
		cr_assert_geq(r, 0, "poll: %s", nf_strerror(r));
		landed += r;
		if (!r)
			usleep(50);
	}
	cr_assert_eq(landed, 20, "%d of 20 reads landed through polls", landed);
	cr_assert_eq(nf_cache_poll(c), 0);
	nf_cache_stats_reset(c);
	fetch(&f, c, 0, ids, 20);
	check_bytes(&f, 0, ids, 20);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], 0);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.prefetch_waits, 0, "%llu lookups waited for a read in flight",
		     (unsigned long long)st.prefetch_waits);
	cr_expect_eq(st.requests, 0, "no read for bundles already in memory");
	cr_assert_eq(nf_cache_release(c), 0);
	expect_found(c, 20, 0, 20);
	nf_cache_close(c);
	fx_close(&f);
}

/*
 * Read-ahead filling half the cold slots, then a request whose scattered
 * misses would fit the other half only if no read bridged their gaps:
 * bridging once took the free slots the later misses needed (slots still
 * filling did not count against it), and the request failed with "memory
 * budget too small" (layer-ahead under 1.5 GiB on the 7B store). Now the
 * filling slots count, and a request that still finds none waits for them.
 */
Test(pipeline, cache_gap_reads_leave_room_beside_read_ahead)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	uint32_t N = nf_store_ffn_find(f.store, 0, 0)->n_bundles;
	/* every read completes 50 ms late (the prefetch is still filling at
	 * the request); reads of at most 16 bundles, so that bridged reads
	 * fit the free slots one by one */
	struct nf_cache_geom g;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_cache_geometry_of(f.store, &g, &d), 0, "%s", d.msg);
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.max_gap = 8;
	o.arena_bytes = min;
	o.io.quiet = true;
	o.io.max_coalesce = 16ull * g.stride;
	o.io.backend = NF_IO_FAULT;
	o.io.fault.n_rules = 1;
	o.io.fault.rules[0] = (struct nf_io_fault_rule){ .kind = NF_IO_FAULT_DELAY, .prob = 1.0, .delay_us = 50000 };
	struct nf_cache *c = NULL;
	cr_assert_eq(nf_cache_open(f.store, &o, &c, &d), 0, "%s", d.msg);
	struct nf_cache_layout cl;
	nf_cache_layout_get(c, &cl);
	uint32_t C = cl.cold_slots, half = C / 2;
	cr_assert(C >= 16 && C <= N, "%u cold slots, %u bundles", C, N);
	uint32_t *ids = malloc(N * sizeof(uint32_t));
	for (uint32_t j = 0; j < N; j++)
		ids[j] = j;
	cr_assert_eq(nf_cache_prefetch(c, 0, 0, ids, half), 1);
	/* every other bundle of layer 1 for as many misses as fit beside it */
	uint32_t n = 0;
	for (uint32_t j = 0; j < N && n < C - half; j += 2)
		ids[n++] = j;
	fetch(&f, c, 1, ids, n);
	for (uint32_t i = 0; i < f.n_got; i++)
		cr_expect_eq(f.results[i], 0, "neuron %u: %s", f.got[i], nf_strerror(f.results[i]));
	check_bytes(&f, 1, ids, n);
	cr_expect_eq(nf_cache_release(c), 0);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.errors, 0);
	nf_cache_close(c);
	free(ids);
	fx_close(&f);
}

/*
 * The KV cache's loan (nf_cache_opts.lend_bytes): extra hot slots at the
 * arena's tail. Giving the loan back keeps the most used hot neurons, at
 * the right bytes, and never goes below the hot segment's own slots.
 */
Test(pipeline, cache_gives_back_the_loan_keeping_the_most_used)
{
	struct fx f;
	fx_open(&f, false);
	uint64_t min = nf_cache_min_bytes(f.store);
	const struct nf_store_object *o = nf_store_ffn_find(f.store, 0, 0);
	struct nf_cache_geom g;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_cache_geometry_of(f.store, &g, &d), 0);
	uint32_t N = o->n_bundles, want = N / 2;
	cr_assert(want >= 24, "%u neurons", N);
	/* a loan of about want slots; no hot segment of its own */
	uint64_t lend = (2ull << 20) + (uint64_t)want * (g.stride + 64);
	uint32_t lent;
	uint64_t cost = nf_cache_lend_cost(f.store, lend, &lent);
	cr_assert(lent >= want && cost > (2ull << 20), "%u slots lent, cost %llu", lent, (unsigned long long)cost);
	struct nf_cache_opts co;
	nf_cache_opts_default(&co);
	co.max_gap = 0;
	co.arena_bytes = min;
	co.hot_fraction = 0;
	co.lend_bytes = lend;
	co.io.quiet = true;
	struct nf_cache *c = NULL;
	int rc = nf_cache_open(f.store, &co, &c, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_cache_layout L;
	nf_cache_layout_get(c, &L);
	cr_assert_eq(L.hot_floor, 0);
	cr_assert_eq(L.hot_slots, lent);
	cr_expect_eq(L.lent, (uint64_t)lent * g.stride);
	/* layer 0's neuron j fires j + 1 times: the top `lent` are hot */
	uint32_t *counts = calloc(N, sizeof(uint32_t));
	for (uint32_t j = 0; j < N; j++)
		counts[j] = j + 1;
	cr_assert_eq(nf_cache_set_counts(c, 0, counts), 0);
	cr_assert_eq(nf_cache_hot_load(c), 0);
	/* give back all but 16 slots' worth */
	uint32_t keep = 16;
	cr_assert_eq(nf_cache_give_back(c, lend - cost - (uint64_t)keep * g.stride), 0);
	nf_cache_layout_get(c, &L);
	cr_assert_eq(L.hot_slots, keep, "%u hot slots", L.hot_slots);
	/* the 16 most used stayed, with their bytes; the next ones left */
	uint32_t top[16], next[8];
	for (uint32_t i = 0; i < keep; i++)
		top[i] = N - keep + i;
	for (uint32_t i = 0; i < 8; i++)
		next[i] = N - keep - 8 + i;
	nf_cache_stats_reset(c);
	fetch(&f, c, 0, top, keep);
	struct nf_cache_stats st;
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_hot, keep, "%llu hot hits", (unsigned long long)st.hits_hot);
	cr_expect_eq(st.misses, 0);
	check_bytes(&f, 0, top, keep);
	cr_assert_eq(nf_cache_release(c), 0);
	nf_cache_stats_reset(c);
	fetch(&f, c, 0, next, 8);
	nf_cache_stats_get(c, &st);
	cr_expect_eq(st.hits_hot, 0);
	cr_expect_eq(st.misses, 8);
	check_bytes(&f, 0, next, 8);
	cr_assert_eq(nf_cache_release(c), 0);
	/* the rest, and more: never below the segment's own (none here) */
	cr_assert_eq(nf_cache_give_back(c, lend), 0);
	nf_cache_layout_get(c, &L);
	cr_expect_eq(L.hot_slots, 0);
	cr_expect_eq(L.lent, 0);
	nf_cache_stats_reset(c);
	fetch(&f, c, 0, top, keep);
	check_bytes(&f, 0, top, keep);
	cr_assert_eq(nf_cache_release(c), 0);
	free(counts);
	nf_cache_close(c);
	fx_close(&f);
}
