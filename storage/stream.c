/*
 * stream.c - groups of dense objects read through rotating buffers (see
 * nflash/stream.h, docs/PIPELINE.md "Streamed attention").
 *
 * Invariants:
 *  1. A buffer (slot) is EMPTY, LOADING (reads of one group in flight),
 *     READY (every object of its group read and crc-checked) or FAILED;
 *     a held slot is READY and is never reused until released.
 *  2. Groups are used in cyclic order. After acquire or release of g the
 *     free slots are filled with the groups that follow g, nearest first;
 *     a slot is only taken from a group that is not among those next
 *     groups, so a prefetched group is never evicted for a later one.
 *  3. Memory is n_slots x slot bytes, allocated at open; acquire and
 *     release never allocate.
 *  4. Errors stick: the first failed read is returned by every call after
 *     it (the I/O context's own errors stick too).
 *  5. Reads go through the cache the stream is opened on (its streamed
 *     segment: one I/O context for every read of the store). Completions
 *     run in whichever thread reaps the cache's context: acquire waiting,
 *     or the FFN's reapers, so a prefetched group's crc32c checks overlap
 *     the FFN. A slot's pending count, state and the sticky error are
 *     atomics; the callback writes the slot's result before it publishes
 *     the state (release), the caller reads the state (acquire) before the
 *     result or the bytes.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nflash/cache.h"
#include "nflash/store.h"
#include "nflash/stream.h"

#define SLOT_ALIGN 4096u

enum slot_state { SLOT_EMPTY, SLOT_LOADING, SLOT_READY, SLOT_FAILED };

struct slot {
	struct nf_stream *st;
	uint8_t *buf;
	uint32_t group;
	_Atomic int state;         /* enum slot_state */
	bool held;
	atomic_uint pending;       /* object reads not yet completed, + 1 while queueing */
	_Atomic int result;
};

struct nf_stream {
	struct nf_store *store;
	struct nf_cache *cache;
	const struct nf_store_object **objs;
	uint64_t *off;             /* per object of a group: offset in a slot */
	uint32_t n_groups, per_group, n_slots;
	uint64_t slot_bytes;
	struct slot *slots;
	_Atomic int error;         /* sticky */
	atomic_ullong groups_done;
	struct nf_stream_stats st;
};

void nf_stream_opts_default(struct nf_stream_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->n_slots = 2;
}

static int slot_state(struct slot *sl);

static uint64_t round_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t nf_stream_slot_bytes(struct nf_store *s, const struct nf_store_object *const *objs,
			      uint32_t n_groups, uint32_t per_group)
{
	uint32_t bs = nf_store_info(s)->block_size;
	uint64_t max = 0;
	for (uint32_t g = 0; g < n_groups; g++) {
		uint64_t b = 0;
		for (uint32_t k = 0; k < per_group; k++) {
			const struct nf_store_object *o = objs[(size_t)g * per_group + k];
			if (!o || o->kind != NF_STORE_KIND_DENSE)
				return 0;
			b += round_up(nf_store_object_buf_size(o, bs), SLOT_ALIGN);
		}
		if (b > max)
			max = b;
	}
	return max;
}

int nf_stream_open(struct nf_cache *c, const struct nf_store_object *const *objs,
		   uint32_t n_groups, uint32_t per_group, const struct nf_stream_opts *o,
		   struct nf_stream **out, struct nf_diag *d)
{
	struct nf_store *s = nf_cache_store(c);
	struct nf_stream_opts def;
	if (!o) {
		nf_stream_opts_default(&def);
		o = &def;
	}
	if (!n_groups || !per_group || o->n_slots < 2)
		return nf_diag_fail(d, NF_EUSAGE, "stream: needs groups, objects per group and 2 or more slots");
	uint64_t sb = nf_stream_slot_bytes(s, objs, n_groups, per_group);
	if (!sb)
		return nf_diag_fail(d, NF_EUSAGE, "%s: stream: every object must be dense", nf_store_path(s));
	int rc = -ENOMEM;
	struct nf_stream *st = calloc(1, sizeof(*st));
	if (!st)
		return nf_diag_fail(d, rc, "stream: out of memory");
	st->store = s;
	st->cache = c;
	st->n_groups = n_groups;
	st->per_group = per_group;
	st->n_slots = o->n_slots;
	st->slot_bytes = sb;
	size_t n_obj = (size_t)n_groups * per_group;
	st->objs = calloc(n_obj, sizeof(*st->objs));
	st->off = calloc(n_obj, sizeof(*st->off));
	st->slots = calloc(o->n_slots, sizeof(*st->slots));
	if (!st->objs || !st->off || !st->slots)
		goto fail_nomem;
	memcpy(st->objs, objs, n_obj * sizeof(*objs));
	uint32_t bs = nf_store_info(s)->block_size;
	for (uint32_t g = 0; g < n_groups; g++) {
		uint64_t at = 0;
		for (uint32_t k = 0; k < per_group; k++) {
			size_t i = (size_t)g * per_group + k;
			st->off[i] = at;
			at += round_up(nf_store_object_buf_size(objs[i], bs), SLOT_ALIGN);
		}
	}
	for (uint32_t i = 0; i < o->n_slots; i++) {
		st->slots[i].st = st;
		atomic_init(&st->slots[i].state, SLOT_EMPTY);
		if (!(st->slots[i].buf = nf_io_buf_alloc(sb, SLOT_ALIGN)))
			goto fail_nomem;
	}
	*out = st;
	return 0;
fail_nomem:
	nf_diag_fail(d, rc, "%s: stream: out of memory for %u buffers of %llu bytes", nf_store_path(s),
		     o->n_slots, (unsigned long long)sb);
	nf_stream_close(st);
	return rc;
}

void nf_stream_close(struct nf_stream *st)
{
	if (!st)
		return;
	/* reads in flight land in the buffers: let them */
	for (uint32_t i = 0; st->slots && i < st->n_slots; i++)
		while (slot_state(&st->slots[i]) == SLOT_LOADING && nf_cache_wait_io(st->cache) == 0)
			;
	for (uint32_t i = 0; st->slots && i < st->n_slots; i++)
		nf_io_buf_free(st->slots[i].buf);
	free(st->slots);
	free(st->objs);
	free(st->off);
	free(st);
}

static void on_read(void *cookie, int result)
{
	struct slot *sl = cookie;
	int zero = 0;
	if (result < 0)
		atomic_compare_exchange_strong(&sl->result, &zero, result);
	if (atomic_fetch_sub(&sl->pending, 1) != 1)
		return;
	int r = atomic_load(&sl->result);
	if (r < 0) {
		zero = 0;
		atomic_compare_exchange_strong(&sl->st->error, &zero, r);
		atomic_store_explicit(&sl->state, SLOT_FAILED, memory_order_release);
		return;
	}
	atomic_fetch_add(&sl->st->groups_done, 1);
	atomic_store_explicit(&sl->state, SLOT_READY, memory_order_release);
}

static int slot_state(struct slot *sl)
{
	return atomic_load_explicit(&sl->state, memory_order_acquire);
}

/* Wait until slot sl is no longer LOADING. */
static int wait_slot(struct nf_stream *st, struct slot *sl)
{
	while (slot_state(sl) == SLOT_LOADING) {
		int w = nf_cache_wait_io(st->cache);
		if (w < 0 && slot_state(sl) == SLOT_LOADING) {
			/* the context failed: the slot's reads never report */
			int zero = 0;
			atomic_compare_exchange_strong(&st->error, &zero, w);
			return w;
		}
	}
	return 0;
}

/* Queue every object of group g into sl (an EMPTY or READY, unheld slot). */
static int load(struct nf_stream *st, struct slot *sl, uint32_t g)
{
	uint32_t bs = nf_store_info(st->store)->block_size;
	sl->group = g;
	atomic_store(&sl->result, 0);
	atomic_store(&sl->pending, 1);  /* held until every read is queued */
	atomic_store(&sl->state, SLOT_LOADING);
	for (uint32_t k = 0; k < st->per_group; k++) {
		size_t i = (size_t)g * st->per_group + k;
		atomic_fetch_add(&sl->pending, 1);
		int rc = nf_cache_read_async(st->cache, st->objs[i], sl->buf + st->off[i], on_read, sl);
		if (rc < 0) {
			int zero = 0;
			atomic_compare_exchange_strong(&st->error, &zero, rc);
			atomic_fetch_sub(&sl->pending, 1);
			on_read(sl, rc);  /* drops the queueing reference: FAILED once reads land */
			return rc;
		}
		st->st.objects_read++;
		st->st.bytes_read += nf_store_object_buf_size(st->objs[i], bs);
	}
	on_read(sl, 0);
	return 0;
}

static struct slot *find(struct nf_stream *st, uint32_t g)
{
	for (uint32_t i = 0; i < st->n_slots; i++)
		if (slot_state(&st->slots[i]) != SLOT_EMPTY && st->slots[i].group == g)
			return &st->slots[i];
	return NULL;
}

/* Distance of group h after group g in cyclic order (0 for g itself). */
static uint32_t ahead(const struct nf_stream *st, uint32_t g, uint32_t h)
{
	return (h + st->n_groups - g) % st->n_groups;
}

/*
 * An unheld slot to read a group w steps after g into: an empty one, else
 * the one whose group comes latest after g, provided it comes later than
 * w steps (so nothing nearer is evicted). NULL if none.
 */
static struct slot *victim(struct nf_stream *st, uint32_t g, uint32_t w)
{
	struct slot *best = NULL;
	uint32_t best_d = 0;
	for (uint32_t i = 0; i < st->n_slots; i++) {
		struct slot *sl = &st->slots[i];
		int state = slot_state(sl);
		if (sl->held || state == SLOT_LOADING)
			continue;
		if (state == SLOT_EMPTY || state == SLOT_FAILED)
			return sl;
		uint32_t d = ahead(st, g, sl->group);
		if (d == 0)
			d = st->n_groups;  /* g itself, released: used last */
		if (d > w && d > best_d) {
			best = sl;
			best_d = d;
		}
	}
	return best;
}

/* Read the groups after g into free slots, nearest first. */
static int prefetch(struct nf_stream *st, uint32_t g)
{
	uint32_t n = st->n_slots < st->n_groups ? st->n_slots : st->n_groups - 1;
	for (uint32_t w = 1; w <= n; w++) {
		uint32_t h = (g + w) % st->n_groups;
		if (find(st, h))
			continue;
		struct slot *sl = victim(st, g, w);
		if (!sl)
			break;
		int rc = load(st, sl, h);
		if (rc < 0)
			return rc;
	}
	return 0;
}

int nf_stream_acquire(struct nf_stream *st, uint32_t g, const void **data)
{
	int err = atomic_load(&st->error);
	if (err)
		return err;
	if (g >= st->n_groups)
		return NF_EUSAGE;
	struct slot *sl = find(st, g);
	int rc;
	if (sl && sl->held)
		return NF_EUSAGE;
	st->st.acquires++;
	double t0 = now_s();
	bool waited = false;
	if (!sl) {
		/* Not prefetched (first use, or after an aborted step): take the
		 * slot used last, waiting for its reads if need be. */
		while (!(sl = victim(st, g, 0))) {
			struct slot *busy = NULL;
			for (uint32_t i = 0; i < st->n_slots && !busy; i++)
				if (!st->slots[i].held && slot_state(&st->slots[i]) == SLOT_LOADING)
					busy = &st->slots[i];
			if (!busy)
				return NF_EBUDGET;
			waited = true;
			if ((rc = wait_slot(st, busy)) < 0)
				return rc;
		}
		if ((rc = load(st, sl, g)) < 0)
			return rc;
	}
	if (slot_state(sl) == SLOT_LOADING) {
		waited = true;
		if ((rc = wait_slot(st, sl)) < 0)
			return rc;
	}
	if (waited) {
		st->st.waits++;
		st->st.t_wait += now_s() - t0;
	}
	if (slot_state(sl) != SLOT_READY) {
		err = atomic_load(&st->error);
		return err ? err : NF_EUSAGE;
	}
	sl->held = true;
	for (uint32_t k = 0; k < st->per_group; k++) {
		size_t i = (size_t)g * st->per_group + k;
		data[k] = sl->buf + st->off[i];
	}
	return prefetch(st, g);
}

int nf_stream_release(struct nf_stream *st, uint32_t g)
{
	struct slot *sl = g < st->n_groups ? find(st, g) : NULL;
	if (sl)
		sl->held = false;
	int err = atomic_load(&st->error);
	if (err)
		return err;
	return g < st->n_groups ? prefetch(st, g) : NF_EUSAGE;
}

uint64_t nf_stream_bytes(const struct nf_stream *st)
{
	return st->slot_bytes * st->n_slots;
}

uint32_t nf_stream_n_slots(const struct nf_stream *st)
{
	return st->n_slots;
}

void nf_stream_stats_get(const struct nf_stream *st, struct nf_stream_stats *out)
{
	*out = st->st;
	out->groups_read = atomic_load(&st->groups_done);
}
