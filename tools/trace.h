/*
 * tools/trace.h - report helpers of `nflash trace` that other commands with
 * a --trace flag (`nflash store bench`, later `nflash generate`) reuse:
 * biolatency-style log2 bar histograms on a terminal and the JSON shape
 * documented in docs/TRACING.md.
 *
 * Not thread-safe; used from a command's main thread.
 */
#ifndef NFLASH_TOOLS_TRACE_H
#define NFLASH_TOOLS_TRACE_H

#include <stdio.h>

#include "cli.h"
#include "nflash/iotrace.h"

/* Prints every non-empty histogram of s and a totals line. */
void nf_trace_print(FILE *f, const struct nf_iotrace_stats *s);

/* Prints one histogram; unit names the value ("usecs", "bytes", "depth"). */
void nf_trace_print_histo(FILE *f, const char *title, const char *unit,
			  const struct nf_iotrace_histo *h);

/* Writes s as members of the JSON object currently open in j: "totals",
 * "lat_us", "size_bytes", "depth", "batch". */
void nf_trace_json_stats(struct nf_json *j, const struct nf_iotrace_stats *s);

/* Writes one histogram as an object {count, sum, mean, p50, p99, slots}. */
void nf_trace_json_histo(struct nf_json *j, const char *key, const struct nf_iotrace_histo *h);

#endif
