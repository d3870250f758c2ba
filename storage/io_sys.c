/*
 * io_sys.c - the default system-call table of the storage layer.
 *
 * Invariant: each entry is the real call with its native contract, so code
 * written against the table behaves the same with nf_io_sys_default as
 * with direct calls; tests swap entries to inject failures.
 */
#include <errno.h>
#include <fcntl.h>
#include <libaio.h>
#include <liburing.h>
#include <linux/fs.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include "nflash/io.h"

static int sys_open(const char *path, int flags, mode_t mode)
{
	return open(path, flags | O_CLOEXEC, mode);
}

static int sys_statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *stx)
{
	return statx(dirfd, path, flags, mask, stx);
}

static int sys_ioctl_size(int fd, uint64_t *bytes)
{
	return ioctl(fd, BLKGETSIZE64, bytes);
}

static int sys_kaio_setup(int nr, struct io_context **ctx)
{
	return io_setup(nr, ctx);
}

static int sys_kaio_destroy(struct io_context *ctx)
{
	return io_destroy(ctx);
}

static int sys_kaio_submit(struct io_context *ctx, long n, struct iocb **iocbs)
{
	return io_submit(ctx, n, iocbs);
}

static int sys_kaio_getevents(struct io_context *ctx, long min, long nr, struct io_event *ev,
			      struct timespec *timeout)
{
	return io_getevents(ctx, min, nr, ev, timeout);
}

static int sys_uring_init(unsigned int entries, struct io_uring *ring, unsigned int flags)
{
	return io_uring_queue_init(entries, ring, flags);
}

static void sys_uring_exit(struct io_uring *ring)
{
	io_uring_queue_exit(ring);
}

static int sys_uring_submit(struct io_uring *ring)
{
	return io_uring_submit(ring);
}

static int sys_uring_wait(struct io_uring *ring, struct io_uring_cqe **cqe,
			  struct __kernel_timespec *timeout)
{
	return io_uring_wait_cqe_timeout(ring, cqe, timeout);
}

const struct nf_io_sys nf_io_sys_default = {
	.open = sys_open,
	.close = close,
	.pread = pread,
	.pwrite = pwrite,
	.fstat = fstat,
	.fstatfs = fstatfs,
	.statx = sys_statx,
	.ioctl_size = sys_ioctl_size,
	.ftruncate = ftruncate,
	.fsync = fsync,
	.rename = rename,
	.unlink = unlink,
	.flock = flock,
	.mmap = mmap,
	.munmap = munmap,
	.kaio_setup = sys_kaio_setup,
	.kaio_destroy = sys_kaio_destroy,
	.kaio_submit = sys_kaio_submit,
	.kaio_getevents = sys_kaio_getevents,
	.uring_init = sys_uring_init,
	.uring_exit = sys_uring_exit,
	.uring_submit = sys_uring_submit,
	.uring_wait = sys_uring_wait,
};
