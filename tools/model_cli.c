/*
 * model_cli.c - the flags generate and eval share, and opening the model
 * (see model_cli.h).
 *
 * Invariants: every error names the flag or the file; the load time covers
 * parsing, mapping and prefaulting the weights and allocating the context.
 */
#include <string.h>

#include "nflash/error.h"
#include "cli.h"
#include "model_cli.h"

void nf_model_cli_init(struct nf_model_cli *mc)
{
	memset(mc, 0, sizeof(*mc));
	mc->n_batch = 512;
	mc->kv_type = NF_KV_F32;
}

int nf_model_cli_flag(struct nf_model_cli *mc, int argc, char **argv, int *i)
{
	const char *f = argv[*i], *v;
	if (!strcmp(f, "-m") || !strcmp(f, "--model")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		mc->path = v;
	} else if (!strcmp(f, "-c") || !strcmp(f, "--ctx-size")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1 << 24, &mc->n_ctx) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "-t") || !strcmp(f, "--threads")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1024, &mc->n_threads) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "-b") || !strcmp(f, "--batch-size")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 1, 1 << 16, &mc->n_batch) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "--kv-type")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		if (!strcmp(v, "f32")) {
			mc->kv_type = NF_KV_F32;
		} else if (!strcmp(v, "f16")) {
			mc->kv_type = NF_KV_F16;
		} else {
			nf_cli_err("%s: expected f32 or f16, got '%s'", f, v);
			return NF_EUSAGE;
		}
	} else {
		return 0;
	}
	return 1;
}

void nf_model_cli_help(FILE *f)
{
	fprintf(f,
		"  -m, --model FILE      GGUF model (llama.cpp or PowerInfer file); required\n"
		"  -c, --ctx-size N      context length in tokens (default: the model's)\n"
		"  -t, --threads N       compute threads (default: all CPUs)\n"
		"  -b, --batch-size N    prompt tokens per forward step (default 512)\n"
		"  --kv-type f32|f16     KV cache element type (default f32)\n");
}

int nf_model_cli_open(struct nf_model_cli *mc)
{
	if (!mc->path) {
		nf_cli_err("-m MODEL is required");
		return NF_EXIT_USAGE;
	}
	struct nf_diag d = { 0 };
	double t0 = nf_cli_now();
	int rc = nf_model_load(mc->path, NULL, &mc->model, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	const struct nf_model_hparams *hp = nf_model_hparams(mc->model);
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = (uint32_t)mc->n_ctx;
	cp.n_batch = (uint32_t)mc->n_batch;
	cp.n_threads = (int)mc->n_threads;
	cp.kv_type = mc->kv_type;
	if (mc->n_ctx > (long)hp->n_ctx_train)
		nf_cli_warn("-c %ld exceeds the model's training context %u", mc->n_ctx, hp->n_ctx_train);
	rc = nf_ctx_open(mc->model, &cp, &mc->ctx, &d);
	if (rc < 0) {
		nf_cli_err("%s: %s", mc->path, nf_diag_msg(&d, rc));
		nf_model_free(mc->model);
		mc->model = NULL;
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	mc->load_s = nf_cli_now() - t0;
	return NF_EXIT_OK;
}

void nf_model_cli_close(struct nf_model_cli *mc)
{
	nf_ctx_close(mc->ctx);
	nf_model_free(mc->model);
	mc->ctx = NULL;
	mc->model = NULL;
}
