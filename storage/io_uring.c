/*
 * io_uring.c - the io_uring backend (liburing): the same semantics as the
 * libaio one, with reads prepared in the submission ring and submitted
 * with one io_uring_submit per batch.
 *
 * Invariants: the ring has qd entries and the engine never has more than
 * qd reads in flight, so a submission slot is always free for each of
 * them; user_data carries the segment pointer. Submission (SQ) and reaping
 * (CQ) may run in two threads at once (completion-thread mode): each side
 * has one user, and inflight is updated atomically.
 */
#include <errno.h>
#include <liburing.h>
#include <stdlib.h>

#include "io_internal.h"

static int uring_be_init(struct nf_io_be *be)
{
	struct io_uring *ring = calloc(1, sizeof(*ring));
	if (!ring)
		return -ENOMEM;
	int rc = be->sys->uring_init(be->qd, ring, 0);
	if (rc < 0) {
		free(ring);
		return rc;
	}
	be->priv = ring;
	return 0;
}

static void uring_be_fini(struct nf_io_be *be)
{
	if (!be->priv)
		return;
	be->sys->uring_exit(be->priv);
	free(be->priv);
	be->priv = NULL;
}

static int uring_be_submit(struct nf_io_be *be, struct nf_io_seg **segs, unsigned int n)
{
	struct io_uring *ring = be->priv;
	unsigned int i;
	for (i = 0; i < n; i++) {
		struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
		if (!sqe)
			break;
		io_uring_prep_read(sqe, be->fd, segs[i]->buf, segs[i]->len, segs[i]->offset);
		io_uring_sqe_set_data(sqe, segs[i]);
		NF_TSAN_RELEASE(segs[i]);   /* the kernel orders this before the reap */
	}
	if (i == 0)
		return 0;
	int r;
	do
		r = be->sys->uring_submit(ring);
	while (r == -EINTR);
	if (r < 0)
		return r;
	__atomic_add_fetch(&be->inflight, i, __ATOMIC_RELAXED);
	return (int)i;
}

static int uring_be_reap(struct nf_io_be *be, unsigned int min, unsigned int max, int64_t timeout_ns,
			 struct nf_io_seg **out)
{
	struct io_uring *ring = be->priv;
	unsigned int got = 0;
	uint64_t deadline = timeout_ns < 0 ? 0 : nf_io_now_ns() + (uint64_t)timeout_ns;
	unsigned int inflight = __atomic_load_n(&be->inflight, __ATOMIC_RELAXED);
	if (min > inflight)
		min = inflight;
	for (;;) {
		struct io_uring_cqe *cqe;
		while (got < max && io_uring_peek_cqe(ring, &cqe) == 0) {
			struct nf_io_seg *s = io_uring_cqe_get_data(cqe);
			NF_TSAN_ACQUIRE(s);
			s->res = cqe->res;
			io_uring_cqe_seen(ring, cqe);
			out[got++] = s;
			__atomic_sub_fetch(&be->inflight, 1, __ATOMIC_RELAXED);
		}
		if (got >= min || got >= max)
			return (int)got;
		struct __kernel_timespec ts, *tp = NULL;
		if (timeout_ns >= 0) {
			uint64_t now = nf_io_now_ns();
			if (now >= deadline)
				return (int)got;
			ts.tv_sec = (long long)((deadline - now) / 1000000000);
			ts.tv_nsec = (long long)((deadline - now) % 1000000000);
			tp = &ts;
		}
		int r = be->sys->uring_wait(ring, &cqe, tp);
		if (r == -ETIME || r == -EINTR)
			continue;
		if (r < 0)
			return got ? (int)got : r;
	}
}

const struct nf_io_be_ops nf_io_be_uring = {
	.name = "uring",
	.init = uring_be_init,
	.fini = uring_be_fini,
	.submit = uring_be_submit,
	.reap = uring_be_reap,
};
