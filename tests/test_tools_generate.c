/*
 * test_tools_generate.c - `nflash generate` and `nflash eval` end to end on
 * a testdata model: eval's logits file and generate's greedy ids against
 * llama.cpp's reference, --json fields, text prompts, and exit codes for
 * bad files (1) and bad usage (2).
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tools/cli.h"
#include "util_ref.h"

int nf_cmd_eval(int argc, char **argv);
int nf_cmd_generate(int argc, char **argv);

#define MODEL "../shared/testdata/models/tiny-llama-q8_0"

static int run(int (*cmd)(int, char **), int argc, const char **argv)
{
	int rc = cmd(argc, (char **)argv);
	fflush(stdout);
	fflush(stderr);
	return rc;
}

static void redirect(void)
{
	cr_redirect_stdout();
	cr_redirect_stderr();
}

/* What the command wrote so far to the redirected stream f (stdout or stderr). */
static void slurp(FILE *std, FILE *f, char *buf, size_t cap)
{
	fflush(std);
	memset(buf, 0, cap);
	cr_assert_gt(fread(buf, 1, cap - 1, f), 0);
}

static struct nf_ref load_ref(char *ids_csv, size_t cap)
{
	struct nf_ref r;
	if (access(MODEL ".gguf", R_OK) != 0)
		cr_skip_test("%s.gguf is absent", MODEL);
	cr_assert_eq(nf_ref_load(MODEL ".ref.txt", &r, NULL), 0);
	size_t off = 0;
	for (size_t i = 0; i < r.n_input; i++)
		off += (size_t)snprintf(ids_csv + off, cap - off, i ? ",%d" : "%d", r.input[i]);
	return r;
}

Test(tools, eval_writes_reference_logits)
{
	char ids[512], out[] = "/tmp/nflash-eval-XXXXXX";
	struct nf_ref r = load_ref(ids, sizeof(ids));
	int fd = mkstemp(out);
	cr_assert(fd >= 0);
	close(fd);
	/* the references were made with an F32 KV cache (the default is f16) */
	const char *argv[] = { "eval", "-m", MODEL ".gguf", "--ids", ids, "-t", "2", "--kv-type", "f32", "--logits", out };
	cr_assert_eq(run(nf_cmd_eval, 11, argv), NF_EXIT_OK);
	FILE *f = fopen(out, "r");
	cr_assert_not_null(f);
	size_t n = 0;
	double v, md = 0;
	while (fscanf(f, "%lf", &v) == 1) {
		cr_assert_lt(n, r.n_vocab);
		md = fmax(md, fabs(v - r.logits[n]));
		n++;
	}
	fclose(f);
	unlink(out);
	cr_assert_eq(n, r.n_vocab);
	cr_assert_leq(md, 1e-3, "eval logits differ from the reference by %g", md);
	nf_ref_free(&r);
}

Test(tools, generate_greedy_ids_match_reference, .init = redirect)
{
	char ids[512], want[1024];
	struct nf_ref r = load_ref(ids, sizeof(ids));
	size_t off = 0;
	for (size_t i = 0; i < r.n_greedy; i++)
		off += (size_t)snprintf(want + off, sizeof(want) - off, i ? " %d" : "%d", r.greedy[i]);
	snprintf(want + off, sizeof(want) - off, "\n");
	char n[16];
	snprintf(n, sizeof(n), "%zu", r.n_greedy);
	const char *argv[] = { "generate", "-m", MODEL ".gguf", "--ids", ids, "-n", n, "--temp", "0",
			       "--print-ids", "--ignore-eos", "-t", "1", "--kv-type", "f32" };
	cr_assert_eq(run(nf_cmd_generate, 15, argv), NF_EXIT_OK);
	cr_assert_stdout_eq_str(want);
	nf_ref_free(&r);
}

Test(tools, generate_json_fields, .init = redirect)
{
	char ids[512];
	struct nf_ref r = load_ref(ids, sizeof(ids));
	const char *argv[] = { "generate", "-m", MODEL ".gguf", "--ids", ids, "-n", "4", "--temp", "0",
			       "--ignore-eos", "--json", "--kv-type", "f16" };
	cr_assert_eq(run(nf_cmd_generate, 13, argv), NF_EXIT_OK);
	char buf[4096];
	slurp(stdout, cr_get_redirected_stdout(), buf, sizeof(buf));
	char first[64];
	snprintf(first, sizeof(first), "\"ids\":[%d,", r.greedy[0]);
	cr_assert(strstr(buf, first), "%s", buf);
	cr_assert(strstr(buf, "\"prompt_tokens\":8"), "%s", buf);
	cr_assert(strstr(buf, "\"gen_tokens\":4"), "%s", buf);
	cr_assert(strstr(buf, "\"prompt_tok_per_s\":"), "%s", buf);
	cr_assert(strstr(buf, "\"gen_tok_per_s\":"), "%s", buf);
	cr_assert(strstr(buf, "\"kv_type\":\"f16\""), "%s", buf);
	cr_assert(strstr(buf, "\"text\":"), "%s", buf);
	nf_ref_free(&r);
}

Test(tools, generate_text_prompt_and_timings, .init = redirect)
{
	if (access(MODEL ".gguf", R_OK) != 0)
		cr_skip_test("%s.gguf is absent", MODEL);
	const char *argv[] = { "generate", "-m", MODEL ".gguf", "-p", "Hello", "-n", "3", "--seed", "7" };
	cr_assert_eq(run(nf_cmd_generate, 9, argv), NF_EXIT_OK);
	char buf[4096];
	slurp(stderr, cr_get_redirected_stderr(), buf, sizeof(buf));
	cr_assert(strstr(buf, "load time"), "%s", buf);
	cr_assert(strstr(buf, "prompt eval time"), "%s", buf);
	cr_assert(strstr(buf, "tokens per second"), "%s", buf);
	cr_assert(strstr(buf, "seed 7"), "%s", buf);
}

Test(tools, generate_eval_errors, .init = redirect)
{
	const char *nomodel[] = { "generate", "--ids", "1,2" };
	cr_assert_eq(run(nf_cmd_generate, 3, nomodel), NF_EXIT_USAGE);
	const char *both[] = { "generate", "-m", MODEL ".gguf", "--ids", "1", "-p", "x" };
	cr_assert_eq(run(nf_cmd_generate, 7, both), NF_EXIT_USAGE);
	const char *badkv[] = { "generate", "-m", MODEL ".gguf", "--ids", "1", "--kv-type", "q8" };
	cr_assert_eq(run(nf_cmd_generate, 7, badkv), NF_EXIT_USAGE);
	const char *badtemp[] = { "generate", "-m", MODEL ".gguf", "--ids", "1", "--temp", "hot" };
	cr_assert_eq(run(nf_cmd_generate, 7, badtemp), NF_EXIT_USAGE);
	const char *badfile[] = { "generate", "-m", "/nonexistent/m.gguf", "--ids", "1" };
	cr_assert_eq(run(nf_cmd_generate, 5, badfile), NF_EXIT_FAIL);
	const char *badid[] = { "eval", "-m", MODEL ".gguf", "--ids", "1,99999" };
	cr_assert_eq(run(nf_cmd_eval, 5, badid), NF_EXIT_USAGE);
	const char *noids[] = { "eval", "-m", MODEL ".gguf" };
	cr_assert_eq(run(nf_cmd_eval, 3, noids), NF_EXIT_USAGE);
	const char *unknown[] = { "eval", "--bogus" };
	cr_assert_eq(run(nf_cmd_eval, 2, unknown), NF_EXIT_USAGE);
	char buf[8192];
	slurp(stderr, cr_get_redirected_stderr(), buf, sizeof(buf));
	cr_assert(strstr(buf, "/nonexistent/m.gguf"), "%s", buf);
	cr_assert(strstr(buf, "--kv-type"), "%s", buf);
	cr_assert(strstr(buf, "99999"), "%s", buf);
	cr_assert(strstr(buf, "--bogus"), "%s", buf);
}
