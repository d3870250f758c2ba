/*
 * synth.c - `nflash synth`: write a synthetic sparse model as GGUF, or
 * report the measured sparsity statistics of a model (--report).
 *
 * Invariants: every usage error names the flag; nothing is written under
 * the output name unless the whole file was generated (the GGUF writer
 * renames its temporary file only at the end); the free space of the
 * output's file system is checked before starting.
 */
#include <errno.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/synth.h"
#include "cli.h"

int nf_cmd_synth(int argc, char **argv);
int nf_synth_report_main(const char *path, uint32_t n_tokens, uint64_t seed, bool json,
			 int n_threads);

static void usage(FILE *f)
{
	fprintf(f,
		"usage: nflash synth --shape tiny|7b|13b|mixtral-8x7b|custom [options] -o FILE.gguf\n"
		"       nflash synth --report FILE.gguf [--tokens N] [--seed N] [--json]\n"
		"\n"
		"Writes a LLaMA-architecture model with random weights whose FFN neurons fire\n"
		"sparsely, with power-law skew, as real ReLU models do (docs/SYNTH.md).\n"
		"\n"
		"shape (overrides apply to any shape):\n"
		"  --shape NAME         tiny (default), 7b, 13b, mixtral-8x7b, custom\n"
		"  --dim D --ffn N --layers L --heads H --kv-heads K\n"
		"  --experts E --experts-used U --vocab V --ctx C\n"
		"  --vocab-file F.gguf  copy the tokenizer from F (default for 32000-token\n"
		"                       shapes: %s)\n"
		"model:\n"
		"  --activation A       relu (default), drelu, silu (key nflash.ffn_activation)\n"
		"  --sparsity S         share of FFN neurons that do not fire per token, in (0,1)\n"
		"                       (default 0.90)\n"
		"  --skew S             power-law exponent of firing probability by rank (default 1)\n"
		"  --dtype T            q4_0, q8_0, q2_k..q6_k (simple K-quant fits; dims multiples\n"
		"                       of 256), f16, f32 (default f32)\n"
		"  --seed N             (default 1); same arguments give the same bytes\n"
		"  --no-predictor       plain llama GGUF for llama.cpp (magic GGUF, ffn_down, no\n"
		"                       fc1/fc2); default is PowerInfer's flavour (PWRI,\n"
		"                       ffn_down_t, predictors blk.N.fc1/fc2)\n"
		"  --rank R             predictor width r (fc1: n_embd -> r), even (default 64)\n"
		"  -t, --threads N      generation threads (default 2)\n"
		"  -o FILE              output file\n"
		"report:\n"
		"  --report FILE        run the dense model over a seeded random token stream and\n"
		"                       print sparsity per layer, firing skew, overlap, predictor\n"
		"                       recall/precision\n"
		"  --tokens N           tokens to run (default 1000)\n"
		"  --json               machine-readable report\n",
		NF_SYNTH_LLAMA_VOCAB);
}

static void progress_cb(void *arg, uint64_t done, uint64_t total)
{
	(void)total;
	nf_progress_update(arg, done);
}

int nf_cmd_synth(int argc, char **argv)
{
	struct nf_synth_params p;
	struct nf_diag d = { 0 };
	const char *shape = "tiny", *out = NULL, *report = NULL, *vocab_file = NULL;
	long dim = -1, ffn = -1, layers = -1, heads = -1, kv = -1, experts = -1, used = -1;
	long vocab = -1, ctx = -1, rank = -1, threads = 2, tokens = 1000;
	bool json = false, seed_set = false;
	int rc;

	nf_synth_params_init(&p);
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v;
		long *lp = NULL;
		long lo = 1, hi = 1L << 30;
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(a, "--no-predictor")) {
			p.predictor = false;
			continue;
		} else if (!strcmp(a, "--json")) {
			json = true;
			continue;
		}
		if (!strcmp(a, "--dim")) lp = &dim;
		else if (!strcmp(a, "--ffn")) lp = &ffn;
		else if (!strcmp(a, "--layers")) lp = &layers;
		else if (!strcmp(a, "--heads")) lp = &heads;
		else if (!strcmp(a, "--kv-heads")) lp = &kv;
		else if (!strcmp(a, "--experts")) { lp = &experts; lo = 0; }
		else if (!strcmp(a, "--experts-used")) { lp = &used; lo = 0; }
		else if (!strcmp(a, "--vocab")) lp = &vocab;
		else if (!strcmp(a, "--ctx")) lp = &ctx;
		else if (!strcmp(a, "--rank")) lp = &rank;
		else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) { lp = &threads; hi = 256; }
		else if (!strcmp(a, "--tokens")) lp = &tokens;
		if (lp) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_int(a, v, lo, hi, lp) < 0)
				return NF_EXIT_USAGE;
			continue;
		}
		if (!strcmp(a, "--shape") || !strcmp(a, "-o") || !strcmp(a, "--output") ||
		    !strcmp(a, "--report") || !strcmp(a, "--vocab-file") ||
		    !strcmp(a, "--activation") || !strcmp(a, "--sparsity") ||
		    !strcmp(a, "--skew") || !strcmp(a, "--dtype") || !strcmp(a, "--seed")) {
			if (!(v = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
		} else {
			nf_cli_err("synth: unknown option '%s' (try 'nflash synth --help')", a);
			return NF_EXIT_USAGE;
		}
		if (!strcmp(a, "--shape")) {
			shape = v;
		} else if (!strcmp(a, "-o") || !strcmp(a, "--output")) {
			out = v;
		} else if (!strcmp(a, "--report")) {
			report = v;
		} else if (!strcmp(a, "--vocab-file")) {
			vocab_file = v;
		} else if (!strcmp(a, "--activation")) {
			int act = nf_synth_act_parse(v);
			if (act < 0) {
				nf_cli_err("--activation: unknown activation '%s' (expected relu, "
					   "drelu or silu)", v);
				return NF_EXIT_USAGE;
			}
			p.act = (enum nf_synth_act)act;
		} else if (!strcmp(a, "--sparsity")) {
			if (nf_cli_double(a, v, &p.sparsity) < 0)
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--skew")) {
			if (nf_cli_double(a, v, &p.skew) < 0)
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--dtype")) {
			int t = nf_dtype_parse(v);
			if (t < 0 || t == NF_DTYPE_BF16 || nf_dtype_is_legacy((uint32_t)t) || t == NF_DTYPE_Q8_1) {
				nf_cli_err("--dtype: unknown type '%s' (expected q4_0, q8_0, "
					   "q2_k..q6_k, f16 or f32)", v);
				return NF_EXIT_USAGE;
			}
			p.dtype = (uint32_t)t;
		} else if (!strcmp(a, "--seed")) {
			if (nf_cli_u64(a, v, &p.seed) < 0)
				return NF_EXIT_USAGE;
			seed_set = true;
		}
	}

	if (report) {
		if (out) {
			nf_cli_err("--report: reads a model; it does not take -o");
			return NF_EXIT_USAGE;
		}
		return nf_synth_report_main(report, (uint32_t)tokens, seed_set ? p.seed : 1, json,
					    (int)threads);
	}
	if (!out) {
		nf_cli_err("synth: -o FILE.gguf is required (try 'nflash synth --help')");
		return NF_EXIT_USAGE;
	}
	double sparsity = p.sparsity, skew = p.skew;
	if ((rc = nf_synth_shape(&p, shape, &d)) < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_USAGE;
	}
	p.sparsity = sparsity;
	p.skew = skew;
	if (dim >= 0) p.n_embd = (uint32_t)dim;
	if (ffn >= 0) p.n_ff = (uint32_t)ffn;
	if (layers >= 0) p.n_layer = (uint32_t)layers;
	if (heads >= 0) p.n_head = (uint32_t)heads;
	if (kv >= 0) p.n_head_kv = (uint32_t)kv;
	else if (heads >= 0 && !strcmp(shape, "custom")) p.n_head_kv = p.n_head;
	if (experts >= 0) p.n_expert = (uint32_t)experts;
	if (used >= 0) p.n_expert_used = (uint32_t)used;
	if (ctx >= 0) p.n_ctx = (uint32_t)ctx;
	if (rank >= 0) p.pred_rank = (uint32_t)rank;
	if (vocab >= 0) {
		p.n_vocab = (uint32_t)vocab;
		p.vocab_path = vocab == 32000 ? NF_SYNTH_LLAMA_VOCAB : NULL;
	}
	if (vocab_file)
		p.vocab_path = vocab_file;
	p.n_threads = (int)threads;
	if ((rc = nf_synth_validate(&p, &d)) < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_USAGE;
	}
	if (p.predictor && p.act != NF_SYNTH_ACT_RELU)
		nf_cli_warn("--activation %s: PowerInfer itself applies ReLU to PWRI files; "
			    "nflash reads nflash.ffn_activation", nf_synth_act_name(p.act));

	uint64_t bytes = nf_synth_data_bytes(&p);
	char *dup = strdup(out);
	struct statvfs sv;
	if (dup && statvfs(dirname(dup), &sv) == 0) {
		uint64_t avail = (uint64_t)sv.f_bavail * sv.f_frsize;
		if (avail < bytes + (bytes >> 6) + (64u << 20)) {
			nf_cli_err("-o %s: the file needs %.2f GiB but only %.2f GiB are free there",
				   out, bytes / 1073741824.0, avail / 1073741824.0);
			free(dup);
			return NF_EXIT_FAIL;
		}
	}
	free(dup);

	struct nf_progress pr;
	nf_progress_start(&pr, "synth", bytes, true);
	p.progress = progress_cb;
	p.progress_arg = &pr;
	double t0 = nf_cli_now();
	rc = nf_synth_write(&p, out, &d);
	nf_progress_end(&pr);
	if (rc < 0) {
		nf_cli_err("synth: %s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	double dt = nf_cli_now() - t0;
	fprintf(stderr, "nflash: wrote %s: %s %s %s, %.2f GiB in %.1f s (%.0f MB/s)\n", out,
		p.shape, nf_synth_act_name(p.act), nf_dtype_name(p.dtype), bytes / 1073741824.0,
		dt, bytes / 1e6 / (dt > 0 ? dt : 1));
	return NF_EXIT_OK;
}

static void report_row(FILE *f, const char *label, const struct nf_synth_layer_stats *s)
{
	fprintf(f, "%-6s %9.4f %7.3f %7.3f %7.3f %8.3f %7.3f %8.4f %9.4f\n", label, s->sparsity,
		s->top1_share, s->top10_share, s->top20_share, s->overlap, s->skew, s->recall,
		s->precision);
}

static void json_stats(struct nf_json *j, const struct nf_synth_layer_stats *s)
{
	nf_json_dbl(j, "sparsity", s->sparsity);
	nf_json_dbl(j, "top1_share", s->top1_share);
	nf_json_dbl(j, "top10_share", s->top10_share);
	nf_json_dbl(j, "top20_share", s->top20_share);
	nf_json_dbl(j, "overlap", s->overlap);
	nf_json_dbl(j, "skew", s->skew);
	nf_json_dbl(j, "recall", s->recall);
	nf_json_dbl(j, "precision", s->precision);
}

int nf_synth_report_main(const char *path, uint32_t n_tokens, uint64_t seed, bool json,
			 int n_threads)
{
	struct nf_synth_report r;
	struct nf_diag d = { 0 };
	struct nf_progress pr;
	struct nf_synth_report_opts o = { .n_tokens = n_tokens, .seed = seed,
					  .n_threads = n_threads, .progress = progress_cb,
					  .progress_arg = &pr };
	nf_progress_start(&pr, "report", n_tokens, false);
	double t0 = nf_cli_now();
	int rc = nf_synth_report_run(path, &o, &r, &d);
	nf_progress_end(&pr);
	if (rc < 0) {
		nf_cli_err("--report: %s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	double dt = nf_cli_now() - t0;
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, true);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "model", path);
		nf_json_u64(&j, "tokens", r.tokens);
		nf_json_str(&j, "token_stream", "seeded uniform random ids in [3, n_vocab)");
		nf_json_u64(&j, "seed", seed);
		nf_json_str(&j, "activation", r.act);
		nf_json_u64(&j, "neurons_per_layer", r.n_neurons);
		nf_json_bool(&j, "predictor", r.predictor);
		nf_json_dbl(&j, "threshold", r.threshold);
		nf_json_dbl(&j, "seconds", dt);
		json_stats(&j, &r.mean);
		nf_json_arr_begin(&j, "layers");
		for (uint32_t i = 0; i < r.n_layer; i++) {
			nf_json_obj_begin(&j, NULL);
			nf_json_u64(&j, "layer", i);
			json_stats(&j, &r.layers[i]);
			nf_json_obj_end(&j);
		}
		nf_json_arr_end(&j);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		printf("model %s: %u layers, %u FFN neurons per layer, activation %s\n", path,
		       r.n_layer, r.n_neurons, r.act);
		printf("tokens: %llu of a seeded uniform random stream (seed %llu), dense forward "
		       "pass, %.1f s\n", (unsigned long long)r.tokens, (unsigned long long)seed, dt);
		if (r.predictor)
			printf("predictor: fc2 . relu(fc1 . resid) >= %g (PowerInfer's rule)\n",
			       r.threshold);
		else
			printf("predictor: none in this file\n");
		printf("%-6s %9s %7s %7s %7s %8s %7s %8s %9s\n", "layer", "sparsity", "top1%",
		       "top10%", "top20%", "overlap", "skew", "recall", "precision");
		for (uint32_t i = 0; i < r.n_layer; i++) {
			char lab[16];
			snprintf(lab, sizeof(lab), "%u", i);
			report_row(stdout, lab, &r.layers[i]);
		}
		report_row(stdout, "mean", &r.mean);
		printf("top N%%: share of all firings by the N%% most frequent neurons; overlap: "
		       "share of a token's active neurons also active for the previous token; "
		       "skew: fitted power-law exponent of firing frequency by rank\n");
	}
	nf_synth_report_free(&r);
	return NF_EXIT_OK;
}
