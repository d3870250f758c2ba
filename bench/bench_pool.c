/*
 * bench_pool.c - what one nf_pool_run costs: an empty job back to back
 * (workers still spinning), and an empty job after the workers fell asleep
 * (futex wake-up). Decode issues ~250 jobs per token, so the first figure
 * times 250 is the pool's share of a token. Medians of REPS runs.
 *
 *	make bench BENCH=bench_pool
 */
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "../tools/cli.h"
#include "bench_common.h"
#include "nflash/pool.h"

#define REPS 7
#define JOBS 20000
#define SLEEPY_JOBS 200

static void empty_fn(void *arg, int ith, int nth)
{
	(void)arg;
	(void)ith;
	(void)nth;
}

int main(int argc, char **argv)
{
	nf_bench_args(argc, argv,
		"usage: bench_pool\n"
		"\n"
		"What one nf_pool_run costs: an empty job back to back (workers still\n"
		"spinning), and one after the workers fell asleep (futex wake-up).\n",
		NULL, 0);
	nf_bench_header("bench_pool", "empty jobs");
	printf("threads\tback_to_back_us_per_job\tafter_sleep_us_per_job\tper_token_250_jobs_us\n");
	for (int nt = 1; nt <= 2; nt++) {
		struct nf_pool *p;
		int rc = nf_pool_open(nt, -1, &p);
		if (rc) {
			fprintf(stderr, "bench_pool: open: %d\n", rc);
			return 1;
		}
		double hot[REPS], cold[REPS];
		for (int r = -1; r < REPS; r++) {
			double t0 = nf_cli_now();
			for (int j = 0; j < JOBS; j++)
				nf_pool_run(p, empty_fn, NULL);
			double t = (nf_cli_now() - t0) / JOBS;
			double sum = 0;
			for (int j = 0; j < SLEEPY_JOBS; j++) {
				usleep(2000); /* well past the spin: workers sleep on the futex */
				double t1 = nf_cli_now();
				nf_pool_run(p, empty_fn, NULL);
				sum += nf_cli_now() - t1;
			}
			if (r >= 0) {
				hot[r] = t;
				cold[r] = sum / SLEEPY_JOBS;
			}
		}
		double h = nf_bench_median(hot, REPS) * 1e6, c = nf_bench_median(cold, REPS) * 1e6;
		printf("%d\t%.3f\t%.3f\t%.1f\n", nt, h, c, h * 250);
		nf_pool_close(p);
	}
	return 0;
}
