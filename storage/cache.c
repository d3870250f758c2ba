/*
 * cache.c - the segmented neuron cache (nflash/cache.h): one arena split
 * into pinned, hot and cold segments; lookups, coalesced miss reads through
 * the store's I/O context, and the cluster-ready event queue.
 *
 * Invariants:
 *  1. The arena is the only large allocation; its size is fixed at open
 *     (arena_bytes). Everything else is O(n_layer * n_neurons) metadata,
 *     counted in meta_bytes.
 *  2. A neuron is in at most one slot: loc[] says where (hot or cold slot)
 *     and the slot's owner says which neuron, so eviction clears exactly
 *     one loc entry.
 *  3. Slots handed out by a request are pinned until nf_cache_release();
 *     the CLOCK hand never evicts a pinned slot, and a slot whose read is
 *     in flight is pinned.
 *  4. Misses of bundles adjacent in the store (consecutive slots of the
 *     FFN object) go to adjacent cold slots and are read with one request.
 *  5. Completion events are pushed under ev_lock by whichever thread runs
 *     the I/O callback and popped by reapers; only one thread at a time
 *     waits on the I/O context (wait_lock), the others nap on ev_cond
 *     until an event is queued or a reaper hands some.
 *  6. A failed read frees its slots (loc cleared) so no later lookup can
 *     hit on bytes that never arrived.
 *  7. Counts are per neuron id; a store profile only seeds them. A hot
 *     load reads each layer's chosen neurons sorted by store slot, one
 *     request per run of adjacent slots (split at max_coalesce by the I/O
 *     context), so a hot-first store's hot set is a few large reads.
 *  8. A route-ahead read (nf_cache_prefetch) fills unpinned cold slots
 *     marked inflight; only the requesting thread changes slot state (the
 *     completion sets its record's state and queues the events of the
 *     neurons requests asked for meanwhile, under ev_lock; pf_settle
 *     applies the state). An inflight slot is never evicted or moved; a
 *     lookup that finds one pins it and its neuron is reported when the
 *     read lands, so compute sees only landed, checked bytes.
 */
#include <errno.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "nflash/bundle.h"
#include "nflash/cache.h"
#include "nflash/crc32c.h"
#include "nflash/dtype.h"
#include "nflash/store.h"

#define NO_SLOT UINT32_MAX
#define HOT_BIT 0x80000000u

struct slot_meta {
	uint32_t ffn;      /* index into ffns, or NO_SLOT when free */
	uint32_t neuron;
	uint8_t ref;       /* CLOCK second chance */
	uint8_t pinned;
	uint8_t inflight;  /* a route-ahead read (nf_cache_prefetch) is filling it */
	uint8_t prefetched; /* filled by a route-ahead read, not yet asked for */
	uint32_t pf;       /* while inflight: that read's record (index into pf) */
};

struct ffn_ent {
	const struct nf_store_object *obj;
	uint32_t *loc;     /* per neuron: cold slot, hot slot | HOT_BIT, or NO_SLOT */
	uint32_t *count;   /* per neuron: times requested (or profile counts) */
	uint32_t *inv;     /* per store slot: its neuron (the permutation inverted) */
	uint64_t *sig;     /* sig_tokens: n_neurons rows of sig_words; bit t of a row: asked
			    * for by this FFN's t-th sampled request (NULL when not recording) */
	uint32_t sig_n;    /* requests recorded in sig */
	uint32_t sig_every; /* requests are sampled every sig_every (a power of two) */
	uint64_t sig_seen;  /* requests of this FFN so far */
};

/* One read: a run of bundles of one FFN landing in adjacent slots. */
struct read_rec {
	struct nf_cache *c;
	uint32_t ffn;
	uint32_t first_slot;   /* arena cold slot of the first bundle */
	uint32_t n;            /* requested neurons reported (neurons[]) */
	uint32_t n_slots;      /* cold slots the read fills (n, plus bridged gaps) */
	uint32_t *neurons;     /* into run_neurons */
	uint32_t *store_slots; /* into run_slots */
	void *tag;             /* the request's tag: reap hands it to fn instead of its user */
	struct read_rec *next_waiter; /* a request's neuron waiting on the same route-ahead read */
	int result;
	bool queued;
};

struct event {
	struct read_rec *r;
};

/* A route-ahead read (nf_cache_prefetch): cold slots [first_slot, +n_slots)
 * filling, reported to no one. Its completion only sets state; the
 * requesting thread settles it (pf_settle). n_slots 0: settled. */
struct pf_rec {
	struct nf_cache *c;
	uint32_t first_slot, n_slots;
	atomic_int state;      /* 1 in flight, 0 landed, < 0 failed (set under ev_lock) */
	/* neurons a request asked for while the read was in flight: one
	 * record each (n 1), queued as events when it lands (under ev_lock) */
	struct read_rec *waiters;
};

struct nf_cache {
	struct nf_store *store;
	struct nf_io_ctx *io;
	struct nf_cache_geom g;
	uint32_t n_ffn;
	struct ffn_ent *ffns;          /* layer * n_expert + expert */

	char *arena;
	uint64_t arena_bytes;
	uint64_t pinned_cap, pinned_used; /* pinned segment: limit (0: none), bytes held */
	void **pins;                   /* its buffers, one per pinned object */
	uint32_t n_pins, cap_pins;
	struct nf_io_opts io_opts;     /* the I/O context's settings */
	bool has_ffn;                  /* the FFN segments are set up */
	char *hot, *cold;
	uint32_t n_hot, n_cold;
	/* the loan (nf_cache_opts.lend_bytes): hot slots [hot_floor, n_hot),
	 * the arena's tail, live on it */
	uint32_t hot_floor;
	uint64_t lend_bytes, lend_taken, lend_cost;
	struct slot_meta *hot_meta, *cold_meta;
	uint32_t hand;
	bool hugepages, numa;
	uint32_t sig_words;            /* co-activation record: words per neuron (0: off) */

	/* the current requests (several may go out before a release, their
	 * misses laid out one after the other from run_base, n_neurons in all) */
	struct read_rec *reads;        /* n_neurons at most */
	uint32_t n_reads;
	uint32_t *run_neurons, *run_slots, *order;
	uint32_t run_base;
	void *cur_tag;
	uint64_t *sortbuf;
	uint32_t *pinned_list;         /* cold slots pinned by the current layer (max(N, n_cold)) */
	uint32_t n_pinned_list;
	/* cold slots the layer's later requests will pin (nf_cache_reserve):
	 * a read bridges a gap only while they stay free */
	uint32_t reserved;
	atomic_uint outstanding;       /* reads not yet reaped */
	int layer_err;
	/* route-ahead reads in flight across releases: a ring of pf_cap
	 * records [pf_head, pf_tail), pf_slots cold slots filling */
	struct pf_rec *pf;
	uint32_t pf_cap, pf_head, pf_tail, pf_slots;

	/* events */
	pthread_mutex_t ev_lock;
	pthread_mutex_t wait_lock;
	pthread_cond_t ev_cond;        /* an event landed, or a reaper handed some */
	atomic_uint ev_sleepers;       /* reapers napping on ev_cond */
	struct event *ev;              /* ring of n_neurons */
	uint32_t ev_head, ev_tail, ev_cap;

	struct nf_cache_stats st;
	uint64_t meta_bytes;
	uint64_t max_coalesce;         /* the I/O context's, for counting hot reads */
	uint32_t max_gap;              /* bundles a miss read may bridge */
	uint32_t *span_slots;          /* one read's store slots (gaps included) */
	/* rebalance: one FFN's slots of each segment, and one bundle in transit */
	uint64_t *rb_hot, *rb_cold;
	char *rb_buf;
	bool hot_from_profile;
	int profile_error;
	uint64_t profile_tokens;
};

void nf_cache_opts_default(struct nf_cache_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->hot_fraction = 0.5;
	o->numa_node = -1;
	o->use_profile = true;
	o->profile_hot_fraction = 1.0;
	nf_io_opts_default(&o->io);
	/* misses are scattered bundles of a few KiB: the device needs many in
	 * flight, and a layer's ~300 reads are best submitted at once
	 * (bench-decode at 2 GiB: I/O wait 55% at 32, 25-28% at 128; with the
	 * co-activation layout FFN time 5.22 s at 128, 4.74 s at 256, 5.07 s
	 * at 384, medians of 3) */
	o->io.qd = 256;
	o->max_gap = 4;
}

/* Fault every page in now, after the NUMA placement, so that tokens do not
 * pay for zeroing pages (clear_page was ~9% of a budgeted run's CPU). */
static void prefault(char *p, uint64_t n)
{
#ifdef MADV_POPULATE_WRITE
	if (madvise(p, n, MADV_POPULATE_WRITE) == 0)
		return;
#endif
	for (uint64_t o = 0; o < n; o += 4096)
		((volatile char *)p)[o] = 0;
}

static int geom_of(const struct nf_store_object *obj, struct nf_cache_geom *g)
{
	memset(g, 0, sizeof(*g));
	g->dim = obj->dim;
	g->n_neurons = obj->n_bundles;
	g->dtype = obj->dtype;
	g->down_dtype = obj->down_dtype;
	g->down_form = obj->down_form == NF_DOWN_QCOL ? NF_CACHE_DOWN_QCOL : NF_CACHE_DOWN_ROW;
	g->has_gate = obj->has_gate;
	g->row_bytes = obj->row_bytes;
	g->down_off = obj->down_off;
	g->stride = obj->stride;
	return 0;
}

static int scan_ffns(struct nf_store *s, struct nf_cache_geom *g, struct nf_diag *d)
{
	memset(g, 0, sizeof(*g));
	bool any = false;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		if (o->kind != NF_STORE_KIND_FFN)
			continue;
		struct nf_cache_geom h;
		geom_of(o, &h);
		if (!any) {
			*g = h;
			any = true;
		} else if (h.dim != g->dim || h.n_neurons != g->n_neurons || h.dtype != g->dtype ||
			   h.has_gate != g->has_gate || h.stride != g->stride || h.down_form != g->down_form ||
			   h.down_off != g->down_off ||
			   (nf_dtype_is_kquant(h.down_dtype) != nf_dtype_is_kquant(g->down_dtype)) ||
			   (!nf_dtype_is_kquant(h.down_dtype) && h.down_dtype != g->down_dtype)) {
			return nf_diag_fail(d, NF_EUSAGE, "%s: FFN object %s has another geometry than the first",
					    nf_store_path(s), o->name);
		}
		if (o->layer + 1 > g->n_layer)
			g->n_layer = o->layer + 1;
		if (o->expert + 1 > g->n_expert)
			g->n_expert = o->expert + 1;
	}
	if (!any)
		return nf_diag_fail(d, NF_EUSAGE, "%s: the store has no FFN objects", nf_store_path(s));
	return 0;
}

uint64_t nf_cache_min_bytes(struct nf_store *s)
{
	return nf_cache_min_bytes_for(s, 0);
}

uint64_t nf_cache_min_bytes_for(struct nf_store *s, uint32_t min_cold_slots)
{
	struct nf_cache_geom g;
	if (scan_ffns(s, &g, NULL) < 0)
		return 0;
	uint32_t k = min_cold_slots && min_cold_slots < g.n_neurons ? min_cold_slots : g.n_neurons;
	return (uint64_t)k * g.stride;
}

/* The arena's hot and cold slots under o (the pinned segment is apart). */
static void split(struct nf_store *s, const struct nf_cache_geom *g, const struct nf_cache_opts *o, uint32_t *n_hot,
		  uint32_t *n_cold)
{
	uint32_t cold_min = o->min_cold_slots && o->min_cold_slots < g->n_neurons ? o->min_cold_slots : g->n_neurons;
	uint64_t min_cold = (uint64_t)cold_min * g->stride;
	uint64_t rest = o->arena_bytes;
	double hf = o->use_profile && nf_store_has_profile(s) ? o->profile_hot_fraction : o->hot_fraction;
	hf = hf < 0 ? 0 : hf > 1 ? 1 : hf;
	uint64_t hot = (uint64_t)((double)rest * hf);
	if (rest - hot < min_cold)
		hot = rest > min_cold ? rest - min_cold : 0;
	*n_hot = (uint32_t)(hot / g->stride);
	*n_cold = (uint32_t)((rest - (uint64_t)*n_hot * g->stride) / g->stride);
}

int nf_cache_split_for(struct nf_store *s, const struct nf_cache_opts *o, uint32_t *n_hot, uint32_t *n_cold)
{
	struct nf_cache_geom g;
	int rc = scan_ffns(s, &g, NULL);
	if (rc < 0)
		return rc;
	split(s, &g, o, n_hot, n_cold);
	return 0;
}

int nf_cache_geometry_of(struct nf_store *s, struct nf_cache_geom *g, struct nf_diag *d)
{
	return scan_ffns(s, g, d);
}

/* The metadata nf_cache_open allocates beside the arena (meta()), for a
 * geometry, slot counts and record: the same terms, in the same order. */
static uint64_t meta_bytes_for(const struct nf_cache_geom *g, uint32_t n_ffn_present, uint64_t n_hot,
			       uint64_t n_cold, uint32_t sig_words)
{
	uint64_t N = g->n_neurons, n_ffn = (uint64_t)g->n_layer * g->n_expert;
	return n_ffn * sizeof(struct ffn_ent) + (n_hot + 1) * sizeof(struct slot_meta) +
	       n_cold * sizeof(struct slot_meta) + (N + 1) * sizeof(struct read_rec) + N * sizeof(uint64_t) +
	       4 * N * sizeof(uint32_t) + (N > n_hot + n_cold ? N : n_hot + n_cold) * sizeof(uint32_t) +
	       (N + 2) * sizeof(struct event) + n_ffn * 3 * N * sizeof(uint32_t) +
	       (uint64_t)n_ffn_present * N * sig_words * sizeof(uint64_t) +
	       (n_hot + n_cold + 2) * sizeof(uint64_t) + g->stride + (N + 1) * sizeof(struct pf_rec);
}

static uint32_t ffns_present(struct nf_store *s)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++)
		n += nf_store_object_get(s, i)->kind == NF_STORE_KIND_FFN;
	return n;
}

uint64_t nf_cache_meta_bytes_for(struct nf_store *s, uint64_t arena_bytes, uint32_t sig_tokens)
{
	struct nf_cache_geom g;
	if (scan_ffns(s, &g, NULL) < 0)
		return 0;
	uint64_t slots = arena_bytes / g.stride;
	return meta_bytes_for(&g, ffns_present(s), slots, 0, (uint32_t)(((uint64_t)sig_tokens + 63) / 64));
}

/* Per cold slot, the tables nf_cache_open allocates (meta_bytes_for's
 * per-slot terms), and the rounding of a give-back. */
#define SLOT_TABLE_BYTES (sizeof(struct slot_meta) + sizeof(uint32_t) + sizeof(uint64_t))
#define GIVE_BACK_ALIGN (2ull << 20)

static uint32_t lend_slots(const struct nf_cache_geom *g, uint64_t lend_bytes)
{
	if (lend_bytes <= GIVE_BACK_ALIGN || !g->stride)
		return 0;
	uint64_t n = (lend_bytes - GIVE_BACK_ALIGN) / (g->stride + SLOT_TABLE_BYTES);
	return n > UINT32_MAX / 2 ? UINT32_MAX / 2 : (uint32_t)n;
}

uint64_t nf_cache_lend_cost(struct nf_store *s, uint64_t lend_bytes, uint32_t *slots)
{
	struct nf_cache_geom g;
	uint32_t n = 0;
	if (scan_ffns(s, &g, NULL) == 0)
		n = lend_slots(&g, lend_bytes);
	if (slots)
		*slots = n;
	return n ? GIVE_BACK_ALIGN + (uint64_t)n * SLOT_TABLE_BYTES : 0;
}

static bool seed_from_profile(struct nf_cache *c);
static void ffn_teardown(struct nf_cache *c);
static void pf_drain(struct nf_cache *c);

static void *meta(struct nf_cache *c, size_t n)
{
	void *p = calloc(1, n ? n : 1);
	if (p)
		c->meta_bytes += n;
	return p;
}

int nf_cache_open_dense(struct nf_store *s, const struct nf_io_opts *io, struct nf_cache **out,
			struct nf_diag *d)
{
	struct nf_cache *c = calloc(1, sizeof(*c));
	if (!c)
		return nf_diag_fail(d, -ENOMEM, "cache: out of memory");
	c->store = s;
	pthread_mutex_init(&c->ev_lock, NULL);
	pthread_mutex_init(&c->wait_lock, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&c->ev_cond, &ca);
	pthread_condattr_destroy(&ca);
	if (io)
		c->io_opts = *io;
	else
		nf_io_opts_default(&c->io_opts);
	int rc = nf_io_ctx_open(s, &c->io_opts, &c->io, d);
	if (rc < 0) {
		nf_cache_close(c);
		return rc;
	}
	*out = c;
	return 0;
}

int nf_cache_reopen_io(struct nf_cache *c, const struct nf_io_opts *o, struct nf_diag *d)
{
	if (c->io && !memcmp(&c->io_opts, o, sizeof(*o)))
		return 0;
	struct nf_io_ctx *io = NULL;
	int rc = nf_io_ctx_open(c->store, o, &io, d);
	if (rc < 0)
		return rc;
	if (c->pf)
		pf_drain(c); /* route-ahead reads land in the old context */
	nf_io_ctx_close(c->io);
	c->io = io;
	c->io_opts = *o;
	return 0;
}

static int ffn_setup(struct nf_cache *c, const struct nf_cache_opts *o, struct nf_diag *d)
{
	int rc;
	struct nf_store *s = c->store;
	c->sig_words = (uint32_t)(((uint64_t)o->sig_tokens + 63) / 64);
	if ((rc = scan_ffns(s, &c->g, d)) < 0)
		return rc;
	const struct nf_cache_geom *g = &c->g;
	uint32_t cold_min = o->min_cold_slots && o->min_cold_slots < g->n_neurons ? o->min_cold_slots : g->n_neurons;
	uint64_t min_cold = (uint64_t)cold_min * g->stride;
	if (o->arena_bytes < min_cold)
		return nf_diag_fail(d, NF_EBUDGET,
				    "cache: %llu bytes for the neuron cache, at least %llu needed (%u cold bundles of "
				    "%u bytes%s)",
				    (unsigned long long)o->arena_bytes, (unsigned long long)min_cold, cold_min,
				    g->stride, cold_min == g->n_neurons ? ": one layer's" : "");
	c->arena_bytes = o->arena_bytes;
	if (o->pinned_bytes)
		c->pinned_cap = o->pinned_bytes;
	split(s, g, o, &c->n_hot, &c->n_cold);
	/* the loan's slots are hot slots, the arena's tail (the cold segment
	 * comes first), so that giving them back frees whole pages */
	c->hot_floor = c->n_hot;
	uint32_t lent = lend_slots(g, o->lend_bytes);
	if (lent) {
		c->lend_bytes = o->lend_bytes;
		c->lend_cost = GIVE_BACK_ALIGN + (uint64_t)lent * SLOT_TABLE_BYTES;
		c->n_hot += lent;
		c->arena_bytes = (uint64_t)(c->n_hot + c->n_cold) * g->stride;
		if (c->arena_bytes < o->arena_bytes)
			c->arena_bytes = o->arena_bytes;
	}

	c->n_ffn = g->n_layer * g->n_expert;
	uint32_t N = g->n_neurons;
	if (!(c->ffns = meta(c, c->n_ffn * sizeof(*c->ffns))) ||
	    !(c->hot_meta = meta(c, (c->n_hot + 1) * sizeof(struct slot_meta))) ||
	    !(c->cold_meta = meta(c, c->n_cold * sizeof(struct slot_meta))) ||
	    !(c->reads = meta(c, (N + 1) * sizeof(struct read_rec))) ||
	    !(c->sortbuf = meta(c, N * sizeof(uint64_t))) ||
	    !(c->run_neurons = meta(c, N * sizeof(uint32_t))) ||
	    !(c->run_slots = meta(c, N * sizeof(uint32_t))) ||
	    !(c->span_slots = meta(c, N * sizeof(uint32_t))) ||
	    !(c->rb_hot = meta(c, ((size_t)c->n_hot + 1) * sizeof(uint64_t))) ||
	    !(c->rb_cold = meta(c, ((size_t)c->n_cold + 1) * sizeof(uint64_t))) ||
	    !(c->rb_buf = meta(c, g->stride)) ||
	    !(c->order = meta(c, N * sizeof(uint32_t))) ||
	    /* every cold slot may be pinned at once (several requests of a
	     * release: a token's routed experts) */
	    !(c->pinned_list = meta(c, (N > c->n_cold ? N : c->n_cold) * sizeof(uint32_t))) ||
	    !(c->ev = meta(c, (N + 2) * sizeof(struct event))) ||
	    !(c->pf = meta(c, (N + 1) * sizeof(struct pf_rec))))
		return nf_diag_fail(d, -ENOMEM, "cache: out of memory");
	c->ev_cap = N + 2;
	c->pf_cap = N + 1;
	for (uint32_t i = 0; i < c->n_hot; i++)
		c->hot_meta[i].ffn = NO_SLOT;
	for (uint32_t i = 0; i < c->n_cold; i++)
		c->cold_meta[i].ffn = NO_SLOT;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_FFN)
			continue;
		struct ffn_ent *f = &c->ffns[ob->layer * g->n_expert + ob->expert];
		f->obj = ob;
	}
	for (uint32_t i = 0; i < c->n_ffn; i++) {
		if (!(c->ffns[i].loc = meta(c, N * sizeof(uint32_t))) ||
		    !(c->ffns[i].count = meta(c, N * sizeof(uint32_t))) ||
		    !(c->ffns[i].inv = meta(c, N * sizeof(uint32_t))))
			return nf_diag_fail(d, -ENOMEM, "cache: out of memory");
		if (c->sig_words && c->ffns[i].obj &&
		    !(c->ffns[i].sig = meta(c, (size_t)N * c->sig_words * sizeof(uint64_t))))
			return nf_diag_fail(d, -ENOMEM, "cache: no memory for the co-activation record (%u tokens)",
					    c->sig_words * 64);
		memset(c->ffns[i].loc, 0xff, N * sizeof(uint32_t));
		if (c->ffns[i].obj)
			for (uint32_t j = 0; j < N; j++)
				c->ffns[i].inv[c->ffns[i].obj->perm[j]] = j;
	}
	/* the profile's counts before the arena: reading and parsing the
	 * section takes twice its size for a moment, which the arena's pages
	 * would otherwise have to stand beside */
	bool seeded = o->use_profile && nf_store_has_profile(s) && seed_from_profile(c);
	c->arena = mmap(NULL, c->arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (c->arena == MAP_FAILED) {
		c->arena = NULL;
		return nf_diag_fail(d, -ENOMEM, "cache: cannot map an arena of %llu bytes",
				    (unsigned long long)c->arena_bytes);
	}
#ifdef MADV_HUGEPAGE
	c->hugepages = madvise(c->arena, c->arena_bytes, MADV_HUGEPAGE) == 0;
#endif
	if (numa_available() >= 0) {
		int node = o->numa_node >= 0 ? o->numa_node : numa_node_of_cpu(sched_getcpu());
		if (node >= 0) {
			numa_tonode_memory(c->arena, c->arena_bytes, node);
			c->numa = true;
		}
	}
	if (o->prefault)
		prefault(c->arena, c->arena_bytes);
	c->cold = c->arena;
	c->hot = c->cold + (uint64_t)c->n_cold * g->stride;

	if ((rc = nf_cache_reopen_io(c, &o->io, d)) < 0)
		return rc;
	nf_cache_stats_reset(c);
	c->max_coalesce = o->io.max_coalesce ? o->io.max_coalesce : (1u << 20);
	c->max_gap = o->max_gap;
	c->has_ffn = true;
	if (seeded) {
		if ((rc = nf_cache_hot_load(c)) < 0)
			return rc;
		c->hot_from_profile = true;
	}
	return 0;
}

int nf_cache_ffn_setup(struct nf_cache *c, const struct nf_cache_opts *o, struct nf_diag *d)
{
	if (c->has_ffn)
		return nf_diag_fail(d, NF_EUSAGE, "cache: the FFN segments are already set up");
	int rc = ffn_setup(c, o, d);
	if (rc < 0)
		ffn_teardown(c);
	return rc;
}

int nf_cache_open(struct nf_store *s, const struct nf_cache_opts *o, struct nf_cache **out,
		  struct nf_diag *d)
{
	struct nf_cache *c = NULL;
	int rc = nf_cache_open_dense(s, &o->io, &c, d);
	if (rc < 0)
		return rc;
	if ((rc = nf_cache_ffn_setup(c, o, d)) < 0) {
		nf_cache_close(c);
		return rc;
	}
	*out = c;
	return 0;
}

/* Everything nf_cache_ffn_setup made, freed; the pinned segment and the
 * I/O context stay. */
static void ffn_teardown(struct nf_cache *c)
{
	if (c->ffns)
		for (uint32_t i = 0; i < c->n_ffn; i++) {
			free(c->ffns[i].loc);
			free(c->ffns[i].count);
			free(c->ffns[i].inv);
			free(c->ffns[i].sig);
		}
	free(c->ffns);
	free(c->hot_meta);
	free(c->cold_meta);
	free(c->reads);
	free(c->run_neurons);
	free(c->run_slots);
	free(c->span_slots);
	free(c->rb_hot);
	free(c->rb_cold);
	free(c->rb_buf);
	free(c->order);
	free(c->sortbuf);
	free(c->pinned_list);
	free(c->ev);
	free(c->pf);
	c->pf = NULL;
	c->pf_cap = c->pf_head = c->pf_tail = c->pf_slots = 0;
	if (c->arena)
		munmap(c->arena, c->arena_bytes);
	c->ffns = NULL;
	c->hot_meta = c->cold_meta = NULL;
	c->reads = NULL;
	c->run_neurons = c->run_slots = c->span_slots = c->order = c->pinned_list = NULL;
	c->rb_hot = c->rb_cold = c->sortbuf = NULL;
	c->rb_buf = NULL;
	c->ev = NULL;
	c->arena = c->hot = c->cold = NULL;
	c->arena_bytes = c->meta_bytes = 0;
	c->n_ffn = c->n_hot = c->n_cold = c->ev_cap = c->hot_floor = 0;
	c->lend_bytes = c->lend_taken = c->lend_cost = 0;
	c->has_ffn = false;
}

void nf_cache_close(struct nf_cache *c)
{
	if (!c)
		return;
	nf_io_ctx_close(c->io);
	ffn_teardown(c);
	for (uint32_t i = 0; i < c->n_pins; i++)
		nf_io_buf_free(c->pins[i]);
	free(c->pins);
	pthread_mutex_destroy(&c->ev_lock);
	pthread_mutex_destroy(&c->wait_lock);
	pthread_cond_destroy(&c->ev_cond);
	free(c);
}

void nf_cache_geometry(const struct nf_cache *c, struct nf_cache_geom *g)
{
	*g = c->g;
}

/* ---- cold slots: CLOCK over runs ------------------------------------------------ */

static void evict(struct nf_cache *c, struct slot_meta *m)
{
	m->prefetched = 0;
	if (m->ffn != NO_SLOT) {
		c->ffns[m->ffn].loc[m->neuron] = NO_SLOT;
		m->ffn = NO_SLOT;
		c->st.evictions++;
	}
}

/*
 * Find k adjacent unpinned cold slots. First sweep: slots with their
 * reference bit set get a second chance (bit cleared, window restarts
 * past them); after two sweeps reference bits are ignored. Returns the
 * first slot, or NO_SLOT when no k adjacent unpinned slots exist.
 */
static uint32_t clock_alloc(struct nf_cache *c, uint32_t k)
{
	if (k == 0 || k > c->n_cold)
		return NO_SLOT;
	uint64_t budget = 2ull * c->n_cold + k;
	for (int pass = 0; pass < 2; pass++) {
		uint64_t steps = 0;
		uint32_t h = c->hand;
		while (steps < budget) {
			if (h + k > c->n_cold) {
				steps += c->n_cold - h;
				h = 0;
				continue;
			}
			uint32_t bad = NO_SLOT;
			for (uint32_t i = 0; i < k; i++) {
				struct slot_meta *m = &c->cold_meta[h + i];
				bool busy = m->pinned || m->inflight;
				if (busy || (pass == 0 && m->ref)) {
					if (!busy)
						m->ref = 0;
					bad = i;
					break;
				}
			}
			if (bad == NO_SLOT) {
				c->hand = (h + k) % c->n_cold;
				return h;
			}
			steps += bad + 1;
			h += bad + 1;
		}
	}
	return NO_SLOT;
}

static int cmp_pair_asc(const void *a, const void *b);

int nf_cache_give_back(struct nf_cache *c, uint64_t bytes)
{
	if (!c->has_ffn || !c->lend_bytes || !bytes)
		return 0;
	c->lend_taken += bytes;
	/* what the loan's slots may still hold, the rounding and their tables
	 * counted */
	uint64_t left = c->lend_bytes > c->lend_taken + c->lend_cost ? c->lend_bytes - c->lend_taken - c->lend_cost : 0;
	uint64_t keep = left / c->g.stride;
	uint32_t n = c->hot_floor + (keep < c->n_hot - c->hot_floor ? (uint32_t)keep : c->n_hot - c->hot_floor);
	if (n >= c->n_hot)
		return 0;
	if (c->n_pinned_list || atomic_load(&c->outstanding))
		return -EBUSY;
	pf_drain(c);
	/* the n_hot - n least used hot neurons leave (empty slots first) */
	uint32_t k = c->n_hot - n;
	uint64_t *by = malloc((size_t)c->n_hot * sizeof(uint64_t));
	if (!by)
		return -ENOMEM;
	for (uint32_t i = 0; i < c->n_hot; i++) {
		const struct slot_meta *m = &c->hot_meta[i];
		uint64_t cnt = m->ffn == NO_SLOT ? 0 : 1ull + c->ffns[m->ffn].count[m->neuron];
		by[i] = (cnt > UINT32_MAX ? UINT32_MAX : cnt) << 32 | i;
	}
	qsort(by, c->n_hot, sizeof(uint64_t), cmp_pair_asc);
	for (uint32_t q = 0; q < k; q++) {
		struct slot_meta *m = &c->hot_meta[(uint32_t)by[q]];
		if (m->ffn != NO_SLOT)
			c->ffns[m->ffn].loc[m->neuron] = NO_SLOT;
		m->ffn = NO_SLOT;
	}
	free(by);
	/* the tail's survivors move into the freed slots below n: bytes as
	 * read, so nothing a kernel computes changes */
	uint32_t to = 0;
	for (uint32_t i = n; i < c->n_hot; i++) {
		struct slot_meta *m = &c->hot_meta[i];
		if (m->ffn == NO_SLOT)
			continue;
		while (c->hot_meta[to].ffn != NO_SLOT)
			to++;
		memcpy(c->hot + (uint64_t)to * c->g.stride, c->hot + (uint64_t)i * c->g.stride, c->g.stride);
		c->hot_meta[to] = *m;
		c->ffns[m->ffn].loc[m->neuron] = to | HOT_BIT;
		m->ffn = NO_SLOT;
	}
	/* the pages wholly past the slots kept (a huge page's worth of
	 * rounding is lend_cost's) go back to the system */
	uintptr_t from = (uintptr_t)(c->hot + (uint64_t)n * c->g.stride);
	uintptr_t end = (uintptr_t)(c->arena + c->arena_bytes);
	from = (from + GIVE_BACK_ALIGN - 1) & ~(uintptr_t)(GIVE_BACK_ALIGN - 1);
	if (from < end)
		madvise((void *)from, end - from, MADV_DONTNEED);
	c->n_hot = n;
	c->st.hot_given_back += k;
	return 0;
}

/* ---- events ------------------------------------------------------------------------ */

static void ev_push_locked(struct nf_cache *c, struct read_rec *r)
{
	c->ev[c->ev_tail].r = r;
	c->ev_tail = (c->ev_tail + 1) % c->ev_cap;
	if (atomic_load_explicit(&c->ev_sleepers, memory_order_relaxed))
		pthread_cond_signal(&c->ev_cond);
}

static void ev_push(struct nf_cache *c, struct read_rec *r)
{
	pthread_mutex_lock(&c->ev_lock);
	ev_push_locked(c, r);
	pthread_mutex_unlock(&c->ev_lock);
}

static struct read_rec *ev_pop(struct nf_cache *c)
{
	struct read_rec *r = NULL;
	pthread_mutex_lock(&c->ev_lock);
	if (c->ev_head != c->ev_tail) {
		r = c->ev[c->ev_head].r;
		c->ev_head = (c->ev_head + 1) % c->ev_cap;
	}
	pthread_mutex_unlock(&c->ev_lock);
	return r;
}

static void read_done(void *cookie, int result)
{
	struct read_rec *r = cookie;
	r->result = result;
	ev_push(r->c, r);
}

/* ---- route-ahead reads (nf_cache_prefetch) ---------------------------------------------- */

static void pf_settle(struct nf_cache *c);

/* A route-ahead read landed: its state, and the neurons requests are
 * waiting for reported (as the read's own events would be). */
static void pf_done(void *cookie, int result)
{
	struct pf_rec *r = cookie;
	struct nf_cache *c = r->c;
	pthread_mutex_lock(&c->ev_lock);
	atomic_store_explicit(&r->state, result < 0 ? result : 0, memory_order_release);
	for (struct read_rec *w = r->waiters; w; w = w->next_waiter) {
		w->result = result;
		ev_push_locked(c, w);
	}
	r->waiters = NULL;
	pthread_mutex_unlock(&c->ev_lock);
}

/* Neuron j of FFN fi, in cold slot l that a route-ahead read is filling:
 * if that read is still in flight, j is handed out now (ptrs, pinned) and
 * reported through reap when it lands; returns true. Else (landed, or
 * failed: then j is a miss) false, the read settled. */
static bool pf_wait_for(struct nf_cache *c, uint32_t fi, uint32_t j, uint32_t l, const void **ptrs)
{
	struct slot_meta *m = &c->cold_meta[l];
	struct pf_rec *r = &c->pf[m->pf];
	pthread_mutex_lock(&c->ev_lock);
	bool flying = atomic_load(&r->state) == 1;
	if (flying) {
		struct read_rec *w = &c->reads[c->n_reads++];
		*w = (struct read_rec){ .c = c, .ffn = fi, .first_slot = NO_SLOT, .n = 1, .neurons = &m->neuron,
					.tag = c->cur_tag, .next_waiter = r->waiters };
		r->waiters = w;
		atomic_fetch_add(&c->outstanding, 1);
	}
	pthread_mutex_unlock(&c->ev_lock);
	if (!flying) {
		pf_settle(c);
		return false;
	}
	ptrs[j] = c->cold + (uint64_t)l * c->g.stride;
	m->ref = 1;
	if (!m->pinned) {
		m->pinned = 1;
		c->pinned_list[c->n_pinned_list++] = l;
	}
	c->st.hits_cold++;
	c->st.prefetch_hits += m->prefetched;
	c->st.prefetch_waits++;
	m->prefetched = 0;
	return true;
}

/* The route-ahead reads that completed: their slots stop filling; a failed
 * one's are freed (invariant 6) and counted as errors. Requesting thread. */
static void pf_settle(struct nf_cache *c)
{
	for (uint32_t i = c->pf_head; i != c->pf_tail; i = (i + 1) % c->pf_cap) {
		struct pf_rec *r = &c->pf[i];
		int st = r->n_slots ? atomic_load_explicit(&r->state, memory_order_acquire) : 1;
		if (st > 0)
			continue;
		for (uint32_t k = 0; k < r->n_slots; k++) {
			struct slot_meta *m = &c->cold_meta[r->first_slot + k];
			m->inflight = 0;
			if (st < 0) {
				if (m->ffn != NO_SLOT)
					c->ffns[m->ffn].loc[m->neuron] = NO_SLOT;
				m->ffn = NO_SLOT;
				m->prefetched = 0;
			}
		}
		c->st.errors += st < 0;
		c->pf_slots -= r->n_slots;
		r->n_slots = 0;
	}
	while (c->pf_head != c->pf_tail && !c->pf[c->pf_head].n_slots)
		c->pf_head = (c->pf_head + 1) % c->pf_cap;
}

/* Wait until no route-ahead read is in flight. */
static void pf_drain(struct nf_cache *c)
{
	for (;;) {
		pf_settle(c);
		if (c->pf_head == c->pf_tail)
			return;
		pthread_mutex_lock(&c->wait_lock);
		bool pending = nf_io_ctx_pending(c->io);
		if (pending)
			nf_io_ctx_wait(c->io, 1, -1); /* an error fails the reads it concerns */
		pthread_mutex_unlock(&c->wait_lock);
		if (!pending)
			sched_yield(); /* a completion thread is running the callback */
	}
}

/* ---- requests ------------------------------------------------------------------------- */

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* The co-activation record: which neurons this FFN's next recorded request
 * asked for (one bit per neuron and calibration token). */
/* The even bits of x (bit 2i to bit i). */
static uint32_t even_bits(uint64_t x)
{
	x &= 0x5555555555555555ull;
	x = (x | x >> 1) & 0x3333333333333333ull;
	x = (x | x >> 2) & 0x0f0f0f0f0f0f0f0full;
	x = (x | x >> 4) & 0x00ff00ff00ff00ffull;
	x = (x | x >> 8) & 0x0000ffff0000ffffull;
	x = (x | x >> 16) & 0x00000000ffffffffull;
	return (uint32_t)x;
}

/*
 * The co-activation record samples an FFN's requests uniformly over the
 * whole run, not its first ones: every request while there is room, then,
 * each time the record is full, every other recorded column is dropped and
 * the sampling interval doubles (requests 0, s, 2s, ... of this FFN, s a
 * power of two). An FFN requested rarely (an expert seldom routed) keeps
 * all its requests; one requested often keeps sig_tokens / 2 or more spread
 * over the run.
 */
static void record_signature(struct nf_cache *c, struct ffn_ent *f, const uint32_t *neurons, uint32_t n)
{
	if (!f->sig)
		return;
	uint64_t seen = f->sig_seen++;
	if (!f->sig_every)
		f->sig_every = 1;
	if (seen % f->sig_every)
		return;
	uint32_t W = c->sig_words;
	if (f->sig_n >= W * 64u) {
		/* keep the even columns (requests 0, 2s, 4s, ...) */
		for (uint64_t r = 0; r < c->g.n_neurons; r++) {
			uint64_t *row = f->sig + r * W;
			for (uint32_t w = 0; w < (W + 1) / 2; w++) {
				uint64_t hi = 2 * w + 1 < W ? row[2 * w + 1] : 0;
				row[w] = even_bits(row[2 * w]) | (uint64_t)even_bits(hi) << 32;
			}
			for (uint32_t w = (W + 1) / 2; w < W; w++)
				row[w] = 0;
		}
		f->sig_n = (f->sig_n + 1) / 2;
		f->sig_every *= 2;
		if (seen % f->sig_every)
			return;
	}
	uint32_t t = f->sig_n++;
	for (uint32_t k = 0; k < n; k++)
		if (neurons[k] < c->g.n_neurons)
			f->sig[(size_t)neurons[k] * c->sig_words + t / 64] |= 1ull << (t % 64);
}

/* Hits get their address in ptrs (cold ones pinned until release) and are
 * listed in hits; misses are listed in c->order. Counts every lookup.
 * Returns the number of misses, or NF_EUSAGE for a neuron out of range. */
static int lookup(struct nf_cache *c, struct ffn_ent *f, const uint32_t *neurons, uint32_t n, const void **ptrs,
		  uint32_t *hits, uint32_t *n_hit)
{
	uint32_t stride = c->g.stride, n_miss = 0;
	*n_hit = 0;
	for (uint32_t k = 0; k < n; k++) {
		uint32_t j = neurons[k];
		if (j >= c->g.n_neurons)
			return NF_EUSAGE;
		f->count[j]++;
		c->st.lookups++;
		uint32_t l = f->loc[j];
		if (l != NO_SLOT && !(l & HOT_BIT) && c->cold_meta[l].inflight) {
			/* a route-ahead read is bringing it: reported when it
			 * lands, like a miss (if it already failed, a miss) */
			if (pf_wait_for(c, (uint32_t)(f - c->ffns), j, l, ptrs))
				continue;
			l = f->loc[j];
		}
		if (l == NO_SLOT) {
			c->order[n_miss++] = j;
			continue;
		}
		if (l & HOT_BIT) {
			ptrs[j] = c->hot + (uint64_t)(l & ~HOT_BIT) * stride;
			c->st.hits_hot++;
		} else {
			struct slot_meta *m = &c->cold_meta[l];
			ptrs[j] = c->cold + (uint64_t)l * stride;
			m->ref = 1;
			c->st.prefetch_hits += m->prefetched;
			m->prefetched = 0;
			if (!m->pinned) {
				m->pinned = 1;
				c->pinned_list[c->n_pinned_list++] = l;
			}
			c->st.hits_cold++;
		}
		hits[(*n_hit)++] = j;
	}
	return (int)n_miss;
}

/* The misses (c->order) into c->run_slots / c->run_neurons, sorted by
 * store slot so that adjacent bundles form runs. */
static void sort_misses(struct nf_cache *c, const struct nf_store_object *obj, uint32_t n_miss)
{
	bool sorted = true;
	for (uint32_t k = 0; k < n_miss; k++) {
		c->run_slots[k] = obj->perm[c->order[k]];
		c->run_neurons[k] = c->order[k];
		if (k && c->run_slots[k - 1] > c->run_slots[k])
			sorted = false;
	}
	if (sorted)
		return;
	uint64_t *pk = c->sortbuf;
	for (uint32_t k = 0; k < n_miss; k++)
		pk[k] = (uint64_t)c->run_slots[k] << 32 | c->run_neurons[k];
	qsort(pk, n_miss, sizeof(uint64_t), cmp_u64);
	for (uint32_t k = 0; k < n_miss; k++) {
		c->run_slots[k] = (uint32_t)(pk[k] >> 32);
		c->run_neurons[k] = (uint32_t)pk[k];
	}
}

/*
 * The read starting at miss k: a run of adjacent store slots, joined to the
 * next runs when the misses are at most max_gap slots apart and the bundles
 * between them are cached nowhere (those are read and cached too, not
 * reported: one request instead of several, each costing kernel CPU), and
 * cold slots for it (CLOCK). Sets *take (misses it serves), *span (slots it
 * reads) and returns the first cold slot, or NO_SLOT when none is free.
 */
static uint32_t plan_read(struct nf_cache *c, struct ffn_ent *f, uint32_t k, uint32_t n_miss, uint32_t *take,
			  uint32_t *span)
{
	uint32_t stride = c->g.stride;
	uint32_t len = 1;
	while (k + len < n_miss && c->run_slots[k + len] == c->run_slots[k + len - 1] + 1)
		len++;
	uint32_t e = k + len, sp = len, at = NO_SLOT;
	while (c->max_gap && e < n_miss) {
		uint32_t d = c->run_slots[e] - c->run_slots[e - 1];
		bool free_gap = d <= c->max_gap + 1 && (uint64_t)(sp + d) * stride <= c->max_coalesce;
		for (uint32_t h = c->run_slots[e - 1] + 1; free_gap && h < c->run_slots[e]; h++)
			free_gap = f->loc[f->inv[h]] == NO_SLOT;
		if (!free_gap)
			break;
		sp += d;
		e++;
		while (e < n_miss && c->run_slots[e] == c->run_slots[e - 1] + 1) {
			sp++;
			e++;
		}
	}
	/* bridge only while the misses after this run still find slots: gap
	 * bundles take slots that no miss may need (nor those read-ahead is
	 * filling) */
	if (sp > len && (uint64_t)c->n_pinned_list + c->pf_slots + sp + (n_miss - e) + c->reserved > c->n_cold) {
		e = k + len;
		sp = len;
	}
	if (sp > len && (at = clock_alloc(c, sp)) == NO_SLOT) {
		e = k + len; /* no room for the gaps: the plain run */
		sp = len;
	}
	uint32_t t = len;
	if (sp > len) {
		t = e - k;
	} else {
		while ((at = clock_alloc(c, t)) == NO_SLOT && t > 1)
			t = (t + 1) / 2;
		sp = t;
	}
	*take = t;
	*span = sp;
	return at;
}

/* Give the slots [at, at + span) to the store slots the read at miss k
 * brings (ptrs: pinned for the current requests, their addresses in ptrs;
 * NULL: filling for a route-ahead read, unpinned) and queue the read with
 * done(cookie). Returns 0 or the queueing error (done will not run). */
static int queue_read(struct nf_cache *c, uint32_t fi, uint32_t k, uint32_t span, uint32_t at, const void **ptrs,
		      nf_io_done_fn done, void *cookie)
{
	struct ffn_ent *f = &c->ffns[fi];
	uint32_t stride = c->g.stride, s0 = c->run_slots[k];
	int rc;
	for (uint32_t i = 0; i < span; i++) {
		struct slot_meta *m = &c->cold_meta[at + i];
		evict(c, m);
		m->ffn = fi;
		m->neuron = f->inv[s0 + i];
		m->ref = 1;
		f->loc[m->neuron] = at + i;
		c->span_slots[i] = s0 + i;
		if (!ptrs) {
			m->inflight = 1;
			m->prefetched = 1;
			continue;
		}
		m->pinned = 1;
		c->pinned_list[c->n_pinned_list++] = at + i;
		ptrs[m->neuron] = c->cold + (uint64_t)(at + i) * stride;
	}
	/* the I/O context holds a bounded number of requests: when it is full,
	 * let some complete (their events wait in the queue) */
	while ((rc = nf_io_ctx_read_bundles(c->io, f->obj, c->span_slots, span, c->cold + (uint64_t)at * stride,
					    done, cookie)) == -EAGAIN) {
		int w = nf_io_ctx_wait(c->io, 1, -1);
		if (w < 0 && w != -ETIMEDOUT) {
			rc = w;
			break;
		}
	}
	if (rc == 0) {
		c->st.requests++;
		c->st.bytes_read += (uint64_t)span * c->g.stride;
	}
	return rc;
}

/* The read at miss k for the current requests: queued (queue_read), its
 * record reported through reap. Returns 0 or the queueing error (then the
 * read is reported failed through reap). */
static int submit_read(struct nf_cache *c, uint32_t fi, uint32_t k, uint32_t take, uint32_t span, uint32_t at,
		       const void **ptrs)
{
	struct read_rec *r = &c->reads[c->n_reads++];
	*r = (struct read_rec){ .c = c, .ffn = fi, .first_slot = at, .n = take, .n_slots = span,
				.neurons = c->run_neurons + k, .store_slots = c->run_slots + k, .tag = c->cur_tag };
	atomic_fetch_add(&c->outstanding, 1);
	int rc = queue_read(c, fi, k, span, at, ptrs, read_done, r);
	if (rc < 0) {
		/* not queued: its callback will not run; report it through reap */
		r->result = rc;
		ev_push(c, r);
		return rc;
	}
	c->st.gap_bundles += span - take;
	return 0;
}

static int request_at(struct nf_cache *c, uint32_t fi, const uint32_t *neurons, uint32_t n, const void **ptrs,
		      nf_cache_ready_fn fn, void *user)
{
	struct ffn_ent *f = &c->ffns[fi];
	record_signature(c, f, neurons, n);
	/* hits now (c->run_neurons is free until the misses are laid out) */
	uint32_t n_hit;
	int nm = lookup(c, f, neurons, n, ptrs, c->run_neurons, &n_hit);
	if (nm < 0)
		return nm;
	uint32_t n_miss = (uint32_t)nm;
	if (n_hit)
		fn(user, c->run_neurons, n_hit, 0);
	c->st.misses += n_miss;
	if (!n_miss)
		return 0;
	/* slots a route-ahead read is filling cannot be given out: when the
	 * misses might need them, those reads land first */
	if (c->pf_slots && (uint64_t)n_miss + c->n_pinned_list + c->pf_slots + c->reserved > c->n_cold)
		pf_drain(c);
	sort_misses(c, f->obj, n_miss);
	int rc = 0;
	uint32_t k = 0;
	while (k < n_miss) {
		uint32_t take, span, at = plan_read(c, f, k, n_miss, &take, &span);
		if (at == NO_SLOT && c->pf_slots) {
			/* the rest is filling for read-ahead: it lands first */
			pf_drain(c);
			at = plan_read(c, f, k, n_miss, &take, &span);
		}
		if (at == NO_SLOT) {
			rc = NF_EBUDGET;
			break;
		}
		rc = submit_read(c, fi, k, take, span, at, ptrs);
		k += take; /* a read that failed to queue reports its own neurons */
		if (rc < 0)
			break;
	}
	if (k < n_miss) {
		/* neurons never submitted: report them failed */
		struct read_rec *r = &c->reads[c->n_reads++];
		*r = (struct read_rec){ .c = c, .ffn = fi, .first_slot = NO_SLOT, .n = n_miss - k,
					.neurons = c->run_neurons + k, .tag = c->cur_tag, .result = rc };
		atomic_fetch_add(&c->outstanding, 1);
		ev_push(c, r);
	}
	if (rc < 0 && c->layer_err == 0)
		c->layer_err = rc;
	return rc;
}

/* A request whose hits are reported to user now; tag (NULL: none) goes
 * with its reads to whoever reaps them. */
static int request_any(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons, uint32_t n,
		       const void **ptrs, nf_cache_ready_fn fn, void *user, void *tag)
{
	if (layer >= c->g.n_layer || expert >= c->g.n_expert)
		return NF_EUSAGE;
	uint32_t fi = layer * c->g.n_expert + expert;
	if (!c->ffns[fi].obj)
		return NF_EUSAGE;
	uint32_t base = c->run_base;
	if (n > c->g.n_neurons - base)
		return NF_EBUDGET;
	/* this request's misses go after the earlier ones' (still in flight) */
	c->run_neurons += base;
	c->run_slots += base;
	c->cur_tag = tag;
	uint32_t misses0 = (uint32_t)c->st.misses;
	int rc = request_at(c, fi, neurons, n, ptrs, fn, user);
	c->run_base += (uint32_t)c->st.misses - misses0;
	c->cur_tag = NULL;
	c->run_neurons -= base;
	c->run_slots -= base;
	return rc;
}

int nf_cache_prefetch(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons, uint32_t n)
{
	if (!c->has_ffn || layer >= c->g.n_layer || expert >= c->g.n_expert)
		return NF_EUSAGE;
	uint32_t fi = layer * c->g.n_expert + expert, N = c->g.n_neurons;
	struct ffn_ent *f = &c->ffns[fi];
	if (!f->obj)
		return NF_EUSAGE;
	pf_settle(c);
	/* at most the cold slots neither pinned nor filling; laid out after
	 * the current requests' misses (still in flight), not kept */
	uint32_t busy = c->n_pinned_list + c->pf_slots, base = c->run_base;
	uint32_t room = busy < c->n_cold ? c->n_cold - busy : 0, n_miss = 0;
	if (room > N - base)
		room = N - base;
	for (uint32_t k = 0; k < n; k++) {
		if (neurons[k] >= N)
			return NF_EUSAGE;
		if (f->loc[neurons[k]] == NO_SLOT && n_miss < room)
			c->order[n_miss++] = neurons[k];
	}
	c->run_neurons += base;
	c->run_slots += base;
	sort_misses(c, f->obj, n_miss);
	int reads = 0;
	uint32_t k = 0;
	while (k < n_miss && (c->pf_tail + 1) % c->pf_cap != c->pf_head) {
		uint32_t take, span, at = plan_read(c, f, k, n_miss, &take, &span);
		if (at == NO_SLOT)
			break;
		struct pf_rec *r = &c->pf[c->pf_tail];
		*r = (struct pf_rec){ .c = c, .first_slot = at, .n_slots = span };
		atomic_store(&r->state, 1);
		for (uint32_t i = 0; i < span; i++)
			c->cold_meta[at + i].pf = c->pf_tail;
		c->pf_tail = (c->pf_tail + 1) % c->pf_cap;
		c->pf_slots += span;
		if (queue_read(c, fi, k, span, at, NULL, pf_done, r) < 0) {
			atomic_store(&r->state, -EIO); /* not queued: its slots are freed */
			break;
		}
		c->st.gap_bundles += span - take;
		c->st.prefetch_requests++;
		c->st.prefetch_bytes += (uint64_t)span * c->g.stride;
		c->st.prefetch_neurons += take;
		k += take;
		reads++;
	}
	c->run_neurons -= base;
	c->run_slots -= base;
	pf_settle(c);
	return reads;
}

int nf_cache_request(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons,
		     uint32_t n, const void **ptrs, nf_cache_ready_fn fn, void *user)
{
	return request_any(c, layer, expert, neurons, n, ptrs, fn, user, NULL);
}

int nf_cache_request_tagged(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons,
			    uint32_t n, const void **ptrs, nf_cache_ready_fn fn, void *tag)
{
	return request_any(c, layer, expert, neurons, n, ptrs, fn, tag, tag);
}

/* Undo the slots of a failed read (invariant 6). */
static void read_failed(struct nf_cache *c, struct read_rec *r)
{
	c->st.errors++;
	if (c->layer_err == 0)
		c->layer_err = r->result;
	if (r->first_slot == NO_SLOT)
		return;
	for (uint32_t i = 0; i < r->n_slots; i++) {
		struct slot_meta *m = &c->cold_meta[r->first_slot + i];
		if (m->ffn != NO_SLOT)
			c->ffns[m->ffn].loc[m->neuron] = NO_SLOT;
		m->ffn = NO_SLOT;
	}
}

/* Longest nap of a reaper while another thread waits on the I/O context. */
#define REAP_NAP_NS 200000L

/* Sleep until an event is queued, another reaper hands some (work may be
 * ready for this thread), or REAP_NAP_NS pass: a reaper that cannot wait on
 * the I/O context itself naps rather than spinning on sched_yield, which
 * spent half of a 2-thread decode's CPU time in the kernel. */
static void reap_nap(struct nf_cache *c)
{
	pthread_mutex_lock(&c->ev_lock);
	if (c->ev_head == c->ev_tail) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ts.tv_nsec += REAP_NAP_NS;
		if (ts.tv_nsec >= 1000000000L) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000L;
		}
		atomic_fetch_add(&c->ev_sleepers, 1);
		pthread_cond_timedwait(&c->ev_cond, &c->ev_lock, &ts);
		atomic_fetch_sub(&c->ev_sleepers, 1);
	}
	pthread_mutex_unlock(&c->ev_lock);
}

int nf_cache_reap(struct nf_cache *c, nf_cache_ready_fn fn, void *user)
{
	int handed = 0;
	struct read_rec *r;
	for (;;) {
		while ((r = ev_pop(c))) {
			if (r->result < 0) {
				pthread_mutex_lock(&c->ev_lock);
				read_failed(c, r);
				pthread_mutex_unlock(&c->ev_lock);
			}
			fn(r->tag ? r->tag : user, r->neurons, r->n, r->result);
			atomic_fetch_sub(&c->outstanding, 1);
			handed++;
		}
		if (handed || atomic_load(&c->outstanding) == 0) {
			/* what this thread handed may have made work for a
			 * napping one */
			if (handed && atomic_load(&c->ev_sleepers))
				pthread_cond_broadcast(&c->ev_cond);
			return handed;
		}
		if (pthread_mutex_trylock(&c->wait_lock) != 0) {
			/* another thread waits on the I/O context */
			reap_nap(c);
			return 0;
		}
		int rc = nf_io_ctx_pending(c->io) ? nf_io_ctx_wait(c->io, 1, -1) : 0;
		pthread_mutex_unlock(&c->wait_lock);
		if (rc < 0 && rc != -ETIMEDOUT) {
			/* the failed requests' callbacks have run (events queued) */
			struct read_rec *q = ev_pop(c);
			if (!q)
				return rc;
			if (q->result < 0) {
				pthread_mutex_lock(&c->ev_lock);
				read_failed(c, q);
				pthread_mutex_unlock(&c->ev_lock);
			}
			fn(q->tag ? q->tag : user, q->neurons, q->n, q->result);
			atomic_fetch_sub(&c->outstanding, 1);
			handed++;
		}
	}
}

int nf_cache_poll(struct nf_cache *c)
{
	if (!c || !c->io)
		return 0;
	/* the I/O context is one thread's at a time (poll mode): the pending
	 * count too is read under the wait lock, which every reaper holds */
	if (pthread_mutex_trylock(&c->wait_lock) != 0)
		return 0; /* a reaper waits on the I/O context: it reaps */
	int rc = nf_io_ctx_pending(c->io) ? nf_io_ctx_poll(c->io) : 0;
	pthread_mutex_unlock(&c->wait_lock);
	if (rc > 0 && atomic_load(&c->ev_sleepers))
		pthread_cond_broadcast(&c->ev_cond);
	return rc;
}

static void ignore_ready(void *user, const uint32_t *neurons, uint32_t n, int result)
{
	(void)user;
	(void)neurons;
	(void)n;
	(void)result;
}

int nf_cache_release(struct nf_cache *c)
{
	while (atomic_load(&c->outstanding)) {
		int rc = nf_cache_reap(c, ignore_ready, NULL);
		if (rc < 0 && c->layer_err == 0)
			c->layer_err = rc;
		if (rc < 0 && !nf_io_ctx_pending(c->io)) {
			/* nothing more can land: drop what is left */
			struct read_rec *r;
			while ((r = ev_pop(c))) {
				if (r->result < 0)
					read_failed(c, r);
				atomic_fetch_sub(&c->outstanding, 1);
			}
			break;
		}
	}
	for (uint32_t i = 0; i < c->n_pinned_list; i++)
		c->cold_meta[c->pinned_list[i]].pinned = 0;
	c->n_pinned_list = 0;
	c->n_reads = 0;
	c->run_base = 0;
	c->reserved = 0;
	int err = c->layer_err;
	c->layer_err = 0;
	return err;
}

/* ---- hot segment ------------------------------------------------------------------- */

/*
 * Online re-planning (nf_cache_rebalance): a neuron read into the cold
 * segment that now fires more often than the least frequent hot neuron of
 * its FFN swaps places with it. The two bundles trade slots by memcpy: no
 * read, no wait, and every byte stays what the store holds, so nothing a
 * kernel computes changes. Counts decay (nf_cache_decay) so that the hot
 * set follows what the text does now.
 */
static int cmp_pair_asc(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static int cmp_pair_desc(const void *a, const void *b)
{
	return cmp_pair_asc(b, a);
}

/* FFN fi's slots as (count << 32 | slot), its hot ones into c->rb_hot and
 * its cold ones into c->rb_cold (their numbers into nh, nc), found through
 * its neurons' locations: a scan of the segments cost 4% of a 47B decode
 * under 12 GiB, where the hot one holds 1.4M slots for 256 FFNs. The
 * callers sort the pairs whole, so the order found in does not matter. */
static void slots_of_ffn(struct nf_cache *c, uint32_t fi, uint32_t *nh, uint32_t *nc)
{
	const struct ffn_ent *f = &c->ffns[fi];
	uint32_t h = 0, k = 0;
	for (uint32_t j = 0; j < c->g.n_neurons; j++) {
		uint32_t l = f->loc[j];
		if (l == NO_SLOT)
			continue;
		uint64_t cnt = (uint64_t)f->count[j] << 32;
		if (l & HOT_BIT) {
			if (!c->hot_meta[l & ~HOT_BIT].inflight)
				c->rb_hot[h++] = cnt | (l & ~HOT_BIT);
		} else if (!c->cold_meta[l].inflight) {
			c->rb_cold[k++] = cnt | l;
		}
	}
	*nh = h;
	*nc = k;
}

int nf_cache_rebalance(struct nf_cache *c, uint32_t layer, uint32_t expert, uint32_t max_moves)
{
	if (!max_moves || !c->n_hot || c->n_pinned_list || atomic_load(&c->outstanding) || layer >= c->g.n_layer ||
	    expert >= c->g.n_expert)
		return 0;
	uint32_t fi = layer * c->g.n_expert + expert, stride = c->g.stride, moves = 0;
	struct ffn_ent *fe = &c->ffns[fi];
	uint32_t nh, nc;
	slots_of_ffn(c, fi, &nh, &nc);
	if (!nh || !nc)
		return 0;
	/* the least frequent hot neurons against the most frequent
	 * cold-resident ones, pair by pair */
	qsort(c->rb_hot, nh, sizeof(uint64_t), cmp_pair_asc);
	qsort(c->rb_cold, nc, sizeof(uint64_t), cmp_pair_desc);
	for (uint32_t k = 0; k < nh && k < nc && moves < max_moves; k++) {
		uint32_t hc = (uint32_t)(c->rb_hot[k] >> 32), cc = (uint32_t)(c->rb_cold[k] >> 32);
		/* hysteresis: clearly hotter (by half again, plus two), so that
		 * two neurons do not trade places back and forth */
		if (cc <= hc + hc / 2 + 2)
			break;
		uint32_t hs = (uint32_t)c->rb_hot[k], l = (uint32_t)c->rb_cold[k];
		struct slot_meta *hm = &c->hot_meta[hs], *cm = &c->cold_meta[l];
		uint32_t h = hm->neuron, j = cm->neuron;
		char *hb = c->hot + (uint64_t)hs * stride, *cb = c->cold + (uint64_t)l * stride;
		memcpy(c->rb_buf, hb, stride);
		memcpy(hb, cb, stride);
		memcpy(cb, c->rb_buf, stride);
		hm->neuron = j;
		fe->loc[j] = hs | HOT_BIT;
		cm->neuron = h;
		fe->loc[h] = l;
		moves++;
	}
	c->st.promotions += moves;
	return (int)moves;
}

void nf_cache_decay(struct nf_cache *c)
{
	for (uint32_t f = 0; f < c->n_ffn; f++)
		if (c->ffns[f].obj)
			for (uint32_t j = 0; j < c->g.n_neurons; j++)
				c->ffns[f].count[j] >>= 1;
}

struct hot_pick {
	uint32_t count, neuron;
};

/* Neurons of FFN f with count >= t. */
static uint64_t count_at_least(const struct ffn_ent *f, uint32_t N, uint32_t t)
{
	uint64_t k = 0;
	if (f->obj)
		for (uint32_t j = 0; j < N; j++)
			k += f->count[j] >= t;
	return k;
}

void nf_cache_reserve(struct nf_cache *c, uint32_t slots)
{
	c->reserved = slots;
}

uint32_t nf_cache_cold_needed(const struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons,
			  uint32_t n)
{
	if (layer >= c->g.n_layer || expert >= c->g.n_expert)
		return n;
	const struct ffn_ent *f = &c->ffns[layer * c->g.n_expert + expert];
	if (!f->obj)
		return n;
	uint32_t k = 0;
	for (uint32_t i = 0; i < n; i++)
		k += neurons[i] >= c->g.n_neurons || f->loc[neurons[i]] == NO_SLOT || !(f->loc[neurons[i]] & HOT_BIT);
	return k;
}

int nf_cache_hot_quota(const struct nf_cache *c, uint64_t slots, uint32_t *quota)
{
	uint32_t N = c->g.n_neurons, hi = 0;
	uint64_t fired = 0;
	for (uint32_t fi = 0; fi < c->n_ffn; fi++) {
		const struct ffn_ent *f = &c->ffns[fi];
		quota[fi] = 0;
		for (uint32_t j = 0; f->obj && j < N; j++) {
			hi = f->count[j] > hi ? f->count[j] : hi;
			fired += f->count[j] > 0;
		}
	}
	if (fired <= slots) {
		/* room for every neuron that ever fired */
		for (uint32_t fi = 0; fi < c->n_ffn; fi++)
			quota[fi] = (uint32_t)count_at_least(&c->ffns[fi], N, 1);
		return 0;
	}
	/* the largest t with at least `slots` counts >= t (t >= 1) */
	uint32_t lo = 1;
	while (lo < hi) {
		uint32_t mid = lo + (hi - lo + 1) / 2;
		uint64_t k = 0;
		for (uint32_t fi = 0; fi < c->n_ffn && k < slots; fi++)
			k += count_at_least(&c->ffns[fi], N, mid);
		if (k >= slots)
			lo = mid;
		else
			hi = mid - 1;
	}
	/* everything above t, then the ties at t in FFN order */
	uint64_t left = slots;
	for (uint32_t fi = 0; fi < c->n_ffn; fi++) {
		uint64_t k = lo < UINT32_MAX ? count_at_least(&c->ffns[fi], N, lo + 1) : 0;
		quota[fi] = (uint32_t)k;
		left -= k;
	}
	for (uint32_t fi = 0; fi < c->n_ffn && left; fi++) {
		uint64_t ties = count_at_least(&c->ffns[fi], N, lo) - quota[fi];
		uint64_t take = ties < left ? ties : left;
		quota[fi] += (uint32_t)take;
		left -= take;
	}
	return 0;
}

static int cmp_pick(const void *a, const void *b)
{
	const struct hot_pick *x = a, *y = b;
	if (x->count != y->count)
		return x->count > y->count ? -1 : 1;
	return x->neuron < y->neuron ? -1 : x->neuron > y->neuron;
}

static void hot_done(void *cookie, int result)
{
	int *res = cookie;
	if (result < 0 && *res == 0)
		*res = result;
}

int nf_cache_set_counts(struct nf_cache *c, uint32_t layer, const uint32_t *counts)
{
	if (layer >= c->g.n_layer)
		return NF_EUSAGE;
	memcpy(c->ffns[layer * c->g.n_expert].count, counts, c->g.n_neurons * sizeof(uint32_t));
	return 0;
}

int nf_cache_count(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons, uint32_t n)
{
	if (layer >= c->g.n_layer || expert >= c->g.n_expert)
		return NF_EUSAGE;
	struct ffn_ent *f = &c->ffns[layer * c->g.n_expert + expert];
	if (!f->obj)
		return NF_EUSAGE;
	for (uint32_t k = 0; k < n; k++)
		if (neurons[k] < c->g.n_neurons)
			f->count[neurons[k]]++;
	return 0;
}

int nf_cache_hot_load(struct nf_cache *c)
{
	uint32_t N = c->g.n_neurons, stride = c->g.stride;
	if (!c->n_hot)
		return 0;
	pf_drain(c); /* no route-ahead read may land in a slot it moves */
	/* forget the previous hot set */
	for (uint32_t i = 0; i < c->n_hot; i++) {
		struct slot_meta *m = &c->hot_meta[i];
		if (m->ffn != NO_SLOT)
			c->ffns[m->ffn].loc[m->neuron] = NO_SLOT;
		m->ffn = NO_SLOT;
	}
	struct hot_pick *pk = malloc(N * sizeof(*pk));
	uint64_t *sl = malloc(N * sizeof(uint64_t));
	uint32_t *slots = malloc((size_t)c->n_hot * sizeof(uint32_t)); /* store slots, all runs */
	uint32_t *quota = malloc((size_t)c->n_ffn * sizeof(uint32_t));
	int rc = 0, res = 0;
	if (!pk || !sl || !slots || !quota) {
		rc = -ENOMEM;
		goto out;
	}
	/* the n_hot highest counts over all FFNs: a layer (or an expert) that
	 * fires more gets more of the hot segment */
	nf_cache_hot_quota(c, c->n_hot, quota);
	uint32_t next = 0;
	for (uint32_t fi = 0; fi < c->n_ffn; fi++) {
		struct ffn_ent *f = &c->ffns[fi];
		if (!f->obj || !quota[fi])
			continue;
		for (uint32_t j = 0; j < N; j++)
			pk[j] = (struct hot_pick){ .count = f->count[j], .neuron = j };
		qsort(pk, N, sizeof(*pk), cmp_pick);
		uint32_t take = quota[fi];
		for (uint32_t i = 0; i < take; i++)
			sl[i] = (uint64_t)f->obj->perm[pk[i].neuron] << 32 | pk[i].neuron;
		qsort(sl, take, sizeof(uint64_t), cmp_u64);
		/* runs of adjacent store slots, each one request, all submitted
		 * before waiting; a neuron leaving a cold slot frees it
		 * (invariant 2) */
		uint32_t i = 0;
		while (i < take) {
			uint32_t len = 1;
			while (i + len < take && (sl[i + len] >> 32) == (sl[i + len - 1] >> 32) + 1)
				len++;
			for (uint32_t q = 0; q < len; q++) {
				uint32_t j = (uint32_t)sl[i + q];
				uint32_t l = f->loc[j];
				if (l != NO_SLOT && !(l & HOT_BIT))
					c->cold_meta[l].ffn = NO_SLOT;
				slots[next + q] = (uint32_t)(sl[i + q] >> 32);
				struct slot_meta *m = &c->hot_meta[next + q];
				m->ffn = fi;
				m->neuron = j;
				f->loc[j] = (next + q) | HOT_BIT;
			}
			while ((rc = nf_io_ctx_read_bundles(c->io, f->obj, slots + next, len,
							    c->hot + (uint64_t)next * stride, hot_done, &res)) == -EAGAIN)
				if ((rc = nf_io_ctx_wait(c->io, 1, -1)) < 0)
					break;
			if (rc < 0)
				goto out;
			c->st.hot_loads++;
			uint64_t seg = c->max_coalesce / stride ? c->max_coalesce / stride : 1;
			c->st.hot_requests += (len + seg - 1) / seg;
			c->st.hot_bytes += (uint64_t)len * stride;
			c->st.bytes_read += (uint64_t)len * stride;
			next += len;
			i += len;
		}
	}
	if ((rc = nf_io_ctx_wait(c->io, 0, -1)) < 0)
		goto out;
	rc = res;
out:
	if (rc < 0) {
		nf_io_ctx_wait(c->io, 0, -1);
		for (uint32_t i = 0; i < c->n_hot; i++) {
			struct slot_meta *m = &c->hot_meta[i];
			if (m->ffn != NO_SLOT)
				c->ffns[m->ffn].loc[m->neuron] = NO_SLOT;
			m->ffn = NO_SLOT;
		}
	}
	free(pk);
	free(sl);
	free(slots);
	free(quota);
	return rc < 0 ? rc : 0;
}

const uint32_t *nf_cache_counts(const struct nf_cache *c, uint32_t layer, uint32_t expert)
{
	if (layer >= c->g.n_layer || expert >= c->g.n_expert)
		return NULL;
	const struct ffn_ent *f = &c->ffns[layer * c->g.n_expert + expert];
	return f->obj ? f->count : NULL;
}

/*
 * Seed the counts from the store's profile (ffn_setup then loads the hot
 * segment from them). A profile that cannot be read (damaged) is not
 * fatal: false, the hot set is then learned online and profile_error says
 * why. I/O errors of the load are.
 */
static bool seed_from_profile(struct nf_cache *c)
{
	struct nf_store_profile *p = NULL;
	int rc = nf_store_profile_read(c->store, &p, NULL);
	if (rc < 0) {
		c->profile_error = rc;
		return false;
	}
	for (uint32_t i = 0; i < p->n_objects; i++) {
		const struct nf_store_object *ob = nf_store_object_get(c->store, i);
		if (!p->counts[i] || ob->kind != NF_STORE_KIND_FFN)
			continue;
		struct ffn_ent *f = &c->ffns[ob->layer * c->g.n_expert + ob->expert];
		memcpy(f->count, p->counts[i], c->g.n_neurons * sizeof(uint32_t));
	}
	c->profile_tokens = p->tokens;
	nf_store_profile_free(p);
	return true;
}

/* ---- pinned -------------------------------------------------------------------------- */

/* A whole-object read of nf_cache_pin_objects / nf_cache_read_object. */
struct obj_read {
	int result;
};

static void obj_done(void *cookie, int result)
{
	((struct obj_read *)cookie)->result = result;
}

/* Read objs[0..n) into bufs[0..n), all submitted at once (the I/O
 * context's queue bounds what is in flight), each checked on completion.
 * Returns 0 or the first failure, d naming its object. */
static int read_objects(struct nf_cache *c, const struct nf_store_object *const *objs, void *const *bufs,
			uint32_t n, struct nf_diag *d)
{
	struct obj_read *r = calloc(n ? n : 1, sizeof(*r));
	if (!r)
		return nf_diag_fail(d, -ENOMEM, "cache: out of memory");
	int rc = 0;
	pthread_mutex_lock(&c->wait_lock);
	for (uint32_t i = 0; i < n && rc == 0; i++) {
		r[i].result = 1;
		while ((rc = nf_io_ctx_read_object(c->io, objs[i], bufs[i], obj_done, &r[i])) == -EAGAIN) {
			int w = nf_io_ctx_wait(c->io, 1, -1);
			if (w < 0 && w != -ETIMEDOUT) {
				rc = w;
				break;
			}
		}
		if (rc < 0) {
			r[i].result = rc;
			nf_diag_fail(d, rc, "%s: object %s: cannot read it: %s", nf_store_path(c->store),
				     objs[i]->name, nf_strerror(rc));
		}
	}
	int w = nf_io_ctx_wait(c->io, 0, -1);
	pthread_mutex_unlock(&c->wait_lock);
	for (uint32_t i = 0; i < n && rc == 0; i++)
		if (r[i].result != 0) {
			rc = r[i].result > 0 ? (w < 0 ? w : -EIO) : r[i].result;
			nf_diag_fail(d, rc, "%s: object %s: %s", nf_store_path(c->store), objs[i]->name,
				     nf_strerror(rc));
		}
	if (rc == 0 && w < 0)
		rc = nf_diag_fail(d, w, "%s: reading objects: %s", nf_store_path(c->store), nf_strerror(w));
	for (uint32_t i = 0; i < n; i++)
		if (r[i].result == 0)
			c->st.bytes_read += nf_store_object_buf_size(objs[i], nf_io_ctx_align(c->io));
	free(r);
	return rc;
}

int nf_cache_pin_objects(struct nf_cache *c, const struct nf_store_object *const *objs, uint32_t n,
			 const void **data, struct nf_diag *d)
{
	uint32_t align = nf_io_ctx_align(c->io) > 4096 ? nf_io_ctx_align(c->io) : 4096;
	uint64_t need = 0;
	for (uint32_t i = 0; i < n; i++)
		need += nf_store_object_buf_size(objs[i], align);
	if (c->pinned_cap && c->pinned_used + need > c->pinned_cap)
		return nf_diag_fail(d, NF_EBUDGET,
				    "cache: pinned segment of %llu bytes cannot hold %u more objects (%llu bytes; %llu "
				    "used)", (unsigned long long)c->pinned_cap, n, (unsigned long long)need,
				    (unsigned long long)c->pinned_used);
	if (c->n_pins + n > c->cap_pins) {
		uint32_t cap = c->cap_pins * 2 > c->n_pins + n ? c->cap_pins * 2 : c->n_pins + n + 16;
		void **p = realloc(c->pins, cap * sizeof(*p));
		if (!p)
			return nf_diag_fail(d, -ENOMEM, "cache: out of memory");
		c->pins = p;
		c->cap_pins = cap;
	}
	void **bufs = c->pins + c->n_pins;
	for (uint32_t i = 0; i < n; i++)
		if (!(bufs[i] = nf_io_buf_alloc(nf_store_object_buf_size(objs[i], align), align))) {
			for (uint32_t k = 0; k < i; k++)
				nf_io_buf_free(bufs[k]);
			return nf_diag_fail(d, -ENOMEM, "%s: out of memory for %llu bytes of %s",
					    nf_store_path(c->store),
					    (unsigned long long)nf_store_object_buf_size(objs[i], align), objs[i]->name);
		}
	int rc = read_objects(c, objs, bufs, n, d);
	if (rc < 0) {
		for (uint32_t i = 0; i < n; i++)
			nf_io_buf_free(bufs[i]);
		return rc;
	}
	for (uint32_t i = 0; i < n; i++)
		data[i] = bufs[i];
	c->n_pins += n;
	c->pinned_used += need;
	return 0;
}

int nf_cache_pin_object(struct nf_cache *c, const struct nf_store_object *obj, const void **data,
			struct nf_diag *d)
{
	return nf_cache_pin_objects(c, &obj, 1, data, d);
}

int nf_cache_read_object(struct nf_cache *c, const struct nf_store_object *obj, void *buf, struct nf_diag *d)
{
	return read_objects(c, &obj, &buf, 1, d);
}

/* ---- rows of a dense object left in the store ------------------------------------------ */

#define VERIFY_PIECE (1u << 20)
#define VERIFY_DEPTH 4u

/* Read [off, off + len) pieces (aligned) into bufs, all at once, and wait
 * for them; r[k].result 0 on success. Holds wait_lock as read_objects. */
static int read_raw_all(struct nf_cache *c, const uint64_t *off, const uint64_t *len, void *const *bufs,
			struct obj_read *r, uint32_t n)
{
	int rc = 0;
	pthread_mutex_lock(&c->wait_lock);
	for (uint32_t i = 0; i < n && rc == 0; i++) {
		r[i].result = 1;
		while ((rc = nf_io_ctx_read_raw(c->io, off[i], len[i], bufs[i], obj_done, &r[i])) == -EAGAIN) {
			int w = nf_io_ctx_wait(c->io, 1, -1);
			if (w < 0 && w != -ETIMEDOUT) {
				rc = w;
				break;
			}
		}
		if (rc < 0)
			r[i].result = rc;
	}
	int w = nf_io_ctx_wait(c->io, 0, -1);
	pthread_mutex_unlock(&c->wait_lock);
	for (uint32_t i = 0; i < n; i++) {
		if (r[i].result == 0) {
			c->st.bytes_read += len[i];
			continue;
		}
		c->st.errors++;
		if (rc == 0)
			rc = r[i].result > 0 ? (w < 0 ? w : -EIO) : r[i].result;
	}
	return rc == 0 && w < 0 ? w : rc;
}

int nf_cache_verify_object(struct nf_cache *c, const struct nf_store_object *obj, struct nf_diag *d)
{
	uint64_t a = nf_io_ctx_align(c->io);
	uint64_t start = obj->offset / a * a, end = (obj->offset + obj->length + a - 1) / a * a;
	char *buf = nf_io_buf_alloc((size_t)VERIFY_PIECE * VERIFY_DEPTH, a > 4096 ? a : 4096);
	if (!buf)
		return nf_diag_fail(d, -ENOMEM, "%s: out of memory to check %s", nf_store_path(c->store),
				    obj->name);
	uint32_t crc = 0;
	int rc = 0;
	for (uint64_t at = start; at < end && rc == 0;) {
		uint64_t off[VERIFY_DEPTH], len[VERIFY_DEPTH];
		void *bufs[VERIFY_DEPTH];
		struct obj_read r[VERIFY_DEPTH];
		uint32_t n = 0;
		for (; n < VERIFY_DEPTH && at < end; n++, at += len[n - 1]) {
			off[n] = at;
			len[n] = end - at < VERIFY_PIECE ? end - at : VERIFY_PIECE;
			bufs[n] = buf + (size_t)n * VERIFY_PIECE;
		}
		if ((rc = read_raw_all(c, off, len, bufs, r, n)) < 0) {
			nf_diag_fail(d, rc, "%s: object %s: cannot read it: %s", nf_store_path(c->store), obj->name,
				     nf_strerror(rc));
			break;
		}
		for (uint32_t k = 0; k < n; k++) {
			/* the object's own bytes of this piece */
			uint64_t lo = off[k] > obj->offset ? off[k] : obj->offset;
			uint64_t hi = off[k] + len[k] < obj->offset + obj->length ? off[k] + len[k]
										  : obj->offset + obj->length;
			if (hi > lo)
				crc = nf_crc32c(crc, (char *)bufs[k] + (lo - off[k]), (size_t)(hi - lo));
		}
	}
	nf_io_buf_free(buf);
	if (rc == 0 && crc != obj->crc)
		rc = nf_diag_fail(d, NF_ECHECKSUM, "%s: object %s: crc32c mismatch (stored %08x, read %08x)",
				  nf_store_path(c->store), obj->name, obj->crc, crc);
	return rc;
}

uint64_t nf_cache_row_span(const struct nf_cache *c, uint64_t row_bytes)
{
	uint64_t a = nf_io_ctx_align(c->io);
	return (row_bytes + a - 1) / a * a + a;
}

int nf_cache_read_rows(struct nf_cache *c, const struct nf_store_object *obj, uint64_t row_bytes,
		       const int32_t *rows, uint32_t n, void *scratch, const void **out, struct nf_diag *d)
{
	if (n == 0)
		return 0;
	uint64_t a = nf_io_ctx_align(c->io), span = nf_cache_row_span(c, row_bytes);
	uint64_t *off = malloc(2 * (size_t)n * sizeof(*off));
	void **bufs = malloc((size_t)n * sizeof(*bufs));
	struct obj_read *r = calloc(n, sizeof(*r));
	int rc = 0;
	if (!off || !bufs || !r) {
		rc = nf_diag_fail(d, -ENOMEM, "cache: out of memory");
		goto out;
	}
	uint64_t *len = off + n;
	uint64_t n_rows = row_bytes ? obj->length / row_bytes : 0;
	for (uint32_t k = 0; k < n; k++) {
		if (rows[k] < 0 || (uint64_t)rows[k] >= n_rows) {
			rc = nf_diag_fail(d, NF_EUSAGE, "%s: object %s: row %d outside its %llu rows",
					  nf_store_path(c->store), obj->name, rows[k], (unsigned long long)n_rows);
			goto out;
		}
		uint64_t at = obj->offset + (uint64_t)rows[k] * row_bytes;
		off[k] = at / a * a;
		len[k] = (at + row_bytes - off[k] + a - 1) / a * a;
		bufs[k] = (char *)scratch + (size_t)k * span;
		out[k] = (const char *)bufs[k] + (at - off[k]);
	}
	if ((rc = read_raw_all(c, off, len, bufs, r, n)) < 0)
		nf_diag_fail(d, rc, "%s: object %s: cannot read a row: %s", nf_store_path(c->store), obj->name,
			     nf_strerror(rc));
out:
	free(off);
	free(bufs);
	free(r);
	return rc;
}

uint32_t nf_cache_align(const struct nf_cache *c)
{
	return nf_io_ctx_align(c->io);
}

struct nf_store *nf_cache_store(const struct nf_cache *c)
{
	return c->store;
}

/* ---- streamed segment: reads for nflash/stream.h ----------------------------------- */

int nf_cache_wait_io(struct nf_cache *c)
{
	pthread_mutex_lock(&c->wait_lock);
	int rc = nf_io_ctx_pending(c->io) ? nf_io_ctx_wait(c->io, 1, -1) : 0;
	pthread_mutex_unlock(&c->wait_lock);
	return rc == -ETIMEDOUT ? 0 : rc;
}

int nf_cache_read_async(struct nf_cache *c, const struct nf_store_object *obj, void *buf, nf_io_done_fn fn,
			void *cookie)
{
	int rc;
	while ((rc = nf_io_ctx_read_object(c->io, obj, buf, fn, cookie)) == -EAGAIN) {
		/* the context's request limit: let some finish, then retry */
		int w = nf_cache_wait_io(c);
		if (w < 0)
			return w;
	}
	return rc;
}

/* ---- stats --------------------------------------------------------------------------- */

const uint64_t *nf_cache_signatures(const struct nf_cache *c, uint32_t layer, uint32_t expert,
				    uint32_t *tokens, uint32_t *words)
{
	*tokens = *words = 0;
	if (layer >= c->g.n_layer || expert >= c->g.n_expert)
		return NULL;
	const struct ffn_ent *f = &c->ffns[layer * c->g.n_expert + expert];
	if (!f->sig)
		return NULL;
	*tokens = f->sig_n;
	*words = c->sig_words;
	return f->sig;
}

const char *nf_cache_error_detail(const struct nf_cache *c)
{
	return c && c->io ? nf_io_ctx_error_detail(c->io) : "";
}

void nf_cache_stats_get(const struct nf_cache *c, struct nf_cache_stats *out)
{
	*out = c->st;
	struct nf_io_stats io;
	nf_io_ctx_stats(c->io, &io);
	out->verify_ns = io.verify_ns - c->st.verify_ns;     /* st holds the base at reset */
	out->verified = io.verified - c->st.verified;
}

void nf_cache_stats_reset(struct nf_cache *c)
{
	memset(&c->st, 0, sizeof(c->st));
	struct nf_io_stats io;
	nf_io_ctx_stats(c->io, &io);
	c->st.verify_ns = io.verify_ns;
	c->st.verified = io.verified;
}

void nf_cache_layout_get(const struct nf_cache *c, struct nf_cache_layout *out)
{
	*out = (struct nf_cache_layout){
		.arena = c->arena_bytes, .meta = c->meta_bytes, .pinned_used = c->pinned_used, .pinned_cap = c->pinned_cap,
		.hot = (uint64_t)c->n_hot * c->g.stride, .cold = (uint64_t)c->n_cold * c->g.stride,
		.hot_slots = c->n_hot, .cold_slots = c->n_cold, .hot_floor = c->hot_floor,
		.lent = (uint64_t)(c->n_hot - c->hot_floor) * c->g.stride, .hugepages = c->hugepages, .numa = c->numa,
		.hot_from_profile = c->hot_from_profile, .profile_error = c->profile_error,
		.profile_tokens = c->profile_tokens,
	};
}
