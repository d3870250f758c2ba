/*
 * pool.c - pinned compute threads with a generation-counter dispatch.
 *
 * Invariants:
 * 1. One job at a time: nf_pool_run publishes fn/arg, then bumps `gen`
 *    (release); a worker that sees a new gen (acquire) runs fn once and adds
 *    one to `done`; run returns when done == nth - 1, so fn/arg are never
 *    rewritten while a worker may still read them.
 * 2. Sleeping is lost-wakeup free: a waiter announces itself in a sleeper
 *    count (seq_cst) before FUTEX_WAIT on the word it watches, and a waker
 *    changes that word (seq_cst) before reading the count, so either the
 *    waker sees the sleeper or the futex sees the new value.
 * 3. Worker i (1 <= i < nth) is pinned to the i-th allowed CPU of the node,
 *    modulo their number; the caller (thread 0) keeps its own affinity.
 * 4. close sets `stop` and bumps gen like a job; workers exit on it and are
 *    joined; no worker outlives the pool.
 */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The spin-wait hint of the target. */
#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

#include "nflash/pool.h"

/* Spin this long before sleeping: longer than the gap between the jobs of
 * one decode step, short enough not to burn a shared CPU between tokens. */
#define POOL_SPIN_NS 100000

struct pool_worker {
	struct nf_pool *pool;
	pthread_t thread;
	int ith;
	int cpu;
};

struct nf_pool {
	int nth;
	int node;
	nf_pool_fn fn;
	void *arg;
	_Atomic uint32_t gen;       /* futex word: bumped once per job */
	_Atomic uint32_t done;      /* futex word: workers finished this job */
	_Atomic int gen_sleepers;   /* workers in FUTEX_WAIT on gen */
	_Atomic int done_sleeper;   /* caller in FUTEX_WAIT on done */
	_Atomic int stop;
	int nstarted;
	struct pool_worker *workers; /* nth - 1 of them */
};

static void futex_wait(_Atomic uint32_t *word, uint32_t val)
{
	syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word)
{
	syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Wait until *word != seen; returns the new value. */
static uint32_t wait_change(_Atomic uint32_t *word, uint32_t seen, _Atomic int *sleepers)
{
	uint32_t v;
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int i = 1;; i++) {
		v = atomic_load_explicit(word, memory_order_acquire);
		if (v != seen)
			return v;
		cpu_relax();
		if (i % 64 == 0) {
			clock_gettime(CLOCK_MONOTONIC, &t);
			if ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) > POOL_SPIN_NS)
				break;
		}
	}
	for (;;) {
		atomic_fetch_add(sleepers, 1);
		if (atomic_load(word) == seen)
			futex_wait(word, seen);
		atomic_fetch_sub(sleepers, 1);
		v = atomic_load_explicit(word, memory_order_acquire);
		if (v != seen)
			return v;
	}
}

static void *pool_worker_main(void *p)
{
	struct pool_worker *w = p;
	struct nf_pool *pool = w->pool;
	uint32_t seen = 0;

	if (w->cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(w->cpu, &set);
		/* Pinning is a performance hint: a refusal (cgroup limits) is not fatal. */
		(void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	for (;;) {
		seen = wait_change(&pool->gen, seen, &pool->gen_sleepers);
		if (atomic_load_explicit(&pool->stop, memory_order_acquire))
			break;
		pool->fn(pool->arg, w->ith, pool->nth);
		atomic_fetch_add(&pool->done, 1);
		if (atomic_load(&pool->done_sleeper))
			futex_wake(&pool->done);
	}
	return NULL;
}

/* The CPUs of node that this process may run on, in ascending order. */
static int pool_node_cpus(int node, int *cpus, int max)
{
	cpu_set_t allowed;
	int n = 0;

	if (sched_getaffinity(0, sizeof(allowed), &allowed) < 0)
		return -errno;
	if (numa_available() < 0) {
		for (int c = 0; c < CPU_SETSIZE && n < max; c++)
			if (CPU_ISSET(c, &allowed))
				cpus[n++] = c;
		return n;
	}
	struct bitmask *bm = numa_allocate_cpumask();
	if (!bm)
		return -ENOMEM;
	if (numa_node_to_cpus(node, bm) < 0) {
		numa_free_cpumask(bm);
		return -EINVAL;
	}
	for (int c = 0; c < CPU_SETSIZE && (unsigned)c < bm->size && n < max; c++)
		if (numa_bitmask_isbitset(bm, (unsigned)c) && CPU_ISSET(c, &allowed))
			cpus[n++] = c;
	numa_free_cpumask(bm);
	return n;
}

static void pool_stop_workers(struct nf_pool *p)
{
	atomic_store(&p->stop, 1);
	atomic_fetch_add(&p->gen, 1);
	if (atomic_load(&p->gen_sleepers))
		futex_wake(&p->gen);
	for (int i = 0; i < p->nstarted; i++)
		pthread_join(p->workers[i].thread, NULL);
	p->nstarted = 0;
}

int nf_pool_open(int nthreads, int node, struct nf_pool **out)
{
	int rc, ncpu, *cpus = NULL;
	struct nf_pool *p = NULL;

	*out = NULL;
	if (nthreads < 0 || node < -1)
		return -EINVAL;
	if (node == -1) {
		int cpu = sched_getcpu();
		node = (numa_available() >= 0 && cpu >= 0) ? numa_node_of_cpu(cpu) : 0;
		if (node < 0)
			node = 0;
	} else if (numa_available() < 0 ? node != 0 : node > numa_max_node()) {
		return -EINVAL;
	}
	cpus = malloc(CPU_SETSIZE * sizeof(*cpus));
	if (!cpus)
		return -ENOMEM;
	ncpu = pool_node_cpus(node, cpus, CPU_SETSIZE);
	if (ncpu < 0) {
		rc = ncpu;
		goto free_cpus;
	}
	if (nthreads == 0)
		nthreads = ncpu > 0 ? ncpu : 1;

	p = calloc(1, sizeof(*p));
	if (!p) {
		rc = -ENOMEM;
		goto free_cpus;
	}
	p->nth = nthreads;
	p->node = node;
	p->workers = calloc((size_t)nthreads, sizeof(*p->workers));
	if (!p->workers) {
		rc = -ENOMEM;
		goto free_pool;
	}
	for (int i = 1; i < nthreads; i++) {
		struct pool_worker *w = &p->workers[i - 1];
		w->pool = p;
		w->ith = i;
		w->cpu = ncpu > 0 ? cpus[i % ncpu] : -1;
		rc = -pthread_create(&w->thread, NULL, pool_worker_main, w);
		if (rc)
			goto stop_workers;
		p->nstarted++;
	}
	free(cpus);
	*out = p;
	return 0;

stop_workers:
	pool_stop_workers(p);
	free(p->workers);
free_pool:
	free(p);
free_cpus:
	free(cpus);
	return rc;
}

void nf_pool_close(struct nf_pool *p)
{
	if (!p)
		return;
	pool_stop_workers(p);
	free(p->workers);
	free(p);
}

int nf_pool_nthreads(const struct nf_pool *p)
{
	return p->nth;
}

int nf_pool_node(const struct nf_pool *p)
{
	return p->node;
}

void nf_pool_run(struct nf_pool *p, nf_pool_fn fn, void *arg)
{
	if (p->nth == 1) {
		fn(arg, 0, 1);
		return;
	}
	p->fn = fn;
	p->arg = arg;
	atomic_store_explicit(&p->done, 0, memory_order_relaxed);
	atomic_fetch_add(&p->gen, 1); /* seq_cst: publishes fn/arg/done */
	if (atomic_load(&p->gen_sleepers))
		futex_wake(&p->gen);

	fn(arg, 0, p->nth);

	uint32_t want = (uint32_t)(p->nth - 1), d;
	while ((d = atomic_load_explicit(&p->done, memory_order_acquire)) != want)
		wait_change(&p->done, d, &p->done_sleeper);
}
