/*
 * nflash/coact.h - a co-activation layout for an FFN's bundles.
 *
 * A miss costs a read request, and on this class of device a request costs
 * more than a few KiB of bytes (docs/PIPELINE.md, "Bridging gaps"). When
 * neurons that fire together sit in adjacent store slots, a token's misses
 * form fewer, longer runs: fewer requests for the same neurons.
 *
 * nf_coact_order plans one FFN from a calibration record: per neuron its
 * firing count and a bitmap of the calibration tokens it fired on (the
 * cache records them: nf_cache_opts.sig_tokens, nf_cache_signatures).
 *
 *	uint32_t *order = malloc(n * sizeof(*order));
 *	nf_coact_order(counts, sig, words, n, head, order);   // order[slot] = neuron
 *
 * The result is stored in the store's profile (nf_store_profile.order) by
 * `nflash generate --profile`, and `nflash store relayout` applies it.
 *
 * Thread-safety: pure function of its arguments.
 */
#ifndef NFLASH_COACT_H
#define NFLASH_COACT_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * nf_coact_order - order[0..n): neuron ids by store slot, a permutation.
 *  1. The first min(head, n) slots: the most frequent neurons (descending
 *     count, ties by id), the part a cache keeps hot, read at open in
 *     large runs.
 *  2. Then every other neuron that fired in the record (a nonzero row of
 *     sig), chained greedily: starting from the most frequent, each next
 *     slot takes the unplaced neuron whose firing bitmap is most similar
 *     (Jaccard: common tokens / tokens of either) to the one just placed;
 *     ties (and the case of no common token) go to the higher count, then
 *     the lower id.
 *  3. Then the neurons that never fired in the record, by count and id.
 * sig: n rows of words uint64_t (bit t: fired at calibration token t), or
 * NULL (then the order is by count alone). counts: n values.
 * Returns 0 or -ENOMEM. O(m^2 * words) for m neurons in part 2.
 */
int nf_coact_order(const uint32_t *counts, const uint64_t *sig, uint32_t words, uint32_t n, uint32_t head,
		   uint32_t *order);

/*
 * nf_coact_order_cuts - one layout for several hot-set sizes. The neurons
 * in count order; the slots before cuts[0] stay so (the smallest hot set),
 * and each part from cuts[k] to cuts[k + 1] (the last to n) is chained on
 * its own, as nf_coact_order chains what follows its head: by vec when
 * given (nf_coact_order_vec), else by sig (NULL and no vec: count order).
 * A cache whose hot set ends at a cut then misses only chained neurons:
 * with a single head, the neurons a larger budget keeps hot sit in count
 * order, and a smaller budget's misses among them take a read each. cuts:
 * n_cuts ascending values (> n: n). nf_coact_order and
 * nf_coact_order_vec are the one-cut cases. Returns 0 or -ENOMEM.
 */
int nf_coact_order_cuts(const uint32_t *counts, const uint64_t *sig, uint32_t words, const float *vec, uint32_t dim,
			uint32_t n, const uint32_t *cuts, uint32_t n_cuts, uint32_t *order);
/* Mean over tokens of the number of runs (maximal groups of adjacent
 * slots, a gap of up to max_gap slots joining two) that the fired neurons
 * outside the first head slots of order form: the read requests a token's
 * misses cost under that layout when the head is cached. Tokens t in
 * [0, tokens) of the record. For reports and tests. */
double nf_coact_runs(const uint64_t *sig, uint32_t words, uint32_t tokens, uint32_t n, const uint32_t *order,
		     uint32_t head, uint32_t max_gap);

/* As nf_coact_runs, with the bundles those reads fetch per token: the
 * misses and the slots a gap of up to max_gap bridges between two of them
 * (bundles_out may be NULL). */
void nf_coact_cost(const uint64_t *sig, uint32_t words, uint32_t tokens, uint32_t n, const uint32_t *order,
		   uint32_t head, uint32_t max_gap, double *runs_out, double *bundles_out);

/*
 * nf_coact_holdout - how a co-activation layout serves tokens it was not
 * planned from. The record's even tokens alone plan a layout, as
 * nf_coact_order plans one from all (head slots first, by the even tokens'
 * counts); the odd tokens are then costed (nf_coact_cost, head cached)
 * against that layout and against order, the layout planned from the whole
 * record. With vec (nf_coact_embed's rows, dim values each; else NULL), the
 * even tokens' counts also plan nf_coact_order_vec's layout, and the one
 * of the two whose odd tokens take fewer runs at choose_gap is the held-out
 * layout (*by_scores: it was vec's; choose_runs[0], [1]: the two's odd
 * tokens' runs at choose_gap; either may be NULL). For each of the
 * n_gaps gaps[k]: in_runs[k], in_bundles[k] (under order) and out_runs[k],
 * out_bundles[k] (under the held-out layout), means over the record's
 * tokens. The calibration's own layout clusters each token's rare neurons,
 * which a new token's misses do not share: the two differ by the layout's
 * fit to its own record. Returns 0, -EINVAL (fewer than 4 tokens), or
 * -ENOMEM.
 */
int nf_coact_holdout(const uint64_t *sig, uint32_t words, uint32_t tokens, uint32_t n, const uint32_t *order,
		     uint32_t head, const float *vec, uint32_t dim, uint32_t choose_gap, const uint32_t *gaps,
		     uint32_t n_gaps, double *in_runs, double *in_bundles, double *out_runs, double *out_bundles,
		     bool *by_scores, double *choose_runs);
/*
 * nf_coact_embed - each neuron's place as a predictor sees it. A predictor
 * scores neuron j as fc2_j . z, z = ReLU(fc1 . h) (PowerInfer's), so over a
 * record of z (n tokens: sum[r] and sq[r * r] = sum of z z^T, row-major;
 * nf_sparse_pred_record) the covariance of two neurons' scores is
 * fc2_i^T C fc2_j, C the covariance of z. With C + ridge = L L^T,
 * vec[j] = L^T fc2_j / |L^T fc2_j| (r floats per neuron, zeros for a score
 * that never moves), so vec_i . vec_j is the correlation of scores i and
 * j: neurons whose scores rise together fire together, on tokens the
 * record never saw too, where a firing bitmap of a few hundred tokens
 * knows only the coincidences it saw. fc2: n_ff rows of r floats.
 * Returns 0, -EINVAL (fewer than 2 tokens, or no ridge makes C positive
 * definite), -ENOMEM.
 */
int nf_coact_embed(const float *fc2, uint32_t n_ff, uint32_t r, uint64_t n, const double *sum, const double *sq,
		   float *vec);
/*
 * nf_coact_order_vec - as nf_coact_order, part 2 chained by vec (unit
 * rows of dim values; nf_coact_embed) instead of firing bitmaps: each next
 * slot takes the unplaced fired neuron (counts > 0) with the largest
 * vec_i . vec_cur (computed exactly in int16 at 2^-14, so the same on every
 * ISA); ties to the higher count, then the lower id. Parts 1 and 3 as
 * nf_coact_order's. Returns 0 or -ENOMEM. O(m^2 * dim).
 */
int nf_coact_order_vec(const uint32_t *counts, const float *vec, uint32_t dim, uint32_t n, uint32_t head,
		       uint32_t *order);
/* Progress of a long step: fn(arg, done, total) as work advances, then
 * once with done == total. */
struct nf_coact_progress {
	void (*fn)(void *arg, const char *label, uint64_t done, uint64_t total);
	void *arg;
};

struct nf_engine;
struct nf_diag;

/*
 * nf_coact_profile_save - a calibration run's result into its store: the
 * firing counts engine e's cache gathered since open (tokens: how many
 * tokens were evaluated) and each FFN's co-activation layout planned from
 * the cache's record (the head: the share of neurons a run under the same
 * budget keeps hot), as a new generation of the store the FFN came from.
 * Writes what it did to the engine's log. pr may be NULL. Returns 0,
 * NF_EUSAGE (e was not opened with opts.profile or has no store), or the
 * store update's errors (d says which). Without memory to plan the layout,
 * stores the counts alone and says so.
 */
/* nf_coact_embed's rows for FFN (layer, expert) of engine e, a calibration
 * run (nf_engine_opts.profile) in predictor mode: malloc'd, n_ff rows of
 * *dim floats; NULL when it recorded no predictor (or no memory). */
float *nf_coact_ffn_vec(struct nf_engine *e, uint32_t layer, uint32_t expert, uint32_t *dim);
/* The read gap a calibration run's layout is judged at: e's own, else 4
 * (the engine's default). */
uint32_t nf_coact_gap(const struct nf_engine *e);
int nf_coact_profile_save(struct nf_engine *e, uint64_t tokens, const struct nf_coact_progress *pr,
			  struct nf_diag *d);
/*
 * nf_coact_profile_recut - nf_coact_profile_save with the layout cut at
 * each of hot_slots[0..n) (bundle slots in all, split among the FFNs as the
 * cache splits a hot set, nf_cache_hot_quota), the largest as the head: the
 * hot sets that the settings a plan chose will load, which differ from an
 * unplanned run's (the cuts nf_engine_opts.profile_cuts gives). A hot set
 * past its cut is loaded in many small reads and splits the chained runs
 * its budget misses in. Same returns; NF_EUSAGE also when n is 0.
 */
int nf_coact_profile_recut(struct nf_engine *e, uint64_t tokens, const uint64_t *hot_slots, uint32_t n,
			   const struct nf_coact_progress *pr, struct nf_diag *d);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_COACT_H */
