/*
 * bench_kernels.c - gemv bandwidth of the kernels against the machine's
 * memory-read bandwidth, gemm throughput, measured in the same run.
 *
 * gemv: y = W x over a set of 4096-column x 11008-row matrices larger than
 * the last-level cache (cycled, so every pass streams from DRAM), rows split
 * between pool threads. GB/s counts weight bytes read. memread: the same
 * threads summing an array of the same size with the widest vector loads,
 * one memread pass before each gemv pass so both see the same machine.
 * gemm: a 512-row activation batch against one 4096 x 2048 matrix.
 * Every figure is the median of REPS timed passes after one warm-up pass.
 * The cpu_ columns divide by the slowest thread's CPU time instead of wall
 * time: on a machine shared with other work they show what the kernel does
 * while it runs, and the wall-clock columns what the caller waited.
 *
 * With LLAMA_BENCH (llama.cpp's llama-bench) and LLAMA_BENCH_MODELS
 * (GGUF files separated by ':'), a row per file gives llama.cpp's decode
 * weight traffic (file bytes x tokens/s of `-t 2 -p 0 -n 16`, median of
 * REPS runs) beside a memory read by 2 threads before each run.
 *
 *	make bench BENCH=bench_kernels   # or: build/bench/bench_kernels [avx512|avx2|neon-dot|neon|scalar...]
 *
 * NFLASH_BENCH_TYPES (a comma list of q4_0, q8_0, f16, q2_K .. q6_K, kcol)
 * limits the run to those weight types (kcol: the rows below).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <sys/stat.h>

#include "../tools/cli.h"
#include "bench_common.h"
#include "nflash/kernels.h"
#include "nflash/pool.h"

#define REPS 5
#define SET_BYTES (320ull << 20) /* matrix set per type, well above L3 */
/* gemv shape: NFLASH_BENCH_SHAPE=COLSxROWS, e.g. 11008x4096 (a down matrix) */
static size_t n_cols = 4096, n_rows = 11008;
#define GEMM_ROWS 2048
#define GEMM_BATCH 512

struct gemv_job {
	const struct nf_kernels *k;
	enum nf_ktype kt;
	size_t n, rows, row_bytes;
	const char *w;
	const void *xq;
	float *y;
	/* gemm */
	size_t nb, xq_stride;
	int packed; /* in 8-row groups: gemv_x8 / gemm_x8 */
	double cpu[8]; /* per-thread CPU seconds of the last job */
};

static double thread_cpu(void)
{
	struct timespec t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double max_cpu(const double *c, int nth)
{
	double m = 0;
	for (int i = 0; i < nth; i++)
		m = c[i] > m ? c[i] : m;
	return m;
}

static void gemv_fn(void *arg, int ith, int nth)
{
	struct gemv_job *j = arg;
	size_t g = j->rows / 8, r0 = g * (size_t)ith / (size_t)nth * 8, r1 = g * (size_t)(ith + 1) / (size_t)nth * 8;
	double t0 = thread_cpu();
	if (j->packed)
		j->k->gemv_x8[j->kt](j->n, r1 - r0, j->w + r0 * j->row_bytes, j->xq, j->y + r0);
	else
		j->k->gemv[j->kt](j->n, r1 - r0, j->w + r0 * j->row_bytes, j->row_bytes, j->xq, j->y + r0);
	j->cpu[ith] = thread_cpu() - t0;
}

static void gemm_fn(void *arg, int ith, int nth)
{
	struct gemv_job *j = arg;
	size_t g = j->rows / 8, r0 = g * (size_t)ith / (size_t)nth * 8, r1 = g * (size_t)(ith + 1) / (size_t)nth * 8;
	double t0 = thread_cpu();
	if (j->packed)
		j->k->gemm_x8[j->kt](j->n, r1 - r0, j->w + r0 * j->row_bytes, j->nb, j->xq, j->xq_stride,
				  j->y + r0, j->rows);
	else
		j->k->gemm[j->kt](j->n, r1 - r0, j->w + r0 * j->row_bytes, j->row_bytes, j->nb, j->xq,
				  j->xq_stride, j->y + r0, j->rows);
	j->cpu[ith] = thread_cpu() - t0;
}

struct read_job {
	const char *buf;
	size_t bytes;
	uint64_t sink[8];
	double cpu[8];
};

static void read_fn(void *arg, int ith, int nth)
{
	struct read_job *j = arg;
	size_t chunk = j->bytes / (size_t)nth & ~(size_t)255;
	const char *p = j->buf + chunk * (size_t)ith;
	double t0 = thread_cpu();
	j->sink[ith] += nf_bench_memsum(p, chunk);
	j->cpu[ith] = thread_cpu() - t0;
}

/* Random weights whose fp16 scales and values are finite and modest. */
/* Where a K-quant block keeps its fp16 d (dmin, if any, right after). */
static size_t kq_d_offset(enum nf_ktype kt)
{
	switch (kt) {
	case NF_KT_Q2_K: return offsetof(struct nf_block_q2_K, d);
	case NF_KT_Q3_K: return offsetof(struct nf_block_q3_K, d);
	case NF_KT_Q4_K: return offsetof(struct nf_block_q4_K, d);
	case NF_KT_Q5_K: return offsetof(struct nf_block_q5_K, d);
	default: return offsetof(struct nf_block_q6_K, d);
	}
}

static void fill_weights(enum nf_ktype kt, uint32_t dt, char *w, size_t rows, size_t row_bytes, uint64_t seed)
{
	uint64_t s = seed | 1;
	for (size_t i = 0; i + 8 <= rows * row_bytes; i += 8) {
		uint64_t v = nf_bench_rng(&s);
		memcpy(w + i, &v, 8);
	}
	for (size_t r = 0; r < rows; r++) {
		char *row = w + r * row_bytes;
		if (kt == NF_KT_F16) {
			uint16_t *h = (uint16_t *)row;
			for (size_t i = 0; i < n_cols; i++)
				h[i] = (uint16_t)((h[i] & 0x83ff) | 0x2c00); /* |v| in [1/16, 1/8) */
		} else if (kt >= NF_KT_Q2_K && kt <= NF_KT_Q6_K) {
			/* random quants and scales; finite d (and dmin) at their offsets */
			size_t bs = nf_dtype_block_size(dt), doff = kq_d_offset(kt);
			for (size_t b = 0; b < n_cols / NF_QK_K; b++) {
				uint16_t d = nf_fp32_to_fp16(0.001f * (float)(1 + (b + r) % 7));
				memcpy(row + b * bs + doff, &d, 2);
				if (kt == NF_KT_Q2_K || kt == NF_KT_Q4_K || kt == NF_KT_Q5_K)
					memcpy(row + b * bs + doff + 2, &d, 2); /* dmin follows d */
			}
		} else {
			size_t bs = kt == NF_KT_Q4_0 || kt == NF_KT_Q4_0L ? sizeof(struct nf_block_q4_0) : sizeof(struct nf_block_q8_0);
			for (size_t b = 0; b < n_cols / NF_QK; b++) {
				uint16_t d = nf_fp32_to_fp16(0.001f * (float)(1 + (b + r) % 7));
				memcpy(row + b * bs, &d, 2);
			}
		}
	}
}

static void *alloc_huge(size_t bytes)
{
	void *p = aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1));
	if (!p) {
		fprintf(stderr, "bench_kernels: out of memory (%zu bytes)\n", bytes);
		exit(1);
	}
	return p;
}

/* One timed pass of the memory read: wall and slowest-thread CPU seconds. */
static void memread_pass(struct nf_pool *p, struct read_job *j, double *wall, double *cpu)
{
	double t0 = nf_cli_now();
	nf_pool_run(p, read_fn, j);
	*wall = nf_cli_now() - t0;
	*cpu = max_cpu(j->cpu, nf_pool_nthreads(p));
}

/* One timed pass of gemv over every matrix of the set. */
static void gemv_pass(struct nf_pool *p, struct gemv_job *j, const char *w, size_t nmat,
		      size_t mat, double *wall, double *cpu)
{
	double t0 = nf_cli_now(), cs = 0;
	for (size_t m = 0; m < nmat; m++) {
		j->w = w + m * mat;
		nf_pool_run(p, gemv_fn, j);
		cs += max_cpu(j->cpu, nf_pool_nthreads(p));
	}
	*wall = nf_cli_now() - t0;
	*cpu = cs;
}

/*
 * kcol: the sparse FFN's K-quant down columns (kcol_madd) as
 * nf_sp_kdown_rows runs them: columns of 4096 rows (b bits each) in
 * batches of 32 (the active neurons of a 256-neuron super-block at 13%),
 * per batch tiles of 256 rows, per tile every column of the batch into the
 * tile's lane sums. One thread over a set larger than the caches, the
 * tables' passes alternating, each after a memory-read pass; GB/s of
 * column bytes, medians.
 */
static void bench_kcol(const char **isas, int nisa, char *set, struct read_job *rj, struct nf_pool *pool1)
{
	enum { E = 4096, TILE = 256, BATCH = 32, MAXISA = 8 };
	static int16_t sc[E];
	static int32_t acc[8][E];
	uint64_t s = 5;
	for (size_t i = 0; i < SET_BYTES; i += 8) {
		uint64_t v = nf_bench_rng(&s);
		memcpy(set + i, &v, 8);
	}
	for (int i = 0; i < E; i++)
		sc[i] = (int16_t)(nf_bench_rng(&s) % 128);
	if (nisa > MAXISA)
		nisa = MAXISA;
	for (uint32_t bits = 4; bits <= 6; bits += 2) {
		size_t colb = (size_t)E * bits / 8, ncol = SET_BYTES / colb / BATCH * BATCH;
		double t[MAXISA][REPS], mt[REPS], d1;
		for (int r = -1; r < REPS; r++) {
			memread_pass(pool1, rj, &mt[r < 0 ? 0 : r], &d1);
			for (int ii = 0; ii < nisa; ii++) {
				const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
				if (!k)
					continue;
				double t0 = nf_cli_now();
				for (size_t c0 = 0; c0 < ncol; c0 += BATCH)
					for (size_t r0 = 0; r0 < E; r0 += TILE)
						for (size_t c = c0; c < c0 + BATCH; c++)
							k->kcol_madd(bits, 32, (const uint8_t *)set + c * colb + r0 * bits / 8,
								     TILE, sc + r0, (int32_t)(c % 255) - 127, acc[c % 8] + r0);
				if (r >= 0)
					t[ii][r] = nf_cli_now() - t0;
			}
		}
		double mgbps = (double)SET_BYTES / nf_bench_median(mt, REPS) / 1e9;
		for (int ii = 0; ii < nisa; ii++) {
			const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
			if (!k)
				continue;
			double gbps = (double)(ncol * colb) / nf_bench_median(t[ii], REPS) / 1e9;
			printf("kcol\t%s\tb%u\t1\t%.2f\t%.2f\t%.2f\t-\t-\t-\t-\t-\n", k->isa, bits, gbps, mgbps,
			       gbps / mgbps);
			fflush(stdout);
		}
	}
}

int main(int argc, char **argv)
{
	/* q4_0l: Q4_0 in ggml's vec_dot order (NF_KT_Q4_0L, kernels.h); f16v:
	 * F16 in ggml_vec_dot_f16's (NF_KT_F16V: one-column products) */
	static const enum nf_ktype types[] = { NF_KT_Q4_0, NF_KT_Q8_0, NF_KT_F16, NF_KT_Q2_K, NF_KT_Q3_K,
					       NF_KT_Q4_K, NF_KT_Q5_K, NF_KT_Q6_K, NF_KT_Q4_0L, NF_KT_F16V };
	static const char *const type_names[] = { "q4_0", "q8_0", "f16", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K",
						  "q4_0l", "f16v" };
	static const uint32_t type_dtypes[] = { NF_DTYPE_Q4_0, NF_DTYPE_Q8_0, NF_DTYPE_F16, NF_DTYPE_Q2_K,
						NF_DTYPE_Q3_K, NF_DTYPE_Q4_K, NF_DTYPE_Q5_K, NF_DTYPE_Q6_K,
						NF_DTYPE_Q4_0, NF_DTYPE_F16 };
	/* NFLASH_BENCH_TYPES=q2_K,q3_K: only those types */
	const char *only = getenv("NFLASH_BENCH_TYPES");
	const int n_types = (int)(sizeof(types) / sizeof(types[0]));
	const char *all_isas[] = NF_BENCH_ISAS_KERNELS; /* scalar: name it on the command line */
	const char **isas = all_isas;
	int nisa = (int)(sizeof(all_isas) / sizeof(all_isas[0]));
	nf_bench_args(argc, argv,
		      "usage: bench_kernels [TABLE...]\n"
		      "\n"
		      "gemv and gemm GB/s of each kernel table (default: the SIMD ones this CPU\n"
		      "has; TABLE: avx512, avx512-256, avx2, scalar, neon-dot, neon) per type, beside a plain\n"
		      "memory read by as many threads. Environment: NFLASH_BENCH_TYPES (e.g.\n"
		      "q4_0,q6_K), NFLASH_BENCH_SHAPE (COLSxROWS, default 4096x11008),\n"
		      "LLAMA_BENCH and LLAMA_BENCH_MODELS (llama.cpp beside it);\n"
		      "bench/bench_kernels.c's opening comment, docs/KERNELS.md.\n",
		      all_isas, nisa);
	if (argc > 1) {
		isas = (const char **)argv + 1;
		nisa = argc - 1;
	}
	const char *shape = getenv("NFLASH_BENCH_SHAPE");
	if (shape) {
		char *end;
		unsigned long long c = strtoull(shape, &end, 10), r = 0;
		if (*end == 'x')
			r = strtoull(end + 1, &end, 10);
		if (*end || c == 0 || c % NF_QK_K || c > (1u << 20) || r == 0 || r % 64 || r > (1u << 20)) {
			fprintf(stderr,
				"bench_kernels: NFLASH_BENCH_SHAPE='%s': want COLSxROWS, columns a multiple of "
				"256, rows of 64 (e.g. 11008x4096)\n",
				shape);
			return 2;
		}
		n_cols = (size_t)c;
		n_rows = (size_t)r;
	}
	char extra[128];
	snprintf(extra, sizeof(extra), "best isa %s; gemv %zux%zu, set %llu MiB per type",
		 nf_kernels_get()->isa, n_rows, n_cols, SET_BYTES >> 20);
	nf_bench_header("bench_kernels", extra);

	float *x = malloc(n_cols * sizeof(float));
	float *y = malloc((n_rows > GEMM_ROWS ? n_rows : GEMM_ROWS) * (size_t)GEMM_BATCH * sizeof(float));
	char *xq = alloc_huge(GEMM_BATCH * nf_act_size(NF_KT_F32, n_cols));
	if (!x || !y)
		return 1;
	uint64_t s = 42;
	for (size_t i = 0; i < n_cols; i++)
		x[i] = (float)(nf_bench_rng(&s) % 2001) / 1000.0f - 1.0f;

	/* memory-read reference: the same bytes as a matrix set, read by the
	 * same threads in passes interleaved with the gemv passes, so that both
	 * see the same machine */
	char *rbuf = alloc_huge(SET_BYTES);
	memset(rbuf, 1, SET_BYTES);
	struct read_job rj = { .buf = rbuf, .bytes = SET_BYTES };
	struct nf_pool *pools[3] = { NULL };
	for (int nt = 1; nt <= 2; nt++) {
		int rc = nf_pool_open(nt, -1, &pools[nt]);
		if (rc) {
			fprintf(stderr, "bench_kernels: pool: %d\n", rc);
			return 1;
		}
	}

	printf("op\tisa\ttype\tthreads\tGB_per_s\tmemread_GB_per_s\tratio\tcpu_GB_per_s\t"
	       "cpu_memread_GB_per_s\tcpu_ratio\tGFLOP_per_s\tcpu_GFLOP_per_s\n");
	fflush(stdout);

	for (int ti = 0; ti < n_types; ti++) {
		enum nf_ktype kt = types[ti];
		if (only && !nf_bench_list_has(only, type_names[ti]))
			continue;
		size_t rb = nf_dtype_row_size(type_dtypes[ti], n_cols), mat = rb * n_rows;
		size_t nmat = (SET_BYTES + mat - 1) / mat;
		char *w = alloc_huge(nmat * mat), *wp = NULL;
		fill_weights(kt, type_dtypes[ti], w, nmat * n_rows, rb, 7 + ti);
		/* Q4_0, Q8_0, Q4_K, Q5_K and Q6_K also in 8-row groups (the form
		 * nf_model_repack gives matrices in memory), for the tables that
		 * have kernels */
		if (nf_x8_supported(kt)) {
			wp = alloc_huge(nmat * mat);
			nf_repack_x8(kt, wp, w, n_cols, nmat * n_rows);
		}
		for (int vi = 0; vi < 2 * nisa; vi++) {
			const struct nf_kernels *k = nf_kernels_isa(isas[vi / 2]);
			int pk = vi % 2;
			if (!k || (pk && (!wp || !k->gemv_x8[kt])))
				continue;
			char tname[16];
			snprintf(tname, sizeof(tname), "%s%s", type_names[ti], pk ? "x8" : "");
			const char *wv = pk ? wp : w;
			k->act_prepare[kt](x, xq, n_cols);
			for (int nt = 1; nt <= 2; nt++) {
				struct gemv_job j = { .k = k, .kt = kt, .n = n_cols, .rows = n_rows,
						      .row_bytes = rb, .xq = xq, .y = y, .packed = pk };
				double t[REPS], c[REPS], mt[REPS], mc[REPS], d0, d1;
				gemv_pass(pools[nt], &j, wv, nmat, mat, &d0, &d1); /* warm-up */
				memread_pass(pools[nt], &rj, &d0, &d1);
				for (int r = 0; r < REPS; r++) {
					memread_pass(pools[nt], &rj, &mt[r], &mc[r]);
					gemv_pass(pools[nt], &j, wv, nmat, mat, &t[r], &c[r]);
				}
				double bytes = (double)(nmat * mat);
				double gbps = bytes / nf_bench_median(t, REPS) / 1e9;
				double cgbps = bytes / nf_bench_median(c, REPS) / 1e9;
				double mgbps = (double)SET_BYTES / nf_bench_median(mt, REPS) / 1e9;
				double mcgbps = (double)SET_BYTES / nf_bench_median(mc, REPS) / 1e9;
				double flop = 2.0 * n_cols * n_rows * (double)nmat;
				printf("gemv\t%s\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t%.1f\n", k->isa,
				       tname, nt, gbps, mgbps, gbps / mgbps, cgbps, mcgbps, cgbps / mcgbps,
				       flop / nf_bench_median(t, REPS) / 1e9, flop / nf_bench_median(c, REPS) / 1e9);
				fflush(stdout);
			}
			if (!strcmp(k->isa, "scalar"))
				continue; /* a 512-row scalar gemm takes minutes */
			size_t as = nf_act_size(kt, n_cols);
			for (size_t b = 0; b < GEMM_BATCH; b++) {
				for (size_t i = 0; i < n_cols; i++)
					x[i] = (float)(nf_bench_rng(&s) % 2001) / 1000.0f - 1.0f;
				k->act_prepare[kt](x, xq + b * as, n_cols);
			}
			for (int nt = 1; nt <= 2; nt++) {
				struct gemv_job j = { .k = k, .kt = kt, .n = n_cols, .rows = GEMM_ROWS,
						      .row_bytes = rb, .w = wv, .xq = xq, .y = y,
						      .nb = GEMM_BATCH, .xq_stride = as, .packed = pk };
				double t[3], c[3];
				for (int r = -1; r < 3; r++) {
					double t0 = nf_cli_now();
					nf_pool_run(pools[nt], gemm_fn, &j);
					if (r >= 0) {
						t[r] = nf_cli_now() - t0;
						c[r] = max_cpu(j.cpu, nt);
					}
				}
				double flop = 2.0 * n_cols * GEMM_ROWS * GEMM_BATCH;
				printf("gemm%d\t%s\t%s\t%d\t-\t-\t-\t-\t-\t-\t%.1f\t%.1f\n", GEMM_BATCH, k->isa,
				       tname, nt, flop / nf_bench_median(t, 3) / 1e9,
				       flop / nf_bench_median(c, 3) / 1e9);
				fflush(stdout);
			}
		}
		free(w);
		free(wp);
	}
	if (!only || nf_bench_list_has(only, "kcol"))
		bench_kcol(isas, nisa, rbuf, &rj, pools[1]);
	/* the peer: llama.cpp's decode on a whole model, its weight traffic
	 * (file bytes x tokens/s) beside a memory read of the same threads just
	 * before each run: what its gemv kernels reach inside a forward pass */
	const char *llama = getenv("LLAMA_BENCH"), *lmodels = getenv("LLAMA_BENCH_MODELS");
	if (llama && lmodels) {
		char list[4096];
		snprintf(list, sizeof(list), "%s", lmodels);
		char *save = NULL;
		for (char *f = strtok_r(list, ":", &save); f; f = strtok_r(NULL, ":", &save)) {
			struct stat st;
			if (stat(f, &st) < 0) {
				fprintf(stderr, "bench_kernels: LLAMA_BENCH_MODELS: %s: %s\n", f, strerror(errno));
				continue;
			}
			double t[REPS], mt[REPS], d1;
			int ok = 0;
			for (int r = 0; r < REPS; r++) {
				memread_pass(pools[2], &rj, &mt[ok], &d1);
				if (nf_bench_llama(llama, f, 2, 0, 16, &t[ok]) == 0)
					ok++;
			}
			if (!ok)
				continue;
			double tps = nf_bench_median(t, (size_t)ok), mgbps = (double)SET_BYTES / nf_bench_median(mt, (size_t)ok) / 1e9;
			double gbps = tps * (double)st.st_size / 1e9;
			printf("decode\tllama.cpp\t%s\t2\t%.2f\t%.2f\t%.2f\t-\t-\t-\t-\t-\n", f, gbps, mgbps, gbps / mgbps);
			fflush(stdout);
		}
	}
	nf_pool_close(pools[1]);
	nf_pool_close(pools[2]);
	free(rbuf);
	free(x);
	free(y);
	free(xq);
	return 0;
}
