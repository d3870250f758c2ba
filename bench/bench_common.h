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

#endif /* NF_BENCH_COMMON_H */
