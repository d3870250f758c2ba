/*
 * test_storage_profile.c - a store's activation profile: written in place
 * as a new generation and read back, written by the writer, carried over a
 * permutation update, a crash at any write of the update leaving a valid
 * store (fault injection through the syscall table), a damaged section
 * refused on read but not on open, a compat bit an older nflash cleared,
 * and relayout: bundles hot-first, neuron ids keep their bytes; a
 * co-activation order stored, checked on read and applied by relayout.
 */
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/crc32c.h"
#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "../storage/store_format.h"
#include "util_storage.h"

/* A profile for s: count of neuron j of object i = (j * 7 + i) % 11. */
static struct nf_store_profile *make_profile(const struct nf_store *s, uint64_t tokens)
{
	struct nf_store_profile *p = NULL;
	cr_assert_eq(nf_store_profile_alloc(s, &p), 0);
	for (uint32_t i = 0; i < p->n_objects; i++)
		for (uint32_t j = 0; j < p->lens[i]; j++)
			p->counts[i][j] = (j * 7 + i) % 11;
	p->tokens = tokens;
	p->source = NF_STORE_PROFILE_PREDICTOR;
	p->created_ns = 12345;
	return p;
}

static void same_profile(const struct nf_store_profile *a, const struct nf_store_profile *b)
{
	cr_assert_eq(a->n_objects, b->n_objects);
	cr_assert_eq(a->tokens, b->tokens);
	cr_assert_eq(a->source, b->source);
	cr_assert_eq(a->created_ns, b->created_ns);
	for (uint32_t i = 0; i < a->n_objects; i++) {
		cr_assert_eq(a->lens[i], b->lens[i], "object %u", i);
		if (a->lens[i])
			cr_assert(!memcmp(a->counts[i], b->counts[i], 4ull * a->lens[i]), "object %u counts", i);
	}
}

static struct nf_store *open_ok(const char *path)
{
	struct nf_store *s = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_store_open(path, NULL, &s, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	return s;
}

static struct nf_store_profile *read_ok(const struct nf_store *s)
{
	struct nf_store_profile *p = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_store_profile_read(s, &p, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	return p;
}

Test(storage, profile_update_in_place_and_read_back)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_Q8_0, 8, 4096, NULL), 0);
	struct nf_store *s = open_ok(t.path);
	cr_assert(!nf_store_has_profile(s));
	struct nf_store_profile *q = NULL;
	cr_assert_eq(nf_store_profile_read(s, &q, NULL), -ENOENT);
	uint64_t g0 = nf_store_info(s)->generation;
	struct nf_store_profile *p = make_profile(s, 100);
	struct nf_diag d = { 0 };
	int rc = nf_store_update_profile(t.path, NULL, p, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	nf_store_close(s);

	s = open_ok(t.path);
	const struct nf_store_info *in = nf_store_info(s);
	cr_assert_eq(in->generation, g0 + 1);
	cr_assert(nf_store_has_profile(s));
	cr_assert(in->compat & NF_STORE_COMPAT_PROFILE);
	cr_assert_eq(in->other_sb_error, 0);
	q = read_ok(s);
	same_profile(p, q);
	nf_store_profile_free(q);

	/* a second profile replaces the first; a permutation update keeps it */
	p->tokens = 200;
	p->counts[2][0] = 999;
	cr_assert_eq(nf_store_update_profile(t.path, NULL, p, &d), 0);
	nf_store_close(s);
	s = open_ok(t.path);
	const struct nf_store_object *ffn = nf_store_ffn_find(s, 0, 0);
	uint32_t perm[TS_N];
	for (uint32_t k = 0; k < ffn->n_bundles; k++)
		perm[k] = ffn->perm[k];
	cr_assert_eq(nf_store_update_perm(t.path, NULL, ffn->index, perm, &d), 0, "%s", d.msg);
	nf_store_close(s);
	s = open_ok(t.path);
	cr_assert_eq(nf_store_info(s)->generation, g0 + 3);
	q = read_ok(s);
	same_profile(p, q);
	cr_assert_eq(q->counts[2][0], 999);
	nf_store_profile_free(q);

	/* a profile shaped for another store is refused, the store unchanged */
	p->lens[2]--;
	rc = nf_store_update_profile(t.path, NULL, p, &d);
	cr_assert_eq(rc, NF_EUSAGE);
	cr_assert(strstr(d.msg, "counts for object"), "%s", d.msg);
	p->lens[2]++;
	nf_store_close(s);
	s = open_ok(t.path);
	cr_assert_eq(nf_store_info(s)->generation, g0 + 3);
	nf_store_profile_free(p);
	nf_store_close(s);
	ts_dir_remove(&t);
}

/* ---- crash safety: a syscall table that fails the k-th write or fsync ---- */

static int fail_at, calls;
static bool torn;

static ssize_t faulty_pwrite(int fd, const void *buf, size_t len, off_t off)
{
	if (++calls == fail_at) {
		if (torn && len > 100)
			(void)pwrite(fd, buf, 100, off);   /* a torn write, then the crash */
		errno = EIO;
		return -1;
	}
	return pwrite(fd, buf, len, off);
}

static int faulty_fsync(int fd)
{
	if (++calls == fail_at) {
		errno = EIO;
		return -1;
	}
	return fsync(fd);
}

Test(storage, profile_update_interrupted_at_every_step)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct nf_io_sys sys = nf_io_sys_default;
	sys.pwrite = faulty_pwrite;
	sys.fsync = faulty_fsync;
	struct nf_store_open_opts so = { .sys = &sys };
	/* the update makes 4 calls: write section, fsync, write superblock, fsync */
	for (int step = 1; step <= 4; step++)
		for (int tear = 0; tear < 2; tear++) {
			cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
			struct nf_store *s = open_ok(t.path);
			uint64_t g0 = nf_store_info(s)->generation;
			struct nf_store_profile *p = make_profile(s, 7);
			nf_store_close(s);
			calls = 0;
			fail_at = step;
			torn = tear;
			struct nf_diag d = { 0 };
			int rc = nf_store_update_profile(t.path, &so, p, &d);
			cr_assert_eq(rc, -EIO, "step %d: %s", step, nf_diag_msg(&d, rc));
			/* the store opens, at g (no profile) or, when only the final
			 * fsync failed, at g + 1 with the whole profile */
			s = open_ok(t.path);
			uint64_t g = nf_store_info(s)->generation;
			if (step <= 3) {
				cr_assert_eq(g, g0, "step %d tear %d: generation %llu", step, tear, (unsigned long long)g);
				cr_assert(!nf_store_has_profile(s));
			} else {
				cr_assert_eq(g, g0 + 1, "step %d", step);
				struct nf_store_profile *q = read_ok(s);
				same_profile(p, q);
				nf_store_profile_free(q);
			}
			/* and the update succeeds once the fault is gone */
			nf_store_close(s);
			fail_at = -1;
			rc = nf_store_update_profile(t.path, &so, p, &d);
			cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
			s = open_ok(t.path);
			struct nf_store_profile *q = read_ok(s);
			same_profile(p, q);
			nf_store_profile_free(q);
			nf_store_profile_free(p);
			nf_store_close(s);
			unlink(t.path);
		}
	ts_dir_remove(&t);
}

/* Rewrite superblock slot k after f changed it (crc resealed). */
static void patch_sb(const char *path, int k, void (*f)(struct nf_store_sb_disk *))
{
	struct nf_store_sb_disk sb;
	ts_read(path, (uint64_t)k * NF_STORE_SB_SLOT, &sb, sizeof(sb));
	f(&sb);
	sb.crc = htole32(nf_store_sb_crc(&sb));
	ts_patch(path, (uint64_t)k * NF_STORE_SB_SLOT, &sb, sizeof(sb));
}

static void drop_fields(struct nf_store_sb_disk *sb)
{
	/* what an older nflash writes on an in-place update: the compat bit
	 * copied, the fields it does not know zeroed */
	sb->profile_offset = sb->profile_length = 0;
	sb->profile_crc = 0;
}

static void drop_bit(struct nf_store_sb_disk *sb)
{
	sb->compat &= ~htole64(NF_STORE_COMPAT_PROFILE);
}

static void past_end(struct nf_store_sb_disk *sb)
{
	sb->profile_offset = htole64(le64toh(sb->file_size));
}

/* Store make_profile(tokens) in the store at path; returns it. */
static struct nf_store_profile *store_profile(const char *path, uint64_t tokens)
{
	struct nf_store *s = open_ok(path);
	struct nf_store_profile *p = make_profile(s, tokens);
	nf_store_close(s);
	cr_assert_eq(nf_store_update_profile(path, NULL, p, NULL), 0);
	return p;
}

Test(storage, profile_damaged_or_dropped)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F32, 8, 4096, NULL), 0);
	struct nf_store_profile *p = store_profile(t.path, 3);
	struct nf_store *s = open_ok(t.path);
	int slot = nf_store_info(s)->sb_slot;
	uint64_t off = nf_store_info(s)->profile_offset;
	nf_store_close(s);

	/* a flipped count: the store opens, the profile read says why */
	ts_flip(t.path, off + 64 + 8 * 3 + 4 * 5, 2);
	s = open_ok(t.path);
	struct nf_store_profile *q = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_profile_read(s, &q, &d), NF_ECHECKSUM);
	cr_assert(strstr(d.msg, "profile"), "%s", d.msg);
	nf_store_close(s);
	ts_flip(t.path, off + 64 + 8 * 3 + 4 * 5, 2);

	/* a section pointing past the end makes that superblock invalid; the
	 * other copy (generation g - 1, no profile) is used */
	patch_sb(t.path, slot, past_end);
	s = open_ok(t.path);
	cr_assert_eq(nf_store_info(s)->sb_slot, !slot);
	cr_assert_eq(nf_store_info(s)->other_sb_error, NF_EFORMAT);
	cr_assert(!nf_store_has_profile(s));
	nf_store_close(s);

	/* the bit with empty fields, or the fields without the bit: no profile */
	void (*drops[2])(struct nf_store_sb_disk *) = { drop_fields, drop_bit };
	for (int k = 0; k < 2; k++) {
		cr_assert_eq(nf_store_update_profile(t.path, NULL, p, NULL), 0);
		s = open_ok(t.path);
		slot = nf_store_info(s)->sb_slot;
		nf_store_close(s);
		patch_sb(t.path, slot, drops[k]);
		s = open_ok(t.path);
		cr_assert_eq(nf_store_info(s)->sb_slot, slot, "case %d", k);
		cr_assert(!nf_store_has_profile(s), "case %d", k);
		nf_store_close(s);
	}
	nf_store_profile_free(p);
	ts_dir_remove(&t);
}

static void relayout_progress(void *user, uint64_t done, uint64_t total)
{
	uint64_t *last = user;
	cr_assert_leq(done, total);
	cr_assert_geq(done, *last);
	*last = done;
}

Test(storage, profile_relayout_puts_hot_bundles_first)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_Q4_0, 8, 4096, NULL), 0);
	char out[256];
	snprintf(out, sizeof(out), "%s/hot.nfs", t.dir);
	struct nf_diag d = { 0 };
	/* no profile: refused, nothing written */
	cr_assert_eq(nf_store_relayout(t.path, out, NULL, &d), -ENOENT);
	cr_assert_eq(ts_dir_count(&t), 1);
	struct nf_store *s = open_ok(t.path);
	struct nf_store_profile *p = make_profile(s, 5);
	nf_store_close(s);
	cr_assert_eq(nf_store_update_profile(t.path, NULL, p, NULL), 0);
	uint64_t last = 0;
	struct nf_store_relayout_opts o = { .progress = relayout_progress, .progress_user = &last };
	int rc = nf_store_relayout(t.path, out, &o, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	cr_assert_gt(last, 0);
	cr_assert_eq(ts_dir_count(&t), 2, "no temporary file is left");

	s = open_ok(t.path);
	struct nf_store *r = open_ok(out);
	struct nf_io_ctx *io = NULL;
	cr_assert_eq(nf_io_ctx_open(r, NULL, &io, &d), 0, "%s", d.msg);
	struct nf_store_profile *q = read_ok(r);
	same_profile(p, q);
	cr_assert_eq(nf_store_object_count(r), nf_store_object_count(s));
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *a = nf_store_object_get(s, i), *b = nf_store_object_get(r, i);
		cr_assert_str_eq(a->name, b->name);
		cr_assert_eq(a->kind, b->kind);
		cr_assert_eq(a->length, b->length);
		if (a->kind != NF_STORE_KIND_FFN) {
			cr_assert_eq(a->crc, b->crc, "%s", a->name);
			continue;
		}
		/* slots in descending count, ties in neuron order */
		uint32_t by_slot[TS_N], who[TS_N];
		for (uint32_t j = 0; j < b->n_bundles; j++) {
			by_slot[b->perm[j]] = p->counts[i][j];
			who[b->perm[j]] = j;
		}
		for (uint32_t k = 1; k < b->n_bundles; k++)
			cr_assert(by_slot[k - 1] > by_slot[k] || (by_slot[k - 1] == by_slot[k] && who[k - 1] < who[k]),
				  "%s: slot %u", b->name, k);
		/* neuron j's bundle holds what ts_make_store wrote for neuron j
		 * (the input's perm is the identity) */
		uint8_t *buf = nf_io_buf_alloc(nf_store_object_buf_size(b, 4096), nf_io_ctx_align(io));
		struct ts_done dn = { 0 };
		cr_assert_eq(nf_io_ctx_read_object(io, b, buf, ts_on_done, &dn), 0);
		cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
		cr_assert_eq(dn.result, 0, "%s", nf_strerror(dn.result));
		for (uint32_t j = 0; j < b->n_bundles; j++) {
			uint32_t slot = b->perm[j];
			cr_assert_eq(ts_check_bundles(a, &j, 1, buf + (uint64_t)slot * b->stride), 0,
				     "%s neuron %u", b->name, j);
		}
		nf_io_buf_free(buf);
	}
	nf_store_profile_free(q);
	nf_io_ctx_close(io);
	nf_store_close(r);
	nf_store_close(s);
	nf_store_profile_free(p);
	ts_dir_remove(&t);
}

/* ---- the co-activation order (FORMAT.md item 19, flag 1) ---- */

static uint32_t new_crc;
static void set_crc(struct nf_store_sb_disk *sb)
{
	sb->profile_crc = htole32(new_crc);
}

Test(storage, profile_order_stored_checked_and_applied_by_relayout)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_Q8_0, 8, 4096, NULL), 0);
	char out[256];
	snprintf(out, sizeof(out), "%s/co.nfs", t.dir);
	struct nf_store *s = open_ok(t.path);
	struct nf_store_profile *p = make_profile(s, 7);
	nf_store_close(s);
	/* an order that is not a permutation is not stored (counts are) */
	cr_assert(!!(p->order = calloc(p->n_objects, sizeof(*p->order))));
	for (uint32_t i = 0; i < p->n_objects; i++) {
		if (!p->lens[i])
			continue;
		cr_assert(!!(p->order[i] = malloc(4ull * p->lens[i])));
		for (uint32_t r = 0; r < p->lens[i]; r++)
			p->order[i][r] = (r * 5 + i) % p->lens[i];   /* 5 and TS_N are coprime */
	}
	uint32_t keep = p->order[2][3];
	p->order[2][3] = p->order[2][4];
	cr_assert(!nf_store_profile_order_valid(p->order[2], p->lens[2]));
	cr_assert_eq(nf_store_update_profile(t.path, NULL, p, NULL), 0);
	s = open_ok(t.path);
	struct nf_store_profile *q = read_ok(s);
	same_profile(p, q);
	cr_assert_null(q->order);
	nf_store_profile_free(q);
	nf_store_close(s);

	/* a valid one: read back equal */
	p->order[2][3] = keep;
	cr_assert(nf_store_profile_order_valid(p->order[2], p->lens[2]));
	cr_assert_eq(nf_store_update_profile(t.path, NULL, p, NULL), 0);
	s = open_ok(t.path);
	q = read_ok(s);
	same_profile(p, q);
	cr_assert_not_null(q->order);
	for (uint32_t i = 0; i < p->n_objects; i++)
		if (p->lens[i])
			cr_assert(!memcmp(p->order[i], q->order[i], 4ull * p->lens[i]), "object %u order", i);
	nf_store_profile_free(q);

	/* relayout follows the order: neuron order[r] in slot r, bytes kept,
	 * the profile (with its order) carried over */
	struct nf_diag d = { 0 };
	int rc = nf_store_relayout(t.path, out, NULL, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_store *r = open_ok(out);
	struct nf_io_ctx *io = NULL;
	cr_assert_eq(nf_io_ctx_open(r, NULL, &io, &d), 0, "%s", d.msg);
	q = read_ok(r);
	cr_assert_not_null(q->order);
	for (uint32_t i = 0; i < nf_store_object_count(r); i++) {
		const struct nf_store_object *a = nf_store_object_get(s, i), *b = nf_store_object_get(r, i);
		if (b->kind != NF_STORE_KIND_FFN)
			continue;
		cr_assert(!memcmp(p->order[i], q->order[i], 4ull * p->lens[i]), "object %u order", i);
		for (uint32_t k = 0; k < b->n_bundles; k++)
			cr_assert_eq(b->perm[p->order[i][k]], k, "%s slot %u", b->name, k);
		uint8_t *buf = nf_io_buf_alloc(nf_store_object_buf_size(b, 4096), nf_io_ctx_align(io));
		struct ts_done dn = { 0 };
		cr_assert_eq(nf_io_ctx_read_object(io, b, buf, ts_on_done, &dn), 0);
		cr_assert_geq(nf_io_ctx_wait(io, 0, -1), 0);
		cr_assert_eq(dn.result, 0, "%s", nf_strerror(dn.result));
		for (uint32_t j = 0; j < b->n_bundles; j++)
			cr_assert_eq(ts_check_bundles(a, &j, 1, buf + (uint64_t)b->perm[j] * b->stride), 0,
				     "%s neuron %u", b->name, j);
		nf_io_buf_free(buf);
	}
	nf_store_profile_free(q);
	nf_io_ctx_close(io);
	nf_store_close(r);

	/* by_count ignores the order: descending count, ties by id */
	char out2[256];
	snprintf(out2, sizeof(out2), "%s/count.nfs", t.dir);
	struct nf_store_relayout_opts bc = { .by_count = true };
	rc = nf_store_relayout(t.path, out2, &bc, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	r = open_ok(out2);
	for (uint32_t i = 0; i < nf_store_object_count(r); i++) {
		const struct nf_store_object *b = nf_store_object_get(r, i);
		if (b->kind != NF_STORE_KIND_FFN)
			continue;
		uint32_t who[TS_N];
		for (uint32_t j = 0; j < b->n_bundles; j++)
			who[b->perm[j]] = j;
		for (uint32_t k = 1; k < b->n_bundles; k++) {
			uint32_t x = p->counts[i][who[k - 1]], y = p->counts[i][who[k]];
			cr_assert(x > y || (x == y && who[k - 1] < who[k]), "%s: slot %u", b->name, k);
		}
	}
	nf_store_close(r);

	/* a section whose order repeats a neuron (crc resealed: written by a
	 * faulty tool, not damaged on disk) is refused, naming the entry */
	const struct nf_store_info *in = nf_store_info(s);
	uint64_t off = in->profile_offset, len = in->profile_length;
	int slot = in->sb_slot;
	nf_store_close(s);
	uint8_t *sec = malloc(len);
	ts_read(t.path, off, sec, len);
	uint32_t n_ffn;
	memcpy(&n_ffn, sec + 12, 4);
	uint64_t total_counts = 0;
	for (uint32_t k = 0; k < le32toh(n_ffn); k++) {
		uint32_t nb;
		memcpy(&nb, sec + 64 + 8 * k + 4, 4);
		total_counts += le32toh(nb);
	}
	uint64_t ord0 = 64 + 8ull * le32toh(n_ffn) + 4 * total_counts;   /* first entry's order */
	memcpy(sec + ord0 + 4, sec + ord0, 4);
	ts_patch(t.path, off, sec, len);
	new_crc = nf_crc32c(0, sec, len);
	patch_sb(t.path, slot, set_crc);
	s = open_ok(t.path);
	cr_assert_eq(nf_store_profile_read(s, &q, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "not a permutation"), "%s", d.msg);
	nf_store_close(s);
	free(sec);
	nf_store_profile_free(p);
	ts_dir_remove(&t);
}

/* An fsync that takes its time, so two updates overlap. */
static int slow_fsync(int fd)
{
	usleep(300 * 1000);
	return fsync(fd);
}

/* Two processes updating one store's profile at once: the second waits for
 * the first (an exclusive lock), so both land, as two generations, and the
 * profile that is read back is whole (issue #16 defect 5). */
Test(storage, profile_updates_from_two_processes_are_serialized)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
	struct nf_store *s = open_ok(t.path);
	uint64_t g0 = nf_store_info(s)->generation;
	struct nf_store_profile *p1 = make_profile(s, 1), *p2 = make_profile(s, 2);
	p2->counts[3][0] = 99;          /* different bytes, the same length */
	nf_store_close(s);
	struct nf_io_sys sys = nf_io_sys_default;
	sys.fsync = slow_fsync;
	struct nf_store_open_opts so = { .sys = &sys };
	pid_t pid[2];
	for (int k = 0; k < 2; k++) {
		pid[k] = fork();
		cr_assert_geq(pid[k], 0);
		if (pid[k] == 0) {
			usleep(k * 100 * 1000);   /* the second starts inside the first's update */
			_exit(nf_store_update_profile(t.path, &so, k ? p2 : p1, NULL) == 0 ? 0 : 1);
		}
	}
	for (int k = 0; k < 2; k++) {
		int st = 0;
		waitpid(pid[k], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "update %d failed", k);
	}
	s = open_ok(t.path);
	cr_expect_eq(nf_store_info(s)->generation, g0 + 2, "generation %llu after two updates from %llu",
		     (unsigned long long)nf_store_info(s)->generation, (unsigned long long)g0);
	struct nf_store_profile *q = read_ok(s);
	same_profile(p2, q);
	nf_store_profile_free(q);
	nf_store_close(s);
	nf_store_profile_free(p1);
	nf_store_profile_free(p2);
	ts_dir_remove(&t);
}

/* `store verify` checks every section, not only objects and extents: a
 * damaged profile is reported, naming the section. */
Test(storage, verify_checks_the_profile_section)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
	nf_store_profile_free(store_profile(t.path, 5));
	char out[8192];
	struct nf_store *s;
	char *const argv[] = { "store", "verify", t.path, NULL };
	int rc = ts_run_store_cmd(argv, out, sizeof(out));
	cr_assert_eq(rc, 0, "%s", out);
	cr_expect(strstr(out, "profile"), "verify does not mention the profile: %s", out);
	s = open_ok(t.path);
	uint64_t off = nf_store_info(s)->profile_offset;
	nf_store_close(s);
	ts_flip(t.path, off + 70, 3);
	rc = ts_run_store_cmd(argv, out, sizeof(out));
	cr_expect_eq(rc, 1, "a damaged profile passes verify: %s", out);
	cr_expect(strstr(out, "bad: profile"), "%s", out);
	ts_dir_remove(&t);
}
