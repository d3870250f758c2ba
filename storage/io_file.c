/*
 * io_file.c - what every writer of a whole file (store writer, GGUF writer)
 * checks before it puts a new file under a name.
 *
 * Invariant: a writer replaces only what it could have written itself: a
 * regular file, or a symlink to one (rename() then replaces the link).
 * Devices, FIFOs, sockets and directories are never replaced, with or
 * without --force: `import MODEL /dev/null --force` run as root must not
 * turn /dev/null into a regular file.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdlib.h>
#include <string.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

#include "nflash/error.h"
#include "nflash/io.h"

static const char *kind_name(mode_t m)
{
	if (S_ISDIR(m))
		return "a directory";
	if (S_ISCHR(m))
		return "a character device";
	if (S_ISBLK(m))
		return "a block device";
	if (S_ISFIFO(m))
		return "a FIFO";
	if (S_ISSOCK(m))
		return "a socket";
	return "not a regular file";
}

/* The directory a new file at path goes into must exist (else every later
 * step fails with a message about temporary files, not the real problem). */
static int dir_check(const struct nf_io_sys *sys, const char *path, struct nf_diag *d)
{
	char *copy = strdup(path);
	if (!copy)
		return -ENOMEM;
	const char *dir = dirname(copy);
	struct statx stx;
	int rc = 0;
	if (sys->statx(AT_FDCWD, dir, 0, STATX_TYPE, &stx) < 0)
		rc = nf_diag_fail(d, -errno, "%s: directory %s %s", path, dir,
				  errno == ENOENT ? "does not exist" : nf_strerror(-errno));
	else if (!S_ISDIR(stx.stx_mode))
		rc = nf_diag_fail(d, -ENOTDIR, "%s: %s is not a directory", path, dir);
	free(copy);
	return rc;
}

int nf_io_target_check(const struct nf_io_sys *sys, const char *path, struct nf_diag *d)
{
	if (!sys)
		sys = &nf_io_sys_default;
	struct statx stx;
	if (sys->statx(AT_FDCWD, path, 0, STATX_TYPE, &stx) < 0) {
		int rc = -errno;
		if (rc == -ENOENT)
			return dir_check(sys, path, d);
		return nf_diag_fail(d, rc, "%s: %s", path, nf_strerror(rc));
	}
	if (S_ISREG(stx.stx_mode))
		return 0;
	return nf_diag_fail(d, NF_EUSAGE, "%s: is %s, not a regular file; refusing to replace it",
			    path, kind_name(stx.stx_mode));
}

/* One loop for both directions: EINTR is retried, a partial transfer goes on. */
static int xfer_full(const struct nf_io_sys *sys, int fd, uint8_t *p, size_t len, uint64_t off,
		     bool write)
{
	if (!sys)
		sys = &nf_io_sys_default;
	while (len) {
		ssize_t n = write ? sys->pwrite(fd, p, len, (off_t)off) : sys->pread(fd, p, len, (off_t)off);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (n == 0)
			return NF_ETRUNCATED;
		p += n;
		len -= (size_t)n;
		off += (uint64_t)n;
	}
	return 0;
}

int nf_io_pread_full(const struct nf_io_sys *sys, int fd, void *buf, size_t len, uint64_t off)
{
	return xfer_full(sys, fd, buf, len, off, false);
}

int nf_io_pwrite_full(const struct nf_io_sys *sys, int fd, const void *buf, size_t len,
		      uint64_t off)
{
	return xfer_full(sys, fd, (uint8_t *)buf, len, off, true);
}
