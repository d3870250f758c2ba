/*
 * bpf/iotrace.h - structs and constants shared by the kernel side
 * (iotrace.bpf.c) and the loader (iotrace.c). Plain __u32/__u64 only, so
 * both clang -target bpf (with vmlinux.h) and the host compiler (with
 * <linux/types.h>) see identical layouts.
 *
 * Invariants:
 *  1. Every map value here is a multiple of 8 bytes with no implicit padding;
 *     the _Static_asserts at the bottom hold on both sides.
 *  2. Histogram slot i counts values v with floor(log2(v)) == i (v == 0 and
 *     v == 1 both land in slot 0); the last slot also takes everything larger.
 *  3. Values only ever get appended to the enums: docs/TRACING.md documents
 *     them for people reading `bpftool map dump` output.
 */
#ifndef NFLASH_BPF_IOTRACE_H
#define NFLASH_BPF_IOTRACE_H

#define NF_IOTRACE_SLOTS 32

/* Operation of a block request (index into lat_hist and size_hist). */
enum nf_iotrace_op {
	NF_IOTRACE_OP_READ = 0,
	NF_IOTRACE_OP_WRITE = 1,
	NF_IOTRACE_OP_OTHER = 2,   /* flush, discard, write-zeroes, ... */
	NF_IOTRACE_NOPS = 3,
};

/* Which interval a latency histogram measures. */
enum nf_iotrace_phase {
	NF_IOTRACE_PHASE_DEVICE = 0, /* block_rq_issue -> block_rq_complete (last issue) */
	NF_IOTRACE_PHASE_TOTAL = 1,  /* block_io_start -> block_rq_complete */
	NF_IOTRACE_NPHASES = 2,
};

/* Syscall batch histograms (index into sys_hist). */
enum nf_iotrace_sys {
	NF_IOTRACE_SYS_IO_SUBMIT = 0,      /* nr iocbs per io_submit() */
	NF_IOTRACE_SYS_IO_URING_ENTER = 1, /* to_submit per io_uring_enter() */
	NF_IOTRACE_NSYS = 2,
};

/* Which histogram a struct nf_iotrace_hist belongs to (its `kind`). */
enum nf_iotrace_kind {
	NF_IOTRACE_KIND_LAT_US = 1,   /* latency in microseconds */
	NF_IOTRACE_KIND_SIZE_B = 2,   /* request size in bytes */
	NF_IOTRACE_KIND_DEPTH = 3,    /* requests in flight at issue, this one included */
	NF_IOTRACE_KIND_BATCH = 4,    /* entries per submission syscall */
	NF_IOTRACE_KIND_QDEPTH = 5,   /* driver tags busy on the request's hardware queue at issue */
};

/*
 * One log2 histogram. kind, phase and op are written once by the loader
 * before attaching so that a bare `bpftool map dump` is self-describing;
 * the kernel side only adds to count, sum and slots.
 */
struct nf_iotrace_hist {
	__u32 kind;   /* enum nf_iotrace_kind */
	__u32 phase;  /* enum nf_iotrace_phase, or enum nf_iotrace_sys for sys_hist */
	__u32 op;     /* enum nf_iotrace_op (0 where it does not apply) */
	__u32 pad;
	__u64 count;  /* samples */
	__u64 sum;    /* sum of the samples, in the histogram's unit */
	__u64 slots[NF_IOTRACE_SLOTS];
};

/* Totals for the traced process (or every process). One array entry. */
struct nf_iotrace_counters {
	__u64 requests;         /* requests issued to the device (first issue; re-issues not counted) */
	__u64 bytes;            /* their bytes at first issue */
	__u64 bios;             /* bios queued by the process (block_bio_queue) */
	__u64 bio_bytes;        /* their bytes */
	__u64 merges;           /* bio back/front merges into a request + request merges */
	__u64 requeues;         /* block_rq_requeue of a traced request */
	__u64 errors;           /* completions with a non-zero blk_status_t */
	__u64 partial;          /* partial completions (nr_bytes < request bytes) */
	__u64 untimed;          /* completions without an io_start time (kernels before 6.5) */
	__u64 dropped;          /* requests not tracked: the request map refused an insert */
	__u64 inflight;         /* gauge: traced requests issued and not yet completed */
	__u64 io_submit_calls;  /* io_submit(2) calls */
	__u64 io_submit_iocbs;  /* iocbs passed to them */
	__u64 uring_enter_calls;/* io_uring_enter(2) calls */
	__u64 uring_enter_sqes; /* to_submit passed to them */
	__u64 ev_lost;          /* ring buffer events that did not fit */
	__u64 splits;           /* bios the block layer split (each adds a bio) */
	__u64 completed;        /* requests whose final completion was seen */
	__u64 completed_bytes;  /* sum of block_rq_complete nr_bytes */
	__u64 lost;             /* issued requests whose completion never reached BPF
				   (detected when the struct request is reused) */
	__u64 pad[4];           /* room to append counters without moving these */
};

/* Per-request state kept between io_start/issue and completion. */
struct nf_iotrace_req {
	__u64 start_ns;   /* block_io_start time, 0 if not seen */
	__u64 issue_ns;   /* last block_rq_issue time, 0 while not issued */
	__u32 tgid;       /* submitting process */
	__u32 bytes;      /* request bytes at first issue */
	__u32 op;         /* enum nf_iotrace_op */
	__u32 flags;      /* NF_IOTRACE_REQ_* */
};

/* Opt-in per-request event (ring buffer "events"). */
struct nf_iotrace_rec {
	__u64 start_ns;   /* 0 if io_start was not seen */
	__u64 issue_ns;
	__u64 done_ns;
	__u64 sector;
	__u32 tgid;
	__u32 bytes;
	__u32 op;
	__s32 error;      /* blk_status_t of the completion */
	__u32 dev;        /* device number of the disk (MKDEV layout: major << 20 | minor) */
	__u32 pad;
};

/* Who owns a pin directory: lets a later run detect pins of a dead process. */
struct nf_iotrace_owner {
	__u32 pid;          /* the tracer process */
	__u32 target_tgid;  /* the traced process, 0 for all */
	__u64 start_ticks;  /* the tracer's start time (/proc/PID/stat field 22) */
};

#define NF_IOTRACE_REQ_ISSUED  1u  /* between issue and complete/requeue */
#define NF_IOTRACE_REQ_COUNTED 2u  /* counted in requests/bytes (first issue) */
#define NF_IOTRACE_REQ_TRACKED 4u  /* a request of the target, not yet completed or merged */

#define NF_IOTRACE_MAX_REQS 16384

_Static_assert(sizeof(struct nf_iotrace_hist) == 16 + 16 + 8 * NF_IOTRACE_SLOTS, "hist layout");
_Static_assert(sizeof(struct nf_iotrace_counters) == 24 * 8, "counters layout");
_Static_assert(sizeof(struct nf_iotrace_req) == 32, "req layout");
_Static_assert(sizeof(struct nf_iotrace_rec) == 56, "event layout");
_Static_assert(sizeof(struct nf_iotrace_owner) == 16, "owner layout");

#endif
