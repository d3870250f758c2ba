/*
 * stress_pool.c - the thread pool under ThreadSanitizer, outside Criterion.
 *
 * Criterion cannot start under TSan (Snaipe/Criterion#274: "Could not
 * initialize inheritable arena"), so `make SANITIZE=thread test` aborts
 * before any test runs. This program drives the same pool paths: many jobs
 * in a row with spinning and sleeping workers, per-thread results, close.
 *
 *	make tsan-pool          # exit 0 and no TSan report = pass
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "nflash/pool.h"

struct job { long per[8]; long data[4096]; };

static void fn(void *arg, int ith, int nth)
{
	struct job *j = arg;
	j->per[ith]++;
	for (size_t i = 4096 * (size_t)ith / (size_t)nth; i < 4096 * (size_t)(ith + 1) / (size_t)nth; i++)
		j->data[i] += 1;
}

int main(void)
{
	for (int nthreads = 1; nthreads <= 4; nthreads++) {
		struct nf_pool *p;
		int rc = nf_pool_open(nthreads, -1, &p);
		if (rc) {
			fprintf(stderr, "open: %d\n", rc);
			return 1;
		}
		struct job *j = calloc(1, sizeof(*j));
		for (int k = 0; k < 2000; k++) {
			nf_pool_run(p, fn, j);
			if (k % 500 == 0)
				usleep(20000); /* workers go to FUTEX_WAIT */
		}
		for (int i = 0; i < nthreads; i++)
			if (j->per[i] != 2000) {
				fprintf(stderr, "thread %d ran %ld jobs\n", i, j->per[i]);
				return 1;
			}
		for (int i = 0; i < 4096; i++)
			if (j->data[i] != 2000) {
				fprintf(stderr, "data[%d] = %ld\n", i, j->data[i]);
				return 1;
			}
		nf_pool_close(p);
		free(j);
	}
	puts("stress_pool: ok");
	return 0;
}
