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

int nf_coact_order(const uint32_t *counts, const uint64_t *sig, uint32_t words, uint32_t n, uint32_t head,
		   uint32_t *order)
{
	uint32_t *tmp = malloc((size_t)(n ? n : 1) * sizeof(*tmp));
	uint32_t *pc = malloc((size_t)(n ? n : 1) * sizeof(*pc));
	if (!tmp || !pc) {
		free(tmp);
		free(pc);
		return -ENOMEM;
	}
	for (uint32_t j = 0; j < n; j++)
		order[j] = j;
	sort_by_count(counts, order, tmp, n);
	if (head > n)
		head = n;
	if (!sig || !words || head == n)
		goto done;

	uint32_t (*and_count)(const uint64_t *, const uint64_t *, uint32_t) =
		have_popcnt() ? and_count_popcnt : and_count_generic;
	/* after the head: fired neurons (chained) in cand, the rest in tail,
	 * both still in count order */
	uint32_t *cand = tmp, m = 0, t = 0;
	uint32_t *tail = order + head;     /* compacted in place: t <= index */
	for (uint32_t r = head; r < n; r++) {
		uint32_t j = order[r];
		pc[j] = row_count(sig + (size_t)j * words, words);
		if (pc[j])
			cand[m++] = j;
		else
			tail[t++] = j;
	}
	/* tail's neurons go last; move them to the end, keeping their order */
	memmove(order + n - t, tail, (size_t)t * sizeof(*order));
	uint32_t *out = order + head;
	if (!m)
		goto done;
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
done:
	free(tmp);
	free(pc);
	return 0;
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
		     uint32_t head, const uint32_t *gaps, uint32_t n_gaps, double *in_runs, double *in_bundles,
		     double *out_runs, double *out_bundles)
{
	if (tokens > words * 64u)
		tokens = words * 64u;
	if (tokens < 4 || !n)
		return -EINVAL;
	size_t cells = (size_t)n * words;
	uint64_t *even = malloc(cells * sizeof(uint64_t)), *odd = malloc(cells * sizeof(uint64_t));
	uint32_t *cnt = calloc(n, sizeof(uint32_t)), *lay = malloc((size_t)n * sizeof(uint32_t));
	int rc = -ENOMEM;
	if (!even || !odd || !cnt || !lay)
		goto out;
	/* bit t of a word is token 64 w + t: even tokens are the even bits */
	for (size_t k = 0; k < cells; k++) {
		even[k] = sig[k] & 0x5555555555555555ull;
		odd[k] = sig[k] & 0xaaaaaaaaaaaaaaaaull;
		cnt[k / words] += (uint32_t)__builtin_popcountll(even[k]);
	}
	if ((rc = nf_coact_order(cnt, even, words, n, head, lay)) < 0)
		goto out;
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
	return rc;
}
