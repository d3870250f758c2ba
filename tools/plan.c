/*
 * plan.c - `nflash plan STORE --memory-budget SIZE`: measure the device and
 * the model, lay the store out, choose every setting for the budget and
 * predict what it does (nflash/plan.h, docs/PLAN.md); and the plan summary
 * `store inspect` prints.
 *
 * Invariants: every error names the file or the flag; the store stays valid
 * whatever happens (the planner writes crash-safely); --json writes one
 * object on stdout and nothing else there.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/dtype.h"
#include "nflash/plan.h"
#include "nflash/store.h"
#include "cli.h"
#include "plan_cli.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: nflash plan STORE --memory-budget SIZE[,SIZE...] [options]\n"
		"\n"
		"Plans STORE for each memory budget: runs calibration text, then the model's\n"
		"own continuation of it, to record which neurons fire together, lays the\n"
		"store out in that order (in place, crash-safely), measures the device that\n"
		"holds it, the kernels and the engine's own read pace, then chooses the\n"
		"settings that minimise the predicted token time, measures what the model\n"
		"does not weigh (where attention would stream, a 128-token context with it\n"
		"pinned; the read gap chosen against the gaps beside it; reading the next\n"
		"layer's guessed neurons or experts ahead; exact mode's gate-first reads:\n"
		"each decoded in turn; streamed attention's read rate beside the FFN's\n"
		"reads, from a decode) and stores the plan. After it,\n"
		"`nflash generate -m STORE --memory-budget SIZE` needs no other flag.\n"
		"\n"
		"options:\n"
		"  --memory-budget LIST  budgets to plan for (K/M/G suffixes, comma-separated);\n"
		"                        required. Plans for other budgets already in the store\n"
		"                        are kept\n"
		"  --calibration FILE    calibration text (default: a built-in mix of prose)\n"
		"  --calib-tokens N      calibration tokens (default 512)\n"
		"  --calib-generate N    of them, N the model writes itself after the text, sampled\n"
		"                        (temperature 0.8, seed 7), as decode reads for the tokens\n"
		"                        it writes (default: 7/8, after 1/8 of text; 0: the\n"
		"                        text only)\n"
		"  --no-relayout         keep the store's layout (the plan predicts for it)\n"
		"  --keep-copy           keep the store as it was beside it, as STORE.orig\n"
		"  --bundle-align B      the relayout's bundle alignment (default: the\n"
		"                        device's O_DIRECT alignment, at least 512)\n"
		"  --remeasure           measure the device again (default: reuse the store's)\n"
		"  --device-seconds S    time for the device's read curve, over its three\n"
		"                        passes (default 12)\n"
		"  --io aio|uring|sync   I/O backend for the measurements (default auto)\n"
		"  -t, --threads N       compute threads (default: all CPUs)\n"
		"  --explain             per budget: where the predicted token time goes\n"
		"  --json                one JSON object on stdout: the plans, and for the first\n"
		"                        budget the chosen settings and predicted_tok_per_s,\n"
		"                        predicted_io_wait_share, predicted_bytes_per_token\n"
		"  -h, --help            this help\n");
}

/* One bar per step: a new label (or done 0) starts one, done == total ends it. */
struct plan_bar {
	struct nf_progress p;
	const char *label;
	const char *said; /* the last step named on a line (no terminal) */
	bool open;
};

static void progress_fn(void *arg, const char *label, uint64_t done, uint64_t total)
{
	struct plan_bar *b = arg;
	if (!b->open || done == 0 || b->label != label || strcmp(b->label, label)) {
		if (b->open)
			nf_progress_end(&b->p);
		nf_progress_start(&b->p, label, total, !strcmp(label, "laying out the store"));
		/* no bar (stderr not a terminal, or NFLASH_NO_PROGRESS): a line
		 * as each kind of step starts, so that a log shows where the
		 * plan is during the minutes between its result lines */
		if (!b->p.tty && (!b->said || strcmp(b->said, label)))
			fprintf(stderr, "nflash: plan: %s ...\n", label);
		b->said = label;
		b->label = label;
		b->open = true;
	}
	nf_progress_update(&b->p, done);
	if (done >= total) {
		nf_progress_end(&b->p);
		b->open = false;
	}
}

static double mib(uint64_t b)
{
	return (double)b / 1048576.0;
}

static void entry_json(struct nf_json *j, const struct nf_store_plan_entry *e, bool top)
{
	nf_json_u64(j, "budget_bytes", e->budget);
	nf_json_u64(j, "n_ctx", e->n_ctx);
	nf_json_str(j, "kv_type", e->kv_type ? "f16" : "f32");
	nf_json_u64(j, "n_batch", e->n_batch);
	nf_json_u64(j, "threads", e->n_threads);
	nf_json_u64(j, "qd", e->qd);
	nf_json_u64(j, "read_gap", e->read_gap);
	nf_json_u64(j, "cold_slots", e->cold_slots);
	nf_json_u64(j, "hot_slots", e->hot_slots);
	nf_json_str(j, "attention", e->flags & NF_STORE_PLAN_F_STREAM_ATTN ? "streamed" : "pinned");
	nf_json_u64(j, "attn_pin_layers", e->attn_pin);
	nf_json_bool(j, "gate_first", e->flags & NF_STORE_PLAN_F_GATE_FIRST);
	nf_json_str(j, "route_ahead", !(e->flags & NF_STORE_PLAN_F_ROUTE_SET) ? "default"
				      : e->flags & NF_STORE_PLAN_F_ROUTE_ON ? "on"
									: "off");
	const char *p = top ? "predicted_" : "";
	char k[64];
	snprintf(k, sizeof(k), "%stok_per_s", p);
	nf_json_dbl(j, k, e->tok_per_s);
	snprintf(k, sizeof(k), "%sio_wait_share", p);
	nf_json_dbl(j, k, e->io_wait_share);
	snprintf(k, sizeof(k), "%sbytes_per_token", p);
	nf_json_dbl(j, k, e->bytes_per_token);
	snprintf(k, sizeof(k), "%sreads_per_token", p);
	nf_json_dbl(j, k, e->reads_per_token);
	nf_json_obj_begin(j, "predicted_seconds_per_token");
	nf_json_dbl(j, "dense", e->t_dense_s);
	nf_json_dbl(j, "ffn_compute", e->t_ffn_s);
	nf_json_dbl(j, "io", e->t_io_s);
	nf_json_dbl(j, "total", e->t_token_s);
	nf_json_obj_end(j);
}

/* The measured choices of an entry (docs/PLAN.md "Measured choices"). */
static const char *measured(const struct nf_store_plan_entry *e)
{
	if (e->flags & NF_STORE_PLAN_F_GATE_FIRST)
		return ", gate-first (measured)";
	if (e->flags & NF_STORE_PLAN_F_ROUTE_SET)
		return e->flags & NF_STORE_PLAN_F_ROUTE_ON ? ", read-ahead on (measured)" : ", read-ahead off (measured)";
	return "";
}

static void entry_line(FILE *f, const struct nf_store_plan_entry *e)
{
	fprintf(f,
		"  %8.1f MiB: -c %u, -b %u, KV %s, attention %s, qd %u, read gap %u, cold %s, hot %u bundles%s -> "
		"predicted %.2f tok/s, I/O wait %.2f, %.1f MiB and %.0f reads per token\n",
		mib(e->budget), e->n_ctx, e->n_batch, e->kv_type ? "f16" : "f32",
		e->flags & NF_STORE_PLAN_F_STREAM_ATTN ? "streamed" : "pinned", e->qd, e->read_gap,
		e->cold_slots ? "part of a layer" : "one layer", e->hot_slots, measured(e), e->tok_per_s,
		e->io_wait_share, e->bytes_per_token / 1048576.0, e->reads_per_token);
}

static void explain(FILE *f, const struct nf_store_plan_entry *e)
{
	double t = e->t_token_s > 0 ? e->t_token_s : 1;
	double ffn_side = t - e->t_dense_s;
	if (e->flags & NF_STORE_PLAN_F_STREAM_ATTN)
		fprintf(f,
			"  %8.1f MiB: token %.1f ms = the longer of the compute path (dense compute %.1f ms, FFN "
			"compute %.1f ms and the FFN's waits) and the device's time for streamed attention and the "
			"FFN's reads together (%.1f ms, the stream at the rate a decode of these settings measured: "
			"the plan's log); I/O wait %.1f ms (%.0f%%)\n",
			mib(e->budget), 1e3 * t, 1e3 * e->t_dense_s, 1e3 * e->t_ffn_s, 1e3 * e->t_io_s,
			1e3 * e->io_wait_share * t, 100 * e->io_wait_share);
	else
		fprintf(f,
			"  %8.1f MiB: token %.1f ms = dense compute %.1f ms (attention, output, predictors; %.0f%%) + "
			"FFN layers %.1f ms (%.0f%%): compute %.1f ms and reads %.1f ms overlapped per layer, the "
			"reads exceeding compute by %.1f ms in all (the I/O wait, %.0f%%)\n",
			mib(e->budget), 1e3 * t, 1e3 * e->t_dense_s, 100 * e->t_dense_s / t, 1e3 * ffn_side,
			100 * ffn_side / t, 1e3 * e->t_ffn_s, 1e3 * e->t_io_s, 1e3 * e->io_wait_share * t,
			100 * e->io_wait_share);
	if (*measured(e))
		fprintf(f,
			"  %8.1f MiB: the token time is what a decode of these settings measured (%s); the parts "
			"are the model's, scaled to it\n",
			mib(e->budget), measured(e) + 2);
}

int nf_cmd_plan(int argc, char **argv)
{
	struct nf_plan_opts o;
	nf_plan_opts_default(&o);
	uint64_t budgets[32];
	uint32_t n_budgets = 0;
	bool json = false, expl = false;
	for (int i = 1; i < argc; i++) {
		const char *f = argv[i], *v;
		long n;
		if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
			usage(stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(f, "--memory-budget")) {
			if (!(v = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
			char buf[512];
			snprintf(buf, sizeof(buf), "%s", v);
			for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
				if (n_budgets == 32) {
					nf_cli_err("%s: at most 32 budgets", f);
					return NF_EXIT_USAGE;
				}
				if (nf_cli_size(f, tok, &budgets[n_budgets]) < 0)
					return NF_EXIT_USAGE;
				if (!budgets[n_budgets]) {
					nf_cli_err("%s: must be positive", f);
					return NF_EXIT_USAGE;
				}
				n_budgets++;
			}
		} else if (!strcmp(f, "--calibration")) {
			if (!(o.calibration = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
		} else if (!strcmp(f, "--calib-tokens")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_int(f, v, 16, 4096, &n) < 0)
				return NF_EXIT_USAGE;
			o.calib_tokens = (uint32_t)n;
		} else if (!strcmp(f, "--calib-generate")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_int(f, v, 0, 4095, &n) < 0)
				return NF_EXIT_USAGE;
			o.calib_generate = (int)n;
		} else if (!strcmp(f, "--no-relayout")) {
			o.relayout = false;
		} else if (!strcmp(f, "--keep-copy")) {
			o.keep_copy = true;
		} else if (!strcmp(f, "--bundle-align")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_block_size(f, v, &o.bundle_align) < 0)
				return NF_EXIT_USAGE;
		} else if (!strcmp(f, "--remeasure")) {
			o.remeasure = true;
		} else if (!strcmp(f, "--device-seconds")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_double(f, v, &o.device.seconds) < 0)
				return NF_EXIT_USAGE;
			if (!(o.device.seconds > 0 && o.device.seconds <= 3600)) {
				nf_cli_err("%s: expected seconds in (0, 3600], got '%s'", f, v);
				return NF_EXIT_USAGE;
			}
		} else if (!strcmp(f, "--io")) {
			if (!(v = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
			int b = nf_io_backend_parse(v);
			if (b < 0 || b == NF_IO_FAULT) {
				nf_cli_err("%s: expected auto, aio, uring or sync, got '%s'", f, v);
				return NF_EXIT_USAGE;
			}
			o.device.io_backend = b;
		} else if (!strcmp(f, "-t") || !strcmp(f, "--threads")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_int(f, v, 0, 1024, &n) < 0)
				return NF_EXIT_USAGE;
			o.n_threads = (int)n;
		} else if (!strcmp(f, "--json")) {
			json = true;
		} else if (!strcmp(f, "--explain")) {
			expl = true;
		} else if (f[0] == '-' && f[1]) {
			nf_cli_err("plan: unknown option '%s' (see --help)", f);
			return NF_EXIT_USAGE;
		} else if (!o.store) {
			o.store = f;
		} else {
			nf_cli_err("plan: unexpected argument '%s' (see --help)", f);
			return NF_EXIT_USAGE;
		}
	}
	if (!o.store) {
		nf_cli_err("plan: STORE is required (a store from `nflash import`; see --help)");
		return NF_EXIT_USAGE;
	}
	if (!n_budgets) {
		nf_cli_err("plan: --memory-budget SIZE is required");
		return NF_EXIT_USAGE;
	}
	o.budgets = budgets;
	o.n_budgets = n_budgets;
	o.log = stderr;
	struct plan_bar pb = { 0 };
	struct nf_plan_progress pr = { progress_fn, &pb };
	o.progress = &pr;
	struct nf_store_plan *p = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_plan_run(&o, &p, &d);
	if (pb.open)
		nf_progress_end(&pb.p);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	const struct nf_store_plan_entry *first = NULL;
	for (uint32_t i = 0; i < p->n_entries; i++)
		if (p->entries[i].budget == budgets[0])
			first = &p->entries[i];
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "store", o.store);
		if (first)
			entry_json(&j, first, true);
		nf_json_dbl(&j, "mem_read_gb_s", p->mem_read_gb_s);
		nf_json_arr_begin(&j, "plans");
		for (uint32_t i = 0; i < p->n_entries; i++) {
			nf_json_obj_begin(&j, NULL);
			entry_json(&j, &p->entries[i], false);
			nf_json_obj_end(&j);
		}
		nf_json_arr_end(&j);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		printf("plans stored in %s:\n", o.store);
		for (uint32_t i = 0; i < p->n_entries; i++)
			entry_line(stdout, &p->entries[i]);
		if (expl) {
			printf("where the predicted time goes:\n");
			for (uint32_t i = 0; i < p->n_entries; i++)
				explain(stdout, &p->entries[i]);
		}
		printf("run: nflash generate -m %s --memory-budget %.1fM -p TEXT\n", o.store, mib(budgets[0]));
	}
	nf_store_plan_free(p);
	return NF_EXIT_OK;
}

void nf_plan_print(const struct nf_store *s, struct nf_json *j)
{
	struct nf_diag d = { 0 };
	struct nf_store_plan *p = NULL;
	int rc = nf_store_has_plan(s) ? nf_store_plan_read(s, &p, &d) : 0;
	if (j) {
		nf_json_obj_begin(j, "plan");
		nf_json_bool(j, "present", nf_store_has_plan(s));
		if (rc < 0)
			nf_json_str(j, "error", nf_diag_msg(&d, rc));
		if (p) {
			nf_json_dbl(j, "mem_read_gb_s", p->mem_read_gb_s);
			nf_json_u64(j, "device_points", p->n_points);
			/* the measured curve itself, as the cost model reads it */
			nf_json_arr_begin(j, "device");
			for (uint32_t i = 0; i < p->n_points; i++) {
				const struct nf_store_dev_point *q = &p->points[i];
				nf_json_obj_begin(j, NULL);
				nf_json_u64(j, "req_bytes", q->req_bytes);
				nf_json_u64(j, "qd", q->qd);
				nf_json_dbl(j, "mb_s", q->mb_s);
				nf_json_dbl(j, "cpu_us", q->cpu_us);
				nf_json_dbl(j, "lat_us", q->lat_us);
				nf_json_obj_end(j);
			}
			nf_json_arr_end(j);
			nf_json_arr_begin(j, "kernels");
			for (uint32_t i = 0; i < p->n_rates; i++) {
				nf_json_obj_begin(j, NULL);
				nf_json_str(j, "dtype", nf_dtype_name(p->rates[i].dtype));
				nf_json_u64(j, "threads", p->rates[i].threads);
				nf_json_dbl(j, "gb_s", p->rates[i].gb_s);
				nf_json_obj_end(j);
			}
			nf_json_arr_end(j);
			nf_json_arr_begin(j, "plans");
			for (uint32_t i = 0; i < p->n_entries; i++) {
				nf_json_obj_begin(j, NULL);
				entry_json(j, &p->entries[i], false);
				nf_json_obj_end(j);
			}
			nf_json_arr_end(j);
		}
		nf_json_obj_end(j);
	} else if (rc < 0) {
		printf("plan        damaged (not followed): %s\n", nf_diag_msg(&d, rc));
	} else if (p) {
		printf("plan        %u budget%s (device: %u points measured, memory read %.1f GB/s):\n", p->n_entries,
		       p->n_entries == 1 ? "" : "s", p->n_points, p->mem_read_gb_s);
		for (uint32_t i = 0; i < p->n_entries; i++)
			entry_line(stdout, &p->entries[i]);
	} else {
		printf("plan        none (settings are chosen at start; see `nflash plan`)\n");
	}
	nf_store_plan_free(p);
}
