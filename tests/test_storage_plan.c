/*
 * test_storage_plan.c - a store's plan section (docs/FORMAT.md item 20):
 * written in place as a new generation and read back; the entry for a
 * budget is the nearest at or below it; a plan a reader would refuse is
 * never written; a damaged section is refused on read (never followed) but
 * the store still opens, and `store verify` names it; a crash at any write of the update leaves a valid
 * store; the profile and the plan live side by side.
 */
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "../storage/store_format.h"
#include "util_storage.h"

static struct nf_store_dev_point pts[2] = { { 4096, 32, 240.5, 6.25, 530.0 }, { 65536, 4, 1430.0, 9.5, 180.0 } };
static struct nf_store_kernel_rate rates[1] = { { NF_DTYPE_Q4_0, 2, 21.5 } };

static void make_plan(struct nf_store_plan *p, struct nf_store_plan_entry *e, uint32_t n)
{
	memset(p, 0, sizeof(*p));
	p->created_ns = 777;
	p->mem_read_gb_s = 33.25;
	p->n_points = 2;
	p->points = pts;
	p->n_rates = 1;
	p->rates = rates;
	p->n_entries = n;
	p->entries = e;
	for (uint32_t i = 0; i < n; i++) {
		memset(&e[i], 0, sizeof(e[i]));
		e[i].budget = (uint64_t)(i + 1) << 30;
		e[i].n_ctx = 512u << i;
		e[i].kv_type = 1;
		e[i].n_batch = 16;
		e[i].n_threads = 2;
		e[i].qd = 256;
		e[i].read_gap = 4;
		e[i].cold_slots = 2752;
		e[i].flags = i == 0 ? NF_STORE_PLAN_F_STREAM_ATTN | NF_STORE_PLAN_F_ROUTE_SET | NF_STORE_PLAN_F_ROUTE_ON
				    : NF_STORE_PLAN_F_GATE_FIRST;
		e[i].hot_slots = 1000 * (i + 1);
		e[i].tok_per_s = 2.5 + i;
		e[i].io_wait_share = 0.25;
		e[i].bytes_per_token = 1e8;
		e[i].reads_per_token = 9000;
		e[i].t_dense_s = 0.1;
		e[i].t_ffn_s = 0.2;
		e[i].t_io_s = 0.3;
		e[i].t_token_s = 0.4;
	}
}

static void same_plan(const struct nf_store_plan *a, const struct nf_store_plan *b)
{
	cr_assert_eq(a->created_ns, b->created_ns);
	cr_assert_eq(a->mem_read_gb_s, b->mem_read_gb_s);
	cr_assert_eq(a->n_points, b->n_points);
	cr_assert_eq(a->n_rates, b->n_rates);
	cr_assert_eq(a->n_entries, b->n_entries);
	cr_assert(!memcmp(a->points, b->points, a->n_points * sizeof(*a->points)));
	cr_assert(!memcmp(a->rates, b->rates, a->n_rates * sizeof(*a->rates)));
	for (uint32_t i = 0; i < a->n_entries; i++)
		cr_assert(!memcmp(&a->entries[i], &b->entries[i], sizeof(a->entries[i])), "entry %u", i);
}

static struct nf_store *open_ok(const char *path)
{
	struct nf_store *s = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_store_open(path, NULL, &s, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	return s;
}

static struct nf_store_plan *read_ok(const struct nf_store *s)
{
	struct nf_store_plan *p = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_store_plan_read(s, &p, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	return p;
}

Test(storage, plan_update_in_place_read_back_and_picked_by_budget)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
	struct nf_store *s = open_ok(t.path);
	cr_assert(!nf_store_has_plan(s));
	struct nf_store_plan *q = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_plan_read(s, &q, &d), -ENOENT);
	cr_assert(strstr(d.msg, "nflash plan"), "%s", d.msg);
	uint64_t g0 = nf_store_info(s)->generation;
	nf_store_close(s);

	struct nf_store_plan p;
	struct nf_store_plan_entry e[3];
	make_plan(&p, e, 3);
	int rc = nf_store_update_plan(t.path, NULL, &p, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	s = open_ok(t.path);
	cr_assert(nf_store_has_plan(s));
	cr_assert_eq(nf_store_info(s)->generation, g0 + 1);
	q = read_ok(s);
	same_plan(&p, q);
	/* the nearest budget at or below */
	cr_assert_null(nf_store_plan_pick(q, 1ull << 29));
	cr_assert_eq(nf_store_plan_pick(q, 1ull << 30)->budget, 1ull << 30);
	cr_assert_eq(nf_store_plan_pick(q, (5ull << 29))->budget, 2ull << 30);
	cr_assert_eq(nf_store_plan_pick(q, 64ull << 30)->budget, 3ull << 30);
	cr_assert_eq(nf_store_plan_pick(q, 0)->budget, 3ull << 30);
	nf_store_plan_free(q);
	nf_store_close(s);

	/* a profile written after keeps the plan, and the other way round */
	s = open_ok(t.path);
	struct nf_store_profile *pr = NULL;
	cr_assert_eq(nf_store_profile_alloc(s, &pr), 0);
	pr->tokens = 3;
	nf_store_close(s);
	rc = nf_store_update_profile(t.path, NULL, pr, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	nf_store_profile_free(pr);
	s = open_ok(t.path);
	cr_assert(nf_store_has_profile(s) && nf_store_has_plan(s));
	q = read_ok(s);
	same_plan(&p, q);
	nf_store_plan_free(q);
	nf_store_close(s);
	ts_dir_remove(&t);
}

Test(storage, plan_refused_before_writing_when_a_reader_would_refuse_it)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
	struct nf_store_plan p;
	struct nf_store_plan_entry e[2];
	for (int k = 0; k < 6; k++) {
		make_plan(&p, e, 2);
		const char *want = NULL;
		switch (k) {
		case 0: e[1].qd = 0; want = "qd"; break;
		case 1: e[1].budget = e[0].budget; want = "ascending"; break;
		case 2: e[0].tok_per_s = NAN; want = "prediction"; break;
		case 3: e[0].kv_type = 7; want = "kv_type"; break;
		case 4: e[0].io_wait_share = 1.5; want = "io_wait_share"; break;
		case 5: e[1].flags |= 16; want = "flags"; break;
		}
		struct nf_diag d = { 0 };
		int rc = nf_store_update_plan(t.path, NULL, &p, &d);
		cr_expect_eq(rc, NF_EPLAN, "case %d: %d", k, rc);
		cr_expect(strstr(d.msg, want) != NULL, "case %d: %s", k, d.msg);
	}
	struct nf_store *s = open_ok(t.path);
	cr_assert(!nf_store_has_plan(s), "a refused plan was written");
	nf_store_close(s);
	ts_dir_remove(&t);
}

Test(storage, plan_damaged_is_refused_but_the_store_opens)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
	struct nf_store_plan p;
	struct nf_store_plan_entry e[2];
	make_plan(&p, e, 2);
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_update_plan(t.path, NULL, &p, &d), 0, "%s", d.msg);
	struct nf_store *s = open_ok(t.path);
	uint64_t off = nf_store_info(s)->plan_offset;
	nf_store_close(s);
	/* one flipped byte in an entry's qd */
	uint8_t b;
	uint64_t at = off + sizeof(struct nf_store_plan_disk) + 2 * sizeof(struct nf_store_plan_point_disk) +
		      sizeof(struct nf_store_plan_rate_disk) + 8 + 16;
	ts_read(t.path, at, &b, 1);
	b ^= 0x40;
	ts_patch(t.path, at, &b, 1);
	s = open_ok(t.path);
	struct nf_store_plan *q = NULL;
	int rc = nf_store_plan_read(s, &q, &d);
	cr_expect_eq(rc, NF_ECHECKSUM, "%s", nf_diag_msg(&d, rc));
	cr_expect(strstr(d.msg, "plan") != NULL, "%s", d.msg);
	cr_expect_null(q);
	nf_store_close(s);
	/* `store verify` checks the plan section too, naming it */
	char out[8192];
	char *const argv[] = { "store", "verify", t.path, NULL };
	rc = ts_run_store_cmd(argv, out, sizeof(out));
	cr_expect_eq(rc, 1, "a damaged plan passes verify: %s", out);
	cr_expect(strstr(out, "bad: plan"), "%s", out);
	ts_patch(t.path, at, (uint8_t[]){ b ^ 0x40 }, 1);
	rc = ts_run_store_cmd(argv, out, sizeof(out));
	cr_expect_eq(rc, 0, "%s", out);
	cr_expect(strstr(out, "plan") && strstr(out, ": ok"), "verify does not mention the plan: %s", out);
	ts_dir_remove(&t);
}

/* ---- crash safety: a syscall table that fails the k-th write or fsync ---- */

static int fail_at, calls;

static ssize_t faulty_pwrite(int fd, const void *buf, size_t len, off_t off)
{
	if (++calls == fail_at) {
		if (len > 100)
			(void)pwrite(fd, buf, 100, off); /* a torn write, then the crash */
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

Test(storage, plan_update_interrupted_at_every_step)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct nf_io_sys sys = nf_io_sys_default;
	sys.pwrite = faulty_pwrite;
	sys.fsync = faulty_fsync;
	struct nf_store_open_opts so = { .sys = &sys };
	struct nf_store_plan old, p;
	struct nf_store_plan_entry eo[1], e[3];
	make_plan(&old, eo, 1);
	make_plan(&p, e, 3);
	p.created_ns = 888;
	/* the update makes 4 calls: write section, fsync, write superblock, fsync */
	for (int step = 1; step <= 4; step++) {
		cr_assert_eq(ts_make_store(t.path, NF_DTYPE_F16, 8, 4096, NULL), 0);
		struct nf_diag d = { 0 };
		cr_assert_eq(nf_store_update_plan(t.path, NULL, &old, &d), 0, "%s", d.msg);
		struct nf_store *s = open_ok(t.path);
		uint64_t g0 = nf_store_info(s)->generation;
		nf_store_close(s);
		calls = 0;
		fail_at = step;
		int rc = nf_store_update_plan(t.path, &so, &p, &d);
		cr_assert_eq(rc, -EIO, "step %d: %s", step, nf_diag_msg(&d, rc));
		/* the store opens with the old plan, or (only the last fsync
		 * failed) the whole new one */
		s = open_ok(t.path);
		struct nf_store_plan *q = read_ok(s);
		same_plan(step <= 3 ? &old : &p, q);
		cr_assert_eq(nf_store_info(s)->generation, step <= 3 ? g0 : g0 + 1);
		nf_store_plan_free(q);
		nf_store_close(s);
		fail_at = -1;
		cr_assert_eq(nf_store_update_plan(t.path, &so, &p, &d), 0, "%s", d.msg);
		s = open_ok(t.path);
		q = read_ok(s);
		same_plan(&p, q);
		nf_store_plan_free(q);
		nf_store_close(s);
		unlink(t.path);
	}
	ts_dir_remove(&t);
}
