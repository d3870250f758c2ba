/*
 * test_planner_synth.c - synthetic sparse models: measured sparsity, skew
 * and predictor quality meet what was asked; same seed, same bytes; the
 * predictor and plain flavours share every other tensor; bad arguments
 * give errors naming the flag.
 *
 * Firing is measured with the real runtime (compute/model's dense forward
 * pass, through nf_synth_report_run); invariants of the construction are
 * checked on the file's bytes.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
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

/* Run the model with the real runtime over 1000 tokens (nf_synth_report_run). */
static void measure(const char *path, double sparsity, struct measured *m)
{
	struct nf_synth_report r;
	struct nf_diag d = { 0 };
	struct nf_synth_report_opts o = { .n_tokens = 1000, .seed = 7, .n_threads = 1 };
	int rc = nf_synth_report_run(path, &o, &r, &d);
	cr_assert_eq(rc, 0, "report: %s", nf_diag_msg(&d, rc));
	*m = (struct measured){ r.mean.sparsity, r.mean.top10_share, r.mean.overlap,
				r.mean.recall, r.mean.precision, r.mean.skew };
	for (uint32_t l = 0; l < r.n_layer; l++)
		cr_expect(fabs(r.layers[l].sparsity - sparsity) <= 0.03,
			  "layer %u: sparsity %.4f, asked %.2f", l, r.layers[l].sparsity, sparsity);
	nf_synth_report_free(&r);
}

static void check_model(uint32_t dtype, enum nf_synth_act act, double sparsity, double skew,
			uint32_t n_expert)
{
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	if (n_expert) {
		p.n_expert = n_expert;
		p.n_expert_used = 2;
		p.n_ff = 256;
	}
	p.dtype = dtype;
	p.act = act;
	p.sparsity = sparsity;
	p.skew = skew;
	p.seed = 42;
	char *path = tmp_path("m");
	write_model(&p, path);
	struct measured m;
	measure(path, sparsity, &m);
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

Test(planner_synth, relu_f32_meets_targets) { check_model(NF_DTYPE_F32, NF_SYNTH_ACT_RELU, 0.90, 1.0, 0); }
Test(planner_synth, relu_q4_0_meets_targets) { check_model(NF_DTYPE_Q4_0, NF_SYNTH_ACT_RELU, 0.90, 1.0, 0); }
Test(planner_synth, drelu_q8_0_meets_targets) { check_model(NF_DTYPE_Q8_0, NF_SYNTH_ACT_DRELU, 0.85, 0.8, 0); }
Test(planner_synth, relu_f16_sparse_skewed) { check_model(NF_DTYPE_F16, NF_SYNTH_ACT_RELU, 0.97, 1.2, 0); }
Test(planner_synth, moe_q8_0_meets_targets) { check_model(NF_DTYPE_Q8_0, NF_SYNTH_ACT_RELU, 0.90, 1.0, 4); }

/* ---- bytes ------------------------------------------------------------------ */

/* Byte-for-byte comparison of two files, streamed. */
static bool same_file(const char *a, const char *b)
{
	FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
	cr_assert(fa && fb, "open %s, %s", a, b);
	const size_t len = 1 << 16;
	char *x = malloc(len), *y = malloc(len);
	bool same = true;
	for (;;) {
		size_t na = fread(x, 1, len, fa), nb = fread(y, 1, len, fb);
		if (na != nb || memcmp(x, y, na)) {
			same = false;
			break;
		}
		if (na == 0)
			break;
	}
	free(x);
	free(y);
	fclose(fa);
	fclose(fb);
	return same;
}

Test(planner_synth, same_seed_same_bytes)
{
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	p.dtype = NF_DTYPE_Q4_0;
	p.seed = 99;
	char *a = tmp_path("a"), *b = tmp_path("b"), *c = tmp_path("c"), *e = tmp_path("e");
	write_model(&p, a);
	p.n_threads = 3;            /* another split of the rows */
	write_model(&p, b);
	cr_expect(same_file(a, b), "1 and 3 threads wrote different bytes");
	setenv("NFLASH_SYNTH_NO_AVX2", "1", 1);   /* the portable gate kernel */
	write_model(&p, c);
	unsetenv("NFLASH_SYNTH_NO_AVX2");
	cr_expect(same_file(a, c), "the AVX2 and portable gate kernels differ");
	p.seed = 100;
	write_model(&p, e);
	cr_expect(!same_file(a, e), "another seed wrote the same bytes");
	unlink(a); unlink(b); unlink(c); unlink(e);
	free(a); free(b); free(c); free(e);
}

/* The default flavour has exactly the layout of PowerInfer's own sample
 * (same shape: n_embd 128, n_ff 1024, 2 layers, 4/2 heads, vocab 320). */
Test(planner_synth, powerinfer_layout_matches_sample)
{
	const char *sample = "../shared/testdata/powerinfer/tiny-relullama-ff1024-f32.pwri.gguf";
	if (access(sample, R_OK))
		cr_skip_test("%s is not readable", sample);
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	char *path = tmp_path("pwri");
	write_model(&p, path);
	struct nf_gguf *a, *b;
	cr_assert_eq(nf_gguf_open(sample, 0, &a, NULL), 0);
	cr_assert_eq(nf_gguf_open(path, 0, &b, NULL), 0);
	cr_expect(nf_gguf_is_powerinfer(b));
	cr_assert_eq(nf_gguf_n_tensors(a), nf_gguf_n_tensors(b));
	for (size_t i = 0; i < nf_gguf_n_tensors(a); i++) {
		const struct nf_gguf_tensor *x = nf_gguf_tensor_at(a, i), *y = nf_gguf_tensor_at(b, i);
		cr_expect_str_eq(x->name, y->name);
		cr_expect_eq(x->type, y->type, "%s: type %u vs %u", x->name, x->type, y->type);
		cr_expect_eq(x->offset, y->offset - nf_gguf_data_offset(b) + nf_gguf_data_offset(a),
			     "%s: offset", x->name);
		for (int k = 0; k < NF_GGUF_MAX_DIMS; k++)
			cr_expect_eq(x->ne[k], y->ne[k], "%s: ne[%d]", x->name, k);
	}
	float thr;
	cr_expect_eq(nf_gguf_get_f32(b, "powerinfer.sparse_threshold", &thr), 0);
	cr_expect(thr <= 0);
	nf_gguf_close(a);
	nf_gguf_close(b);
	unlink(path);
	free(path);
}

static bool is_down_or_pred(const char *name)
{
	return strstr(name, "ffn_down") || strstr(name, ".fc1.") || strstr(name, ".fc2.");
}

static void check_flavours(uint32_t dtype)
{
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	p.dtype = dtype;
	p.seed = 5;
	char *pw = tmp_path("pw"), *pl = tmp_path("pl");
	write_model(&p, pw);
	p.predictor = false;
	write_model(&p, pl);
	struct nf_gguf *a, *b;
	cr_assert_eq(nf_gguf_open(pw, NF_GGUF_MMAP, &a, NULL), 0);
	cr_assert_eq(nf_gguf_open(pl, NF_GGUF_MMAP, &b, NULL), 0);
	cr_expect(nf_gguf_is_powerinfer(a));
	cr_expect(!nf_gguf_is_powerinfer(b));
	cr_expect(!nf_gguf_find_kv(b, "powerinfer.sparse_threshold"));
	size_t n_other = 0;
	for (size_t i = 0; i < nf_gguf_n_tensors(b); i++) {
		const struct nf_gguf_tensor *y = nf_gguf_tensor_at(b, i);
		cr_expect(!strstr(y->name, ".fc1.") && !strstr(y->name, ".fc2.") &&
			  !strstr(y->name, "ffn_down_t"), "plain file has %s", y->name);
		if (is_down_or_pred(y->name))
			continue;
		const struct nf_gguf_tensor *x = nf_gguf_find_tensor(a, y->name);
		cr_assert(x, "%s missing from the predictor file", y->name);
		cr_expect(x->size == y->size && !memcmp(x->data, y->data, x->size),
			  "%s differs between the flavours", y->name);
		n_other++;
	}
	cr_expect_eq(n_other, 1 + 2 * 8 + 2);   /* embd, 8 per layer, output norm and matrix */
	/* The two down layouts hold exactly the same real matrix. */
	uint32_t n_embd = p.n_embd, n_ff = p.n_ff;
	for (uint32_t l = 0; l < p.n_layer; l++) {
		char n1[64], n2[64];
		snprintf(n1, sizeof(n1), "blk.%u.ffn_down_t.weight", l);
		snprintf(n2, sizeof(n2), "blk.%u.ffn_down.weight", l);
		uint64_t r1, c1, r2, c2;
		float *dt = load_f32(a, n1, &r1, &c1), *dn = load_f32(b, n2, &r2, &c2);
		cr_assert(r1 == n_ff && c1 == n_embd && r2 == n_embd && c2 == n_ff);
		size_t bad = 0;
		for (uint32_t c = 0; c < n_embd; c++)
			for (uint32_t j = 0; j < n_ff; j++)
				bad += dt[(size_t)j * n_embd + c] != dn[(size_t)c * n_ff + j];
		cr_expect_eq(bad, 0, "%s vs %s: %zu values differ", n1, n2, bad);
		free(dt);
		free(dn);
	}
	nf_gguf_close(a);
	nf_gguf_close(b);
	unlink(pw); unlink(pl);
	free(pw); free(pl);
}

Test(planner_synth, flavours_share_tensors_q4_0) { check_flavours(NF_DTYPE_Q4_0); }
Test(planner_synth, flavours_share_tensors_f32) { check_flavours(NF_DTYPE_F32); }

/* No layer writes to the bias channel or the token channels: that is what
 * makes firing probabilities exact. Also: the bias sits alone in its block
 * and every embedding stores the same constant there. */
Test(planner_synth, construction_invariants)
{
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	p.dtype = NF_DTYPE_Q4_0;
	p.predictor = false;
	char *path = tmp_path("inv");
	write_model(&p, path);
	struct nf_gguf *g;
	cr_assert_eq(nf_gguf_open(path, NF_GGUF_MMAP, &g, NULL), 0);
	uint32_t nt = nf_synth_n_tok(p.n_embd), tb, tc;
	cr_assert_eq(nf_gguf_get_u32(g, "nflash.synth.token_channel_begin", &tb), 0);
	cr_assert_eq(nf_gguf_get_u32(g, "nflash.synth.token_channel_count", &tc), 0);
	cr_expect(tb == NF_SYNTH_TOK_BEGIN && tc == nt);
	uint64_t rows, cols;
	float *emb = load_f32(g, "token_embd.weight", &rows, &cols);
	for (uint64_t t = 0; t < rows; t++)
		cr_expect_eq(emb[t * cols], emb[0], "token %llu: bias channel differs",
			     (unsigned long long)t);
	cr_expect(fabsf(emb[0] - NF_SYNTH_BIAS_VALUE) < 0.01f);
	free(emb);
	for (uint32_t l = 0; l < p.n_layer; l++) {
		const char *names[] = { "attn_output", "ffn_down" };
		for (int k = 0; k < 2; k++) {
			char nm[64];
			snprintf(nm, sizeof(nm), "blk.%u.%s.weight", l, names[k]);
			float *w = load_f32(g, nm, &rows, &cols);
			for (uint64_t c = 0; c < rows; c++) {
				bool reserved = c == 0 || (c >= tb && c < tb + tc);
				double s = 0;
				for (uint64_t i = 0; i < cols; i++)
					s += fabs(w[c * cols + i]);
				if (reserved)
					cr_expect(s == 0, "%s writes to reserved channel %llu", nm,
						  (unsigned long long)c);
				else
					cr_expect(s > 0, "%s: row %llu is empty", nm, (unsigned long long)c);
			}
			free(w);
		}
		/* ggml's own quantizer reproduces the down matrix's bytes from its
		 * values (the grid construction makes Q4_0 exact along rows). */
		char nm[64];
		snprintf(nm, sizeof(nm), "blk.%u.ffn_down.weight", l);
		const struct nf_gguf_tensor *dt = nf_gguf_find_tensor(g, nm);
		float *dv = load_f32(g, nm, &rows, &cols);
		size_t rb = nf_dtype_row_size(dt->type, cols);
		uint8_t *q = malloc(rb);
		for (uint64_t r = 0; r < rows; r++) {
			nf_quantize_row(dt->type, dv + r * cols, q, cols);
			if (memcmp(q, (const uint8_t *)dt->data + r * rb, rb)) {
				cr_expect(0, "%s row %llu: requantized bytes differ", nm,
					  (unsigned long long)r);
				break;
			}
		}
		free(q);
		free(dv);
		snprintf(nm, sizeof(nm), "blk.%u.ffn_gate.weight", l);
		float *w = load_f32(g, nm, &rows, &cols);
		for (uint64_t j = 0; j < rows; j++)
			for (uint64_t c = 1; c < cols; c++)
				if (!(c >= tb && c < tb + tc) && w[j * cols + c] != 0) {
					cr_expect(0, "%s row %llu reads channel %llu", nm,
						  (unsigned long long)j, (unsigned long long)c);
					j = rows;
					break;
				}
		free(w);
	}
	nf_gguf_close(g);
	unlink(path);
	free(path);
}

Test(planner_synth, quantizer_matches_reference)
{
	size_t n = 32 * 64;
	float *x = malloc(n * sizeof(float));
	uint8_t *a = malloc(2 * n), *b = malloc(2 * n);
	uint64_t s = 12345;
	for (size_t i = 0; i < n; i++) {
		s = s * 6364136223846793005ULL + 1442695040888963407ULL;
		x[i] = (float)((int64_t)(s >> 11) - (1LL << 52)) / (float)(1LL << 52) * 3.0f;
	}
	/* ties and edge cases: halves, equal magnitudes of both signs, zeros */
	for (int i = 0; i < 32; i++)
		x[i] = (float)(i - 16) * 0.5f;
	x[40] = 7.0f;
	x[41] = -7.0f;
	for (int i = 64; i < 96; i++)
		x[i] = 0;
	uint32_t types[] = { NF_DTYPE_Q4_0, NF_DTYPE_Q8_0 };
	for (int t = 0; t < 2; t++) {
		size_t rb = nf_dtype_row_size(types[t], n);
		nf_quantize_row(types[t], x, a, n);
		nf_synth_quantize_row(types[t], x, b, n);
		cr_expect(!memcmp(a, b, rb), "%s: bytes differ from the reference",
			  nf_dtype_name(types[t]));
	}
	free(x);
	free(a);
	free(b);
}

/* The 32000-token shapes carry LLaMA-2's real vocabulary. */
Test(planner_synth, llama_vocabulary_copied)
{
	if (access(NF_SYNTH_LLAMA_VOCAB, R_OK))
		cr_skip_test("%s is not readable", NF_SYNTH_LLAMA_VOCAB);
	struct nf_synth_params p;
	nf_synth_params_init(&p);
	p.n_vocab = 32000;
	p.n_layer = 1;
	p.vocab_path = NF_SYNTH_LLAMA_VOCAB;
	p.dtype = NF_DTYPE_Q4_0;
	char *path = tmp_path("voc");
	write_model(&p, path);
	struct nf_gguf *a, *b;
	cr_assert_eq(nf_gguf_open(NF_SYNTH_LLAMA_VOCAB, 0, &a, NULL), 0);
	cr_assert_eq(nf_gguf_open(path, 0, &b, NULL), 0);
	const struct nf_gguf_kv *ta, *tb;
	cr_assert_eq(nf_gguf_get_arr(a, "tokenizer.ggml.tokens", &ta), 0);
	cr_assert_eq(nf_gguf_get_arr(b, "tokenizer.ggml.tokens", &tb), 0);
	cr_assert_eq(ta->arr_n, tb->arr_n);
	for (uint64_t i = 0; i < ta->arr_n; i += 97) {
		uint64_t la, lb;
		const char *sa = nf_gguf_arr_str(ta, i, &la), *sb = nf_gguf_arr_str(tb, i, &lb);
		cr_expect(la == lb && !memcmp(sa, sb, la), "token %llu differs",
			  (unsigned long long)i);
	}
	cr_expect(nf_gguf_find_kv(b, "tokenizer.ggml.scores") != NULL);
	cr_expect(nf_gguf_find_kv(b, "tokenizer.ggml.token_type") != NULL);
	nf_gguf_close(a);
	nf_gguf_close(b);
	/* A vocabulary size that does not match the file is refused. */
	p.n_vocab = 31999;
	struct nf_diag d = { 0 };
	cr_expect_eq(nf_synth_write(&p, path, &d), NF_EUSAGE);
	cr_expect(strstr(d.msg, "--vocab"), "message: %s", d.msg);
	unlink(path);
	free(path);
}

/* ---- arguments ----------------------------------------------------------- */

static void expect_bad(struct nf_synth_params *p, const char *flag)
{
	struct nf_diag d = { 0 };
	cr_expect_eq(nf_synth_validate(p, &d), NF_EUSAGE, "%s accepted", flag);
	cr_expect(strstr(d.msg, flag), "message '%s' does not name %s", d.msg, flag);
}

Test(planner_synth, bad_parameters_name_the_flag)
{
	struct nf_synth_params p;
	struct nf_diag d = { 0 };
	nf_synth_params_init(&p);
	cr_expect_eq(nf_synth_validate(&p, &d), 0, "%s", d.msg);
	p.n_embd = 100;
	expect_bad(&p, "--dim");
	nf_synth_params_init(&p);
	p.n_ff = 1000;
	expect_bad(&p, "--ffn");
	nf_synth_params_init(&p);
	p.sparsity = 1.0;
	expect_bad(&p, "--sparsity");
	p.sparsity = 0;
	expect_bad(&p, "--sparsity");
	p.sparsity = -0.5;
	expect_bad(&p, "--sparsity");
	nf_synth_params_init(&p);
	p.n_head = 5;
	expect_bad(&p, "--heads");
	nf_synth_params_init(&p);
	p.n_expert = 4;
	p.n_expert_used = 5;
	expect_bad(&p, "--experts-used");
	nf_synth_params_init(&p);
	p.pred_rank = 7;
	expect_bad(&p, "--rank");
	memset(&d, 0, sizeof(d));
	cr_expect_eq(nf_synth_shape(&p, "70b", &d), NF_EUSAGE);
	cr_expect(strstr(d.msg, "--shape") && strstr(d.msg, "70b"), "message: %s", d.msg);
	cr_expect_eq(nf_synth_shape(&p, "mixtral-8x7b", NULL), 0);
	cr_expect(p.n_expert == 8 && p.n_expert_used == 2 && p.n_ff == 14336);
}

static int run_cli(const char *const *args)
{
	char *argv[32];
	int argc = 0;
	for (; args[argc]; argc++)
		argv[argc] = (char *)args[argc];
	argv[argc] = NULL;
	return nf_cmd_synth(argc, argv);
}

Test(planner_synth, cli_usage_errors, .init = cr_redirect_stderr)
{
	const char *o = "/tmp/nflash-synth-never-written.gguf";
	const char *bad[][12] = {
		{ "synth", "--shape", "huge", "-o", o, NULL },
		{ "synth", "--sparsity", "1.5", "-o", o, NULL },
		{ "synth", "--shape", "custom", "--dim", "100", "-o", o, NULL },
		{ "synth", "--dtype", "q5_1", "-o", o, NULL },
		{ "synth", "--activation", "gelu", "-o", o, NULL },
		{ "synth", "--frobnicate", "-o", o, NULL },
		{ "synth", "--sparsity", "0.9", NULL },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_expect_eq(run_cli(bad[i]), NF_EXIT_USAGE, "case %zu accepted", i);
	cr_expect(access(o, F_OK) != 0, "a failed run left %s", o);
	fflush(stderr);
	cr_expect_stderr_eq_str(
		"nflash: --shape: unknown shape 'huge' (expected tiny, 7b, 13b, mixtral-8x7b or custom)\n"
		"nflash: --sparsity: 1.5 is outside (0,1)\n"
		"nflash: --dim: 100 is not a multiple of the quant block (32) of at least 128 (the bias and token channels are block-aligned)\n"
		"nflash: --dtype: unknown type 'q5_1' (expected q4_0, q8_0, q2_k..q6_k, f16 or f32)\n"
		"nflash: --activation: unknown activation 'gelu' (expected relu, drelu or silu)\n"
		"nflash: synth: unknown option '--frobnicate' (try 'nflash synth --help')\n"
		"nflash: synth: -o FILE.gguf is required (try 'nflash synth --help')\n");
}
