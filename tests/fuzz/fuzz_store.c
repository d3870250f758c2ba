/*
 * fuzz_store.c - libFuzzer target for the store reader (`make fuzz`).
 *
 * The input is a whole store file, served from memory through the
 * syscall table (fuzz_fix.c). nf_store_open() parses both superblocks and
 * the object table (entries, aux arrays, FFN permutations, bundle
 * checksums); if it accepts, every object is walked (layout, extents and
 * their data checks where the bytes are in the input, the permutation,
 * the bundle checks), and the profile and plan sections are read. The
 * custom mutator recomputes the crcs after mutating, so the parsers behind
 * them see structure, not only checksum failures. Invariants checked: a
 * rejected input sets a message and leaves *out NULL; an accepted one has
 * every object inside the file and every permutation a bijection.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/bundle.h"
#include "nflash/store.h"
#include "fuzz_fix.h"

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed)
{
	return fuzz_store_mutate(data, size, max_size, seed);
}

static void walk_ffn(const struct nf_store_object *o, const uint8_t *data, size_t size)
{
	struct nf_bundle_layout L;
	nf_store_ffn_layout(o, &L);
	uint8_t *seen = calloc(o->n_bundles ? o->n_bundles : 1, 1);
	if (!seen)
		return;
	for (uint32_t k = 0; k < o->n_bundles; k++) {
		if (o->perm[k] >= o->n_bundles || seen[o->perm[k]])
			abort();          /* the reader promised a bijection */
		seen[o->perm[k]] = 1;
	}
	free(seen);
	for (uint32_t e = 0; e < o->n_extents && e < 64; e++) {
		uint32_t first, count;
		uint64_t off, len;
		nf_store_extent_bundles(o, e, &first, &count);
		nf_store_extent_span(o, e, &off, &len);
		if (first + count > o->n_bundles || off + len > o->offset + o->length)
			abort();
		if (off + len <= size) {
			nf_store_extent_check(o, e, data + off);
			for (uint32_t b = first; b < first + count; b++)
				nf_store_bundle_check(o, b, data + nf_store_bundle_offset(o, b));
		}
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fuzz_mem_set(data, size);
	struct nf_store_open_opts so = { .sys = fuzz_mem_sys };
	struct nf_store *s = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_store_open("fuzz.nfs", &so, &s, &d);
	if (rc < 0) {
		if (s || !d.msg[0])
			abort();
		return 0;
	}
	const struct nf_store_info *in = nf_store_info(s);
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		if (o->offset + o->length > in->file_size)
			abort();
		if (o->kind == NF_STORE_KIND_FFN) {
			walk_ffn(o, data, size);
			if (nf_store_ffn_find(s, o->layer, o->expert) != o)
				abort();
		} else if (o->offset + o->length <= size) {
			nf_store_object_check(o, data + o->offset);
		}
		if (nf_store_object_find(s, o->name) != o)
			abort();
	}
	struct nf_store_profile *p = NULL;
	if (nf_store_profile_read(s, &p, &d) == 0)
		nf_store_profile_free(p);
	struct nf_store_plan *pl = NULL;
	if (nf_store_plan_read(s, &pl, &d) == 0) {
		nf_store_plan_pick(pl, 1ull << 31);
		nf_store_plan_free(pl);
	}
	nf_store_close(s);
	return 0;
}
