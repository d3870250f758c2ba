/*
 * bench_decode.c - decode and prefill speed of the dense forward pass on a
 * LLaMA-7B-shaped Q4_0 model with random weights, in memory, 2 threads.
 *
 * Shape: n_embd 4096, n_ff 11008, 32 heads (32 KV heads), 32 layers,
 * vocab 32000; every matrix (embedding and output included) Q4_0, norms
 * F32. Weights are normal(0, 0.02) values quantized to Q4_0, so every
 * activation stays finite. The file (3.8 GB) is written once with the
 * GGUF writer to $NFLASH_BENCH_MODEL (default /tmp/nflash-bench-7b-q4_0.gguf)
 * and reused while it loads with the expected shape.
 *
 * Rows: decode tokens/s (one token per eval from an empty cache, after a
 * warm-up token) and prefill tokens/s (one eval of 512 tokens, batched),
 * each the median of NFLASH_BENCH_REPEATS runs (default 3). Decode reads
 * every weight once per token, so its row also gives that traffic in GB/s
 * beside a plain memory read by as many threads, measured before each run
 * (the machine is shared: the ratio is what compares across runs), and
 * cpu_tok_per_s: tokens per second of the process's CPU time divided by
 * the thread count, what the run would do with the CPUs to itself (spinning
 * workers count as busy, so it errs low).
 *
 * Environment: NFLASH_BENCH_THREADS (default 2), NFLASH_BENCH_DECODE
 * (tokens per decode run, default 32), NFLASH_BENCH_PREFILL (default 512;
 * 0: no prefill rows),
 * NFLASH_BENCH_KV (f16, the default of `nflash generate` and llama-bench, or
 * f32: the KV cache's type),
 * NFLASH_ISA (kernel table), NFLASH_BENCH_REPACK=0 (keep Q4_0/Q8_0 rows plain
 * instead of nf_model_repack's 8-row groups, for A/B runs),
 * NFLASH_BENCH_MODEL (an existing file is used if it has the 7B shape,
 * Q4_0, Q8_0 or K-quants such as llama-quantize's Q4_K_M mix, e.g.
 * `nflash synth --shape 7b --dtype q4_0
 * --no-predictor`; never overwritten), LLAMA_BENCH (path of llama.cpp's
 * llama-bench: each nflash run is followed by one llama-bench run on the
 * same file, `-t THREADS -p 0 -n DECODE` or `-p PREFILL -n 0`, and rows
 * "llama.cpp" and the ratio of the medians follow nflash's),
 * NFLASH_BENCH_SPARSE (1: predictor mode, the sparse FFN in memory, as
 * `nflash generate --sparse-mode predictor` runs a GGUF it holds; default
 * 1 for a file with PowerInfer predictors such as `nflash synth --shape 7b`
 * without --no-predictor, else 0).
 *
 * Predictor mode (row "sparse_decode"): a token reads the dense weights
 * (attention, output, predictors, norms: nf_model_step_dense_bytes) and,
 * of the FFN, only the rows of the neurons it activates (gate, up and
 * down_t rows); the engine's counters give the active fraction over the
 * run. Bytes touched per token divided by the memory-read GB/s measured
 * before each run is the bandwidth limit; the ratio column is tok/s times
 * the bytes per token over the memory read, i.e. the fraction of that
 * limit reached. llama.cpp refuses predictor files: no peer row.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/kernels.h"
#include "nflash/model.h"
#include "nflash/pool.h"
#include "nflash/sparse.h"
#include "bench_common.h"

#define B_EMBD 4096u
#define B_FF 11008u
#define B_HEAD 32u
#define B_LAYER 32u
#define B_VOCAB 32000u
#define B_STD 0.02f

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static long env_long(const char *name, long def)
{
	const char *s = getenv(name);
	return s && *s ? strtol(s, NULL, 10) : def;
}

/* Approximately normal values: Irwin-Hall sum of 4 uniform bytes,
 * centred and scaled to standard deviation std. */
static void fill_normal(uint64_t *s, float *x, size_t n, float std)
{
	const float scale = std / sqrtf(4.0f * (256.0f * 256.0f - 1.0f) / 12.0f);
	for (size_t i = 0; i < n; i += 2) {
		*s ^= *s << 13;
		*s ^= *s >> 7;
		*s ^= *s << 17;
		uint64_t r = *s;
		int a = (int)(r & 255) + (int)((r >> 8) & 255) + (int)((r >> 16) & 255) + (int)((r >> 24) & 255);
		int b = (int)((r >> 32) & 255) + (int)((r >> 40) & 255) + (int)((r >> 48) & 255) + (int)(r >> 56);
		x[i] = (float)(a - 510) * scale;
		if (i + 1 < n)
			x[i + 1] = (float)(b - 510) * scale;
	}
}

struct btensor {
	char name[64];
	uint32_t type, nd;
	uint64_t ne[2];
};

static int write_model(const char *path)
{
	struct btensor *t = calloc(3 + 9 * B_LAYER, sizeof(*t));
	size_t nt = 0;
	if (!t)
		return -ENOMEM;
#define ADD(nm, ty, d, a, b) (snprintf(t[nt].name, sizeof(t[nt].name), "%s", nm), t[nt].type = ty, \
			      t[nt].nd = d, t[nt].ne[0] = a, t[nt].ne[1] = b, nt++)
	ADD("token_embd.weight", NF_DTYPE_Q4_0, 2, B_EMBD, B_VOCAB);
	for (uint32_t il = 0; il < B_LAYER; il++) {
		char nm[64];
		struct { const char *s; uint32_t ty, nd; uint64_t a, b; } L[] = {
			{ "attn_norm", NF_DTYPE_F32, 1, B_EMBD, 1 },
			{ "attn_q", NF_DTYPE_Q4_0, 2, B_EMBD, B_EMBD },
			{ "attn_k", NF_DTYPE_Q4_0, 2, B_EMBD, B_EMBD },
			{ "attn_v", NF_DTYPE_Q4_0, 2, B_EMBD, B_EMBD },
			{ "attn_output", NF_DTYPE_Q4_0, 2, B_EMBD, B_EMBD },
			{ "ffn_norm", NF_DTYPE_F32, 1, B_EMBD, 1 },
			{ "ffn_gate", NF_DTYPE_Q4_0, 2, B_EMBD, B_FF },
			{ "ffn_up", NF_DTYPE_Q4_0, 2, B_EMBD, B_FF },
			{ "ffn_down", NF_DTYPE_Q4_0, 2, B_FF, B_EMBD },
		};
		for (size_t k = 0; k < sizeof(L) / sizeof(L[0]); k++) {
			snprintf(nm, sizeof(nm), "blk.%u.%s.weight", il, L[k].s);
			ADD(nm, L[k].ty, L[k].nd, L[k].a, L[k].b);
		}
	}
	ADD("output_norm.weight", NF_DTYPE_F32, 1, B_EMBD, 1);
	ADD("output.weight", NF_DTYPE_Q4_0, 2, B_EMBD, B_VOCAB);
#undef ADD

	struct nf_gguf_writer *w = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_gguf_writer_open(path, false, &w, &d);
	if (rc < 0) {
		fprintf(stderr, "bench_decode: %s\n", nf_diag_msg(&d, rc));
		free(t);
		return rc;
	}
	nf_gguf_writer_kv_str(w, "general.architecture", "llama");
	nf_gguf_writer_kv_str(w, "general.name", "nflash-bench-7b-q4_0");
	nf_gguf_writer_kv_u32(w, "llama.context_length", 4096);
	nf_gguf_writer_kv_u32(w, "llama.embedding_length", B_EMBD);
	nf_gguf_writer_kv_u32(w, "llama.block_count", B_LAYER);
	nf_gguf_writer_kv_u32(w, "llama.feed_forward_length", B_FF);
	nf_gguf_writer_kv_u32(w, "llama.attention.head_count", B_HEAD);
	nf_gguf_writer_kv_u32(w, "llama.attention.head_count_kv", B_HEAD);
	nf_gguf_writer_kv_f32(w, "llama.rope.freq_base", 10000.0f);
	nf_gguf_writer_kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
	nf_gguf_writer_kv_u32(w, "llama.vocab_size", B_VOCAB);
	nf_gguf_writer_kv_u32(w, "general.file_type", 2);
	for (size_t i = 0; i < nt && rc == 0; i++)
		rc = nf_gguf_writer_tensor(w, t[i].name, t[i].type, t[i].nd, t[i].ne);

	size_t maxrow = B_FF;
	float *x = malloc(maxrow * sizeof(float));
	void *q = malloc(nf_dtype_row_size(NF_DTYPE_F32, maxrow));
	uint64_t seed = 0x9e3779b97f4a7c15ull;
	double t0 = now();
	for (size_t i = 0; i < nt && rc == 0 && x && q; i++) {
		size_t n = t[i].ne[0], rows = t[i].ne[1];
		size_t rb = nf_dtype_row_size(t[i].type, n);
		for (size_t r = 0; r < rows && rc == 0; r++) {
			if (t[i].type == NF_DTYPE_F32) {
				for (size_t k = 0; k < n; k++)
					x[k] = 1.0f;
				rc = nf_gguf_writer_write(w, x, rb);
			} else {
				fill_normal(&seed, x, n, B_STD);
				nf_quantize_row(t[i].type, x, q, n);
				rc = nf_gguf_writer_write(w, q, rb);
			}
		}
		if (isatty(2))
			fprintf(stderr, "\rbench_decode: writing %s: %zu/%zu tensors", path, i + 1, nt);
	}
	if (isatty(2))
		fprintf(stderr, "\n");
	if (!x || !q)
		rc = -ENOMEM;
	free(x);
	free(q);
	free(t);
	if (rc < 0) {
		nf_gguf_writer_abort(w);
		fprintf(stderr, "bench_decode: writing %s: %s\n", path, nf_strerror(rc));
		return rc;
	}
	rc = nf_gguf_writer_finish(w, &d);
	if (rc < 0)
		fprintf(stderr, "bench_decode: %s\n", nf_diag_msg(&d, rc));
	else
		fprintf(stderr, "bench_decode: wrote %s in %.1f s\n", path, now() - t0);
	return rc;
}

static bool shape_ok(const struct nf_model *m)
{
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	uint32_t t = nf_model_layer(m, 0)->wq.dtype;
	return hp->n_embd == B_EMBD && hp->n_ff == B_FF && hp->n_head == B_HEAD &&
	       hp->n_layer == B_LAYER && hp->n_vocab == B_VOCAB &&
	       (t == NF_DTYPE_Q4_0 || t == NF_DTYPE_Q8_0 || nf_dtype_is_kquant(t));
}

/* Bytes of every layer's FFN rows the sparse FFN gathers: gate, up and
 * down_t (PowerInfer's transposed down: row j is neuron j's column). */
static uint64_t ffn_bytes(const struct nf_model *m)
{
	uint64_t b = 0;
	for (uint32_t il = 0; il < nf_model_hparams(m)->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		const struct nf_weight *dn = L->down_t.data ? &L->down_t : &L->down;
		b += (uint64_t)L->gate.nrows * L->gate.row_bytes + (uint64_t)L->up.nrows * L->up.row_bytes +
		     (uint64_t)dn->nrows * dn->row_bytes;
	}
	return b;
}

/* ---- memory-read peer: the same number of threads summing a buffer ---- */

#define MEMREAD_BYTES (512ull << 20)

struct read_job {
	const char *buf;
	size_t bytes;
	uint64_t sink[64];
};

static void read_fn(void *arg, int ith, int nth)
{
	struct read_job *j = arg;
	size_t chunk = j->bytes / (size_t)nth & ~(size_t)255;
	j->sink[ith & 63] += nf_bench_memsum(j->buf + chunk * (size_t)ith, chunk);
}

/* GB/s of one pass over the buffer. */
static double memread(struct nf_pool *p, struct read_job *j)
{
	double t0 = now();
	nf_pool_run(p, read_fn, j);
	return j->bytes / (now() - t0) / 1e9;
}

/* One row: median, min and max of reps tokens/s figures (sorts tps). */
static void report(const char *phase, size_t tokens, const struct nf_ctx *c, double *tps,
		   double *ctps, int reps, double weight_gb, double memread_gbs)
{
	double med = nf_bench_median(tps, (size_t)reps), cmed = nf_bench_median(ctps, (size_t)reps);
	printf("%s\t%zu\t%d\t%s\t%.3f\t%.3f\t%.3f\t%.1f\t%.3f", phase, tokens, nf_ctx_n_threads(c),
	       nf_ctx_kernels(c)->isa, med, tps[0], tps[reps - 1], 1e3 / med, cmed);
	if (weight_gb > 0)
		printf("\t%.2f\t%.2f\t%.2f\n", med * weight_gb, memread_gbs, med * weight_gb / memread_gbs);
	else
		printf("\t-\t-\t-\n");
	fflush(stdout);
}

/* The peer's row (llama-bench, runs interleaved with nflash's) and the
 * ratio of the medians; sorts both arrays. */
static void report_llama(const char *phase, size_t tokens, int threads, double *ltps, int lreps,
			 double *tps, int reps, double weight_gb, double memread_gbs)
{
	if (lreps < 1)
		return;
	double med = nf_bench_median(ltps, (size_t)lreps), ours = nf_bench_median(tps, (size_t)reps);
	printf("%s\t%zu\t%d\tllama.cpp\t%.3f\t%.3f\t%.3f\t%.1f\t-", phase, tokens, threads, med, ltps[0],
	       ltps[lreps - 1], 1e3 / med);
	if (weight_gb > 0)
		printf("\t%.2f\t%.2f\t%.2f\n", med * weight_gb, memread_gbs, med * weight_gb / memread_gbs);
	else
		printf("\t-\t-\t-\n");
	printf("# %s: nflash / llama.cpp = %.2f (medians of %d and %d interleaved runs)\n", phase, ours / med,
	       reps, lreps);
	fflush(stdout);
}

int main(int argc, char **argv)
{
	nf_bench_args(argc, argv,
		"usage: bench_decode\n"
		"\n"
		"Decode and prefill tokens/s of a LLaMA-7B-shaped model in memory (the dense\n"
		"forward pass, or predictor mode on a file with predictors), beside\n"
		"llama.cpp's llama-bench on the same file when LLAMA_BENCH is set.\n"
		"Without NFLASH_BENCH_MODEL it writes a 3.8 GB Q4_0 model to\n"
		"/tmp/nflash-bench-7b-q4_0.gguf first (once).\n"
		"\n"
		"Environment: NFLASH_BENCH_MODEL, NFLASH_BENCH_REPEATS (3),\n"
		"NFLASH_BENCH_DECODE (32), NFLASH_BENCH_PREFILL (512; 0: none),\n"
		"NFLASH_BENCH_THREADS (2), NFLASH_BENCH_REPACK (0: plain rows),\n"
		"NFLASH_BENCH_SPARSE, NFLASH_ISA, LLAMA_BENCH. The opening comment of\n"
		"bench/bench_decode.c says what each does; docs/KERNELS.md has runs.\n",
		NULL, 0);
	const char *path = getenv("NFLASH_BENCH_MODEL");
	if (!path || !*path)
		path = "/tmp/nflash-bench-7b-q4_0.gguf";
	int threads = (int)env_long("NFLASH_BENCH_THREADS", 2);
	int reps = (int)env_long("NFLASH_BENCH_REPEATS", 3);
	size_t n_dec = (size_t)env_long("NFLASH_BENCH_DECODE", 32);
	size_t n_pre = (size_t)env_long("NFLASH_BENCH_PREFILL", 512);
	if (threads < 1 || reps < 1 || n_dec < 1 || reps > 100) {
		fprintf(stderr, "bench_decode: bad NFLASH_BENCH_* setting\n");
		return 2;
	}

	bool given = getenv("NFLASH_BENCH_MODEL") && *getenv("NFLASH_BENCH_MODEL");
	const char *llama = getenv("LLAMA_BENCH");
	bool repack = env_long("NFLASH_BENCH_REPACK", 1) != 0;
	const char *kv = getenv("NFLASH_BENCH_KV") ? getenv("NFLASH_BENCH_KV") : "f16";
	if (strcmp(kv, "f16") != 0 && strcmp(kv, "f32") != 0) {
		fprintf(stderr, "bench_decode: NFLASH_BENCH_KV='%s': want f16 or f32\n", kv);
		return 2;
	}
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	if (access(path, R_OK) == 0 && nf_model_load(path, NULL, &m, &d) == 0 && !shape_ok(m)) {
		nf_model_free(m);
		m = NULL;
		if (given) {
			fprintf(stderr, "bench_decode: %s is not a LLaMA-7B-shaped Q4_0, Q8_0 or K-quant model; not overwritten\n",
				path);
			return 1;
		}
	}
	if (!m) {
		if (write_model(path) < 0)
			return 1;
		d = (struct nf_diag){ 0 };
		double t0 = now();
		int rc = nf_model_load(path, NULL, &m, &d);
		if (rc < 0) {
			fprintf(stderr, "bench_decode: %s\n", nf_diag_msg(&d, rc));
			return 1;
		}
		fprintf(stderr, "bench_decode: loaded in %.1f s\n", now() - t0);
	}

	bool has_pred = nf_model_layer(m, 0)->fc1.data != NULL;
	bool sparse = env_long("NFLASH_BENCH_SPARSE", has_pred) != 0;
	if (sparse && !has_pred) {
		fprintf(stderr, "bench_decode: NFLASH_BENCH_SPARSE=1: %s has no predictor (fc1/fc2)\n", path);
		return 1;
	}
	if (sparse)
		llama = NULL; /* llama.cpp refuses PowerInfer's predictor files */

	/* in memory with the built-in FFN: every Q4_0/Q8_0 matrix into 8-row
	 * groups where the kernels have them, as `nflash generate` does (the
	 * sparse FFN gathers plain rows: attention and output only) */
	int n_packed = 0;
	double t_pack = now();
	unsigned what = NF_REPACK_ATTN | NF_REPACK_OUTPUT | (sparse ? 0 : NF_REPACK_FFN);
	if (repack && (n_packed = nf_model_repack(m, what)) < 0) {
		fprintf(stderr, "bench_decode: repack: %s\n", nf_strerror(n_packed));
		return 1;
	}
	t_pack = now() - t_pack;

	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_threads = threads;
	cp.n_ctx = (uint32_t)(n_pre > n_dec + 1 ? n_pre : n_dec + 1);
	cp.n_batch = (uint32_t)(n_pre ? n_pre : 1);
	cp.kv_type = strcmp(kv, "f32") == 0 ? NF_KV_F32 : NF_KV_F16;
	struct nf_ctx *c = NULL;
	int rc = nf_ctx_open(m, &cp, &c, &d);
	if (rc < 0) {
		fprintf(stderr, "bench_decode: %s\n", nf_diag_msg(&d, rc));
		nf_model_free(m);
		return 1;
	}
	struct nf_sparse *sp = NULL;
	if (sparse) {
		struct nf_sparse_params spp;
		nf_sparse_params_init(&spp);
		spp.mode = NF_SPARSE_PREDICTOR;
		if ((rc = nf_sparse_open(c, &spp, &sp, &d)) < 0) {
			fprintf(stderr, "bench_decode: %s\n", nf_diag_msg(&d, rc));
			nf_ctx_close(c);
			nf_model_free(m);
			return 1;
		}
	}
	char extra[512];
	snprintf(extra, sizeof(extra),
		 "model %s (%.2f GB %s, LLaMA-7B shape), %s kernels, %d threads, %s KV, FFN %s, %d matrices "
		 "repacked in %.1f s; peer %s",
		 path, nf_model_weight_bytes(m) / 1e9, nf_dtype_name(nf_model_layer(m, 0)->wq.dtype),
		 nf_ctx_kernels(c)->isa, nf_ctx_n_threads(c), cp.kv_type == NF_KV_F32 ? "F32" : "F16", sparse ? "sparse (predictor mode)" : "dense",
		 n_packed, t_pack,
		 llama ? llama : sparse ? "none (llama.cpp refuses predictor files)" : "none (LLAMA_BENCH unset)");
	nf_bench_header("bench_decode", extra);

	size_t n_ids = n_pre > n_dec + 1 ? n_pre : n_dec + 1;
	int32_t *ids = malloc(n_ids * sizeof(int32_t));
	double *tps = malloc((size_t)reps * sizeof(double)), *ctps = malloc((size_t)reps * sizeof(double));
	double ltps[100];
	int nl = 0;
	uint64_t active = 0, total = 0;
	if (!ids || !tps || !ctps)
		return 1;
	uint64_t s = 12345;
	for (size_t i = 0; i < n_ids; i++) {
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		ids[i] = (int32_t)((s >> 33) % B_VOCAB);
	}

	struct nf_pool *rp = NULL;
	struct read_job *rj = calloc(1, sizeof(*rj));
	char *rbuf = aligned_alloc(4096, MEMREAD_BYTES);
	double *mr = malloc((size_t)reps * sizeof(double));
	if (!rj || !rbuf || !mr || nf_pool_open(threads, -1, &rp) < 0) {
		fprintf(stderr, "bench_decode: cannot set up the memory-read peer\n");
		return 1;
	}
	memset(rbuf, 1, MEMREAD_BYTES);
	rj->buf = rbuf;
	rj->bytes = MEMREAD_BYTES;
	double wgb = nf_model_weight_bytes(m) / 1e9;

	/* decode reads every weight once per token: weight_GB_per_s is that
	 * traffic, beside a plain read of memory by as many threads, measured
	 * before each run (ratio = decode / memread). */
	printf("phase\ttokens\tthreads\tisa\ttok_per_s_median\ttok_per_s_min\ttok_per_s_max\t"
	       "ms_per_tok_median\tcpu_tok_per_s_median\tweight_GB_per_s\tmemread_GB_per_s\tratio\n");
	/* decode: warm-up token, then n_dec single-token evals */
	for (int r = 0; r < reps; r++) {
		mr[r] = memread(rp, rj);
		nf_ctx_reset(c);
		int32_t tok = ids[0];
		if ((rc = nf_ctx_eval(c, &tok, 1)) < 0)
			break;
		if (sp)
			nf_sparse_stats_reset(sp);
		double t0 = now(), c0 = cpu_now();
		for (size_t i = 0; i < n_dec && rc == 0; i++) {
			tok = ids[i + 1];
			rc = nf_ctx_eval(c, &tok, 1);
		}
		tps[r] = n_dec / (now() - t0);
		ctps[r] = n_dec * nf_ctx_n_threads(c) / (cpu_now() - c0);
		if (sp) {
			struct nf_sparse_stats st;
			nf_sparse_stats_get(sp, &st);
			active += st.neurons_active;
			total += st.neurons_total;
		}
		fprintf(stderr, "bench_decode: decode run %d: %.3f tok/s\n", r + 1, tps[r]);
		if (llama && nf_bench_llama(llama, path, threads, 0, (int)n_dec, &ltps[nl]) == 0)
			fprintf(stderr, "bench_decode: llama.cpp decode run %d: %.3f tok/s\n", r + 1, ltps[nl++]);
	}
	if (rc == 0) {
		double mrm = nf_bench_median(mr, (size_t)reps);
		double tcopy[100];
		memcpy(tcopy, tps, (size_t)reps * sizeof(double));
		if (sp) {
			/* bytes a token touches: the dense weights, and the rows of
			 * the FFN neurons it activated (the run's active fraction) */
			double frac = total ? (double)active / (double)total : 0;
			double dense = (double)nf_model_step_dense_bytes(m), ffn = (double)ffn_bytes(m);
			wgb = (dense + frac * ffn) / 1e9;
			report("sparse_decode", n_dec, c, tps, ctps, reps, wgb, mrm);
			double med = nf_bench_median(tcopy, (size_t)reps);
			printf("# sparse_decode: %.1f MB touched per token (dense %.1f MB + %.2f%% of the FFN's %.1f MB); "
			       "bandwidth limit %.2f tok/s at %.2f GB/s; nflash %.3f tok/s = %.2f of it\n",
			       wgb * 1e3, dense / 1e6, 100 * frac, ffn / 1e6, mrm / wgb, mrm, med, med * wgb / mrm);
		} else {
			report("decode", n_dec, c, tps, ctps, reps, wgb, mrm);
		}
		report_llama("decode", n_dec, threads, ltps, nl, tcopy, reps, wgb, mrm);
	}
	nl = 0;
	/* prefill: n_pre tokens in one batched eval (NFLASH_BENCH_PREFILL=0: none) */
	for (int r = 0; r < reps && rc == 0 && n_pre > 0; r++) {
		nf_ctx_reset(c);
		double t0 = now(), c0 = cpu_now();
		rc = nf_ctx_eval(c, ids, n_pre);
		tps[r] = n_pre / (now() - t0);
		ctps[r] = n_pre * nf_ctx_n_threads(c) / (cpu_now() - c0);
		fprintf(stderr, "bench_decode: prefill run %d: %.3f tok/s\n", r + 1, tps[r]);
		if (llama && nf_bench_llama(llama, path, threads, (int)n_pre, 0, &ltps[nl]) == 0)
			fprintf(stderr, "bench_decode: llama.cpp prefill run %d: %.3f tok/s\n", r + 1, ltps[nl++]);
	}
	if (rc == 0 && n_pre > 0) {
		double tcopy[100];
		memcpy(tcopy, tps, (size_t)reps * sizeof(double));
		report(sp ? "sparse_prefill" : "prefill", n_pre, c, tps, ctps, reps, 0, 0);
		report_llama("prefill", n_pre, threads, ltps, nl, tcopy, reps, 0, 0);
		float l0 = nf_ctx_logits(c)[0];
		if (!isfinite(l0)) {
			fprintf(stderr, "bench_decode: non-finite logits\n");
			rc = NF_EFORMAT;
		}
	}
	if (rc < 0)
		fprintf(stderr, "bench_decode: eval failed: %s\n", nf_strerror(rc));
	free(ids);
	free(tps);
	free(ctps);
	free(mr);
	free(rbuf);
	free(rj);
	nf_pool_close(rp);
	nf_sparse_close(sp);
	nf_ctx_close(c);
	nf_model_free(m);
	return rc < 0 ? 1 : 0;
}
