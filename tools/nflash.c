/*
 * nflash.c - the `nflash` command: dispatch to one subcommand per file.
 *
 * Each subcommand lives in tools/<name>.c as nf_cmd_<name>(argc, argv) and
 * returns an exit code from cli.h (0 ok, 1 failed, 2 usage).
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int nf_cmd_eval(int argc, char **argv);
int nf_cmd_generate(int argc, char **argv);
int nf_cmd_import(int argc, char **argv);
int nf_cmd_plan(int argc, char **argv);
int nf_cmd_serve(int argc, char **argv);
int nf_cmd_store(int argc, char **argv);
int nf_cmd_synth(int argc, char **argv);
int nf_cmd_tokenize(int argc, char **argv);
int nf_cmd_trace(int argc, char **argv);

static const struct nf_cmd nf_cmds[] = {
	/* { "name", nf_cmd_name, "summary" }, kept in alphabetical order */
	{ "eval", nf_cmd_eval, "run a prompt of token ids, print the last position's logits" },
	{ "generate", nf_cmd_generate, "generate text after a prompt, with llama.cpp-style timings" },
	{ "import", nf_cmd_import, "build a store from a GGUF (llama.cpp or PowerInfer)" },
	{ "plan", nf_cmd_plan, "measure device and model, lay out a store, plan settings for a memory budget" },
	{ "serve", nf_cmd_serve, "OpenAI-compatible HTTP server (completions, chat, SSE, /metrics)" },
	{ "store", nf_cmd_store, "make, inspect, verify and benchmark stores" },
	{ "synth", nf_cmd_synth, "write a synthetic sparse model (GGUF); --report measures one" },
	{ "tokenize", nf_cmd_tokenize, "token ids of a text with a GGUF vocabulary" },
	{ "trace", nf_cmd_trace, "eBPF histograms of a process's block I/O (latency, size, depth)" },
	{ NULL, NULL, NULL },
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: nflash <command> [options]\n"
		"\n"
		"Runs LLMs whose weights do not fit in memory by streaming the FFN\n"
		"neurons each token activates from flash (PowerInfer-2 style).\n"
		"\n"
		"commands:\n");
	for (size_t i = 0; nf_cmds[i].name; i++)
		fprintf(f, "  %-10s %s\n", nf_cmds[i].name, nf_cmds[i].summary);
	fprintf(f,
		"\n"
		"`nflash <command> --help` describes one command.\n"
		"exit codes: 0 success, 1 operation failed, 2 usage error or unsupported here\n");
}

static int run(int argc, char **argv)
{
	if (argc < 2) {
		usage(stderr);
		return NF_EXIT_USAGE;
	}
	if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
		usage(stdout);
		return NF_EXIT_OK;
	}
	if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
		printf("nflash %s\n", NF_VERSION);
		return NF_EXIT_OK;
	}
	for (size_t i = 0; nf_cmds[i].name; i++)
		if (!strcmp(argv[1], nf_cmds[i].name))
			return nf_cmds[i].run(argc - 1, argv + 1);
	nf_cli_err("unknown command '%s' (try 'nflash --help')", argv[1]);
	return NF_EXIT_USAGE;
}

/* A command whose output (or whose diagnostics) did not all reach their
 * file failed, whatever it returned: `nflash generate > /dev/full` exits 1. */
int main(int argc, char **argv)
{
	int rc = run(argc, argv);
	bool out_ok = nf_cli_out_ok(stdout, "standard output");
	bool err_ok = nf_cli_out_ok(stderr, "standard error");
	return rc == NF_EXIT_OK && !(out_ok && err_ok) ? NF_EXIT_FAIL : rc;
}
