/*
 * tools/trace.c - `nflash trace`: eBPF histograms of the block I/O of one
 * process (--pid), of a command it starts (-- COMMAND ARGS...), or of every
 * process; biolatency-style bars on a terminal, JSON lines with --json.
 *
 * Invariants:
 *  1. SIGINT, SIGTERM, SIGCHLD and SIGPIPE are blocked for the whole run and
 *     taken synchronously with sigtimedwait() (or seen as a write error), so
 *     every way out of the loop goes through nf_iotrace_close() and the pins
 *     are removed (no handler, no global flag).
 *  2. A command given after `--` is forked and held on a pipe until the
 *     tracer is attached, so its first I/O is traced; if attaching fails it
 *     is killed before it ran anything.
 *  3. Interval output is the difference of two snapshots; the final JSON
 *     line ("type":"total") is cumulative since attaching.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nflash/iotrace.h"
#include "cli.h"
#include "trace.h"

int nf_cmd_trace(int argc, char **argv);

static const char *const nf_op_names[NF_IOTRACE_NOP] = { "read", "write", "other" };

static void usage(FILE *f)
{
	fprintf(f,
		"usage: nflash trace [--pid P | -- COMMAND ARGS...] [options]\n"
		"\n"
		"Traces block I/O with eBPF: per-operation latency (device: issue ->\n"
		"complete, total: block layer entry -> complete), request sizes,\n"
		"in-flight depth, merges, requeues and io_submit / io_uring_enter\n"
		"batch sizes. Without --pid or COMMAND every process is traced.\n"
		"While it runs the maps are pinned under " NF_IOTRACE_PIN_ROOT "/<tag>/\n"
		"for bpftool (docs/TRACING.md). Needs root and a kernel with BTF.\n"
		"\n"
		"options:\n"
		"  --pid P          trace process P (all its threads)\n"
		"  -- COMMAND ...   start COMMAND, trace it, stop when it exits\n"
		"  --interval S     print every S seconds (default: once at the end)\n"
		"  --duration S     stop after S seconds (default: Ctrl-C, or COMMAND exit)\n"
		"  --tag T          pin directory name (default: this process's pid)\n"
		"  --json           JSON lines: one per interval, then a \"total\" line\n"
		"  --events         also print one line per completed request (ring buffer),\n"
		"                   with its completion time in seconds since the start\n"
		"  --raw-tp         use the raw_tp programs even where tp_btf works\n"
		"  --prog-stats     also report the CPU time the eBPF programs took\n"
		"  --help           this text\n"
		"\n"
		"exit codes: 0 done, 1 COMMAND failed, 2 usage error or no eBPF here\n"
		"(not root, kernel without BTF, bpf() refused, built with BPF=0)\n");
}

void nf_trace_print_histo(FILE *f, const char *title, const char *unit,
			  const struct nf_iotrace_histo *h)
{
	int lo = -1, hi = -1;
	uint64_t max = 0;

	for (int i = 0; i < NF_IOTRACE_NSLOTS; i++) {
		if (!h->slots[i])
			continue;
		if (lo < 0)
			lo = i;
		hi = i;
		if (h->slots[i] > max)
			max = h->slots[i];
	}
	if (lo < 0)
		return;
	fprintf(f, "\n%s (count %llu, mean %.1f)\n", title, (unsigned long long)h->count,
		h->count ? (double)h->sum / (double)h->count : 0.0);
	fprintf(f, "%24s : count    distribution\n", unit);
	for (int i = lo; i <= hi; i++) {
		unsigned long long a = i == 0 ? 0 : 1ull << i, b = (2ull << i) - 1;
		int w = (int)(h->slots[i] * 40 / max);
		char bar[41];

		memset(bar, '*', (size_t)w);
		bar[w] = 0;
		fprintf(f, "%10llu -> %-10llu : %-8llu |%-40s|\n", a, b,
			(unsigned long long)h->slots[i], bar);
	}
}

void nf_trace_print(FILE *f, const struct nf_iotrace_stats *s)
{
	char title[96];

	for (int op = 0; op < NF_IOTRACE_NOP; op++) {
		snprintf(title, sizeof(title), "%s: device latency (issue -> complete)", nf_op_names[op]);
		nf_trace_print_histo(f, title, "usecs", &s->lat[NF_IOTRACE_DEVICE][op]);
		snprintf(title, sizeof(title), "%s: total latency (block layer entry -> complete)", nf_op_names[op]);
		nf_trace_print_histo(f, title, "usecs", &s->lat[NF_IOTRACE_TOTAL][op]);
		snprintf(title, sizeof(title), "%s: request size", nf_op_names[op]);
		nf_trace_print_histo(f, title, "bytes", &s->size[op]);
	}
	nf_trace_print_histo(f, "traced requests in flight at issue", "depth", &s->depth);
	nf_trace_print_histo(f, "device queue at issue (driver tags busy, all processes)", "depth", &s->qdepth);
	nf_trace_print_histo(f, "iocbs per io_submit()", "iocbs", &s->batch[NF_IOTRACE_IO_SUBMIT]);
	nf_trace_print_histo(f, "to_submit per io_uring_enter()", "sqes", &s->batch[NF_IOTRACE_IO_URING_ENTER]);
	fprintf(f, "\nrequests %llu  bytes %llu  merges %llu  requeues %llu  errors %llu  bios %llu"
		"  io_submit %llu  io_uring_enter %llu\n",
		(unsigned long long)s->requests, (unsigned long long)s->bytes,
		(unsigned long long)s->merges, (unsigned long long)s->requeues,
		(unsigned long long)s->errors, (unsigned long long)s->bios,
		(unsigned long long)s->io_submit_calls, (unsigned long long)s->uring_enter_calls);
	if (s->prog_runs)
		fprintf(f, "eBPF programs: %llu runs, %.0f ns per run, %.0f ns per request\n",
			(unsigned long long)s->prog_runs, (double)s->prog_ns / (double)s->prog_runs,
			s->requests ? (double)s->prog_ns / (double)s->requests : 0.0);
	if (s->lost)
		fprintf(f, "%llu completions never reached the tracer: those requests have no latency"
			" sample (docs/TRACING.md)\n", (unsigned long long)s->lost);
	if (s->dropped)
		fprintf(f, "%llu requests not traced: the request map was full\n",
			(unsigned long long)s->dropped);
	if (s->untimed)
		fprintf(f, "%llu requests without a block-layer entry time (kernel before 6.5)\n",
			(unsigned long long)s->untimed);
}

void nf_trace_json_histo(struct nf_json *j, const char *key, const struct nf_iotrace_histo *h)
{
	nf_json_obj_begin(j, key);
	nf_json_u64(j, "count", h->count);
	nf_json_u64(j, "sum", h->sum);
	nf_json_dbl(j, "mean", h->count ? (double)h->sum / (double)h->count : 0.0);
	nf_json_dbl(j, "p50", nf_iotrace_histo_quantile(h, 0.50));
	nf_json_dbl(j, "p99", nf_iotrace_histo_quantile(h, 0.99));
	nf_json_arr_begin(j, "slots");
	for (int i = 0; i < NF_IOTRACE_NSLOTS; i++)
		nf_json_u64(j, NULL, h->slots[i]);
	nf_json_arr_end(j);
	nf_json_obj_end(j);
}

void nf_trace_json_stats(struct nf_json *j, const struct nf_iotrace_stats *s)
{
	static const char *const phase[2] = { "device", "total" };

	nf_json_obj_begin(j, "totals");
	nf_json_u64(j, "requests", s->requests);
	nf_json_u64(j, "bytes", s->bytes);
	nf_json_u64(j, "merges", s->merges);
	nf_json_u64(j, "requeues", s->requeues);
	nf_json_u64(j, "completed", s->completed);
	nf_json_u64(j, "completed_bytes", s->completed_bytes);
	nf_json_u64(j, "lost", s->lost);
	nf_json_u64(j, "bios", s->bios);
	nf_json_u64(j, "bio_bytes", s->bio_bytes);
	nf_json_u64(j, "splits", s->splits);
	nf_json_u64(j, "errors", s->errors);
	nf_json_u64(j, "partial", s->partial);
	nf_json_u64(j, "untimed", s->untimed);
	nf_json_u64(j, "dropped", s->dropped);
	nf_json_u64(j, "inflight", s->inflight);
	nf_json_u64(j, "io_submit_calls", s->io_submit_calls);
	nf_json_u64(j, "io_submit_iocbs", s->io_submit_iocbs);
	nf_json_u64(j, "io_uring_enter_calls", s->uring_enter_calls);
	nf_json_u64(j, "io_uring_enter_sqes", s->uring_enter_sqes);
	if (s->prog_runs) {
		nf_json_u64(j, "prog_runs", s->prog_runs);
		nf_json_u64(j, "prog_ns", s->prog_ns);
		nf_json_dbl(j, "prog_ns_per_request", s->requests ? (double)s->prog_ns / (double)s->requests : 0.0);
	}
	nf_json_obj_end(j);
	nf_json_obj_begin(j, "lat_us");
	for (int ph = 0; ph < 2; ph++) {
		nf_json_obj_begin(j, phase[ph]);
		for (int op = 0; op < NF_IOTRACE_NOP; op++)
			nf_trace_json_histo(j, nf_op_names[op], &s->lat[ph][op]);
		nf_json_obj_end(j);
	}
	nf_json_obj_end(j);
	nf_json_obj_begin(j, "size_bytes");
	for (int op = 0; op < NF_IOTRACE_NOP; op++)
		nf_trace_json_histo(j, nf_op_names[op], &s->size[op]);
	nf_json_obj_end(j);
	nf_trace_json_histo(j, "depth", &s->depth);
	nf_trace_json_histo(j, "device_depth", &s->qdepth);
	nf_json_obj_begin(j, "batch");
	nf_trace_json_histo(j, "io_submit", &s->batch[NF_IOTRACE_IO_SUBMIT]);
	nf_trace_json_histo(j, "io_uring_enter", &s->batch[NF_IOTRACE_IO_URING_ENTER]);
	nf_json_obj_end(j);
}

struct nf_trace_run {
	struct nf_iotrace *t;
	pid_t pid;              /* traced process, 0 for all */
	pid_t child;            /* forked COMMAND, 0 if none */
	bool json, events;
	double t0;
};

static void nf_trace_report(const struct nf_trace_run *r, const char *type,
			    const struct nf_iotrace_stats *s, double span, int exit_status)
{
	if (r->json) {
		struct nf_json j;

		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "type", type);
		nf_json_i64(&j, "pid", r->pid);
		nf_json_str(&j, "mode", nf_iotrace_mode(r->t));
		nf_json_str(&j, "pin_dir", nf_iotrace_pin_dir(r->t));
		nf_json_dbl(&j, "t_s", s->t - r->t0);
		nf_json_dbl(&j, "span_s", span);
		if (exit_status >= 0)
			nf_json_i64(&j, "exit_status", exit_status);
		nf_trace_json_stats(&j, s);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
		return;
	}
	if (!strcmp(type, "interval")) {
		time_t now = time(NULL);
		char hms[16];

		strftime(hms, sizeof(hms), "%H:%M:%S", localtime(&now));
		printf("\n%s (%.1f s)\n", hms, span);
	} else {
		printf("\ntraced %.1f s\n", span);
	}
	nf_trace_print(stdout, s);
	fflush(stdout);
}

static void nf_trace_event(void *ctx, const struct nf_iotrace_event *e)
{
	const struct nf_trace_run *r = ctx;
	double dev = (double)(e->done_ns - e->issue_ns) / 1e3;
	/* seconds since the trace started (bpf_ktime_get_ns is CLOCK_MONOTONIC,
	 * as r->t0 is), as biosnoop's TIME(s) */
	double at = (double)e->done_ns * 1e-9 - r->t0;
	double tot = e->start_ns ? (double)(e->done_ns - e->start_ns) / 1e3 : 0.0;
	const char *op = e->op < NF_IOTRACE_NOP ? nf_op_names[e->op] : "other";

	if (r->json) {
		struct nf_json j;

		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "type", "event");
		nf_json_dbl(&j, "t_s", at);
		nf_json_u64(&j, "tgid", e->tgid);
		nf_json_str(&j, "op", op);
		nf_json_u64(&j, "bytes", e->bytes);
		nf_json_u64(&j, "sector", e->sector);
		nf_json_u64(&j, "major", e->dev >> 20);
		nf_json_u64(&j, "minor", e->dev & 0xfffff);
		nf_json_dbl(&j, "device_us", dev);
		nf_json_dbl(&j, "total_us", tot);
		nf_json_i64(&j, "error", e->error);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		printf("%-11.6f %-8u %-5s %8u %12llu %3u:%-3u %10.1f %10.1f %d\n", at, e->tgid, op, e->bytes,
		       (unsigned long long)e->sector, e->dev >> 20, e->dev & 0xfffff, dev, tot, e->error);
	}
}

/* Forks argv held on a pipe; *release is the write end to let it exec. */
static int nf_trace_spawn(char **cmd, const sigset_t *oldmask, pid_t *child, int *release)
{
	int p[2];
	pid_t c;

	if (pipe2(p, O_CLOEXEC) < 0)
		return -errno;
	c = fork();
	if (c < 0) {
		int e = errno;

		close(p[0]);
		close(p[1]);
		return -e;
	}
	if (c == 0) {
		char go = 0;

		sigprocmask(SIG_SETMASK, oldmask, NULL);
		close(p[1]);
		if (read(p[0], &go, 1) != 1 || go != 'g')
			_exit(127);   /* the tracer did not attach: run nothing */
		close(p[0]);
		execvp(cmd[0], cmd);
		fprintf(stderr, "nflash: trace: cannot run '%s': %s\n", cmd[0], strerror(errno));
		_exit(127);
	}
	close(p[0]);
	*child = c;
	*release = p[1];
	return 0;
}

static int nf_exit_for(int rc)
{
	return (rc == -EPERM || rc == -EACCES || rc == NF_EUNSUPPORTED || rc == NF_EUSAGE ||
		rc == -EBUSY) ? NF_EXIT_USAGE : NF_EXIT_FAIL;
}

int nf_cmd_trace(int argc, char **argv)
{
	double interval = 0, duration = 0, now, next, end;
	struct nf_iotrace_stats first, prev, cur, d;
	struct nf_trace_run r = {0};
	struct nf_diag dg = {0};
	sigset_t set, oldmask;
	const char *tag = NULL;
	char **cmd = NULL;
	unsigned flags = 0;
	int release = -1, status = -1, rc, ret = NF_EXIT_OK;
	bool stop = false;
	long pidv = 0;

	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v;

		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(a, "--")) {
			if (i + 1 >= argc) {
				nf_cli_err("trace: '--' needs a COMMAND after it");
				return NF_EXIT_USAGE;
			}
			cmd = argv + i + 1;
			break;
		} else if (!strcmp(a, "--pid")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_int(a, v, 1, 0x7fffffff, &pidv) < 0)
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--interval") || !strcmp(a, "--duration")) {
			double x;

			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_double(a, v, &x) < 0)
				return NF_EXIT_USAGE;
			if (!(x > 0) || x > 1e7) {
				nf_cli_err("%s: expected seconds > 0, got '%s'", a, v);
				return NF_EXIT_USAGE;
			}
			*(a[2] == 'i' ? &interval : &duration) = x;
		} else if (!strcmp(a, "--tag")) {
			if (!(tag = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--json")) {
			r.json = true;
		} else if (!strcmp(a, "--events")) {
			r.events = true;
			flags |= NF_IOTRACE_EVENTS;
		} else if (!strcmp(a, "--raw-tp")) {
			flags |= NF_IOTRACE_RAW_TP;
		} else if (!strcmp(a, "--prog-stats")) {
			flags |= NF_IOTRACE_PROG_STATS;
		} else {
			nf_cli_err("trace: unknown option '%s' (try 'nflash trace --help')", a);
			return NF_EXIT_USAGE;
		}
	}
	if (pidv && cmd) {
		nf_cli_err("trace: give either --pid or -- COMMAND, not both");
		return NF_EXIT_USAGE;
	}
	if (pidv && kill((pid_t)pidv, 0) < 0 && errno == ESRCH) {
		nf_cli_err("trace: --pid %ld: no such process", pidv);
		return NF_EXIT_USAGE;
	}
	r.pid = (pid_t)pidv;

	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGPIPE);   /* a closed stdout ends the trace through the normal exit */
	sigprocmask(SIG_BLOCK, &set, &oldmask);
	if (cmd) {
		rc = nf_trace_spawn(cmd, &oldmask, &r.child, &release);
		if (rc < 0) {
			nf_cli_err("trace: cannot start '%s': %s", cmd[0], strerror(-rc));
			ret = NF_EXIT_FAIL;
			goto out_mask;
		}
		r.pid = r.child;
	}
	rc = nf_iotrace_open(r.pid, tag, flags, &r.t, &dg);
	if (rc < 0) {
		nf_cli_err("trace: %s", nf_diag_msg(&dg, rc));
		ret = nf_exit_for(rc);
		goto out_child;
	}
	if (nf_iotrace_snapshot(r.t, &first) < 0) {
		nf_cli_err("trace: cannot read the trace maps");
		ret = NF_EXIT_FAIL;
		goto out_close;
	}
	prev = first;
	r.t0 = first.t;
	if (!r.json) {
		if (r.pid)
			fprintf(stderr, "Tracing block I/O of pid %d", (int)r.pid);
		else
			fprintf(stderr, "Tracing block I/O of every process");
		fprintf(stderr, " (%s; maps pinned in %s).%s\n", nf_iotrace_mode(r.t),
			nf_iotrace_pin_dir(r.t), cmd ? "" : " Ctrl-C to end.");
		if (r.events)
			printf("%-11s %-8s %-5s %8s %12s %7s %10s %10s %s\n", "TIME(s)", "TGID", "OP", "BYTES", "SECTOR",
			       "DEV", "DEV_US", "TOTAL_US", "ERR");
	}
	if (release >= 0) {
		if (write(release, "g", 1) != 1)
			nf_cli_warn("trace: could not release '%s'", cmd[0]);
		close(release);
		release = -1;
	}

	now = nf_cli_now();
	next = interval > 0 ? now + interval : 1e300;
	end = duration > 0 ? now + duration : 1e300;
	while (!stop) {
		double wake = next < end ? next : end, left;
		struct timespec ts;
		siginfo_t si;
		int sig;

		now = nf_cli_now();
		left = wake - now;
		if (r.events && left > 0.1)
			left = 0.1;
		if (r.pid && !r.child && left > 0.25)
			left = 0.25;   /* notice a --pid process exiting */
		if (left > 1.0)
			left = 1.0;    /* wake up now and then; also keeps tv_sec sane */
		if (left < 0)
			left = 0;
		if (r.events) {
			int n = nf_iotrace_events_poll(r.t, (int)(left * 1000), nf_trace_event, &r);

			if (n < 0 && n != -EINTR) {
				nf_cli_err("trace: reading events: %s", nf_strerror(n));
				ret = NF_EXIT_FAIL;
				break;
			}
			left = 0;
		}
		ts.tv_sec = (time_t)left;
		ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
		sig = sigtimedwait(&set, &si, &ts);
		if (sig == SIGINT || sig == SIGTERM || (r.events && ferror(stdout))) {
			stop = true;
		} else if (sig == SIGCHLD && r.child) {
			int st;

			if (waitpid(r.child, &st, WNOHANG) == r.child) {
				status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
				r.child = 0;
				stop = true;
			}
		}
		if (r.pid && !cmd && kill(r.pid, 0) < 0 && errno == ESRCH) {
			if (!r.json)
				fprintf(stderr, "pid %d exited\n", (int)r.pid);
			stop = true;
		}
		now = nf_cli_now();
		if (now >= end)
			stop = true;
		if (interval > 0 && (now >= next || stop)) {
			if (nf_iotrace_snapshot(r.t, &cur) < 0) {
				ret = NF_EXIT_FAIL;
				break;
			}
			nf_iotrace_stats_diff(&cur, &prev, &d);
			nf_trace_report(&r, "interval", &d, cur.t - prev.t, -1);
			prev = cur;
			if (ferror(stdout))
				stop = true;   /* reader went away (EPIPE) */
			while (next <= now)
				next += interval;
		}
	}
	if (r.events)
		nf_iotrace_events_poll(r.t, 0, nf_trace_event, &r);
	if (nf_iotrace_snapshot(r.t, &cur) == 0) {
		nf_iotrace_stats_diff(&cur, &first, &d);
		if (r.json || interval <= 0)
			nf_trace_report(&r, "total", &d, cur.t - first.t, status);
	}
	if (cmd && status >= 0) {
		if (!r.json)
			fprintf(stderr, "%s exited with status %d\n", cmd[0], status);
		if (status != 0 && ret == NF_EXIT_OK)
			ret = NF_EXIT_FAIL;
	} else if (r.child) {
		fprintf(stderr, "nflash: trace: %s (pid %d) is still running\n", cmd[0], (int)r.child);
		r.child = 0;
	}
out_close:
	nf_iotrace_close(r.t);
out_child:
	if (release >= 0) {
		close(release);   /* the child sees EOF and exits without running COMMAND */
		waitpid(r.child, NULL, 0);
	}
out_mask:
	sigprocmask(SIG_SETMASK, &oldmask, NULL);
	return ret;
}

/* ---- --trace for the engine's own commands ----------------------------- */

bool nf_trace_probe_start(struct nf_trace_probe *p, bool want)
{
	struct nf_diag dg = {0};
	sigset_t set;
	int rc;

	memset(p, 0, sizeof(*p));
	p->wanted = want;
	if (!want)
		return false;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigprocmask(SIG_BLOCK, &set, &p->oldmask);
	p->masked = true;
	rc = nf_iotrace_open(getpid(), NULL, 0, &p->t, &dg);
	if (rc < 0) {
		snprintf(p->err, sizeof(p->err), "%s", nf_diag_msg(&dg, rc));
		nf_cli_warn("--trace: %s; carrying on without it", p->err);
		sigprocmask(SIG_SETMASK, &p->oldmask, NULL);
		p->masked = false;
		p->t = NULL;
		return false;
	}
	return true;
}

void nf_trace_probe_mark(struct nf_trace_probe *p)
{
	if (p->t && nf_iotrace_snapshot(p->t, &p->a) < 0)
		memset(&p->a, 0, sizeof(p->a));
}

void nf_trace_probe_collect(struct nf_trace_probe *p)
{
	if (!p->t)
		return;
	if (nf_iotrace_snapshot(p->t, &p->b) < 0)
		p->b = p->a;
	nf_iotrace_stats_diff(&p->b, &p->a, &p->d);
}

bool nf_trace_probe_interrupted(struct nf_trace_probe *p)
{
	sigset_t pend;

	double now;

	if (p->interrupted)
		return true;
	if (!p->masked)
		return false;
	now = nf_cli_now();
	if (now - p->last_check < 0.05)
		return false;
	p->last_check = now;
	if (sigpending(&pend) < 0)
		return false;
	p->interrupted = sigismember(&pend, SIGINT) || sigismember(&pend, SIGTERM);
	return p->interrupted;
}

static void nf_probe_lat(const struct nf_iotrace_histo *per_op, double *mean, double *p50, double *p99)
{
	struct nf_iotrace_histo h;

	nf_iotrace_histo_sum(per_op, NF_IOTRACE_NOP, &h);
	*mean = h.count ? (double)h.sum / (double)h.count : 0.0;
	*p50 = nf_iotrace_histo_quantile(&h, 0.50);
	*p99 = nf_iotrace_histo_quantile(&h, 0.99);
}

void nf_trace_probe_report(const struct nf_trace_probe *p, FILE *f, struct nf_json *j,
			   const struct nf_trace_engine_lat *e)
{
	const struct nf_iotrace_stats *d = &p->d;
	double dm, d50, d99, tm, t50, t99;

	if (!p->wanted)
		return;
	if (!p->t) {
		if (j) {
			nf_json_obj_begin(j, "trace");
			nf_json_str(j, "error", p->err);
			nf_json_obj_end(j);
		}
		return;
	}
	nf_probe_lat(d->lat[NF_IOTRACE_DEVICE], &dm, &d50, &d99);
	nf_probe_lat(d->lat[NF_IOTRACE_TOTAL], &tm, &t50, &t99);
	if (j) {
		nf_json_obj_begin(j, "trace");
		nf_json_str(j, "mode", nf_iotrace_mode(p->t));
		nf_json_u64(j, "requests", d->requests);
		nf_json_u64(j, "bytes", d->bytes);
		nf_json_u64(j, "merges", d->merges);
		nf_json_u64(j, "requeues", d->requeues);
		nf_json_u64(j, "completed", d->completed);
		nf_json_u64(j, "lost", d->lost);
		nf_json_u64(j, "io_submit_calls", d->io_submit_calls);
		nf_json_u64(j, "io_uring_enter_calls", d->uring_enter_calls);
		nf_json_u64(j, "engine_reads", e->reads);
		nf_json_dbl(j, "engine_mean_us", e->mean_us);
		nf_json_dbl(j, "engine_p50_us", e->p50_us);
		nf_json_dbl(j, "engine_p99_us", e->p99_us);
		nf_json_dbl(j, "block_mean_us", tm);
		nf_json_dbl(j, "block_p50_us", t50);
		nf_json_dbl(j, "block_p99_us", t99);
		nf_json_dbl(j, "device_mean_us", dm);
		nf_json_dbl(j, "device_p50_us", d50);
		nf_json_dbl(j, "device_p99_us", d99);
		nf_json_dbl(j, "software_us", e->mean_us - dm);
		nf_json_dbl(j, "block_queue_us", tm - dm);
		nf_json_obj_end(j);
		return;
	}
	fprintf(f, "  trace (eBPF %s): %llu block requests, %.1f MB, %llu merges, %llu requeues",
		nf_iotrace_mode(p->t), (unsigned long long)d->requests, (double)d->bytes / 1e6,
		(unsigned long long)d->merges, (unsigned long long)d->requeues);
	if (d->lost)
		fprintf(f, ", %llu completions not seen", (unsigned long long)d->lost);
	fprintf(f, "\n  latency (us)        mean      p50      p99\n");
	fprintf(f, "    engine        %8.1f %8.0f %8.0f   %llu reads: submit -> completion reaped\n",
		e->mean_us, e->p50_us, e->p99_us, (unsigned long long)e->reads);
	fprintf(f, "    block layer   %8.1f %8.0f~ %7.0f~  entry into the block layer -> completion\n",
		tm, t50, t99);
	fprintf(f, "    device        %8.1f %8.0f~ %7.0f~  issue to the driver -> completion\n", dm, d50, d99);
	fprintf(f, "  per read: %.1f us outside the device (engine - device), of which %.1f us queued in the block layer"
		" (~ log2-histogram estimate)\n", e->mean_us - dm, tm - dm);
}

void nf_trace_probe_stop(struct nf_trace_probe *p)
{
	nf_iotrace_close(p->t);
	p->t = NULL;
	if (p->masked)
		sigprocmask(SIG_SETMASK, &p->oldmask, NULL);   /* a held SIGINT/SIGTERM lands now */
	p->masked = false;
}
