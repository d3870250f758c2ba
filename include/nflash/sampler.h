/*
 * nflash/sampler.h - picks the next token from a row of logits.
 *
 * The chain follows llama.cpp's default order: the penalties over the last
 * repeat_last_n accepted tokens (repetition, then frequency and presence,
 * as OpenAI defines them), then top-k, top-p, min-p (these three
 * look at the probabilities at temperature 1), then temperature, then a
 * draw from the remaining distribution with the sampler's own PRNG. A
 * temperature <= 0 means greedy: the largest (penalised) logit, ties going
 * to the lowest id. Identical seeds and inputs give identical draws.
 *
 *	struct nf_sampler_params sp = nf_sampler_defaults();
 *	sp.temp = 0.7f; sp.seed = 42;
 *	struct nf_sampler *s;
 *	nf_sampler_open(&sp, n_vocab, &s);
 *	int32_t id = nf_sampler_sample(s, logits);   // logits are not modified
 *	nf_sampler_accept(s, id);                     // feeds the penalty window
 *	nf_sampler_close(s);
 *
 * Everything is allocated at open; sampling never allocates. A sampler is
 * used by one thread at a time; distinct samplers are independent.
 */
#ifndef NFLASH_SAMPLER_H
#define NFLASH_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct nf_sampler_params {
	float temp;            /* <= 0: greedy */
	int32_t top_k;         /* <= 0: off */
	float top_p;           /* >= 1: off */
	float min_p;           /* <= 0: off */
	float repeat_penalty;  /* 1: off; > 1 discourages repeats */
	int32_t repeat_last_n; /* window of accepted tokens the penalties look at; 0: off */
	float freq_penalty;    /* 0: off; subtracted from a logit once per occurrence in the window */
	float presence_penalty; /* 0: off; subtracted once from a logit whose token is in the window */
	uint64_t seed;
};

/* llama.cpp's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05,
 * repeat penalty 1.0 (off) over the last 64 tokens, frequency and
 * presence penalties 0 (off), seed 0. */
struct nf_sampler_params nf_sampler_defaults(void);

struct nf_sampler;

/*
 * nf_sampler_open - a sampler for rows of n_vocab logits. Returns 0, NF_EUSAGE
 * for a bad parameter (n_vocab 0, NaN or negative values, repeat penalty
 * <= 0, a non-finite frequency or presence penalty) or
 * -ENOMEM. The caller frees *out with nf_sampler_close().
 */
int nf_sampler_open(const struct nf_sampler_params *p, uint32_t n_vocab, struct nf_sampler **out);
/* Accepts NULL. */
void nf_sampler_close(struct nf_sampler *s);

/*
 * nf_sampler_sample - the next token id for logits[0..n_vocab). Non-finite
 * logits are treated as -inf. Returns an id in [0, n_vocab).
 */
int32_t nf_sampler_sample(struct nf_sampler *s, const float *logits);

/* Record a token (prompt or generated) in the repetition-penalty window. */
void nf_sampler_accept(struct nf_sampler *s, int32_t id);

/* Forget the accepted tokens and reseed the PRNG with seed. */
void nf_sampler_reset(struct nf_sampler *s, uint64_t seed);

/*
 * nf_sampler_stop_scan - stop strings in generated text. Returns the
 * offset of the earliest occurrence in text[0..len) of any of the n stop
 * strings (empty strings are ignored), or len if none occurs. *hold (may be
 * NULL) is set to the length of the longest tail of text[0..len) that is a
 * proper prefix of a stop string: bytes a stream must hold back until the
 * next token settles whether a stop string starts there. Pure function.
 */
size_t nf_sampler_stop_scan(const char *text, size_t len, const char *const *stops, size_t n, size_t *hold);

/* Greedy argmax of n logits, ties to the lowest index (NaN ignored). */
int32_t nf_sampler_argmax(const float *logits, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_SAMPLER_H */
