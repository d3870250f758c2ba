/*
 * qemu_exec.c - linked into the test binary of a cross build only (see the
 * Makefile): runs aarch64 programs through qemu-user when the tests
 * themselves run under it, whether or not binfmt_misc knows aarch64.
 *
 * Criterion starts each test worker by execve() of the test binary itself;
 * under qemu-user that execve reaches the host kernel, which cannot run an
 * aarch64 file unless binfmt_misc has qemu registered (CI machines and
 * containers often do not). This execve, found before libc's because the
 * executable defines it, rewrites "exec P args" into "exec $NF_QEMU -0 argv0
 * P args" when NF_QEMU is set and P is an aarch64 ELF file; the host runs
 * qemu (an x86-64 program) natively. Everything else goes to libc as is.
 *
 * Invariants: no allocation on the exec path (the argument vector is on the
 * stack, bounded); errors are libc's (-1 with errno), as execve's.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EM_AARCH64_ 183
#define QEMU_MAX_ARGS 256

static int is_aarch64_elf(const char *path)
{
	unsigned char h[20];
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, h, sizeof(h));
	close(fd);
	return n == (ssize_t)sizeof(h) && !memcmp(h, "\177ELF", 4) && h[4] == 2 /* 64-bit */ &&
	       h[5] == 1 /* little-endian */ && (h[18] | h[19] << 8) == EM_AARCH64_;
}

int execve(const char *path, char *const argv[], char *const envp[])
{
	int (*real)(const char *, char *const[], char *const[]) =
		(int (*)(const char *, char *const[], char *const[]))dlsym(RTLD_NEXT, "execve");
	if (!real) {
		errno = ENOSYS;
		return -1;
	}
	const char *qemu = getenv("NF_QEMU");
	if (!qemu || !*qemu || !is_aarch64_elf(path))
		return real(path, argv, envp);
	size_t argc = 0;
	while (argv[argc])
		argc++;
	if (argc + 5 > QEMU_MAX_ARGS) {
		errno = E2BIG;
		return -1;
	}
	char *nargv[QEMU_MAX_ARGS];
	size_t k = 0;
	nargv[k++] = (char *)qemu;
	nargv[k++] = (char *)"-0";
	nargv[k++] = argc ? argv[0] : (char *)path;
	nargv[k++] = (char *)path;
	for (size_t i = 1; i < argc; i++)
		nargv[k++] = argv[i];
	nargv[k] = NULL;
	return real(qemu, nargv, envp);
}
