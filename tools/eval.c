/*
 * eval.c - `nflash eval`: run a prompt given as token ids and write the
 * last position's logits, one per line as %.6e (the format of the
 * testdata references), to a file or stdout.
 *
 * Invariants: the output file is written completely or reported as failed
 * (exit 1); nothing is printed to stdout but the logits.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/error.h"
#include "cli.h"
#include "model_cli.h"

static void eval_usage(FILE *f)
{
	fprintf(f,
		"usage: nflash eval -m MODEL --ids 1,2,3 [-c CONTEXT] [-t THREADS] [--logits FILE]\n"
		"\n"
		"Runs the prompt (token ids, no BOS added) and writes the logits of the\n"
		"last position, one per line as %%.6e, to FILE or stdout.\n"
		"\n"
		"options:\n");
	nf_model_cli_help(f);
	fprintf(f,
		"  --ids LIST            comma-separated prompt token ids; required\n"
		"  --logits FILE         write the logits here instead of stdout\n"
		"  --json                print a JSON object (stats, vm_hwm_bytes) on stdout instead\n"
		"                        of the logits (use --logits FILE for them)\n"
		"  -h, --help            this help\n");
}

int nf_cmd_eval(int argc, char **argv)
{
	struct nf_model_cli mc;
	nf_model_cli_init(&mc);
	int32_t *ids = NULL;
	size_t n_ids = 0;
	const char *out_path = NULL;
	bool json = false;
	int ret = NF_EXIT_USAGE;

	for (int i = 1; i < argc; i++) {
		const char *f = argv[i], *v;
		int r = nf_model_cli_flag(&mc, argc, argv, &i);
		if (r < 0)
			goto done;
		if (r > 0)
			continue;
		if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
			eval_usage(stdout);
			ret = NF_EXIT_OK;
			goto done;
		} else if (!strcmp(f, "--ids")) {
			free(ids);
			ids = NULL;
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_ids(f, v, &ids, &n_ids) < 0)
				goto done;
		} else if (!strcmp(f, "--json")) {
			json = true;
		} else if (!strcmp(f, "--logits")) {
			if (!(out_path = nf_cli_value(argc, argv, &i)))
				goto done;
		} else {
			nf_cli_err("eval: unknown option '%s' (try 'nflash eval --help')", f);
			goto done;
		}
	}
	if (!ids) {
		nf_cli_err("eval: --ids is required");
		goto done;
	}
	if ((ret = nf_model_cli_open(&mc)) != NF_EXIT_OK)
		goto done;

	uint32_t n_vocab = nf_model_hparams(mc.model)->n_vocab;
	ret = NF_EXIT_USAGE;
	for (size_t i = 0; i < n_ids; i++)
		if (ids[i] < 0 || (uint32_t)ids[i] >= n_vocab) {
			nf_cli_err("--ids: token id %d is outside the vocabulary of %s (%u tokens)",
				   ids[i], mc.path, n_vocab);
			goto done;
		}
	if (n_ids > nf_ctx_n_ctx(mc.ctx)) {
		nf_cli_err("--ids: %zu tokens do not fit the context of %u (-c)", n_ids, nf_ctx_n_ctx(mc.ctx));
		goto done;
	}
	ret = NF_EXIT_FAIL;
	double t0 = nf_cli_now();
	int rc = nf_ctx_eval(mc.ctx, ids, n_ids);
	double t_eval = nf_cli_now() - t0;
	if (rc < 0) {
		nf_cli_err("%s: evaluation failed: %s", mc.path, nf_model_cli_strerror(&mc, rc));
		goto done;
	}
	nf_model_cli_stats_total(&mc, stderr, t_eval);
	if ((ret = nf_model_cli_profile_save(&mc, n_ids)) != NF_EXIT_OK)
		goto done;
	ret = NF_EXIT_FAIL;
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "model", mc.path);
		nf_json_u64(&j, "prompt_tokens", n_ids);
		nf_json_dbl(&j, "eval_ms", t_eval * 1e3);
		nf_model_cli_stats_json(&mc, &j, t_eval);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
		if (!out_path) {
			ret = NF_EXIT_OK;
			goto done;
		}
	}
	FILE *f = out_path ? fopen(out_path, "w") : stdout;
	if (!f) {
		nf_cli_err("--logits %s: %s", out_path, strerror(errno));
		goto done;
	}
	const float *lg = nf_ctx_logits(mc.ctx);
	for (uint32_t i = 0; i < n_vocab; i++)
		fprintf(f, "%.6e\n", lg[i]);
	int werr = ferror(f);
	if (out_path)
		werr |= fclose(f) != 0;
	else
		werr |= fflush(f) != 0;
	if (werr) {
		nf_cli_err("%s: write failed: %s", out_path ? out_path : "stdout", strerror(errno));
		goto done;
	}
	ret = NF_EXIT_OK;
done:
	free(ids);
	nf_model_cli_close(&mc);
	return ret;
}
