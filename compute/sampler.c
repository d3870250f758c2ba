/*
 * sampler.c - next-token selection: repetition penalty, top-k, top-p,
 * min-p, temperature and a seeded draw (see nflash/sampler.h).
 *
 * Invariants:
 *  1. All buffers (candidates, penalty window, seen-stamps) are sized at
 *     open for n_vocab; sample() and accept() never allocate.
 *  2. The PRNG state lives in the sampler (xoshiro256**, seeded through
 *     splitmix64), so equal seeds give equal sequences and samplers do not
 *     disturb each other.
 *  3. Candidate order is total: larger logit first, then lower id, so the
 *     result never depends on qsort's instability.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/error.h"
#include "nflash/sampler.h"

struct nf_cand {
	int32_t id;
	float logit;
	float p;
};

struct nf_sampler {
	struct nf_sampler_params prm;
	uint32_t n_vocab;
	struct nf_cand *cand;   /* n_vocab */
	float *pen;             /* n_vocab: penalised logits */
	uint32_t *stamp;        /* n_vocab: window membership marks */
	uint32_t *count;        /* n_vocab: occurrences in the window (valid where stamped) */
	uint32_t stamp_now;
	int32_t *win;           /* repeat_last_n ring of accepted ids */
	uint32_t win_len, win_pos;
	uint64_t rng[4];
};

struct nf_sampler_params nf_sampler_defaults(void)
{
	return (struct nf_sampler_params){
		.temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
		.repeat_penalty = 1.0f, .repeat_last_n = 64, .seed = 0,
	};
}

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(uint64_t s[4])
{
	uint64_t r = rotl(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return r;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t s[4])
{
	return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

void nf_sampler_reset(struct nf_sampler *s, uint64_t seed)
{
	uint64_t x = seed;
	for (int i = 0; i < 4; i++)
		s->rng[i] = splitmix64(&x);
	s->win_len = 0;
	s->win_pos = 0;
}

int nf_sampler_open(const struct nf_sampler_params *p, uint32_t n_vocab, struct nf_sampler **out)
{
	if (!p || n_vocab == 0 || isnan(p->temp) || isnan(p->top_p) || p->top_p < 0 ||
	    isnan(p->min_p) || p->min_p < 0 || p->min_p > 1 || !(p->repeat_penalty > 0) ||
	    !isfinite(p->repeat_penalty) || p->repeat_last_n < 0 || !isfinite(p->freq_penalty) ||
	    !isfinite(p->presence_penalty))
		return NF_EUSAGE;
	int rc = -ENOMEM;
	struct nf_sampler *s = calloc(1, sizeof(*s));
	if (!s)
		return rc;
	s->prm = *p;
	s->n_vocab = n_vocab;
	s->cand = malloc((size_t)n_vocab * sizeof(*s->cand));
	s->pen = malloc((size_t)n_vocab * sizeof(*s->pen));
	s->stamp = calloc(n_vocab, sizeof(*s->stamp));
	s->count = calloc(n_vocab, sizeof(*s->count));
	s->win = malloc(((size_t)p->repeat_last_n + 1) * sizeof(*s->win));
	if (!s->cand || !s->pen || !s->stamp || !s->count || !s->win)
		goto fail_free;
	nf_sampler_reset(s, p->seed);
	*out = s;
	return 0;
fail_free:
	nf_sampler_close(s);
	return rc;
}

void nf_sampler_close(struct nf_sampler *s)
{
	if (!s)
		return;
	free(s->cand);
	free(s->pen);
	free(s->stamp);
	free(s->count);
	free(s->win);
	free(s);
}

void nf_sampler_accept(struct nf_sampler *s, int32_t id)
{
	uint32_t n = (uint32_t)s->prm.repeat_last_n;
	if (n == 0 || id < 0 || (uint32_t)id >= s->n_vocab)
		return;
	s->win[s->win_pos] = id;
	s->win_pos = (s->win_pos + 1) % n;
	if (s->win_len < n)
		s->win_len++;
}

int32_t nf_sampler_argmax(const float *logits, size_t n)
{
	int32_t best = 0;
	float bv = -INFINITY;
	bool any = false;
	for (size_t i = 0; i < n; i++) {
		float v = logits[i];
		if (isnan(v))
			continue;
		if (!any || v > bv) {
			bv = v;
			best = (int32_t)i;
			any = true;
		}
	}
	return best;
}

static int cand_cmp(const void *a, const void *b)
{
	const struct nf_cand *x = a, *y = b;
	if (x->logit > y->logit)
		return -1;
	if (x->logit < y->logit)
		return 1;
	return (x->id > y->id) - (x->id < y->id);
}

/* Penalise each distinct token of the window once, as llama.cpp does:
 * positive logits are divided by the penalty, negative ones multiplied. */
static void apply_penalty(struct nf_sampler *s)
{
	float r = s->prm.repeat_penalty, fr = s->prm.freq_penalty, pr = s->prm.presence_penalty;
	if ((r == 1.0f && fr == 0.0f && pr == 0.0f) || s->win_len == 0)
		return;
	if (++s->stamp_now == 0) {
		memset(s->stamp, 0, (size_t)s->n_vocab * sizeof(*s->stamp));
		s->stamp_now = 1;
	}
	for (uint32_t i = 0; i < s->win_len; i++) {
		int32_t id = s->win[i];
		if (s->stamp[id] != s->stamp_now) {
			s->stamp[id] = s->stamp_now;
			s->count[id] = 0;
		}
		s->count[id]++;
	}
	/* then each distinct token once (its count zeroed when done) */
	for (uint32_t i = 0; i < s->win_len; i++) {
		int32_t id = s->win[i];
		uint32_t c = s->count[id];
		if (c == 0)
			continue;
		s->count[id] = 0;
		float v = s->pen[id];
		v = v > 0 ? v / r : v * r;
		s->pen[id] = v - (float)c * fr - pr;
	}
}

size_t nf_sampler_stop_scan(const char *text, size_t len, const char *const *stops, size_t n, size_t *hold)
{
	size_t first = len, tail = 0;
	for (size_t k = 0; k < n; k++) {
		size_t sl = stops[k] ? strlen(stops[k]) : 0;
		if (sl == 0)
			continue;
		const char *at = sl <= len ? memmem(text, len, stops[k], sl) : NULL;
		if (at && (size_t)(at - text) < first)
			first = (size_t)(at - text);
		/* longest tail of text that is a proper prefix of this stop string */
		for (size_t t = sl - 1 < len ? sl - 1 : len; t > tail; t--) {
			if (!memcmp(text + len - t, stops[k], t)) {
				tail = t;
				break;
			}
		}
	}
	if (hold)
		*hold = tail;
	return first;
}

/* Probabilities of cand[0..n) at temperature t (cand sorted, cand[0] max). */
static void cand_softmax(struct nf_cand *c, size_t n, float t)
{
	double sum = 0;
	float mx = c[0].logit;
	for (size_t i = 0; i < n; i++) {
		c[i].p = expf((c[i].logit - mx) / t);
		sum += c[i].p;
	}
	for (size_t i = 0; i < n; i++)
		c[i].p = (float)(c[i].p / sum);
}

int32_t nf_sampler_sample(struct nf_sampler *s, const float *logits)
{
	uint32_t nv = s->n_vocab;
	for (uint32_t i = 0; i < nv; i++)
		s->pen[i] = isfinite(logits[i]) || logits[i] == INFINITY ? logits[i] : -INFINITY;
	apply_penalty(s);
	if (!(s->prm.temp > 0))
		return nf_sampler_argmax(s->pen, nv);

	size_t n = 0;
	for (uint32_t i = 0; i < nv; i++)
		if (s->pen[i] > -INFINITY)
			s->cand[n++] = (struct nf_cand){ .id = (int32_t)i, .logit = s->pen[i] };
	if (n == 0)
		return nf_sampler_argmax(logits, nv);
	qsort(s->cand, n, sizeof(*s->cand), cand_cmp);
	if (s->cand[0].logit == INFINITY)
		return s->cand[0].id;

	if (s->prm.top_k > 0 && (size_t)s->prm.top_k < n)
		n = (size_t)s->prm.top_k;
	if (s->prm.top_p < 1.0f) {
		cand_softmax(s->cand, n, 1.0f);
		double cum = 0;
		for (size_t i = 0; i < n; i++) {
			cum += s->cand[i].p;
			if (cum >= s->prm.top_p) {
				n = i + 1;
				break;
			}
		}
	}
	if (s->prm.min_p > 0) {
		/* p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p) */
		float cut = s->cand[0].logit + logf(s->prm.min_p);
		size_t k = 1;
		while (k < n && s->cand[k].logit >= cut)
			k++;
		n = k;
	}
	cand_softmax(s->cand, n, s->prm.temp);
	double u = rng_uniform(s->rng), cum = 0;
	for (size_t i = 0; i < n; i++) {
		cum += s->cand[i].p;
		if (u < cum)
			return s->cand[i].id;
	}
	return s->cand[n - 1].id;
}
