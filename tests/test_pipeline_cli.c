/*
 * test_pipeline_cli.c - the memory budget as the user sees it: `nflash
 * eval` on a store whose FFNs (about 100 MB) do not fit the budget stays
 * within budget + the fixed overhead it prints (VmHWM, from its --json),
 * well below the whole model; a budget too small is refused with the
 * minimum, and that minimum is enough.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util_pipeline.h"


static char gguf[256], store[256];

static void make_model(void)
{
	pl_make_wide_model("cli", 0, gguf, store, sizeof(gguf));
}

static void drop_model(void)
{
	unlink(gguf);
	unlink(store);
}

Test(pipeline, budget_holds_and_too_small_is_refused)
{
	if (access(PL_NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built", PL_NFLASH);
	make_model();
	struct stat sb;
	cr_assert_eq(stat(gguf, &sb), 0);
	static char out[1 << 16], err[1 << 16];
	char args[1024];

	/* too small: refused, the message states the minimum */
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13 -c 64 --memory-budget 20M --json", store);
	int rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_expect_eq(rc, 1, "exit %d: %s", rc, err);
	const char *at = strstr(err, "at least ");
	cr_assert_not_null(at, "no minimum in: %s", err);
	double min_mib = strtod(at + 9, NULL);
	cr_assert(min_mib > 20.0, "minimum %.1f MiB", min_mib);

	/* the stated minimum (rounded up) runs, within budget + overhead */
	unsigned long long budget = (unsigned long long)(min_mib + 1.0) << 20;
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13,300,72,101,259 -c 64 -t 2 --memory-budget %llu --json",
		 store, budget);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "fixed overhead"), "the overhead is not printed at start: %s", err);
	unsigned long long hwm = pl_json_u64(out, "vm_hwm_bytes"), over = pl_json_u64(out, "overhead_bytes");
	cr_expect_eq(pl_json_u64(out, "budget_bytes"), budget);
	cr_expect(pl_json_u64(out, "bytes_read") > 0);
	cr_expect(hwm <= budget + over, "VmHWM %llu > budget %llu + overhead %llu", hwm, budget, over);
	cr_expect(hwm < (unsigned long long)sb.st_size,
		  "VmHWM %llu is not below the model's %lld bytes: the check proves nothing", hwm,
		  (long long)sb.st_size);
	cr_expect(strstr(out, "\"hit_rate\":") && strstr(out, "\"io_wait_share\":") &&
		  strstr(out, "\"requests\":"), "%s", out);

	/* --cold-slots: a cold segment below a layer's 8192 bundles (the
	 * rest goes hot), the logits are the same (windows and halved batches
	 * are checked bit for bit in pipeline/store_backed_equals_memory) */
	static char out2[1 << 16];
	snprintf(args, sizeof(args), "eval -m %s --ids 1,278,263,13,300,72,101,259 -c 64 -t 2 --memory-budget 88M", store);
	cr_assert_eq(pl_run_cli(args, out, sizeof(out), err, sizeof(err)), 0, "%s", err);
	cr_expect(strstr(err, "cold 32.0 MiB / 8192 slots"), "default: one layer cold: %s", err);
	strncat(args, " --cold-slots 128", sizeof(args) - strlen(args) - 1);
	cr_assert_eq(pl_run_cli(args, out2, sizeof(out2), err, sizeof(err)), 0, "%s", err);
	const char *cold = strstr(err, "cold ");
	cr_assert_not_null(cold, "%s", err);
	const char *sl = strstr(cold, " / ");
	cr_assert_not_null(sl, "%s", err);
	long n_cold = strtol(sl + 3, NULL, 10);
	cr_expect(n_cold >= 128 && n_cold < 8192, "--cold-slots 128: %ld cold slots (%s)", n_cold, err);
	cr_expect_str_eq(out, out2);
	snprintf(args, sizeof(args), "eval -m %s --ids 1 --cold-slots 100", store);
	cr_expect_eq(pl_run_cli(args, out2, sizeof(out2), err, sizeof(err)), 2);
	cr_expect(strstr(err, "--cold-slots: 100 is below 128"), "%s", err);
	drop_model();
}
