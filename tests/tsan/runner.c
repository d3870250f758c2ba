/*
 * tests/tsan/runner.c - the test runner of `make test SANITIZE=thread`,
 * where Criterion cannot start (see criterion/criterion.h here). Runs every
 * registered test (or those matching --filter=SUITE/NAME glob), one at a
 * time, each in a forked child with its suite's and its own init/fini and
 * timeout; a child that ThreadSanitizer reported on exits 66 and counts as
 * failed. Prints one line per failed or skipped test and closes with
 * "N passed, N failed, N skipped". Exit 0 when none failed.
 */
#include <fcntl.h>
#include <fnmatch.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "criterion/criterion.h"
#include "criterion/redirect.h"

static struct tsan_test *tests;
static struct tsan_suite *suites;
static bool failed;
static int redir_fd[3] = { -1, -1, -1 };

void tsan_register(struct tsan_test *t)
{
	t->next = tests;
	tests = t;
}

void tsan_register_suite(struct tsan_suite *s)
{
	s->next = suites;
	suites = s;
}

static void fail(const char *file, int line, const char *expr, const char *fmt, va_list ap)
{
	char msg[2048];
	vsnprintf(msg, sizeof(msg), fmt, ap);
	const char *m = msg[0] == ' ' ? msg + 1 : msg;   /* the macros prefix a space */
	dprintf(redir_fd[2] >= 0 ? 99 : 2, "[----] %s:%d: Assertion Failed: %s%s%s\n", file, line, expr,
		m[0] ? ": " : "", m);
	failed = true;
}

void tsan_assert_fail(const char *file, int line, const char *expr, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fail(file, line, expr, fmt, ap);
	va_end(ap);
	exit(1);
}

void tsan_expect_fail(const char *file, int line, const char *expr, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fail(file, line, expr, fmt, ap);
	va_end(ap);
}

void tsan_skip(const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	dprintf(redir_fd[2] >= 0 ? 99 : 2, "[SKIP]%s\n", msg);
	exit(77);
}

void tsan_log(const char *level, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "[%s] ", level);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

static void redirect(int fd)
{
	FILE *std = fd == 1 ? stdout : stderr;
	fflush(std);
	if (fd == 2 && redir_fd[2] < 0)
		dup2(2, 99);          /* failures still reach the real stderr */
	char tmpl[] = "/tmp/nflash-tsan-out.XXXXXX";
	int t = mkstemp(tmpl);
	if (t < 0)
		abort();
	unlink(tmpl);
	dup2(t, fd);
	redir_fd[fd] = t;
}

void cr_redirect_stdout(void) { redirect(1); }
void cr_redirect_stderr(void) { redirect(2); }

static FILE *reader(int fd)
{
	fflush(fd == 1 ? stdout : stderr);
	char p[64];
	snprintf(p, sizeof(p), "/proc/self/fd/%d", redir_fd[fd]);
	return fopen(p, "r");
}

FILE *cr_get_redirected_stdout(void) { return reader(1); }
FILE *cr_get_redirected_stderr(void) { return reader(2); }

bool tsan_stream_eq(int fd, const char *want)
{
	FILE *f = reader(fd);
	if (!f)
		return false;
	size_t n = strlen(want);
	char *buf = malloc(n + 2);
	size_t got = buf ? fread(buf, 1, n + 1, f) : 0;
	bool eq = buf && got == n && !memcmp(buf, want, n);
	free(buf);
	fclose(f);
	return eq;
}

static const struct tsan_suite *suite_of(const struct tsan_test *t)
{
	for (const struct tsan_suite *s = suites; s; s = s->next)
		if (!strcmp(s->name, t->suite))
			return s;
	return NULL;
}

static int cmp(const void *a, const void *b)
{
	const struct tsan_test *x = *(struct tsan_test *const *)a, *y = *(struct tsan_test *const *)b;
	int c = strcmp(x->suite, y->suite);
	return c ? c : strcmp(x->name, y->name);
}

static void run_child(const struct tsan_test *t, const struct tsan_suite *s)
{
	double to = t->timeout > 0 ? t->timeout : s && s->timeout > 0 ? s->timeout : 300;
	alarm((unsigned)(to * 4 + 60));      /* TSan runs several times slower */
	void (*init)(void) = t->init ? t->init : s ? s->init : NULL;
	void (*fini)(void) = t->fini ? t->fini : s ? s->fini : NULL;
	if (init)
		init();
	t->fn();
	if (fini)
		fini();
	exit(failed ? 1 : 0);            /* exit, not _exit: TSan sets 66 on reports */
}

int main(int argc, char **argv)
{
	const char *filter = NULL;
	for (int i = 1; i < argc; i++)
		if (!strncmp(argv[i], "--filter=", 9))
			filter = argv[i] + 9;
	size_t n = 0;
	for (struct tsan_test *t = tests; t; t = t->next)
		n++;
	struct tsan_test **v = malloc((n ? n : 1) * sizeof(*v));
	n = 0;
	for (struct tsan_test *t = tests; t; t = t->next)
		v[n++] = t;
	qsort(v, n, sizeof(*v), cmp);
	int pass = 0, fail = 0, skip = 0;
	for (size_t i = 0; i < n; i++) {
		char full[256];
		snprintf(full, sizeof(full), "%s/%s", v[i]->suite, v[i]->name);
		if (filter && fnmatch(filter, full, 0))
			continue;
		fflush(stdout);
		fflush(stderr);
		pid_t pid = fork();
		if (pid == 0)
			run_child(v[i], suite_of(v[i]));
		int st = 0;
		waitpid(pid, &st, 0);
		if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
			pass++;
		} else if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
			skip++;
			fprintf(stderr, "[SKIP] %s\n", full);
		} else {
			fail++;
			if (WIFEXITED(st))
				fprintf(stderr, "[FAIL] %s: exit %d%s\n", full, WEXITSTATUS(st),
					WEXITSTATUS(st) == 66 ? " (ThreadSanitizer report above)" : "");
			else
				fprintf(stderr, "[FAIL] %s: signal %d%s\n", full, WTERMSIG(st),
					WTERMSIG(st) == SIGALRM ? " (timeout)" : "");
		}
	}
	free(v);
	printf("tsan: %d passed, %d failed, %d skipped\n", pass, fail, skip);
	return fail ? 1 : 0;
}
