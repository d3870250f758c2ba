/*
 * test_compute_model.c - the transformer against llama.cpp.
 *
 * For every NAME.gguf with a NAME.ref.txt in ../shared/testdata/models and
 * ../shared/testdata/kquant (found by globbing, so new models are checked the same way): the last
 * prompt position's logits within 1e-3 of the reference and the 16-token
 * greedy continuation identical, on every ISA this CPU runs, with 1 and 2
 * threads, with the prompt batched (gemm) and token by token (gemv), which
 * must also agree with each other. The PowerInfer tiny model runs dense.
 * Metadata handling (activation key, errors naming keys and tensors, tied
 * embeddings, the FFN seam) is checked on small models written here.
 */
#include <criterion/criterion.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/kernels.h"
#include "nflash/model.h"
#include "nflash/sampler.h"
#include "util_ref.h"
#include "util_requant.h"

#define MODELS_DIR "../shared/testdata/models"
#define KQUANT_DIR "../shared/testdata/kquant"
#define PWRI_MODEL "../shared/testdata/powerinfer/tiny-relullama-ff1024-f32.pwri.gguf"
#define LOGIT_TOL 1e-3
#define MODE_TOL 1e-4 /* batched vs token by token, 1 vs 2 threads */

static const char *const isas[] = { "scalar", "avx2", "avx512" };

static struct nf_model *load(const char *path)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_model_load(path, NULL, &m, &d);
	cr_assert_eq(rc, 0, "%s: %s", path, nf_diag_msg(&d, rc));
	return m;
}

static struct nf_ctx *open_ctx(struct nf_model *m, const struct nf_kernels *k, int threads,
			       uint32_t n_batch, enum nf_kv_type kv)
{
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.kernels = k;
	cp.n_threads = threads;
	cp.n_batch = n_batch;
	cp.kv_type = kv;
	struct nf_ctx *c = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_ctx_open(m, &cp, &c, &d);
	cr_assert_eq(rc, 0, "nf_ctx_open: %s", nf_diag_msg(&d, rc));
	return c;
}

/* Prompt (all at once, or one token per eval), then n greedy tokens;
 * EOS does not stop. Leaves the prompt's last logits in lg. */
static void run(struct nf_ctx *c, const struct nf_ref *r, bool batched, float *lg, int32_t *greedy,
		size_t n_greedy, uint32_t n_vocab)
{
	if (batched) {
		cr_assert_eq(nf_ctx_eval(c, r->input, r->n_input), 0);
	} else {
		for (size_t i = 0; i < r->n_input; i++)
			cr_assert_eq(nf_ctx_eval(c, &r->input[i], 1), 0);
	}
	memcpy(lg, nf_ctx_logits(c), n_vocab * sizeof(float));
	for (size_t i = 0; i < n_greedy; i++) {
		greedy[i] = nf_sampler_argmax(nf_ctx_logits(c), n_vocab);
		if (i + 1 < n_greedy)
			cr_assert_eq(nf_ctx_eval(c, &greedy[i], 1), 0);
	}
}

static double max_diff(const float *a, const float *b, size_t n, size_t *at)
{
	double md = -1;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)a[i] - (double)b[i]);
		if (!(d <= md)) {
			md = d;
			*at = i;
		}
	}
	return md;
}

static void check_model_how(const char *gguf, const char *ref_path, bool every_way, bool tbt);

static void check_model(const char *gguf, const char *ref_path)
{
	check_model_how(gguf, ref_path, true, false);
}

/* every_way: every ISA, 1 and 2 threads, batched and token by token (else
 * the start-up table, 2 threads, batched, or token by token if tbt: the
 * ISAs and thread counts agree, and the testdata models check that) */
static void check_model_how(const char *gguf, const char *ref_path, bool every_way, bool tbt)
{
	struct nf_ref r;
	struct nf_diag d = { 0 };
	int rc = nf_ref_load(ref_path, &r, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_model *m = load(gguf);
	uint32_t nv = nf_model_hparams(m)->n_vocab;
	cr_assert_eq(nv, r.n_vocab, "%s: n_vocab %u, reference has %zu", gguf, nv, r.n_vocab);
	float *lg = malloc(nv * sizeof(float)), *first = malloc(2 * nv * sizeof(float));
	int32_t *greedy = malloc(r.n_greedy * sizeof(int32_t));
	cr_assert(lg && first && greedy);
	int runs = 0;

	for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
		const struct nf_kernels *k = every_way ? nf_kernels_isa(isas[ii]) : ii ? NULL : nf_kernels_get();
		if (!k)
			continue;
		/* per way of feeding the prompt: with F16 weights a batch's
		 * products and a single token's sum in other orders, as in
		 * llama.cpp (nf_ktype_column); each is checked against the
		 * reference above */
		bool have_first[2] = { false, false };
		for (int threads = every_way ? 1 : 2; threads <= 2; threads++) {
			for (int batched = !(tbt && !every_way); batched >= (every_way || tbt ? 0 : 1); batched--) {
				struct nf_ctx *c = open_ctx(m, k, threads, 512, NF_KV_F32);
				run(c, &r, batched, lg, greedy, r.n_greedy, nv);
				nf_ctx_close(c);
				const char *how = batched ? "batched" : "token by token";
				size_t at = 0;
				double md = max_diff(lg, r.logits, nv, &at);
				cr_expect(md <= LOGIT_TOL,
					  "%s [%s, %d threads, %s]: logit %zu is %.6e, reference %.6e (diff %.3g)",
					  gguf, k->isa, threads, how, at, lg[at], r.logits[at], md);
				for (size_t i = 0; i < r.n_greedy; i++)
					cr_expect_eq(greedy[i], r.greedy[i],
						     "%s [%s, %d threads, %s]: greedy token %zu is %d, reference %d",
						     gguf, k->isa, threads, how, i, greedy[i], r.greedy[i]);
				/* Within one ISA and way, the thread count must agree. */
				float *fw = first + (size_t)batched * nv;
				if (!have_first[batched]) {
					memcpy(fw, lg, nv * sizeof(float));
					have_first[batched] = true;
				} else {
					md = max_diff(lg, fw, nv, &at);
					cr_expect(md <= MODE_TOL, "%s [%s, %d threads, %s]: differs from "
						  "the first way by %.3g at %zu", gguf, k->isa, threads,
						  how, md, at);
				}
				runs++;
			}
		}
	}
	cr_assert(runs >= (every_way ? 4 : 1));
	free(lg);
	free(first);
	free(greedy);
	nf_model_free(m);
	nf_ref_free(&r);
}

/* check_model on every NAME.gguf in dir that has a NAME.ref.txt */
static void check_dir(const char *dir)
{
	glob_t gl;
	char pat[4096];
	snprintf(pat, sizeof(pat), "%s/*.gguf", dir);
	int grc = glob(pat, 0, NULL, &gl);
	if (grc == GLOB_NOMATCH)
		cr_skip_test("no models in %s", dir);
	cr_assert_eq(grc, 0);
	size_t checked = 0;
	for (size_t i = 0; i < gl.gl_pathc; i++) {
		char ref[4096];
		const char *p = gl.gl_pathv[i];
		size_t len = strlen(p);
		cr_assert(len > 5 && len < sizeof(ref));
		snprintf(ref, sizeof(ref), "%.*s.ref.txt", (int)(len - 5), p);
		if (access(ref, R_OK) != 0) {
			cr_log_warn("%s has no reference %s; skipped", p, ref);
			continue;
		}
		check_model(p, ref);
		checked++;
	}
	globfree(&gl);
	cr_assert(checked > 0, "no model with a reference in %s", dir);
}

Test(model, fidelity_all_testdata_models, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	check_dir(MODELS_DIR);
}

/* K-quant files as llama-quantize's recipes mix them (Q4_K_M: Q4_K with
 * Q6_K output and down matrices, ...), activations rounded to Q8_K. */
Test(model, fidelity_kquant_testdata_models, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	check_dir(KQUANT_DIR);
}

/* More prompts on the same files (tests/peer/MODEL.pTOKENS-sSEED.ref.txt:
 * llama.cpp's output for random prompts of 8 to 127 ids, made with
 * tests/peer/peer_logits.c, see the README there). A last-bit difference
 * in RoPE, softmax's exp or the value sum flips a Q8_0 or Q8_K rounding on
 * some prompts, not on the one in testdata: before nflash took llama.cpp's
 * float order for those, tiny-llama-q4_k_m.p8-s9 was 0.11 off. One way
 * each (the start-up table, batched; CI's arm64 run covers NEON). */
Test(model, fidelity_peer_prompts, .timeout = 240 * NF_TEST_SLOWDOWN)
{
	glob_t gl;
	cr_assert_eq(glob("tests/peer/*.ref.txt", 0, NULL, &gl), 0, "no tests/peer/*.ref.txt");
	for (size_t i = 0; i < gl.gl_pathc; i++) {
		const char *ref = gl.gl_pathv[i], *base = strrchr(ref, '/') + 1, *dot = strstr(base, ".p");
		cr_assert(dot, "%s: not MODEL.pN-sS.ref.txt", ref);
		char gguf[4096];
		snprintf(gguf, sizeof(gguf), "%s/%.*s.gguf", MODELS_DIR, (int)(dot - base), base);
		if (access(gguf, R_OK) != 0)
			snprintf(gguf, sizeof(gguf), "%s/%.*s.gguf", KQUANT_DIR, (int)(dot - base), base);
		if (access(gguf, R_OK) != 0)
			cr_skip_test("%s: model not in ../shared/testdata", ref);
		/* MODEL.pN-sS-tbt.ref.txt: the peer fed the prompt token by token */
		check_model_how(gguf, ref, false, strstr(base, "-tbt.") != NULL);
	}
	cr_assert_geq(gl.gl_pathc, 7);
	globfree(&gl);
}

/*
 * Q4_1, Q5_0 and Q5_1 (llama-quantize's recipes of those names, and its
 * fallback for K-quant rows not a multiple of 256): kquant/tiny-llama-q6_k
 * requantized to each type by nflash's reference quantizers
 * (tests/util_requant.c), against llama.cpp's logits for that very file
 * (tests/peer/requant/NAME-as-TYPE.pN-sS[-tbt].ref.txt, made by
 * tests/peer/peer_logits.c with AMX compiled out: batches of Q5_0 take
 * llamafile's tinyBLAS there, the rest ggml's vec_dot).
 */
Test(model, fidelity_legacy_types, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	const char *src = KQUANT_DIR "/tiny-llama-q6_k.gguf";
	if (access(src, R_OK) != 0)
		cr_skip_test("no %s", src);
	glob_t gl;
	cr_assert_eq(glob("tests/peer/requant/*.ref.txt", 0, NULL, &gl), 0, "no tests/peer/requant/*.ref.txt");
	for (size_t i = 0; i < gl.gl_pathc; i++) {
		const char *ref = gl.gl_pathv[i], *as = strstr(ref, "-as-"), *dot = as ? strstr(as, ".p") : NULL;
		cr_assert(dot, "%s: not NAME-as-TYPE.pN-sS.ref.txt", ref);
		char type[16], gguf[64];
		snprintf(type, sizeof(type), "%.*s", (int)(dot - as - 4), as + 4);
		int t = nf_dtype_parse(type);
		cr_assert(t >= 0, "%s: unknown type '%s'", ref, type);
		snprintf(gguf, sizeof(gguf), "/tmp/nflash-test-requant-%d-%s.gguf", (int)getpid(), type);
		struct nf_diag d = { 0 };
		cr_assert_eq(nf_test_requant_gguf(src, gguf, (uint32_t)t, &d), 0, "%s", d.msg);
		check_model_how(gguf, ref, false, strstr(dot, "-tbt.") != NULL);
		unlink(gguf);
	}
	cr_assert_geq(gl.gl_pathc, 9);
	globfree(&gl);
}

/* A real, trained model (llama2.c's stories260K): 5 layers, 8 heads over 4
 * KV heads, vocabulary 512, a 17-token prompt with BOS. */
Test(model, fidelity_real_testdata_models, .timeout = 120 * NF_TEST_SLOWDOWN)
{
	check_dir("../shared/testdata/real");
}

/*
 * Matrices repacked into 8-row groups (nf_model_repack; Q4_0, Q8_0 and the
 * K-quants Q4_K, Q5_K, Q6_K): the same logits, bit for bit, as the plain
 * rows, batched and token by token, on 1 and 2 threads, with every table
 * (a table without the grouped kernels uses the best one's for packed
 * matrices), and the reference's greedy tokens. name is DIR/NAME without
 * .gguf; all: every matrix is of a repackable type (else at least one per
 * layer).
 */
static void check_repacked(const char *name, bool all)
{
	struct nf_ref r;
	char path[256], refp[256];
	snprintf(path, sizeof(path), "%s.gguf", name);
	snprintf(refp, sizeof(refp), "%s.ref.txt", name);
	if (access(path, R_OK) != 0)
		cr_skip_test("%s is absent", path);
	cr_assert_eq(nf_ref_load(refp, &r, NULL), 0);
	struct nf_model *plain = load(path), *packed = load(path);
	int n = nf_model_repack(packed, NF_REPACK_ATTN | NF_REPACK_FFN | NF_REPACK_OUTPUT);
	cr_assert_geq(n, 0, "nf_model_repack: %d", n);
	int kt = nf_model_layer(packed, 0)->wq.kt;
	if (!nf_kernels_get()->gemv_x8[kt]) {
		cr_assert_eq(n, 0, "repacked without kernels for it");
		cr_skip_test("the %s table has no 8-row kernels for %s", nf_kernels_get()->isa, name);
	}
	const struct nf_model_hparams *hp = nf_model_hparams(packed);
	if (all)
		cr_assert_eq(n, (int)hp->n_layer * 7 + 1, "%s: repacked %d matrices", name, n);
	else
		cr_assert_geq(n, (int)hp->n_layer, "%s: repacked %d matrices", name, n);
	cr_assert(nf_model_layer(packed, 0)->wq.packed && !nf_model_layer(plain, 0)->wq.packed);
	cr_assert_eq(nf_model_repack(packed, NF_REPACK_ATTN), 0, "a second repack must be a no-op");
	uint32_t nv = hp->n_vocab;
	float *la = malloc(nv * sizeof(float)), *lb = malloc(nv * sizeof(float));
	int32_t *ga = malloc(r.n_greedy * sizeof(int32_t)), *gb = malloc(r.n_greedy * sizeof(int32_t));
	cr_assert(la && lb && ga && gb);
	for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
		const struct nf_kernels *k = nf_kernels_isa(isas[ii]);
		if (!k)
			continue;
		for (int threads = 1; threads <= 2; threads++)
			for (int batched = 1; batched >= 0; batched--) {
				struct nf_ctx *c = open_ctx(plain, k, threads, 512, NF_KV_F32);
				run(c, &r, batched, la, ga, r.n_greedy, nv);
				nf_ctx_close(c);
				c = open_ctx(packed, k, threads, 512, NF_KV_F32);
				run(c, &r, batched, lb, gb, r.n_greedy, nv);
				nf_ctx_close(c);
				for (uint32_t i = 0; i < nv; i++)
					cr_assert(!memcmp(&la[i], &lb[i], sizeof(float)),
						  "%s [%s, %d threads, %s] logit %u: packed %.9g, plain %.9g", name,
						  k->isa, threads, batched ? "batched" : "token by token", i, lb[i], la[i]);
				for (size_t i = 0; i < r.n_greedy; i++)
					cr_expect_eq(gb[i], r.greedy[i], "%s [%s] greedy token %zu: %d, reference %d",
						     name, k->isa, i, gb[i], r.greedy[i]);
			}
	}
	free(la);
	free(lb);
	free(ga);
	free(gb);
	nf_model_free(plain);
	nf_model_free(packed);
	nf_ref_free(&r);
}

Test(model, repacked_q4_0_same_bits, .timeout = 60) { check_repacked(MODELS_DIR "/tiny-llama-q4_0", true); }
Test(model, repacked_q8_0_same_bits, .timeout = 60) { check_repacked(MODELS_DIR "/tiny-llama-q8_0", true); }
Test(model, repacked_q4_k_m_same_bits, .timeout = 60 * NF_TEST_SLOWDOWN)
{
	check_repacked(KQUANT_DIR "/tiny-llama-q4_k_m", false);
}
Test(model, repacked_q5_k_m_same_bits, .timeout = 60 * NF_TEST_SLOWDOWN)
{
	check_repacked(KQUANT_DIR "/tiny-llama-q5_k_m", false);
}
Test(model, repacked_q6_k_same_bits, .timeout = 60 * NF_TEST_SLOWDOWN)
{
	check_repacked(KQUANT_DIR "/tiny-llama-q6_k", false);
}

Test(model, f16_kv_cache_close_to_f32)
{
	struct nf_ref r;
	char path[] = MODELS_DIR "/tiny-llama-f32.gguf";
	if (access(path, R_OK) != 0)
		cr_skip_test("%s is absent", path);
	cr_assert_eq(nf_ref_load(MODELS_DIR "/tiny-llama-f32.ref.txt", &r, NULL), 0);
	struct nf_model *m = load(path);
	uint32_t nv = nf_model_hparams(m)->n_vocab;
	float lg32[512], lg16[512];
	int32_t g32[16], g16[16];
	cr_assert(nv <= 512);
	struct nf_ctx *c = open_ctx(m, NULL, 1, 512, NF_KV_F32);
	run(c, &r, true, lg32, g32, 4, nv);
	nf_ctx_close(c);
	c = open_ctx(m, NULL, 1, 512, NF_KV_F16);
	run(c, &r, true, lg16, g16, 4, nv);
	nf_ctx_close(c);
	size_t at;
	double md = max_diff(lg32, lg16, nv, &at);
	cr_expect(md > 0, "an F16 cache should round something");
	cr_expect(md < 0.05, "F16 cache differs from F32 by %.3g at %zu", md, at);
	nf_model_free(m);
	nf_ref_free(&r);
}

Test(model, powerinfer_file_runs_dense)
{
	if (access(PWRI_MODEL, R_OK) != 0)
		cr_skip_test("%s is absent", PWRI_MODEL);
	struct nf_model *m = load(PWRI_MODEL);
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	cr_assert(hp->powerinfer);
	cr_assert_eq(hp->act, NF_FFN_RELU);
	const struct nf_layer_weights *L = nf_model_layer(m, 0);
	cr_assert_null(L->down.data);
	cr_assert_not_null(L->down_t.data);
	cr_assert_eq(L->down_t.nrows, hp->n_ff);
	cr_assert_not_null(L->fc1.data);
	cr_assert_eq(L->fc2.nrows, hp->n_ff);

	struct nf_ref r = { 0 };
	int32_t ids[8] = { 1, 278, 263, 13, 300, 72, 101, 259 };
	r.input = ids;
	r.n_input = 8;
	uint32_t nv = hp->n_vocab;
	float *a = malloc(nv * sizeof(float)), *b = malloc(nv * sizeof(float));
	int32_t ga[8], gb[8];
	struct nf_ctx *c = open_ctx(m, NULL, 1, 512, NF_KV_F32);
	run(c, &r, true, a, ga, 8, nv);
	nf_ctx_close(c);
	c = open_ctx(m, NULL, 2, 512, NF_KV_F32);
	run(c, &r, false, b, gb, 8, nv);
	nf_ctx_close(c);
	size_t at;
	for (uint32_t i = 0; i < nv; i++)
		cr_assert(isfinite(a[i]), "logit %u is not finite", i);
	double md = max_diff(a, b, nv, &at);
	cr_expect(md <= MODE_TOL, "batched/1 thread vs token by token/2 threads: %.3g at %zu", md, at);
	cr_expect_arr_eq(ga, gb, sizeof(ga));
	/* Dense ReLU differs from PowerInfer's sparse output by up to 0.16
	 * (testdata/README.md); a broken FFN is much further off. */
	struct nf_ref pr;
	char refp[] = "../shared/testdata/powerinfer/tiny-relullama-ff1024-f32.pwri.ref.txt";
	if (nf_ref_load(refp, &pr, NULL) == 0) {
		md = max_diff(a, pr.logits, nv, &at);
		cr_expect(md < 0.5, "dense differs from the sparse reference by %.3g at %zu", md, at);
		nf_ref_free(&pr);
	}
	free(a);
	free(b);
	nf_model_free(m);
}

/* ---- small models written here -------------------------------------------- */

struct tiny_opts {
	const char *arch;
	const char *act;          /* nflash.ffn_activation, NULL: absent */
	const char *skip_tensor;  /* leave this tensor out */
	bool tied;                /* no output.weight */
	bool bad_norm_shape;
	float rope_scale;         /* rope.scaling.factor, 0: absent */
	float rope_freq;          /* rope_freqs.weight all this (<0: pair 3 is 0), 0: absent */
};

#define T_E 32
#define T_F 64
#define T_V 16

static uint64_t lcg(uint64_t *s)
{
	*s = *s * 6364136223846793005ull + 1442695040888963407ull;
	return *s >> 33;
}

static void write_tiny(const char *path, const struct tiny_opts *o)
{
	struct nf_gguf_writer *w;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_gguf_writer_kv_str(w, "general.architecture", o->arch ? o->arch : "llama"), 0);
	nf_gguf_writer_kv_u32(w, "llama.context_length", 64);
	nf_gguf_writer_kv_u32(w, "llama.embedding_length", T_E);
	nf_gguf_writer_kv_u32(w, "llama.block_count", 1);
	nf_gguf_writer_kv_u32(w, "llama.feed_forward_length", T_F);
	nf_gguf_writer_kv_u32(w, "llama.attention.head_count", 2);
	nf_gguf_writer_kv_u32(w, "llama.attention.head_count_kv", 1);
	nf_gguf_writer_kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
	if (o->rope_scale > 0)
		nf_gguf_writer_kv_f32(w, "llama.rope.scaling.factor", o->rope_scale);
	if (o->act)
		nf_gguf_writer_kv_str(w, "nflash.ffn_activation", o->act);
	struct { const char *name; uint32_t nd; uint64_t ne[2]; } t[] = {
		{ "token_embd.weight", 2, { T_E, T_V } },
		{ "output_norm.weight", 1, { T_E, 1 } },
		{ "output.weight", 2, { T_E, T_V } },
		{ "blk.0.attn_norm.weight", 1, { o->bad_norm_shape ? T_E + 1 : T_E, 1 } },
		{ "blk.0.attn_q.weight", 2, { T_E, T_E } },
		{ "blk.0.attn_k.weight", 2, { T_E, T_E / 2 } },
		{ "blk.0.attn_v.weight", 2, { T_E, T_E / 2 } },
		{ "blk.0.attn_output.weight", 2, { T_E, T_E } },
		{ "blk.0.ffn_norm.weight", 1, { T_E, 1 } },
		{ "blk.0.ffn_gate.weight", 2, { T_E, T_F } },
		{ "blk.0.ffn_up.weight", 2, { T_E, T_F } },
		{ "blk.0.ffn_down.weight", 2, { T_F, T_E } },
		{ "rope_freqs.weight", 1, { T_E / 4, 1 } },
	};
	size_t nt = sizeof(t) / sizeof(t[0]) - (o->rope_freq == 0);
	bool keep[16];
	for (size_t i = 0; i < nt; i++) {
		keep[i] = !(o->skip_tensor && !strcmp(o->skip_tensor, t[i].name)) &&
			  !(o->tied && !strcmp(t[i].name, "output.weight"));
		if (keep[i])
			cr_assert_eq(nf_gguf_writer_tensor(w, t[i].name, NF_DTYPE_F32, t[i].nd, t[i].ne), 0);
	}
	uint64_t seed = 7;
	for (size_t i = 0; i < nt; i++) {
		if (!keep[i])
			continue;
		size_t n = t[i].ne[0] * t[i].ne[1];
		bool norm = t[i].nd == 1, freqs = !strcmp(t[i].name, "rope_freqs.weight");
		for (size_t j = 0; j < n; j++) {
			float v = freqs ? (o->rope_freq < 0 && j == 3 ? 0.0f : fabsf(o->rope_freq)) :
				  norm ? 1.0f : ((float)(lcg(&seed) % 2001) / 1000.0f - 1.0f) * 0.3f;
			cr_assert_eq(nf_gguf_writer_write(w, &v, sizeof(v)), 0);
		}
	}
	cr_assert_eq(nf_gguf_writer_finish(w, &d), 0, "%s", d.msg);
}

static int try_load(const struct tiny_opts *o, struct nf_model **m, struct nf_diag *d)
{
	char path[] = "/tmp/nflash-model-test-XXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0);
	close(fd);
	write_tiny(path, o);
	int rc = nf_model_load(path, NULL, m, d);
	unlink(path);
	return rc;
}

static void tiny_logits(const struct tiny_opts *o, float *lg)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	int rc = try_load(o, &m, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_ctx *c = open_ctx(m, NULL, 1, 8, NF_KV_F32);
	int32_t ids[5] = { 1, 5, 9, 2, 15 };
	cr_assert_eq(nf_ctx_eval(c, ids, 5), 0);
	memcpy(lg, nf_ctx_logits(c), T_V * sizeof(float));
	nf_ctx_close(c);
	nf_model_free(m);
}

Test(model, activation_from_metadata)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	const char *names[] = { NULL, "silu", "relu", "drelu" };
	enum nf_ffn_act want[] = { NF_FFN_SILU, NF_FFN_SILU, NF_FFN_RELU, NF_FFN_DRELU };
	float lg[4][T_V];
	for (int i = 0; i < 4; i++) {
		struct tiny_opts o = { .act = names[i] };
		cr_assert_eq(try_load(&o, &m, &d), 0, "%s", d.msg);
		cr_assert_eq(nf_model_hparams(m)->act, want[i]);
		nf_model_free(m);
		tiny_logits(&o, lg[i]);
	}
	cr_assert_arr_eq(lg[0], lg[1], sizeof(lg[0]));
	size_t at;
	cr_assert(max_diff(lg[1], lg[2], T_V, &at) > 1e-4, "relu gave silu's logits");
	cr_assert(max_diff(lg[2], lg[3], T_V, &at) > 1e-4, "drelu gave relu's logits");
	struct tiny_opts bad = { .act = "gelu" };
	cr_assert_eq(try_load(&bad, &m, &d), NF_EUNSUPPORTED);
	cr_assert(strstr(d.msg, "nflash.ffn_activation"), "%s", d.msg);
}

Test(model, errors_name_the_key_or_tensor)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	struct tiny_opts o = { .arch = "gpt2" };
	cr_assert_eq(try_load(&o, &m, &d), NF_EUNSUPPORTED);
	cr_assert(strstr(d.msg, "general.architecture"), "%s", d.msg);
	d = (struct nf_diag){ 0 };
	o = (struct tiny_opts){ .skip_tensor = "blk.0.ffn_up.weight" };
	cr_assert_eq(try_load(&o, &m, &d), NF_ENOTFOUND);
	cr_assert(strstr(d.msg, "blk.0.ffn_up.weight"), "%s", d.msg);
	d = (struct nf_diag){ 0 };
	o = (struct tiny_opts){ .bad_norm_shape = true };
	cr_assert_eq(try_load(&o, &m, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "blk.0.attn_norm.weight"), "%s", d.msg);
	cr_assert_null(m);
}

Test(model, tied_embeddings_and_rope_scale)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	struct tiny_opts o = { .tied = true, .rope_scale = 4.0f };
	cr_assert_eq(try_load(&o, &m, &d), 0, "%s", d.msg);
	cr_assert_float_eq(nf_model_hparams(m)->rope_freq_scale, 0.25f, 1e-7);
	nf_model_free(m);
	float a[T_V], b[T_V];
	tiny_logits(&o, a);
	o.rope_scale = 0;
	tiny_logits(&o, b);
	size_t at;
	cr_assert(max_diff(a, b, T_V, &at) > 1e-5, "rope scaling had no effect");
}

/* LLaMA 3.1's rope_freqs.weight divides each pair's angle by its factor:
 * factors of 2 are linear scaling by 2 (both halve the angle exactly, so
 * the same bits); a zero factor is refused, naming the tensor. */
Test(model, rope_freq_factors)
{
	float a[T_V], b[T_V], c[T_V];
	struct tiny_opts o = { .rope_freq = 2.0f };
	tiny_logits(&o, a);
	o = (struct tiny_opts){ .rope_scale = 2.0f };
	tiny_logits(&o, b);
	o = (struct tiny_opts){ 0 };
	tiny_logits(&o, c);
	cr_assert_arr_eq(a, b, sizeof(a), "factors of 2 differ from linear scaling by 2");
	size_t at;
	cr_assert(max_diff(a, c, T_V, &at) > 1e-5, "rope_freqs had no effect");
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	o = (struct tiny_opts){ .rope_freq = -1.0f };
	cr_assert_eq(try_load(&o, &m, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "rope_freqs.weight") && strstr(d.msg, "factor 3"), "%s", d.msg);
	cr_assert_null(m);
}

/* ---- the FFN seam -------------------------------------------------------------- */

struct counting_ffn {
	struct nf_ctx *c;
	int calls;
	int fail;
};

static int counting_forward(void *self, const struct nf_ffn_env *env, const struct nf_ffn_io *io)
{
	struct counting_ffn *f = self;
	cr_assert_not_null(env->k);
	cr_assert_not_null(env->model);
	f->calls++;
	if (f->fail)
		return f->fail;
	return nf_ctx_ffn_builtin(f->c, io);
}

Test(model, ffn_seam_replaces_a_layer)
{
	float base[T_V], via[T_V];
	struct tiny_opts o = { 0 };
	tiny_logits(&o, base);
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(try_load(&o, &m, &d), 0);
	struct nf_ctx *c = open_ctx(m, NULL, 2, 8, NF_KV_F32);
	struct counting_ffn f = { .c = c };
	static const struct nf_ffn_ops ops = { .name = "counting", .forward = counting_forward };
	cr_assert_eq(nf_ctx_set_ffn(c, 0, &ops, &f), 0);
	cr_assert_eq(nf_ctx_set_ffn(c, 1, &ops, &f), NF_EUSAGE);
	int32_t ids[5] = { 1, 5, 9, 2, 15 };
	cr_assert_eq(nf_ctx_eval(c, ids, 5), 0);
	memcpy(via, nf_ctx_logits(c), sizeof(via));
	cr_assert_eq(f.calls, 1);
	size_t at;
	cr_assert(max_diff(base, via, T_V, &at) <= MODE_TOL);
	f.fail = NF_EBUDGET;
	cr_assert_eq(nf_ctx_eval(c, ids, 1), NF_EBUDGET);
	nf_ctx_reset(c);
	cr_assert_eq(nf_ctx_n_past(c), 0);
	int32_t bad = T_V;
	cr_assert_eq(nf_ctx_eval(c, &bad, 1), NF_EUSAGE);
	nf_ctx_close(c);
	nf_model_free(m);
}

Test(model, context_overflow_is_refused)
{
	struct tiny_opts o = { 0 };
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	cr_assert_eq(try_load(&o, &m, &d), 0);
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = 4;
	cp.n_threads = 1;
	struct nf_ctx *c;
	cr_assert_eq(nf_ctx_open(m, &cp, &c, &d), 0);
	int32_t ids[5] = { 1, 2, 3, 4, 5 };
	cr_assert_eq(nf_ctx_eval(c, ids, 5), NF_EBUDGET);
	cr_assert_eq(nf_ctx_n_past(c), 0);
	cr_assert_eq(nf_ctx_eval(c, ids, 4), 0);
	cr_assert_eq(nf_ctx_eval(c, ids, 1), NF_EBUDGET);
	nf_ctx_close(c);
	nf_model_free(m);
}

Test(model, ref_parser_rejects_bad_files)
{
	char path[] = "/tmp/nflash-ref-test-XXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0);
	const char *txt = "n_input 2\n1 2\nn_vocab 3\n0.5\nbogus\n1\nn_greedy 1\n0\n";
	cr_assert_eq(write(fd, txt, strlen(txt)), (ssize_t)strlen(txt));
	close(fd);
	struct nf_ref r;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_ref_load(path, &r, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "logit 1"), "%s", d.msg);
	cr_assert_null(r.logits);
	unlink(path);
	cr_assert_lt(nf_ref_load("/nonexistent/x.ref.txt", &r, NULL), 0);
}
