/*
 * test_compute_sampler.c - each stage of the sampler on small, hand-made
 * distributions: greedy ties, temperature, top-k, top-p, min-p, the
 * repetition penalty and its window, frequency and presence penalties,
 * stop strings, and seeding.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "nflash/error.h"
#include "nflash/sampler.h"

static struct nf_sampler *mk(struct nf_sampler_params p, uint32_t nv)
{
	struct nf_sampler *s = NULL;
	cr_assert_eq(nf_sampler_open(&p, nv, &s), 0);
	return s;
}

static struct nf_sampler_params plain(float temp)
{
	struct nf_sampler_params p = nf_sampler_defaults();
	p.temp = temp;
	p.top_k = 0;
	p.top_p = 1.0f;
	p.min_p = 0.0f;
	p.repeat_penalty = 1.0f;
	p.seed = 1234;
	return p;
}

/* Histogram of n draws. */
static void draw(struct nf_sampler *s, const float *lg, int n, int *hist, int nv)
{
	for (int i = 0; i < nv; i++)
		hist[i] = 0;
	for (int i = 0; i < n; i++) {
		int32_t id = nf_sampler_sample(s, lg);
		cr_assert(id >= 0 && id < nv);
		hist[id]++;
	}
}

Test(sampler, greedy_ties_lowest_id)
{
	float lg[6] = { 0.5f, 3.0f, NAN, 3.0f, -INFINITY, 2.9f };
	cr_assert_eq(nf_sampler_argmax(lg, 6), 1);
	struct nf_sampler *s = mk(plain(0.0f), 6);
	cr_assert_eq(nf_sampler_sample(s, lg), 1);
	nf_sampler_close(s);
	float all_nan[2] = { NAN, NAN };
	cr_assert_eq(nf_sampler_argmax(all_nan, 2), 0);
}

Test(sampler, temperature_matches_softmax)
{
	/* p = 1/7, 2/7, 4/7 at temperature 1; at 0.5, 1/21, 4/21, 16/21 */
	float lg[3] = { 0.0f, logf(2.0f), logf(4.0f) };
	int h[3], n = 20000;
	struct nf_sampler *s = mk(plain(1.0f), 3);
	draw(s, lg, n, h, 3);
	cr_assert_float_eq(h[0] / (double)n, 1.0 / 7, 0.015);
	cr_assert_float_eq(h[1] / (double)n, 2.0 / 7, 0.015);
	cr_assert_float_eq(h[2] / (double)n, 4.0 / 7, 0.015);
	nf_sampler_close(s);
	s = mk(plain(0.5f), 3);
	draw(s, lg, n, h, 3);
	cr_assert_float_eq(h[0] / (double)n, 1.0 / 21, 0.015);
	cr_assert_float_eq(h[2] / (double)n, 16.0 / 21, 0.015);
	nf_sampler_close(s);
}

Test(sampler, top_k)
{
	float lg[5] = { 1.0f, 1.1f, 0.9f, 1.05f, 0.2f };
	int h[5];
	struct nf_sampler_params p = plain(1.0f);
	p.top_k = 2;
	struct nf_sampler *s = mk(p, 5);
	draw(s, lg, 4000, h, 5);
	cr_assert_eq(h[0] + h[2] + h[4], 0);
	cr_assert(h[1] > 0 && h[3] > 0);
	nf_sampler_close(s);
	p.top_k = 1;
	s = mk(p, 5);
	draw(s, lg, 200, h, 5);
	cr_assert_eq(h[1], 200);
	nf_sampler_close(s);
}

Test(sampler, top_p)
{
	/* probabilities 0.5, 0.3, 0.15, 0.05 (ids permuted) */
	float lg[4] = { logf(0.15f), logf(0.5f), logf(0.05f), logf(0.3f) };
	int h[4];
	struct nf_sampler_params p = plain(1.0f);
	p.top_p = 0.75f;   /* 0.5 + 0.3 reaches it: keep two */
	struct nf_sampler *s = mk(p, 4);
	draw(s, lg, 4000, h, 4);
	cr_assert_eq(h[0] + h[2], 0);
	cr_assert(h[1] > 0 && h[3] > 0);
	cr_assert_float_eq(h[1] / 4000.0, 0.5 / 0.8, 0.03);
	nf_sampler_close(s);
	p.top_p = 0.9f;    /* needs the third */
	s = mk(p, 4);
	draw(s, lg, 4000, h, 4);
	cr_assert_eq(h[2], 0);
	cr_assert(h[0] > 0);
	nf_sampler_close(s);
}

Test(sampler, min_p)
{
	float lg[4] = { logf(0.15f), logf(0.5f), logf(0.05f), logf(0.3f) };
	int h[4];
	struct nf_sampler_params p = plain(1.0f);
	p.min_p = 0.25f;   /* keeps p >= 0.125: ids 1, 3, 0 */
	struct nf_sampler *s = mk(p, 4);
	draw(s, lg, 4000, h, 4);
	cr_assert_eq(h[2], 0);
	cr_assert(h[0] > 0 && h[1] > 0 && h[3] > 0);
	nf_sampler_close(s);
	p.min_p = 0.7f;    /* only the top token is within 0.7 of the max */
	s = mk(p, 4);
	draw(s, lg, 300, h, 4);
	cr_assert_eq(h[1], 300);
	nf_sampler_close(s);
}

Test(sampler, repetition_penalty_and_window)
{
	struct nf_sampler_params p = plain(0.0f);
	p.repeat_penalty = 1.5f;
	p.repeat_last_n = 1;
	float pos[3] = { 2.0f, 1.9f, -1.0f };
	struct nf_sampler *s = mk(p, 3);
	cr_assert_eq(nf_sampler_sample(s, pos), 0);
	nf_sampler_accept(s, 0);
	cr_assert_eq(nf_sampler_sample(s, pos), 1);       /* 2.0 / 1.5 < 1.9 */
	nf_sampler_accept(s, 2);                          /* pushes 0 out of the window */
	cr_assert_eq(nf_sampler_sample(s, pos), 0);
	nf_sampler_close(s);

	float neg[2] = { -1.0f, -1.2f };
	p.repeat_last_n = 4;
	s = mk(p, 2);
	nf_sampler_accept(s, 0);
	nf_sampler_accept(s, 0);                          /* penalised once, not twice */
	cr_assert_eq(nf_sampler_sample(s, neg), 1);       /* -1.5 < -1.2 */
	float close[2] = { -1.0f, -1.6f };
	cr_assert_eq(nf_sampler_sample(s, close), 0);     /* -1.5 > -1.6: once only */
	nf_sampler_reset(s, 0);
	cr_assert_eq(nf_sampler_sample(s, neg), 0);
	nf_sampler_close(s);
}

Test(sampler, seed_reproducible)
{
	float lg[8];
	for (int i = 0; i < 8; i++)
		lg[i] = 0.1f * i;
	struct nf_sampler_params p = plain(1.0f);
	struct nf_sampler *a = mk(p, 8), *b = mk(p, 8);
	p.seed = 99;
	struct nf_sampler *c = mk(p, 8);
	int32_t sa[64];
	int same_c = 0;
	for (int i = 0; i < 64; i++) {
		sa[i] = nf_sampler_sample(a, lg);
		cr_assert_eq(sa[i], nf_sampler_sample(b, lg));
		same_c += sa[i] == nf_sampler_sample(c, lg);
	}
	cr_assert(same_c < 64, "a different seed gave the same 64 draws");
	nf_sampler_reset(a, 1234);
	for (int i = 0; i < 64; i++)
		cr_assert_eq(sa[i], nf_sampler_sample(a, lg));
	nf_sampler_close(a);
	nf_sampler_close(b);
	nf_sampler_close(c);
}

Test(sampler, rejects_bad_params)
{
	struct nf_sampler *s = NULL;
	struct nf_sampler_params p = plain(1.0f);
	cr_assert_eq(nf_sampler_open(&p, 0, &s), NF_EUSAGE);
	p.repeat_penalty = 0.0f;
	cr_assert_eq(nf_sampler_open(&p, 4, &s), NF_EUSAGE);
	p = plain(NAN);
	cr_assert_eq(nf_sampler_open(&p, 4, &s), NF_EUSAGE);
	p = plain(1.0f);
	p.min_p = 2.0f;
	cr_assert_eq(nf_sampler_open(&p, 4, &s), NF_EUSAGE);
	cr_assert_null(s);
	nf_sampler_close(NULL);
}

/* OpenAI's definitions: logit -= count * frequency + (count > 0) * presence,
 * over the accepted tokens in the window. */
Test(sampler, frequency_and_presence_penalties)
{
	struct nf_sampler_params p = plain(0.0f);
	p.freq_penalty = 0.5f;
	p.repeat_last_n = 8;
	float lg[3] = { 3.0f, 2.2f, 0.0f };
	struct nf_sampler *s = mk(p, 3);
	nf_sampler_accept(s, 0);
	cr_assert_eq(nf_sampler_sample(s, lg), 0);        /* 2.5 > 2.2 */
	nf_sampler_accept(s, 0);
	cr_assert_eq(nf_sampler_sample(s, lg), 1);        /* 3 - 2 * 0.5 = 2.0 < 2.2 */
	nf_sampler_close(s);

	p.freq_penalty = 0.0f;
	p.presence_penalty = 0.5f;
	s = mk(p, 3);
	nf_sampler_accept(s, 0);
	nf_sampler_accept(s, 0);
	nf_sampler_accept(s, 0);
	cr_assert_eq(nf_sampler_sample(s, lg), 0);        /* once only: 2.5 > 2.2 */
	p.presence_penalty = 0.9f;
	nf_sampler_close(s);
	s = mk(p, 3);
	nf_sampler_accept(s, 0);
	cr_assert_eq(nf_sampler_sample(s, lg), 1);        /* 2.1 < 2.2 */
	nf_sampler_close(s);

	/* negative penalties encourage repeats */
	p.presence_penalty = -1.0f;
	s = mk(p, 3);
	nf_sampler_accept(s, 2);
	float lg2[3] = { 0.5f, 0.2f, 0.0f };
	cr_assert_eq(nf_sampler_sample(s, lg2), 2);
	nf_sampler_close(s);

	p.freq_penalty = INFINITY;
	cr_assert_eq(nf_sampler_open(&p, 3, &s), NF_EUSAGE);
	p.freq_penalty = 0.0f;
	p.presence_penalty = NAN;
	cr_assert_eq(nf_sampler_open(&p, 3, &s), NF_EUSAGE);
}

Test(sampler, stop_strings)
{
	const char *stops[] = { "\n\n", "END", "" };
	size_t hold = 99;
	const char *t = "one two";
	cr_expect_eq(nf_sampler_stop_scan(t, strlen(t), stops, 3, &hold), strlen(t));
	cr_expect_eq(hold, 0);
	t = "one E";
	cr_expect_eq(nf_sampler_stop_scan(t, strlen(t), stops, 3, &hold), strlen(t));
	cr_expect_eq(hold, 1);                            /* "E" may start "END" */
	t = "one EN";
	nf_sampler_stop_scan(t, strlen(t), stops, 3, &hold);
	cr_expect_eq(hold, 2);
	t = "a\n\nb END c";
	cr_expect_eq(nf_sampler_stop_scan(t, strlen(t), stops, 3, &hold), 1);   /* the earliest */
	t = "xENDy\n";
	cr_expect_eq(nf_sampler_stop_scan(t, strlen(t), stops, 2, &hold), 1);
	cr_expect_eq(hold, 1);                            /* the "\n" */
	cr_expect_eq(nf_sampler_stop_scan("", 0, stops, 3, NULL), 0);
	cr_expect_eq(nf_sampler_stop_scan("EN", 2, stops, 0, &hold), 2);
	cr_expect_eq(hold, 0);
}
