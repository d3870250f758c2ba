/*
 * store.c - opening and validating a store; locating objects, extents and
 * bundles.
 *
 * Invariants:
 *  1. Nothing read from the file is trusted: every count, offset and length
 *     is checked against the file size and for overflow before it is used,
 *     and each failure names the field (nf_diag).
 *  2. The superblock used is the valid copy with the higher generation; a
 *     damaged copy is reported in nf_store_info.other_sb_error, not fatal.
 *  3. After open the store is immutable, so readers may share it.
 *  4. All multi-byte fields are little-endian on disk and decoded with
 *     le*toh; aux arrays are decoded in place.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nflash/bundle.h"
#include "nflash/crc32c.h"
#include "nflash/dtype.h"
#include "nflash/store.h"
#include "store_format.h"

struct nf_store {
	char *path;
	struct nf_io_sys sys;
	struct nf_store_info info;
	struct nf_store_object *objs;
	uint8_t *table;        /* the object table as read; aux arrays point into it */
};

uint32_t nf_store_sb_crc(const struct nf_store_sb_disk *sb)
{
	return nf_crc32c(0, sb, offsetof(struct nf_store_sb_disk, crc));
}

void nf_store_obj_encode(const struct nf_store_object *o, struct nf_store_obj_disk *e)
{
	memset(e, 0, sizeof(*e));
	memcpy(e->name, o->name, sizeof(e->name));
	e->name[sizeof(e->name) - 1] = '\0';
	e->kind = htole32(o->kind);
	e->dtype = htole32(o->dtype);
	e->n_dims = htole32(o->n_dims);
	uint32_t flags = o->has_gate ? NF_STORE_OBJ_GATE : 0;
	if (o->kind == NF_STORE_KIND_FFN) {
		if (o->down_form == NF_DOWN_QCOL)
			flags |= NF_STORE_OBJ_QCOL;
		if (o->down_dtype != o->dtype)
			flags |= NF_STORE_OBJ_DOWN_DTYPE;
		if (o->down_transposed)
			flags |= NF_STORE_OBJ_DOWN_T;
	}
	e->flags = htole32(flags);
	for (int i = 0; i < NF_STORE_MAX_DIMS; i++)
		e->shape[i] = htole64(o->shape[i]);
	e->offset = htole64(o->offset);
	e->length = htole64(o->length);
	e->crc = htole32(o->crc);
	if (o->kind == NF_STORE_KIND_FFN) {
		e->layer = htole32(o->layer);
		e->expert = htole32(o->expert);
		e->n_bundles = htole32(o->n_bundles);
		e->dim = htole32(o->dim);
		e->bundle_bytes = htole32(o->bundle_bytes);
		e->stride = htole32(o->stride);
		e->extent_bundles = htole32(o->extent_bundles);
		e->n_extents = htole32(o->n_extents);
		if (flags & NF_STORE_OBJ_DOWN_DTYPE)
			e->down_dtype = htole32(o->down_dtype);
	}
}

const char *nf_store_kind_name(uint32_t kind)
{
	switch (kind) {
	case NF_STORE_KIND_DENSE: return "dense";
	case NF_STORE_KIND_FFN: return "ffn";
	case NF_STORE_KIND_BLOB: return "blob";
	}
	return "unknown";
}

/* Bytes of the down part of a bundle for (form, down dtype, dim), 0 if that
 * combination has no bundle form (nflash/bundle.h). */
static uint64_t down_part_bytes(uint32_t form, uint32_t down_dtype, uint32_t dim)
{
	if (form == NF_DOWN_ROW)
		return nf_dtype_row_size(down_dtype, dim);
	if (down_dtype == NF_DTYPE_Q8_0)
		return dim;
	if (down_dtype == NF_DTYPE_Q4_0 && dim % 2 == 0)
		return dim / 2;
	if (nf_dtype_is_kquant(down_dtype) && (uint64_t)dim * nf_kquant_bits(down_dtype) % 8 == 0)
		return (uint64_t)dim * nf_kquant_bits(down_dtype) / 8;
	return 0;
}

int nf_store_table_encode(const struct nf_store_object *const *objs, uint32_t n, uint8_t **out,
			  uint64_t *len, uint32_t *crc)
{
	uint64_t total = (uint64_t)n * sizeof(struct nf_store_obj_disk);
	for (uint32_t i = 0; i < n; i++)
		if (objs[i]->kind == NF_STORE_KIND_FFN)
			total += 4ull * ((uint64_t)objs[i]->n_extents + objs[i]->n_bundles +
					 (objs[i]->bundle_crc ? objs[i]->n_bundles : 0));
	uint8_t *buf = malloc(total ? total : 1);
	if (!buf)
		return -ENOMEM;
	uint64_t aux_off = (uint64_t)n * sizeof(struct nf_store_obj_disk);
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *o = objs[i];
		struct nf_store_obj_disk e;
		nf_store_obj_encode(o, &e);
		if (o->kind == NF_STORE_KIND_FFN) {
			uint32_t *aux = (uint32_t *)(buf + aux_off);
			uint64_t k = 0;
			for (uint32_t j = 0; j < o->n_extents; j++)
				aux[k++] = htole32(o->extent_crc[j]);
			for (uint32_t j = 0; j < o->n_bundles; j++)
				aux[k++] = htole32(o->perm[j]);
			e.crc = htole32(nf_crc32c(0, aux, 4 * k));
			e.aux_offset = htole64(aux_off);
			e.aux_length = htole64(4 * k);
			aux_off += 4 * k;
			if (o->bundle_crc) {     /* item 22: after the aux arrays */
				uint32_t *b = (uint32_t *)(buf + aux_off);
				for (uint32_t j = 0; j < o->n_bundles; j++)
					b[j] = htole32(o->bundle_crc[j]);
				e.bcrc_offset = htole64(aux_off);
				e.bcrc_crc = htole32(nf_crc32c(0, b, 4ull * o->n_bundles));
				aux_off += 4ull * o->n_bundles;
			}
		}
		memcpy(buf + (uint64_t)i * sizeof(e), &e, sizeof(e));
	}
	*out = buf;
	*len = total;
	*crc = nf_crc32c(0, buf, total);
	return 0;
}

void nf_store_sb_build(struct nf_store_sb_disk *sb, const struct nf_store_info *in, uint32_t table_crc)
{
	memset(sb, 0, sizeof(*sb));
	sb->magic = htole64(NF_STORE_MAGIC);
	sb->version = htole32(NF_STORE_VERSION);
	sb->sb_size = htole32(sizeof(*sb));
	sb->generation = htole64(in->generation);
	sb->incompat = htole64(in->incompat);
	sb->block_size = htole32(in->block_size);
	sb->n_objects = htole32(in->n_objects);
	sb->file_size = htole64(in->file_size);
	sb->data_start = htole64(nf_store_data_start(in->block_size));
	sb->table_offset = htole64(in->table_offset);
	sb->table_length = htole64(in->table_length);
	sb->table_crc = htole32(table_crc);
	sb->created_ns = htole64(in->created_ns);
	memcpy(sb->uuid, in->uuid, sizeof(sb->uuid));
	if (in->profile_length) {
		sb->compat = htole64(in->compat | NF_STORE_COMPAT_PROFILE);
		sb->profile_offset = htole64(in->profile_offset);
		sb->profile_length = htole64(in->profile_length);
		sb->profile_crc = htole32(in->profile_crc);
	} else {
		sb->compat = htole64(in->compat & ~NF_STORE_COMPAT_PROFILE);
	}
	if (in->plan_length) {
		sb->compat |= htole64(NF_STORE_COMPAT_PLAN);
		sb->plan_offset = htole64(in->plan_offset);
		sb->plan_length = htole64(in->plan_length);
		sb->plan_crc = htole32(in->plan_crc);
	} else {
		sb->compat &= htole64(~NF_STORE_COMPAT_PLAN);
	}
	sb->crc = htole32(nf_store_sb_crc(sb));
}

static int read_full(struct nf_store *s, int fd, void *buf, size_t len, uint64_t off)
{
	return nf_io_pread_full(&s->sys, fd, buf, len, off);
}

bool nf_store_probe(const char *path)
{
	int fd = nf_io_sys_default.open(path, O_RDONLY, 0);
	if (fd < 0)
		return false;
	bool is = false;
	for (int slot = 0; slot < 2 && !is; slot++) {
		uint64_t magic;
		if (nf_io_pread_full(&nf_io_sys_default, fd, &magic, sizeof(magic),
				     (uint64_t)slot * NF_STORE_SB_SLOT) == 0)
			is = le64toh(magic) == NF_STORE_MAGIC || le64toh(magic) == NF_STORE_MAGIC_SWAPPED;
	}
	nf_io_sys_default.close(fd);
	return is;
}

static bool is_pow2(uint64_t v)
{
	return v && !(v & (v - 1));
}

/* Validate one superblock copy; fills *sb (decoded to host order). */
static int sb_check(const uint8_t *raw, const char *path, int slot, uint64_t actual_size,
		    struct nf_store_sb_disk *sb, struct nf_diag *d)
{
	memcpy(sb, raw, sizeof(*sb));
	uint64_t magic = le64toh(sb->magic);
	if (magic == NF_STORE_MAGIC_SWAPPED)
		return nf_diag_fail(d, NF_EMAGIC,
				    "%s: superblock %d: magic is byte-swapped (written with the wrong byte order)",
				    path, slot);
	if (magic != NF_STORE_MAGIC)
		return nf_diag_fail(d, NF_EMAGIC,
				    "%s: superblock %d: bad magic %#018llx (not an nflash store)", path,
				    slot, (unsigned long long)magic);
	uint32_t crc = le32toh(sb->crc);
	if (nf_store_sb_crc(sb) != crc)
		return nf_diag_fail(d, NF_ECHECKSUM, "%s: superblock %d: crc32c mismatch", path, slot);
	sb->version = le32toh(sb->version);
	sb->sb_size = le32toh(sb->sb_size);
	sb->generation = le64toh(sb->generation);
	sb->compat = le64toh(sb->compat);
	sb->incompat = le64toh(sb->incompat);
	sb->block_size = le32toh(sb->block_size);
	sb->n_objects = le32toh(sb->n_objects);
	sb->file_size = le64toh(sb->file_size);
	sb->data_start = le64toh(sb->data_start);
	sb->table_offset = le64toh(sb->table_offset);
	sb->table_length = le64toh(sb->table_length);
	sb->table_crc = le32toh(sb->table_crc);
	sb->created_ns = le64toh(sb->created_ns);
	sb->profile_offset = le64toh(sb->profile_offset);
	sb->profile_length = le64toh(sb->profile_length);
	sb->profile_crc = le32toh(sb->profile_crc);
	sb->plan_offset = le64toh(sb->plan_offset);
	sb->plan_length = le64toh(sb->plan_length);
	sb->plan_crc = le32toh(sb->plan_crc);
	if (!(sb->compat & NF_STORE_COMPAT_PROFILE)) {
		/* fields of a feature the writer did not set: ignore them */
		sb->profile_offset = sb->profile_length = 0;
		sb->profile_crc = 0;
	}
	if (!(sb->compat & NF_STORE_COMPAT_PLAN)) {
		sb->plan_offset = sb->plan_length = 0;
		sb->plan_crc = 0;
	}
	if (sb->version > NF_STORE_VERSION || sb->version == 0)
		return nf_diag_fail(d, NF_EVERSION,
				    "%s: superblock %d: version %u is not supported (this nflash reads version %u)",
				    path, slot, sb->version, NF_STORE_VERSION);
	if (sb->incompat & ~NF_STORE_INCOMPAT_KNOWN)
		return nf_diag_fail(d, NF_EINCOMPAT,
				    "%s: superblock %d: unknown incompatible feature flags %#llx",
				    path, slot,
				    (unsigned long long)(sb->incompat & ~NF_STORE_INCOMPAT_KNOWN));
	if (sb->sb_size != sizeof(*sb))
		return nf_diag_fail(d, NF_EFORMAT, "%s: superblock %d: sb_size %u, expected %zu",
				    path, slot, sb->sb_size, sizeof(*sb));
	if (!is_pow2(sb->block_size) || sb->block_size < NF_STORE_BLOCK_MIN ||
	    sb->block_size > NF_STORE_BLOCK_MAX)
		return nf_diag_fail(d, NF_EFORMAT,
				    "%s: superblock %d: block_size %u is not a power of two in [%u, %u]",
				    path, slot, sb->block_size, NF_STORE_BLOCK_MIN, NF_STORE_BLOCK_MAX);
	if (sb->data_start != nf_store_data_start(sb->block_size))
		return nf_diag_fail(d, NF_EFORMAT, "%s: superblock %d: data_start %llu, expected %llu",
				    path, slot, (unsigned long long)sb->data_start,
				    (unsigned long long)nf_store_data_start(sb->block_size));
	if (sb->file_size > actual_size)
		return nf_diag_fail(d, NF_ETRUNCATED,
				    "%s: file is %llu bytes but superblock %d says file_size %llu (truncated)",
				    path, (unsigned long long)actual_size, slot,
				    (unsigned long long)sb->file_size);
	uint64_t tend;
	if (__builtin_add_overflow(sb->table_offset, sb->table_length, &tend) ||
	    tend > sb->file_size)
		return nf_diag_fail(d, NF_EFORMAT,
				    "%s: superblock %d: table_offset %llu + table_length %llu is past the end of the file (%llu bytes)",
				    path, slot, (unsigned long long)sb->table_offset,
				    (unsigned long long)sb->table_length,
				    (unsigned long long)sb->file_size);
	if (sb->table_offset % sb->block_size || sb->table_offset < sb->data_start)
		return nf_diag_fail(d, NF_EFORMAT,
				    "%s: superblock %d: table_offset %llu is not a block-aligned offset after the superblocks",
				    path, slot, (unsigned long long)sb->table_offset);
	if (sb->table_length / sizeof(struct nf_store_obj_disk) < sb->n_objects)
		return nf_diag_fail(d, NF_EFORMAT,
				    "%s: superblock %d: n_objects %u does not fit in table_length %llu",
				    path, slot, sb->n_objects, (unsigned long long)sb->table_length);
	/* A compat bit with an empty section is a no-profile store (an older
	 * nflash updated it in place and zeroed what it did not know). */
	uint64_t pend;
	if (sb->profile_length &&
	    (sb->profile_offset % sb->block_size || sb->profile_offset < sb->data_start ||
	     __builtin_add_overflow(sb->profile_offset, sb->profile_length, &pend) ||
	     pend > sb->file_size ||
	     (sb->profile_offset < tend && pend > sb->table_offset)))
		return nf_diag_fail(d, NF_EFORMAT,
				    "%s: superblock %d: profile_offset %llu + profile_length %llu is misaligned, "
				    "past the end of the file or over the object table",
				    path, slot, (unsigned long long)sb->profile_offset,
				    (unsigned long long)sb->profile_length);
	if (sb->plan_length &&
	    (sb->plan_offset % sb->block_size || sb->plan_offset < sb->data_start ||
	     __builtin_add_overflow(sb->plan_offset, sb->plan_length, &pend) || pend > sb->file_size ||
	     (sb->plan_offset < tend && pend > sb->table_offset)))
		return nf_diag_fail(d, NF_EFORMAT,
				    "%s: superblock %d: plan_offset %llu + plan_length %llu is misaligned, past the "
				    "end of the file or over the object table",
				    path, slot, (unsigned long long)sb->plan_offset, (unsigned long long)sb->plan_length);
	return 0;
}

#define OBJFAIL(code, fmt, ...)                                                          \
	nf_diag_fail(d, code, "%s: object %u '%s': " fmt, s->path, i, o->name, __VA_ARGS__)

/* Decode and validate entry i; aux arrays are decoded in s->table. */
static int obj_decode(struct nf_store *s, uint32_t i, const struct nf_store_sb_disk *sb,
		      struct nf_diag *d)
{
	struct nf_store_obj_disk e;
	memcpy(&e, s->table + (size_t)i * sizeof(e), sizeof(e));
	struct nf_store_object *o = &s->objs[i];
	memset(o, 0, sizeof(*o));
	memcpy(o->name, e.name, sizeof(o->name));
	o->name[sizeof(o->name) - 1] = '\0';
	if (memchr(e.name, '\0', sizeof(e.name)) == NULL || e.name[0] == '\0')
		return OBJFAIL(NF_EFORMAT, "name is %s", e.name[0] ? "not NUL-terminated" : "empty");
	o->index = i;
	o->kind = le32toh(e.kind);
	o->dtype = le32toh(e.dtype);
	o->n_dims = le32toh(e.n_dims);
	uint32_t flags = le32toh(e.flags);
	for (int k = 0; k < NF_STORE_MAX_DIMS; k++)
		o->shape[k] = le64toh(e.shape[k]);
	o->offset = le64toh(e.offset);
	o->length = le64toh(e.length);
	o->crc = le32toh(e.crc);
	uint32_t bs = sb->block_size;

	if (o->kind != NF_STORE_KIND_DENSE && o->kind != NF_STORE_KIND_FFN &&
	    o->kind != NF_STORE_KIND_BLOB)
		return OBJFAIL(NF_EFORMAT, "unknown kind %u", o->kind);
	if (o->kind == NF_STORE_KIND_BLOB && !(sb->incompat & NF_STORE_INCOMPAT_BLOB))
		return OBJFAIL(NF_EFORMAT, "blob object without the incompat flag %#llx",
			       (unsigned long long)NF_STORE_INCOMPAT_BLOB);
	if (!nf_dtype_valid(o->dtype))
		return OBJFAIL(NF_EUNSUPPORTED, "unknown dtype %u", o->dtype);
	if (o->n_dims < 1 || o->n_dims > NF_STORE_MAX_DIMS)
		return OBJFAIL(NF_EFORMAT, "n_dims %u not in [1, %d]", o->n_dims, NF_STORE_MAX_DIMS);
	if (o->offset % bs)
		return OBJFAIL(NF_EFORMAT, "offset %llu is not a multiple of the block size %u",
			       (unsigned long long)o->offset, bs);
	uint64_t end;
	if (__builtin_add_overflow(o->offset, o->length, &end) || o->offset < sb->data_start ||
	    end > sb->table_offset)
		return OBJFAIL(NF_EFORMAT,
			       "offset %llu + length %llu is outside the data area [%llu, %llu)",
			       (unsigned long long)o->offset, (unsigned long long)o->length,
			       (unsigned long long)sb->data_start,
			       (unsigned long long)sb->table_offset);

	if (o->kind == NF_STORE_KIND_BLOB) {
		if (o->n_dims != 1 || o->shape[0] != o->length || o->dtype != 0 || o->length == 0)
			return OBJFAIL(NF_EFORMAT, "blob: shape {%llu} must be {length %llu}, dtype 0",
				       (unsigned long long)o->shape[0], (unsigned long long)o->length);
		return 0;
	}
	if (o->kind == NF_STORE_KIND_DENSE) {
		uint64_t row = nf_dtype_row_size(o->dtype, o->shape[0]);
		if (row == 0)
			return OBJFAIL(NF_EFORMAT, "shape[0] %llu is not a whole number of %s blocks",
				       (unsigned long long)o->shape[0], nf_dtype_name(o->dtype));
		uint64_t size = row;
		for (uint32_t k = 1; k < o->n_dims; k++)
			if (__builtin_mul_overflow(size, o->shape[k], &size))
				return OBJFAIL(NF_EFORMAT, "shape overflows 64 bits at shape[%u]", k);
		if (size != o->length)
			return OBJFAIL(NF_EFORMAT, "length %llu, but the shape needs %llu bytes",
				       (unsigned long long)o->length, (unsigned long long)size);
		return 0;
	}

	o->layer = le32toh(e.layer);
	o->expert = le32toh(e.expert);
	o->n_bundles = le32toh(e.n_bundles);
	o->dim = le32toh(e.dim);
	o->has_gate = flags & NF_STORE_OBJ_GATE;
	o->bundle_bytes = le32toh(e.bundle_bytes);
	o->stride = le32toh(e.stride);
	o->extent_bundles = le32toh(e.extent_bundles);
	o->n_extents = le32toh(e.n_extents);
	uint64_t row = nf_dtype_row_size(o->dtype, o->dim);
	uint32_t rows = o->has_gate ? 3 : 2;
	if (row == 0 || row > UINT32_MAX / 3)
		return OBJFAIL(NF_EFORMAT, "dim %u is not a whole number of %s blocks", o->dim,
			       nf_dtype_name(o->dtype));
	o->row_bytes = (uint32_t)row;
	if (o->n_dims != 3 || o->shape[0] != o->dim || o->shape[1] != o->n_bundles ||
	    o->shape[2] != rows || o->shape[3] != 0)
		return OBJFAIL(NF_EFORMAT, "shape is not {dim %u, n_bundles %u, %u}", o->dim,
			       o->n_bundles, rows);
	if (o->n_bundles == 0)
		return OBJFAIL(NF_EFORMAT, "n_bundles is %u", 0);
	o->down_form = flags & NF_STORE_OBJ_QCOL ? NF_DOWN_QCOL : NF_DOWN_ROW;
	o->down_dtype = flags & NF_STORE_OBJ_DOWN_DTYPE ? le32toh(e.down_dtype) : o->dtype;
	o->down_transposed = flags & NF_STORE_OBJ_DOWN_T;
	if ((flags & (NF_STORE_OBJ_QCOL | NF_STORE_OBJ_DOWN_DTYPE)) &&
	    !(sb->incompat & NF_STORE_INCOMPAT_DOWN_FORMS))
		return OBJFAIL(NF_EFORMAT, "down form flags %#x without the incompat flag %#llx",
			       flags, (unsigned long long)NF_STORE_INCOMPAT_DOWN_FORMS);
	if (!nf_dtype_valid(o->down_dtype))
		return OBJFAIL(NF_EUNSUPPORTED, "unknown down_dtype %u", o->down_dtype);
	uint64_t down = down_part_bytes(o->down_form, o->down_dtype, o->dim);
	if (down == 0 || (o->down_form == NF_DOWN_QCOL && o->n_bundles % nf_dtype_block_len(o->down_dtype)))
		return OBJFAIL(NF_EFORMAT, "no %s down part of %s for dim %u and %u bundles",
			       o->down_form == NF_DOWN_QCOL ? "qcol" : "row",
			       nf_dtype_name(o->down_dtype), o->dim, o->n_bundles);
	o->down_off = (uint32_t)((rows - 1) * row);
	o->down_bytes = (uint32_t)down;
	if (o->bundle_bytes != (rows - 1) * row + down)
		return OBJFAIL(NF_EFORMAT, "bundle_bytes %u, expected %u", o->bundle_bytes,
			       (unsigned)((rows - 1) * row + down));
	if (o->stride < o->bundle_bytes || o->stride % bs)
		return OBJFAIL(NF_EFORMAT,
			       "stride %u is not a multiple of the block size %u holding %u bytes",
			       o->stride, bs, o->bundle_bytes);
	if (o->extent_bundles == 0 || o->extent_bundles > o->n_bundles)
		return OBJFAIL(NF_EFORMAT, "extent_bundles %u not in [1, n_bundles %u]",
			       o->extent_bundles, o->n_bundles);
	uint32_t next = (o->n_bundles + o->extent_bundles - 1) / o->extent_bundles;
	if (o->n_extents != next)
		return OBJFAIL(NF_EFORMAT, "n_extents %u, expected %u", o->n_extents, next);
	if ((uint64_t)o->n_bundles * o->stride != o->length)
		return OBJFAIL(NF_EFORMAT, "length %llu is not n_bundles * stride",
			       (unsigned long long)o->length);
	uint64_t aux_off = le64toh(e.aux_offset), aux_len = le64toh(e.aux_length);
	uint64_t aux_end, tbl_entries = (uint64_t)sb->n_objects * sizeof(e);
	if (aux_len != 4ull * ((uint64_t)o->n_extents + o->n_bundles) || aux_off % 4 ||
	    aux_off < tbl_entries || __builtin_add_overflow(aux_off, aux_len, &aux_end) ||
	    aux_end > sb->table_length)
		return OBJFAIL(NF_EFORMAT,
			       "aux_offset %llu / aux_length %llu outside the object table",
			       (unsigned long long)aux_off, (unsigned long long)aux_len);
	uint32_t *aux = (uint32_t *)(s->table + aux_off);
	if (nf_crc32c(0, aux, aux_len) != o->crc)
		return OBJFAIL(NF_ECHECKSUM, "crc32c of extent checksums and permutation (%s)",
			       "aux arrays damaged");
	for (uint64_t k = 0; k < aux_len / 4; k++)
		aux[k] = le32toh(aux[k]);
	o->extent_crc = aux;
	o->perm = aux + o->n_extents;
	uint64_t bc_off = le64toh(e.bcrc_offset), bc_len = 4ull * o->n_bundles, bc_end;
	if (bc_off) {      /* item 22; 0: a store written before bundle checksums */
		if (bc_off % 4 || bc_off < tbl_entries || __builtin_add_overflow(bc_off, bc_len, &bc_end) ||
		    bc_end > sb->table_length || (bc_off < aux_end && bc_end > aux_off))
			return OBJFAIL(NF_EFORMAT, "bcrc_offset %llu outside the object table or over its aux arrays",
				       (unsigned long long)bc_off);
		uint32_t *bc = (uint32_t *)(s->table + bc_off);
		if (nf_crc32c(0, bc, bc_len) != le32toh(e.bcrc_crc))
			return OBJFAIL(NF_ECHECKSUM, "crc32c of bundle checksums (%s)", "array damaged");
		for (uint64_t k = 0; k < o->n_bundles; k++)
			bc[k] = le32toh(bc[k]);
		o->bundle_crc = bc;
	}
	/* The permutation must be a bijection onto the slots. */
	uint8_t *seen = calloc(o->n_bundles, 1);
	if (!seen)
		return -ENOMEM;
	int rc = 0;
	for (uint32_t k = 0; k < o->n_bundles; k++) {
		uint32_t slot = o->perm[k];
		if (slot >= o->n_bundles || seen[slot]) {
			rc = OBJFAIL(NF_EFORMAT, "perm[%u] = %u is out of range or repeated", k, slot);
			break;
		}
		seen[slot] = 1;
	}
	free(seen);
	return rc;
}

static int cmp_by_offset(const void *a, const void *b)
{
	const struct nf_store_object *x = *(const struct nf_store_object *const *)a;
	const struct nf_store_object *y = *(const struct nf_store_object *const *)b;
	return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Objects must not overlap, and names and (layer, expert) pairs are unique. */
static int check_overlaps(struct nf_store *s, struct nf_diag *d)
{
	uint32_t n = s->info.n_objects;
	if (n < 2)
		return 0;
	const struct nf_store_object **v = malloc(n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++)
		v[i] = &s->objs[i];
	qsort(v, n, sizeof(*v), cmp_by_offset);
	int rc = 0;
	for (uint32_t i = 1; i < n && rc == 0; i++)
		if (v[i - 1]->length && v[i - 1]->offset + v[i - 1]->length > v[i]->offset)
			rc = nf_diag_fail(d, NF_EFORMAT, "%s: objects '%s' and '%s' overlap", s->path,
					  v[i - 1]->name, v[i]->name);
	free(v);
	for (uint32_t i = 0; i < n && rc == 0; i++)
		for (uint32_t j = i + 1; j < n && rc == 0; j++) {
			const struct nf_store_object *a = &s->objs[i], *b = &s->objs[j];
			if (!strcmp(a->name, b->name))
				rc = nf_diag_fail(d, NF_EFORMAT, "%s: object name '%s' appears twice",
						  s->path, a->name);
			else if (a->kind == NF_STORE_KIND_FFN && b->kind == NF_STORE_KIND_FFN &&
				 a->layer == b->layer && a->expert == b->expert)
				rc = nf_diag_fail(d, NF_EFORMAT,
						  "%s: FFN (layer %u, expert %u) appears twice", s->path,
						  a->layer, a->expert);
		}
	return rc;
}

int nf_store_open(const char *path, const struct nf_store_open_opts *o, struct nf_store **out,
		  struct nf_diag *d)
{
	int rc, fd = -1;
	struct nf_store *s = calloc(1, sizeof(*s));
	uint8_t *raw = NULL;
	*out = NULL;
	if (!s)
		return -ENOMEM;
	s->sys = o && o->sys ? *o->sys : nf_io_sys_default;
	s->path = strdup(path);
	if (!s->path) {
		rc = -ENOMEM;
		goto fail;
	}
	fd = s->sys.open(path, O_RDONLY, 0);
	if (fd < 0) {
		rc = nf_diag_fail(d, -errno, "%s: cannot open: %s", path, nf_strerror(-errno));
		goto fail;
	}
	struct stat st;
	if (s->sys.fstat(fd, &st) < 0) {
		rc = nf_diag_fail(d, -errno, "%s: fstat: %s", path, nf_strerror(-errno));
		goto fail;
	}
	if (S_ISDIR(st.st_mode)) {
		rc = nf_diag_fail(d, -EISDIR, "%s: is a directory, not a store", path);
		goto fail;
	}
	uint64_t size = (uint64_t)st.st_size;
	if (S_ISBLK(st.st_mode) && s->sys.ioctl_size(fd, &size) < 0) {
		rc = nf_diag_fail(d, -errno, "%s: BLKGETSIZE64: %s", path, nf_strerror(-errno));
		goto fail;
	}
	if (size < NF_STORE_SB_AREA) {
		uint64_t magic = 0;
		if (size >= sizeof(magic) && read_full(s, fd, &magic, sizeof(magic), 0) == 0 &&
		    le64toh(magic) != NF_STORE_MAGIC) {
			rc = nf_diag_fail(d, NF_EMAGIC, "%s: bad magic (not an nflash store)", path);
			goto fail;
		}
		rc = nf_diag_fail(d, NF_ETRUNCATED,
				  "%s: file is %llu bytes, shorter than its two superblocks (%u)",
				  path, (unsigned long long)size, NF_STORE_SB_AREA);
		goto fail;
	}
	raw = malloc(NF_STORE_SB_AREA);
	if (!raw) {
		rc = -ENOMEM;
		goto fail;
	}
	rc = read_full(s, fd, raw, NF_STORE_SB_AREA, 0);
	if (rc < 0) {
		nf_diag_fail(d, rc, "%s: reading the superblocks: %s", path, nf_strerror(rc));
		goto fail;
	}
	struct nf_store_sb_disk sb[2];
	struct nf_diag dd[2] = {{0}, {0}};
	int err[2];
	for (int k = 0; k < 2; k++)
		err[k] = sb_check(raw + k * NF_STORE_SB_SLOT, path, k, size, &sb[k], &dd[k]);
	int use;
	if (err[0] == 0 && err[1] == 0)
		use = sb[1].generation > sb[0].generation;
	else if (err[0] == 0)
		use = 0;
	else if (err[1] == 0)
		use = 1;
	else {
		/* Both bad: report the first copy's error, mention the second. */
		rc = nf_diag_fail(d, err[0], "%s; %s", dd[0].msg, dd[1].msg);
		goto fail;
	}
	const struct nf_store_sb_disk *u = &sb[use];
	s->info.version = u->version;
	s->info.generation = u->generation;
	s->info.sb_slot = use;
	s->info.other_sb_error = err[!use];
	s->info.compat = u->compat;
	s->info.incompat = u->incompat;
	s->info.block_size = u->block_size;
	s->info.file_size = u->file_size;
	s->info.data_start = u->data_start;
	s->info.table_offset = u->table_offset;
	s->info.table_length = u->table_length;
	s->info.table_crc = u->table_crc;
	s->info.n_objects = u->n_objects;
	s->info.created_ns = u->created_ns;
	memcpy(s->info.uuid, u->uuid, sizeof(s->info.uuid));
	s->info.profile_offset = u->profile_offset;
	s->info.profile_length = u->profile_length;
	s->info.profile_crc = u->profile_crc;
	s->info.plan_offset = u->plan_offset;
	s->info.plan_length = u->plan_length;
	s->info.plan_crc = u->plan_crc;

	s->table = malloc(u->table_length ? u->table_length : 1);
	s->objs = calloc(u->n_objects ? u->n_objects : 1, sizeof(*s->objs));
	if (!s->table || !s->objs) {
		rc = nf_diag_fail(d, -ENOMEM, "%s: no memory for a %llu-byte object table", path,
				  (unsigned long long)u->table_length);
		goto fail;
	}
	rc = read_full(s, fd, s->table, u->table_length, u->table_offset);
	if (rc < 0) {
		nf_diag_fail(d, rc, "%s: reading the object table: %s", path, nf_strerror(rc));
		goto fail;
	}
	if (nf_crc32c(0, s->table, u->table_length) != u->table_crc) {
		rc = nf_diag_fail(d, NF_ECHECKSUM, "%s: object table: crc32c mismatch", path);
		goto fail;
	}
	for (uint32_t i = 0; i < u->n_objects; i++) {
		rc = obj_decode(s, i, u, d);
		if (rc < 0)
			goto fail;
		if (s->objs[i].kind == NF_STORE_KIND_FFN)
			s->info.n_ffn++;
	}
	rc = check_overlaps(s, d);
	if (rc < 0)
		goto fail;
	for (uint32_t i = 0; i < u->n_objects && u->profile_length; i++) {
		const struct nf_store_object *ob = &s->objs[i];
		if (ob->length && ob->offset < u->profile_offset + u->profile_length &&
		    u->profile_offset < ob->offset + ob->length) {
			rc = nf_diag_fail(d, NF_EFORMAT, "%s: the profile section overlaps object '%s'", path,
					  ob->name);
			goto fail;
		}
	}
	for (uint32_t i = 0; i < u->n_objects && u->plan_length; i++) {
		const struct nf_store_object *ob = &s->objs[i];
		if (ob->length && ob->offset < u->plan_offset + u->plan_length &&
		    u->plan_offset < ob->offset + ob->length) {
			rc = nf_diag_fail(d, NF_EFORMAT, "%s: the plan section overlaps object '%s'", path, ob->name);
			goto fail;
		}
	}
	free(raw);
	s->sys.close(fd);
	*out = s;
	return 0;
fail:
	free(raw);
	if (fd >= 0)
		s->sys.close(fd);
	nf_store_close(s);
	return rc;
}

void nf_store_close(struct nf_store *s)
{
	if (!s)
		return;
	free(s->objs);
	free(s->table);
	free(s->path);
	free(s);
}

const struct nf_store_info *nf_store_info(const struct nf_store *s)
{
	return &s->info;
}

uint64_t nf_store_mem_bytes(const struct nf_store *s)
{
	return sizeof(*s) + s->info.table_length + (uint64_t)s->info.n_objects * sizeof(*s->objs);
}

const char *nf_store_path(const struct nf_store *s)
{
	return s->path;
}

const struct nf_io_sys *nf_store_sys(const struct nf_store *s)
{
	return &s->sys;
}

uint32_t nf_store_object_count(const struct nf_store *s)
{
	return s->info.n_objects;
}

const struct nf_store_object *nf_store_object_get(const struct nf_store *s, uint32_t i)
{
	return i < s->info.n_objects ? &s->objs[i] : NULL;
}

const struct nf_store_object *nf_store_object_find(const struct nf_store *s, const char *name)
{
	for (uint32_t i = 0; i < s->info.n_objects; i++)
		if (!strcmp(s->objs[i].name, name))
			return &s->objs[i];
	return NULL;
}

const struct nf_store_object *nf_store_ffn_find(const struct nf_store *s, uint32_t layer,
						uint32_t expert)
{
	for (uint32_t i = 0; i < s->info.n_objects; i++) {
		const struct nf_store_object *o = &s->objs[i];
		if (o->kind == NF_STORE_KIND_FFN && o->layer == layer && o->expert == expert)
			return o;
	}
	return NULL;
}

void nf_store_ffn_layout(const struct nf_store_object *obj, struct nf_bundle_layout *out)
{
	/* field by field over zeroed memory: padding bytes are zero too, so
	 * layouts compare with memcmp (a compound literal leaves them unset) */
	memset(out, 0, sizeof(*out));
	out->dtype = obj->dtype;
	out->dim = obj->dim;
	out->n_neurons = obj->n_bundles;
	out->has_gate = obj->has_gate;
	out->row_bytes = obj->row_bytes;
	out->down_form = obj->down_form;
	out->down_dtype = obj->down_dtype;
	out->down_off = obj->down_off;
	out->down_bytes = obj->down_bytes;
	out->bundle_bytes = obj->bundle_bytes;
	out->stride = obj->stride;
}

const struct nf_store_object *nf_store_ffn_gate_rows(const struct nf_store *s, const struct nf_store_object *obj)
{
	char name[NF_STORE_NAME_MAX + 16];
	if (obj->kind != NF_STORE_KIND_FFN || !obj->has_gate)
		return NULL;
	snprintf(name, sizeof(name), "%s" NF_STORE_GATE_ROWS_SUFFIX, obj->name);
	const struct nf_store_object *g = nf_store_object_find(s, name);
	if (!g || g->kind != NF_STORE_KIND_DENSE || g->dtype != obj->dtype || g->n_dims != 2 ||
	    g->shape[0] != obj->dim || g->shape[1] != obj->n_bundles ||
	    g->length != (uint64_t)obj->row_bytes * obj->n_bundles)
		return NULL;
	return g;
}

bool nf_store_is_gate_rows_name(const char *name)
{
	size_t n = strlen(name), k = strlen(NF_STORE_GATE_ROWS_SUFFIX);
	return n > k && !strcmp(name + n - k, NF_STORE_GATE_ROWS_SUFFIX);
}

const struct nf_store_object *nf_store_ffn_scales(const struct nf_store *s,
						  const struct nf_store_object *obj)
{
	char name[NF_STORE_NAME_MAX + 16];
	if (obj->kind != NF_STORE_KIND_FFN || obj->down_form != NF_DOWN_QCOL)
		return NULL;
	snprintf(name, sizeof(name), "%s.down_scales", obj->name);
	const struct nf_store_object *sc = nf_store_object_find(s, name);
	struct nf_bundle_layout L;
	uint64_t shape[2];
	nf_store_ffn_layout(obj, &L);
	nf_bundle_scales_shape(&L, shape);
	if (!sc || sc->kind != NF_STORE_KIND_DENSE || sc->dtype != NF_DTYPE_F16 ||
	    sc->n_dims != 2 || sc->shape[0] != shape[0] || sc->shape[1] != shape[1])
		return NULL;
	return sc;
}

uint64_t nf_store_object_buf_size(const struct nf_store_object *obj, uint32_t block_size)
{
	return (obj->length + block_size - 1) / block_size * block_size;
}

uint64_t nf_store_bundle_offset(const struct nf_store_object *obj, uint32_t slot)
{
	return obj->offset + (uint64_t)slot * obj->stride;
}

void nf_store_extent_bundles(const struct nf_store_object *obj, uint32_t e, uint32_t *first,
			     uint32_t *count)
{
	uint32_t f = e * obj->extent_bundles;
	uint32_t c = obj->n_bundles - f < obj->extent_bundles ? obj->n_bundles - f : obj->extent_bundles;
	*first = f;
	*count = c;
}

void nf_store_extent_span(const struct nf_store_object *obj, uint32_t e, uint64_t *offset,
			  uint64_t *length)
{
	uint32_t f, c;
	nf_store_extent_bundles(obj, e, &f, &c);
	*offset = nf_store_bundle_offset(obj, f);
	*length = (uint64_t)c * obj->stride;
}

int nf_store_extent_check(const struct nf_store_object *obj, uint32_t e, const void *buf)
{
	uint64_t off, len;
	nf_store_extent_span(obj, e, &off, &len);
	return nf_crc32c(0, buf, len) == obj->extent_crc[e] ? 0 : NF_ECHECKSUM;
}

int nf_store_object_check(const struct nf_store_object *obj, const void *buf)
{
	return nf_crc32c(0, buf, obj->length) == obj->crc ? 0 : NF_ECHECKSUM;
}

int nf_store_bundle_check(const struct nf_store_object *obj, uint32_t slot, const void *buf)
{
	if (!obj->bundle_crc)
		return 1;
	return nf_crc32c(0, buf, obj->bundle_bytes) == obj->bundle_crc[slot] ? 0 : NF_ECHECKSUM;
}
