/*
 * nflash/stream.h - dense objects of a store read in groups through a small
 * rotating set of buffers, for weights too large to pin (attention of a
 * model whose dense objects exceed the memory budget, docs/PIPELINE.md).
 *
 * A stream has n_groups groups of per_group dense objects (e.g. one group
 * per layer: attn_q, attn_k, attn_v, attn_output) and n_slots buffers, each
 * large enough for the largest group. Groups are used in cyclic order
 * (0, 1, ..., n_groups - 1, 0, ...): while group g is held, the next groups
 * are read into the free buffers, so group g + 1 is (being) read while g is
 * computed on. Every read is an O_DIRECT read of a whole object through
 * the cache the stream is opened on (nflash/cache.h: its streamed segment,
 * on its one I/O context), its crc32c checked on completion.
 *
 *	struct nf_stream_opts o;
 *	nf_stream_opts_default(&o);               // 2 slots
 *	nf_stream_open(cache, objs, n_layer, 4, &o, &st, &d);
 *	for each layer l:
 *		const void *w[4];
 *		if (nf_stream_acquire(st, l, w) < 0) fail;  // waits for l's reads
 *		compute on w[0..3];
 *		nf_stream_release(st, l);                  // its buffer reads l + n_slots
 *	nf_stream_close(st);
 *
 * Errors (STYLE.md rule 6): a failed read (I/O error, short read, checksum
 * mismatch) is returned by the acquire of its group and by every call
 * after it, until the stream is closed.
 * Thread-safety: one thread at a time calls the functions, never while the
 * cache's FFN reads are being requested. Completions (and their crc32c
 * checks) run in whichever thread reaps the cache's I/O context: acquire,
 * or the FFN's reapers in passing (so a prefetched group is checked while
 * the FFN computes).
 */
#ifndef NFLASH_STREAM_H
#define NFLASH_STREAM_H

#include <stdbool.h>
#include <stdint.h>

#include "nflash/error.h"
#include "nflash/io.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_cache;
struct nf_store;
struct nf_store_object;

struct nf_stream_opts {
	uint32_t n_slots;          /* buffers of one group each, >= 2 (default 2) */
};

void nf_stream_opts_default(struct nf_stream_opts *o);

struct nf_stream_stats {
	uint64_t bytes_read;       /* whole object buffers read (block-rounded) */
	uint64_t objects_read;
	uint64_t groups_read;
	uint64_t acquires;
	uint64_t waits;            /* acquires that found their group not yet read */
	double t_wait;             /* seconds acquire spent waiting for reads */
};

struct nf_stream;

/*
 * nf_stream_slot_bytes - bytes one buffer takes for groups
 * objs[g * per_group .. + per_group) of store s (the largest group, each
 * object's block-rounded size at 4 KiB alignment). A stream of n slots
 * allocates n times this. 0 if an object is not dense.
 */
uint64_t nf_stream_slot_bytes(struct nf_store *s, const struct nf_store_object *const *objs,
			      uint32_t n_groups, uint32_t per_group);

/*
 * nf_stream_open - a stream over the dense objects objs[0 .. n_groups *
 * per_group) of the store of cache c (c and objs must outlive it; objs is
 * copied). o may be NULL for defaults. Allocates the buffers; reads
 * nothing yet. Returns 0 and *out, NF_EUSAGE (no groups, n_slots < 2, an
 * object that is not dense) or -ENOMEM; d says which.
 */
int nf_stream_open(struct nf_cache *c, const struct nf_store_object *const *objs,
		   uint32_t n_groups, uint32_t per_group, const struct nf_stream_opts *o,
		   struct nf_stream **out, struct nf_diag *d);
/* Waits for reads in flight, frees the buffers. NULL allowed. */
void nf_stream_close(struct nf_stream *st);

/*
 * nf_stream_acquire - group g's objects, read and verified: data[k] is
 * object g * per_group + k (valid until nf_stream_release(st, g)). Reads g
 * now if no buffer holds it, waits for its reads, and starts reading the
 * groups after it into free buffers. Returns 0, NF_EUSAGE (g out of range,
 * or already held), NF_EBUDGET (every buffer held), or the read's error
 * (sticky).
 */
int nf_stream_acquire(struct nf_stream *st, uint32_t g, const void **data);

/* Done with group g: its buffer may be reused; the next groups in cyclic
 * order are read into free buffers. Returns 0 or the sticky error. */
int nf_stream_release(struct nf_stream *st, uint32_t g);

/* Bytes of the buffers (n_slots x slot bytes). */
uint64_t nf_stream_bytes(const struct nf_stream *st);
uint32_t nf_stream_n_slots(const struct nf_stream *st);
void nf_stream_stats_get(const struct nf_stream *st, struct nf_stream_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_STREAM_H */
