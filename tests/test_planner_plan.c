/*
 * test_planner_plan.c - the offline planner (nflash/plan.h): the cost model
 * against a hand computation; `plan` on a real store measures, calibrates,
 * lays the store out and stores a plan per budget; the engine follows the
 * plan for its budget; a planned run gives the same bits as an unplanned run
 * with the same settings; a planned CLI run stays within its budget.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/engine.h"
#include "nflash/io.h"
#include "nflash/plan.h"
#include "nflash/store.h"
#include "util_pipeline.h"

Test(planner, cost_model_matches_a_hand_computation)
{
	struct nf_store_dev_point pt = { 4096, 32, 100.0, 10.0, 100.0 };
	struct nf_store_kernel_rate kr = { NF_DTYPE_Q4_0, 2, 10.0 };
	struct nf_store_plan dev = { .n_points = 1, .points = &pt, .n_rates = 1, .rates = &kr };
	double active[2] = { 100, 100 }, runs[2] = { 10, 10 }, bundles[2] = { 20, 20 };
	struct nf_plan_model m = {
		.n_layer = 2, .stride = 4096, .threads = 2, .ffn_dtype = NF_DTYPE_Q4_0, .dense_dtype = NF_DTYPE_Q4_0,
		.dense_bytes = 1e7, .compute_bytes_per_neuron = 1000, .active = active, .runs = runs, .bundles = bundles,
	};
	struct nf_store_plan_entry e = { 0 };
	nf_plan_predict(&dev, &m, 32, &e);
	/* dense 1e7 B at 10 GB/s = 1 ms; per layer: 20 bundles x 4096 B =
	 * 81920 B at 100 MB/s = 0.8192 ms + 0.1 ms latency; compute 100 x 1000
	 * B at 10 GB/s = 0.01 ms + 10 reads x 10 us CPU / 2 threads = 0.05 ms */
	double layer_r = 0.8192e-3 + 0.1e-3, layer_c = 0.01e-3 + 0.05e-3;
	double t = 1e-3 + 2 * layer_r;
	cr_expect_float_eq(e.t_token_s, t, 1e-12, "%.9f", e.t_token_s);
	cr_expect_float_eq(e.tok_per_s, 1 / t, 1e-6);
	cr_expect_float_eq(e.io_wait_share, 2 * (layer_r - layer_c) / t, 1e-9);
	cr_expect_float_eq(e.bytes_per_token, 2 * 81920.0, 1e-6);
	cr_expect_float_eq(e.reads_per_token, 20.0, 1e-9);
	cr_expect_float_eq(e.t_dense_s, 1e-3, 1e-12);
	/* FFN compute as --stats counts it: the layers' time less the I/O wait */
	cr_expect_float_eq(e.t_ffn_s, 2 * layer_c, 1e-12, "%.9f", e.t_ffn_s);

	/* compute-bound: with a fast device the layer takes its compute */
	pt.mb_s = 1e6;
	pt.lat_us = 0;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, 1e-3 + 2 * layer_c, 1e-9, "%.9f", e.t_token_s);
	cr_expect(e.io_wait_share < 0.01);
	/* the checksums of the bytes read are CPU beside the reads', on the
	 * thread where they complete: 81920 B at 1 GB/s add 81.92 us a layer */
	m.verify_s_per_byte = 1e-9;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, 1e-3 + 2 * (layer_c + 81.92e-6), 1e-9, "%.9f", e.t_token_s);
	m.verify_s_per_byte = 0;

	/* the engine's measured ceiling: 10 reads at 1000 a second take 10 ms
	 * a layer however fast the device (the latency is the idle one's) */
	m.engine_iops = 1000;
	pt.lat_us = 100;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, 1e-3 + 2 * (10e-3 + 0.1e-3), 1e-9, "%.9f", e.t_token_s);
	/* a ceiling above the device's pace changes nothing */
	m.engine_iops = 1e9;
	pt.mb_s = 100.0;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, t, 1e-12, "%.9f", e.t_token_s);
	/* the engine's fixed cost per layer adds to each layer, not to the wait */
	m.layer_overhead_s = 2e-3;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, t + 2 * 2e-3, 1e-12, "%.9f", e.t_token_s);
	cr_expect_float_eq(e.t_ffn_s, 2 * (layer_c + 2e-3), 1e-12, "%.9f", e.t_ffn_s);
	cr_expect_float_eq(e.io_wait_share, 2 * (layer_r - layer_c) / (t + 4e-3), 1e-9);
	/* no kernel outruns the memory read: at 5 GB/s the dense part takes 2 ms */
	m.layer_overhead_s = 0;
	dev.mem_read_gb_s = 5.0;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_dense_s, 2e-3, 1e-12, "%.9f", e.t_dense_s);
	/* a memory read above the kernel's rate changes nothing */
	dev.mem_read_gb_s = 50.0;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, t, 1e-12, "%.9f", e.t_token_s);

	/* streamed attention at a measured 1000 MB/s: 1e8 B take 0.1 s on
	 * the device that serves the FFN's reads too, beside the compute
	 * path (1 ms dense, the layers): the token is the device's time */
	m.attn_stream_bytes = 1e8;
	m.attn_mb_s = 1000.0;
	nf_plan_predict(&dev, &m, 32, &e);
	double t_dev = 0.1 + 2 * layer_r;
	cr_expect_float_eq(e.t_token_s, t_dev, 1e-12, "%.9f", e.t_token_s);
	cr_expect_float_eq(e.t_io_s, t_dev, 1e-12, "%.9f", e.t_io_s);
	cr_expect_float_eq(e.io_wait_share, (t_dev - (1e-3 + 2 * layer_c)) / t_dev, 1e-9);
	cr_expect_float_eq(e.bytes_per_token, 1e8 + 2 * 81920.0, 1e-6);
	/* a stream that keeps up hides behind the compute path */
	m.attn_mb_s = 1e9;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, t, 1e-9, "%.9f", e.t_token_s);
	/* unmeasured: the curve's 1 MiB reads at depth 8 (here its one point,
	 * 100 MB/s): 1 s */
	m.attn_mb_s = 0;
	nf_plan_predict(&dev, &m, 32, &e);
	cr_expect_float_eq(e.t_token_s, 1.0 + 2 * layer_r, 1e-9, "%.9f", e.t_token_s);
}

Test(planner, device_curve_interpolates_and_kernel_rate_picks_the_thread_count)
{
	struct nf_store_dev_point pts[2] = { { 4096, 32, 100.0, 5.0, 50.0 }, { 65536, 32, 1000.0, 7.0, 70.0 } };
	struct nf_store_kernel_rate kr[3] = { { NF_DTYPE_Q4_0, 1, 5.0 }, { NF_DTYPE_Q4_0, 2, 9.0 },
					      { NF_DTYPE_F32, 2, 20.0 } };
	struct nf_store_plan dev = { .n_points = 2, .points = pts, .n_rates = 3, .rates = kr };
	cr_expect_float_eq(nf_plan_device_mb_s(&dev, 4096, 32), 100.0, 1e-9);
	cr_expect_float_eq(nf_plan_device_mb_s(&dev, 65536, 32), 1000.0, 1e-9);
	double mid = nf_plan_device_mb_s(&dev, 16384, 32);
	cr_expect(mid > 100.0 && mid < 1000.0, "%f", mid);
	cr_expect_float_eq(nf_plan_kernel_gb_s(&dev, NF_DTYPE_Q4_0, 1), 5.0, 1e-12);
	cr_expect_float_eq(nf_plan_kernel_gb_s(&dev, NF_DTYPE_Q4_0, 2), 9.0, 1e-12);
	cr_expect_float_eq(nf_plan_kernel_gb_s(&dev, NF_DTYPE_Q4_0, 8), 9.0, 1e-12);
	/* a type not measured: the fastest rate there is */
	cr_expect_float_eq(nf_plan_kernel_gb_s(&dev, NF_DTYPE_Q8_0, 2), 20.0, 1e-12);
}

/* Read curves measured in passes minutes apart merge to the median of
 * each figure at each point, a point one pass lacks taken from the
 * others: one slow minute (pass b's 4 KiB) does not set the plan. */
Test(planner, device_passes_merge_to_the_median_per_point)
{
	struct nf_store_dev_point a[2] = { { 4096, 32, 100.0, 5.0, 50.0 }, { 65536, 32, 1000.0, 7.0, 70.0 } };
	struct nf_store_dev_point b[2] = { { 65536, 32, 1200.0, 9.0, 90.0 }, { 4096, 32, 10.0, 50.0, 500.0 } };
	struct nf_store_dev_point c[1] = { { 4096, 32, 130.0, 6.0, 40.0 } };
	struct nf_store_plan pa = { .n_points = 2, .points = a }, pb = { .n_points = 2, .points = b },
			     pc = { .n_points = 1, .points = c }, out = { 0 };
	const struct nf_store_plan *passes[3] = { &pa, &pb, &pc };
	cr_assert_eq(nf_plan_points_median(passes, 3, &out), 0);
	cr_assert_eq(out.n_points, 2);
	cr_expect_eq(out.points[0].req_bytes, 4096);
	cr_expect_float_eq(out.points[0].mb_s, 100.0, 1e-12);
	cr_expect_float_eq(out.points[0].cpu_us, 6.0, 1e-12);
	cr_expect_float_eq(out.points[0].lat_us, 50.0, 1e-12);
	/* two passes measured 64 KiB: the mean of the two */
	cr_expect_float_eq(out.points[1].mb_s, 1100.0, 1e-12);
	cr_expect_float_eq(out.points[1].cpu_us, 8.0, 1e-12);
	cr_expect_float_eq(nf_plan_device_mb_s(&out, 4096, 32), 100.0, 1e-9);
	free(out.points);
	struct nf_store_plan none = { 0 };
	const struct nf_store_plan *empty[1] = { &none };
	cr_expect_eq(nf_plan_points_median(empty, 1, &out), -EINVAL);
	double v[4] = { 3, 1, 2, 10 };
	cr_expect_float_eq(nf_plan_median(v, 3), 2.0, 1e-12);
	double w[4] = { 3, 1, 2, 10 };
	cr_expect_float_eq(nf_plan_median(w, 4), 2.5, 1e-12);
	cr_expect_float_eq(nf_plan_median(w, 0), 0.0, 1e-12);
}

static char gguf[256], store[256];

static void drop_model(void)
{
	unlink(gguf);
	unlink(store);
}

/* The read curve at given offsets (where a calibration read): offsets
 * that are not block-aligned, or that run past the data area, are
 * aligned down and kept inside it; unaligned O_DIRECT reads would fail
 * with -EINVAL at completion. */
/*
 * The read-gap search on scripted decodes (nf_plan_gap_search): gap k's
 * rounds take the milliseconds in row k, in order, its last one repeated
 * (a 0 past the first ends the row); a row starting 0 cannot run
 * (-EAGAIN), -1 fails (-EIO).
 */
struct script {
	double ms[6][4];
	int n[6];                   /* rounds taken per gap */
	double best[6];             /* seconds */
	int calls;
};

static int script_round(void *arg, size_t k, double *best)
{
	struct script *s = arg;
	cr_assert(k < 6);
	s->calls++;
	if (s->ms[k][0] == 0)
		return -EAGAIN;
	if (s->ms[k][0] < 0)
		return -EIO;
	int i = s->n[k] < 4 ? s->n[k] : 3;
	while (i > 0 && s->ms[k][i] == 0)
		i--;
	double t = s->ms[k][i] * 1e-3;
	s->n[k]++;
	s->best[k] = s->n[k] == 1 || t < s->best[k] ? t : s->best[k];
	*best = s->best[k];
	return 0;
}

static size_t search(struct script *s, size_t k0, double best0, int *rc, char *log, size_t len)
{
	static const uint32_t gaps[6] = { 0, 1, 2, 4, 8, 16 };
	size_t taken = 99;
	*rc = nf_plan_gap_search(gaps, 6, k0, best0, 0.03, script_round, s, &taken, log, len);
	cr_log_info("k0 %zu: rc %d, taken %zu: %s", k0, *rc, taken, log);
	return taken;
}

Test(planner, read_gap_search_walks_on_while_each_gap_wins)
{
	char log[512];
	int rc;
	/* faster up to gap 4, then slower: the walk takes gap 4, decoding 8
	 * once to find it slower; 16 is never decoded */
	struct script s = { .ms = { { 200 }, { 190 }, { 180 }, { 170 }, { 175 }, { 100 } } };
	cr_expect_eq(search(&s, 0, 0, &rc, log, sizeof(log)), 3);
	cr_expect_eq(rc, 0);
	cr_expect_str_eq(log, "gap 0 200.0 ms, gap 1 190.0 ms; again, the faster of two: gap 1 190.0 ms, gap 0 200.0 "
			      "ms; on to gap 2 180.0 ms, the faster of two 180.0 against gap 1 190.0; on to gap 4 "
			      "170.0 ms, the faster of two 170.0 against gap 2 180.0; on to gap 8 175.0 ms");
	cr_expect_eq(s.n[4], 1, "gap 8, not faster, decoded once");
	cr_expect_eq(s.n[5], 0);
	cr_expect_eq(s.n[3], 2, "gap 4: found and confirmed");
	/* no ": gap " in the walk: measure_gap's last, ": gap G kept / taken",
	 * is the decision (as tests read it) */
	cr_expect(!strstr(strstr(log, "; on to"), ": gap "), "%s", log);

	/* down from the widest, to the end of the list */
	struct script dn = { .ms = { { 50 }, { 60 }, { 70 }, { 80 }, { 90 }, { 100 } } };
	cr_expect_eq(search(&dn, 5, 0, &rc, log, sizeof(log)), 0);
	cr_expect_eq(rc, 0);

	/* a neighbour 3% faster on its first round, but the chosen gap's
	 * second round beats it: kept, nothing walked */
	struct script kept = { .ms = { { 100 }, { 95, 70 }, { 80, 90 }, { 50 }, { 50 }, { 50 } } };
	cr_expect_eq(search(&kept, 1, 0, &rc, log, sizeof(log)), 1);
	cr_expect_eq(rc, 0);
	cr_expect_eq(kept.n[3], 0, "no walk past a neighbour not taken");
	/* and within the margin of it: kept without decoding again */
	struct script near = { .ms = { { 100 }, { 100 }, { 98 }, { 50 }, { 50 }, { 50 } } };
	cr_expect_eq(search(&near, 1, 0, &rc, log, sizeof(log)), 1);
	cr_expect_eq(near.calls, 3);
	/* the chosen gap's round before the search counts as its first */
	struct script pre = { .ms = { { 100 }, { 100 }, { 100 }, { 100 }, { 100 }, { 100 } } };
	cr_expect_eq(search(&pre, 2, 0.100, &rc, log, sizeof(log)), 2);
	cr_expect_eq(pre.n[2], 0);
	cr_expect_eq(pre.calls, 2, "the two neighbours alone");

	/* the walk stops at a gap that cannot run, keeping the one before */
	struct script gone = { .ms = { { 200 }, { 150 }, { 0 }, { 50 }, { 50 }, { 50 } } };
	cr_expect_eq(search(&gone, 0, 0, &rc, log, sizeof(log)), 1);
	cr_expect_eq(rc, 0);
	cr_expect_eq(gone.n[3], 0, "no gap past one that cannot run");

	/* the chosen gap cannot run: nothing decided; an error ends it */
	struct script none = { .ms = { { 0 }, { 10 }, { 10 }, { 10 }, { 10 }, { 10 } } };
	search(&none, 0, 0, &rc, log, sizeof(log));
	cr_expect_eq(rc, 1);
	struct script bad = { .ms = { { 100 }, { -1 }, { 100 }, { 100 }, { 100 }, { 100 } } };
	search(&bad, 0, 0, &rc, log, sizeof(log));
	cr_expect_eq(rc, -EIO);
	/* a tiny log is truncated, never overrun; k0 out of range refused */
	char tiny[8];
	struct script t2 = { .ms = { { 200 }, { 190 }, { 180 }, { 170 }, { 175 }, { 100 } } };
	cr_expect_eq(search(&t2, 0, 0, &rc, tiny, sizeof(tiny)), 3);
	cr_expect_eq(strlen(tiny), 7);
	search(&t2, 6, 0, &rc, tiny, sizeof(tiny));
	cr_expect_eq(rc, -EINVAL);
}

Test(planner, device_reads_at_given_offsets_stay_aligned_and_inside, .fini = drop_model)
{
	pl_make_wide_model("plan-at", 64, gguf, store, sizeof(gguf));
	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	const struct nf_store_info *in = nf_store_info(s);
	uint64_t at[4] = { in->data_start + 4097, in->data_start + 12345, in->table_offset - 1, ~0ull >> 4 };
	struct nf_plan_device_opts o;
	nf_plan_device_opts_default(&o);
	o.seconds = 0.5;
	o.offsets = at;
	o.n_offsets = 4;
	struct nf_store_plan p = { 0 };
	int rc = nf_plan_measure_reads(s, &o, &p, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	cr_expect(p.n_points > 0);
	for (uint32_t i = 0; i < p.n_points; i++)
		cr_expect(p.points[i].mb_s > 0, "%u bytes at depth %u: no reads", p.points[i].req_bytes, p.points[i].qd);
	free(p.points);
	nf_store_close(s);
}

static int open_at(uint64_t budget, bool use_plan, const struct nf_store_plan_entry *as, struct nf_engine **e,
		   struct nf_diag *d)
{
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.path = store;
	o.budget = budget;
	o.n_threads = 2;
	o.use_plan = use_plan;
	/* this test process holds more than a fresh one: count a fresh one's */
	o.overhead = 24ull << 20;
	if (as) {
		/* the plan's settings, given by hand */
		o.n_ctx = as->n_ctx;
		o.kv_type = (int)as->kv_type;
		o.n_batch = as->n_batch;
		o.qd = as->qd;
		o.read_gap = (int)as->read_gap;
		o.cold_slots = (int)as->cold_slots;
		o.stream_attn = as->flags & NF_STORE_PLAN_F_STREAM_ATTN;
		o.attn_pin = as->attn_pin;
		o.gate_first = (as->flags & NF_STORE_PLAN_F_GATE_FIRST) != 0;
		if (as->flags & NF_STORE_PLAN_F_ROUTE_SET)
			o.route_prefetch = (as->flags & NF_STORE_PLAN_F_ROUTE_ON) != 0;
	}
	memset(d, 0, sizeof(*d));
	return nf_engine_open(&o, e, d);
}

/* e1 and e2 give the same logits and ids for ids[0..8) and 6 greedy
 * tokens; both are closed. */
static void expect_same_run(struct nf_engine *e1, struct nf_engine *e2, const int32_t *ids)
{
	int32_t g1[6], g2[6];
	uint32_t nv = nf_model_hparams(nf_engine_model(e1))->n_vocab;
	float *l1 = malloc(nv * sizeof(float)), *l2 = malloc(nv * sizeof(float));
	pl_run(nf_engine_ctx(e1), ids, 8, l1, g1, 6);
	pl_run(nf_engine_ctx(e2), ids, 8, l2, g2, 6);
	cr_expect(!memcmp(l1, l2, nv * sizeof(float)), "planned and unplanned logits differ");
	cr_expect(!memcmp(g1, g2, sizeof(g1)), "planned and unplanned ids differ");
	free(l1);
	free(l2);
	nf_engine_close(e1);
	nf_engine_close(e2);
}

/* Plan the test store for n budgets: 32 calibration tokens, a one-second
 * device curve. */
static struct nf_store_plan *plan_quickly(const uint64_t *budgets, uint32_t n)
{
	struct nf_plan_opts o;
	nf_plan_opts_default(&o);
	o.store = store;
	o.budgets = budgets;
	o.n_budgets = n;
	o.calib_tokens = 32;
	o.n_threads = 2;
	o.device.seconds = 1.0;
	struct nf_store_plan *p = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_plan_run(&o, &p, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	cr_assert_eq(p->n_entries, n);
	return p;
}

static struct nf_store_plan *plan_logged_n(const uint64_t *budgets, uint32_t n_budgets, uint64_t ov, char *text,
					   size_t cap);

/* Where the plan decoded its choices ("a decode token measured with plain
 * reads X ms, read-ahead Y ms, ... (means of 2): WINNER; WINNER, the
 * median of 3: Z ms"), the entry's speed is the winner's median decode:
 * *tok_s, and true. */
static bool choice_measured(const char *text, const struct nf_store_plan_entry *e, double *tok_s, double *tol)
{
	char head[96];
	/* (the shorter context's line begins alike: "... measured with -c 256, ...") */
	snprintf(head, sizeof(head), "%.1f MiB: a decode token measured with plain reads ",
		 (double)e->budget / 1048576.0);
	const char *at = strstr(text, head);
	if (!at)
		return false;
	const char *eol = strchr(at, '\n');
	char line[512];
	snprintf(line, sizeof(line), "%.*s", eol ? (int)(eol - at) : (int)strlen(at), at);
	const char *won = strstr(line, "): ");
	if (!won)
		return false;
	won += 3;
	/* the winner, named again before its median: "WINNER; WINNER, the
	 * median of N: T ms", N three (two where its third decode failed) */
	const char *semi = strstr(won, "; ");
	cr_assert(semi, "no median in: %s", line);
	size_t wl = (size_t)(semi - won);
	cr_assert(!strncmp(semi + 2, won, wl) && !strncmp(semi + 2 + wl, ", the median of ", 16), "%s", line);
	int n_rounds = 0;
	double ms = 0;
	if (sscanf(semi + 2 + wl + 16, "%d: %lf ms", &n_rounds, &ms) != 2 || ms <= 0)
		return false;
	cr_assert(n_rounds == 2 || n_rounds == 3, "%s", line);
	/* its mean of two is listed among the others ("read-ahead on, a
	 * layer of cold slots" as "read-ahead with a layer of cold slots") */
	const char *name = !strncmp(won, "plain reads", wl) && wl == 11 ? "plain reads "
			   : !strncmp(won, "read-ahead on", wl) && wl == 13 ? ", read-ahead "
			   : !strncmp(won, "gate-first", wl) && wl == 10 ? ", gate-first "
			   : "read-ahead with a layer of cold slots ";
	const char *t = strstr(line, name);
	double mean = 0;
	cr_assert(t && sscanf(t + strlen(name), "%lf ms", &mean) == 1 && mean > 0, "%s", line);
	*tok_s = 1e3 / ms;
	*tol += 0.05 / ms;
	return true;
}

/*
 * The prediction entry e ends with, from a gap's prediction *pred: a
 * later step's, where one ran for its budget (in the plan's order: the
 * streamed attention's rate, "predicted X tok/s, not Y"; then the decode
 * of the choices, which is final).
 */
static void later_prediction(const char *text, const struct nf_store_plan_entry *e, double *pred, double *tol)
{
	char head[96];
	snprintf(head, sizeof(head), "%.1f MiB: attention streamed ", (double)e->budget / 1048576.0);
	const char *at = strstr(text, head), *eol = at ? strchr(at, '\n') : NULL;
	const char *pp = at ? strstr(at, "): predicted ") : NULL;
	double v = 0;
	if (pp && (!eol || pp < eol) && sscanf(pp, "): predicted %lf tok/s", &v) == 1 && v > 0)
		*pred = v;
	choice_measured(text, e, pred, tol);
}

/*
 * Where a token reads, the plan decodes the read gap it chose against the
 * gaps beside it in its list and keeps the faster (docs/PLAN.md "The read
 * gap, measured"): the log names each gap with its time, the entry holds
 * the gap the log says was kept or taken, and a gap taken carries the
 * model's prediction for it.
 */
static void expect_gap_measured(const char *text, const struct nf_store_plan_entry *e)
{
	char head[64];
	snprintf(head, sizeof(head), "%.1f MiB: read gap ", (double)e->budget / 1048576.0);
	const char *at = strstr(text, head);
	cr_assert(at, "the gap was not measured at %s:\n%s", head, text);
	at = strstr(at, "and its neighbours, a decode token each: ");
	cr_assert(at);
	const char *eol = strchr(at, '\n');
	cr_assert(eol);
	char line[512];
	snprintf(line, sizeof(line), "%.*s", (int)(eol - at), at);
	cr_log_info("%s", line);
	/* the chosen gap and at least one neighbour, each with a time */
	unsigned g0 = 0, g1 = 0;
	double t0 = 0, t1 = 0;
	cr_assert(sscanf(line, "and its neighbours, a decode token each: gap %u %lf ms, gap %u %lf ms", &g0, &t0, &g1,
			 &t1) == 4,
		  "%s", line);
	cr_expect(t0 > 0 && t1 > 0 && g0 != g1, "%s", line);
	unsigned kept = 0;
	double pred = 0, before = 0;
	const char *k = strstr(line, ": gap ");
	while (k && strstr(k + 1, ": gap "))
		k = strstr(k + 1, ": gap ");
	cr_assert(k, "%s", line);
	if (strstr(k, "kept")) {
		cr_assert(sscanf(k, ": gap %u kept", &kept) == 1, "%s", line);
		cr_expect_eq(kept, g0, "%s", line);
	} else {
		cr_assert(sscanf(k, ": gap %u taken, predicted %lf tok/s, not %lf", &kept, &pred, &before) == 3, "%s",
			  line);
		cr_expect_neq(kept, g0, "%s", line);
		cr_expect(strstr(line, "again, the faster of two"), "a neighbour taken on one round: %s", line);
		double tol = 0.006;
		later_prediction(text, e, &pred, &tol);
		cr_expect(fabs(e->tok_per_s - pred) < tol * (pred > 1 ? pred : 1), "entry %.3f, log %.2f:\n%s",
			  e->tok_per_s, pred, text);
	}
	cr_expect_eq(e->read_gap, kept, "entry gap %u, log: %s", e->read_gap, line);
	cr_expect_float_eq(e->tok_per_s, 1.0 / e->t_token_s, 1e-9);
}

Test(planner, plan_a_store_then_follow_it_with_the_same_bits, .fini = drop_model)
{
	pl_make_wide_model("plan", 256, gguf, store, sizeof(gguf));
	/* budgets above what this process holds (more under ASan): the
	 * planner counts it as the fixed overhead */
	uint64_t base = nf_engine_overhead_now() >> 20 << 20;
	/* the third holds every neuron in the hot segment */
	uint64_t budgets[3] = { base + (72ull << 20), base + (136ull << 20), base + (1024ull << 20) };
	struct nf_diag d = { 0 };
	static char text[1 << 16];
	struct nf_store_plan *p = plan_logged_n(budgets, 3, 0, text, sizeof(text));
	cr_assert_eq(p->n_entries, 3);
	cr_expect(p->n_points > 0 && p->n_rates > 0 && p->mem_read_gb_s > 0);
	/* the calibration's layout lines are the plan's too
	 * (nf_engine_opts.profile_log), the calibration engine's own (its
	 * memory line) are not */
	cr_expect(strstr(text, "nflash: co-activation layout of ") && strstr(text, "nflash: profile of 32 tokens"), "%s",
		  text);
	cr_expect(!strstr(text, "nflash: memory: "), "%s", text);
	/* the layout cut again at the three chosen hot sets (docs/PLAN.md step 4) */
	cr_expect(strstr(text, "its layout cut at the 3 chosen hot sets") ||
			  strstr(text, "the layout cut at the 3 chosen hot sets is the store's already"),
		  "%s", text);
	/* the first budget's tokens read: its gap was decoded */
	cr_assert(p->entries[0].reads_per_token >= 4, "%.1f reads a token:\n%s", p->entries[0].reads_per_token, text);
	expect_gap_measured(text, &p->entries[0]);
	/* leave one out: with every neuron the calibration saw hot, a new
	 * token still brings neurons it never saw (the replay of a token
	 * against the hot set chosen without it); without it the replay
	 * predicted no read at all */
	cr_expect(p->entries[2].reads_per_token > 0, "%.3g reads a token predicted with every seen neuron hot",
		  p->entries[2].reads_per_token);
	for (uint32_t i = 0; i < 3; i++) {
		const struct nf_store_plan_entry *e = &p->entries[i];
		cr_expect_eq(e->budget, budgets[i]);
		cr_expect(e->tok_per_s > 0 && e->bytes_per_token >= 0 && e->io_wait_share <= 1,
			  "budget %u: %.3g tok/s, %.3g bytes per token, I/O wait %.3g, cold %u, hot %u", i,
			  e->tok_per_s, e->bytes_per_token, e->io_wait_share, e->cold_slots, e->hot_slots);
		cr_expect_eq(e->kv_type, NF_KV_F16);
	}
	/* the store: laid out in the profile's order, its bundles packed at
	 * the device's O_DIRECT alignment (import wrote 4096), the plan in it */
	struct nf_store *s;
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	cr_expect(nf_store_has_profile(s) && nf_store_has_plan(s));
	struct nf_io_ctx *io = NULL;
	cr_assert_eq(nf_io_ctx_open(s, NULL, &io, &d), 0, "%s", d.msg);
	uint32_t al = nf_io_ctx_align(io) > 512 ? nf_io_ctx_align(io) : 512;
	nf_io_ctx_close(io);
	cr_expect_eq(nf_store_info(s)->block_size, al, "block size %u, the device's alignment %u",
		     nf_store_info(s)->block_size, al);
	struct nf_store_profile *pr = NULL;
	cr_assert_eq(nf_store_profile_read(s, &pr, &d), 0, "%s", d.msg);
	cr_assert_not_null(pr->order);
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_FFN)
			continue;
		for (uint32_t r = 0; r < ob->n_bundles; r++)
			cr_assert_eq(ob->perm[pr->order[i][r]], r, "object %u slot %u: not relayouted", i, r);
	}
	nf_store_profile_free(pr);
	nf_store_close(s);
	char orig[300];
	snprintf(orig, sizeof(orig), "%s.orig", store);
	cr_expect(access(orig, F_OK) != 0, "a copy was left behind without --keep-copy");

	/* the engine follows the nearest plan at or below its budget */
	struct nf_engine *e1, *e2;
	cr_assert_eq(open_at(budgets[1] + (40ull << 20), true, NULL, &e1, &d), 0, "%s", d.msg);
	struct nf_engine_info info;
	nf_engine_info(e1, &info);
	cr_expect_eq(info.plan_budget, budgets[1]);
	cr_expect_eq(info.qd, p->entries[1].qd);
	cr_expect_eq(info.read_gap, p->entries[1].read_gap);
	cr_expect_eq(info.n_ctx, p->entries[1].n_ctx);
	/* its prediction, for generate's check of the decode against it */
	cr_expect(info.plan_tok_per_s == p->entries[1].tok_per_s && !info.plan_overridden,
		  "%.3g tok/s predicted, overridden %d", info.plan_tok_per_s, info.plan_overridden);
	{
		/* a flag that moves a planned setting marks the plan overridden */
		struct nf_store_plan_entry as = p->entries[1];
		as.read_gap += 1;
		struct nf_engine *e3;
		cr_assert_eq(open_at(budgets[1] + (40ull << 20), true, &as, &e3, &d), 0, "%s", d.msg);
		struct nf_engine_info info3;
		nf_engine_info(e3, &info3);
		cr_expect(info3.plan_overridden && info3.plan_tok_per_s > 0);
		nf_engine_close(e3);
	}
	/* and gives the bits an unplanned run with the same settings gives */
	cr_assert_eq(open_at(budgets[1] + (40ull << 20), false, &p->entries[1], &e2, &d), 0, "%s", d.msg);
	struct nf_engine_info info2;
	nf_engine_info(e2, &info2);
	cr_expect_eq(info2.plan_budget, 0);
	cr_expect(info2.plan_tok_per_s == 0);
	static const int32_t ids[8] = { 1, 278, 263, 13, 300, 72, 101, 259 };
	expect_same_run(e1, e2, ids);

	/* below every plan: the engine decides at start and says so */
	cr_assert_eq(open_at(budgets[0] - (8ull << 20), true, NULL, &e1, &d), 0, "%s", d.msg);
	nf_engine_info(e1, &info);
	cr_expect_eq(info.plan_budget, 0);
	cr_expect(strstr(info.plan_note, "above") != NULL, "%s", info.plan_note);
	nf_engine_close(e1);
	/* a front end that keeps part of the budget for itself (the
	 * server's slots) follows the plan of the whole budget: plan_for */
	{
		struct nf_engine_opts so;
		nf_engine_opts_default(&so);
		so.path = store;
		so.budget = budgets[0] - (8ull << 20);
		so.plan_for = budgets[0];
		so.n_threads = 2;
		so.overhead = 24ull << 20;
		memset(&d, 0, sizeof(d));
		cr_assert_eq(nf_engine_open(&so, &e1, &d), 0, "%s", d.msg);
		nf_engine_info(e1, &info);
		cr_expect_eq(info.plan_budget, budgets[0]);
		cr_expect_eq(info.n_ctx, p->entries[0].n_ctx);
		cr_expect_eq(info.read_gap, p->entries[0].read_gap);
		cr_expect(info.budget == so.budget);
		nf_engine_close(e1);
	}
	nf_store_plan_free(p);

	/* a planned CLI run with the budget alone stays within it */
	if (access(PL_NFLASH, X_OK) != 0)
		return;
	static char out[1 << 16], err[1 << 16];
	char args[1024];
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13,300,72,101,259 --memory-budget %llu --json", store,
		 (unsigned long long)budgets[0]);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 0, "%s", err);
	char want[64];
	snprintf(want, sizeof(want), "plan for %.1f MiB", (double)budgets[0] / 1048576.0);
	cr_expect(strstr(err, want) != NULL, "%s", err);
	unsigned long long hwm = pl_json_u64(out, "vm_hwm_bytes");
	cr_expect(hwm <= budgets[0], "VmHWM %llu above the %llu-byte budget", hwm, (unsigned long long)budgets[0]);
}


/* The engine's fit with options o, sized only: 1 when attention streams,
 * 0 when pinned, < 0 when refused. */
static int streams_with(struct nf_engine_opts *o)
{
	o->path = store;
	o->n_threads = 2;
	o->use_plan = false;
	o->size_only = true;
	struct nf_engine *e = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(o, &e, &d);
	if (rc < 0)
		return rc;
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	nf_engine_close(e);
	return info.attn_streamed;
}

/* The engine's own fit at budget b with n_ctx (0: its rule); lean: the
 * smallest prompt batch and cold segment the planner tries. */
static int streams_at(uint64_t b, uint32_t n_ctx, bool lean, uint64_t overhead)
{
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.budget = b;
	o.n_ctx = n_ctx;
	if (lean) {
		o.n_batch = 16;
		o.cold_slots = 128;
	}
	o.overhead = overhead;
	return streams_with(&o);
}

/* nf_plan_run of store for one budget, quickly, with overhead ov (a
 * window's, whatever this process holds by then); its log in text. */
static struct nf_store_plan *plan_logged_n(const uint64_t *budgets, uint32_t n_budgets, uint64_t ov, char *text,
					   size_t cap)
{
	char logp[300];
	pl_tmp_path(logp, sizeof(logp), "plan-log");
	FILE *log = fopen(logp, "w+");
	cr_assert_not_null(log);
	struct nf_plan_opts o;
	nf_plan_opts_default(&o);
	o.store = store;
	o.budgets = budgets;
	o.n_budgets = n_budgets;
	o.calib_tokens = 32;
	o.n_threads = 2;
	o.device.seconds = 1.0;
	o.overhead = ov;
	o.log = log;
	struct nf_store_plan *p = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_plan_run(&o, &p, &d);
	rewind(log);
	size_t n = fread(text, 1, cap - 1, log);
	text[n] = 0;
	fclose(log);
	unlink(logp);
	cr_assert_eq(rc, 0, "%s\n%s", nf_diag_msg(&d, rc), text);
	return p;
}

static struct nf_store_plan *plan_logged(uint64_t budget, uint64_t ov, char *text, size_t cap)
{
	return plan_logged_n(&budget, 1, ov, text, cap);
}

/*
 * Where the engine's context fit leaves attention streamed and a context
 * of 128 tokens would pin it, the plan decodes both in turn and keeps the
 * faster (docs/PLAN.md "Measured choices"); either way the engine follows
 * the entry with the bits of an unplanned run given its settings.
 */
Test(planner, streamed_attention_is_weighed_against_a_shorter_context, .fini = drop_model)
{
	pl_make_wide_model("plan-ctx", 4096, gguf, store, sizeof(gguf));
	/* a budget in the window: streamed at the engine's context however
	 * lean the other settings, pinned at 128 tokens */
	uint64_t ov = nf_engine_overhead_now(), lo = 0, hi = 0;
	for (uint64_t b = ov + (8ull << 20); b < ov + (256ull << 20); b += 1ull << 20) {
		bool in = streams_at(b, 0, true, ov) == 1 && streams_at(b, 128, true, ov) == 0;
		if (in && !lo)
			lo = b;
		if (in)
			hi = b;
		else if (lo)
			break;
	}
	cr_assert(lo, "no budget streams attention at the engine's context and pins it at 128 tokens");
	uint64_t budget = (lo + hi) / 2 >> 20 << 20;
	budget = budget < lo ? lo : budget;

	static char text[1 << 16];
	struct nf_store_plan *p = plan_logged(budget, ov, text, sizeof(text));
	struct nf_diag d = { 0 };
	cr_expect(strstr(text, "attention streamed") && strstr(text, "with -c 128, attention pinned"),
		  "budget %llu: the shorter context was not measured:\n%s", (unsigned long long)budget, text);
	const struct nf_store_plan_entry *e = &p->entries[0];
	bool pinned = !(e->flags & NF_STORE_PLAN_F_STREAM_ATTN);
	cr_expect(pinned ? e->n_ctx == 128 : e->n_ctx > 128, "-c %u, attention %s", e->n_ctx,
		  pinned ? "pinned" : "streamed");

	struct nf_engine *e1, *e2;
	cr_assert_eq(open_at(budget, true, NULL, &e1, &d), 0, "%s", d.msg);
	struct nf_engine_info info;
	nf_engine_info(e1, &info);
	cr_expect_eq(info.plan_budget, budget);
	cr_expect_eq(info.n_ctx, e->n_ctx);
	cr_expect_eq(info.attn_streamed, !pinned);
	cr_assert_eq(open_at(budget, false, e, &e2, &d), 0, "%s", d.msg);
	static const int32_t ids[8] = { 1, 278, 263, 13, 300, 72, 101, 259 };
	expect_same_run(e1, e2, ids);
	nf_store_plan_free(p);
}

/* The plan's calibration engine at budget b (32 calibration tokens, as
 * plan_logged_n runs them). */
static int calib_streams_at(uint64_t b, uint64_t overhead)
{
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.budget = b;
	o.n_ctx = 33;
	o.profile = true;
	o.profile_sig_tokens = 32;
	o.overhead = overhead;
	return streams_with(&o);
}

/*
 * Where every context streams attention, the plan decodes its choice and
 * prices the stream at the rate that decode reached beside the FFN's reads
 * (docs/PLAN.md "Measured choices"): the log says so, and the entry holds
 * the prediction made at that rate, not the device curve's. The
 * calibration, which would stream it too, runs with it pinned.
 */
Test(planner, streamed_attention_is_priced_from_a_decode, .fini = drop_model)
{
	/* a 128-token model: no shorter context to weigh; attention
	 * streams in a window below the budget that pins it */
	pl_make_wide_model("plan-stream", 128, gguf, store, sizeof(gguf));
	uint64_t ov = nf_engine_overhead_now(), lo = 0, hi = 0;
	uint64_t b = ov + (8ull << 20);
	while (b < ov + (256ull << 20) && streams_at(b, 0, true, ov) < 0)
		b += 1ull << 20;
	/* the leanest settings the planner tries stream from the smallest
	 * budget that opens up to a window's end (about 1.5 MiB here) */
	for (b = b - (1ull << 20); b < ov + (256ull << 20); b += 64ull << 10) {
		int st = streams_at(b, 0, true, ov);
		if (st == 1 && !lo)
			lo = b;
		if (st == 1)
			hi = b;
		else if (lo)
			break;
	}
	cr_assert(lo, "no budget streams attention");
	/* of the window, the largest budget under which the plan's
	 * calibration engine would stream attention too (every calibration
	 * token reading all of it): the calibration then runs under a larger
	 * budget that pins it, and the log says so (docs/PLAN.md, step 1) */
	uint64_t budget = 0;
	for (b = hi; b >= lo && !budget; b -= 64ull << 10)
		if (calib_streams_at(b >> 16 << 16, ov) == 1 && b >> 16 << 16 >= lo)
			budget = b >> 16 << 16;
	cr_assert(budget, "no budget in [%llu, %llu] streams the calibration's attention", (unsigned long long)lo,
		  (unsigned long long)hi);

	static char text[1 << 16];
	struct nf_store_plan *p = plan_logged(budget, ov, text, sizeof(text));
	const char *cl = strstr(text, "calibration under ");
	double cal = 0, big = 0;
	cr_assert(cl && sscanf(cl, "calibration under %lf MiB, not the largest budget's %lf MiB: attention pinned", &cal,
			       &big) == 2,
		  "budget %llu: the calibration was not given a budget that pins attention:\n%s",
		  (unsigned long long)budget, text);
	cr_expect(fabs(big - budget / 1048576.0) < 0.05 && cal > big, "%.1f, %.1f MiB", cal, big);
	cr_expect_eq(calib_streams_at((uint64_t)(cal * 1048576.0 + 0.5), ov), 0, "%.1f MiB streams", cal);
	const struct nf_store_plan_entry *e = &p->entries[0];
	cr_assert(e->flags & NF_STORE_PLAN_F_STREAM_ATTN, "attention pinned at %llu:\n%s",
		  (unsigned long long)budget, text);
	const char *at = strstr(text, "beside the FFN's reads");
	cr_assert(at, "the stream was not measured:\n%s", text);
	double mbs = 0, pred = 0, before = 0;
	const char *line = at;
	while (line > text && line[-1] != '\n')
		line--;
	cr_assert(sscanf(strstr(line, "a token at "), "a token at %lf MB/s", &mbs) == 1, "%s", line);
	const char *pp = strstr(at, "predicted ");
	cr_assert(pp && sscanf(pp, "predicted %lf tok/s, not %lf", &pred, &before) == 2, "%s", at);
	cr_expect(mbs > 0, "%s", line);
	/* the entry is the second prediction, as logged (or the decode
	 * measured with the choice the plan then made) */
	double tol = 0.006;
	choice_measured(text, e, &pred, &tol);
	cr_expect(fabs(e->tok_per_s - pred) < tol * (pred > 1 ? pred : 1), "entry %.3f, log %.2f", e->tok_per_s,
		  pred);
	cr_expect_float_eq(e->tok_per_s, 1.0 / e->t_token_s, 1e-9);
	nf_store_plan_free(p);
}

/*
 * A mixture of experts in exact mode from a store with gate rows: the plan
 * measures route-ahead prefetch and gate-first reads at each budget and
 * records what won (docs/PLAN.md "Measured choices"); the engine follows
 * it, with the bits of an unplanned run given the same settings.
 */
Test(planner, moe_plan_measures_route_ahead_and_gate_first, .fini = drop_model)
{
	pl_tmp_path(gguf, sizeof(gguf), "plan-moe-gguf");
	cr_assert_eq(pl_synth_tiny_moe(gguf, "relu", NF_DTYPE_Q8_0, false, 4), 0);
	pl_import_with(gguf, store, sizeof(store), true);
	uint64_t budgets[1] = { (nf_engine_overhead_now() >> 20 << 20) + (64ull << 20) };
	struct nf_diag d = { 0 };
	struct nf_store_plan *p = plan_quickly(budgets, 1);
	const struct nf_store_plan_entry *pe = &p->entries[0];
	uint32_t fl = pe->flags;
	/* decided by measurement: gate-first, or route-ahead on or off */
	cr_expect((fl & NF_STORE_PLAN_F_GATE_FIRST) || (fl & NF_STORE_PLAN_F_ROUTE_SET), "flags %u", fl);
	cr_expect(!((fl & NF_STORE_PLAN_F_GATE_FIRST) && (fl & NF_STORE_PLAN_F_ROUTE_ON)), "flags %u", fl);
	cr_expect(pe->tok_per_s > 0 && pe->t_token_s > 0);
	/* the flags survive the store: read back */
	struct nf_store *s;
	cr_assert_eq(nf_store_open(store, NULL, &s, &d), 0, "%s", d.msg);
	struct nf_store_plan *back = NULL;
	cr_assert_eq(nf_store_plan_read(s, &back, &d), 0, "%s", d.msg);
	cr_expect_eq(back->entries[0].flags, fl);
	nf_store_plan_free(back);
	nf_store_close(s);
	/* the engine follows the plan */
	struct nf_engine *e1, *e2;
	cr_assert_eq(open_at(budgets[0], true, NULL, &e1, &d), 0, "%s", d.msg);
	const struct nf_engine_opts *eo = nf_engine_opts(e1);
	cr_expect_eq(eo->gate_first, (fl & NF_STORE_PLAN_F_GATE_FIRST) ? 1 : 0);
	if (fl & NF_STORE_PLAN_F_ROUTE_SET)
		cr_expect_eq(eo->route_prefetch, (fl & NF_STORE_PLAN_F_ROUTE_ON) ? 1 : 0);
	cr_assert_eq(open_at(budgets[0], false, pe, &e2, &d), 0, "%s", d.msg);
	static const int32_t ids[8] = { 1, 7, 13, 29, 31, 42, 5, 9 };
	expect_same_run(e1, e2, ids);
	nf_store_plan_free(p);
}

/*
 * The command line: `nflash plan --json` gives the plans and, at top level,
 * the first budget's predictions; `--explain` says where each budget's
 * token time goes; a bad flag or budget is a usage error (exit 2) naming
 * it; a budget below the minimum is reported and, alone, fails (exit 1).
 */
Test(planner, cli_json_explain_and_errors, .fini = drop_model)
{
	if (access(PL_NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built", PL_NFLASH);
	pl_make_wide_model("plan-cli", 256, gguf, store, sizeof(gguf));
	static char out[1 << 16], err[1 << 16];
	char args[1024];
	/* the child's own overhead is below this process's */
	unsigned long long mib = (nf_engine_overhead_now() >> 20) + 136;
	snprintf(args, sizeof(args), "plan %s --memory-budget %lluM --calib-tokens 32 -t 2 --device-seconds 1 --json",
		 store, mib);
	int rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "exit %d: %s", rc, err);
	cr_expect_eq(pl_json_u64(out, "budget_bytes"), mib << 20);
	cr_expect(strstr(out, "\"predicted_tok_per_s\":") && strstr(out, "\"predicted_io_wait_share\":") &&
		  strstr(out, "\"predicted_bytes_per_token\":") && strstr(out, "\"plans\":["), "%s", out);
	/* stderr is a pipe here: no bars, a line as each step starts, each
	 * step named once and before its result line */
	const char *cal = strstr(err, "nflash: plan: calibrating ...\n");
	cr_expect(cal && !strstr(cal + 1, "nflash: plan: calibrating ...") && cal < strstr(err, "calibration tokens in"),
		  "%s", err);
	cr_expect(strstr(err, "nflash: plan: measuring the device ...\n") &&
			  strstr(err, "nflash: plan: laying out the store ...\n") && !strchr(err, '\r'),
		  "%s", err);

	/* a second plan for another budget keeps the first; --explain */
	snprintf(args, sizeof(args), "plan %s --memory-budget %lluM --calib-tokens 32 -t 2 --no-relayout --explain",
		 store, mib + 64);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "exit %d: %s", rc, err);
	char want[64];
	snprintf(want, sizeof(want), "%.1f MiB: -c", (double)mib);
	cr_expect(strstr(out, want), "the earlier plan is gone: %s", out);
	snprintf(want, sizeof(want), "%.1f MiB: token", (double)(mib + 64));
	cr_expect(strstr(out, "where the predicted time goes") && strstr(out, want), "%s", out);

	/* errors name what is wrong */
	snprintf(args, sizeof(args), "plan %s --memory-budget 12Q", store);
	cr_expect_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 2, "%s", err);
	cr_expect(strstr(err, "--memory-budget"), "%s", err);
	snprintf(args, sizeof(args), "plan %s --memory-budget 1G --no-such-flag", store);
	cr_expect_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 2, "%s", err);
	cr_expect(strstr(err, "--no-such-flag"), "%s", err);
	snprintf(args, sizeof(args), "plan %s", store);
	cr_expect_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 2, "%s", err);
	cr_expect(strstr(err, "--memory-budget"), "%s", err);
	snprintf(args, sizeof(args), "plan %s-missing --memory-budget 1G", store);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_expect(rc == 1 || rc == 2, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "-missing"), "the file is not named: %s", err);
	snprintf(args, sizeof(args), "plan %s --memory-budget 4M --calib-tokens 32 -t 2 --no-relayout", store);
	cr_expect_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 1, "%s", err);
	cr_expect(strstr(err, "at least") || strstr(err, "minimum"), "no minimum stated: %s", err);
}
