/*
 * synth.c - parameters, named shapes, validation and the firing-probability
 * mathematics of synthetic sparse models (see nflash/synth.h and
 * docs/SYNTH.md). The generator itself is in synth_write.c.
 *
 * Invariants: validation names the command-line flag of every bad field;
 * nf_synth_power_law returns probabilities in [1e-6, cap] whose mean is the
 * requested one to 1e-9 (when the cap allows it); everything is pure.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "nflash/dtype.h"
#include "nflash/synth.h"

void nf_synth_params_init(struct nf_synth_params *p)
{
	memset(p, 0, sizeof(*p));
	p->shape = "tiny";
	p->n_embd = 128;
	p->n_ff = 1024;
	p->n_layer = 2;
	p->n_head = 4;
	p->n_head_kv = 2;
	p->n_vocab = 320;
	p->n_ctx = 128;
	p->rope_base = 10000.0f;
	p->rms_eps = 1e-5f;
	p->act = NF_SYNTH_ACT_RELU;
	p->sparsity = 0.9;
	p->skew = 1.0;
	p->dtype = NF_DTYPE_F32;
	p->seed = 1;
	p->predictor = true;
	p->pred_rank = 64;
	p->n_threads = 1;
}

struct shape {
	const char *name;
	uint32_t n_embd, n_ff, n_layer, n_head, n_head_kv, n_expert, n_expert_used;
	uint32_t n_vocab, n_ctx;
	float rope_base;
	bool llama_vocab;
};

static const struct shape shapes[] = {
	{ "tiny", 128, 1024, 2, 4, 2, 0, 0, 320, 128, 10000.0f, false },
	{ "7b", 4096, 11008, 32, 32, 32, 0, 0, 32000, 4096, 10000.0f, true },
	{ "13b", 5120, 13824, 40, 40, 40, 0, 0, 32000, 4096, 10000.0f, true },
	{ "mixtral-8x7b", 4096, 14336, 32, 32, 8, 8, 2, 32000, 32768, 1000000.0f, true },
};

int nf_synth_shape(struct nf_synth_params *p, const char *name, struct nf_diag *d)
{
	if (!strcmp(name, "custom")) {
		p->shape = "custom";
		return 0;
	}
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
		const struct shape *s = &shapes[i];
		if (strcmp(name, s->name))
			continue;
		p->shape = s->name;
		p->n_embd = s->n_embd;
		p->n_ff = s->n_ff;
		p->n_layer = s->n_layer;
		p->n_head = s->n_head;
		p->n_head_kv = s->n_head_kv;
		p->n_expert = s->n_expert;
		p->n_expert_used = s->n_expert_used;
		p->n_vocab = s->n_vocab;
		p->n_ctx = s->n_ctx;
		p->rope_base = s->rope_base;
		p->vocab_path = s->llama_vocab ? NF_SYNTH_LLAMA_VOCAB : NULL;
		return 0;
	}
	return nf_diag_fail(d, NF_EUSAGE,
			    "--shape: unknown shape '%s' (expected tiny, 7b, 13b, mixtral-8x7b "
			    "or custom)", name);
}

uint32_t nf_synth_n_tok(uint32_t n_embd)
{
	/* Half the stream, in whole blocks, after the bias block. */
	uint32_t n = (n_embd / 2) / 32 * 32;
	if (n + NF_SYNTH_TOK_BEGIN > n_embd)
		n = 0;
	return n;
}

int nf_synth_validate(const struct nf_synth_params *p, struct nf_diag *d)
{
	size_t blk = nf_dtype_block_len(p->dtype);
	if (!blk || p->dtype == NF_DTYPE_BF16 || p->dtype == NF_DTYPE_Q8_K)
		return nf_diag_fail(d, NF_EUSAGE, "--dtype: expected q4_0, q8_0, q2_k..q6_k, f16 or f32");
	if (nf_dtype_is_kquant(p->dtype) && (p->n_embd % NF_QK_K || p->n_ff % NF_QK_K))
		return nf_diag_fail(d, NF_EUSAGE,
				    "--dtype %s: --dim %u and --ffn %u must be multiples of its super-block (256)",
				    nf_dtype_name(p->dtype), p->n_embd, p->n_ff);
	if (p->n_embd < 128 || p->n_embd % 32)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--dim: %u is not a multiple of the quant block (32) of at "
				    "least 128 (the bias and token channels are block-aligned)",
				    p->n_embd);
	if (p->n_ff < 32 || p->n_ff % 32)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--ffn: %u is not a multiple of the quant block (32)", p->n_ff);
	if (p->n_layer < 1 || p->n_layer > 4096)
		return nf_diag_fail(d, NF_EUSAGE, "--layers: %u is out of range [1, 4096]",
				    p->n_layer);
	if (p->n_head < 1 || p->n_embd % p->n_head || (p->n_embd / p->n_head) % 2)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--heads: %u must divide --dim %u into an even head size",
				    p->n_head, p->n_embd);
	if (p->n_head_kv < 1 || p->n_head % p->n_head_kv)
		return nf_diag_fail(d, NF_EUSAGE, "--kv-heads: %u must divide --heads %u",
				    p->n_head_kv, p->n_head);
	if (p->n_expert > 256 || p->n_expert == 1)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--experts: %u must be 0 (dense) or in [2, 256]", p->n_expert);
	if (p->n_expert && (p->n_expert_used < 1 || p->n_expert_used > p->n_expert))
		return nf_diag_fail(d, NF_EUSAGE, "--experts-used: %u must be in [1, --experts %u]",
				    p->n_expert_used, p->n_expert);
	if (!p->n_expert && p->n_expert_used)
		return nf_diag_fail(d, NF_EUSAGE, "--experts-used: needs --experts");
	if (p->n_vocab < 259 || p->n_vocab > 1000000)
		return nf_diag_fail(d, NF_EUSAGE,
				    "--vocab: %u is out of range [259, 1000000] (the byte-level "
				    "vocabulary needs 259 tokens)", p->n_vocab);
	if (!(p->sparsity > 0 && p->sparsity < 1))
		return nf_diag_fail(d, NF_EUSAGE, "--sparsity: %g is outside (0,1)", p->sparsity);
	if (!(p->skew >= 0 && p->skew <= 10))
		return nf_diag_fail(d, NF_EUSAGE, "--skew: %g is outside [0, 10]", p->skew);
	if (p->pred_rank < 4 || p->pred_rank % 2 || p->pred_rank > 4096)
		return nf_diag_fail(d, NF_EUSAGE, "--rank: %u must be even, in [4, 4096]",
				    p->pred_rank);
	if (p->act > NF_SYNTH_ACT_SILU)
		return nf_diag_fail(d, NF_EUSAGE, "--activation: expected relu, drelu or silu");
	if (p->n_threads < 1 || p->n_threads > 256)
		return nf_diag_fail(d, NF_EUSAGE, "--threads: %d is out of range [1, 256]",
				    p->n_threads);
	if (p->n_ctx < 1)
		return nf_diag_fail(d, NF_EUSAGE, "--ctx: must be positive");
	return 0;
}

/* Mean of min(cap, c * (k+1)^-skew) over k < n. */
static double law_mean(double c, size_t n, double skew, double cap)
{
	double s = 0;
	for (size_t k = 0; k < n; k++) {
		double v = c * pow((double)(k + 1), -skew);
		s += v < cap ? v : cap;
	}
	return s / (double)n;
}

int nf_synth_power_law(double *prob, size_t n, double mean, double skew)
{
	if (!(mean > 0 && mean < 1) || n == 0)
		return NF_EUSAGE;
	double cap = 1.0 - (1.0 - mean) / 4.0;
	if (cap < 0.98)
		cap = 0.98;
	if (cap > 0.999)
		cap = 0.999;
	if (mean >= cap) {
		for (size_t k = 0; k < n; k++)
			prob[k] = mean;
		return 0;
	}
	/* law_mean is increasing in c: bisect on log c. */
	double lo = log(1e-12), hi = log(cap) + skew * log((double)n) + 1.0;
	for (int it = 0; it < 200; it++) {
		double mid = 0.5 * (lo + hi);
		if (law_mean(exp(mid), n, skew, cap) < mean)
			lo = mid;
		else
			hi = mid;
	}
	double c = exp(0.5 * (lo + hi));
	for (size_t k = 0; k < n; k++) {
		double v = c * pow((double)(k + 1), -skew);
		if (v > cap)
			v = cap;
		if (v < 1e-6)
			v = 1e-6;
		prob[k] = v;
	}
	return 0;
}

double nf_synth_probit(double p)
{
	if (p <= 0)
		return -INFINITY;
	if (p >= 1)
		return INFINITY;
	/* Phi(x) = erfc(-x / sqrt 2) / 2 is increasing: bisect, then polish
	 * with Newton steps. Deterministic for a given libm. */
	double lo = -40, hi = 40;
	for (int it = 0; it < 80; it++) {
		double mid = 0.5 * (lo + hi);
		if (0.5 * erfc(-mid / sqrt(2.0)) < p)
			lo = mid;
		else
			hi = mid;
	}
	return 0.5 * (lo + hi);
}

const char *nf_synth_act_name(enum nf_synth_act a)
{
	switch (a) {
	case NF_SYNTH_ACT_RELU: return "relu";
	case NF_SYNTH_ACT_DRELU: return "drelu";
	case NF_SYNTH_ACT_SILU: return "silu";
	}
	return "unknown";
}

int nf_synth_act_parse(const char *s)
{
	if (!strcasecmp(s, "relu"))
		return NF_SYNTH_ACT_RELU;
	if (!strcasecmp(s, "drelu"))
		return NF_SYNTH_ACT_DRELU;
	if (!strcasecmp(s, "silu"))
		return NF_SYNTH_ACT_SILU;
	return -1;
}
