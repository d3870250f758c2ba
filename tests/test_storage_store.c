/*
 * test_storage_store.c - the store format: round trips of every object
 * kind and dtype, superblock fallback, rejection of damaged or forged
 * stores with a clear error, checksums caught on read and by verify, and
 * crash-safe creation.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <endian.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/crc32c.h"
#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "../storage/store_format.h"
#include "util_storage.h"

static const uint32_t all_dtypes[] = { NF_DTYPE_F32, NF_DTYPE_F16, NF_DTYPE_BF16, NF_DTYPE_Q8_0,
				       NF_DTYPE_Q4_0 };


/* Read obj whole and every 3rd bundle through io; compare with the writer's input. */
static void check_contents(struct nf_store *s, struct nf_io_ctx *io)
{
	uint32_t align = nf_io_ctx_align(io);
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		uint64_t size = nf_store_object_buf_size(o, nf_store_info(s)->block_size);
		uint8_t *buf = nf_io_buf_alloc(size, align);
		cr_assert(buf);
		struct ts_done d = {0};
		cr_assert_eq(nf_io_ctx_read_object(io, o, buf, ts_on_done, &d), 0, "%s", o->name);
		cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
		cr_assert_eq(d.calls, 1);
		cr_assert_eq(d.result, 0, "%s: %s", o->name, nf_strerror(d.result));
		if (o->kind == NF_STORE_KIND_DENSE) {
			cr_assert_eq(ts_check_dense(o, buf), 0, "dense %s differs", o->name);
		} else {
			cr_assert_eq(ts_check_bundles(o, NULL, o->n_bundles, buf), 0, "FFN %s differs", o->name);
			uint32_t slots[TS_N], n = 0;
			for (uint32_t k = 1; k < o->n_bundles; k += 3)
				slots[n++] = k;
			slots[n++] = 2;   /* out of order, a run of one */
			memset(buf, 0xAA, size);
			struct ts_done d2 = {0};
			cr_assert_eq(nf_io_ctx_read_bundles(io, o, slots, n, buf, ts_on_done, &d2), 0);
			cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
			cr_assert_eq(d2.result, 0);
			cr_assert_eq(ts_check_bundles(o, slots, n, buf), 0, "bundles of %s differ", o->name);
			/* extents 1..2 */
			struct ts_done d3 = {0};
			uint32_t f, c;
			nf_store_extent_bundles(o, 1, &f, &c);
			cr_assert_eq(nf_io_ctx_read_extents(io, o, 1, 2, buf, ts_on_done, &d3), 0);
			cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
			cr_assert_eq(d3.result, 0);
			uint32_t want[2 * TS_N];
			for (uint32_t k = 0; k < 2 * o->extent_bundles && f + k < o->n_bundles; k++)
				want[k] = f + k;
			uint32_t cnt = 2 * o->extent_bundles;
			if (f + cnt > o->n_bundles)
				cnt = o->n_bundles - f;
			cr_assert_eq(ts_check_bundles(o, want, cnt, buf), 0);
		}
		nf_io_buf_free(buf);
	}
}

Test(storage, store_round_trip_every_dtype)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	for (size_t k = 0; k < sizeof(all_dtypes) / sizeof(all_dtypes[0]); k++) {
		uint32_t dt = all_dtypes[k];
		uint32_t block = k % 2 ? 512 : 4096, eb = (uint32_t)k + 1;
		cr_assert_eq(ts_make_store(t.path, dt, eb, block, NULL), 0, "%s", nf_dtype_name(dt));
		struct nf_store *s;
		struct nf_diag d = {0};
		cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
		const struct nf_store_info *in = nf_store_info(s);
		cr_assert_eq(in->block_size, block);
		cr_assert_eq(in->n_objects, 5);
		cr_assert_eq(in->n_ffn, 3);
		cr_assert_eq(in->generation, 1);
		cr_assert_eq(in->other_sb_error, 0);
		const struct nf_store_object *f0 = nf_store_ffn_find(s, 0, 0);
		const struct nf_store_object *f1 = nf_store_object_find(s, "blk.1.ffn");
		const struct nf_store_object *f2 = nf_store_ffn_find(s, 2, 1);
		cr_assert(f0 && f1 && f2);
		cr_assert_null(nf_store_ffn_find(s, 2, 0));
		cr_assert_null(nf_store_object_find(s, "nope"));
		cr_assert(f0->has_gate && !f1->has_gate && f2->has_gate);
		uint32_t row = (uint32_t)nf_dtype_row_size(dt, TS_DIM);
		cr_assert_eq(f0->row_bytes, row);
		cr_assert_eq(f0->bundle_bytes, 3 * row);
		cr_assert_eq(f1->bundle_bytes, 2 * row);
		cr_assert_eq(f0->stride % block, 0);
		cr_assert_geq(f0->stride, f0->bundle_bytes);
		cr_assert_lt(f0->stride - f0->bundle_bytes, block);
		cr_assert_eq(f0->extent_bundles, eb);
		cr_assert_eq(f0->n_extents, (TS_N + eb - 1) / eb);
		for (uint32_t i = 0; i < TS_N; i++)
			cr_assert_eq(f0->perm[i], i, "identity permutation at creation");
		cr_assert_eq(nf_store_object_get(s, 0)->dtype, dt);
		cr_assert_eq(nf_store_object_get(s, 0)->shape[1], 10);
		/* Reads through the sync backend (any file system) and the default. */
		for (int b = 0; b < 2; b++) {
			struct nf_io_opts o;
			nf_io_opts_default(&o);
			o.backend = b ? NF_IO_AUTO : NF_IO_SYNC;
			o.quiet = true;
			if (block < 4096)
				o.max_coalesce = 3 * block;   /* several segments per request */
			struct nf_io_ctx *io;
			cr_assert_eq(nf_io_ctx_open(s, &o, &io, &d), 0, "%s", d.msg);
			if (nf_io_ctx_align(io) <= block)
				check_contents(s, io);
			nf_io_ctx_close(io);
		}
		nf_store_close(s);
		unlink(t.path);
	}
	ts_dir_remove(&t);
}

Test(storage, store_permutation_set_at_creation)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct nf_store_writer *w;
	struct nf_diag d = {0};
	cr_assert_eq(nf_store_writer_open(t.path, NULL, &w, &d), 0);
	cr_assert_eq(nf_store_writer_add_ffn(w, "f", 0, 0, NF_DTYPE_F16, 64, 9, false, 4, &d), 0);
	uint32_t bad[9] = { 0, 1, 2, 3, 4, 5, 6, 7, 7 }, perm[9];
	cr_assert_eq(nf_store_writer_set_perm(w, 0, bad, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "perm[8]"), "%s", d.msg);
	for (int i = 0; i < 9; i++)
		perm[i] = (uint32_t)(8 - i);
	cr_assert_eq(nf_store_writer_set_perm(w, 0, perm, NULL), 0);
	cr_assert_eq(nf_store_writer_begin(w, NULL), 0);
	uint8_t row[128] = {1};
	for (int i = 0; i < 8; i++)
		cr_assert_eq(nf_store_writer_write_bundle(w, NULL, row, row), 0);
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_store_writer_finish(w, &d), NF_EUSAGE, "an incomplete object is refused");
	cr_assert(strstr(d.msg, "incomplete"), "%s", d.msg);
	cr_assert_eq(nf_store_writer_write_bundle(w, row, row, row), NF_EUSAGE, "no gate in this FFN");
	cr_assert_eq(nf_store_writer_write_bundle(w, NULL, row, row), 0);
	cr_assert_eq(nf_store_writer_write_bundle(w, NULL, row, row), NF_EUSAGE, "past the last object");
	cr_assert_eq(nf_store_writer_finish(w, NULL), 0);
	nf_store_writer_close(w);
	struct nf_store *s;
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	const struct nf_store_object *o = nf_store_object_get(s, 0);
	cr_assert_eq(o->n_extents, 3);
	for (int i = 0; i < 9; i++)
		cr_assert_eq(o->perm[i], (uint32_t)(8 - i));
	nf_store_close(s);
	ts_dir_remove(&t);
}

Test(storage, store_writer_rejects_bad_declarations)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct nf_store_writer *w;
	struct nf_diag d = {0};
	struct nf_store_create_opts co = { .block_size = 1000 };
	cr_assert_eq(nf_store_writer_open(t.path, &co, &w, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "block size 1000"), "%s", d.msg);
	cr_assert_eq(ts_dir_count(&t), 0);
	cr_assert_eq(nf_store_writer_open(t.path, NULL, &w, NULL), 0);
	uint64_t shape[2] = { 33, 2 }, big[4] = { 32, 1ull << 40, 1ull << 40, 1ull << 40 };
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_store_writer_add_dense(w, "x", NF_DTYPE_Q4_0, 2, shape, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "shape[0] 33"), "%s", d.msg);
	cr_assert_eq(nf_store_writer_add_dense(w, "big", NF_DTYPE_F32, 4, big, NULL), NF_EFORMAT);
	shape[0] = 32;
	cr_assert_eq(nf_store_writer_add_dense(w, "x", NF_DTYPE_Q4_0, 2, shape, NULL), 0);
	cr_assert_eq(nf_store_writer_add_dense(w, "x", NF_DTYPE_Q4_0, 2, shape, NULL), NF_EUSAGE);
	cr_assert_eq(nf_store_writer_add_ffn(w, "f", 3, 0, NF_DTYPE_Q8_0, 48, 4, true, 0, NULL), NF_EUSAGE);
	cr_assert_eq(nf_store_writer_add_ffn(w, "f", 3, 0, NF_DTYPE_Q8_0, 64, 4, true, 0, NULL), 0);
	cr_assert_eq(nf_store_writer_add_ffn(w, "g", 3, 0, NF_DTYPE_Q8_0, 64, 4, true, 0, NULL), NF_EUSAGE);
	nf_store_writer_close(w);
	cr_assert_eq(ts_dir_count(&t), 0, "an abandoned writer leaves nothing");
	ts_dir_remove(&t);
}

/* ---- damaged and forged stores --------------------------------------- */

static void read_sb(const char *path, int slot, struct nf_store_sb_disk *sb)
{
	ts_read(path, (uint64_t)slot * NF_STORE_SB_SLOT, sb, sizeof(*sb));
}

static void write_sb(const char *path, int slot, struct nf_store_sb_disk *sb)
{
	sb->crc = htole32(nf_store_sb_crc(sb));
	ts_patch(path, (uint64_t)slot * NF_STORE_SB_SLOT, sb, sizeof(*sb));
}

static int open_err(const char *path, struct nf_diag *d)
{
	struct nf_store *s = NULL;
	memset(d, 0, sizeof(*d));
	int rc = nf_store_open(path, NULL, &s, d);
	cr_assert(rc < 0 ? s == NULL : s != NULL);
	nf_store_close(s);
	return rc;
}

static void fresh(struct ts_dir *t)
{
	cr_assert(ts_dir_make(t, "/tmp"));
	cr_assert_eq(ts_make_store(t->path, NF_DTYPE_Q8_0, 4, 4096, NULL), 0);
}

Test(storage, store_one_superblock_damaged_uses_the_other)
{
	struct ts_dir t;
	fresh(&t);
	struct nf_store *s;
	struct nf_diag d = {0};
	ts_flip(t.path, NF_STORE_SB_SLOT + 40, 3);   /* slot 1, generation 1 */
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->sb_slot, 0);
	cr_assert_eq(nf_store_info(s)->generation, 0);
	cr_assert_eq(nf_store_info(s)->other_sb_error, NF_ECHECKSUM);
	nf_store_close(s);
	ts_flip(t.path, NF_STORE_SB_SLOT + 40, 3);   /* repair, then damage slot 0 */
	ts_flip(t.path, 17, 0);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->sb_slot, 1);
	cr_assert_eq(nf_store_info(s)->other_sb_error, NF_ECHECKSUM);
	nf_store_close(s);
	/* The higher generation wins when both are valid, whatever the slot. */
	struct nf_store_sb_disk sb;
	read_sb(t.path, 1, &sb);
	sb.generation = htole64(6);   /* slot 1 holding an even generation: still taken by value */
	write_sb(t.path, 1, &sb);
	read_sb(t.path, 0, &sb);
	sb.generation = htole64(7);
	write_sb(t.path, 0, &sb);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->generation, 7);
	cr_assert_eq(nf_store_info(s)->sb_slot, 0);
	nf_store_close(s);
	/* Both damaged: a checksum error naming both copies. */
	ts_flip(t.path, 20, 1);
	ts_flip(t.path, NF_STORE_SB_SLOT + 20, 1);
	cr_assert_eq(open_err(t.path, &d), NF_ECHECKSUM);
	cr_assert(strstr(d.msg, "superblock 0") && strstr(d.msg, "superblock 1"), "%s", d.msg);
	ts_dir_remove(&t);
}

Test(storage, store_bad_magic_version_flags)
{
	struct ts_dir t;
	fresh(&t);
	struct nf_diag d;
	struct nf_store_sb_disk sb0, sb1, sb;
	read_sb(t.path, 0, &sb0);
	read_sb(t.path, 1, &sb1);

	uint8_t zero[NF_STORE_SB_AREA] = {0};
	ts_patch(t.path, 0, zero, sizeof(zero));
	cr_assert_eq(open_err(t.path, &d), NF_EMAGIC);
	cr_assert(strstr(d.msg, "bad magic"), "%s", d.msg);

	for (int k = 0; k < 2; k++) {   /* byte-swapped magic: a byte-order mistake */
		sb = k ? sb1 : sb0;
		sb.magic = htole64(NF_STORE_MAGIC_SWAPPED);
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), NF_EMAGIC);
	cr_assert(strstr(d.msg, "byte-swapped"), "%s", d.msg);

	for (int k = 0; k < 2; k++) {
		sb = k ? sb1 : sb0;
		sb.version = htole32(NF_STORE_VERSION + 1);
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), NF_EVERSION);
	cr_assert(strstr(d.msg, "version 2"), "%s", d.msg);

	for (int k = 0; k < 2; k++) {
		sb = k ? sb1 : sb0;
		sb.incompat = htole64(1ull << 5);
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), NF_EINCOMPAT);
	cr_assert(strstr(d.msg, "incompatible feature flags 0x20"), "%s", d.msg);

	/* Unknown compat flags are fine. */
	for (int k = 0; k < 2; k++) {
		sb = k ? sb1 : sb0;
		sb.compat = htole64(1ull << 9);
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), 0, "%s", d.msg);
	ts_dir_remove(&t);
}

Test(storage, store_truncated_and_table_past_end)
{
	struct ts_dir t;
	fresh(&t);
	struct nf_diag d;
	struct stat st;
	cr_assert_eq(stat(t.path, &st), 0);
	struct nf_store_sb_disk sb0, sb1, sb;
	read_sb(t.path, 0, &sb0);
	read_sb(t.path, 1, &sb1);

	for (int k = 0; k < 2; k++) {
		sb = k ? sb1 : sb0;
		sb.table_offset = htole64(le64toh(sb.file_size) - 512);   /* table runs past the end */
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "table_offset") && strstr(d.msg, "past the end"), "%s", d.msg);

	for (int k = 0; k < 2; k++) {
		sb = k ? sb1 : sb0;
		sb.table_offset = htole64(UINT64_MAX - 10);   /* offset + length overflows */
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "table_offset"), "%s", d.msg);

	for (int k = 0; k < 2; k++) {
		sb = k ? sb1 : sb0;
		sb.n_objects = htole32(0x7fffffff);   /* entries * 256 past the table */
		write_sb(t.path, k, &sb);
	}
	cr_assert_eq(open_err(t.path, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "n_objects"), "%s", d.msg);

	write_sb(t.path, 0, &sb0);
	write_sb(t.path, 1, &sb1);
	cr_assert_eq(open_err(t.path, &d), 0, "%s", d.msg);
	cr_assert_eq(truncate(t.path, st.st_size - 4096), 0);
	cr_assert_eq(open_err(t.path, &d), NF_ETRUNCATED);
	cr_assert(strstr(d.msg, "truncated"), "%s", d.msg);
	cr_assert_eq(truncate(t.path, 100), 0);
	cr_assert_eq(open_err(t.path, &d), NF_ETRUNCATED);
	cr_assert_eq(truncate(t.path, 0), 0);
	cr_assert_eq(open_err(t.path, &d), NF_ETRUNCATED);
	/* A short file that is not a store at all says so. */
	ts_patch(t.path, 0, "hello, world\n", 13);
	cr_assert_eq(open_err(t.path, &d), NF_EMAGIC);
	cr_assert(strstr(d.msg, "not an nflash store"), "%s", d.msg);
	ts_dir_remove(&t);
}

/* Read the object table, let f change it, write it back with the table
 * and superblock crcs fixed. */
static void forge_table(const char *path, void (*f)(uint8_t *tbl, uint64_t tlen, uint32_t i, void *arg),
			uint32_t i, void *arg)
{
	struct nf_store_sb_disk sb0, sb1;
	read_sb(path, 0, &sb0);
	read_sb(path, 1, &sb1);
	uint64_t toff = le64toh(sb1.table_offset), tlen = le64toh(sb1.table_length);
	uint8_t *tbl = malloc(tlen);
	cr_assert(tbl);
	ts_read(path, toff, tbl, tlen);
	f(tbl, tlen, i, arg);
	ts_patch(path, toff, tbl, tlen);
	uint32_t crc = nf_crc32c(0, tbl, tlen);
	sb0.table_crc = sb1.table_crc = htole32(crc);
	write_sb(path, 0, &sb0);
	write_sb(path, 1, &sb1);
	free(tbl);
}

static void entry_through(uint8_t *tbl, uint64_t tlen, uint32_t i, void *arg)
{
	void (*f)(struct nf_store_obj_disk *) = *(void (**)(struct nf_store_obj_disk *))arg;
	struct nf_store_obj_disk e;
	memcpy(&e, tbl + i * sizeof(e), sizeof(e));
	f(&e);
	memcpy(tbl + i * sizeof(e), &e, sizeof(e));
}

/* Rewrite object entry i through f, fixing the table and superblock crcs. */
static void forge_entry(const char *path, uint32_t i, void (*f)(struct nf_store_obj_disk *))
{
	forge_table(path, entry_through, i, &f);
}

static void huge_shape(struct nf_store_obj_disk *e) { e->shape[1] = htole64(1ull << 62); }
static void huge_length(struct nf_store_obj_disk *e) { e->length = htole64(UINT64_MAX - 4095); }
static void bad_dtype(struct nf_store_obj_disk *e) { e->dtype = htole32(77); }
static void bad_stride(struct nf_store_obj_disk *e) { e->stride = htole32(le32toh(e->stride) + 512); }
static void bad_extents(struct nf_store_obj_disk *e) { e->n_extents = htole32(le32toh(e->n_extents) + 1); }
static void bad_aux(struct nf_store_obj_disk *e) { e->aux_offset = htole64(UINT64_MAX - 3); }
static void bad_name(struct nf_store_obj_disk *e) { memset(e->name, 'x', sizeof(e->name)); }
static void bad_kind(struct nf_store_obj_disk *e) { e->kind = htole32(9); }

Test(storage, store_forged_entries_are_refused)
{
	struct {
		uint32_t obj;
		void (*f)(struct nf_store_obj_disk *);
		int code;
		const char *word;
	} cases[] = {
		{ 0, huge_shape, NF_EFORMAT, "overflows" },
		{ 0, huge_length, NF_EFORMAT, "length" },
		{ 2, huge_length, NF_EFORMAT, "outside the data area" },
		{ 0, bad_dtype, NF_EUNSUPPORTED, "dtype 77" },
		{ 2, bad_stride, NF_EFORMAT, "stride" },
		{ 2, bad_extents, NF_EFORMAT, "n_extents" },
		{ 3, bad_aux, NF_EFORMAT, "aux_offset" },
		{ 1, bad_name, NF_EFORMAT, "NUL" },
		{ 4, bad_kind, NF_EFORMAT, "unknown kind 9" },
	};
	for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
		struct ts_dir t;
		fresh(&t);
		forge_entry(t.path, cases[k].obj, cases[k].f);
		struct nf_diag d;
		cr_assert_eq(open_err(t.path, &d), cases[k].code, "case %zu: %s", k, d.msg);
		cr_assert(strstr(d.msg, cases[k].word), "case %zu: '%s' lacks '%s'", k, d.msg, cases[k].word);
		cr_assert(strstr(d.msg, "object"), "case %zu names the object: %s", k, d.msg);
		ts_dir_remove(&t);
	}
	/* A damaged table (without fixing its crc) is a checksum error. */
	struct ts_dir t;
	fresh(&t);
	struct nf_store_sb_disk sb;
	read_sb(t.path, 1, &sb);
	ts_flip(t.path, le64toh(sb.table_offset) + 70, 2);
	struct nf_diag d;
	cr_assert_eq(open_err(t.path, &d), NF_ECHECKSUM);
	cr_assert(strstr(d.msg, "object table"), "%s", d.msg);
	ts_dir_remove(&t);
}

/* Neuron 1 of FFN entry i takes neuron 0's slot, the entry's aux crc
 * fixed (*fix true) or left (then it mismatches). */
static void perm_dup(uint8_t *tbl, uint64_t tlen, uint32_t i, void *arg)
{
	struct nf_store_obj_disk e;
	memcpy(&e, tbl + i * sizeof(e), sizeof(e));
	cr_assert_eq(le32toh(e.kind), NF_STORE_KIND_FFN);
	uint64_t aux = le64toh(e.aux_offset), perm = aux + 4ull * le32toh(e.n_extents);
	cr_assert(perm + 8 <= tlen);
	memcpy(tbl + perm + 4, tbl + perm, 4);
	if (*(bool *)arg) {
		e.crc = htole32(nf_crc32c(0, tbl + aux, le64toh(e.aux_length)));
		memcpy(tbl + i * sizeof(e), &e, sizeof(e));
	}
}

/* The FFN permutations are checked at open, so `store verify` reports a
 * damaged one (defect 5: verify checks every section), naming the object:
 * a flipped entry by its crc, a forged one (crcs fixed) as not a bijection. */
Test(storage, store_damaged_permutation_refused_by_open_and_verify)
{
	char out[4096];
	for (int fix = 0; fix < 2; fix++) {
		struct ts_dir t;
		fresh(&t);
		bool f = fix;
		forge_table(t.path, perm_dup, 2, &f);
		struct nf_diag d;
		int rc = open_err(t.path, &d);
		cr_expect_eq(rc, fix ? NF_EFORMAT : NF_ECHECKSUM, "%s", d.msg);
		cr_expect(strstr(d.msg, fix ? "repeated" : "permutation"), "%s", d.msg);
		char *argv[] = { "store", "verify", t.path, NULL };
		rc = ts_run_store_cmd(argv, out, sizeof(out));
		cr_expect_eq(rc, 1, "verify passed a damaged permutation: %s", out);
		cr_expect(strstr(out, fix ? "repeated" : "permutation") && strstr(out, "object"), "%s", out);
		ts_dir_remove(&t);
	}
}

Test(storage, store_flipped_bit_caught_on_read_and_by_verify)
{
	struct ts_dir t;
	fresh(&t);
	struct nf_store *s;
	struct nf_diag d = {0};
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0);
	const struct nf_store_object *o = nf_store_object_find(s, "blk.1.ffn");
	uint64_t off, len;
	nf_store_extent_span(o, 2, &off, &len);
	nf_store_close(s);
	ts_flip(t.path, off + 100, 6);              /* extent 2 of blk.1.ffn */
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0);
	o = nf_store_object_find(s, "blk.1.ffn");
	struct nf_io_opts io_o;
	nf_io_opts_default(&io_o);
	io_o.quiet = true;
	io_o.backend = NF_IO_SYNC;
	struct nf_io_ctx *io;
	cr_assert_eq(nf_io_ctx_open(s, &io_o, &io, &d), 0);
	uint8_t *buf = nf_io_buf_alloc(o->length, nf_io_ctx_align(io));
	struct ts_done r1 = {0}, r2 = {0}, r3 = {0};
	cr_assert_eq(nf_io_ctx_read_extents(io, o, 2, 1, buf, ts_on_done, &r1), 0);
	cr_assert_eq(nf_io_ctx_read_extents(io, o, 1, 1, buf + len, ts_on_done, &r2), 0);
	uint32_t slots[4] = { 8, 9, 10, 11 };   /* exactly extent 2 */
	cr_assert_eq(nf_io_ctx_read_bundles(io, o, slots, 4, buf + 2 * len, ts_on_done, &r3), 0);
	cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
	cr_assert_eq(r1.result, NF_ECHECKSUM);
	cr_assert_eq(r2.result, 0);
	cr_assert_eq(r3.result, NF_ECHECKSUM, "bundle reads covering a whole extent are verified");
	cr_assert_eq(nf_io_ctx_error(io), 0, "a checksum mismatch does not stick");
	nf_io_ctx_close(io);
	io_o.no_verify = true;
	cr_assert_eq(nf_io_ctx_open(s, &io_o, &io, &d), 0);
	cr_assert_eq(nf_io_ctx_read_extents(io, o, 2, 1, buf, ts_on_done, &r1), 0);
	cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
	cr_assert_eq(r1.result, 0, "verification off");
	nf_io_ctx_close(io);
	nf_io_buf_free(buf);
	nf_store_close(s);

	char out[4096];
	char *argv[] = { "store", "verify", t.path, NULL };
	cr_assert_eq(ts_run_store_cmd(argv, out, sizeof(out)), 1, "%s", out);
	cr_assert(strstr(out, "bad: blk.1.ffn extent 2 (bundles 8..11)"), "%s", out);
	cr_assert(strstr(out, "DAMAGED"), "%s", out);
	/* A dense object too. */
	ts_flip(t.path, 8192 + 5, 0);
	cr_assert_eq(ts_run_store_cmd(argv, out, sizeof(out)), 1, "%s", out);
	cr_assert(strstr(out, "bad: emb:"), "%s", out);
	cr_assert(strstr(out, "bad: blk.1.ffn extent 2"), "%s", out);
	ts_dir_remove(&t);

	fresh(&t);
	char *argv2[] = { "store", "verify", t.path, "--json", NULL };
	cr_assert_eq(ts_run_store_cmd(argv2, out, sizeof(out)), 0, "%s", out);
	cr_assert(strstr(out, "\"ok\": true"), "%s", out);
	ts_dir_remove(&t);
}

/* ---- crash safety ---------------------------------------------------- */

static int fail_fsync(int fd)
{
	(void)fd;
	errno = EIO;
	return -1;
}

Test(storage, store_creation_killed_midway_leaves_nothing)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		struct nf_store_writer *w;
		if (nf_store_writer_open(t.path, NULL, &w, NULL) < 0 ||
		    nf_store_writer_add_ffn(w, "f", 0, 0, NF_DTYPE_F16, 1024, 8192, true, 0, NULL) < 0 ||
		    nf_store_writer_begin(w, NULL) < 0)
			_exit(3);
		static uint8_t b[3 * 2048];
		for (int i = 0; i < 8192; i++) {
			if (i == 6000)
				raise(SIGKILL);   /* 40 MiB of 64 written, some flushed */
			if (nf_store_writer_write_bundles(w, b, 1) < 0)
				_exit(4);
		}
		_exit(5);
	}
	int st;
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "child status %#x", st);
	struct stat sst;
	cr_assert_eq(stat(t.path, &sst), -1, "nothing under the final name");
	cr_assert_eq(errno, ENOENT);
	cr_assert_eq(ts_dir_count(&t), 1, "only the temporary file remains");

	/* A failed fsync: finish fails, nothing appears, the error sticks. */
	struct nf_io_sys sys = nf_io_sys_default;
	sys.fsync = fail_fsync;
	cr_assert_lt(ts_make_store(t.path, NF_DTYPE_F32, 0, 0, &sys), 0);
	cr_assert_eq(stat(t.path, &sst), -1);
	cr_assert_eq(ts_dir_count(&t), 1, "the failed writer removed its temporary file");
	ts_dir_remove(&t);
}

/* ---- in-place updates: generations alternate between the two slots ---- */

static int fsync_calls;

static int fail_second_fsync(int fd)
{
	if (++fsync_calls == 2) {
		errno = EIO;
		return -1;
	}
	return fsync(fd);
}

Test(storage, store_update_alternates_superblocks)
{
	struct ts_dir t;
	fresh(&t);
	struct nf_store *s;
	struct nf_diag d = {0};
	const uint32_t ffn = 3;   /* blk.1.ffn */
	uint32_t rev[TS_N], rot[TS_N], bad[TS_N];
	for (uint32_t i = 0; i < TS_N; i++) {
		rev[i] = TS_N - 1 - i;
		rot[i] = (i + 5) % TS_N;
		bad[i] = i;
	}
	bad[7] = 6;

	cr_assert_eq(nf_store_update_perm(t.path, NULL, ffn, rev, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->generation, 2);
	cr_assert_eq(nf_store_info(s)->sb_slot, 0);
	cr_assert_eq(nf_store_info(s)->other_sb_error, 0);
	cr_assert_str_eq(nf_store_object_get(s, ffn)->name, "blk.1.ffn");
	for (uint32_t i = 0; i < TS_N; i++) {
		cr_assert_eq(nf_store_object_get(s, ffn)->perm[i], rev[i]);
		cr_assert_eq(nf_store_object_get(s, 2)->perm[i], i, "other FFNs unchanged");
	}
	nf_store_close(s);

	cr_assert_eq(nf_store_update_perm(t.path, NULL, ffn, rot, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->generation, 3);
	cr_assert_eq(nf_store_info(s)->sb_slot, 1);
	cr_assert_eq(nf_store_object_get(s, ffn)->perm[0], 5);
	nf_store_close(s);

	/* Refused updates change nothing. */
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_store_update_perm(t.path, NULL, ffn, bad, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "perm[7]"), "%s", d.msg);
	cr_assert_eq(nf_store_update_perm(t.path, NULL, 0, rev, NULL), NF_EUSAGE, "dense object");
	/* The fsync after the new table failing: generation 3 stays in use. */
	struct nf_io_sys sys = nf_io_sys_default;
	sys.fsync = fail_second_fsync;
	struct nf_store_open_opts so = { .sys = &sys };
	fsync_calls = 1;
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_store_update_perm(t.path, &so, ffn, rev, &d), -EIO);
	cr_assert(strstr(d.msg, "object table"), "%s", d.msg);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->generation, 3);
	cr_assert_eq(nf_store_object_get(s, ffn)->perm[0], 5);
	nf_store_close(s);

	/* The newest copy damaged: the previous generation and its table are used. */
	ts_flip(t.path, 1 * NF_STORE_SB_SLOT + 30, 4);   /* generation 3 lives in slot 1 */
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->generation, 2);
	cr_assert_eq(nf_store_info(s)->other_sb_error, NF_ECHECKSUM);
	cr_assert_eq(nf_store_object_get(s, ffn)->perm[0], TS_N - 1, "generation 2's permutation");
	nf_store_close(s);

	/* And the data still reads back, verified, through the new table. */
	char out[4096];
	char *argv[] = { "store", "verify", t.path, NULL };
	cr_assert_eq(ts_run_store_cmd(argv, out, sizeof(out)), 0, "%s", out);
	ts_dir_remove(&t);
}
