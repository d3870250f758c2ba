/*
 * bench_common.h - helpers shared by the bench/ programs: the header line
 * (machine, kernel, compiler) and medians.
 */
#ifndef NF_BENCH_COMMON_H
#define NF_BENCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

static inline void nf_bench_header(const char *name, const char *extra)
{
	char model[256] = "unknown";
	FILE *f = fopen("/proc/cpuinfo", "r");
	if (f) {
		char line[512];
		while (fgets(line, sizeof(line), f)) {
			char *c = strchr(line, ':');
			if (!strncmp(line, "model name", 10) && c) {
				snprintf(model, sizeof(model), "%s", c + 2);
				model[strcspn(model, "\n")] = 0;
				break;
			}
		}
		fclose(f);
	}
	struct utsname u;
	uname(&u);
	double load[3] = { -1, -1, -1 };
	getloadavg(load, 3);
	printf("# %s: machine %s, %ld cpus, load %.2f; kernel %s %s; cc %s -O2; %s\n", name, model,
	       sysconf(_SC_NPROCESSORS_ONLN), load[0], u.sysname, u.release, __VERSION__, extra);
}

static inline int nf_bench_cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static inline double nf_bench_median(double *v, size_t n)
{
	qsort(v, n, sizeof(*v), nf_bench_cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* xorshift64: deterministic inputs for benchmarks. */
static inline uint64_t nf_bench_rng(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/*
 * The peer: one run of llama.cpp's llama-bench (path bench, e.g. from the
 * LLAMA_BENCH environment variable) on model with threads threads, n_prompt
 * prompt tokens or n_gen generated ones (the other 0), one repetition, CSV
 * output; *tps gets its avg_ts (tokens per second). Returns 0, or -1 if it
 * could not run or printed no figure (its stderr goes to stderr).
 */
static inline int nf_bench_llama(const char *bench, const char *model, int threads, int n_prompt,
				 int n_gen, double *tps)
{
	char cmd[4096];
	snprintf(cmd, sizeof(cmd), "'%s' -m '%s' -t %d -p %d -n %d -r 1 -o csv 2>/dev/null", bench,
		 model, threads, n_prompt, n_gen);
	FILE *p = popen(cmd, "r");
	if (!p)
		return -1;
	char line[8192];
	int col = -1, rc = -1;
	while (fgets(line, sizeof(line), p)) {
		int i = 0;
		char *save = NULL;
		for (char *f = strtok_r(line, ",\n", &save); f; f = strtok_r(NULL, ",\n", &save), i++) {
			if (f[0] == '"')
				f++;
			size_t l = strlen(f);
			if (l && f[l - 1] == '"')
				f[l - 1] = 0;
			if (col < 0 && !strcmp(f, "avg_ts"))
				col = i;
			else if (col >= 0 && i == col) {
				*tps = strtod(f, NULL);
				rc = *tps > 0 ? 0 : -1;
			}
		}
	}
	int st = pclose(p);
	return st == 0 ? rc : -1;
}

#endif /* NF_BENCH_COMMON_H */
