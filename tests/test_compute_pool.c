/*
 * test_compute_pool.c - the thread pool: every thread runs every job once,
 * with its own ith, many jobs in a row, and close joins the workers.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "nflash/pool.h"

struct job {
	int nth_seen[8];
	long hits[8];       /* per thread, written only by that thread */
	_Atomic long total; /* ith summed over all threads and jobs */
	long data[1000];
};

static void job_fn(void *arg, int ith, int nth)
{
	struct job *j = arg;
	j->nth_seen[ith] = nth;
	j->hits[ith]++;
	atomic_fetch_add(&j->total, ith + 1);
	/* split rows as kernels do: each thread owns a disjoint range */
	size_t lo = 1000 * (size_t)ith / (size_t)nth, hi = 1000 * (size_t)(ith + 1) / (size_t)nth;
	for (size_t i = lo; i < hi; i++)
		j->data[i] += (long)i;
}

static void run_many(int nthreads, int jobs)
{
	struct nf_pool *p;
	cr_assert_eq(nf_pool_open(nthreads, -1, &p), 0);
	int nth = nf_pool_nthreads(p);
	cr_assert(nth >= 1 && nth <= 8);
	if (nthreads)
		cr_assert_eq(nth, nthreads);
	cr_assert(nf_pool_node(p) >= 0);
	struct job *j = calloc(1, sizeof(*j));
	cr_assert_not_null(j);
	for (int k = 0; k < jobs; k++) {
		nf_pool_run(p, job_fn, j);
		/* every result of job k is visible when run returns */
		cr_assert_eq(j->data[999], 999L * (k + 1), "job %d", k);
		if (k % 97 == 0)
			usleep(200); /* let workers fall asleep on the futex sometimes */
	}
	for (int i = 0; i < nth; i++) {
		cr_assert_eq(j->hits[i], jobs, "thread %d ran %ld of %d jobs", i, j->hits[i], jobs);
		cr_assert_eq(j->nth_seen[i], nth);
	}
	cr_assert_eq(atomic_load(&j->total), (long)jobs * nth * (nth + 1) / 2);
	for (int i = 0; i < 1000; i++)
		cr_assert_eq(j->data[i], (long)i * jobs);
	nf_pool_close(p);
	free(j);
}

Test(pool, two_threads_many_jobs) { run_many(2, 3000); }
Test(pool, more_threads_than_cpus) { run_many(5, 500); }
Test(pool, one_thread_runs_inline) { run_many(1, 10); }
Test(pool, zero_means_node_cpus) { run_many(0, 100); }

Test(pool, open_close_repeatedly)
{
	for (int i = 0; i < 20; i++) {
		struct nf_pool *p;
		cr_assert_eq(nf_pool_open(3, -1, &p), 0);
		if (i % 2)
			run_many(2, 2);
		nf_pool_close(p); /* idle workers, some never ran a job */
	}
	nf_pool_close(NULL);
}

Test(pool, bad_arguments)
{
	struct nf_pool *p = (struct nf_pool *)1;
	cr_assert_eq(nf_pool_open(-1, -1, &p), -EINVAL);
	cr_assert_null(p);
	cr_assert_eq(nf_pool_open(2, 4096, &p), -EINVAL);
	cr_assert_null(p);
}

/* Workers are pinned to CPUs this process may use. */
static void where_fn(void *arg, int ith, int nth)
{
	((int *)arg)[ith] = sched_getcpu();
}

Test(pool, workers_run_on_allowed_cpus)
{
	cpu_set_t allowed;
	cr_assert_eq(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
	struct nf_pool *p;
	cr_assert_eq(nf_pool_open(2, -1, &p), 0);
	int cpu[2] = { -1, -1 };
	nf_pool_run(p, where_fn, cpu);
	for (int i = 0; i < 2; i++)
		cr_assert(cpu[i] >= 0 && CPU_ISSET(cpu[i], &allowed), "thread %d on cpu %d", i, cpu[i]);
	nf_pool_close(p);
}
