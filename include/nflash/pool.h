/*
 * nflash/pool.h - a pool of pinned compute threads.
 *
 * Workers are created once, pinned to CPUs of one NUMA node (libnuma picks
 * the node of the caller unless told otherwise), and parked between jobs.
 * A job runs fn(arg, ith, nth) on every thread, the caller being thread 0,
 * and returns when all have finished. Decode issues hundreds of jobs per
 * token, so dispatch spins briefly before sleeping.
 *
 *	struct nf_pool *p;
 *	nf_pool_open(2, -1, &p);
 *	nf_pool_run(p, my_rows, &ctx);   // my_rows splits work by ith/nth
 *	nf_pool_close(p);
 *
 * nf_pool_run is called from one thread at a time.
 */
#ifndef NFLASH_POOL_H
#define NFLASH_POOL_H

#ifdef __cplusplus
extern "C" {
#endif

struct nf_pool;

typedef void (*nf_pool_fn)(void *arg, int ith, int nth);

/*
 * nf_pool_open - nthreads in total (including the caller; 0 = all CPUs of
 * the node), on NUMA node (-1 = the caller's). 0 or a negative errno.
 */
int nf_pool_open(int nthreads, int node, struct nf_pool **out);
/* Stop and join the workers. Accepts NULL. */
void nf_pool_close(struct nf_pool *p);
int nf_pool_nthreads(const struct nf_pool *p);
/* NUMA node the workers run on (for placing their memory). */
int nf_pool_node(const struct nf_pool *p);
void nf_pool_run(struct nf_pool *p, nf_pool_fn fn, void *arg);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_POOL_H */
