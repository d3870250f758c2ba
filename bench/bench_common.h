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

/*
 * The command line of a bench program: -h/--help anywhere prints usage to
 * stdout and exits 0. With isas given (bench_kernels, bench_gather), the
 * arguments must be kernel tables (those names or "scalar"; one the CPU
 * lacks is skipped); without, a program takes none. Anything else is
 * named on stderr, with the usage, and the exit status is 2.
 */
static inline void nf_bench_args(int argc, char **argv, const char *usage, const char *const *isas, int nisa)
{
	for (int i = 1; i < argc; i++)
		if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
			fputs(usage, stdout);
			exit(0);
		}
	for (int i = 1; i < argc; i++) {
		int ok = nisa && !strcmp(argv[i], "scalar");
		for (int j = 0; j < nisa && !ok; j++)
			ok = !strcmp(argv[i], isas[j]);
		if (!ok) {
			fprintf(stderr, "%s: unknown %s '%s'\n%s", argv[0], nisa ? "kernel table" : "argument", argv[i],
				usage);
			exit(2);
		}
	}
}

static inline void nf_bench_header(const char *name, const char *extra)
{
	char model[256] = "unknown";
	FILE *f = fopen("/proc/cpuinfo", "r");
	if (f) {
		char line[512];
		while (fgets(line, sizeof(line), f)) {
			char *c = strchr(line, ':');
			/* x86: "model name"; arm64: "CPU part" (the core's id) when the
			 * kernel gives no model name */
			if ((!strncmp(line, "model name", 10) || !strncmp(line, "CPU part", 8)) && c) {
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

/*
 * Sum of the 64-bit words of p[0..bytes) (bytes a multiple of 64, p
 * aligned to 64) with the widest loads the CPU has: the memory-read
 * bandwidth the gemv benchmarks are compared with.
 */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static inline uint64_t nf_bench_sum_avx512(const char *p, size_t bytes)
{
	__m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
	for (size_t i = 0; i + 256 <= bytes; i += 256) {
		s0 = _mm512_add_epi64(s0, _mm512_load_si512((const void *)(p + i)));
		s1 = _mm512_add_epi64(s1, _mm512_load_si512((const void *)(p + i + 64)));
		s2 = _mm512_add_epi64(s2, _mm512_load_si512((const void *)(p + i + 128)));
		s3 = _mm512_add_epi64(s3, _mm512_load_si512((const void *)(p + i + 192)));
	}
	for (size_t i = bytes & ~(size_t)255; i + 64 <= bytes; i += 64)
		s0 = _mm512_add_epi64(s0, _mm512_load_si512((const void *)(p + i)));
	return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1),
								  _mm512_add_epi64(s2, s3)));
}

__attribute__((target("avx2"))) static inline uint64_t nf_bench_sum_avx2(const char *p, size_t bytes)
{
	__m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
	for (size_t i = 0; i + 128 <= bytes; i += 128) {
		s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(p + i)));
		s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(p + i + 32)));
		s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i *)(p + i + 64)));
		s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i *)(p + i + 96)));
	}
	for (size_t i = bytes & ~(size_t)127; i + 64 <= bytes; i += 64) {
		s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(p + i)));
		s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(p + i + 32)));
	}
	s0 = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
	uint64_t l[4];
	_mm256_storeu_si256((__m256i *)l, s0);
	return l[0] + l[1] + l[2] + l[3];
}

static inline uint64_t nf_bench_memsum(const char *p, size_t bytes)
{
	return __builtin_cpu_supports("avx512f") ? nf_bench_sum_avx512(p, bytes) : nf_bench_sum_avx2(p, bytes);
}

/* The SIMD tables a benchmark measures when none is named; bench_kernels
 * adds avx512-256, which differs from avx512 in Q4_0's group gemv only. */
#define NF_BENCH_ISAS { "avx512", "avx2" }
#define NF_BENCH_ISAS_KERNELS { "avx512", "avx512-256", "avx2" }
#elif defined(__aarch64__)
#include <arm_neon.h>
static inline uint64_t nf_bench_memsum(const char *p, size_t bytes)
{
	uint64x2_t s0 = vdupq_n_u64(0), s1 = s0, s2 = s0, s3 = s0;
	for (size_t i = 0; i + 64 <= bytes; i += 64) {
		const uint64_t *q = (const uint64_t *)(const void *)(p + i);
		s0 = vaddq_u64(s0, vld1q_u64(q));
		s1 = vaddq_u64(s1, vld1q_u64(q + 2));
		s2 = vaddq_u64(s2, vld1q_u64(q + 4));
		s3 = vaddq_u64(s3, vld1q_u64(q + 6));
	}
	return vaddvq_u64(vaddq_u64(vaddq_u64(s0, s1), vaddq_u64(s2, s3)));
}

#define NF_BENCH_ISAS { "neon-dot", "neon" }
#define NF_BENCH_ISAS_KERNELS NF_BENCH_ISAS
#endif

/* True if name is one of the comma-separated items of list. */
static inline int nf_bench_list_has(const char *list, const char *name)
{
	size_t n = strlen(name);
	for (const char *p = list; *p;) {
		const char *e = strchr(p, ',');
		size_t len = e ? (size_t)(e - p) : strlen(p);
		if (len == n && !strncmp(p, name, n))
			return 1;
		p += len + (e != NULL);
	}
	return 0;
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
