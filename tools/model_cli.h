/*
 * tools/model_cli.h - flags and set-up shared by the commands that run a
 * model (generate, eval): -m, -c, -t, -b, --kv-type, and opening the model
 * and its context with errors that name the file or flag.
 *
 * Not thread-safe; used from the command's main thread.
 */
#ifndef NFLASH_TOOLS_MODEL_CLI_H
#define NFLASH_TOOLS_MODEL_CLI_H

#include <stdio.h>

#include "nflash/model.h"

struct nf_model_cli {
	const char *path;       /* -m */
	long n_ctx;             /* -c, 0: the model's */
	long n_threads;         /* -t, 0: all CPUs */
	long n_batch;           /* -b */
	enum nf_kv_type kv_type;
	/* filled by nf_model_cli_open */
	struct nf_model *model;
	struct nf_ctx *ctx;
	double load_s;
};

void nf_model_cli_init(struct nf_model_cli *mc);

/*
 * If argv[*i] is one of the shared flags, parse it (advancing *i past its
 * value) and return 1; return 0 if it is not one of them; NF_EUSAGE after
 * printing an error naming the flag.
 */
int nf_model_cli_flag(struct nf_model_cli *mc, int argc, char **argv, int *i);

/* Help lines for the shared flags. */
void nf_model_cli_help(FILE *f);

/*
 * Load the model and open a context. Returns an exit code: NF_EXIT_OK,
 * NF_EXIT_USAGE (no -m, a bad -c/-t for this model) or NF_EXIT_FAIL (the
 * file is bad), after printing the error.
 */
int nf_model_cli_open(struct nf_model_cli *mc);
void nf_model_cli_close(struct nf_model_cli *mc);

#endif
