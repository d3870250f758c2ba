/*
 * store_profile.c - a store's activation profile (docs/FORMAT.md item 19):
 * per FFN object, how often each neuron fired over calibration tokens.
 *
 * Invariants:
 *  1. The section is read whole and checked (crc32c from the superblock,
 *     magic, version, every entry naming an FFN object of the table with
 *     its neuron count, no object twice) before any count is used.
 *  2. Counts are indexed by neuron id, never by bundle slot, so a relayout
 *     (which changes slots) leaves them valid.
 *  3. Encoding is deterministic: entries in object-table order, padding
 *     zero, so a section written twice is byte-identical.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/crc32c.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "store_format.h"

const char *nf_store_profile_source_name(uint32_t source)
{
	switch (source) {
	case NF_STORE_PROFILE_PREDICTOR: return "predictor";
	case NF_STORE_PROFILE_EXACT: return "exact";
	case NF_STORE_PROFILE_DENSE: return "dense";
	}
	return "unknown";
}

bool nf_store_has_profile(const struct nf_store *s)
{
	return nf_store_info(s)->profile_length != 0;
}

void nf_store_profile_free(struct nf_store_profile *p)
{
	if (!p)
		return;
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (p->counts)
			free(p->counts[i]);
		if (p->order)
			free(p->order[i]);
	}
	free(p->counts);
	free(p->order);
	free(p->lens);
	free(p);
}

static struct nf_store_profile *profile_new(uint32_t n)
{
	struct nf_store_profile *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->n_objects = n;
	p->counts = calloc(n ? n : 1, sizeof(*p->counts));
	p->lens = calloc(n ? n : 1, sizeof(*p->lens));
	if (!p->counts || !p->lens) {
		nf_store_profile_free(p);
		return NULL;
	}
	return p;
}

int nf_store_profile_alloc(const struct nf_store *s, struct nf_store_profile **out)
{
	uint32_t n = nf_store_object_count(s);
	struct nf_store_profile *p = profile_new(n);
	*out = NULL;
	if (!p)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		if (o->kind != NF_STORE_KIND_FFN)
			continue;
		if (!(p->counts[i] = calloc(o->n_bundles, sizeof(uint32_t)))) {
			nf_store_profile_free(p);
			return -ENOMEM;
		}
		p->lens[i] = o->n_bundles;
	}
	*out = p;
	return 0;
}

/* p has an order for every FFN entry, each a permutation of its neurons. */
static bool has_orders(const struct nf_store_profile *p)
{
	if (!p->order)
		return false;
	bool any = false;
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (!p->counts[i] || !p->lens[i])
			continue;
		if (!p->order[i] || !nf_store_profile_order_valid(p->order[i], p->lens[i]))
			return false;
		any = true;
	}
	return any;
}

bool nf_store_profile_order_valid(const uint32_t *order, uint32_t n)
{
	uint8_t *seen = calloc(n ? n : 1, 1);
	bool ok = seen != NULL;
	for (uint32_t r = 0; ok && r < n; r++) {
		if (order[r] >= n || seen[order[r]])
			ok = false;
		else
			seen[order[r]] = 1;
	}
	free(seen);
	return ok;
}

static void put_u32s(uint8_t *buf, uint64_t *off, const uint32_t *v, uint32_t n)
{
	for (uint32_t k = 0; k < n; k++) {
		uint32_t x = htole32(v[k]);
		memcpy(buf + *off, &x, 4);
		*off += 4;
	}
}

static void get_u32s(const uint8_t *buf, uint64_t *off, uint32_t *v, uint32_t n)
{
	for (uint32_t k = 0; k < n; k++) {
		uint32_t x;
		memcpy(&x, buf + *off, 4);
		v[k] = le32toh(x);
		*off += 4;
	}
}

int nf_store_profile_encode(const struct nf_store_profile *p, uint32_t bs, uint8_t **out,
			    uint64_t *len, uint64_t *used, uint32_t *crc)
{
	uint32_t n_ffn = 0;
	uint64_t total = sizeof(struct nf_store_profile_disk);
	bool orders = has_orders(p);
	for (uint32_t i = 0; i < p->n_objects; i++)
		if (p->counts[i] && p->lens[i]) {
			n_ffn++;
			total += sizeof(struct nf_store_profile_entry_disk) + (orders ? 8ull : 4ull) * p->lens[i];
		}
	uint64_t padded = (total + bs - 1) / bs * bs;
	uint8_t *buf = calloc(1, padded);
	if (!buf)
		return -ENOMEM;
	struct nf_store_profile_disk h;
	memset(&h, 0, sizeof(h));
	h.magic = htole64(NF_STORE_PROFILE_MAGIC);
	h.version = htole32(NF_STORE_PROFILE_VERSION);
	h.n_ffn = htole32(n_ffn);
	h.tokens = htole64(p->tokens);
	h.source = htole32(p->source);
	h.flags = htole32(orders ? NF_STORE_PROFILE_F_ORDER : 0);
	h.created_ns = htole64(p->created_ns);
	memcpy(buf, &h, sizeof(h));
	uint64_t eoff = sizeof(h), coff = eoff + (uint64_t)n_ffn * sizeof(struct nf_store_profile_entry_disk);
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (!p->counts[i] || !p->lens[i])
			continue;
		struct nf_store_profile_entry_disk e = { htole32(i), htole32(p->lens[i]) };
		memcpy(buf + eoff, &e, sizeof(e));
		eoff += sizeof(e);
		put_u32s(buf, &coff, p->counts[i], p->lens[i]);
	}
	for (uint32_t i = 0; orders && i < p->n_objects; i++)
		if (p->counts[i] && p->lens[i])
			put_u32s(buf, &coff, p->order[i], p->lens[i]);
	*out = buf;
	*len = padded;
	*used = total;
	*crc = nf_crc32c(0, buf, total);
	return 0;
}

#define PFAIL(code, ...) nf_diag_fail(d, code, __VA_ARGS__)

int nf_store_section_read(const struct nf_store *s, uint64_t off, uint64_t len, uint32_t crc, const char *what,
			  uint8_t **out, struct nf_diag *d)
{
	const struct nf_io_sys *sys = nf_store_sys(s);
	const char *path = nf_store_path(s);
	uint8_t *buf = malloc(len ? len : 1);
	int rc = 0;
	*out = NULL;
	if (!buf)
		return PFAIL(-ENOMEM, "%s: no memory for the %llu-byte %s", path, (unsigned long long)len, what);
	int fd = sys->open(path, O_RDONLY, 0);
	if (fd < 0) {
		rc = PFAIL(-errno, "%s: cannot open: %s", path, nf_strerror(-errno));
		goto out;
	}
	if ((rc = nf_io_pread_full(sys, fd, buf, len, off)) < 0) {
		PFAIL(rc, "%s: reading the %s: %s", path, what, nf_strerror(rc));
		goto out;
	}
	if (nf_crc32c(0, buf, len) != crc)
		rc = PFAIL(NF_ECHECKSUM, "%s: %s: crc32c mismatch", path, what);
out:
	if (fd >= 0)
		sys->close(fd);
	if (rc < 0)
		free(buf);
	else
		*out = buf;
	return rc;
}

int nf_store_profile_read(const struct nf_store *s, struct nf_store_profile **out,
			  struct nf_diag *d)
{
	const struct nf_store_info *in = nf_store_info(s);
	const char *path = nf_store_path(s);
	uint8_t *buf = NULL;
	struct nf_store_profile *p = NULL;
	int rc;
	*out = NULL;
	if (!in->profile_length)
		return PFAIL(-ENOENT, "%s: the store has no profile (run with --profile first)", path);
	uint64_t len = in->profile_length;
	if (len < sizeof(struct nf_store_profile_disk) || len > (1ull << 34))
		return PFAIL(NF_EFORMAT, "%s: profile_length %llu is not a profile section", path,
			     (unsigned long long)len);
	if ((rc = nf_store_section_read(s, in->profile_offset, len, in->profile_crc, "profile", &buf, d)) < 0)
		goto out;
	struct nf_store_profile_disk h;
	memcpy(&h, buf, sizeof(h));
	if (le64toh(h.magic) != NF_STORE_PROFILE_MAGIC) {
		rc = PFAIL(NF_EFORMAT, "%s: profile: bad magic", path);
		goto out;
	}
	if (le32toh(h.version) != NF_STORE_PROFILE_VERSION) {
		rc = PFAIL(NF_EVERSION, "%s: profile: version %u is not supported (this nflash reads %u)", path,
			   le32toh(h.version), NF_STORE_PROFILE_VERSION);
		goto out;
	}
	uint32_t n_ffn = le32toh(h.n_ffn), n_obj = nf_store_object_count(s);
	uint64_t eoff = sizeof(h), coff = eoff + (uint64_t)n_ffn * sizeof(struct nf_store_profile_entry_disk);
	if (n_ffn > n_obj || coff > len) {
		rc = PFAIL(NF_EFORMAT, "%s: profile: n_ffn %u does not fit (%u objects, %llu bytes)", path, n_ffn,
			   n_obj, (unsigned long long)len);
		goto out;
	}
	if (!(p = profile_new(n_obj))) {
		rc = -ENOMEM;
		goto out;
	}
	p->tokens = le64toh(h.tokens);
	p->source = le32toh(h.source);
	p->created_ns = le64toh(h.created_ns);
	for (uint32_t k = 0; k < n_ffn; k++) {
		struct nf_store_profile_entry_disk e;
		memcpy(&e, buf + eoff, sizeof(e));
		eoff += sizeof(e);
		uint32_t oi = le32toh(e.obj_index), nb = le32toh(e.n_bundles);
		const struct nf_store_object *o = nf_store_object_get(s, oi);
		if (!o || o->kind != NF_STORE_KIND_FFN || o->n_bundles != nb || p->counts[oi]) {
			rc = PFAIL(NF_EFORMAT,
				   "%s: profile entry %u: object %u with %u neurons is not an FFN of this store "
				   "(or appears twice)", path, k, oi, nb);
			goto out;
		}
		if (coff + 4ull * nb > len) {
			rc = PFAIL(NF_EFORMAT, "%s: profile entry %u: counts past the end of the section", path, k);
			goto out;
		}
		if (!(p->counts[oi] = malloc(4ull * nb))) {
			rc = -ENOMEM;
			goto out;
		}
		p->lens[oi] = nb;
		get_u32s(buf, &coff, p->counts[oi], nb);
	}
	if (le32toh(h.flags) & NF_STORE_PROFILE_F_ORDER) {
		/* the orders follow, entry by entry in the same order */
		if (!(p->order = calloc(n_obj ? n_obj : 1, sizeof(*p->order)))) {
			rc = -ENOMEM;
			goto out;
		}
		eoff = sizeof(h);
		for (uint32_t k = 0; k < n_ffn; k++) {
			struct nf_store_profile_entry_disk e;
			memcpy(&e, buf + eoff, sizeof(e));
			eoff += sizeof(e);
			uint32_t oi = le32toh(e.obj_index), nb = le32toh(e.n_bundles);
			if (coff + 4ull * nb > len) {
				rc = PFAIL(NF_EFORMAT, "%s: profile entry %u: order past the end of the section", path, k);
				goto out;
			}
			if (!(p->order[oi] = malloc(4ull * (nb ? nb : 1)))) {
				rc = -ENOMEM;
				goto out;
			}
			get_u32s(buf, &coff, p->order[oi], nb);
			if (!nf_store_profile_order_valid(p->order[oi], nb)) {
				rc = PFAIL(NF_EFORMAT, "%s: profile entry %u: the order of object %u is not a permutation "
					   "of its %u neurons", path, k, oi, nb);
				goto out;
			}
		}
	}
	*out = p;
	p = NULL;
	rc = 0;
out:
	free(buf);
	nf_store_profile_free(p);
	return rc;
}
