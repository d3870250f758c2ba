/*
 * io_fault.c - a backend that wraps another one and makes chosen reads
 * fail with EIO, come back short, or complete late. Tests use it to drive
 * the engine's error paths with real I/O underneath.
 *
 * Invariants:
 *  1. Reads are numbered 0, 1, 2... in submission order; a rule hits read
 *     number nth, or each read with probability prob drawn from a PRNG
 *     seeded by the options, so a run is reproducible. The first matching
 *     rule decides.
 *  2. EIO reads never reach the inner backend; short reads are real reads
 *     whose result is cut to half (rounded down to 512 bytes); late reads
 *     are real reads held back until their due time.
 *  3. inflight counts every segment not yet returned by reap: in the inner
 *     backend, held back, or failed and waiting to be reaped.
 */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "io_internal.h"

struct fault_priv {
	struct nf_io_be inner;
	uint64_t count;           /* reads numbered so far */
	uint64_t rng;
	struct nf_io_seg *ready;  /* failed at submission, LIFO is fine */
	struct nf_io_seg *late;   /* held back, sorted by due time */
};

static uint64_t next_rand(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static int fault_be_init(struct nf_io_be *be)
{
	struct fault_priv *p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->inner = *be;
	p->inner.ops = be->inner_ops;
	p->inner.inflight = 0;
	p->inner.priv = NULL;
	p->rng = be->fault->seed;
	int rc = p->inner.ops->init(&p->inner);
	if (rc < 0) {
		free(p);
		return rc;
	}
	be->priv = p;
	return 0;
}

static void fault_be_fini(struct nf_io_be *be)
{
	struct fault_priv *p = be->priv;
	if (!p)
		return;
	p->inner.ops->fini(&p->inner);
	free(p);
	be->priv = NULL;
}

static void decide(struct fault_priv *p, const struct nf_io_fault_opts *f, struct nf_io_seg *s)
{
	uint64_t n = p->count++;
	s->fault = 0;
	for (unsigned int i = 0; i < f->n_rules; i++) {
		const struct nf_io_fault_rule *r = &f->rules[i];
		bool hit;
		if (r->prob > 0)
			hit = (double)(next_rand(&p->rng) >> 11) * 0x1.0p-53 < r->prob;
		else
			hit = r->nth == n;
		if (hit) {
			s->fault = (int)r->kind;
			s->delay_us = r->delay_us;
			return;
		}
	}
}

static int fault_be_submit(struct nf_io_be *be, struct nf_io_seg **segs, unsigned int n)
{
	struct fault_priv *p = be->priv;
	unsigned int i;
	for (i = 0; i < n; i++) {
		struct nf_io_seg *s = segs[i];
		uint64_t count = p->count, rng = p->rng;
		decide(p, be->fault, s);
		if (s->fault == NF_IO_FAULT_EIO) {
			s->res = -EIO;
			s->next = p->ready;
			p->ready = s;
			be->inflight++;
			continue;
		}
		int r = p->inner.ops->submit(&p->inner, &s, 1);
		if (r <= 0) {
			p->count = count;   /* not submitted: this read keeps its number */
			p->rng = rng;
			if (r < 0 && i == 0)
				return r;
			break;
		}
		be->inflight++;
	}
	return (int)i;
}

static void hold(struct fault_priv *p, struct nf_io_seg *s)
{
	s->due = nf_io_now_ns() + (uint64_t)s->delay_us * 1000;
	struct nf_io_seg **pp = &p->late;
	while (*pp && (*pp)->due <= s->due)
		pp = &(*pp)->next;
	s->next = *pp;
	*pp = s;
}

static int fault_be_reap(struct nf_io_be *be, unsigned int min, unsigned int max, int64_t timeout_ns,
			 struct nf_io_seg **out)
{
	struct fault_priv *p = be->priv;
	uint64_t deadline = timeout_ns < 0 ? UINT64_MAX : nf_io_now_ns() + (uint64_t)timeout_ns;
	unsigned int got = 0;
	if (min > be->inflight)
		min = be->inflight;
	for (;;) {
		uint64_t now = nf_io_now_ns();
		while (got < max && p->ready) {
			out[got++] = p->ready;
			p->ready = p->ready->next;
		}
		while (got < max && p->late && p->late->due <= now) {
			out[got++] = p->late;
			p->late = p->late->next;
		}
		/* Collect what the inner backend has without waiting when we are
		 * done, else wait for it up to the next due time. */
		bool enough = got >= min || got >= max;
		uint64_t until = deadline;
		if (p->late && p->late->due < until)
			until = p->late->due;
		int64_t wait_ns = enough ? 0 : (until == UINT64_MAX ? -1 : (int64_t)(until > now ? until - now : 0));
		if (p->inner.inflight > 0 && got < max) {
			int r = p->inner.ops->reap(&p->inner, enough ? 0 : 1, max - got, wait_ns, out + got);
			if (r < 0 && r != -EINTR) {
				be->inflight -= got;
				return got ? (int)got : r;
			}
			for (int k = 0; k < r; k++) {
				struct nf_io_seg *s = out[got + k];
				if (s->fault == NF_IO_FAULT_SHORT && s->res > 0)
					s->res = (s->res / 2) & ~(int64_t)511;
				if (s->fault == NF_IO_FAULT_DELAY) {
					hold(p, s);
					out[got + k] = NULL;
				}
			}
			/* compact out the held-back ones */
			unsigned int w = got;
			for (int k = 0; k < (r > 0 ? r : 0); k++)
				if (out[got + k])
					out[w++] = out[got + k];
			got = w;
		} else if (!enough && p->late) {
			struct timespec ts = { (time_t)(wait_ns / 1000000000), (long)(wait_ns % 1000000000) };
			nanosleep(&ts, NULL);
		}
		if (got >= min || got >= max || nf_io_now_ns() >= deadline ||
		    (p->inner.inflight == 0 && !p->late && !p->ready)) {
			be->inflight -= got;
			return (int)got;
		}
	}
}

const struct nf_io_be_ops nf_io_be_fault = {
	.name = "fault",
	.init = fault_be_init,
	.fini = fault_be_fini,
	.submit = fault_be_submit,
	.reap = fault_be_reap,
};
