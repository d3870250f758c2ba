/*
 * test_tools_mmap.c - `--io mmap`, the baseline mode of generate/eval (a
 * GGUF run dense through its read-only mapping, no prefault): its logits
 * are those of the normal GGUF path, and it is refused clearly with a
 * store (-m STORE or --ffn-store) or with --memory-budget.
 *
 * Runs build/nflash (built by `make test`) on
 * ../shared/testdata/models/tiny-llama-q4_0.gguf.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util_pipeline.h"

#define NFLASH PL_NFLASH
#define MODEL "../shared/testdata/models/tiny-llama-q4_0.gguf"
#define IDS "1,278,263,13,300,72,101,259"

/* Run nflash with args, stderr into err; exit status (-1 if killed). */
static int run_cli(const char *args, char *err, size_t err_len)
{
	char ef[256], cmd[1024];
	pl_tmp_path(ef, sizeof(ef), "mmap-err");
	snprintf(cmd, sizeof(cmd), PL_NFLASH_CMD " %s >/dev/null 2>%s", args, ef);
	int st = system(cmd);
	FILE *e = fopen(ef, "r");
	size_t n = e ? fread(err, 1, err_len - 1, e) : 0;
	err[n] = 0;
	if (e)
		fclose(e);
	unlink(ef);
	return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Read the logits eval wrote (one per line); returns how many. */
static size_t read_logits(const char *path, float *out, size_t max)
{
	FILE *f = fopen(path, "r");
	cr_assert_not_null(f, "%s", path);
	size_t n = 0;
	while (n < max && fscanf(f, "%f", &out[n]) == 1)
		n++;
	fclose(f);
	return n;
}

static void need_inputs(void)
{
	if (access(NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built (run make first)", NFLASH);
	if (access(MODEL, R_OK) != 0)
		cr_skip_test("%s is missing (see ../shared/testdata/README.md)", MODEL);
}

Test(tools_mmap, same_logits_as_gguf_path)
{
	need_inputs();
	char a[256], b[256], args[1024], err[4096];
	pl_tmp_path(a, sizeof(a), "mmap-ref");
	pl_tmp_path(b, sizeof(b), "mmap-map");
	snprintf(args, sizeof(args), "eval -m " MODEL " --ids " IDS " -t 2 --logits %s", a);
	cr_assert_eq(run_cli(args, err, sizeof(err)), 0, "normal path: %s", err);
	snprintf(args, sizeof(args), "eval -m " MODEL " --ids " IDS " -t 2 --io mmap --logits %s", b);
	cr_assert_eq(run_cli(args, err, sizeof(err)), 0, "--io mmap: %s", err);
	enum { MAX = 1 << 17 };
	float *la = malloc(MAX * sizeof(float)), *lb = malloc(MAX * sizeof(float));
	cr_assert(la && lb);
	size_t na = read_logits(a, la, MAX), nb = read_logits(b, lb, MAX);
	unlink(a);
	unlink(b);
	cr_assert_gt(na, 100, "too few logits: %zu", na);
	cr_assert_eq(na, nb, "normal path gave %zu logits, --io mmap %zu", na, nb);
	/* the same weights through the same kernels: the same printed values */
	double diff = pl_max_diff(la, lb, na);
	cr_assert_eq(diff, 0.0, "logits differ by up to %g", diff);
	free(la);
	free(lb);
}

Test(tools_mmap, greedy_generation_matches)
{
	need_inputs();
	char args[512], err[4096], cmd[1024];
	char out[2][4096];
	const char *io[2] = { "", "--io mmap" };
	for (int i = 0; i < 2; i++) {
		snprintf(args, sizeof(args), "generate -m " MODEL " --ids " IDS " -n 8 --temp 0 -t 2 --json %s",
			 io[i]);
		snprintf(cmd, sizeof(cmd), PL_NFLASH_CMD " %s 2>/dev/null", args);
		FILE *p = popen(cmd, "r");
		cr_assert_not_null(p);
		size_t n = fread(out[i], 1, sizeof(out[i]) - 1, p);
		out[i][n] = 0;
		cr_assert_eq(pclose(p), 0, "%s failed", args);
		(void)err;
	}
	const char *ta = strstr(out[0], "\"ids\""), *tb = strstr(out[1], "\"ids\"");
	cr_assert_not_null(ta, "no ids in %s", out[0]);
	cr_assert_not_null(tb, "no ids in %s", out[1]);
	size_t la = strcspn(ta, "]"), lb = strcspn(tb, "]");
	cr_assert(la == lb && !memcmp(ta, tb, la), "generated tokens differ:\n%.*s\n%.*s", (int)la, ta,
		  (int)lb, tb);
}

Test(tools_mmap, store_refused)
{
	need_inputs();
	char store[256], args[1024], err[4096];
	pl_import(MODEL, store, sizeof(store));
	snprintf(args, sizeof(args), "eval -m %s --ids " IDS " --io mmap", store);
	int rc = run_cli(args, err, sizeof(err));
	cr_expect_eq(rc, 2, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "--io mmap") && strstr(err, "not a GGUF"), "unclear message: %s", err);
	snprintf(args, sizeof(args), "eval -m " MODEL " --ffn-store %s --ids " IDS " --io mmap", store);
	rc = run_cli(args, err, sizeof(err));
	cr_expect_eq(rc, 2, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "--io mmap") && strstr(err, "--ffn-store"), "unclear message: %s", err);
	unlink(store);
	snprintf(args, sizeof(args), "eval -m " MODEL " --memory-budget 1G --ids " IDS " --io mmap");
	rc = run_cli(args, err, sizeof(err));
	cr_expect_eq(rc, 2, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "--io mmap") && strstr(err, "--memory-budget"), "unclear message: %s", err);
}

Test(tools_mmap, unknown_io_names_choices)
{
	need_inputs();
	char err[4096];
	int rc = run_cli("eval -m " MODEL " --ids " IDS " --io mapped", err, sizeof(err));
	cr_expect_eq(rc, 2, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "--io") && strstr(err, "mmap") && strstr(err, "'mapped'"), "message: %s", err);
}
