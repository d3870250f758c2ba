/*
 * test_tools_tokenize.c - `nflash tokenize`: ids on stdout, flags, and exit
 * codes for a bad file (1) and bad usage (2); errors name the file.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <string.h>

#include "../tools/cli.h"

int nf_cmd_tokenize(int argc, char **argv);

#define SPM "../shared/testdata/vocab/ggml-vocab-llama-spm.gguf"
#define GPT2 "../shared/testdata/vocab/ggml-vocab-gpt-2.gguf"

static int run(int argc, const char **argv)
{
	int rc = nf_cmd_tokenize(argc, (char **)argv);
	fflush(stdout);
	fflush(stderr);
	return rc;
}

static void redirect(void)
{
	cr_redirect_stdout();
	cr_redirect_stderr();
}

Test(tools, tokenize_spm_with_bos, .init = redirect)
{
	const char *argv[] = { "tokenize", "-m", SPM, "Hello world" };
	cr_assert_eq(run(4, argv), NF_EXIT_OK);
	cr_assert_stdout_eq_str("1 15043 3186\n");
}

Test(tools, tokenize_no_bos_json, .init = redirect)
{
	const char *argv[] = { "tokenize", "--no-bos", "--json", "-m", GPT2, " Hello, world!" };
	cr_assert_eq(run(6, argv), NF_EXIT_OK);
	cr_assert_stdout_eq_str("{\"model\":\"" GPT2 "\",\"ids\":[18435,11,995,0],\"n_tokens\":4}\n");
}

Test(tools, tokenize_special_text, .init = redirect)
{
	const char *argv[] = { "tokenize", "-m", GPT2, "--no-parse-special", "a<|endoftext|>" };
	cr_assert_eq(run(5, argv), NF_EXIT_OK);
	/* as text: several ordinary tokens, never 50256 */
	const char *argv2[] = { "tokenize", "-m", GPT2, "-p", "a<|endoftext|>" };
	cr_assert_eq(run(5, argv2), NF_EXIT_OK);
	cr_assert_stdout_eq_str("64 27 91 437 1659 5239 91 29\n64 50256\n");
}

Test(tools, tokenize_errors, .init = redirect)
{
	const char *bad[] = { "tokenize", "-m", "/nonexistent/m.gguf", "x" };
	cr_assert_eq(run(4, bad), NF_EXIT_FAIL);
	const char *nomodel[] = { "tokenize", "x" };
	cr_assert_eq(run(2, nomodel), NF_EXIT_USAGE);
	const char *notext[] = { "tokenize", "-m", SPM };
	cr_assert_eq(run(3, notext), NF_EXIT_USAGE);
	const char *two[] = { "tokenize", "-m", SPM, "a", "b" };
	cr_assert_eq(run(5, two), NF_EXIT_USAGE);
	const char *flag[] = { "tokenize", "-m", SPM, "--bogus", "a" };
	cr_assert_eq(run(5, flag), NF_EXIT_USAGE);
	cr_assert_stderr_eq_str(
		"nflash: /nonexistent/m.gguf: cannot open: No such file or directory\n"
		"nflash: tokenize: -m MODEL is required (try 'nflash tokenize --help')\n"
		"nflash: tokenize: no TEXT given (try 'nflash tokenize --help')\n"
		"nflash: tokenize: give the text as one argument (quote it)\n"
		"nflash: tokenize: unknown option '--bogus' (try 'nflash tokenize --help')\n");
}
