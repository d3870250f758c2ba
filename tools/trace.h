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

#include <signal.h>
#include <stdbool.h>
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

/*
 * --trace for the engine's own commands (`nflash store bench`, later
 * `nflash generate`): trace this process around a measured period and
 * report the device's view next to the engine's request latency.
 *
 *	struct nf_trace_probe p;
 *	nf_trace_probe_start(&p, want_trace);   // warns and carries on if it cannot
 *	... warm-up ...
 *	nf_trace_probe_mark(&p);                // start of the measured period
 *	... measured I/O; poll nf_trace_probe_interrupted(&p) ...
 *	nf_trace_probe_collect(&p);             // end of the measured period
 *	nf_trace_probe_report(&p, stdout, NULL, &engine);  // or into a JSON object
 *	nf_trace_probe_stop(&p);                // detach, unpin, deliver SIGINT/SIGTERM
 *
 * SIGINT and SIGTERM are held while the tracer is attached so that the pins
 * are always removed; a held signal is delivered by nf_trace_probe_stop().
 */
struct nf_trace_probe {
	struct nf_iotrace *t;          /* NULL when tracing is off or failed */
	struct nf_iotrace_stats a, b, d;
	sigset_t oldmask;
	bool masked, wanted, interrupted;
	double last_check;             /* nf_trace_probe_interrupted() looks every 50 ms */
	char err[256];                 /* why tracing is off, when it was wanted */
};

/* Engine-side latency of the same period, microseconds. */
struct nf_trace_engine_lat {
	uint64_t reads;
	double mean_us, p50_us, p99_us;
};

/* Returns true when tracing is on; on failure warns (one line) and returns false. */
bool nf_trace_probe_start(struct nf_trace_probe *p, bool want);
void nf_trace_probe_mark(struct nf_trace_probe *p);
void nf_trace_probe_collect(struct nf_trace_probe *p);
/* True when SIGINT or SIGTERM arrived while tracing: stop the measurement.
 * Cheap enough for a hot loop: asks the kernel at most every 50 ms. */
bool nf_trace_probe_interrupted(struct nf_trace_probe *p);
/* Text lines to f, or, with j != NULL, a "trace" object member of j's open object. */
void nf_trace_probe_report(const struct nf_trace_probe *p, FILE *f, struct nf_json *j,
			   const struct nf_trace_engine_lat *e);
void nf_trace_probe_stop(struct nf_trace_probe *p);
