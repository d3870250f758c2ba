/*
 * coact.c - co-activation layout of an FFN's bundles (nflash/coact.h).
 *
 * Invariants:
 *  1. The result is a permutation of 0..n-1, and a pure function of the
 *     arguments: every tie is broken by count, then id, never by memory
 *     order, so the same record always gives the same layout.
 *  2. The head (the most frequent neurons) is exactly the set a count-
 *     ordered layout puts first, so a cache's hot preload still reads it
 *     in long runs.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/coact.h"

/* (count desc, id asc) */
static bool before(const uint32_t *counts, uint32_t a, uint32_t b)
{
	if (counts[a] != counts[b])
		return counts[a] > counts[b];
	return a < b;
}

/* Merge sort by (count desc, id asc): stable, thread-safe (no globals). */
static void sort_by_count(const uint32_t *counts, uint32_t *v, uint32_t *tmp, uint32_t n)
{
	for (uint32_t w = 1; w < n; w *= 2) {
		for (uint32_t lo = 0; lo < n; lo += 2 * w) {
			uint32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
			uint32_t i = lo, j = mid, k = lo;
			while (i < mid && j < hi)
				tmp[k++] = before(counts, v[j], v[i]) ? v[j++] : v[i++];
			while (i < mid)
				tmp[k++] = v[i++];
			while (j < hi)
				tmp[k++] = v[j++];
		}
		memcpy(v, tmp, (size_t)n * sizeof(*v));
	}
}

/* order[0..n): neuron ids by (count desc, id asc); returns min(head, n) */
static uint32_t count_order(const uint32_t *counts, uint32_t n, uint32_t head, uint32_t *order, uint32_t *tmp)
{
	for (uint32_t j = 0; j < n; j++)
		order[j] = j;
	sort_by_count(counts, order, tmp, n);
	return head < n ? head : n;
}

#if defined(__x86_64__)
#define POPCNT_TARGET __attribute__((target("popcnt")))
#define have_popcnt() __builtin_cpu_supports("popcnt")
#else
#define POPCNT_TARGET
#define have_popcnt() 1 /* aarch64: cnt is base NEON */
#endif

POPCNT_TARGET static uint32_t and_count_popcnt(const uint64_t *a, const uint64_t *b,
								  uint32_t words)
{
	uint32_t s = 0;
	for (uint32_t w = 0; w < words; w++)
		s += (uint32_t)__builtin_popcountll(a[w] & b[w]);
	return s;
}

static uint32_t and_count_generic(const uint64_t *a, const uint64_t *b, uint32_t words)
{
	uint32_t s = 0;
	for (uint32_t w = 0; w < words; w++)
		s += (uint32_t)__builtin_popcountll(a[w] & b[w]);
	return s;
}

static uint32_t row_count(const uint64_t *a, uint32_t words)
{
	return and_count_generic(a, a, words);
}

/* Chain order[a..b) in place by firing bitmaps: the neurons that fired in
 * the record (a nonzero row of sig), each next the unplaced one most
 * similar (Jaccard) to the one just placed, then the rest in their order.
 * tmp, pc: n entries each. */
static void chain_bits(const uint32_t *counts, const uint64_t *sig, uint32_t words, uint32_t *order, uint32_t a,
		       uint32_t b, uint32_t *tmp, uint32_t *pc)
{
	uint32_t (*and_count)(const uint64_t *, const uint64_t *, uint32_t) =
		have_popcnt() ? and_count_popcnt : and_count_generic;
	/* fired neurons (chained) in cand, the rest in tail, both still in
	 * count order */
	uint32_t *cand = tmp, m = 0, t = 0;
	uint32_t *tail = order + a;        /* compacted in place: t <= index */
	for (uint32_t r = a; r < b; r++) {
		uint32_t j = order[r];
		pc[j] = row_count(sig + (size_t)j * words, words);
		if (pc[j])
			cand[m++] = j;
		else
			tail[t++] = j;
	}
	/* tail's neurons go last; move them to the end, keeping their order */
	memmove(order + b - t, tail, (size_t)t * sizeof(*order));
	uint32_t *out = order + a;
	if (!m)
		return;
	/* the chain: cand[0..left) unplaced, unordered after the first pick */
	uint32_t cur = cand[0], left = m;
	cand[0] = cand[--left];
	*out++ = cur;
	while (left) {
		const uint64_t *cs = sig + (size_t)cur * words;
		uint32_t bi = 0, b_in = 0, b_un = 1;
		for (uint32_t i = 0; i < left; i++) {
			uint32_t c = cand[i];
			uint32_t in = and_count(cs, sig + (size_t)c * words, words);
			uint32_t un = pc[cur] + pc[c] - in;
			/* in / un > b_in / b_un, exactly */
			uint64_t l = (uint64_t)in * b_un, r = (uint64_t)b_in * un;
			if (i == 0 || l > r || (l == r && before(counts, c, cand[bi]))) {
				bi = i;
				b_in = in;
				b_un = un;
			}
		}
		cur = cand[bi];
		cand[bi] = cand[--left];
		*out++ = cur;
	}
}

double nf_coact_runs(const uint64_t *sig, uint32_t words, uint32_t tokens, uint32_t n, const uint32_t *order,
		     uint32_t head, uint32_t max_gap)
{
	double runs = 0;
	nf_coact_cost(sig, words, tokens, n, order, head, max_gap, &runs, NULL);
	return runs;
}

void nf_coact_cost(const uint64_t *sig, uint32_t words, uint32_t tokens, uint32_t n, const uint32_t *order,
		   uint32_t head, uint32_t max_gap, double *runs_out, double *bundles_out)
{
	*runs_out = 0;
	if (bundles_out)
		*bundles_out = 0;
	if (!tokens || !n)
		return;
	if (tokens > words * 64u)
		tokens = words * 64u;
	uint64_t runs = 0, bundles = 0;
	for (uint32_t t = 0; t < tokens; t++) {
		uint32_t last = 0;
		bool open = false;
		for (uint32_t s = head; s < n; s++) {
			uint32_t j = order[s];
			if (!(sig[(size_t)j * words + t / 64] >> (t % 64) & 1))
				continue;
			if (!open || s - last > max_gap + 1) {
				runs++;
				bundles++;
			} else {
				bundles += s - last; /* the bundles bridged, and this one */
			}
			open = true;
			last = s;
		}
	}
	*runs_out = (double)runs / tokens;
	if (bundles_out)
		*bundles_out = (double)bundles / tokens;
}

int nf_coact_holdout(const uint64_t *sig, uint32_t words, uint32_t tokens, uint32_t n, const uint32_t *order,
		     uint32_t head, const float *vec, uint32_t dim, uint32_t choose_gap, const uint32_t *gaps,
		     uint32_t n_gaps, double *in_runs, double *in_bundles, double *out_runs, double *out_bundles,
		     bool *by_scores, double *choose_runs)
{
	if (by_scores)
		*by_scores = false;
	if (tokens > words * 64u)
		tokens = words * 64u;
	if (tokens < 4 || !n)
		return -EINVAL;
	size_t cells = (size_t)n * words;
	uint64_t *even = malloc(cells * sizeof(uint64_t)), *odd = malloc(cells * sizeof(uint64_t));
	uint32_t *cnt = calloc(n, sizeof(uint32_t)), *lay = malloc((size_t)n * sizeof(uint32_t));
	uint32_t *lay_v = vec ? malloc((size_t)n * sizeof(uint32_t)) : NULL;
	int rc = -ENOMEM;
	if (!even || !odd || !cnt || !lay || (vec && !lay_v))
		goto out;
	/* bit t of a word is token 64 w + t: even tokens are the even bits */
	for (size_t k = 0; k < cells; k++) {
		even[k] = sig[k] & 0x5555555555555555ull;
		odd[k] = sig[k] & 0xaaaaaaaaaaaaaaaaull;
		cnt[k / words] += (uint32_t)__builtin_popcountll(even[k]);
	}
	if ((rc = nf_coact_order(cnt, even, words, n, head, lay)) < 0)
		goto out;
	if (vec) {
		/* the scores' layout from the even tokens' counts: the one of
		 * the two whose odd tokens take fewer reads at choose_gap */
		if ((rc = nf_coact_order_vec(cnt, vec, dim, n, head, lay_v)) < 0)
			goto out;
		double rb, rv;
		nf_coact_cost(odd, words, tokens, n, lay, head, choose_gap, &rb, NULL);
		nf_coact_cost(odd, words, tokens, n, lay_v, head, choose_gap, &rv, NULL);
		if (choose_runs) {
			choose_runs[0] = rb;
			choose_runs[1] = rv;
		}
		if (rv < rb) {
			uint32_t *t = lay;
			lay = lay_v;
			lay_v = t;
			if (by_scores)
				*by_scores = true;
		}
	}
	for (uint32_t k = 0; k < n_gaps; k++) {
		nf_coact_cost(odd, words, tokens, n, order, head, gaps[k], &in_runs[k], &in_bundles[k]);
		nf_coact_cost(odd, words, tokens, n, lay, head, gaps[k], &out_runs[k], &out_bundles[k]);
	}
	rc = 0;
out:
	free(even);
	free(odd);
	free(cnt);
	free(lay);
	free(lay_v);
	return rc;
}

/* ---- the predictor's view ------------------------------------------------------------------ */

int nf_coact_embed(const float *fc2, uint32_t n_ff, uint32_t r, uint64_t n, const double *sum, const double *sq,
		   float *vec)
{
	if (n < 2 || !r)
		return -EINVAL;
	double *c = malloc((size_t)r * r * sizeof(double)), *l = calloc((size_t)r * r, sizeof(double));
	double *y = malloc((size_t)r * sizeof(double));
	int rc = -ENOMEM;
	if (!c || !l || !y)
		goto out;
	/* the covariance of z, and a ridge of 1e-6 of its mean variance (a
	 * hidden unit that never moved has none) */
	double tr = 0;
	for (uint32_t i = 0; i < r; i++)
		for (uint32_t k = 0; k < r; k++) {
			double v = sq[(size_t)i * r + k] / (double)n - (sum[i] / (double)n) * (sum[k] / (double)n);
			c[(size_t)i * r + k] = v;
			tr += i == k ? v : 0;
		}
	double ridge = tr > 0 ? 1e-6 * tr / r : 1e-12;
	for (int attempt = 0;; attempt++) {
		/* Cholesky: c + ridge I = l l^T, l lower */
		bool ok = true;
		for (uint32_t i = 0; i < r && ok; i++)
			for (uint32_t k = 0; k <= i; k++) {
				double v = c[(size_t)i * r + k] + (i == k ? ridge : 0);
				for (uint32_t q = 0; q < k; q++)
					v -= l[(size_t)i * r + q] * l[(size_t)k * r + q];
				if (i == k) {
					if (!(v > 0)) {
						ok = false;
						break;
					}
					l[(size_t)i * r + i] = sqrt(v);
				} else {
					l[(size_t)i * r + k] = v / l[(size_t)k * r + k];
				}
			}
		if (ok)
			break;
		if (attempt == 8) {
			rc = -EINVAL;
			goto out;
		}
		ridge = ridge * 100 + 1e-12;
	}
	/* y = l^T f: f^T C g = (l^T f) . (l^T g) */
	for (uint32_t j = 0; j < n_ff; j++) {
		const float *f = fc2 + (size_t)j * r;
		double nn = 0;
		for (uint32_t k = 0; k < r; k++) {
			double v = 0;
			for (uint32_t i = k; i < r; i++)
				v += l[(size_t)i * r + k] * f[i];
			y[k] = v;
			nn += v * v;
		}
		double inv = nn > 0 ? 1.0 / sqrt(nn) : 0;
		for (uint32_t k = 0; k < r; k++)
			vec[(size_t)j * r + k] = (float)(y[k] * inv);
	}
	rc = 0;
out:
	free(c);
	free(l);
	free(y);
	return rc;
}

/* Unit vectors as int16 at 2^14 (|a . b| <= 2^28 in int32, exact, so the
 * layout is the same on every ISA), VEC_BLOCK values per block. */
#define VEC_BLOCK 16u
#define VEC_ONE 16384.0f

static int32_t dot_q(const int16_t *a, const int16_t *b, uint32_t blocks)
{
	int32_t s = 0;
	for (uint32_t k = 0; k < blocks; k++, a += VEC_BLOCK, b += VEC_BLOCK)
		for (uint32_t i = 0; i < VEC_BLOCK; i++)
			s += (int32_t)a[i] * b[i];
	return s;
}

/* Chain order[a..b) in place by vec: the neurons with counts > 0, each
 * next the unplaced one with the largest vec . vec_cur, then the rest in
 * their order. tmp: n entries; q: (b - a + 1) * dp int16. */
static void chain_vec(const uint32_t *counts, const float *vec, uint32_t dim, uint32_t *order, uint32_t a, uint32_t b,
		      uint32_t *tmp, int16_t *q)
{
	uint32_t blocks = (dim + VEC_BLOCK - 1) / VEC_BLOCK, dp = blocks * VEC_BLOCK;
	uint32_t m = 0, t = 0, *tail = order + a;
	for (uint32_t r = a; r < b; r++) {
		uint32_t j = order[r];
		if (counts[j])
			tmp[m++] = j;
		else
			tail[t++] = j;
	}
	memmove(order + b - t, tail, (size_t)t * sizeof(*order));
	for (uint32_t i = 0; i < m; i++) {
		int16_t *row = q + (size_t)i * dp;
		const float *v = vec + (size_t)tmp[i] * dim;
		for (uint32_t k = 0; k < dp; k++) {
			float x = k < dim ? v[k] : 0.0f;
			x = x > 1.0f ? 1.0f : x < -1.0f ? -1.0f : x;
			row[k] = (int16_t)lrintf(x * VEC_ONE);
		}
	}
	uint32_t *out = order + a, left = m;
	int16_t *cur = q + (size_t)m * dp; /* the row just placed */
	if (!left)
		return;
	/* from the most frequent, each next the unplaced neuron whose scores
	 * move most with the one just placed */
	uint32_t bi = 0;
	for (;;) {
		*out++ = tmp[bi];
		memcpy(cur, q + (size_t)bi * dp, dp * sizeof(*q));
		tmp[bi] = tmp[--left];
		memcpy(q + (size_t)bi * dp, q + (size_t)left * dp, dp * sizeof(*q));
		if (!left)
			break;
		int32_t best = 0;
		bi = 0;
		for (uint32_t i = 0; i < left; i++) {
			int32_t d = dot_q(cur, q + (size_t)i * dp, blocks);
			if (i == 0 || d > best || (d == best && before(counts, tmp[i], tmp[bi]))) {
				best = d;
				bi = i;
			}
		}
	}
}

int nf_coact_order_cuts(const uint32_t *counts, const uint64_t *sig, uint32_t words, const float *vec, uint32_t dim,
			uint32_t n, const uint32_t *cuts, uint32_t n_cuts, uint32_t *order)
{
	uint32_t dp = (dim + VEC_BLOCK - 1) / VEC_BLOCK * VEC_BLOCK;
	uint32_t *tmp = malloc((size_t)(n ? n : 1) * sizeof(*tmp));
	uint32_t *pc = malloc((size_t)(n ? n : 1) * sizeof(*pc));
	int16_t *q = vec ? malloc(((size_t)n + 1) * (dp ? dp : 1) * sizeof(*q)) : NULL;
	if (!tmp || !pc || (vec && !q)) {
		free(tmp);
		free(pc);
		free(q);
		return -ENOMEM;
	}
	count_order(counts, n, n, order, tmp);
	/* each part, from one cut to the next (the last to n), chained on
	 * its own; the slots before the first cut stay in count order */
	for (uint32_t k = 0; k < n_cuts && (vec || (sig && words)); k++) {
		uint32_t start = cuts[k] < n ? cuts[k] : n;
		uint32_t end = k + 1 < n_cuts && cuts[k + 1] < n ? cuts[k + 1] : n;
		if (end <= start)
			continue;
		if (vec)
			chain_vec(counts, vec, dim, order, start, end, tmp, q);
		else
			chain_bits(counts, sig, words, order, start, end, tmp, pc);
	}
	free(tmp);
	free(pc);
	free(q);
	return 0;
}

int nf_coact_order(const uint32_t *counts, const uint64_t *sig, uint32_t words, uint32_t n, uint32_t head,
		   uint32_t *order)
{
	return nf_coact_order_cuts(counts, sig, words, NULL, 0, n, &head, 1, order);
}

int nf_coact_order_vec(const uint32_t *counts, const float *vec, uint32_t dim, uint32_t n, uint32_t head,
		       uint32_t *order)
{
	return nf_coact_order_cuts(counts, NULL, 0, vec, dim, n, &head, 1, order);
}
