/*
 * tools/store_profile.h - `nflash store relayout` and the profile summary
 * of `nflash store inspect` (tools/store_profile.c).
 *
 * Not thread-safe; used from the command's main thread.
 */
#ifndef NFLASH_TOOLS_STORE_PROFILE_H
#define NFLASH_TOOLS_STORE_PROFILE_H

#include "nflash/store.h"

struct nf_json;

/* `nflash store relayout IN OUT [--profile-from STORE]`; an exit code. */
int nf_store_cmd_relayout(int argc, char **argv);

/* The store's profile: one "profile" line on stdout, or with j a
 * "profile" object (present, tokens, source, top10_share,
 * hot_first_layout; error when damaged). */
void nf_store_profile_print(const struct nf_store *s, struct nf_json *j);

#endif
