/*
 * bench_gather.c - the sparse FFN's gather kernels against the per-row
 * calls they replace, on scattered rows streaming from DRAM.
 *
 * A set of 4096-column x 11008-row matrices larger than the last-level
 * cache stands for a 7B model's layers; per matrix a fixed 13% of the rows
 * (the predictor benchmark's activity) is active, cut into chunks of 64
 * active rows as compute/ffn_sparse.c does, chunks split between pool
 * threads. Per chunk:
 *   gemv_rows   one gemv call per row (nrows = 1), the path before gemv_list
 *   gemv_list   one gemv_list call
 *   axpy_cols   one axpy per row as a down column into the chunk's output
 *   axpy_list   one axpy_list call
 *   read_rows   the peer: a plain sum of the same rows' cache lines, no
 *               arithmetic, in the same chunks and threads (what DRAM gives
 *               to reads scattered like these)
 * Q4_0 and Q8_0 run all four; Q4_K and Q6_K the two gemv ops (their downs
 * are K-quant columns, kcol_madd, not rows).
 * GB/s counts the active rows' bytes; every figure is the median of REPS
 * passes over the whole set after one warm-up pass. ratio_to_per_row
 * compares the list kernel to the per-row calls, of_read_rows each op to
 * the plain read of the same rows, measured in the same repetitions.
 *
 *	make bench BENCH=bench_gather   # or: build/bench/bench_gather [avx512|avx2|neon-dot|neon...]
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tools/cli.h"
#include "bench_common.h"
#include "nflash/kernels.h"
#include "nflash/pool.h"

#define REPS 5
#define SET_BYTES (320ull << 20)
#define N_COLS 4096
#define N_ROWS 11008
#define CHUNK 64
#define ACTIVE_PER_1000 130

enum op { OP_GEMV_ROWS, OP_GEMV_LIST, OP_AXPY_COLS, OP_AXPY_LIST, OP_READ_ROWS, OP_COUNT };
static const char *const op_names[OP_COUNT] = { "gemv_rows", "gemv_list", "axpy_cols", "axpy_list",
						 "read_rows" };

struct job {
	const struct nf_kernels *k;
	enum nf_ktype kt;
	enum op op;
	const char *w;          /* current matrix */
	size_t row_bytes;
	const uint32_t *active; /* active row ids, ascending */
	size_t n_active;
	const void *xq;
	float *y;               /* N_ROWS: gemv outputs */
	float *out;             /* per thread N_COLS: chunk output */
	const float *coef;      /* per active row */
	uint64_t sink[2];       /* read_rows' sums, per thread */
};

static void job_fn(void *arg, int ith, int nth)
{
	struct job *j = arg;
	size_t nchunks = (j->n_active + CHUNK - 1) / CHUNK;
	float *out = j->out + (size_t)ith * N_COLS;
	for (size_t c = (size_t)ith; c < nchunks; c += (size_t)nth) {
		size_t a0 = c * CHUNK, an = j->n_active - a0 < CHUNK ? j->n_active - a0 : CHUNK;
		const void *rows[CHUNK];
		for (size_t i = 0; i < an; i++)
			rows[i] = j->w + (size_t)j->active[a0 + i] * j->row_bytes;
		switch (j->op) {
		case OP_GEMV_ROWS:
			for (size_t i = 0; i < an; i++)
				j->k->gemv[j->kt](N_COLS, 1, rows[i], j->row_bytes, j->xq, j->y + a0 + i);
			break;
		case OP_GEMV_LIST:
			j->k->gemv_list[j->kt](N_COLS, an, rows, j->xq, j->y + a0);
			break;
		case OP_AXPY_COLS:
			memset(out, 0, N_COLS * sizeof(float));
			for (size_t i = 0; i < an; i++)
				j->k->axpy[j->kt](N_COLS, j->coef[a0 + i], rows[i], out);
			break;
		case OP_AXPY_LIST:
			memset(out, 0, N_COLS * sizeof(float));
			j->k->axpy_list[j->kt](N_COLS, an, j->coef + a0, rows, out);
			break;
		default:
			/* every cache line a row touches */
			for (size_t i = 0; i < an; i++) {
				uintptr_t p0 = (uintptr_t)rows[i] & ~(uintptr_t)63;
				uintptr_t p1 = ((uintptr_t)rows[i] + j->row_bytes + 63) & ~(uintptr_t)63;
				j->sink[ith & 1] += nf_bench_memsum((const char *)p0, p1 - p0);
			}
			break;
		}
	}
}

int main(int argc, char **argv)
{
	static const enum nf_ktype types[] = { NF_KT_Q4_0, NF_KT_Q8_0, NF_KT_Q4_K, NF_KT_Q6_K };
	static const char *const type_names[] = { "q4_0", "q8_0", "q4_K", "q6_K" };
	static const uint32_t type_dtypes[] = { NF_DTYPE_Q4_0, NF_DTYPE_Q8_0, NF_DTYPE_Q4_K, NF_DTYPE_Q6_K };
	/* per block: its size, values, and where its fp16 scales sit */
	static const size_t type_bs[] = { sizeof(struct nf_block_q4_0), sizeof(struct nf_block_q8_0),
					  sizeof(struct nf_block_q4_K), sizeof(struct nf_block_q6_K) };
	static const size_t type_qk[] = { NF_QK, NF_QK, NF_QK_K, NF_QK_K };
	static const size_t type_d0[] = { 0, 0, 0, offsetof(struct nf_block_q6_K, d) };
	static const int type_nd[] = { 1, 1, 2, 1 };  /* q4_K: d and dmin */
	const int ntypes = (int)(sizeof(types) / sizeof(types[0]));
	const char *all_isas[] = NF_BENCH_ISAS;
	const char **isas = all_isas;
	int nisa = (int)(sizeof(all_isas) / sizeof(all_isas[0]));
	nf_bench_args(argc, argv,
		      "usage: bench_gather [TABLE...]\n"
		      "\n"
		      "The sparse FFN's gather kernels (gemv_list, axpy_list) against one call\n"
		      "per row and against a plain read of the same rows (read_rows), on 13%\n"
		      "of the rows of 7B-shaped matrices streaming from DRAM,\n"
		      "per kernel table (default: the SIMD ones this CPU has; TABLE: avx512,\n"
		      "avx2, scalar, neon-dot, neon) and type (bench/bench_gather.c).\n",
		      all_isas, nisa);
	if (argc > 1) {
		isas = (const char **)argv + 1;
		nisa = argc - 1;
	}
	char extra[160];
	snprintf(extra, sizeof(extra), "best isa %s; %dx%d matrices, %.1f%% rows active, chunks of %d, set %llu MiB",
		 nf_kernels_get()->isa, N_ROWS, N_COLS, ACTIVE_PER_1000 / 10.0, CHUNK, SET_BYTES >> 20);
	nf_bench_header("bench_gather", extra);

	uint64_t s = 42;
	float *x = malloc(N_COLS * sizeof(float)), *y = malloc(N_ROWS * sizeof(float));
	float *out = malloc(2 * N_COLS * sizeof(float)), *coef = malloc(N_ROWS * sizeof(float));
	uint32_t *active = malloc(N_ROWS * sizeof(uint32_t));
	void *xq = malloc(nf_act_size(NF_KT_F32, N_COLS));
	if (!x || !y || !out || !coef || !active || !xq)
		return 1;
	for (size_t i = 0; i < N_COLS; i++)
		x[i] = (float)(nf_bench_rng(&s) % 2001) / 1000.0f - 1.0f;
	struct nf_pool *pools[3] = { NULL };
	for (int nt = 1; nt <= 2; nt++)
		if (nf_pool_open(nt, -1, &pools[nt]) < 0)
			return 1;

	printf("op\tisa\ttype\tthreads\tGB_per_s\tratio_to_per_row\tof_read_rows\n");
	fflush(stdout);
	for (int ti = 0; ti < ntypes; ti++) {
		enum nf_ktype kt = types[ti];
		size_t rb = nf_dtype_row_size(type_dtypes[ti], N_COLS), mat = rb * N_ROWS;
		size_t nmat = (SET_BYTES + mat - 1) / mat;
		char *w = aligned_alloc(2 << 20, (nmat * mat + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1));
		if (!w)
			return 1;
		/* random quants, modest finite fp16 scales */
		for (size_t i = 0; i + 8 <= nmat * mat; i += 8) {
			uint64_t v = nf_bench_rng(&s);
			memcpy(w + i, &v, 8);
		}
		size_t bs = type_bs[ti];
		for (size_t r = 0; r < nmat * N_ROWS; r++)
			for (size_t b = 0; b < N_COLS / type_qk[ti]; b++)
				for (int f = 0; f < type_nd[ti]; f++) {
					uint16_t d = nf_fp32_to_fp16(0.001f * (float)(1 + (b + r + f) % 7));
					memcpy(w + r * rb + b * bs + type_d0[ti] + 2 * (size_t)f, &d, 2);
				}
		size_t n_active = 0;
		for (uint32_t r = 0; r < N_ROWS; r++)
			if (nf_bench_rng(&s) % 1000 < ACTIVE_PER_1000) {
				coef[n_active] = (float)(nf_bench_rng(&s) % 255) / 64.0f - 2.0f;
				active[n_active++] = r;
			}
		for (int ii = 0; ii < nisa; ii++) {
			const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
			if (!k)
				continue;
			k->act_prepare[kt](x, xq, N_COLS);
			/* K-quant downs go through kcol_madd (QCOL form), not axpy */
			bool down = kt == NF_KT_Q4_0 || kt == NF_KT_Q8_0;
			for (int nt = 1; nt <= 2; nt++) {
				double t[OP_COUNT][REPS];
				for (int rep = -1; rep < REPS; rep++)
					for (int op = 0; op < OP_COUNT; op++) {
						if (!down && (op == OP_AXPY_COLS || op == OP_AXPY_LIST))
							continue;
						struct job j = { .k = k, .kt = kt, .op = (enum op)op, .row_bytes = rb,
								 .active = active, .n_active = n_active, .xq = xq,
								 .y = y, .out = out, .coef = coef };
						double t0 = nf_cli_now();
						for (size_t m = 0; m < nmat; m++) {
							j.w = w + m * mat;
							nf_pool_run(pools[nt], job_fn, &j);
						}
						if (rep >= 0)
							t[op][rep] = nf_cli_now() - t0;
					}
				double bytes = (double)n_active * (double)rb * (double)nmat, med[OP_COUNT];
				for (int op = 0; op < OP_COUNT; op++)
					if (down || (op != OP_AXPY_COLS && op != OP_AXPY_LIST))
						med[op] = nf_bench_median(t[op], REPS);
				for (int op = 0; op < OP_COUNT; op++) {
					if (!down && (op == OP_AXPY_COLS || op == OP_AXPY_LIST))
						continue;
					printf("%s\t%s\t%s\t%d\t%.2f\t", op_names[op], k->isa, type_names[ti], nt,
					       bytes / med[op] / 1e9);
					if (op == OP_READ_ROWS)
						printf("-\t1.00\n");
					else
						printf("%.2f\t%.2f\n", med[op & ~1] / med[op], med[OP_READ_ROWS] / med[op]);
				}
				fflush(stdout);
			}
		}
		free(w);
	}
	nf_pool_close(pools[1]);
	nf_pool_close(pools[2]);
	free(x);
	free(y);
	free(out);
	free(coef);
	free(active);
	free(xq);
	return 0;
}
