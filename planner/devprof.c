/*
 * devprof.c - what the planner measures of the machine (nflash/plan.h):
 * the store's device by request size and queue depth, through the engine's
 * own I/O backend (O_DIRECT), the gemv kernels' GB/s per weight type and
 * thread count beside the memory-read bandwidth, and the crc32c check's
 * cost per byte.
 *
 * Invariants:
 *  1. Every figure is measured here, on this store's file and these
 *     kernels; nothing is assumed (DESIGN invariant 6).
 *  2. Reads go to random block-aligned offsets of the store's data area,
 *     or, given the offsets a calibration read, to those (aligned down,
 *     kept inside the area): O_DIRECT, so this machine's page cache never
 *     answers (the sync backend on a file system without it says so, and
 *     its figures are the page cache's); what lies below the file (a
 *     host's cache under a virtual disk, a drive's DRAM) answers as it
 *     will for decode's reads, which go where the calibration's went.
 *  3. Bytes in flight stay under READ_CAP_BYTES: a point whose depth times
 *     size exceeds it is not measured (interpolation covers it).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "nflash/crc32c.h"
#include "nflash/io.h"
#include "nflash/kernels.h"
#include "nflash/plan.h"
#include "nflash/pool.h"

#define READ_CAP_BYTES (64u << 20)

static const uint32_t k_sizes[] = { 4096, 16384, 65536, 262144, 1048576 };
static const uint32_t k_qds[] = { 1, 8, 32, 128, 256 };
#define N_SIZES (sizeof(k_sizes) / sizeof(k_sizes[0]))
#define N_QDS (sizeof(k_qds) / sizeof(k_qds[0]))

void nf_plan_device_opts_default(struct nf_plan_device_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->io_backend = -1;
	o->seconds = 12.0;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu_s(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
	       ((double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_usec) / 1e6;
}

static void progress(const struct nf_plan_progress *pr, const char *label, uint64_t done, uint64_t total)
{
	if (pr && pr->fn)
		pr->fn(pr->arg, label, done, total);
}

/* ---- the read curve -------------------------------------------------------------- */

struct rd {
	struct nf_io_ctx *io;
	uint64_t lo, span;         /* offsets drawn from [lo, lo + span) */
	const uint64_t *at;        /* or near these (n_at of them) */
	size_t n_at;
	uint64_t align;
	uint32_t size;
	uint64_t rng;
	double deadline;
	uint64_t done, lat_ns;
	int err;
	char *bufs;
};

struct rd_slot {
	struct rd *r;
	char *buf;
};

static uint64_t xorshift(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

static void rd_done(void *cookie, int result);

static int rd_submit(struct rd_slot *sl)
{
	struct rd *r = sl->r;
	uint64_t slots = r->span / r->size, off;
	if (r->n_at) {
		/* a read the calibration made, aligned down, inside the area */
		off = r->at[xorshift(&r->rng) % r->n_at] & ~(r->align - 1);
		uint64_t end = r->lo + (slots ? slots : 1) * r->size;
		if (off + r->size > end)
			off = (end - r->size) & ~(r->align - 1);
		if (off < r->lo)
			off = r->lo;
	} else {
		off = r->lo + (xorshift(&r->rng) % (slots ? slots : 1)) * r->size;
	}
	return nf_io_ctx_read_raw(r->io, off, r->size, sl->buf, rd_done, sl);
}

static void rd_done(void *cookie, int result)
{
	struct rd_slot *sl = cookie;
	struct rd *r = sl->r;
	if (result < 0) {
		r->err = r->err ? r->err : result;
		return;
	}
	r->done++;
	if (now_s() < r->deadline && !r->err) {
		int rc = rd_submit(sl);
		if (rc < 0)
			r->err = rc;
	}
}

static void on_read(void *user, uint64_t offset, uint32_t len, int64_t res, uint64_t lat_ns)
{
	struct rd *r = user;
	r->lat_ns += lat_ns;
}

/* One point: qd reads of size in flight for secs. */
static int read_point(struct nf_store *s, const struct nf_plan_device_opts *o, uint64_t lo, uint64_t span,
		      uint32_t size, uint32_t qd, double secs, struct nf_store_dev_point *pt, struct nf_diag *d)
{
	struct rd r = { .lo = lo, .span = span, .size = size, .rng = 0x9e3779b97f4a7c15ull ^ size ^ qd,
			.at = o->offsets, .n_at = o->offsets ? o->n_offsets : 0 };
	struct nf_io_opts io;
	nf_io_opts_default(&io);
	if (o->io_backend >= 0)
		io.backend = (enum nf_io_backend)o->io_backend;
	io.qd = qd;
	io.max_coalesce = size;
	io.quiet = true;
	io.on_read = on_read;
	io.on_read_user = &r;
	int rc = nf_io_ctx_open(s, &io, &r.io, d);
	if (rc < 0)
		return rc;
	uint32_t align = nf_io_ctx_align(r.io);
	r.align = align > 4096 ? align : 4096;
	struct rd_slot *sl = calloc(qd, sizeof(*sl));
	r.bufs = nf_io_buf_alloc((size_t)qd * size, align > 4096 ? align : 4096);
	if (!sl || !r.bufs) {
		rc = nf_diag_fail(d, -ENOMEM, "plan: no memory for %u reads of %u bytes", qd, size);
		goto out;
	}
	/* warm-up: a short burst the figures do not count */
	double t0 = now_s();
	r.deadline = t0 + secs / 8;
	for (uint32_t i = 0; i < qd; i++) {
		sl[i] = (struct rd_slot){ &r, r.bufs + (size_t)i * size };
		if ((rc = rd_submit(&sl[i])) < 0)
			goto fail_io;
	}
	while (nf_io_ctx_pending(r.io))
		if ((rc = nf_io_ctx_wait(r.io, 0, -1)) < 0)
			goto fail_io;
	r.done = 0;
	r.lat_ns = 0;
	double c0 = cpu_s();
	t0 = now_s();
	r.deadline = t0 + secs;
	for (uint32_t i = 0; i < qd; i++)
		if ((rc = rd_submit(&sl[i])) < 0)
			goto fail_io;
	while (nf_io_ctx_pending(r.io))
		if ((rc = nf_io_ctx_wait(r.io, 0, -1)) < 0)
			goto fail_io;
	double t = now_s() - t0, c = cpu_s() - c0;
	if (r.err) {
		rc = r.err;
		goto fail_io;
	}
	*pt = (struct nf_store_dev_point){
		.req_bytes = size,
		.qd = qd,
		.mb_s = r.done ? (double)r.done * size / t / 1e6 : 0,
		.cpu_us = r.done ? c / (double)r.done * 1e6 : 0,
		.lat_us = r.done ? (double)r.lat_ns / (double)r.done / 1e3 : 0,
	};
	rc = 0;
	goto out;
fail_io:
	rc = nf_diag_fail(d, rc, "%s: plan: reading %u bytes at queue depth %u: %s", nf_store_path(s), size, qd,
			  nf_strerror(rc));
out:
	nf_io_ctx_close(r.io);
	nf_io_buf_free(r.bufs);
	free(sl);
	return rc;
}

static int read_curve(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
		      struct nf_diag *d)
{
	const struct nf_store_info *in = nf_store_info(s);
	/* the data area: objects and sections, block-aligned */
	uint64_t lo = in->data_start, span = in->table_offset > lo ? in->table_offset - lo : 0;
	uint32_t n = 0;
	for (size_t i = 0; i < N_SIZES; i++)
		for (size_t j = 0; j < N_QDS; j++)
			n += (uint64_t)k_sizes[i] * k_qds[j] <= READ_CAP_BYTES && span >= k_sizes[i];
	if (!n)
		return nf_diag_fail(d, NF_EUSAGE, "%s: plan: the store's data area (%llu bytes) is too small to measure",
				    nf_store_path(s), (unsigned long long)span);
	p->points = calloc(n, sizeof(*p->points));
	if (!p->points)
		return -ENOMEM;
	double secs = o->seconds / n;
	uint32_t k = 0;
	progress(o->progress, "measuring the device", 0, n);
	for (size_t i = 0; i < N_SIZES; i++)
		for (size_t j = 0; j < N_QDS; j++) {
			if ((uint64_t)k_sizes[i] * k_qds[j] > READ_CAP_BYTES || span < k_sizes[i])
				continue;
			int rc = read_point(s, o, lo, span, k_sizes[i], k_qds[j], secs, &p->points[k], d);
			if (rc < 0)
				return rc;
			progress(o->progress, "measuring the device", ++k, n);
		}
	p->n_points = k;
	return 0;
}

/* ---- kernels and memory ---------------------------------------------------------------- */

#define KROWS 4096
/* the kernels' and the memory read's set: far beyond a last-level cache
 * (a 64 MB set half fits a 32 MB L3: Q4_0 on 2 threads of the AVX-512
 * EPYC probed 55.9 GB/s over it, and the memory read 48.8, where a 47B
 * decode's dense weights streamed at about 25) */
#define KSET_BYTES (256u << 20)
#define MEMREAD_PASSES 5

struct kjob {
	const struct nf_kernels *k;
	int kt;
	const char *w;
	size_t row_bytes, nrows, ncols;
	const void *xq;
	float *y;
	const char *rbuf;
	size_t rbytes;
	uint64_t sink;              /* keeps the reads; threads add to it atomically */
};

static void gemv_fn(void *arg, int ith, int nth)
{
	struct kjob *j = arg;
	size_t r0 = j->nrows * (size_t)ith / (size_t)nth, r1 = j->nrows * (size_t)(ith + 1) / (size_t)nth;
	j->k->gemv[j->kt](j->ncols, r1 - r0, j->w + r0 * j->row_bytes, j->row_bytes, j->xq, j->y + r0);
}

static void read_fn(void *arg, int ith, int nth)
{
	struct kjob *j = arg;
	size_t n = j->rbytes / 8, i0 = n * (size_t)ith / (size_t)nth, i1 = n * (size_t)(ith + 1) / (size_t)nth;
	const uint64_t *v = (const uint64_t *)j->rbuf;
	uint64_t acc = 0;
	for (size_t i = i0; i < i1; i++)
		acc += v[i];
	__atomic_fetch_add(&j->sink, acc, __ATOMIC_RELAXED);   /* every thread adds: no race */
}

/* The median of three passes over the set, GB/s. */
static double timed(struct nf_pool *pool, nf_pool_fn fn, struct kjob *j, size_t bytes, size_t n_mat,
		    size_t mat_bytes, const char *base)
{
	double v[3];
	for (int pass = 0; pass < 3; pass++) {
		double t0 = now_s();
		for (size_t m = 0; m < n_mat; m++) {
			j->w = base + m * mat_bytes;
			nf_pool_run(pool, fn, j);
		}
		double t = now_s() - t0;
		v[pass] = t > 0 ? (double)bytes / t / 1e9 : 0;
	}
	return nf_plan_median(v, 3);
}

static int kernel_rates(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			struct nf_diag *d)
{
	uint32_t types[8], nt = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_BLOB || nf_ktype_of(ob->dtype) < 0)
			continue;
		bool seen = false;
		for (uint32_t k = 0; k < nt; k++)
			seen |= types[k] == ob->dtype;
		if (!seen && nt < 8)
			types[nt++] = ob->dtype;
	}
	int max_threads = o->n_threads;
	struct nf_pool *pool = NULL;
	int rc = nf_pool_open(max_threads, -1, &pool);
	if (rc < 0)
		return nf_diag_fail(d, rc, "plan: thread pool: %s", nf_strerror(rc));
	max_threads = nf_pool_nthreads(pool);
	nf_pool_close(pool);
	const struct nf_kernels *k = nf_kernels_get();
	size_t ncols = 4096;
	char *set = aligned_alloc(1 << 21, KSET_BYTES);
	float *x = malloc(ncols * sizeof(float)), *y = malloc(KROWS * sizeof(float));
	void *xq = aligned_alloc(64, 2 * ncols * sizeof(float) + 64);
	p->rates = calloc((size_t)nt * (size_t)max_threads + 1, sizeof(*p->rates));
	if (!set || !x || !y || !xq || !p->rates) {
		rc = nf_diag_fail(d, -ENOMEM, "plan: no memory to measure the kernels");
		goto out;
	}
	/* small values of every type: bytes of the set, not NaNs, are read */
	memset(set, 0x11, KSET_BYTES);
	for (size_t i = 0; i < ncols; i++)
		x[i] = (float)((i * 37) % 19) / 19.0f - 0.5f;
	uint32_t step = 0, steps = (uint32_t)(nt + 1) * (uint32_t)max_threads;
	progress(o->progress, "measuring the kernels", 0, steps);
	for (int th = 1; th <= max_threads; th++) {
		if ((rc = nf_pool_open(th, -1, &pool)) < 0) {
			nf_diag_fail(d, rc, "plan: thread pool: %s", nf_strerror(rc));
			goto out;
		}
		/* the memory read: the median of MEMREAD_PASSES passes */
		struct kjob j = { .k = k, .rbuf = set, .rbytes = KSET_BYTES };
		nf_pool_run(pool, read_fn, &j);
		double v[MEMREAD_PASSES];
		for (int pass = 0; pass < MEMREAD_PASSES; pass++) {
			double t0 = now_s();
			nf_pool_run(pool, read_fn, &j);
			double t = now_s() - t0;
			v[pass] = t > 0 ? KSET_BYTES / t / 1e9 : 0;
		}
		double med = nf_plan_median(v, MEMREAD_PASSES);
		if (med > p->mem_read_gb_s)
			p->mem_read_gb_s = med;
		progress(o->progress, "measuring the kernels", ++step, steps);
		for (uint32_t t = 0; t < nt; t++) {
			/* the kernel this store's matrices run (kernels.h) */
			int kt = nf_ktype_matrix(types[t], KROWS, o->q4_0_vec_dot);
			size_t row = nf_dtype_row_size(types[t], ncols);
			size_t mat = row * KROWS, n_mat = KSET_BYTES / mat;
			k->act_prepare[kt](x, xq, ncols);
			struct kjob g = { .k = k, .kt = kt, .row_bytes = row, .nrows = KROWS, .ncols = ncols, .xq = xq, .y = y };
			g.w = set;
			nf_pool_run(pool, gemv_fn, &g); /* warm-up */
			double gbs = timed(pool, gemv_fn, &g, n_mat * mat, n_mat, mat, set);
			p->rates[p->n_rates++] = (struct nf_store_kernel_rate){ types[t], (uint32_t)th, gbs };
			progress(o->progress, "measuring the kernels", ++step, steps);
		}
		nf_pool_close(pool);
		pool = NULL;
	}
	rc = 0;
out:
	nf_pool_close(pool);
	free(set);
	free(x);
	free(y);
	free(xq);
	return rc;
}

int nf_plan_measure_reads(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			  struct nf_diag *d)
{
	struct nf_plan_device_opts def;
	if (!o) {
		nf_plan_device_opts_default(&def);
		o = &def;
	}
	free(p->points);
	p->points = NULL;
	p->n_points = 0;
	return read_curve(s, o, p, d);
}

int nf_plan_measure_kernels(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			    struct nf_diag *d)
{
	struct nf_plan_device_opts def;
	if (!o) {
		nf_plan_device_opts_default(&def);
		o = &def;
	}
	free(p->rates);
	p->rates = NULL;
	p->n_rates = 0;
	p->mem_read_gb_s = 0;
	return kernel_rates(s, o, p, d);
}

int nf_plan_measure_device(struct nf_store *s, const struct nf_plan_device_opts *o, struct nf_store_plan *p,
			   struct nf_diag *d)
{
	int rc = nf_plan_measure_reads(s, o, p, d);
	return rc < 0 ? rc : nf_plan_measure_kernels(s, o, p, d);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* the median of v[0..n) (sorts v); the mean of the middle two when n is even */
double nf_plan_median(double *v, size_t n)
{
	if (!n)
		return 0;
	qsort(v, n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int nf_plan_points_median(const struct nf_store_plan *const *passes, uint32_t n_passes, struct nf_store_plan *out)
{
	if (!n_passes || !passes[0]->n_points)
		return -EINVAL;
	uint32_t n = passes[0]->n_points;
	struct nf_store_dev_point *pts = calloc(n, sizeof(*pts));
	double *v = malloc(n_passes * sizeof(*v));
	if (!pts || !v) {
		free(pts);
		free(v);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_dev_point *q = &passes[0]->points[i];
		pts[i] = *q;
		for (int f = 0; f < 3; f++) {
			size_t k = 0;
			for (uint32_t j = 0; j < n_passes; j++)
				for (uint32_t m = 0; m < passes[j]->n_points; m++) {
					const struct nf_store_dev_point *r = &passes[j]->points[m];
					if (r->req_bytes == q->req_bytes && r->qd == q->qd) {
						v[k++] = f == 0 ? r->mb_s : f == 1 ? r->cpu_us : r->lat_us;
						break;
					}
				}
			double med = nf_plan_median(v, k);
			if (f == 0)
				pts[i].mb_s = med;
			else if (f == 1)
				pts[i].cpu_us = med;
			else
				pts[i].lat_us = med;
		}
	}
	free(v);
	free(out->points);
	out->points = pts;
	out->n_points = n;
	return 0;
}

/* ---- interpolation ----------------------------------------------------------------------- */

enum pt_field { PT_MBS, PT_CPU, PT_LAT };

static double field(const struct nf_store_dev_point *q, enum pt_field f)
{
	return f == PT_MBS ? q->mb_s : f == PT_CPU ? q->cpu_us : q->lat_us;
}

/* Inverse-distance weighting in (log2 size, log2 qd) over the measured
 * points; an exact match returns that point's figure. */
static double interp(const struct nf_store_plan *p, double req_bytes, uint32_t qd, enum pt_field f)
{
	if (!p || !p->n_points)
		return 0;
	double ls = log2(req_bytes > 512 ? req_bytes : 512), lq = log2(qd ? qd : 1);
	double wsum = 0, vsum = 0;
	for (uint32_t i = 0; i < p->n_points; i++) {
		const struct nf_store_dev_point *q = &p->points[i];
		double ds = ls - log2(q->req_bytes), dq = (lq - log2(q->qd)) * 0.5;
		double dist2 = ds * ds + dq * dq;
		if (dist2 < 1e-12)
			return field(q, f);
		double w = 1.0 / (dist2 * dist2);
		wsum += w;
		vsum += w * field(q, f);
	}
	return wsum > 0 ? vsum / wsum : 0;
}

double nf_plan_device_mb_s(const struct nf_store_plan *p, double req_bytes, uint32_t qd)
{
	return interp(p, req_bytes, qd, PT_MBS);
}

double nf_plan_device_cpu_us(const struct nf_store_plan *p, double req_bytes, uint32_t qd)
{
	return interp(p, req_bytes, qd, PT_CPU);
}

double nf_plan_device_lat_us(const struct nf_store_plan *p, double req_bytes, uint32_t qd)
{
	return interp(p, req_bytes, qd, PT_LAT);
}

double nf_plan_kernel_gb_s(const struct nf_store_plan *p, uint32_t dtype, uint32_t threads)
{
	double best_any = 0, best = 0;
	uint32_t best_th = 0;
	for (uint32_t i = 0; p && i < p->n_rates; i++) {
		const struct nf_store_kernel_rate *r = &p->rates[i];
		if (r->gb_s > best_any)
			best_any = r->gb_s;
		if (r->dtype != dtype)
			continue;
		uint32_t dist = r->threads > threads ? r->threads - threads : threads - r->threads;
		uint32_t bdist = best_th > threads ? best_th - threads : threads - best_th;
		if (!best_th || dist < bdist) {
			best = r->gb_s;
			best_th = r->threads;
		}
	}
	return best_th ? best : best_any;
}

double nf_plan_verify_s_per_byte(void)
{
	const size_t n = (size_t)128 << 20;
	uint8_t *buf = malloc(n);
	if (!buf)
		return 0;
	for (size_t i = 0; i < n; i += 64)
		buf[i] = (uint8_t)(i >> 6);
	double best = INFINITY;
	uint32_t crc = 0;
	for (int pass = 0; pass < 2; pass++) {
		double t0 = now_s();
		crc ^= nf_crc32c(crc, buf, n);
		double t = now_s() - t0;
		best = t < best ? t : best;
	}
	/* crc keeps the loop from being dropped */
	free(buf);
	return (best + (crc == 1 ? 1e-12 : 0)) / (double)n;
}
