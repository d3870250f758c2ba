/*
 * tests/tsan/runner.c - the test runner of `make test SANITIZE=thread`,
 * where Criterion cannot start (see criterion/criterion.h here). Runs every
 * registered test (or those matching --filter=SUITE/NAME glob), each in a
 * forked child with its suite's and its own init/fini and time limit
 * (scaled, see time_limit), -jN of them at a time (as Criterion's -j;
 * default 1); a child that ThreadSanitizer reported on exits 66 and counts
 * as failed. Prints one line per failed or skipped test, per test that
 * took a minute or more, and every 2 minutes per test still running (with
 * --verbose, each test's name as it starts and its wall time when it
 * ends); closes with "N passed, N failed, N skipped". Exit 0 when none
 * failed.
 */
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
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

/*
 * A test's time limit under TSan: its own (or its suite's; 300 s when it
 * has none) times NF_TSAN_SLOWDOWN (default 10), plus a minute. TSan slows
 * plain scalar code the most: the reference K-quant kernels of
 * model/fidelity_kquant_testdata_models run 16x slower than without it
 * (31 s -> 503 s on the shared 2-vCPU machine), where the old factor of 4
 * killed it at 540 s.
 */
static double slowdown(void)
{
	const char *e = getenv("NF_TSAN_SLOWDOWN");
	double f = e ? strtod(e, NULL) : 0;
	return f >= 1 ? f : 10;
}

static double time_limit(const struct tsan_test *t, const struct tsan_suite *s)
{
	double to = t->timeout > 0 ? t->timeout : s && s->timeout > 0 ? s->timeout : 300;
	return to * slowdown() + 60;
}

static void run_child(const struct tsan_test *t, const struct tsan_suite *s)
{
	alarm((unsigned)time_limit(t, s));
	void (*init)(void) = t->init ? t->init : s ? s->init : NULL;
	void (*fini)(void) = t->fini ? t->fini : s ? s->fini : NULL;
	if (init)
		init();
	t->fn();
	if (fini)
		fini();
	exit(failed ? 1 : 0);            /* exit, not _exit: TSan sets 66 on reports */
}

struct running {
	pid_t pid;
	char name[256];
	struct timespec t0;
	double limit, next_note;     /* seconds */
};

static double since(const struct timespec *t0)
{
	struct timespec t1;
	clock_gettime(CLOCK_MONOTONIC, &t1);
	return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/* Wait for any child; every 2 minutes a test runs, say so (a slow test
 * under TSan is not a hung one, and a hung one is named). */
static pid_t wait_any(struct running *run, int jobs, int *st)
{
	for (;;) {
		pid_t pid = waitpid(-1, st, WNOHANG);
		if (pid != 0)
			return pid;
		for (int k = 0; k < jobs; k++) {
			if (!run[k].pid)
				continue;
			double t = since(&run[k].t0);
			if (t >= run[k].next_note) {
				fprintf(stderr, "[WAIT] %s: running for %.0f s (limit %.0f s)\n", run[k].name, t,
					run[k].limit);
				run[k].next_note += 120;
			}
		}
		usleep(200 * 1000);
	}
}

/* Account for the child that ended with status st. */
static void reap(const struct running *r, int st, bool verbose, int *pass, int *fail, int *skip)
{
	double t = since(&r->t0);
	if (verbose || t >= 60)
		fprintf(stderr, "[DONE] %s: %.1f s\n", r->name, t);
	if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
		(*pass)++;
	} else if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
		(*skip)++;
		fprintf(stderr, "[SKIP] %s\n", r->name);
	} else {
		(*fail)++;
		if (WIFEXITED(st))
			fprintf(stderr, "[FAIL] %s: exit %d%s\n", r->name, WEXITSTATUS(st),
				WEXITSTATUS(st) == 66 ? " (ThreadSanitizer report above)" : "");
		else
			fprintf(stderr, "[FAIL] %s: signal %d%s\n", r->name, WTERMSIG(st),
				WTERMSIG(st) == SIGALRM ? " (time limit)" : "");
	}
}

int main(int argc, char **argv)
{
	const char *filter = NULL;
	bool verbose = false;
	int jobs = 1;
	for (int i = 1; i < argc; i++) {
		if (!strncmp(argv[i], "--filter=", 9))
			filter = argv[i] + 9;
		else if (!strcmp(argv[i], "--verbose"))
			verbose = true;
		else if (!strncmp(argv[i], "-j", 2))
			jobs = atoi(argv[i] + 2);
	}
	if (jobs < 1 || jobs > 64)
		jobs = 1;
	size_t n = 0;
	for (struct tsan_test *t = tests; t; t = t->next)
		n++;
	struct tsan_test **v = malloc((n ? n : 1) * sizeof(*v));
	struct running *run = calloc((size_t)jobs, sizeof(*run));
	if (!v || !run)
		return 2;
	n = 0;
	for (struct tsan_test *t = tests; t; t = t->next)
		v[n++] = t;
	qsort(v, n, sizeof(*v), cmp);
	int pass = 0, fail = 0, skip = 0, busy = 0;
	for (size_t i = 0; i <= n; i++) {
		/* wait for a free slot (after the last test: for all of them) */
		while (busy > 0 && (busy == jobs || i == n)) {
			int st = 0;
			pid_t pid = wait_any(run, jobs, &st);
			if (pid < 0)
				break;
			for (int k = 0; k < jobs; k++)
				if (run[k].pid == pid) {
					reap(&run[k], st, verbose, &pass, &fail, &skip);
					run[k].pid = 0;
					busy--;
				}
		}
		if (i == n)
			break;
		char full[256];
		snprintf(full, sizeof(full), "%s/%s", v[i]->suite, v[i]->name);
		if (filter && fnmatch(filter, full, FNM_EXTMATCH))
			continue;
		if (verbose)
			fprintf(stderr, "[RUN ] %s\n", full);
		fflush(stdout);
		fflush(stderr);
		int k = 0;
		while (run[k].pid)
			k++;
		snprintf(run[k].name, sizeof(run[k].name), "%s", full);
		clock_gettime(CLOCK_MONOTONIC, &run[k].t0);
		run[k].limit = time_limit(v[i], suite_of(v[i]));
		run[k].next_note = 120;
		pid_t pid = fork();
		if (pid == 0)
			run_child(v[i], suite_of(v[i]));
		if (pid < 0) {
			fprintf(stderr, "[FAIL] %s: fork: %s\n", full, strerror(errno));
			fail++;
			continue;
		}
		run[k].pid = pid;
		busy++;
	}
	free(v);
	free(run);
	printf("tsan: %d passed, %d failed, %d skipped\n", pass, fail, skip);
	return fail ? 1 : 0;
}
