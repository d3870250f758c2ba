/*
 * synth_stats.c - statistics of measured FFN firing: sparsity, the share of
 * firings taken by the most frequent neurons, token-to-token overlap of the
 * active sets, predictor recall and precision, fitted power-law skew.
 *
 * Invariants: counts are exact integers; every ratio is derived from them
 * at the end; a layer with no tokens reports NAN rather than a made-up 0.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/synth.h"

struct layer_acc {
	uint64_t *count;       /* firings per neuron */
	uint8_t *prev;         /* previous token's mask */
	uint64_t tokens, fired, computed;
	uint64_t tp, pred_n, with_pred;
	double overlap_sum;
	uint64_t overlap_n;
};

struct nf_synth_stats {
	uint32_t n_layer, n;
	struct layer_acc *l;
};

int nf_synth_stats_open(uint32_t n_layer, uint32_t n_neurons, struct nf_synth_stats **out)
{
	struct nf_synth_stats *s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->n_layer = n_layer;
	s->n = n_neurons;
	s->l = calloc(n_layer, sizeof(*s->l));
	if (!s->l)
		goto nomem;
	for (uint32_t i = 0; i < n_layer; i++) {
		s->l[i].count = calloc(n_neurons, sizeof(uint64_t));
		s->l[i].prev = calloc(n_neurons, 1);
		if (!s->l[i].count || !s->l[i].prev)
			goto nomem;
	}
	*out = s;
	return 0;
nomem:
	nf_synth_stats_close(s);
	return -ENOMEM;
}

void nf_synth_stats_close(struct nf_synth_stats *s)
{
	if (!s)
		return;
	if (s->l)
		for (uint32_t i = 0; i < s->n_layer; i++) {
			free(s->l[i].count);
			free(s->l[i].prev);
		}
	free(s->l);
	free(s);
}

void nf_synth_stats_add(struct nf_synth_stats *s, uint32_t layer, const uint8_t *fired,
			const uint8_t *predicted, uint32_t n_computed)
{
	if (layer >= s->n_layer)
		return;
	struct layer_acc *a = &s->l[layer];
	uint64_t nf = 0, both_prev = 0, tp = 0, np = 0;
	for (uint32_t i = 0; i < s->n; i++) {
		uint8_t f = fired[i] != 0;
		nf += f;
		a->count[i] += f;
		both_prev += f & a->prev[i];
		if (predicted) {
			uint8_t pr = predicted[i] != 0;
			np += pr;
			tp += f & pr;
		}
		a->prev[i] = f;
	}
	if (a->tokens > 0 && nf > 0) {
		a->overlap_sum += (double)both_prev / (double)nf;
		a->overlap_n++;
	}
	a->tokens++;
	a->fired += nf;
	a->computed += n_computed;
	if (predicted) {
		a->with_pred++;
		a->tp += tp;
		a->pred_n += np;
	}
}

static int cmp_desc(const void *x, const void *y)
{
	uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
	return a < b ? 1 : a > b ? -1 : 0;
}

double nf_synth_fit_skew(const uint64_t *counts, size_t n, uint64_t tokens)
{
	uint64_t *c = malloc(n * sizeof(uint64_t));
	if (!c || !tokens) {
		free(c);
		return NAN;
	}
	memcpy(c, counts, n * sizeof(uint64_t));
	qsort(c, n, sizeof(uint64_t), cmp_desc);
	double sx = 0, sy = 0, sxx = 0, sxy = 0;
	size_t m = 0;
	for (size_t k = 0; k < n; k++) {
		double f = (double)c[k] / (double)tokens;
		if (f < 0.01 || f > 0.5)
			continue;
		double x = log((double)(k + 1)), y = log(f);
		sx += x;
		sy += y;
		sxx += x * x;
		sxy += x * y;
		m++;
	}
	free(c);
	if (m < 8)
		return NAN;
	double den = m * sxx - sx * sx;
	return den > 0 ? -(m * sxy - sx * sy) / den : NAN;
}

void nf_synth_stats_layer(const struct nf_synth_stats *s, uint32_t layer,
			  struct nf_synth_layer_stats *out)
{
	const struct layer_acc *a = &s->l[layer];
	memset(out, 0, sizeof(*out));
	out->tokens = a->tokens;
	out->sparsity = a->computed ? 1.0 - (double)a->fired / (double)a->computed : NAN;
	out->overlap = a->overlap_n ? a->overlap_sum / (double)a->overlap_n : NAN;
	out->recall = a->with_pred && a->fired ? (double)a->tp / (double)a->fired : NAN;
	out->precision = a->with_pred && a->pred_n ? (double)a->tp / (double)a->pred_n : NAN;
	out->skew = nf_synth_fit_skew(a->count, s->n, a->tokens);
	out->top1_share = out->top10_share = out->top20_share = NAN;
	uint64_t *c = malloc(s->n * sizeof(uint64_t));
	if (!c || !a->fired) {
		free(c);
		return;
	}
	memcpy(c, a->count, s->n * sizeof(uint64_t));
	qsort(c, s->n, sizeof(uint64_t), cmp_desc);
	size_t k1 = (s->n + 99) / 100, k10 = (s->n + 9) / 10, k20 = (s->n + 4) / 5;
	uint64_t acc = 0;
	for (size_t k = 0; k < s->n; k++) {
		acc += c[k];
		if (k + 1 == k1)
			out->top1_share = (double)acc / (double)a->fired;
		if (k + 1 == k10)
			out->top10_share = (double)acc / (double)a->fired;
		if (k + 1 == k20)
			out->top20_share = (double)acc / (double)a->fired;
	}
	free(c);
}

int32_t nf_synth_token(uint64_t seed, uint64_t i, uint32_t n_vocab)
{
	uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	z ^= z >> 31;
	return (int32_t)(3 + (uint32_t)(((z >> 32) * (uint64_t)(n_vocab - 3)) >> 32));
}
