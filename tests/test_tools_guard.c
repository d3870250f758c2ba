/*
 * test_tools_guard.c - the command line never clobbers what is not its own,
 * never reports success when its output was lost, and reads its flags and
 * files the way a user means them (issue #16). Each test runs the real
 * build/nflash on real files in a scratch directory.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/error.h"
#include "nflash/store.h"
#include "../tools/cli.h"
#include "util_pipeline.h"
#include "util_storage.h"

#define TINY "../shared/testdata/models/tiny-llama-f32.gguf"

static char out[1 << 16], err[1 << 16];

/* Run `build/nflash ARGS` through the shell (so ARGS may redirect). */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
	char args[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(args, sizeof(args), fmt, ap);
	va_end(ap);
	return pl_run_cli(args, out, sizeof(out), err, sizeof(err));
}

static void need_cli(void)
{
	if (access(PL_NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built", PL_NFLASH);
}

static bool is_fifo(const char *p)
{
	struct stat st;
	return lstat(p, &st) == 0 && S_ISFIFO(st.st_mode);
}

/* Defect 1: --force (and writers without it) replace only regular files. */
Test(guard, writers_refuse_a_target_that_is_not_a_regular_file)
{
	need_cli();
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	char fifo[256], link[256], reg[256];
	snprintf(fifo, sizeof(fifo), "%s/fifo", t.dir);
	snprintf(reg, sizeof(reg), "%s/reg.nfs", t.dir);
	snprintf(link, sizeof(link), "%s/link.nfs", t.dir);
	cr_assert_eq(mkfifo(fifo, 0644), 0);

	int rc = sh("import %s %s --force", TINY, fifo);
	cr_expect_neq(rc, 0, "import --force over a FIFO: exit %d: %s", rc, err);
	cr_expect(strstr(err, "not a regular file"), "%s", err);
	cr_expect(is_fifo(fifo), "import replaced the FIFO");

	rc = sh("store mkfake %s --layers 1 --dim 64 --ffn 64 --vocab 16", fifo);
	cr_expect_neq(rc, 0, "mkfake over a FIFO: exit %d: %s", rc, err);
	cr_expect(is_fifo(fifo), "mkfake replaced the FIFO");

	rc = sh("synth -o %s", fifo);
	cr_expect_neq(rc, 0, "synth over a FIFO: exit %d: %s", rc, err);
	cr_expect(is_fifo(fifo), "synth replaced the FIFO");

	/* a character device, as /dev/null was (a node of our own: mknod
	 * needs root, which the original report had too) */
	char dev[256];
	snprintf(dev, sizeof(dev), "%s/null", t.dir);
	if (mknod(dev, S_IFCHR | 0666, makedev(1, 3)) == 0) {
		rc = sh("import %s %s --force", TINY, dev);
		cr_expect_neq(rc, 0, "import --force over a character device: exit %d: %s", rc, err);
		cr_expect(strstr(err, "not a regular file"), "%s", err);
		struct stat st;
		cr_expect(lstat(dev, &st) == 0 && S_ISCHR(st.st_mode), "import replaced the device");
		unlink(dev);
	}

	/* the library refuses too (relayout and every other writer go through it) */
	struct nf_store_writer *w = NULL;
	struct nf_diag d = { 0 };
	cr_expect_eq(nf_store_writer_open(fifo, NULL, &w, &d), NF_EUSAGE, "%s", d.msg);
	nf_store_writer_close(w);
	cr_expect_eq(ts_dir_count(&t), 1, "a temporary file was left behind");

	/* a symlink to a regular file is replaced (the link, as rename does) */
	rc = sh("store mkfake %s --layers 1 --dim 64 --ffn 64 --vocab 16", reg);
	cr_assert_eq(rc, 0, "%s", err);
	cr_assert_eq(symlink(reg, link), 0);
	rc = sh("import %s %s --force", TINY, link);
	cr_expect_eq(rc, 0, "import --force over a symlink to a file: %s", err);
	ts_dir_remove(&t);
}

/* Defect 3: a store whose superblock 0 is damaged still opens from
 * superblock 1, in eval as in inspect and verify. */
Test(guard, store_with_damaged_superblock0_still_runs)
{
	need_cli();
	char store[256];
	pl_import(TINY, store, sizeof(store));
	int rc = sh("eval -m %s --ids 1,278,263 -c 16", store);
	cr_assert_eq(rc, 0, "%s", err);
	static char before[sizeof(out)];
	snprintf(before, sizeof(before), "%s", out);
	static const uint8_t junk[8] = { 'G', 'A', 'R', 'B', 'A', 'G', 'E', '!' };
	ts_patch(store, 0, junk, sizeof(junk));
	cr_expect(nf_store_probe(store), "the probe misses superblock 1");
	rc = sh("eval -m %s --ids 1,278,263 -c 16", store);
	cr_expect_eq(rc, 0, "eval refused a store that superblock 1 opens: %s", err);
	cr_expect_str_eq(out, before);
	cr_expect_not(nf_store_probe(TINY), "a GGUF taken for a store");
	unlink(store);
}

/* Defect 7: output lost on a full device is a failure (exit 1), not success. */
Test(guard, lost_output_is_a_failure)
{
	need_cli();
	int rc = sh("generate -m %s -p hello -n 4 -c 32 >/dev/full", TINY);
	cr_expect_eq(rc, 1, "generate > /dev/full: exit %d: %s", rc, err);
	cr_expect(strstr(err, "standard output"), "%s", err);
	rc = sh("eval -m %s --ids 1,278 -c 16 >/dev/full", TINY);
	cr_expect_eq(rc, 1, "eval > /dev/full: exit %d: %s", rc, err);
	rc = sh("store inspect %s --json >/dev/full", TINY);
	cr_expect_neq(rc, 0, "inspect > /dev/full: exit %d: %s", rc, err);
	rc = sh("--help >/dev/full");
	cr_expect_eq(rc, 1, "--help > /dev/full: exit %d", rc);
	/* the diagnostics going nowhere fails too (nothing can say why) */
	rc = sh("generate -m %s -p hello -n 2 -c 32 2>/dev/full >/dev/null; exit $?", TINY);
	cr_expect_eq(rc, 1, "generate 2> /dev/full: exit %d", rc);
}

/* Copy src to dst with the value of key (a 4-byte scalar) replaced by v. */
static void gguf_patch_kv(const char *src, const char *dst, const char *key, const void *v)
{
	FILE *f = fopen(src, "rb");
	cr_assert_not_null(f);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	rewind(f);
	uint8_t *b = malloc((size_t)n);
	cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	uint8_t pat[128];
	uint64_t kl = strlen(key);
	memcpy(pat, &kl, 8);     /* GGUF strings: u64 length, then the bytes */
	memcpy(pat + 8, key, kl);
	uint8_t *at = memmem(b, (size_t)n, pat, 8 + kl);
	cr_assert_not_null(at, "%s: no key %s", src, key);
	memcpy(at + 8 + kl + 4, v, 4);   /* after the u32 value type */
	f = fopen(dst, "wb");
	cr_assert_eq(fwrite(b, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	free(b);
}

/* Defect 9: import refuses what eval would refuse, before writing anything. */
Test(guard, import_validates_hyperparameters)
{
	need_cli();
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	char bad[256];
	snprintf(bad, sizeof(bad), "%s/bad.gguf", t.dir);
	const uint32_t zero = 0;
	const float nan = __builtin_nanf("");
	struct { const char *key; const void *v; const char *says; } cases[] = {
		{ "llama.attention.head_count", &zero, "head_count" },
		{ "llama.attention.layer_norm_rms_epsilon", &nan, "layer_norm_rms_epsilon" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		gguf_patch_kv(TINY, bad, cases[i].key, cases[i].v);
		int rc = sh("eval -m %s --ids 1,2 -c 16", bad);
		cr_assert_eq(rc, 1, "eval accepts %s: %s", cases[i].key, err);
		rc = sh("import %s %s/out.nfs", bad, t.dir);
		cr_expect_eq(rc, 1, "import accepts %s (exit %d): %s", cases[i].key, rc, err);
		cr_expect(strstr(err, cases[i].says), "%s", err);
		cr_expect_eq(ts_dir_count(&t), 1, "import wrote something for %s", cases[i].key);
	}
	ts_dir_remove(&t);
}

/* Defect 10: numbers are decimal, whitespace is not a sign, and messages
 * name the real problem. */
Test(guard, numbers_are_decimal)
{
	long v = 0;
	uint64_t u = 0;
	cr_expect_eq(nf_cli_int("-n", "010", -1, 100, &v), 0);
	cr_expect_eq(v, 10, "-n 010 parsed as %ld", v);
	cr_expect_eq(nf_cli_int("-n", "08", -1, 100, &v), 0);
	cr_expect_eq(v, 8);
	cr_expect_eq(nf_cli_int("-n", "0x10", -1, 100, &v), NF_EUSAGE);
	cr_expect_eq(nf_cli_int("-n", " 5", -1, 100, &v), NF_EUSAGE);
	cr_expect_eq(nf_cli_u64("--seed", " -5", &u), NF_EUSAGE, "--seed ' -5' gave %llu",
		     (unsigned long long)u);
	cr_expect_eq(nf_cli_u64("--seed", "+5", &u), NF_EUSAGE);
	cr_expect_eq(nf_cli_u64("--seed", "0x10", &u), NF_EUSAGE);
	cr_expect_eq(nf_cli_u64("--seed", "010", &u), 0);
	cr_expect_eq(u, 10);
}

Test(guard, messages_name_the_real_problem)
{
	need_cli();
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	int rc = sh("store inspect %s", t.dir);
	cr_expect_eq(rc, 1);
	cr_expect(strstr(err, "is a directory"), "inspect DIR: %s", err);
	rc = sh("import %s %s/no/such/dir/out.nfs", TINY, t.dir);
	cr_expect_neq(rc, 0);
	cr_expect(strstr(err, "does not exist") && !strstr(err, "temporary"), "missing dir: %s", err);
	rc = sh("generate -m %s -p hello -n -1 -c 8 --ignore-eos --json", TINY);
	cr_expect_eq(rc, 0, "%s", err);
	cr_expect(strstr(out, "\"stop\":\"context\""), "-n -1 -c 8: %s", out);
	ts_dir_remove(&t);
}

/* --profile on a store that cannot be written fails at once, before the
 * calibration run (an immutable file: root cannot write it either). */
Test(guard, profile_on_a_read_only_store_fails_first)
{
	need_cli();
	char store[256], cmd[512];
	pl_import(TINY, store, sizeof(store));
	snprintf(cmd, sizeof(cmd), "chattr +i %s 2>/dev/null", store);
	if (system(cmd) != 0) {
		unlink(store);
		cr_skip_test("chattr +i is not possible here");
	}
	int rc = sh("generate -m %s -p hello -n 4 -c 32 --profile", store);
	snprintf(cmd, sizeof(cmd), "chattr -i %s", store);
	cr_assert_eq(system(cmd), 0);
	unlink(store);
	cr_expect_eq(rc, 1, "%s", err);
	cr_expect(strstr(err, "cannot be written") || strstr(err, "read-only"), "%s", err);
	cr_expect_str_empty(out, "it generated before failing: %s", out);
	cr_expect_null(strstr(err, "eval time"), "it ran before failing: %s", err);
}

/* Defect 6: a killed writer's temporary file is recognisable; `store clean`
 * removes it (and only it: a live writer's file stays), and the next import
 * into that directory, `store verify DIR` and `store verify` of a store
 * there report it. */
Test(guard, stale_temporary_files_are_reported_and_cleaned)
{
	need_cli();
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	char dead[256], live[256];
	snprintf(dead, sizeof(dead), "%s/dead.nfs", t.dir);
	snprintf(live, sizeof(live), "%s/live.nfs", t.dir);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {     /* a writer killed in the middle */
		struct nf_store_writer *w;
		if (nf_store_writer_open(dead, NULL, &w, NULL) == 0 &&
		    nf_store_writer_add_dense(w, "x", NF_DTYPE_F32, 1, (const uint64_t[]){ 4096 }, NULL) == 0)
			nf_store_writer_begin(w, NULL);
		raise(SIGKILL);
	}
	int st;
	waitpid(pid, &st, 0);
	cr_assert_eq(ts_dir_count(&t), 1, "the killed writer left no file");
	struct nf_store_writer *w;
	cr_assert_eq(nf_store_writer_open(live, NULL, &w, NULL), 0);
	cr_assert_eq(ts_dir_count(&t), 2);

	char model[256];
	snprintf(model, sizeof(model), "%s/m.nfs", t.dir);
	int rc = sh("import %s %s", TINY, model);
	cr_expect_eq(rc, 0, "%s", err);
	cr_expect(strstr(err, "nflash-tmp") && strstr(err, "store clean"), "import does not report it: %s", err);
	cr_expect_eq(ts_dir_count(&t), 3);

	/* `store verify DIR` lists the dead writer's file (not the live one's)
	 * and exits 1; verify of a store in that directory names it too but
	 * stays 0 (the store is intact) */
	rc = sh("store verify %s", t.dir);
	cr_expect_eq(rc, 1, "verify DIR with a stale temporary: exit %d: %s%s", rc, out, err);
	cr_expect(strstr(out, "stale") && strstr(out, ".dead.nfs.nflash-tmp."), "%s", out);
	cr_expect_null(strstr(out, ".live.nfs.nflash-tmp."), "it listed the live writer's file: %s", out);
	cr_expect(strstr(out, "1 stale temporary file") && strstr(out, "store clean"), "%s", out);
	rc = sh("store verify %s --json", t.dir);
	cr_expect_eq(rc, 1, "%s", err);
	cr_expect(strstr(out, "\"stale_temporaries\"") && strstr(out, ".dead.nfs.nflash-tmp."), "%s", out);
	rc = sh("store verify %s", model);
	cr_expect_eq(rc, 0, "%s", err);
	cr_expect(strstr(err, ".dead.nfs.nflash-tmp.") && strstr(err, "store clean"),
		  "verify of a store does not report the stale file beside it: %s", err);
	cr_expect_null(strstr(err, ".live.nfs.nflash-tmp."), "%s", err);

	rc = sh("store clean %s", t.dir);
	cr_expect_eq(rc, 0, "%s", err);
	cr_expect(strstr(out, "removed") && strstr(out, "nflash-tmp"), "%s", out);
	cr_expect_eq(ts_dir_count(&t), 2, "clean left the dead writer's file or took the live one's");
	rc = sh("store verify %s", t.dir);
	cr_expect_eq(rc, 0, "verify DIR after clean: %s%s", out, err);
	cr_expect(strstr(out, "0 stale temporary files"), "%s", out);
	cr_assert_eq(nf_store_writer_add_dense(w, "x", NF_DTYPE_F32, 1, (const uint64_t[]){ 16 }, NULL), 0);
	cr_assert_eq(nf_store_writer_begin(w, NULL), 0);
	static const uint8_t zero[64];
	cr_assert_eq(nf_store_writer_write_dense(w, zero, sizeof(zero)), 0);
	cr_expect_eq(nf_store_writer_finish(w, NULL), 0, "the live writer lost its file");
	nf_store_writer_close(w);
	ts_dir_remove(&t);
}

/* Defect 2: corrupt FFN bytes are never computed on: a PowerInfer store
 * with bits flipped in blk.0.ffn extent 9 makes predictor-mode eval with
 * -b 1 (single-bundle reads) fail, naming the object. */
Test(guard, corrupt_bundles_are_not_computed_on)
{
	need_cli();
	char store[256];
	pl_import("../shared/testdata/powerinfer/tiny-relullama-ff1024-f32.pwri.gguf", store, sizeof(store));
	struct nf_store *s;
	cr_assert_eq(nf_store_open(store, NULL, &s, NULL), 0);
	const struct nf_store_object *o = nf_store_ffn_find(s, 0, 0);
	cr_assert_not_null(o);
	uint32_t first, n;
	nf_store_extent_bundles(o, 9, &first, &n);
	for (uint32_t b = first; b < first + n; b++)   /* an exponent bit of a down value */
		ts_flip(store, nf_store_bundle_offset(o, b) + o->down_off + 3, 5);
	nf_store_close(s);
	int rc = sh("eval -m %s --ids 1,278,263,13,300,72 -b 1 --sparse-mode predictor", store);
	cr_expect_eq(rc, 1, "eval computed on corrupt bundles (exit %d)", rc);
	cr_expect(strstr(err, "blk.0.ffn") && strstr(err, "offset"), "%s", err);
	rc = sh("generate -m %s --ids 1,278,263,13 -n 8 -b 1 --temp 0", store);
	cr_expect_eq(rc, 1, "generate computed on corrupt bundles (exit %d)", rc);
	unlink(store);
}
