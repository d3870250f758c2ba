/*
 * tools/plan_cli.h - `nflash plan` and the plan summary of `nflash store
 * inspect` (tools/plan.c).
 *
 * Not thread-safe; used from the command's main thread.
 */
#ifndef NFLASH_TOOLS_PLAN_CLI_H
#define NFLASH_TOOLS_PLAN_CLI_H

#include "nflash/store.h"

struct nf_json;

/* `nflash plan STORE --memory-budget SIZE ...`; an exit code. */
int nf_cmd_plan(int argc, char **argv);

/* The store's plans: a "plan" block on stdout, or with j a "plan" object
 * (present, plans; error when damaged). */
void nf_plan_print(const struct nf_store *s, struct nf_json *j);

#endif
