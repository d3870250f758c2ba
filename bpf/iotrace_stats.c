/*
 * bpf/iotrace_stats.c - arithmetic on struct nf_iotrace_stats snapshots
 * (differences, sums, quantile estimates). Pure functions with no libbpf
 * dependency, so they are built with BPF=0 as well (bpf/bpf.mk).
 *
 * Invariants:
 *  1. Slot i of a histogram covers [2^i, 2^(i+1)) except slot 0, [0, 2).
 *  2. Differences never wrap: a counter that went down (cannot happen with
 *     one tracer) yields 0.
 */
#include <string.h>

#include "nflash/iotrace.h"

static uint64_t nf_sub(uint64_t a, uint64_t b)
{
	return a > b ? a - b : 0;
}

static void nf_histo_diff(const struct nf_iotrace_histo *a, const struct nf_iotrace_histo *b,
			  struct nf_iotrace_histo *d)
{
	d->count = nf_sub(a->count, b->count);
	d->sum = nf_sub(a->sum, b->sum);
	for (int i = 0; i < NF_IOTRACE_NSLOTS; i++)
		d->slots[i] = nf_sub(a->slots[i], b->slots[i]);
}

void nf_iotrace_stats_diff(const struct nf_iotrace_stats *now,
			   const struct nf_iotrace_stats *before,
			   struct nf_iotrace_stats *d)
{
	struct nf_iotrace_stats r;

	memset(&r, 0, sizeof(r));
	r.requests = nf_sub(now->requests, before->requests);
	r.bytes = nf_sub(now->bytes, before->bytes);
	r.bios = nf_sub(now->bios, before->bios);
	r.bio_bytes = nf_sub(now->bio_bytes, before->bio_bytes);
	r.merges = nf_sub(now->merges, before->merges);
	r.requeues = nf_sub(now->requeues, before->requeues);
	r.errors = nf_sub(now->errors, before->errors);
	r.partial = nf_sub(now->partial, before->partial);
	r.untimed = nf_sub(now->untimed, before->untimed);
	r.dropped = nf_sub(now->dropped, before->dropped);
	r.inflight = now->inflight;
	r.io_submit_calls = nf_sub(now->io_submit_calls, before->io_submit_calls);
	r.io_submit_iocbs = nf_sub(now->io_submit_iocbs, before->io_submit_iocbs);
	r.uring_enter_calls = nf_sub(now->uring_enter_calls, before->uring_enter_calls);
	r.uring_enter_sqes = nf_sub(now->uring_enter_sqes, before->uring_enter_sqes);
	r.ev_lost = nf_sub(now->ev_lost, before->ev_lost);
	r.splits = nf_sub(now->splits, before->splits);
	r.completed = nf_sub(now->completed, before->completed);
	r.completed_bytes = nf_sub(now->completed_bytes, before->completed_bytes);
	r.lost = nf_sub(now->lost, before->lost);
	r.prog_runs = nf_sub(now->prog_runs, before->prog_runs);
	r.prog_ns = nf_sub(now->prog_ns, before->prog_ns);
	r.t = now->t;
	for (int ph = 0; ph < 2; ph++)
		for (int op = 0; op < NF_IOTRACE_NOP; op++)
			nf_histo_diff(&now->lat[ph][op], &before->lat[ph][op], &r.lat[ph][op]);
	for (int op = 0; op < NF_IOTRACE_NOP; op++)
		nf_histo_diff(&now->size[op], &before->size[op], &r.size[op]);
	nf_histo_diff(&now->depth, &before->depth, &r.depth);
	nf_histo_diff(&now->qdepth, &before->qdepth, &r.qdepth);
	for (int i = 0; i < 2; i++)
		nf_histo_diff(&now->batch[i], &before->batch[i], &r.batch[i]);
	*d = r;
}

void nf_iotrace_histo_sum(const struct nf_iotrace_histo *h, int n, struct nf_iotrace_histo *out)
{
	struct nf_iotrace_histo r;

	memset(&r, 0, sizeof(r));
	for (int k = 0; k < n; k++) {
		r.count += h[k].count;
		r.sum += h[k].sum;
		for (int i = 0; i < NF_IOTRACE_NSLOTS; i++)
			r.slots[i] += h[k].slots[i];
	}
	*out = r;
}

double nf_iotrace_histo_quantile(const struct nf_iotrace_histo *h, double q)
{
	uint64_t total = 0, seen = 0;
	double rank;

	for (int i = 0; i < NF_IOTRACE_NSLOTS; i++)
		total += h->slots[i];
	if (total == 0)
		return 0.0;
	if (q < 0)
		q = 0;
	if (q > 1)
		q = 1;
	rank = q * (double)total;
	for (int i = 0; i < NF_IOTRACE_NSLOTS; i++) {
		double lo = i == 0 ? 0.0 : (double)(1ull << i);
		double hi = (double)(2ull << i);

		if (h->slots[i] && (double)(seen + h->slots[i]) >= rank)
			return lo + (hi - lo) * ((rank - (double)seen) / (double)h->slots[i]);
		seen += h->slots[i];
	}
	return (double)(2ull << (NF_IOTRACE_NSLOTS - 1));
}
