/*
 * nflash/cache.h - the segmented neuron cache of a store, and its
 * cluster-ready events.
 *
 * The cache is compute's one door to a store: every byte a model reads
 * from it comes through one of its segments and its one I/O context.
 *  - pinned: dense objects every token needs (embeddings, norms, output,
 *    attention when it fits), read whole at load (nf_cache_pin_objects),
 *    each in its own aligned buffer, kept until close;
 *  - streamed: dense objects too large to pin (attention of a model whose
 *    dense weights exceed the budget), read group by group into a few
 *    rotating buffers (nflash/stream.h, opened on the cache);
 * and one arena, allocated once from the memory budget (NUMA-placed next
 * to the compute threads, transparent hugepages where available), for the
 * FFN's bundles:
 *  - hot: the most frequently requested neurons over all layers and
 *    experts (a layer that fires more gets more; nf_cache_hot_quota), loaded in
 *    large sequential reads by nf_cache_hot_load() from the firing counts:
 *    the store's profile (nflash/store.h), loaded at open, or counts
 *    learned online from the requests;
 *  - cold: fixed-size slots (one bundle each) shared by all layers, CLOCK
 *    eviction; a run of bundles adjacent in the store is read with one
 *    request into adjacent slots.
 *
 * The cache owns lookups. Compute asks for a set of neurons of one
 * (layer, expert): hits are reported at once through the callback, misses
 * are read (all of them submitted at once, at the I/O context's queue
 * depth) and reported when their read lands: the I/O completion pushes an
 * event on a mutex-protected queue and nf_cache_reap() hands events to the
 * caller. Slots handed out stay valid until nf_cache_release().
 *
 *	nf_cache_open_dense(store, NULL, &c, &diag);        // the model's load
 *	nf_cache_pin_objects(c, objs, n, data, &diag);      // dense weights
 *	struct nf_cache_opts o;
 *	nf_cache_opts_default(&o);
 *	o.arena_bytes = budget - reserved;
 *	nf_cache_ffn_setup(c, &o, &diag);    // or nf_cache_open(): both at once
 *	nf_cache_request(c, layer, 0, ids, n, ptrs, ready_fn, me);  // hits: ready_fn now
 *	while (work left) nf_cache_reap(c, ready_fn, me);          // misses as they land
 *	nf_cache_release(c);                                         // end of the layer
 *
 * Errors: a failed read is reported to ready_fn with its error; the layer
 * fails, the cache stays usable (the slots of a failed read are freed).
 * Thread-safety: request/release/hot_load from one thread; reap from any
 * thread (serialised inside); stats from the requesting thread.
 */
#ifndef NFLASH_CACHE_H
#define NFLASH_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"
#include "nflash/io.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_store;
struct nf_store_object;
struct nf_cache;

struct nf_cache_opts {
	uint64_t arena_bytes;      /* hot + cold; required */
	uint64_t pinned_bytes;     /* most bytes the pinned segment may hold (default 0: no limit) */
	double hot_fraction;       /* of the arena, for the hot segment (default 0.5) */
	/* Misses up to this many store slots apart are read as one request,
	 * the bundles between them (cached nowhere) read and cached as well:
	 * one request costs more than a few KiB more (default 4; 0: only
	 * adjacent misses join). */
	uint32_t max_gap;
	int numa_node;             /* -1: the caller's node */
	bool prefault;             /* touch the whole arena at open (no page faults later) */
	/* Use the store's activation profile (default true): counts seeded from
	 * it and the hot segment loaded at open, in large sequential reads.
	 * Without a profile (or with false) the hot set is learned online. */
	bool use_profile;
	/* hot_fraction when the profile is used (default 1.0: the hot segment
	 * takes all but the cold minimum, one layer's bundles; on the 7B synth
	 * model the cold segment's CLOCK adds <5% hits, a profile's hot set
	 * ~10% more) */
	double profile_hot_fraction;
	struct nf_io_opts io;      /* backend, queue depth (default 256), faults */
	/* Record which neurons up to sig_tokens of an FFN's requests asked
	 * for, sampled uniformly over the run (every request while there is
	 * room, then every 2nd, 4th, ...), for a co-activation layout
	 * (nf_cache_signatures, nf_coact_order; default 0: off). Costs
	 * n_neurons * ceil(sig_tokens / 64) * 8 bytes per FFN, outside the
	 * arena (a calibration run's). */
	uint32_t sig_tokens;
	/* Smallest cold segment, in slots (default 0: one FFN's neurons, what
	 * a request for a whole layer needs). The sparse engine splits what
	 * does not fit (nf_cache_cold_needed): a token's chunks into windows, a
	 * batch into halves; a predictor-mode decode needs only its misses, so
	 * the rest of a smaller cold segment can be hot. */
	uint32_t min_cold_slots;
	/* Memory lent to the hot segment beyond arena_bytes (default 0),
	 * taken back by nf_cache_give_back: a budgeted engine lends the KV
	 * cache's unwritten part. Of it, nf_cache_lend_cost's bytes (the lent
	 * slots' tables, a page of rounding) must come out of arena_bytes. */
	uint64_t lend_bytes;
};

void nf_cache_opts_default(struct nf_cache_opts *o);

/*
 * What lending lend_bytes costs for good: the lent slots' tables, which
 * stay, and the rounding of a give-back to whole (huge) pages. *slots: the
 * cold slots the loan adds. 0 when the loan adds no slot.
 */
uint64_t nf_cache_lend_cost(struct nf_store *s, uint64_t lend_bytes, uint32_t *slots);
/*
 * Take bytes of the loan back (cumulative over calls, at most lend_bytes
 * in all). The loan's slots are hot slots at the arena's tail: the least
 * used hot neurons leave (read again when asked for), the survivors move
 * down into their slots, and the tail's pages go back to the system, so that
 * the cache's resident arena and tables never exceed arena_bytes, the
 * tables of arena_bytes and lend_bytes less what was taken back. Call
 * between requests (after nf_cache_release), from the requesting thread;
 * route-ahead reads in flight are waited for. Returns 0, or -EBUSY if a
 * slot to empty is pinned (a request not released).
 */
int nf_cache_give_back(struct nf_cache *c, uint64_t bytes);

/* The down part of a bundle (the values of enum nf_down_form in
 * nflash/bundle.h): a row of dim values in down_dtype, or QCOL quants. */
enum nf_cache_down_form { NF_CACHE_DOWN_ROW = 0, NF_CACHE_DOWN_QCOL = 1 };

/* Geometry of the store's FFN bundles (all FFN objects share it). */
struct nf_cache_geom {
	uint32_t n_layer, n_expert;
	uint32_t dim, n_neurons;
	uint32_t dtype, down_dtype; /* down_dtype: the first FFN's; K-quant downs may differ per
				     * FFN (nf_model_ffn_layout has each one's) */
	uint32_t down_form;        /* enum nf_cache_down_form */
	bool has_gate;
	uint32_t row_bytes, down_off, stride;
};

struct nf_cache_stats {
	uint64_t lookups;          /* neurons asked for */
	uint64_t hits_hot, hits_cold, misses;
	uint64_t requests;         /* read requests submitted (runs of adjacent bundles) */
	uint64_t bytes_read;       /* by those requests, and by hot loads */
	uint64_t hot_loads, hot_bytes;
	uint64_t hot_requests;     /* reads of hot loads (runs split at the I/O context's max_coalesce) */
	uint64_t evictions;
	uint64_t errors;
	uint64_t gap_bundles;      /* not requested, read to join two misses in one read */
	uint64_t promotions;       /* neurons moved from the cold segment to the hot (rebalance) */
	uint64_t hot_given_back;   /* hot slots given back to a filling KV cache (nf_cache_give_back) */
	uint64_t verify_ns;        /* CPU time of crc32c checks in the completion path */
	uint64_t verified;         /* bytes those checks covered */
	/* route-ahead reads (nf_cache_prefetch), also counted in requests,
	 * bytes_read and gap_bundles; a failed one in errors */
	uint64_t prefetch_requests, prefetch_bytes;
	uint64_t prefetch_neurons;  /* bundles asked for that they read */
	uint64_t prefetch_hits;     /* bundles they read (asked for, or between two that were)
				     * that a request then found (cold hits) */
	uint64_t prefetch_waits;    /* of those, found while still in flight (reported when it landed) */
};

struct nf_cache;

/*
 * nf_cache_open - a cache over store s's FFN objects (s must outlive it).
 * With o->use_profile and a profile in the store, the counts are seeded
 * from it and the hot segment is loaded before it returns (a damaged
 * profile is skipped: nf_cache_layout says why).
 * Returns 0 and *out, or NF_EUSAGE (no FFN objects, mixed geometry),
 * NF_EBUDGET (arena too small for one layer's neurons: the message states
 * the minimum), the I/O context's errors, or -ENOMEM; d says which.
 */
int nf_cache_open(struct nf_store *s, const struct nf_cache_opts *o, struct nf_cache **out,
		  struct nf_diag *d);
/*
 * nf_cache_open_dense - a cache of store s with its I/O context (io: NULL
 * for defaults) and no FFN segments yet: what a model's load pins its
 * dense objects into. nf_cache_ffn_setup adds the FFN segments later (the
 * budget decides them once the model is known). Returns 0 and *out, the
 * I/O context's errors, or -ENOMEM.
 */
int nf_cache_open_dense(struct nf_store *s, const struct nf_io_opts *io, struct nf_cache **out,
			struct nf_diag *d);
/*
 * nf_cache_ffn_setup - the hot and cold segments of cache c (opened by
 * nf_cache_open_dense), as nf_cache_open makes them; the I/O context is
 * reopened when o->io differs from its settings (no read may be in flight:
 * no stream open). Pinned objects stay. Returns what nf_cache_open returns;
 * on failure c keeps its pinned segment and has no FFN segments.
 */
int nf_cache_ffn_setup(struct nf_cache *c, const struct nf_cache_opts *o, struct nf_diag *d);
/* The cache's I/O context with settings o (backend, queue depth, faults):
 * kept when they are its settings, else replaced by a new one. No read
 * may be in flight. Returns 0 or the new context's error (the old one is
 * kept then). */
int nf_cache_reopen_io(struct nf_cache *c, const struct nf_io_opts *o, struct nf_diag *d);
/* Waits for reads in flight, frees the arena. NULL allowed. */
void nf_cache_close(struct nf_cache *c);

void nf_cache_geometry(const struct nf_cache *c, struct nf_cache_geom *g);
/* The FFN geometry of store s (as nf_cache_geometry gives for a cache over
 * it); NF_EUSAGE if it has no FFN objects or they differ (d says which). */
int nf_cache_geometry_of(struct nf_store *s, struct nf_cache_geom *g, struct nf_diag *d);
/*
 * nf_cache_rebalance - online re-planning for the FFN (layer, expert),
 * right after its layer was released (no slot pinned, no read in flight;
 * otherwise it does nothing): its most frequent cold-resident neurons (just
 * read) are paired with its least frequent hot ones, and while the cold
 * one's count exceeds the hot one's by half again plus two they trade
 * slots; max_moves at most. Bundles move by memcpy (no I/O); addresses
 * handed out before are stale after it. O(slots) plus two sorts. Returns
 * the moves made.
 */
int nf_cache_rebalance(struct nf_cache *c, uint32_t layer, uint32_t expert, uint32_t max_moves);
/* Halve every neuron's count, so that the hot set follows recent requests. */
void nf_cache_decay(struct nf_cache *c);

/* The hot and cold slots nf_cache_open would make of o->arena_bytes over
 * store s. Returns 0 or NF_EUSAGE (no FFN objects). */
int nf_cache_split_for(struct nf_store *s, const struct nf_cache_opts *o, uint32_t *n_hot, uint32_t *n_cold);
/* The bytes of tables nf_cache_open allocates beside an arena of
 * arena_bytes (at most: every slot counted) with a co-activation record of
 * sig_tokens; 0 if s has no FFN objects. */
uint64_t nf_cache_meta_bytes_for(struct nf_store *s, uint64_t arena_bytes, uint32_t sig_tokens);
/* Smallest arena (bytes) nf_cache_open accepts for this store beside
 * pinned_bytes: one layer's neurons in cold slots. */
uint64_t nf_cache_min_bytes(struct nf_store *s);
/* The same with a cold segment of min_cold_slots (0: one layer's). */
uint64_t nf_cache_min_bytes_for(struct nf_store *s, uint32_t min_cold_slots);

/* Completion of neurons[0..n): their bundles are at ptrs[neuron] (result
 * 0) or could not be read (result < 0). Runs in the thread that requested
 * (hits) or that reaps (misses). */
typedef void (*nf_cache_ready_fn)(void *user, const uint32_t *neurons, uint32_t n, int result);

/*
 * nf_cache_request - neurons[0..n) (distinct ids) of FFN (layer, expert).
 * ptrs (n_neurons entries, indexed by neuron id) receives each bundle's
 * address: hits are filled and reported through fn before the call
 * returns; misses are filled now (the slot) and reported when their read
 * lands, through nf_cache_reap(). Returns 0, NF_EUSAGE (no such FFN),
 * NF_EBUDGET (more neurons than unpinned cold slots), or the I/O error that
 * prevented submitting (neurons already reported keep their report; the
 * others are reported failed through reap).
 */
int nf_cache_request(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons,
		     uint32_t n, const void **ptrs, nf_cache_ready_fn fn, void *user);

/*
 * nf_cache_request_tagged - nf_cache_request whose hits are reported to
 * fn(tag, ...) now and whose misses are handed by nf_cache_reap to its fn
 * with tag in place of the reaper's user: the requester tells its requests
 * apart. Several requests (of different FFNs) may go out before one
 * nf_cache_release, their reads all in flight together, as long as they
 * ask for at most n_neurons neurons in all (else NF_EBUDGET) and their
 * cold slots fit the cold segment.
 */
int nf_cache_request_tagged(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons,
			    uint32_t n, const void **ptrs, nf_cache_ready_fn fn, void *tag);

/*
 * nf_cache_prefetch - start reading the misses among neurons[0..n) of FFN
 * (layer, expert) into cold slots, reported to no one: a route-ahead read
 * of what a later request will probably ask for. Its reads go through the
 * same I/O context and may stay in flight across nf_cache_release; a later
 * request that asks for one of their bundles gets it reported when the
 * read lands (through nf_cache_reap, as its own misses; with the read's
 * error if it fails), or as a miss if it failed before, so what a request
 * hands out is what a request without the prefetch would have. Slots still filling
 * are never evicted nor given to a request (a request whose misses might
 * need them waits for them first); the misses taken are at most the cold
 * slots neither pinned nor filling. Requesting thread only. Returns the reads submitted (0: all
 * present, or no room) or NF_EUSAGE (no such FFN, a neuron out of range).
 * A read that cannot be queued is dropped (its slots freed).
 */
int nf_cache_prefetch(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons, uint32_t n);

/*
 * nf_cache_reap - hand queued completion events to fn; if none is queued
 * and reads are in flight, wait for at least one (one thread waits; the
 * others return at once to try again). Returns the number of events
 * handed, 0, or a backend error.
 */
int nf_cache_reap(struct nf_cache *c, nf_cache_ready_fn fn, void *user);

/*
 * nf_cache_poll - between compute steps (attention, from the thread that
 * runs the layer): collect the reads that have landed without waiting, so
 * that the reads queued behind them go to the device (nf_io_ctx_poll);
 * their events wait for nf_cache_reap. Costs one non-blocking syscall when
 * reads are in flight, nothing otherwise. Returns the requests completed,
 * 0 (none, or another thread is reaping), or a backend error, which the
 * next reap or release reports too.
 */
int nf_cache_poll(struct nf_cache *c);

/* End of a layer: waits for its reads (not route-ahead ones), unpins its
 * slots. Returns 0 or the first read error seen since the last release. */
int nf_cache_release(struct nf_cache *c);

/*
 * nf_cache_hot_load - fill the hot segment: the neurons with the highest
 * counts over all FFNs (online counts, or those set by nf_cache_set_counts;
 * see nf_cache_hot_quota), read in runs of adjacent bundles. Replaces the previous hot set. Returns 0 or
 * an I/O error.
 */
int nf_cache_hot_load(struct nf_cache *c);
/*
 * nf_cache_reserve - the cold slots the requests still to come before the
 * next nf_cache_release will pin (their nf_cache_cold_needed, summed).
 * Until then a read bridges a gap between misses only while those slots
 * stay free, so that requests made together (a mixture's routed experts)
 * each find room when the first ones' misses are far apart. Replaces the
 * previous value; nf_cache_release clears it.
 */
void nf_cache_reserve(struct nf_cache *c, uint32_t slots);
/* How many of neurons[0..n) of FFN (layer, expert) are not hot: the cold
 * slots nf_cache_request would pin for them now (misses, and hits in the
 * cold segment). At most the cold segment's slot count fits one request. */
uint32_t nf_cache_cold_needed(const struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons,
			  uint32_t n);
/* How many of `slots` hot slots each FFN gets (quota[layer * n_expert +
 * expert], n_layer * n_expert entries): the neurons with the `slots`
 * highest counts over all FFNs (ties at the threshold in FFN order), never
 * a neuron that has not fired. nf_cache_hot_load fills n_hot this way.
 * Returns 0. */
int nf_cache_hot_quota(const struct nf_cache *c, uint64_t slots, uint32_t *quota);
/* Count neurons[0..n) of (layer, expert) as used once more without
 * requesting them (nf_cache_request counts what it is asked for): a batch
 * that requests the union of its tokens' neurons counts each token's own
 * set this way, so the online hot set still follows per-token frequency.
 * Returns 0 or NF_EUSAGE. */
int nf_cache_count(struct nf_cache *c, uint32_t layer, uint32_t expert, const uint32_t *neurons, uint32_t n);
/* Firing counts of (layer, expert 0) from a profile: n_neurons values. */
int nf_cache_set_counts(struct nf_cache *c, uint32_t layer, const uint32_t *counts);
/* The counts of FFN (layer, expert): n_neurons values indexed by neuron id
 * (times requested since open, plus the profile's counts when one was
 * used), or NULL when there is no such FFN. Valid until close. */
const uint32_t *nf_cache_counts(const struct nf_cache *c, uint32_t layer, uint32_t expert);

/* The co-activation record of FFN (layer, expert) (opts sig_tokens),
 * sampled uniformly over the run (see record_signature in storage/cache.c):
 * n_neurons rows of *words uint64_t, bit t of neuron j's row set when the
 * FFN's request t asked for j, *tokens requests recorded. NULL when not
 * recording. Valid until close. */
const uint64_t *nf_cache_signatures(const struct nf_cache *c, uint32_t layer, uint32_t expert,
				    uint32_t *tokens, uint32_t *words);

/*
 * nf_cache_pin_objects - read objects objs[0..n) (dense or blobs) into the
 * pinned segment, all submitted at once, each checked against its crc32c,
 * and return their addresses in data[0..n) (valid until close; aligned to
 * 4 KiB and the I/O context's alignment). Returns 0, NF_EBUDGET (over
 * opts.pinned_bytes: the message says how much is needed), -ENOMEM, or the
 * first failed read's error, d naming its object; on failure nothing of
 * this call stays pinned.
 */
int nf_cache_pin_objects(struct nf_cache *c, const struct nf_store_object *const *objs, uint32_t n,
			 const void **data, struct nf_diag *d);
int nf_cache_pin_object(struct nf_cache *c, const struct nf_store_object *obj, const void **data,
			struct nf_diag *d);
/* Read a whole object into buf (nf_cache_align()-aligned, its
 * nf_store_object_buf_size() long), checked, without keeping it: for a
 * load that transforms what it reads (an FFN unpacked into memory). */
int nf_cache_read_object(struct nf_cache *c, const struct nf_store_object *obj, void *buf, struct nf_diag *d);
/*
 * Rows of a dense object left in the store (the token embedding: a token
 * needs one row of it, so it is not pinned; model_store.c).
 *
 * nf_cache_verify_object - read dense object obj in pieces of at most 1 MiB
 *   and check its crc32c, keeping none of it: at load, for an object later
 *   read a row at a time (rows carry no checksum of their own). Returns 0,
 *   NF_ECHECKSUM or the read's error, d naming the object.
 * nf_cache_row_span - scratch bytes nf_cache_read_rows needs per row of
 *   row_bytes: the row rounded out to the alignment on both sides.
 * nf_cache_read_rows - rows rows[0..n) of obj (row_bytes each, at
 *   obj->offset + row * row_bytes), all submitted at once through the
 *   cache's I/O context (O_DIRECT where the backend has it) and waited
 *   for; row k lands in scratch + k * span (scratch aligned to
 *   nf_cache_align()) and out[k] points at its first byte. A row outside
 *   the object is NF_EUSAGE. Counted in the stats' bytes_read (a failed read
 *   in errors). Returns 0 or the first failure, d naming the object.
 */
int nf_cache_verify_object(struct nf_cache *c, const struct nf_store_object *obj, struct nf_diag *d);
uint64_t nf_cache_row_span(const struct nf_cache *c, uint64_t row_bytes);
int nf_cache_read_rows(struct nf_cache *c, const struct nf_store_object *obj, uint64_t row_bytes,
		       const int32_t *rows, uint32_t n, void *scratch, const void **out, struct nf_diag *d);
/* The alignment the cache's reads need of buffers, offsets and lengths. */
uint32_t nf_cache_align(const struct nf_cache *c);
struct nf_store *nf_cache_store(const struct nf_cache *c);

/*
 * The streamed segment's reads (nflash/stream.h keeps its buffers): a
 * whole object read into buf on the cache's I/O context, checked on
 * completion, fn(cookie, result) run by whichever thread reaps it: the
 * stream waiting (nf_cache_wait_io), or the FFN's reapers in passing, so
 * the checks of a prefetched group overlap the FFN. nf_cache_read_async
 * returns 0 or an error (fn will not run); nf_cache_wait_io waits for at
 * least one completion of any of the cache's reads (none in flight: at
 * once) and returns 0 or the context's sticky error.
 */
int nf_cache_read_async(struct nf_cache *c, const struct nf_store_object *obj, void *buf, nf_io_done_fn fn,
			void *cookie);
int nf_cache_wait_io(struct nf_cache *c);

void nf_cache_stats_get(const struct nf_cache *c, struct nf_cache_stats *out);
/* The first failed read or checksum mismatch of the cache's I/O, naming
 * the object and file offset (nf_io_ctx_error_detail), or "". */
const char *nf_cache_error_detail(const struct nf_cache *c);
void nf_cache_stats_reset(struct nf_cache *c);

/* Bytes of each segment, and of the arena in total. */
struct nf_cache_layout {
	uint64_t arena, pinned_used, pinned_cap, hot, cold;
	uint64_t meta;             /* the cache's tables beside the arena (bytes) */
	uint32_t hot_slots, cold_slots;
	uint32_t hot_floor;        /* hot slots without the loan (hot_slots once all is given back) */
	uint64_t lent;             /* arena bytes of the loan's slots still held (in arena and hot) */
	bool hugepages, numa;
	/* Where the hot set came from: the store's profile (loaded at open),
	 * or learned online. profile_error: why a profile present in the store
	 * was not used (0 if it was, or there is none). */
	bool hot_from_profile;
	int profile_error;
	uint64_t profile_tokens;   /* calibration tokens of the profile used */
};
void nf_cache_layout_get(const struct nf_cache *c, struct nf_cache_layout *out);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_CACHE_H */
