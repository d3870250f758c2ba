/*
 * io_file.c - what every writer of a whole file (store writer, GGUF writer)
 * checks before it puts a new file under a name.
 *
 * Invariant: a writer replaces only what it could have written itself: a
 * regular file, or a symlink to one (rename() then replaces the link).
 * Devices, FIFOs, sockets and directories are never replaced, with or
 * without --force: `import MODEL /dev/null --force` run as root must not
 * turn /dev/null into a regular file.
 *
 * Temporary files (and import's temporary directory) are named
 * ".<final name>.nflash-tmp.<pid>.<16 hex digits>" beside the final name,
 * and their writer holds an exclusive flock on them while it runs. One a
 * killed writer left is recognised by the name, a pid that no longer runs
 * and a lock nobody holds; nf_io_tmp_sweep reports or removes those, never
 * a live writer's.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
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

/* ---- temporary files ------------------------------------------------------ */

static uint64_t tmp_random(int attempt)
{
	uint64_t r = 0;
	if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r)) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		r = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)attempt;
	}
	return r;
}

int nf_io_tmp_create(const struct nf_io_sys *sys, const char *path, bool dir, char **tmp, int *fd,
		     struct nf_diag *d)
{
	if (!sys)
		sys = &nf_io_sys_default;
	*tmp = NULL;
	*fd = -1;
	char *dcopy = strdup(path), *bcopy = strdup(path);
	int rc = -ENOMEM;
	if (!dcopy || !bcopy)
		goto out;
	const char *dname = dirname(dcopy), *base = basename(bcopy);
	for (int attempt = 0; attempt < 100; attempt++) {
		free(*tmp);
		if (asprintf(tmp, "%s/.%s" NF_IO_TMP_TAG "%d.%016llx", dname, base, (int)getpid(),
			     (unsigned long long)tmp_random(attempt)) < 0) {
			*tmp = NULL;
			rc = -ENOMEM;
			goto out;
		}
		if (dir) {
			*fd = mkdir(*tmp, 0755) < 0 ? -1 : sys->open(*tmp, O_RDONLY | O_DIRECTORY, 0);
		} else {
			*fd = sys->open(*tmp, O_RDWR | O_CREAT | O_EXCL, 0644);
		}
		if (*fd >= 0 || errno != EEXIST)
			break;
	}
	if (*fd < 0) {
		rc = nf_diag_fail(d, -errno, "%s: cannot create temporary %s %s: %s", path,
				  dir ? "directory" : "file", *tmp, nf_strerror(-errno));
		if (dir)
			rmdir(*tmp);
		free(*tmp);
		*tmp = NULL;
		goto out;
	}
	/* Held while fd is open (the kernel drops it when the writer dies). */
	if (sys->flock(*fd, LOCK_EX | LOCK_NB) < 0) {
		rc = nf_diag_fail(d, -errno, "%s: cannot lock temporary %s: %s", path, *tmp,
				  nf_strerror(-errno));
		sys->close(*fd);
		*fd = -1;
		if (dir)
			rmdir(*tmp);
		else
			sys->unlink(*tmp);
		free(*tmp);
		*tmp = NULL;
		goto out;
	}
	rc = 0;
out:
	free(dcopy);
	free(bcopy);
	return rc;
}

/* pid in a name ".<base>.nflash-tmp.<pid>.<hex>", or 0 when it is not one. */
static pid_t tmp_pid(const char *name)
{
	if (name[0] != '.')
		return 0;
	const char *tag = strstr(name, NF_IO_TMP_TAG);
	if (!tag)
		return 0;
	char *end;
	long pid = strtol(tag + strlen(NF_IO_TMP_TAG), &end, 10);
	if (pid <= 0 || *end != '.' || strlen(end + 1) != 16)
		return 0;
	return (pid_t)pid;
}

/* Bytes of a file, or of the files in a directory (one level). */
static uint64_t tmp_bytes(int dfd, const char *name, bool is_dir)
{
	struct stat st;
	if (!is_dir)
		return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 ? (uint64_t)st.st_size : 0;
	int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	DIR *dd = fd >= 0 ? fdopendir(fd) : NULL;
	uint64_t b = 0;
	struct dirent *e;
	while (dd && (e = readdir(dd)))
		if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
			b += (uint64_t)st.st_size;
	if (dd)
		closedir(dd);
	else if (fd >= 0)
		close(fd);
	return b;
}

/* Remove a stale temporary: a file, or a directory and the files in it. */
static int tmp_remove(int dfd, const char *name, bool is_dir)
{
	if (!is_dir)
		return unlinkat(dfd, name, 0) < 0 ? -errno : 0;
	int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	DIR *dd = fd >= 0 ? fdopendir(fd) : NULL;
	struct dirent *e;
	while (dd && (e = readdir(dd)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			unlinkat(fd, e->d_name, 0);
	if (dd)
		closedir(dd);
	else if (fd >= 0)
		close(fd);
	return unlinkat(dfd, name, AT_REMOVEDIR) < 0 ? -errno : 0;
}

int nf_io_tmp_sweep(const char *dir, bool remove, nf_io_tmp_fn fn, void *user)
{
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return -errno;
	DIR *dd = fdopendir(dup(dfd));
	if (!dd) {
		int rc = -errno;
		close(dfd);
		return rc;
	}
	int n = 0;
	struct dirent *e;
	while ((e = readdir(dd))) {
		pid_t pid = tmp_pid(e->d_name);
		if (!pid)
			continue;
		/* A live writer: its pid runs here, or it holds the lock. */
		if (pid != getpid() && (kill(pid, 0) == 0 || errno == EPERM))
			continue;
		struct stat st;
		if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
		    !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)))
			continue;
		bool is_dir = S_ISDIR(st.st_mode);
		int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (is_dir ? O_DIRECTORY : 0));
		if (fd < 0)
			continue;
		if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
			close(fd);
			continue;
		}
		char *path = NULL;
		if (asprintf(&path, "%s/%s", dir, e->d_name) < 0)
			path = NULL;
		uint64_t bytes = tmp_bytes(dfd, e->d_name, is_dir);
		int rc = remove ? tmp_remove(dfd, e->d_name, is_dir) : 1;
		close(fd);
		if (fn)
			fn(user, path ? path : e->d_name, bytes, rc);
		free(path);
		n++;
	}
	closedir(dd);
	close(dfd);
	return n;
}
