/*
 * generate.c - `nflash generate`: prefill a prompt, then sample tokens one
 * at a time, streaming them to stdout, and report llama.cpp-style timings
 * on stderr (or everything as one JSON object with --json).
 *
 * Invariants: stdout carries only the generated output (text or ids) or
 * the JSON object; diagnostics and timings go to stderr. Generation stops
 * at -n tokens, at EOS (unless --ignore-eos) or when the context is full,
 * and says which.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nflash/error.h"
#include "nflash/kernels.h"
#include "nflash/sampler.h"
#include "nflash/tokenizer.h"
#include "cli.h"
#include "model_cli.h"

static void gen_usage(FILE *f)
{
	fprintf(f,
		"usage: nflash generate -m MODEL (-p TEXT | -f FILE | --ids 1,2,3) [-n N] [-c CONTEXT] [-t THREADS]\n"
		"                       [--temp T] [--top-k K] [--top-p P] [--min-p P]\n"
		"                       [--repeat-penalty R] [--repeat-last-n N] [--seed S]\n"
		"                       [--kv-type f32|f16] [--ignore-eos] [--print-ids] [--json]\n"
		"\n"
		"Generates text after a prompt and prints timings as llama.cpp does.\n"
		"\n"
		"options:\n");
	nf_model_cli_help(f);
	fprintf(f,
		"  -p, --prompt TEXT     prompt text (tokenized with the model's vocabulary)\n"
		"  -f, --file FILE       prompt text from FILE (e.g. calibration text for --profile)\n"
		"  --ids LIST            prompt as comma-separated token ids (used as given)\n"
		"  -n, --n-predict N     tokens to generate (default 128; -1: until EOS or full context)\n"
		"  --temp T              temperature (default 0.8; 0: greedy, ties to the lowest id)\n"
		"  --top-k K             keep the K most likely tokens (default 40; 0: off)\n"
		"  --top-p P             nucleus: smallest set with probability >= P (default 0.95; 1: off)\n"
		"  --min-p P             drop tokens below P x the top probability (default 0.05; 0: off)\n"
		"  --repeat-penalty R    penalise recent tokens (default 1.0: off)\n"
		"  --repeat-last-n N     window of the penalty (default 64)\n"
		"  --seed S              sampler seed (default: from the clock; printed)\n"
		"  --ignore-eos          keep generating after the end-of-sequence token\n"
		"  --print-ids           print token ids instead of text\n"
		"  --json                print one JSON object (ids, counts, timings) instead\n"
		"  -h, --help            this help\n");
}

struct gen_opts {
	const char *prompt;
	char *prompt_file;       /* -f: the file's text (owned); prompt points at it */
	int32_t *ids;
	size_t n_ids;
	long n_predict;
	struct nf_sampler_params sp;
	bool seed_set, ignore_eos, print_ids, json;
};

static int parse_prob(const char *flag, const char *v, float lo, float hi, float *out)
{
	double d;
	if (nf_cli_double(flag, v, &d) < 0)
		return NF_EUSAGE;
	if (d < lo || d > hi) {
		nf_cli_err("%s: %g is out of range [%g, %g]", flag, d, lo, hi);
		return NF_EUSAGE;
	}
	*out = (float)d;
	return 0;
}

/* The whole of text file path, NUL-terminated (malloc'd), or NULL after
 * an error naming flag. */
static char *read_text(const char *flag, const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		nf_cli_err("%s %s: %s", flag, path, strerror(errno));
		return NULL;
	}
	size_t cap = 1 << 16, len = 0;
	char *buf = malloc(cap);
	while (buf) {
		len += fread(buf + len, 1, cap - 1 - len, f);
		if (len < cap - 1)
			break;
		char *nb = realloc(buf, cap * 2);
		if (!nb) {
			free(buf);
			buf = NULL;
			break;
		}
		buf = nb;
		cap *= 2;
	}
	if (!buf || ferror(f)) {
		nf_cli_err("%s %s: %s", flag, path, buf ? "read error" : "out of memory");
		free(buf);
		fclose(f);
		return NULL;
	}
	fclose(f);
	buf[len] = '\0';
	if (len == 0) {
		nf_cli_err("%s %s: the file is empty", flag, path);
		free(buf);
		return NULL;
	}
	return buf;
}

static int gen_parse(int argc, char **argv, struct nf_model_cli *mc, struct gen_opts *o)
{
	for (int i = 1; i < argc; i++) {
		const char *f = argv[i], *v;
		long l;
		uint64_t u;
		int r = nf_model_cli_flag(mc, argc, argv, &i);
		if (r < 0)
			return NF_EUSAGE;
		if (r > 0)
			continue;
		if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
			gen_usage(stdout);
			return 1;
		}
		if (!strcmp(f, "--ignore-eos")) {
			o->ignore_eos = true;
			continue;
		}
		if (!strcmp(f, "--print-ids")) {
			o->print_ids = true;
			continue;
		}
		if (!strcmp(f, "--json")) {
			o->json = true;
			continue;
		}
		bool known = !strcmp(f, "-p") || !strcmp(f, "--prompt") || !strcmp(f, "--ids") ||
			     !strcmp(f, "-f") || !strcmp(f, "--file") ||
			     !strcmp(f, "-n") || !strcmp(f, "--n-predict") || !strcmp(f, "--temp") ||
			     !strcmp(f, "--top-k") || !strcmp(f, "--top-p") || !strcmp(f, "--min-p") ||
			     !strcmp(f, "--repeat-penalty") || !strcmp(f, "--repeat-last-n") ||
			     !strcmp(f, "--seed");
		if (!known) {
			nf_cli_err("generate: unknown option '%s' (try 'nflash generate --help')", f);
			return NF_EUSAGE;
		}
		if (!(v = nf_cli_value(argc, argv, &i)))
			return NF_EUSAGE;
		int rc = 0;
		if (!strcmp(f, "-p") || !strcmp(f, "--prompt")) {
			o->prompt = v;
		} else if (!strcmp(f, "-f") || !strcmp(f, "--file")) {
			free(o->prompt_file);
			if (!(o->prompt_file = read_text(f, v)))
				return NF_EUSAGE;
			o->prompt = o->prompt_file;
		} else if (!strcmp(f, "--ids")) {
			free(o->ids);
			o->ids = NULL;
			rc = nf_cli_ids(f, v, &o->ids, &o->n_ids);
		} else if (!strcmp(f, "-n") || !strcmp(f, "--n-predict")) {
			rc = nf_cli_int(f, v, -1, 1 << 24, &o->n_predict);
		} else if (!strcmp(f, "--temp")) {
			rc = parse_prob(f, v, 0.0f, 100.0f, &o->sp.temp);
		} else if (!strcmp(f, "--top-k")) {
			rc = nf_cli_int(f, v, 0, INT32_MAX, &l);
			o->sp.top_k = (int32_t)l;
		} else if (!strcmp(f, "--top-p")) {
			rc = parse_prob(f, v, 0.0f, 1.0f, &o->sp.top_p);
		} else if (!strcmp(f, "--min-p")) {
			rc = parse_prob(f, v, 0.0f, 1.0f, &o->sp.min_p);
		} else if (!strcmp(f, "--repeat-penalty")) {
			rc = parse_prob(f, v, 1e-3f, 100.0f, &o->sp.repeat_penalty);
		} else if (!strcmp(f, "--repeat-last-n")) {
			rc = nf_cli_int(f, v, 0, 1 << 20, &l);
			o->sp.repeat_last_n = (int32_t)l;
		} else {
			rc = nf_cli_u64(f, v, &u);
			o->sp.seed = u;
			o->seed_set = true;
		}
		if (rc < 0)
			return NF_EUSAGE;
	}
	if (!!o->prompt == !!o->ids) {
		nf_cli_err("generate: give exactly one of -p TEXT and --ids LIST");
		return NF_EUSAGE;
	}
	return 0;
}

enum gen_stop { STOP_LENGTH, STOP_EOS, STOP_CONTEXT };
static const char *const stop_names[] = { "length", "eos", "context" };

/*
 * The decode measured against the plan's prediction. The plan measured
 * the device once; a disk that has changed since (a virtual one's rate
 * moved 2.3x between two sessions of one day on the same machine) leaves its
 * settings and figures stale, and this says so. Short runs (fewer than 32
 * decode steps: the first ones fill the cold segment) are not judged, and
 * only a factor past 0.6 or 1.6 is: this host's noise alone moves a run
 * by 15%.
 */
static void plan_check(const struct nf_engine_info *pi, const char *path, size_t n_evals, double gen_tps)
{
	if (pi->plan_tok_per_s <= 0 || gen_tps <= 0)
		return;
	double r = gen_tps / pi->plan_tok_per_s;
	fprintf(stderr, "nflash: decode %.2f tok/s, the plan for %.1f MiB predicted %.2f (measured %.2fx)%s\n", gen_tps,
		(double)pi->plan_budget / 1048576.0, pi->plan_tok_per_s, r,
		pi->plan_overridden ? "; flags given here changed the plan's settings" : "");
	if (!pi->plan_overridden && n_evals >= 32 && (r < 0.6 || r > 1.6))
		fprintf(stderr,
			"nflash: hint: the device or the machine may have changed since the plan measured them: "
			"`nflash plan %s --memory-budget %.1fM --remeasure` measures them again\n",
			path, (double)pi->plan_budget / 1048576.0);
}

int nf_cmd_generate(int argc, char **argv)
{
	struct nf_model_cli mc;
	nf_model_cli_init(&mc);
	struct gen_opts o = { .n_predict = 128, .sp = nf_sampler_defaults() };
	struct nf_sampler *smp = NULL;
	struct nf_tok *tok = NULL;
	int32_t *out_ids = NULL;
	char *text = NULL;
	size_t text_len = 0, text_cap = 0;
	int ret = NF_EXIT_USAGE;

	int pr = gen_parse(argc, argv, &mc, &o);
	if (pr != 0) {
		ret = pr > 0 ? NF_EXIT_OK : NF_EXIT_USAGE;
		goto done;
	}
	if (!o.seed_set)
		o.sp.seed = (uint64_t)time(NULL);
	if ((ret = nf_model_cli_open(&mc)) != NF_EXIT_OK)
		goto done;
	const struct nf_model_hparams *hp = nf_model_hparams(mc.model);
	struct nf_diag td = { 0 };
	int trc = nf_tok_open(nf_model_gguf(mc.model), &tok, &td);
	if (trc < 0 && o.prompt) {
		nf_cli_err("-p needs the model's vocabulary: %s", nf_diag_msg(&td, trc));
		ret = NF_EXIT_FAIL;
		goto done;
	}
	if (trc < 0 && !o.print_ids && !o.json)
		nf_cli_warn("%s; printing token ids", nf_diag_msg(&td, trc));
	if (o.prompt) {
		size_t len = strlen(o.prompt), n = 0;
		unsigned fl = NF_TOK_ADD_SPECIAL | NF_TOK_PARSE_SPECIAL;
		trc = nf_tok_encode(tok, o.prompt, len, fl, NULL, 0, &n);
		if (trc == -ENOSPC || (trc == 0 && n > 0)) {
			o.ids = malloc((n ? n : 1) * sizeof(*o.ids));
			trc = o.ids ? nf_tok_encode(tok, o.prompt, len, fl, o.ids, n, &o.n_ids) : -ENOMEM;
		}
		if (trc < 0 || o.n_ids == 0) {
			nf_cli_err("-p: cannot tokenize the prompt: %s",
				   trc < 0 ? nf_strerror(trc) : "it gives no tokens");
			ret = trc == -ENOMEM ? NF_EXIT_FAIL : NF_EXIT_USAGE;
			goto done;
		}
	}
	bool as_text = tok && !o.print_ids;
	ret = NF_EXIT_USAGE;
	for (size_t i = 0; i < o.n_ids; i++)
		if (o.ids[i] < 0 || (uint32_t)o.ids[i] >= hp->n_vocab) {
			nf_cli_err("--ids: token id %d is outside the vocabulary of %s (%u tokens)",
				   o.ids[i], mc.path, hp->n_vocab);
			goto done;
		}
	uint32_t n_ctx = nf_ctx_n_ctx(mc.ctx);
	if (o.n_ids >= n_ctx) {
		nf_cli_err("prompt of %zu tokens leaves no room in the context of %u (-c)", o.n_ids, n_ctx);
		goto done;
	}
	int rc = nf_sampler_open(&o.sp, hp->n_vocab, &smp);
	if (rc < 0) {
		nf_cli_err("generate: bad sampling parameters");
		goto done;
	}
	size_t max_gen = o.n_predict < 0 ? n_ctx - o.n_ids : (size_t)o.n_predict;
	out_ids = malloc((max_gen ? max_gen : 1) * sizeof(*out_ids));
	ret = NF_EXIT_FAIL;
	if (!out_ids) {
		nf_cli_err("generate: out of memory");
		goto done;
	}
	for (size_t i = 0; i < o.n_ids; i++)
		nf_sampler_accept(smp, o.ids[i]);

	bool stream = !o.json;
	if (stream && as_text && o.prompt) {
		fputs(o.prompt, stdout);
		fflush(stdout);
	}
	double t0 = nf_cli_now();
	rc = nf_ctx_eval(mc.ctx, o.ids, o.n_ids);
	double t_prompt = nf_cli_now() - t0, t_eval = 0, t_sample = 0;
	if (rc < 0) {
		nf_cli_err("%s: prompt evaluation failed: %s", mc.path, nf_model_cli_strerror(&mc, rc));
		goto done;
	}
	nf_model_cli_stats_step(&mc, stderr, "prompt");
	size_t n_gen = 0, n_evals = 0;
	enum gen_stop stop = STOP_LENGTH;
	while (n_gen < max_gen) {
		double ts = nf_cli_now();
		int32_t id = nf_sampler_sample(smp, nf_ctx_logits(mc.ctx));
		nf_sampler_accept(smp, id);
		t_sample += nf_cli_now() - ts;
		bool eog = tok ? nf_tok_is_eog(tok, id) : id == hp->eos_id;
		if (eog && !o.ignore_eos) {
			stop = STOP_EOS;
			break;
		}
		out_ids[n_gen++] = id;
		if (as_text) {
			char piece[256];
			int pl = nf_tok_piece(tok, id, false, piece, sizeof(piece));
			pl = pl < 0 ? 0 : pl > (int)sizeof(piece) ? (int)sizeof(piece) : pl;
			if (text_len + (size_t)pl + 1 > text_cap) {
				size_t cap = (text_cap + (size_t)pl + 1) * 2;
				char *t = realloc(text, cap);
				if (!t) {
					nf_cli_err("generate: out of memory");
					goto done;
				}
				text = t;
				text_cap = cap;
			}
			memcpy(text + text_len, piece, (size_t)pl);
			text_len += (size_t)pl;
			text[text_len] = 0;
			if (stream)
				fwrite(piece, 1, (size_t)pl, stdout);
		} else if (stream) {
			printf(n_gen > 1 ? " %d" : "%d", id);
		}
		if (stream && !nf_cli_out_ok(stdout, "standard output"))
			goto done;     /* the text is lost: no point generating more */
		if (n_gen == max_gen) {
			if (o.n_predict < 0)
				stop = STOP_CONTEXT;   /* -n -1 runs until the context is full */
			break;
		}
		if (nf_ctx_n_past(mc.ctx) >= n_ctx) {
			stop = STOP_CONTEXT;
			break;
		}
		double te = nf_cli_now();
		rc = nf_ctx_eval(mc.ctx, &id, 1);
		t_eval += nf_cli_now() - te;
		n_evals++;
		if (rc < 0) {
			nf_cli_err("%s: evaluation failed: %s", mc.path, nf_model_cli_strerror(&mc, rc));
			goto done;
		}
		char label[32];
		snprintf(label, sizeof(label), "token %zu", n_gen);
		nf_model_cli_stats_step(&mc, stderr, label);
	}
	if (stream)
		printf("\n");
	double prompt_tps = t_prompt > 0 ? o.n_ids / t_prompt : 0;
	double gen_tps = t_eval > 0 ? n_evals / t_eval : 0;
	struct nf_engine_info pi = { 0 };
	if (mc.engine)
		nf_engine_info(mc.engine, &pi);
	const char *isa = nf_ctx_kernels(mc.ctx)->isa;
	if (o.json) {
		struct nf_json j;
		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "model", mc.path);
		nf_json_arr_begin(&j, "ids");
		for (size_t i = 0; i < n_gen; i++)
			nf_json_i64(&j, NULL, out_ids[i]);
		nf_json_arr_end(&j);
		if (as_text)   /* invalid UTF-8 becomes U+FFFD (nf_json_str) */
			nf_json_str(&j, "text", text ? text : "");
		nf_json_u64(&j, "prompt_tokens", o.n_ids);
		nf_json_u64(&j, "gen_tokens", n_gen);
		nf_json_str(&j, "stop", stop_names[stop]);
		nf_json_dbl(&j, "load_ms", mc.load_s * 1e3);
		nf_json_dbl(&j, "prompt_ms", t_prompt * 1e3);
		nf_json_dbl(&j, "gen_ms", t_eval * 1e3);
		nf_json_dbl(&j, "sample_ms", t_sample * 1e3);
		nf_json_dbl(&j, "prompt_tok_per_s", prompt_tps);
		nf_json_dbl(&j, "gen_tok_per_s", gen_tps);
		if (pi.plan_tok_per_s > 0)
			nf_json_dbl(&j, "plan_predicted_tok_per_s", pi.plan_tok_per_s);
		nf_json_u64(&j, "gen_evals", n_evals);
		nf_json_i64(&j, "threads", nf_ctx_n_threads(mc.ctx));
		nf_json_str(&j, "isa", isa);
		nf_json_u64(&j, "n_ctx", n_ctx);
		nf_json_str(&j, "kv_type", mc.kv_type == NF_KV_F16 ? "f16" : "f32");
		nf_json_u64(&j, "seed", o.sp.seed);
		nf_model_cli_stats_json(&mc, &j, t_prompt + t_eval);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	}
	fflush(stdout);
	fprintf(stderr, "\n");
	fprintf(stderr, "nflash: %s, %d threads, %s kernels, n_ctx %u, KV %s, seed %llu, stop: %s\n",
		mc.path, nf_ctx_n_threads(mc.ctx), isa, n_ctx, mc.kv_type == NF_KV_F16 ? "f16" : "f32",
		(unsigned long long)o.sp.seed, stop_names[stop]);
	fprintf(stderr, "nflash: load time        = %10.2f ms\n", mc.load_s * 1e3);
	fprintf(stderr, "nflash: sample time      = %10.2f ms / %5zu runs   (%8.2f ms per token, %8.2f tokens per second)\n",
		t_sample * 1e3, n_gen, n_gen ? t_sample * 1e3 / n_gen : 0.0,
		t_sample > 0 ? n_gen / t_sample : 0.0);
	fprintf(stderr, "nflash: prompt eval time = %10.2f ms / %5zu tokens (%8.2f ms per token, %8.2f tokens per second)\n",
		t_prompt * 1e3, o.n_ids, t_prompt * 1e3 / o.n_ids, prompt_tps);
	fprintf(stderr, "nflash:        eval time = %10.2f ms / %5zu runs   (%8.2f ms per token, %8.2f tokens per second)\n",
		t_eval * 1e3, n_evals, n_evals ? t_eval * 1e3 / n_evals : 0.0, gen_tps);
	fprintf(stderr, "nflash:       total time = %10.2f ms / %5zu tokens\n",
		(mc.load_s + t_prompt + t_eval + t_sample) * 1e3, o.n_ids + n_gen);
	nf_model_cli_stats_total(&mc, stderr, t_prompt + t_eval);
	plan_check(&pi, mc.path, n_evals, gen_tps);
	ret = nf_model_cli_profile_save(&mc, o.n_ids + n_evals);
done:
	free(o.prompt_file);
	free(o.ids);
	free(out_ids);
	free(text);
	nf_tok_close(tok);
	nf_sampler_close(smp);
	nf_model_cli_close(&mc);
	return ret;
}
