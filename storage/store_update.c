/*
 * store_update.c - in-place updates of a store as a new generation.
 *
 * Invariants (docs/FORMAT.md, item 6):
 *  1. Nothing the current superblock points to is overwritten: the new
 *     table goes after the end of the file, the new superblock over the
 *     older copy.
 *  2. Order: new bytes (a table or a profile section), fsync, superblock
 *     of generation g + 1, fsync. A crash before the second write leaves
 *     generation g in use; a torn superblock fails its crc and generation
 *     g is used.
 *  3. A new superblock carries every field of the old one it does not
 *     change (the table for a profile update, the profile for a
 *     permutation update).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/store.h"
#include "store_format.h"

static int write_all(const struct nf_io_sys *sys, int fd, const void *buf, size_t len, uint64_t off)
{
	const uint8_t *p = buf;
	while (len) {
		ssize_t n = sys->pwrite(fd, p, len, (off_t)off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : NF_ESHORT;
		p += n;
		len -= (size_t)n;
		off += (uint64_t)n;
	}
	return 0;
}

/*
 * Append bytes[0, len) (len a multiple of the block size) at the
 * block-aligned end of the file described by *in, fsync, then write the
 * superblock of generation g + 1 built from *in as changed by set(), fsync.
 */
struct commit {
	const uint8_t *bytes;
	uint64_t len;          /* padded to the block size */
	uint64_t used;         /* meaningful bytes (table or section length) */
	uint32_t crc;
	enum { COMMIT_PROFILE, COMMIT_TABLE, COMMIT_PLAN } kind;
};

static const char *const commit_what[] = { "profile", "object table", "plan" };

static int commit(const char *path, const struct nf_io_sys *sys, struct nf_store_info in,
		  uint32_t table_crc, const struct commit *c, struct nf_diag *d)
{
	uint64_t bs = in.block_size;
	uint64_t off = (in.file_size + bs - 1) / bs * bs;
	int rc;
	int fd = sys->open(path, O_RDWR, 0);
	if (fd < 0)
		return nf_diag_fail(d, -errno, "%s: cannot open for update: %s", path, nf_strerror(-errno));
	if ((rc = write_all(sys, fd, c->bytes, c->len, off)) < 0 || (sys->fsync(fd) < 0 && (rc = -errno))) {
		nf_diag_fail(d, rc, "%s: writing the new %s: %s", path,
			     commit_what[c->kind], nf_strerror(rc));
		goto out;
	}
	in.generation++;
	in.file_size = off + c->len;
	if (c->kind == COMMIT_TABLE) {
		in.table_offset = off;
		in.table_length = c->used;
		table_crc = c->crc;
	} else if (c->kind == COMMIT_PLAN) {
		in.plan_offset = off;
		in.plan_length = c->used;
		in.plan_crc = c->crc;
	} else {
		in.profile_offset = off;
		in.profile_length = c->used;
		in.profile_crc = c->crc;
	}
	struct nf_store_sb_disk sb;
	nf_store_sb_build(&sb, &in, table_crc);
	uint64_t slot = in.generation % 2;
	if ((rc = write_all(sys, fd, &sb, sizeof(sb), slot * NF_STORE_SB_SLOT)) < 0 ||
	    (sys->fsync(fd) < 0 && (rc = -errno))) {
		nf_diag_fail(d, rc, "%s: writing superblock %llu: %s", path, (unsigned long long)slot,
			     nf_strerror(rc));
		goto out;
	}
	rc = 0;
out:
	sys->close(fd);
	return rc;
}

int nf_store_update_profile(const char *path, const struct nf_store_open_opts *o,
			    const struct nf_store_profile *p, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	uint8_t *buf = NULL;
	int rc = nf_store_open(path, o, &s, d);
	if (rc < 0)
		return rc;
	uint32_t n = nf_store_object_count(s);
	if (p->n_objects != n) {
		rc = nf_diag_fail(d, NF_EUSAGE, "%s: the profile is for %u objects, the store has %u", path,
				  p->n_objects, n);
		goto out;
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		uint32_t want = ob->kind == NF_STORE_KIND_FFN ? ob->n_bundles : 0;
		if ((p->counts[i] ? p->lens[i] : 0) != want) {
			rc = nf_diag_fail(d, NF_EUSAGE, "%s: the profile has %u counts for object '%s' (%u expected)",
					  path, p->counts[i] ? p->lens[i] : 0, ob->name, want);
			goto out;
		}
	}
	struct commit c = { .kind = COMMIT_PROFILE };
	if ((rc = nf_store_profile_encode(p, nf_store_info(s)->block_size, &buf, &c.len, &c.used, &c.crc)) < 0)
		goto out;
	c.bytes = buf;
	rc = commit(path, nf_store_sys(s), *nf_store_info(s), nf_store_info(s)->table_crc, &c, d);
out:
	free(buf);
	nf_store_close(s);
	return rc;
}

int nf_store_update_perm(const char *path, const struct nf_store_open_opts *o, uint32_t obj_index,
			 const uint32_t *perm, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	const struct nf_store_object **v = NULL;
	uint8_t *tbl = NULL, *pad = NULL;
	int rc = nf_store_open(path, o, &s, d);
	if (rc < 0)
		return rc;
	const struct nf_io_sys *sys = nf_store_sys(s);
	const struct nf_store_object *ob = nf_store_object_get(s, obj_index);
	if (!ob || ob->kind != NF_STORE_KIND_FFN) {
		rc = nf_diag_fail(d, NF_EUSAGE, "%s: object %u is not an FFN", path, obj_index);
		goto out;
	}
	uint8_t *seen = calloc(ob->n_bundles, 1);
	if (!seen) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t k = 0; k < ob->n_bundles && rc == 0; k++) {
		if (perm[k] >= ob->n_bundles || seen[perm[k]])
			rc = nf_diag_fail(d, NF_EUSAGE, "%s: '%s': perm[%u] = %u is out of range or repeated",
					  path, ob->name, k, perm[k]);
		else
			seen[perm[k]] = 1;
	}
	free(seen);
	if (rc < 0)
		goto out;

	struct nf_store_info in = *nf_store_info(s);
	struct nf_store_object changed = *ob;
	changed.perm = perm;
	v = malloc(in.n_objects * sizeof(*v));
	if (!v) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t i = 0; i < in.n_objects; i++)
		v[i] = i == obj_index ? &changed : nf_store_object_get(s, i);
	uint64_t len;
	uint32_t crc;
	if ((rc = nf_store_table_encode(v, in.n_objects, &tbl, &len, &crc)) < 0)
		goto out;
	uint64_t bs = in.block_size;
	uint64_t padded = (len + bs - 1) / bs * bs;
	pad = calloc(1, padded);
	if (!pad) {
		rc = -ENOMEM;
		goto out;
	}
	memcpy(pad, tbl, len);
	struct commit c = { .bytes = pad, .len = padded, .used = len, .crc = crc, .kind = COMMIT_TABLE };
	rc = commit(path, sys, in, 0, &c, d);
out:
	free(pad);
	free(tbl);
	free(v);
	nf_store_close(s);
	return rc;
}

int nf_store_update_plan(const char *path, const struct nf_store_open_opts *o, const struct nf_store_plan *p,
			 struct nf_diag *d)
{
	struct nf_store *s = NULL;
	uint8_t *buf = NULL;
	int rc = nf_store_plan_check(p, path, d);
	if (rc < 0)
		return rc;
	if ((rc = nf_store_open(path, o, &s, d)) < 0)
		return rc;
	struct commit c = { .kind = COMMIT_PLAN };
	if ((rc = nf_store_plan_encode(p, nf_store_info(s)->block_size, &buf, &c.len, &c.used, &c.crc)) < 0)
		goto out;
	c.bytes = buf;
	rc = commit(path, nf_store_sys(s), *nf_store_info(s), nf_store_info(s)->table_crc, &c, d);
out:
	free(buf);
	nf_store_close(s);
	return rc;
}
