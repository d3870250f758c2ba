/*
 * bpf/iotrace.c - user side of the block-I/O tracer (include/nflash/iotrace.h):
 * loads the skeleton generated from iotrace.bpf.c, picks the tp_btf or
 * raw_tp program set, attaches, pins the histogram maps under
 * /sys/fs/bpf/nflash/<tag>/ and reads them back.
 *
 * Invariants:
 *  1. nf_iotrace_open() either returns a fully attached and pinned tracer or
 *     leaves nothing behind: no links, no pins, no directory.
 *  2. The `owner` map is pinned first, so any pin directory with other pins
 *     also names its owner (pid + start time); a directory whose owner is
 *     dead is stale and may be removed by anyone.
 *  3. Histogram headers (kind/phase/op) are written before any program is
 *     attached; programs only add to counts.
 *  4. Only the `reqs` and `events` maps stay unpinned: they are the tracer's
 *     private state, not results.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

#include <linux/types.h>
#include <bpf/bpf.h>
#include <bpf/btf.h>
#include <bpf/libbpf.h>

#include "nflash/iotrace.h"
#include "iotrace.h"
#include "bpf/iotrace.skel.h"   /* generated in $(B)/bpf by bpf/bpf.mk */

_Static_assert(NF_IOTRACE_NSLOTS == NF_IOTRACE_SLOTS, "public and kernel histograms differ");
_Static_assert((int)NF_IOTRACE_NOP == (int)NF_IOTRACE_NOPS, "public and kernel op counts differ");

#define NF_BPFFS_ROOT "/sys/fs/bpf"
#define NF_BPF_FS_MAGIC 0xcafe4a11
#define NF_BTF_VMLINUX "/sys/kernel/btf/vmlinux"

struct nf_iotrace {
	struct iotrace_bpf *skel;
	unsigned flags;
	pid_t tgid;
	bool raw_tp;
	char dir[256];                 /* pin directory, "" when not pinned */
	struct ring_buffer *rb;
	void (*ev_cb)(void *ctx, const struct nf_iotrace_event *e);
	void *ev_ctx;
	int ev_count;
	int stats_fd;                  /* bpf_enable_stats() handle, -1 if off */
};

/* Pinned maps, in pin order (owner first, invariant 2). */
static const char *const nf_iotrace_pins[] = {
	"owner", "counters", "lat_hist", "size_hist", "depth_hist", "sys_hist",
};
#define NF_NPINS (sizeof(nf_iotrace_pins) / sizeof(nf_iotrace_pins[0]))

/* One tracepoint and its two program variants. */
struct nf_tp {
	const char *name;
	size_t btf_off, raw_off;   /* offsets into struct iotrace_bpf::progs */
};
#define NF_TP(n, b, r) { n, offsetof(struct iotrace_bpf, progs.b), offsetof(struct iotrace_bpf, progs.r) }
static const struct nf_tp nf_tps[] = {
	NF_TP("block_io_start", btf_io_start, raw_io_start),
	NF_TP("block_rq_issue", btf_rq_issue, raw_rq_issue),
	NF_TP("block_rq_requeue", btf_rq_requeue, raw_rq_requeue),
	NF_TP("block_rq_merge", btf_rq_merge, raw_rq_merge),
	NF_TP("block_rq_complete", btf_rq_complete, raw_rq_complete),
	NF_TP("block_bio_queue", btf_bio_queue, raw_bio_queue),
	NF_TP("block_bio_backmerge", btf_bio_backmerge, raw_bio_backmerge),
	NF_TP("block_bio_frontmerge", btf_bio_frontmerge, raw_bio_frontmerge),
	NF_TP("block_split", btf_bio_split, raw_bio_split),
	NF_TP("sys_enter", btf_sys_enter, raw_sys_enter),
};
/* Without these the tracer is useless; the others are optional. */
static bool nf_tp_required(const char *name)
{
	return !strcmp(name, "block_rq_issue") || !strcmp(name, "block_rq_complete");
}

static struct bpf_program *nf_tp_prog(struct iotrace_bpf *s, size_t off)
{
	return *(struct bpf_program **)((char *)s + off);
}

static int nf_libbpf_print(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	if (!getenv("NFLASH_BPF_DEBUG"))
		return 0;
	return vfprintf(stderr, fmt, ap);
}

static void nf_note(unsigned flags, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void nf_note(unsigned flags, const char *fmt, ...)
{
	va_list ap;

	if (flags & NF_IOTRACE_QUIET)
		return;
	va_start(ap, fmt);
	fputs("nflash: iotrace: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

/* Start time of pid in clock ticks (field 22 of /proc/PID/stat), 0 if unknown. */
static uint64_t nf_proc_start_ticks(pid_t pid)
{
	char path[64], buf[1024];
	unsigned long long v = 0;
	ssize_t n;
	char *p;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	p = strrchr(buf, ')');    /* comm may contain spaces and parentheses */
	if (!p)
		return 0;
	/* after ") " comes field 3; skip to field 22 */
	for (int field = 3; field <= 22 && p; field++)
		p = strchr(p + 1, ' ');
	if (p)
		sscanf(p + 1, "%llu", &v);
	return v;
}

static bool nf_owner_alive(const struct nf_iotrace_owner *o)
{
	uint64_t st;

	if (o->pid == 0 || (kill((pid_t)o->pid, 0) < 0 && errno == ESRCH))
		return false;
	st = nf_proc_start_ticks((pid_t)o->pid);
	return st == 0 || o->start_ticks == 0 || st == o->start_ticks;
}

/* Reads dir/owner; 0 and *o filled, or -errno (-ENOENT: no owner pin). */
static int nf_owner_read(const char *dir, struct nf_iotrace_owner *o)
{
	char path[512];
	__u32 key = 0;
	int fd, rc = 0;

	snprintf(path, sizeof(path), "%s/owner", dir);
	fd = bpf_obj_get(path);
	if (fd < 0)
		return -errno;
	if (bpf_map_lookup_elem(fd, &key, o) < 0)
		rc = -errno;
	close(fd);
	return rc;
}

/* Removes every pin in dir, then dir. */
static int nf_dir_remove(const char *dir)
{
	char path[512];
	struct dirent *e;
	DIR *dp = opendir(dir);

	if (!dp)
		return -errno;
	while ((e = readdir(dp))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		unlink(path);
	}
	closedir(dp);
	return rmdir(dir) < 0 ? -errno : 0;
}

static bool nf_all_digits(const char *s)
{
	if (!*s)
		return false;
	for (; *s; s++)
		if (!isdigit((unsigned char)*s))
			return false;
	return true;
}

int nf_iotrace_clean_stale(bool quiet)
{
	unsigned flags = quiet ? NF_IOTRACE_QUIET : 0;
	char dir[512];
	struct dirent *e;
	int removed = 0;
	DIR *dp = opendir(NF_IOTRACE_PIN_ROOT);

	if (!dp)
		return errno == ENOENT ? 0 : -errno;
	while ((e = readdir(dp))) {
		struct nf_iotrace_owner o = {0};
		int rc;

		if (e->d_name[0] == '.')
			continue;
		snprintf(dir, sizeof(dir), "%s/%s", NF_IOTRACE_PIN_ROOT, e->d_name);
		rc = nf_owner_read(dir, &o);
		if (rc == -ENOENT && nf_all_digits(e->d_name))
			o.pid = (__u32)strtoul(e->d_name, NULL, 10);  /* died before pinning owner */
		else if (rc < 0)
			continue;
		if (nf_owner_alive(&o))
			continue;
		if (nf_dir_remove(dir) == 0) {
			removed++;
			nf_note(flags, "removed stale pins %s (owner pid %u is gone)", dir, o.pid);
		}
	}
	closedir(dp);
	return removed;
}

static int nf_bpffs_ensure(struct nf_diag *d)
{
	struct statfs sf;

	if (statfs(NF_BPFFS_ROOT, &sf) == 0 && (unsigned long)sf.f_type == NF_BPF_FS_MAGIC)
		return 0;
	if (mount("bpf", NF_BPFFS_ROOT, "bpf", 0, "mode=0700") < 0)
		return nf_diag_fail(d, -errno, "bpffs is not mounted on %s and mounting it failed: %s",
				    NF_BPFFS_ROOT, strerror(errno));
	return 0;
}

static int nf_tag_check(const char *tag, struct nf_diag *d)
{
	size_t n = strlen(tag);

	if (n == 0 || n > 64 || tag[0] == '.')
		return nf_diag_fail(d, NF_EUSAGE, "trace tag '%s': must be 1..64 characters, not starting with '.'", tag);
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)tag[i]) && !strchr("._-", tag[i]))
			return nf_diag_fail(d, NF_EUSAGE, "trace tag '%s': only letters, digits, '.', '_' and '-'", tag);
	return 0;
}

/* Opens the skeleton, chooses programs, loads. */
static int nf_skel_load(struct nf_iotrace *t, bool raw, const struct btf *vmlinux,
			struct iotrace_bpf **out, struct nf_diag *d)
{
	struct iotrace_bpf *s;
	int rc;

	s = iotrace_bpf__open();
	if (!s)
		return nf_diag_fail(d, -errno, "cannot open the eBPF object: %s", strerror(errno));
	s->rodata->target_tgid = (__u32)t->tgid;
	s->rodata->emit_events = (t->flags & NF_IOTRACE_EVENTS) ? 1 : 0;
	if (t->flags & NF_IOTRACE_EVENTS)
		bpf_map__set_max_entries(s->maps.events, 4u << 20);
	for (size_t i = 0; i < sizeof(nf_tps) / sizeof(nf_tps[0]); i++) {
		char name[96];
		bool have;

		snprintf(name, sizeof(name), "btf_trace_%s", nf_tps[i].name);
		have = btf__find_by_name_kind(vmlinux, name, BTF_KIND_TYPEDEF) >= 0;
		if (!have && nf_tp_required(nf_tps[i].name)) {
			iotrace_bpf__destroy(s);
			return nf_diag_fail(d, NF_EUNSUPPORTED, "kernel has no %s tracepoint", nf_tps[i].name);
		}
		if (!strcmp(nf_tps[i].name, "block_io_start"))
			s->rodata->have_io_start = have;
		bpf_program__set_autoload(nf_tp_prog(s, nf_tps[i].btf_off), have && !raw);
		bpf_program__set_autoload(nf_tp_prog(s, nf_tps[i].raw_off), have && raw);
	}
	rc = iotrace_bpf__load(s);
	if (rc < 0) {
		iotrace_bpf__destroy(s);
		return nf_diag_fail(d, rc, "bpf() refused the eBPF programs (%s variant): %s",
				    raw ? "raw_tp" : "tp_btf", strerror(-rc));
	}
	*out = s;
	return 0;
}

static int nf_hist_init(int fd, __u32 idx, __u32 kind, __u32 phase, __u32 op)
{
	struct nf_iotrace_hist h = { .kind = kind, .phase = phase, .op = op };

	return bpf_map_update_elem(fd, &idx, &h, BPF_ANY) < 0 ? -errno : 0;
}

static int nf_maps_init(struct nf_iotrace *t)
{
	struct iotrace_bpf *s = t->skel;
	struct nf_iotrace_owner o = {
		.pid = (__u32)getpid(), .target_tgid = (__u32)t->tgid,
		.start_ticks = nf_proc_start_ticks(getpid()),
	};
	__u32 zero = 0;
	int rc = 0;

	for (__u32 ph = 0; ph < NF_IOTRACE_NPHASES && !rc; ph++)
		for (__u32 op = 0; op < NF_IOTRACE_NOPS && !rc; op++)
			rc = nf_hist_init(bpf_map__fd(s->maps.lat_hist), ph * NF_IOTRACE_NOPS + op,
					  NF_IOTRACE_KIND_LAT_US, ph, op);
	for (__u32 op = 0; op < NF_IOTRACE_NOPS && !rc; op++)
		rc = nf_hist_init(bpf_map__fd(s->maps.size_hist), op, NF_IOTRACE_KIND_SIZE_B, 0, op);
	if (!rc)
		rc = nf_hist_init(bpf_map__fd(s->maps.depth_hist), 0, NF_IOTRACE_KIND_DEPTH, 0, 0);
	if (!rc)
		rc = nf_hist_init(bpf_map__fd(s->maps.depth_hist), 1, NF_IOTRACE_KIND_QDEPTH, 0, 0);
	for (__u32 i = 0; i < NF_IOTRACE_NSYS && !rc; i++)
		rc = nf_hist_init(bpf_map__fd(s->maps.sys_hist), i, NF_IOTRACE_KIND_BATCH, i, 0);
	if (!rc && bpf_map_update_elem(bpf_map__fd(s->maps.owner), &zero, &o, BPF_ANY) < 0)
		rc = -errno;
	return rc;
}

static int nf_pin_all(struct nf_iotrace *t, const char *tag, struct nf_diag *d)
{
	struct nf_iotrace_owner o;
	char path[512];
	int rc;

	if (mkdir(NF_IOTRACE_PIN_ROOT, 0700) < 0 && errno != EEXIST)
		return nf_diag_fail(d, -errno, "cannot create %s: %s", NF_IOTRACE_PIN_ROOT, strerror(errno));
	snprintf(t->dir, sizeof(t->dir), "%s/%s", NF_IOTRACE_PIN_ROOT, tag);
	if (mkdir(t->dir, 0700) < 0) {
		rc = -errno;
		if (rc == -EEXIST && nf_owner_read(t->dir, &o) == 0)
			rc = nf_diag_fail(d, -EBUSY, "%s is in use by live process %u (choose another --tag)",
					  t->dir, o.pid);
		else
			rc = nf_diag_fail(d, rc, "cannot create %s: %s", t->dir, strerror(-rc));
		t->dir[0] = 0;
		return rc;
	}
	for (size_t i = 0; i < NF_NPINS; i++) {
		struct bpf_map *m = bpf_object__find_map_by_name(t->skel->obj, nf_iotrace_pins[i]);

		snprintf(path, sizeof(path), "%s/%s", t->dir, nf_iotrace_pins[i]);
		rc = m ? bpf_map__pin(m, path) : -ENOENT;
		if (rc < 0) {
			nf_dir_remove(t->dir);
			t->dir[0] = 0;
			return nf_diag_fail(d, rc, "cannot pin %s: %s", path, strerror(-rc));
		}
	}
	return 0;
}

int nf_iotrace_open(pid_t tgid, const char *tag, unsigned flags,
		    struct nf_iotrace **out, struct nf_diag *d)
{
	struct btf *vmlinux = NULL;
	struct nf_iotrace *t = NULL;
	struct nf_diag first = {0};
	char deftag[32];
	int rc;

	*out = NULL;
	if (tgid < 0)
		return nf_diag_fail(d, NF_EUSAGE, "trace: bad pid %d", (int)tgid);
	if (!tag) {
		snprintf(deftag, sizeof(deftag), "%d", (int)getpid());
		tag = deftag;
	}
	rc = nf_tag_check(tag, d);
	if (rc < 0)
		return rc;
	if (geteuid() != 0)
		return nf_diag_fail(d, -EPERM, "eBPF tracing needs root (bpf() and tracepoints are privileged)");
	if (access(NF_BTF_VMLINUX, R_OK) < 0)
		return nf_diag_fail(d, NF_EUNSUPPORTED, "the kernel has no BTF (%s missing; needs CONFIG_DEBUG_INFO_BTF=y)",
				    NF_BTF_VMLINUX);
	libbpf_set_print(nf_libbpf_print);

	t = calloc(1, sizeof(*t));
	if (!t)
		return nf_diag_fail(d, -ENOMEM, "out of memory");
	t->flags = flags;
	t->tgid = tgid;
	t->stats_fd = -1;

	vmlinux = btf__load_vmlinux_btf();
	if (!vmlinux) {
		rc = nf_diag_fail(d, NF_EUNSUPPORTED, "cannot read the kernel BTF %s: %s", NF_BTF_VMLINUX, strerror(errno));
		goto err_free;
	}
	t->raw_tp = (flags & NF_IOTRACE_RAW_TP) != 0;
	rc = nf_skel_load(t, t->raw_tp, vmlinux, &t->skel, &first);
	if (rc < 0 && !t->raw_tp && rc != NF_EUNSUPPORTED) {
		nf_note(flags, "tp_btf programs refused (%s); using raw_tp", strerror(-rc));
		t->raw_tp = true;
		rc = nf_skel_load(t, true, vmlinux, &t->skel, d);
	} else if (rc < 0) {
		nf_diag_fail(d, rc, "%s", first.msg);
	}
	if (rc < 0)
		goto err_btf;
	rc = nf_maps_init(t);
	if (rc < 0) {
		nf_diag_fail(d, rc, "cannot initialise the trace maps: %s", strerror(-rc));
		goto err_skel;
	}
	if (!(flags & NF_IOTRACE_NO_PIN)) {
		rc = nf_bpffs_ensure(d);
		if (rc < 0)
			goto err_skel;
		nf_iotrace_clean_stale(flags & NF_IOTRACE_QUIET);
		rc = nf_pin_all(t, tag, d);
		if (rc < 0)
			goto err_skel;
	}
	if (flags & NF_IOTRACE_PROG_STATS) {
		t->stats_fd = bpf_enable_stats(BPF_STATS_RUN_TIME);
		if (t->stats_fd < 0) {
			rc = nf_diag_fail(d, t->stats_fd, "cannot enable eBPF run-time statistics: %s",
					  strerror(-t->stats_fd));
			t->stats_fd = -1;
			goto err_unpin;
		}
	}
	rc = iotrace_bpf__attach(t->skel);
	if (rc < 0) {
		nf_diag_fail(d, rc, "cannot attach to the block tracepoints: %s", strerror(-rc));
		goto err_unpin;
	}
	btf__free(vmlinux);
	*out = t;
	return 0;

err_unpin:
	if (t->stats_fd >= 0)
		close(t->stats_fd);
	if (t->dir[0])
		nf_dir_remove(t->dir);
err_skel:
	iotrace_bpf__destroy(t->skel);
err_btf:
	btf__free(vmlinux);
err_free:
	free(t);
	return rc;
}

static int nf_hist_read(int fd, __u32 idx, struct nf_iotrace_histo *h)
{
	struct nf_iotrace_hist v;

	if (bpf_map_lookup_elem(fd, &idx, &v) < 0)
		return -errno;
	h->count = v.count;
	h->sum = v.sum;
	memcpy(h->slots, v.slots, sizeof(h->slots));
	return 0;
}

int nf_iotrace_snapshot(struct nf_iotrace *t, struct nf_iotrace_stats *s)
{
	struct iotrace_bpf *k = t->skel;
	struct nf_iotrace_counters c;
	struct timespec ts;
	__u32 zero = 0;
	int rc = 0;

	memset(s, 0, sizeof(*s));
	if (bpf_map_lookup_elem(bpf_map__fd(k->maps.counters), &zero, &c) < 0)
		return -errno;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	s->t = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
	s->requests = c.requests;
	s->bytes = c.bytes;
	s->bios = c.bios;
	s->bio_bytes = c.bio_bytes;
	s->merges = c.merges;
	s->requeues = c.requeues;
	s->errors = c.errors;
	s->partial = c.partial;
	s->untimed = c.untimed;
	s->dropped = c.dropped;
	s->inflight = c.inflight;
	s->io_submit_calls = c.io_submit_calls;
	s->io_submit_iocbs = c.io_submit_iocbs;
	s->uring_enter_calls = c.uring_enter_calls;
	s->uring_enter_sqes = c.uring_enter_sqes;
	s->ev_lost = c.ev_lost;
	s->splits = c.splits;
	s->completed = c.completed;
	s->completed_bytes = c.completed_bytes;
	s->lost = c.lost;
	for (__u32 ph = 0; ph < NF_IOTRACE_NPHASES && !rc; ph++)
		for (__u32 op = 0; op < NF_IOTRACE_NOPS && !rc; op++)
			rc = nf_hist_read(bpf_map__fd(k->maps.lat_hist), ph * NF_IOTRACE_NOPS + op, &s->lat[ph][op]);
	for (__u32 op = 0; op < NF_IOTRACE_NOPS && !rc; op++)
		rc = nf_hist_read(bpf_map__fd(k->maps.size_hist), op, &s->size[op]);
	if (!rc)
		rc = nf_hist_read(bpf_map__fd(k->maps.depth_hist), 0, &s->depth);
	if (!rc)
		rc = nf_hist_read(bpf_map__fd(k->maps.depth_hist), 1, &s->qdepth);
	for (__u32 i = 0; i < NF_IOTRACE_NSYS && !rc; i++)
		rc = nf_hist_read(bpf_map__fd(k->maps.sys_hist), i, &s->batch[i]);
	if (t->stats_fd >= 0) {
		struct bpf_program *p;

		bpf_object__for_each_program(p, k->obj) {
			struct bpf_prog_info info;
			__u32 len = sizeof(info);

			if (!bpf_program__autoload(p))
				continue;
			memset(&info, 0, sizeof(info));
			if (bpf_obj_get_info_by_fd(bpf_program__fd(p), &info, &len) == 0) {
				s->prog_runs += info.run_cnt;
				s->prog_ns += info.run_time_ns;
			}
		}
	}
	return rc;
}

const char *nf_iotrace_pin_dir(const struct nf_iotrace *t)
{
	return t->dir;
}

const char *nf_iotrace_mode(const struct nf_iotrace *t)
{
	return t->raw_tp ? "raw_tp" : "tp_btf";
}

static int nf_rb_event(void *ctx, void *data, size_t size)
{
	struct nf_iotrace *t = ctx;
	const struct nf_iotrace_rec *r = data;
	struct nf_iotrace_event e;

	if (size < sizeof(*r))
		return 0;
	e.start_ns = r->start_ns;
	e.issue_ns = r->issue_ns;
	e.done_ns = r->done_ns;
	e.sector = r->sector;
	e.tgid = r->tgid;
	e.bytes = r->bytes;
	e.op = r->op;
	e.dev = r->dev;
	e.error = r->error;
	t->ev_cb(t->ev_ctx, &e);
	t->ev_count++;
	return 0;
}

int nf_iotrace_events_poll(struct nf_iotrace *t, int timeout_ms,
			   void (*cb)(void *ctx, const struct nf_iotrace_event *e), void *ctx)
{
	int rc;

	if (!(t->flags & NF_IOTRACE_EVENTS) || !cb)
		return NF_EUSAGE;
	if (!t->rb) {
		t->rb = ring_buffer__new(bpf_map__fd(t->skel->maps.events), nf_rb_event, t, NULL);
		if (!t->rb)
			return -errno;
	}
	t->ev_cb = cb;
	t->ev_ctx = ctx;
	t->ev_count = 0;
	rc = ring_buffer__poll(t->rb, timeout_ms);
	return rc < 0 ? rc : t->ev_count;
}

void nf_iotrace_close(struct nf_iotrace *t)
{
	if (!t)
		return;
	ring_buffer__free(t->rb);
	iotrace_bpf__detach(t->skel);
	if (t->stats_fd >= 0)
		close(t->stats_fd);
	if (t->dir[0]) {
		nf_dir_remove(t->dir);
		rmdir(NF_IOTRACE_PIN_ROOT);   /* only succeeds when no other tracer is left */
	}
	iotrace_bpf__destroy(t->skel);
	free(t);
}
