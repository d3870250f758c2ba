/*
 * test_planner_coact.c - the co-activation layout (nflash/coact.h): a
 * permutation with the most frequent neurons first; neurons that fire
 * together end up side by side, so a token's misses cost fewer reads than
 * under the count order; neurons that never fired go last; the same record
 * gives the same layout.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/coact.h"
#include "nflash/store.h"

#define N 256
#define T 200
#define W ((T + 63) / 64)

static uint64_t sig[N * W];
static uint32_t counts[N];

static void fire(uint32_t j, uint32_t t)
{
	sig[(size_t)j * W + t / 64] |= 1ull << (t % 64);
	counts[j]++;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng % n);
}

/*
 * Neurons 0..15 fire on most tokens (the hot set). The other 240 form 12
 * clusters of 20, interleaved by id (neuron j in cluster j % 12), so the
 * id order scatters every cluster; token t fires two clusters, each
 * member with probability 0.8. Neurons 250..255 never fire.
 */
static void make_record(void)
{
	memset(sig, 0, sizeof(sig));
	memset(counts, 0, sizeof(counts));
	for (uint32_t t = 0; t < T; t++) {
		for (uint32_t j = 0; j < 16; j++)
			if (rnd(10) < 9)
				fire(j, t);
		uint32_t a = rnd(12), b = rnd(12);
		for (uint32_t j = 16; j < 250; j++) {
			uint32_t c = (j - 16) % 12;
			if ((c == a || c == b) && rnd(10) < 8)
				fire(j, t);
		}
	}
}

Test(planner, coact_order_groups_co_firing_neurons)
{
	make_record();
	uint32_t by_count[N], co[N], again[N];
	cr_assert_eq(nf_coact_order(counts, NULL, 0, N, 16, by_count), 0);
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 16, co), 0);
	cr_assert(nf_store_profile_order_valid(by_count, N));
	cr_assert(nf_store_profile_order_valid(co, N));

	/* the head is the count order's head, in the same order */
	cr_assert(!memcmp(by_count, co, 16 * sizeof(uint32_t)));
	for (uint32_t r = 0; r < 16; r++)
		cr_assert_lt(co[r], 16u, "slot %u holds neuron %u", r, co[r]);
	/* by count: descending, ties by id */
	for (uint32_t r = 1; r < N; r++) {
		uint32_t x = by_count[r - 1], y = by_count[r];
		cr_assert(counts[x] > counts[y] || (counts[x] == counts[y] && x < y), "slot %u", r);
	}
	/* never fired: last, by id (their counts are all 0) */
	for (uint32_t r = 0; r < 6; r++)
		cr_assert_eq(co[N - 6 + r], 250 + r);

	/* each cluster occupies consecutive slots: at most a few boundaries
	 * where the cluster changes (exactly 11 if every cluster is one run) */
	uint32_t changes = 0;
	for (uint32_t r = 17; r < N - 6; r++)
		changes += (co[r] - 16) % 12 != (co[r - 1] - 16) % 12;
	cr_assert_leq(changes, 14, "clusters split %u times", changes);

	/* so a token's misses (outside the head) form far fewer runs */
	double runs_count = nf_coact_runs(sig, W, T, N, by_count, 16, 0);
	double runs_co = nf_coact_runs(sig, W, T, N, co, 16, 0);
	cr_assert_gt(runs_count, 20.0, "by count: %.1f runs", runs_count);
	cr_assert_lt(runs_co, 6.0, "co-activation: %.1f runs (by count %.1f)", runs_co, runs_count);
	/* bridging gaps of 4 helps the count order, but not to the same point */
	cr_assert_lt(nf_coact_runs(sig, W, T, N, co, 16, 4), nf_coact_runs(sig, W, T, N, by_count, 16, 4));

	/* the same record, the same layout */
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 16, again), 0);
	cr_assert(!memcmp(co, again, sizeof(co)));
}

Test(planner, coact_order_edges)
{
	make_record();
	uint32_t o[N];
	/* a head of everything (or more) is the count order */
	uint32_t ref[N];
	cr_assert_eq(nf_coact_order(counts, NULL, 0, N, 0, ref), 0);
	cr_assert_eq(nf_coact_order(counts, sig, W, N, N + 5, o), 0);
	cr_assert(!memcmp(o, ref, sizeof(o)));
	/* head 0: the chain starts at the most frequent neuron */
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 0, o), 0);
	cr_assert(nf_store_profile_order_valid(o, N));
	cr_assert_eq(o[0], ref[0]);
	/* an empty record: count order */
	static uint64_t none[N * W];
	cr_assert_eq(nf_coact_order(counts, none, W, N, 3, o), 0);
	cr_assert(!memcmp(o, ref, sizeof(o)));
	/* one neuron, zero neurons */
	uint32_t one = 7, c1 = 1;
	uint64_t s1 = 1;
	cr_assert_eq(nf_coact_order(&c1, &s1, 1, 1, 0, &one), 0);
	cr_assert_eq(one, 0u);
	cr_assert_eq(nf_coact_order(NULL, NULL, 0, 0, 0, NULL), 0);
	cr_assert_eq(nf_coact_runs(sig, W, 0, N, ref, 0, 0), 0.0);
	/* the validity check itself */
	uint32_t bad[3] = { 0, 2, 2 }, big[2] = { 0, 2 };
	cr_assert(!nf_store_profile_order_valid(bad, 3));
	cr_assert(!nf_store_profile_order_valid(big, 2));
}

/*
 * The holdout: a layout planned from a record fits the record's own tokens
 * better than new ones when each token's rare neurons are its own (a
 * mixture's expert, routed a few tokens), and about as well when the
 * neurons fire in groups every token shares (make_record's clusters).
 */
Test(planner, coact_holdout_tells_a_layout_fit_to_its_own_record)
{
	static const uint32_t gaps[2] = { 0, 4 };
	double ir[2], ib[2], or_[2], ob[2];
	uint32_t co[N];

	/* clusters shared by every token: the even half plans as well */
	make_record();
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 16, co), 0);
	cr_assert_eq(nf_coact_holdout(sig, W, T, N, co, 16, NULL, 0, 0, gaps, 2, ir, ib, or_, ob, NULL, NULL), 0);
	cr_assert_gt(ib[0], 5.0, "%.1f misses a token", ib[0]);
	cr_expect_float_eq(ib[0], ob[0], 1e-9, "the same misses: %.2f against %.2f", ib[0], ob[0]);
	cr_expect_lt(or_[0] / ob[0], 1.5 * ir[0] / ib[0], "shared clusters: %.3f runs a miss held out, %.3f own",
		     or_[0] / ob[0], ir[0] / ib[0]);
	cr_expect_leq(or_[1], or_[0] + 1e-9);
	cr_expect_geq(ob[1], ob[0] - 1e-9);

	/* every token fires 4 neurons of its own choosing among 240 (each
	 * neuron fires on about 3 tokens): the record's layout chains each
	 * token's 4, the even tokens' layout cannot know the odd ones' */
	memset(sig, 0, sizeof(sig));
	memset(counts, 0, sizeof(counts));
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t k = 0; k < 4; k++)
			fire(16 + rnd(240), t);
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 16, co), 0);
	cr_assert_eq(nf_coact_holdout(sig, W, T, N, co, 16, NULL, 0, 0, gaps, 2, ir, ib, or_, ob, NULL, NULL), 0);
	double own = ir[0] / ib[0], held = or_[0] / ob[0];
	cr_expect_gt(held, 1.25 * own, "own tokens: %.3f runs a miss, held out: %.3f", own, held);
	cr_expect_gt(held, 0.9, "held out: %.3f runs a miss", held);

	/* too short a record to split */
	cr_expect_eq(nf_coact_holdout(sig, W, 3, N, co, 16, NULL, 0, 0, gaps, 2, ir, ib, or_, ob, NULL, NULL), -EINVAL);
}

/*
 * nf_coact_embed: vec_i . vec_j is the correlation of neurons i and j's
 * scores fc2_i . z over the recorded z, computed here directly from the
 * samples; a neuron whose fc2 row is zero gets a zero row; too short a
 * record is refused.
 */
#define ER 6
#define EF 10
#define ET 300
Test(planner, coact_embed_gives_the_correlation_of_scores)
{
	static double z[ET][ER];
	static float fc2[EF * ER], vec[EF * ER];
	double sum[ER] = { 0 }, sq[ER * ER] = { 0 };
	for (uint32_t t = 0; t < ET; t++) {
		double u[3] = { rnd(2001) / 1000.0 - 1, rnd(2001) / 1000.0 - 1, rnd(2001) / 1000.0 - 1 };
		for (uint32_t i = 0; i < ER; i++) {
			/* correlated units, some of them cut by ReLU */
			double v = u[i % 3] + 0.5 * u[(i + 1) % 3] - (i == 5 ? 0.3 : 0.0);
			z[t][i] = v > 0 ? v : 0;
		}
		for (uint32_t i = 0; i < ER; i++) {
			sum[i] += z[t][i];
			for (uint32_t k = 0; k < ER; k++)
				sq[i * ER + k] += z[t][i] * z[t][k];
		}
	}
	for (uint32_t j = 0; j < EF * ER; j++)
		fc2[j] = (float)(rnd(2001) / 1000.0 - 1);
	memset(fc2 + 3 * ER, 0, ER * sizeof(float)); /* neuron 3: a score that never moves */
	cr_assert_eq(nf_coact_embed(fc2, EF, ER, ET, sum, sq, vec), 0);
	for (uint32_t k = 0; k < ER; k++)
		cr_expect_eq(vec[3 * ER + k], 0.0f);
	double sc[EF][ET], mean[EF] = { 0 };
	for (uint32_t j = 0; j < EF; j++)
		for (uint32_t t = 0; t < ET; t++) {
			sc[j][t] = 0;
			for (uint32_t i = 0; i < ER; i++)
				sc[j][t] += (double)fc2[j * ER + i] * z[t][i];
			mean[j] += sc[j][t] / ET;
		}
	for (uint32_t a = 0; a < EF; a++)
		for (uint32_t b = 0; b < EF; b++) {
			if (a == 3 || b == 3)
				continue;
			double xy = 0, xx = 0, yy = 0, dot = 0;
			for (uint32_t t = 0; t < ET; t++) {
				xy += (sc[a][t] - mean[a]) * (sc[b][t] - mean[b]);
				xx += (sc[a][t] - mean[a]) * (sc[a][t] - mean[a]);
				yy += (sc[b][t] - mean[b]) * (sc[b][t] - mean[b]);
			}
			for (uint32_t k = 0; k < ER; k++)
				dot += (double)vec[a * ER + k] * vec[b * ER + k];
			double corr = xy / sqrt(xx * yy);
			cr_expect(fabs(dot - corr) < 1e-4, "neurons %u, %u: %.6f against the samples' %.6f", a, b, dot, corr);
		}
	cr_expect_eq(nf_coact_embed(fc2, EF, ER, 1, sum, sq, vec), -EINVAL);
}

/*
 * nf_coact_order_vec: 12 clusters of 20 neurons interleaved by id (as in
 * make_record), each member's vector its cluster's direction plus a little
 * noise. The layout keeps the head in count order, chains every cluster
 * into one run, puts the neurons that never fired last, is a permutation,
 * and is the same again.
 */
Test(planner, coact_order_vec_chains_neurons_whose_scores_move_together)
{
	enum { D = 8 };
	static float vec[N * D], cen[12][D];
	uint32_t cnt[N];
	for (uint32_t c = 0; c < 12; c++) {
		double nn = 0;
		for (uint32_t k = 0; k < D; k++) {
			cen[c][k] = (float)(rnd(2001) / 1000.0 - 1);
			nn += cen[c][k] * cen[c][k];
		}
		for (uint32_t k = 0; k < D; k++)
			cen[c][k] /= (float)sqrt(nn);
	}
	for (uint32_t j = 0; j < N; j++) {
		const float *c = j >= 16 ? cen[(j - 16) % 12] : cen[j % 12];
		double nn = 0;
		for (uint32_t k = 0; k < D; k++) {
			vec[j * D + k] = c[k] + (float)(rnd(2001) / 1000.0 - 1) * 0.02f;
			nn += (double)vec[j * D + k] * vec[j * D + k];
		}
		for (uint32_t k = 0; k < D; k++)
			vec[j * D + k] /= (float)sqrt(nn);
		cnt[j] = j < 16 ? 1000 - j : j < 250 ? 1 + rnd(10) : 0;
	}
	uint32_t o[N], again[N], ref[N];
	cr_assert_eq(nf_coact_order_vec(cnt, vec, D, N, 16, o), 0);
	cr_assert(nf_store_profile_order_valid(o, N));
	cr_assert_eq(nf_coact_order(cnt, NULL, 0, N, 16, ref), 0);
	for (uint32_t s = 0; s < 16; s++)
		cr_expect_eq(o[s], ref[s], "head slot %u", s);
	for (uint32_t s = 250; s < N; s++)
		cr_expect_geq(o[s], 250u, "slot %u: neuron %u", s, o[s]);
	uint32_t changes = 0;
	for (uint32_t s = 17; s < 250; s++)
		changes += (o[s] - 16) % 12 != (o[s - 1] - 16) % 12;
	cr_expect_eq(changes, 11, "%u cluster changes along the chain (11: every cluster in one run)", changes);
	cr_assert_eq(nf_coact_order_vec(cnt, vec, D, N, 16, again), 0);
	cr_expect_arr_eq(o, again, sizeof(o));
	cr_assert_eq(nf_coact_order_vec(NULL, NULL, D, 0, 0, NULL), 0);
}

/*
 * The holdout with the predictor's view: each token fires two clusters,
 * each member with probability 0.15, so a record of 200 tokens sees few of
 * a cluster's pairs fire together, while the vectors know the clusters.
 * The scores' layout serves the odd tokens with fewer runs, and the
 * holdout says so; without vectors it keeps the record's.
 */
Test(planner, coact_holdout_takes_the_scores_layout_where_it_serves_better)
{
	enum { D = 8 };
	static float vec[N * D];
	for (uint32_t c = 0; c < 12; c++)
		for (uint32_t j = 16 + c; j < 250; j += 12)
			for (uint32_t k = 0; k < D; k++)
				vec[j * D + k] = k == c % D ? (c < D ? 1.0f : 0.6f) : (c >= D && k == (c + 1) % D ? 0.8f : 0.0f);
	for (uint32_t j = 0; j < 16; j++)
		vec[j * D] = 1.0f;
	memset(sig, 0, sizeof(sig));
	memset(counts, 0, sizeof(counts));
	for (uint32_t t = 0; t < T; t++) {
		for (uint32_t j = 0; j < 16; j++)
			fire(j, t);
		uint32_t a = rnd(12), b = rnd(12);
		for (uint32_t j = 16; j < 250; j++) {
			uint32_t c = (j - 16) % 12;
			if ((c == a || c == b) && rnd(100) < 15)
				fire(j, t);
		}
	}
	static const uint32_t gaps[1] = { 4 };
	double ir[1], ib[1], or_[1], ob[1], cr[2];
	uint32_t co[N];
	bool scores = false;
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 16, co), 0);
	cr_assert_eq(nf_coact_holdout(sig, W, T, N, co, 16, vec, D, 4, gaps, 1, ir, ib, or_, ob, &scores, cr), 0);
	cr_log_info("held out: %.2f runs a token by the record, %.2f by the scores", cr[0], cr[1]);
	cr_expect(scores, "held out: %.2f runs a token by the record, %.2f by the scores", cr[0], cr[1]);
	cr_expect_lt(cr[1], 0.8 * cr[0], "%.2f against %.2f", cr[1], cr[0]);
	cr_expect_float_eq(or_[0], cr[1], 1e-9);
	cr_assert_eq(nf_coact_holdout(sig, W, T, N, co, 16, NULL, 0, 4, gaps, 1, ir, ib, or_, ob, &scores, NULL), 0);
	cr_expect(!scores);
}

/*
 * nf_coact_order_cuts: each part between two cuts holds exactly the
 * neurons a count order puts there (so a hot set that ends at any cut is
 * the most frequent neurons, as the cache loads it), and is chained within
 * itself; one cut is nf_coact_order (or nf_coact_order_vec with vectors).
 */
Test(planner, coact_order_cuts_chain_each_part_on_its_own)
{
	make_record();
	static const uint32_t cuts[3] = { 16, 100, 180 };
	uint32_t o[N], ref[N], one[N], co[N];
	cr_assert_eq(nf_coact_order_cuts(counts, sig, W, NULL, 0, N, cuts, 3, o), 0);
	cr_assert(nf_store_profile_order_valid(o, N));
	cr_assert_eq(nf_coact_order(counts, NULL, 0, N, 0, ref), 0);
	for (uint32_t k = 0; k <= 3; k++) {
		uint32_t a = k ? cuts[k - 1] : 0, b = k < 3 ? cuts[k] : N;
		bool in[N] = { false };
		for (uint32_t s = a; s < b; s++)
			in[ref[s]] = true;
		for (uint32_t s = a; s < b; s++)
			cr_expect(in[o[s]], "slot %u (part %u-%u): neuron %u belongs to another part", s, a, b, o[s]);
	}
	for (uint32_t s = 0; s < 16; s++)
		cr_expect_eq(o[s], ref[s], "slot %u before the first cut: count order", s);
	/* chained: the middle part is not left in count order */
	cr_expect(memcmp(o + 16, ref + 16, 84 * sizeof(uint32_t)) != 0);
	cr_assert_eq(nf_coact_order_cuts(counts, sig, W, NULL, 0, N, cuts, 1, one), 0);
	cr_assert_eq(nf_coact_order(counts, sig, W, N, 16, co), 0);
	cr_expect_arr_eq(one, co, sizeof(co));
	/* cuts past n count as n */
	static const uint32_t far[2] = { 16, 10 * N };
	cr_assert_eq(nf_coact_order_cuts(counts, sig, W, NULL, 0, N, far, 2, one), 0);
	cr_expect_arr_eq(one, co, sizeof(co));
}
