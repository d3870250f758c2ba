/*
 * io_sync.c - the pread backend, for file systems where O_DIRECT is
 * refused or not enforced (tmpfs). Reads happen at submission, one pread
 * each; reap hands back the finished segments in order.
 *
 * Invariants: a segment is finished when submit returns; short reads are
 * returned as such (the engine turns them into NF_ESHORT); EINTR is
 * retried, every other error is the segment's result.
 */
#include <errno.h>
#include <stdlib.h>

#include "io_internal.h"

struct sync_priv {
	struct nf_io_seg *head, *tail;
};

static int sync_be_init(struct nf_io_be *be)
{
	be->priv = calloc(1, sizeof(struct sync_priv));
	return be->priv ? 0 : -ENOMEM;
}

static void sync_be_fini(struct nf_io_be *be)
{
	free(be->priv);
	be->priv = NULL;
}

static int sync_be_submit(struct nf_io_be *be, struct nf_io_seg **segs, unsigned int n)
{
	struct sync_priv *p = be->priv;
	for (unsigned int i = 0; i < n; i++) {
		struct nf_io_seg *s = segs[i];
		ssize_t r;
		do
			r = be->sys->pread(be->fd, s->buf, s->len, (off_t)s->offset);
		while (r < 0 && errno == EINTR);
		s->res = r < 0 ? -errno : r;
		s->next = NULL;
		if (p->tail)
			p->tail->next = s;
		else
			p->head = s;
		p->tail = s;
	}
	be->inflight += n;
	return (int)n;
}

static int sync_be_reap(struct nf_io_be *be, unsigned int min, unsigned int max, int64_t timeout_ns,
			struct nf_io_seg **out)
{
	struct sync_priv *p = be->priv;
	unsigned int got = 0;
	while (p->head && got < max) {
		out[got++] = p->head;
		p->head = p->head->next;
		if (!p->head)
			p->tail = NULL;
	}
	be->inflight -= got;
	return (int)got;
}

const struct nf_io_be_ops nf_io_be_sync = {
	.name = "sync",
	.init = sync_be_init,
	.fini = sync_be_fini,
	.submit = sync_be_submit,
	.reap = sync_be_reap,
};
