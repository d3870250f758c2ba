// SPDX-License-Identifier: GPL-2.0
/*
 * bpf/iotrace.bpf.c - kernel side of nflash's block-I/O tracer: log2
 * histograms of request latency, size, in-flight depth and submission batch
 * size for one process (or all), kept in maps the loader pins for bpftool.
 *
 * Every program exists twice: SEC("tp_btf/...") for kernels with BTF
 * tracepoints and SEC("raw_tp/...") as the fallback; the loader enables
 * exactly one set with bpf_program__set_autoload(). Both call the same
 * handler, which reads kernel structs only through BPF_CORE_READ.
 *
 * Invariants:
 *  1. A request is tracked from block_io_start, which runs in the
 *     submitting process's context (on kernels without that tracepoint,
 *     from block_rq_issue, a best guess); completion runs in irq/kworker
 *     context and never consults the current task.
 *  2. A tracked request is counted (requests, bytes, size histogram) once,
 *     at its first issue; requeued requests are re-issued and keep their
 *     entry; merged-away requests are dropped from the map and counted as
 *     merges. Latency is recorded at the final completion, which is the
 *     only event that can go missing (counted as `lost` on reuse).
 *  3. counters.inflight is the number of tracked requests between issue and
 *     completion/requeue; the depth histogram samples it at each issue.
 *  4. Nothing here allocates beyond the fixed-size maps. Request entries
 *     are never deleted but rewritten in place when the kernel reuses the
 *     struct request; the LRU map drops entries of requests unused for
 *     NF_IOTRACE_MAX_REQS insertions, never one in flight in practice.
 *     An entry counts only while it has NF_IOTRACE_REQ_TRACKED.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "iotrace.h"

char LICENSE[] SEC("license") = "GPL";

/* Set by the loader between open and load. */
const volatile __u32 target_tgid = 0;     /* 0: every process */
const volatile __u32 emit_events = 0;     /* 1: per-request ring buffer records */
const volatile __u32 have_io_start = 1;   /* 0: kernel without block_io_start (< 6.5) */

#define NF_REQ_OP_MASK 0xff
#define NF_NR_IO_SUBMIT 209        /* x86_64 */
#define NF_NR_IO_URING_ENTER 426   /* every architecture */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NF_IOTRACE_NPHASES * NF_IOTRACE_NOPS);
	__type(key, __u32);
	__type(value, struct nf_iotrace_hist);
} lat_hist SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NF_IOTRACE_NOPS);
	__type(key, __u32);
	__type(value, struct nf_iotrace_hist);
} size_hist SEC(".maps");

/* 0: traced requests in flight (our gauge); 1: the device's queue (driver tags busy) */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct nf_iotrace_hist);
} depth_hist SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NF_IOTRACE_NSYS);
	__type(key, __u32);
	__type(value, struct nf_iotrace_hist);
} sys_hist SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nf_iotrace_counters);
} counters SEC(".maps");

/* Written once by the loader; never touched by the programs. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nf_iotrace_owner);
} owner SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, NF_IOTRACE_MAX_REQS);
	__type(key, __u64);                   /* struct request * */
	__type(value, struct nf_iotrace_req);
} reqs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);            /* the loader enlarges it when events are on */
} events SEC(".maps");

static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0, s;

	s = (v > 0xffffffffULL) << 5; v >>= s; r |= s;
	s = (v > 0xffff) << 4; v >>= s; r |= s;
	s = (v > 0xff) << 3; v >>= s; r |= s;
	s = (v > 0xf) << 2; v >>= s; r |= s;
	s = (v > 0x3) << 1; v >>= s; r |= s;
	r |= (v >> 1);
	return r;
}

static __always_inline void hist_add(void *map, __u32 idx, __u64 v)
{
	struct nf_iotrace_hist *h = bpf_map_lookup_elem(map, &idx);
	__u32 slot;

	if (!h)
		return;
	slot = log2_u64(v);
	if (slot >= NF_IOTRACE_SLOTS)
		slot = NF_IOTRACE_SLOTS - 1;
	__sync_fetch_and_add(&h->slots[slot & (NF_IOTRACE_SLOTS - 1)], 1);
	__sync_fetch_and_add(&h->count, 1);
	__sync_fetch_and_add(&h->sum, v);
}

#define NF_MAX_SB_WORDS 64   /* 4096 tags at 64 per word */

/*
 * Requests holding a driver tag on rq's hardware queue, i.e. dispatched to
 * the driver and not yet completed, from every process: the kernel's own
 * view of the device queue, immune to completions we never see.
 */
static __always_inline __u32 device_depth(struct request *rq)
{
	struct blk_mq_tags *tags = BPF_CORE_READ(rq, mq_hctx, tags);
	struct sbitmap_word *map;
	__u32 map_nr, stride, n = 0;

	if (!tags)
		return 0;
	map_nr = BPF_CORE_READ(tags, bitmap_tags.sb.map_nr);
	map = BPF_CORE_READ(tags, bitmap_tags.sb.map);
	stride = bpf_core_type_size(struct sbitmap_word);
	for (__u32 i = 0; i < NF_MAX_SB_WORDS; i++) {
		struct sbitmap_word *w;
		unsigned long word, cleared;

		if (i >= map_nr)
			break;
		w = (void *)map + (__u64)i * stride;
		word = BPF_CORE_READ(w, word);
		cleared = BPF_CORE_READ(w, cleared);
		n += __builtin_popcountl(word & ~cleared);
	}
	return n;
}

static __always_inline struct nf_iotrace_counters *ctrs(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&counters, &zero);
}

static __always_inline bool current_is_target(void)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;

	return target_tgid == 0 || tgid == target_tgid;
}

static __always_inline __u32 rq_op(struct request *rq)
{
	__u32 op = BPF_CORE_READ(rq, cmd_flags) & NF_REQ_OP_MASK;

	if (op == 0)
		return NF_IOTRACE_OP_READ;
	if (op == 1)
		return NF_IOTRACE_OP_WRITE;
	return NF_IOTRACE_OP_OTHER;
}

/*
 * (Re)starts tracking rq for the current task. Entries are never deleted:
 * the kernel reuses a small set of struct requests, so an entry is
 * rewritten in place next time (no map update on the hot path), and the
 * LRU map evicts entries of requests that are no longer used.
 */
static __always_inline struct nf_iotrace_req *track(struct request *rq, struct nf_iotrace_req *r,
						    __u64 start_ns)
{
	struct nf_iotrace_req n = {};
	__u64 key = (__u64)rq;
	struct nf_iotrace_counters *c;

	n.start_ns = start_ns;
	n.tgid = bpf_get_current_pid_tgid() >> 32;
	n.op = rq_op(rq);
	n.flags = NF_IOTRACE_REQ_TRACKED;
	if (r) {
		*r = n;
		return r;
	}
	if (bpf_map_update_elem(&reqs, &key, &n, BPF_ANY) < 0) {
		c = ctrs();
		if (c)
			__sync_fetch_and_add(&c->dropped, 1);
		return NULL;
	}
	return bpf_map_lookup_elem(&reqs, &key);
}

static __always_inline int on_io_start(struct request *rq)
{
	__u64 key = (__u64)rq;
	struct nf_iotrace_req *r = bpf_map_lookup_elem(&reqs, &key);
	struct nf_iotrace_counters *c;

	/*
	 * A struct request is reused only after it completed, so an entry
	 * still marked issued means its completion never reached us (seen on
	 * virtio-blk for a fraction of a percent of requests). Checked for
	 * every process: any of them may get the request next.
	 */
	if (r) {
		if (r->flags & NF_IOTRACE_REQ_ISSUED) {
			c = ctrs();
			if (c) {
				__sync_fetch_and_add(&c->lost, 1);
				__sync_fetch_and_add(&c->inflight, -1);
			}
		}
		if (!current_is_target()) {
			r->flags = 0;   /* another process's request now */
			return 0;
		}
	} else if (!current_is_target()) {
		return 0;
	}
	track(rq, r, bpf_ktime_get_ns());
	return 0;
}

static __always_inline int on_rq_issue(struct request *rq)
{
	__u64 key = (__u64)rq;
	struct nf_iotrace_req *r = bpf_map_lookup_elem(&reqs, &key);
	struct nf_iotrace_counters *c;
	__u64 depth;
	__u32 bytes;

	if (!r || !(r->flags & NF_IOTRACE_REQ_TRACKED)) {
		/*
		 * Whoever runs the hardware queue issues requests of every
		 * process, so the current task names the submitter only on
		 * kernels without block_io_start, where this is the best guess.
		 * With io_start, an unknown request was queued before we
		 * attached, or by another process: not ours.
		 */
		if (have_io_start || !current_is_target())
			return 0;
		r = track(rq, r, 0);
		if (!r)
			return 0;
	}
	if (r->flags & NF_IOTRACE_REQ_ISSUED)
		return 0;
	c = ctrs();
	if (!c)
		return 0;
	if (!(r->flags & NF_IOTRACE_REQ_COUNTED)) {
		bytes = BPF_CORE_READ(rq, __data_len);
		r->bytes = bytes;
		__sync_fetch_and_add(&c->requests, 1);
		__sync_fetch_and_add(&c->bytes, bytes);
		hist_add(&size_hist, r->op < NF_IOTRACE_NOPS ? r->op : NF_IOTRACE_OP_OTHER, bytes);
	}
	r->issue_ns = bpf_ktime_get_ns();
	r->flags = NF_IOTRACE_REQ_TRACKED | NF_IOTRACE_REQ_ISSUED | NF_IOTRACE_REQ_COUNTED;
	depth = __sync_fetch_and_add(&c->inflight, 1) + 1;
	hist_add(&depth_hist, 0, depth);
	hist_add(&depth_hist, 1, device_depth(rq));
	return 0;
}

static __always_inline int on_rq_requeue(struct request *rq)
{
	__u64 key = (__u64)rq;
	struct nf_iotrace_req *r = bpf_map_lookup_elem(&reqs, &key);
	struct nf_iotrace_counters *c = ctrs();

	if (!r || !c || !(r->flags & NF_IOTRACE_REQ_TRACKED))
		return 0;
	__sync_fetch_and_add(&c->requeues, 1);
	if (r->flags & NF_IOTRACE_REQ_ISSUED) {
		r->flags &= ~NF_IOTRACE_REQ_ISSUED;
		__sync_fetch_and_add(&c->inflight, -1);
	}
	return 0;
}

static __always_inline int on_rq_merge(struct request *next)
{
	__u64 key = (__u64)next;
	struct nf_iotrace_req *r = bpf_map_lookup_elem(&reqs, &key);
	struct nf_iotrace_counters *c = ctrs();

	if (!r || !c || !(r->flags & NF_IOTRACE_REQ_TRACKED))
		return 0;
	__sync_fetch_and_add(&c->merges, 1);
	r->flags = 0;
	return 0;
}

static __always_inline void emit(struct request *rq, struct nf_iotrace_req *r,
				 __u64 now, int error)
{
	struct nf_iotrace_rec *e;
	struct nf_iotrace_counters *c;

	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		c = ctrs();
		if (c)
			__sync_fetch_and_add(&c->ev_lost, 1);
		return;
	}
	e->start_ns = r->start_ns;
	e->issue_ns = r->issue_ns;
	e->done_ns = now;
	e->sector = BPF_CORE_READ(rq, __sector);
	e->tgid = r->tgid;
	e->bytes = r->bytes;
	e->op = r->op;
	e->error = error;
	e->dev = BPF_CORE_READ(rq, q, disk, major) << 20 | BPF_CORE_READ(rq, q, disk, first_minor);
	e->pad = 0;
	bpf_ringbuf_submit(e, 0);
}

static __always_inline int on_rq_complete(struct request *rq, int error, __u32 nr_bytes)
{
	__u64 key = (__u64)rq;
	struct nf_iotrace_req *r = bpf_map_lookup_elem(&reqs, &key);
	struct nf_iotrace_counters *c = ctrs();
	__u64 now, left;
	__u32 op;

	if (!r || !c || !(r->flags & NF_IOTRACE_REQ_TRACKED))
		return 0;
	__sync_fetch_and_add(&c->completed_bytes, nr_bytes);
	left = BPF_CORE_READ(rq, __data_len);
	if (nr_bytes < left) {
		__sync_fetch_and_add(&c->partial, 1);
		return 0;
	}
	now = bpf_ktime_get_ns();
	op = r->op < NF_IOTRACE_NOPS ? r->op : NF_IOTRACE_OP_OTHER;
	__sync_fetch_and_add(&c->completed, 1);
	if (error)
		__sync_fetch_and_add(&c->errors, 1);
	if (r->flags & NF_IOTRACE_REQ_ISSUED) {
		__sync_fetch_and_add(&c->inflight, -1);
		hist_add(&lat_hist, NF_IOTRACE_PHASE_DEVICE * NF_IOTRACE_NOPS + op,
			 (now - r->issue_ns) / 1000);
	}
	if (r->start_ns)
		hist_add(&lat_hist, NF_IOTRACE_PHASE_TOTAL * NF_IOTRACE_NOPS + op,
			 (now - r->start_ns) / 1000);
	else
		__sync_fetch_and_add(&c->untimed, 1);
	if (emit_events)
		emit(rq, r, now, error);
	r->flags = 0;   /* kept for the next use of this struct request */
	return 0;
}

static __always_inline int on_bio_queue(struct bio *bio)
{
	struct nf_iotrace_counters *c;

	if (!current_is_target())
		return 0;
	c = ctrs();
	if (!c)
		return 0;
	__sync_fetch_and_add(&c->bios, 1);
	__sync_fetch_and_add(&c->bio_bytes, BPF_CORE_READ(bio, bi_iter.bi_size));
	return 0;
}

static __always_inline int on_bio_merge(struct bio *bio)
{
	struct nf_iotrace_counters *c;

	if (!current_is_target())
		return 0;
	c = ctrs();
	if (c)
		__sync_fetch_and_add(&c->merges, 1);
	return 0;
}

static __always_inline int on_bio_split(struct bio *bio)
{
	struct nf_iotrace_counters *c;

	if (!current_is_target())
		return 0;
	c = ctrs();
	if (c)
		__sync_fetch_and_add(&c->splits, 1);
	return 0;
}

static __always_inline int on_sys_enter(struct pt_regs *regs, long id)
{
	struct nf_iotrace_counters *c;
	__u64 n;

	if (id != NF_NR_IO_SUBMIT && id != NF_NR_IO_URING_ENTER)
		return 0;
	if (!current_is_target())
		return 0;
	c = ctrs();
	if (!c)
		return 0;
	n = PT_REGS_PARM2_CORE(regs);
	if (id == NF_NR_IO_SUBMIT) {
		__sync_fetch_and_add(&c->io_submit_calls, 1);
		__sync_fetch_and_add(&c->io_submit_iocbs, n);
		hist_add(&sys_hist, NF_IOTRACE_SYS_IO_SUBMIT, n);
	} else {
		__sync_fetch_and_add(&c->uring_enter_calls, 1);
		__sync_fetch_and_add(&c->uring_enter_sqes, n);
		hist_add(&sys_hist, NF_IOTRACE_SYS_IO_URING_ENTER, n);
	}
	return 0;
}

/* tp_btf variants (typed arguments, need kernel BTF). */
SEC("tp_btf/block_io_start")
int BPF_PROG(btf_io_start, struct request *rq) { return on_io_start(rq); }
SEC("tp_btf/block_rq_issue")
int BPF_PROG(btf_rq_issue, struct request *rq) { return on_rq_issue(rq); }
SEC("tp_btf/block_rq_requeue")
int BPF_PROG(btf_rq_requeue, struct request *rq) { return on_rq_requeue(rq); }
SEC("tp_btf/block_rq_merge")
int BPF_PROG(btf_rq_merge, struct request *rq) { return on_rq_merge(rq); }
SEC("tp_btf/block_rq_complete")
int BPF_PROG(btf_rq_complete, struct request *rq, int error, unsigned int nr_bytes)
{ return on_rq_complete(rq, error, nr_bytes); }
SEC("tp_btf/block_bio_queue")
int BPF_PROG(btf_bio_queue, struct bio *bio) { return on_bio_queue(bio); }
SEC("tp_btf/block_bio_backmerge")
int BPF_PROG(btf_bio_backmerge, struct bio *bio) { return on_bio_merge(bio); }
SEC("tp_btf/block_bio_frontmerge")
int BPF_PROG(btf_bio_frontmerge, struct bio *bio) { return on_bio_merge(bio); }
SEC("tp_btf/block_split")
int BPF_PROG(btf_bio_split, struct bio *bio, unsigned int new_sector) { return on_bio_split(bio); }
SEC("tp_btf/sys_enter")
int BPF_PROG(btf_sys_enter, struct pt_regs *regs, long id) { return on_sys_enter(regs, id); }

/* raw_tp fallbacks (untyped u64 arguments; no kernel BTF needed to attach). */
SEC("raw_tp/block_io_start")
int BPF_PROG(raw_io_start, struct request *rq) { return on_io_start(rq); }
SEC("raw_tp/block_rq_issue")
int BPF_PROG(raw_rq_issue, struct request *rq) { return on_rq_issue(rq); }
SEC("raw_tp/block_rq_requeue")
int BPF_PROG(raw_rq_requeue, struct request *rq) { return on_rq_requeue(rq); }
SEC("raw_tp/block_rq_merge")
int BPF_PROG(raw_rq_merge, struct request *rq) { return on_rq_merge(rq); }
SEC("raw_tp/block_rq_complete")
int BPF_PROG(raw_rq_complete, struct request *rq, int error, unsigned int nr_bytes)
{ return on_rq_complete(rq, error, nr_bytes); }
SEC("raw_tp/block_bio_queue")
int BPF_PROG(raw_bio_queue, struct bio *bio) { return on_bio_queue(bio); }
SEC("raw_tp/block_bio_backmerge")
int BPF_PROG(raw_bio_backmerge, struct bio *bio) { return on_bio_merge(bio); }
SEC("raw_tp/block_bio_frontmerge")
int BPF_PROG(raw_bio_frontmerge, struct bio *bio) { return on_bio_merge(bio); }
SEC("raw_tp/block_split")
int BPF_PROG(raw_bio_split, struct bio *bio, unsigned int new_sector) { return on_bio_split(bio); }
SEC("raw_tp/sys_enter")
int BPF_PROG(raw_sys_enter, struct pt_regs *regs, long id) { return on_sys_enter(regs, id); }
