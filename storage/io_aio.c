/*
 * io_aio.c - the libaio backend: O_DIRECT reads submitted with io_submit
 * in batches and reaped with io_getevents.
 *
 * Invariants: one kernel AIO context of qd entries per I/O context; submit
 * and reap may run in two threads at once (completion-thread mode), so
 * inflight is updated atomically and only reap touches the event array; every
 * iocb lives in its segment, so nothing is allocated per read; events carry
 * the segment pointer in their data field; -EAGAIN from io_submit means
 * "full", not failure.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "io_internal.h"

struct aio_priv {
	io_context_t ctx;
	struct iocb **cbs;
	struct io_event *ev;
};

static int aio_be_init(struct nf_io_be *be)
{
	struct aio_priv *p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->cbs = calloc(be->qd, sizeof(*p->cbs));
	p->ev = calloc(be->qd, sizeof(*p->ev));
	int rc = p->cbs && p->ev ? be->sys->kaio_setup((int)be->qd, &p->ctx) : -ENOMEM;
	if (rc < 0) {
		free(p->cbs);
		free(p->ev);
		free(p);
		return rc;
	}
	be->priv = p;
	return 0;
}

static void aio_be_fini(struct nf_io_be *be)
{
	struct aio_priv *p = be->priv;
	if (!p)
		return;
	be->sys->kaio_destroy(p->ctx);
	free(p->cbs);
	free(p->ev);
	free(p);
	be->priv = NULL;
}

static int aio_be_submit(struct nf_io_be *be, struct nf_io_seg **segs, unsigned int n)
{
	struct aio_priv *p = be->priv;
	for (unsigned int i = 0; i < n; i++) {
		struct nf_io_seg *s = segs[i];
		io_prep_pread(&s->iocb, be->fd, s->buf, s->len, (long long)s->offset);
		s->iocb.data = s;
		p->cbs[i] = &s->iocb;
		NF_TSAN_RELEASE(s);     /* the kernel orders this before the reap */
	}
	int r;
	do
		r = be->sys->kaio_submit(p->ctx, (long)n, p->cbs);
	while (r == -EINTR);
	if (r == -EAGAIN)
		return 0;
	if (r < 0)
		return r;
	__atomic_add_fetch(&be->inflight, (unsigned)r, __ATOMIC_RELAXED);
	return r;
}

static int aio_be_reap(struct nf_io_be *be, unsigned int min, unsigned int max, int64_t timeout_ns,
		       struct nf_io_seg **out)
{
	struct aio_priv *p = be->priv;
	struct timespec ts, *tp = NULL;
	if (max > be->qd)
		max = be->qd;
	unsigned int inflight = __atomic_load_n(&be->inflight, __ATOMIC_RELAXED);
	if (min > inflight)
		min = inflight;
	if (timeout_ns >= 0) {
		ts.tv_sec = timeout_ns / 1000000000;
		ts.tv_nsec = timeout_ns % 1000000000;
		tp = &ts;
	}
	int r = be->sys->kaio_getevents(p->ctx, (long)min, (long)max, p->ev, tp);
	if (r < 0)
		return r;
	for (int i = 0; i < r; i++) {
		struct nf_io_seg *s = p->ev[i].data;
		NF_TSAN_ACQUIRE(s);
		s->res = (long)p->ev[i].res;
		out[i] = s;
	}
	__atomic_sub_fetch(&be->inflight, (unsigned)r, __ATOMIC_RELAXED);
	return r;
}

const struct nf_io_be_ops nf_io_be_aio = {
	.name = "aio",
	.init = aio_be_init,
	.fini = aio_be_fini,
	.submit = aio_be_submit,
	.reap = aio_be_reap,
};
