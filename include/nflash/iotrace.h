/*
 * nflash/iotrace.h - eBPF histograms of what the block device did for one
 * process: request latency (device time and total time), request sizes,
 * in-flight depth, merges, requeues, and how the process batched its
 * io_submit / io_uring_enter calls.
 *
 * The programs attach to the block and syscall tracepoints (tp_btf where the
 * kernel allows it, raw_tp otherwise) and keep only histograms in maps,
 * pinned under /sys/fs/bpf/nflash/<tag>/ so that
 * `bpftool map dump pinned /sys/fs/bpf/nflash/<tag>/lat_hist` reads them
 * while the tracer runs (docs/TRACING.md shows the layouts). Needs root, a
 * kernel with BTF (/sys/kernel/btf/vmlinux) and a build with BPF=1; where
 * any is missing nf_iotrace_open() fails with a one-line diagnostic.
 *
 *	struct nf_iotrace *t;
 *	struct nf_iotrace_stats a, b, d;
 *	struct nf_diag dg = {0};
 *	if (nf_iotrace_open(getpid(), NULL, 0, &t, &dg) < 0)
 *		fprintf(stderr, "no tracing: %s\n", dg.msg);
 *	nf_iotrace_snapshot(t, &a);
 *	... do I/O ...
 *	nf_iotrace_snapshot(t, &b);
 *	nf_iotrace_stats_diff(&b, &a, &d);   // the I/O of that period
 *	nf_iotrace_close(t);                 // detaches, removes the pins
 *
 * Thread-safety: one struct nf_iotrace is used by one thread at a time.
 * nf_iotrace_open() changes libbpf's process-wide print callback.
 */
#ifndef NFLASH_IOTRACE_H
#define NFLASH_IOTRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NF_IOTRACE_NSLOTS 32      /* log2 slots per histogram */
#define NF_IOTRACE_PIN_ROOT "/sys/fs/bpf/nflash"

enum nf_iotrace_flag {
	NF_IOTRACE_EVENTS  = 1u << 0,  /* also keep a per-request ring buffer (opt-in) */
	NF_IOTRACE_RAW_TP  = 1u << 1,  /* skip tp_btf, use the raw_tp programs */
	NF_IOTRACE_QUIET   = 1u << 2,  /* no notes on stderr (stale pins removed, fallback) */
	NF_IOTRACE_NO_PIN  = 1u << 3,  /* do not pin the maps */
	NF_IOTRACE_PROG_STATS = 1u << 4, /* have the kernel time the programs (adds two
					    clock reads per run; fills prog_runs/prog_ns) */
};

/* Indices of the latency histograms. */
enum { NF_IOTRACE_READ = 0, NF_IOTRACE_WRITE = 1, NF_IOTRACE_OTHER = 2, NF_IOTRACE_NOP = 3 };
enum { NF_IOTRACE_DEVICE = 0, NF_IOTRACE_TOTAL = 1 };
enum { NF_IOTRACE_IO_SUBMIT = 0, NF_IOTRACE_IO_URING_ENTER = 1 };

/* log2 histogram: slots[i] counts values v with floor(log2(v)) == i (0 in slot 0). */
struct nf_iotrace_histo {
	uint64_t count;
	uint64_t sum;
	uint64_t slots[NF_IOTRACE_NSLOTS];
};

/* Cumulative totals since nf_iotrace_open(); see docs/TRACING.md. */
struct nf_iotrace_stats {
	uint64_t requests, bytes;        /* requests issued to the device, their bytes */
	uint64_t completed, completed_bytes; /* completions seen (latency samples) */
	uint64_t lost;                   /* issued, completion never seen (see docs/TRACING.md) */
	uint64_t bios, bio_bytes;        /* bios the process queued */
	uint64_t merges, requeues;
	uint64_t errors, partial, untimed, dropped;
	uint64_t inflight;               /* gauge at snapshot time (not differenced) */
	uint64_t io_submit_calls, io_submit_iocbs;
	uint64_t uring_enter_calls, uring_enter_sqes;
	uint64_t ev_lost;
	uint64_t splits;                 /* bio splits: requests + merges == bios + splits */
	uint64_t prog_runs, prog_ns;     /* runs and run time of the tracer's programs
					    (only with NF_IOTRACE_PROG_STATS) */
	double t;                        /* nf_iotrace monotonic seconds of the snapshot */
	struct nf_iotrace_histo lat[2][NF_IOTRACE_NOP];  /* [DEVICE|TOTAL][op], microseconds */
	struct nf_iotrace_histo size[NF_IOTRACE_NOP];    /* bytes per request */
	struct nf_iotrace_histo depth;                   /* traced requests in flight at issue */
	struct nf_iotrace_histo qdepth;                  /* device queue at issue: driver tags
							    busy on the hardware queue, all processes */
	struct nf_iotrace_histo batch[2];                /* [IO_SUBMIT|IO_URING_ENTER] */
};

/* One completed request (only with NF_IOTRACE_EVENTS). */
struct nf_iotrace_event {
	uint64_t start_ns, issue_ns, done_ns;  /* CLOCK_MONOTONIC; start_ns 0 if unseen */
	uint64_t sector;
	uint32_t tgid, bytes, op, dev;         /* dev: major << 20 | minor */
	int32_t error;                         /* blk_status_t */
};

struct nf_iotrace;

/*
 * nf_iotrace_open - load, attach and pin the tracer.
 * tgid:  process to trace, 0 for every process.
 * tag:   pin directory name under NF_IOTRACE_PIN_ROOT ([A-Za-z0-9._-], at
 *        most 64 chars); NULL uses the caller's pid.
 * flags: enum nf_iotrace_flag.
 * out:   receives the tracer; the caller frees it with nf_iotrace_close().
 * d:     optional; receives a one-line explanation on failure.
 * First removes pin directories whose owner process is dead (a note on
 * stderr unless NF_IOTRACE_QUIET); mounts bpffs on /sys/fs/bpf if it is not.
 * Returns 0; -EPERM (not root, bpf() refused), NF_EUNSUPPORTED (built
 * without eBPF, no kernel BTF), -EBUSY (tag in use by a live process),
 * NF_EUSAGE (bad tag), or another -errno. Nothing is left behind on failure.
 */
int nf_iotrace_open(pid_t tgid, const char *tag, unsigned flags,
		    struct nf_iotrace **out, struct nf_diag *d);

/* nf_iotrace_snapshot - read every map into *s. Returns 0 or -errno. */
int nf_iotrace_snapshot(struct nf_iotrace *t, struct nf_iotrace_stats *s);

/* nf_iotrace_stats_diff - *d = *now - *before (inflight and t taken from now). */
void nf_iotrace_stats_diff(const struct nf_iotrace_stats *now,
			   const struct nf_iotrace_stats *before,
			   struct nf_iotrace_stats *d);

/* Sums of the per-op histograms into *out (e.g. device latency of all ops). */
void nf_iotrace_histo_sum(const struct nf_iotrace_histo *h, int n, struct nf_iotrace_histo *out);

/*
 * nf_iotrace_histo_quantile - an estimate of quantile q (0..1): linear
 * interpolation inside the log2 slot holding it. 0 if the histogram is empty.
 */
double nf_iotrace_histo_quantile(const struct nf_iotrace_histo *h, double q);

/* The pin directory ("" with NF_IOTRACE_NO_PIN); owned by t. */
const char *nf_iotrace_pin_dir(const struct nf_iotrace *t);

/* "tp_btf" or "raw_tp": which program variant is attached. */
const char *nf_iotrace_mode(const struct nf_iotrace *t);

/*
 * nf_iotrace_events_poll - hand completed-request events to cb, waiting up
 * to timeout_ms for the first. Needs NF_IOTRACE_EVENTS. Returns the number
 * of events consumed, or -errno (-EINTR when a signal arrived).
 */
int nf_iotrace_events_poll(struct nf_iotrace *t, int timeout_ms,
			   void (*cb)(void *ctx, const struct nf_iotrace_event *e), void *ctx);

/*
 * nf_iotrace_close - detach, unpin (removing the tag directory, and the
 * nflash directory if it is then empty), free. Accepts NULL.
 */
void nf_iotrace_close(struct nf_iotrace *t);

/*
 * nf_iotrace_clean_stale - remove pin directories under NF_IOTRACE_PIN_ROOT
 * whose owner process no longer exists, writing one note per directory to
 * stderr unless quiet. Returns the number removed, or -errno.
 */
int nf_iotrace_clean_stale(bool quiet);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_IOTRACE_H */
