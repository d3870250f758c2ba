/*
 * store_update.c - in-place updates of a store as a new generation.
 *
 * Invariants (docs/FORMAT.md, item 6):
 *  1. Nothing the current superblock points to is overwritten: the new
 *     table goes after the end of the file, the new superblock over the
 *     older copy.
 *  2. Order: table, fsync, superblock of generation g + 1, fsync. A crash
 *     before the second write leaves generation g in use; a torn
 *     superblock fails its crc and generation g is used.
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

int nf_store_update_perm(const char *path, const struct nf_store_open_opts *o, uint32_t obj_index,
			 const uint32_t *perm, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	const struct nf_store_object **v = NULL;
	uint8_t *tbl = NULL, *pad = NULL;
	int fd = -1;
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
	uint64_t toff = (in.file_size + bs - 1) / bs * bs;
	uint64_t end = (toff + len + bs - 1) / bs * bs;
	pad = calloc(1, end - toff);
	if (!pad) {
		rc = -ENOMEM;
		goto out;
	}
	memcpy(pad, tbl, len);
	fd = sys->open(path, O_RDWR, 0);
	if (fd < 0) {
		rc = nf_diag_fail(d, -errno, "%s: cannot open for update: %s", path, nf_strerror(-errno));
		goto out;
	}
	if ((rc = write_all(sys, fd, pad, end - toff, toff)) < 0 || (sys->fsync(fd) < 0 && (rc = -errno))) {
		nf_diag_fail(d, rc, "%s: writing the new object table: %s", path, nf_strerror(rc));
		goto out;
	}
	in.generation++;
	in.file_size = end;
	in.table_offset = toff;
	in.table_length = len;
	struct nf_store_sb_disk sb;
	nf_store_sb_build(&sb, &in, crc);
	uint64_t slot = in.generation % 2;
	if ((rc = write_all(sys, fd, &sb, sizeof(sb), slot * NF_STORE_SB_SLOT)) < 0 ||
	    (sys->fsync(fd) < 0 && (rc = -errno))) {
		nf_diag_fail(d, rc, "%s: writing superblock %llu: %s", path, (unsigned long long)slot,
			     nf_strerror(rc));
		goto out;
	}
	rc = 0;
out:
	if (fd >= 0)
		sys->close(fd);
	free(pad);
	free(tbl);
	free(v);
	nf_store_close(s);
	return rc;
}
