/*
 * bench_replan.c - online re-planning when the hot set drifts (docs/PLAN.md
 * "Online re-planning"): a store calibrated on one token distribution (A)
 * decodes tokens of another (B), with re-planning on and off, interleaved.
 *
 * The model: `nflash synth`'s 7B shape cut to BENCH_REPLAN_LAYERS layers
 * (default 4: dim 4096, 11008 neurons per layer, q4_0, ReLU, sparsity
 * 0.90, PowerInfer predictors), written and imported once into
 * NFLASH_BENCH_DIR (default /tmp) and reused. A synth neuron's firing
 * depends on the token (its gate reads the token's embedding), so two
 * disjoint sets of token ids fire different neurons beyond the shared
 * hottest ones (docs/SYNTH.md).
 *
 * The run: calibrate (the profile, as `generate --profile` records it) on
 * 256 tokens of set A (BENCH_REPLAN_SET ids from 1000, default 4, one
 * token per step); then, per
 * repetition and mode (off, on, off, on, ...), open the engine under the
 * budget (the dense weights and context plus BENCH_REPLAN_CACHE_SHARE of
 * the FFN bundles, default 0.35: the hot segment is what the profile
 * chose), decode 64 tokens of A, then BENCH_REPLAN_N (default 256) tokens
 * of set B (as many ids from 20000), one per step, counting per 16-token window
 * the hot segment's hit rate, the time per token and the bytes read.
 *
 * Output: a header line, one row per window (medians over the
 * repetitions, BENCH_REPLAN_REPS, default 2), then a summary: the hot hit
 * rate before and after the shift, the tokens re-planning takes to bring
 * it back to 90% of where it ends, and the decode speed while it does,
 * against the same tokens without re-planning.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nflash/cache.h"
#include "nflash/coact.h"
#include "nflash/dtype.h"
#include "nflash/engine.h"
#include "nflash/import.h"
#include "nflash/model.h"
#include "nflash/store.h"
#include "nflash/synth.h"
#include "bench_common.h"

#define WIN 16u
#define N_WARM 64u
#define N_CALIB 256u
#define MAX_REPS 9
#define MAX_WIN 128

struct window {
	double hot;      /* hot hits / lookups */
	double ms;       /* per token */
	double kib;      /* read per token */
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long env_long(const char *name, long def)
{
	const char *v = getenv(name);
	return v && *v ? strtol(v, NULL, 10) : def;
}

static double env_dbl(const char *name, double def)
{
	const char *v = getenv(name);
	return v && *v ? strtod(v, NULL) : def;
}

/* ids per set (BENCH_REPLAN_SET): a synth neuron fires or not as a
 * function of the token alone, so a small set fires a set of neurons of
 * its own beside the hottest ones every token fires */
static uint32_t g_set = 4;

/* token i of set A or B: g_set ids in a fixed scrambled order */
static int32_t tok(int set, uint32_t i)
{
	return (set ? 20000 : 1000) + (int32_t)((i * 37u + (uint32_t)set * 11u) % g_set);
}

static int cmp_dbl(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_dbl);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int make_store(const char *dir, uint32_t layers, char *store, size_t len)
{
	snprintf(store, len, "%s/nflash-bench-replan-%ul.nfl", dir, layers);
	struct stat st;
	if (stat(store, &st) == 0 && st.st_size > 0)
		return 0;
	char gguf[512];
	snprintf(gguf, sizeof(gguf), "%s/nflash-bench-replan-%ul.gguf", dir, layers);
	struct nf_synth_params p;
	struct nf_diag d = { 0 };
	nf_synth_params_init(&p);
	int rc = nf_synth_shape(&p, "7b", &d);
	p.n_layer = layers;
	p.dtype = NF_DTYPE_Q4_0;
	p.sparsity = 0.90;
	p.n_threads = 2;
	if (rc == 0)
		rc = nf_synth_write(&p, gguf, &d);
	if (rc == 0) {
		struct nf_import_opts io;
		nf_import_opts_default(&io);
		io.block_size = 512;
		struct nf_import_report rep;
		rc = nf_import(gguf, store, &io, &rep, &d);
	}
	unlink(gguf);
	if (rc < 0)
		fprintf(stderr, "bench_replan: %s\n", nf_diag_msg(&d, rc));
	return rc;
}

/* the fixed overhead of a fresh process, measured by the first (dry) open:
 * later opens in this process would count what earlier runs left */
static uint64_t g_overhead;

static int open_at(const char *store, uint64_t budget, int replan, bool profile, struct nf_engine **e)
{
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.path = store;
	o.budget = budget;
	o.n_ctx = N_CALIB + 512;
	o.n_threads = 2;
	o.use_plan = false;
	o.replan_moves = replan;
	o.profile = profile;
	o.profile_sig_tokens = N_CALIB;
	o.overhead = g_overhead;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(&o, e, &d);
	if (rc < 0)
		fprintf(stderr, "bench_replan: %s\n", nf_diag_msg(&d, rc));
	return rc;
}

/* one run: warm-up on A, then n tokens of B; w[k] per window of B */
static int run(const char *store, uint64_t budget, int replan, uint32_t n, struct window *w, double *warm_hot,
	       uint64_t *promotions)
{
	struct nf_engine *e;
	int rc = open_at(store, budget, replan, false, &e);
	if (rc < 0)
		return rc;
	struct nf_ctx *ctx = nf_engine_ctx(e);
	struct nf_cache *c = nf_engine_cache(e);
	struct nf_cache_stats s0, s1;
	nf_cache_stats_get(c, &s0);
	for (uint32_t i = 0; i < N_WARM && rc == 0; i++) {
		int32_t id = tok(0, i);
		rc = nf_ctx_eval(ctx, &id, 1);
	}
	nf_cache_stats_get(c, &s1);
	*warm_hot = s1.lookups > s0.lookups ? (double)(s1.hits_hot - s0.hits_hot) / (double)(s1.lookups - s0.lookups) : 0;
	for (uint32_t k = 0; k * WIN < n && rc == 0; k++) {
		nf_cache_stats_get(c, &s0);
		double t0 = now();
		for (uint32_t i = 0; i < WIN && rc == 0; i++) {
			int32_t id = tok(1, k * WIN + i);
			rc = nf_ctx_eval(ctx, &id, 1);
		}
		double t = now() - t0;
		nf_cache_stats_get(c, &s1);
		uint64_t lk = s1.lookups - s0.lookups;
		w[k].hot = lk ? (double)(s1.hits_hot - s0.hits_hot) / (double)lk : 0;
		w[k].ms = t * 1e3 / WIN;
		w[k].kib = (double)(s1.bytes_read - s0.bytes_read) / 1024.0 / WIN;
	}
	nf_cache_stats_get(c, &s1);
	*promotions = s1.promotions;
	nf_engine_close(e);
	if (rc < 0)
		fprintf(stderr, "bench_replan: decode: %s\n", nf_strerror(rc));
	return rc;
}

int main(int argc, char **argv)
{
	nf_bench_args(argc, argv,
		"usage: bench_replan\n"
		"\n"
		"Online re-planning when the hot set drifts: a store calibrated on one\n"
		"token distribution decodes another, re-planning on and off, interleaved;\n"
		"the hit rate's recovery and the decode speed while it recovers.\n"
		"Environment: NFLASH_BENCH_DIR (/tmp) and the BENCH_REPLAN_* variables\n"
		"in bench/bench_replan.c's opening comment (docs/PLAN.md).\n",
		NULL, 0);
	const char *dir = getenv("NFLASH_BENCH_DIR") ? getenv("NFLASH_BENCH_DIR") : "/tmp";
	uint32_t layers = (uint32_t)env_long("BENCH_REPLAN_LAYERS", 4);
	uint32_t n = (uint32_t)env_long("BENCH_REPLAN_N", 256);
	int reps = (int)env_long("BENCH_REPLAN_REPS", 2);
	double share = env_dbl("BENCH_REPLAN_CACHE_SHARE", 0.35);
	g_set = (uint32_t)env_long("BENCH_REPLAN_SET", 4);
	if (n < WIN || n / WIN > MAX_WIN || reps < 1 || reps > MAX_REPS || share <= 0 || share > 1 || g_set < 1 ||
	    g_set > 1000) {
		fprintf(stderr, "bench_replan: BENCH_REPLAN_N in [%u, %u], BENCH_REPLAN_REPS in [1, %d], "
				"BENCH_REPLAN_CACHE_SHARE in (0, 1], BENCH_REPLAN_SET in [1, 1000]\n", WIN, WIN * MAX_WIN,
			MAX_REPS);
		return 2;
	}
	char store[512];
	if (make_store(dir, layers, store, sizeof(store)) < 0)
		return 1;

	/* the budget: what the engine holds besides the cache, plus a share
	 * of the FFN bundles (a dry run tells the former) */
	struct nf_engine *e;
	struct nf_engine_opts o;
	nf_engine_opts_default(&o);
	o.path = store;
	o.n_ctx = N_CALIB + 512;
	o.n_threads = 2;
	o.use_plan = false;
	o.size_only = true;
	struct nf_diag d = { 0 };
	int rc = nf_engine_open(&o, &e, &d);
	if (rc < 0) {
		fprintf(stderr, "bench_replan: %s\n", nf_diag_msg(&d, rc));
		return 1;
	}
	struct nf_engine_info info;
	nf_engine_info(e, &info);
	uint64_t ffn = 0;
	struct nf_store *s = nf_engine_store(e);
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind == NF_STORE_KIND_FFN)
			ffn += (uint64_t)ob->n_bundles * ob->stride;
	}
	g_overhead = info.overhead;
	uint64_t budget = info.weights + info.reserved + info.overhead + info.attn_buffers + (uint64_t)(share * (double)ffn);
	nf_engine_close(e);

	/* calibration on set A: the profile picks the hot set */
	if ((rc = open_at(store, budget, 0, true, &e)) < 0)
		return 1;
	for (uint32_t i = 0; i < N_CALIB && rc == 0; i++) {
		int32_t id = tok(0, i);
		rc = nf_ctx_eval(nf_engine_ctx(e), &id, 1);
	}
	if (rc == 0 && (rc = nf_coact_profile_save(e, N_CALIB, NULL, &d)) < 0)
		fprintf(stderr, "bench_replan: %s\n", nf_diag_msg(&d, rc));
	nf_engine_close(e);
	if (rc < 0)
		return 1;

	char extra[256];
	snprintf(extra, sizeof(extra),
		 "%u layers of the 7B shape, budget %.0f MiB (FFN %.0f MiB), sets of %u ids, %u B tokens x %d", layers,
		 (double)budget / 1048576.0, (double)ffn / 1048576.0, g_set, n, reps);
	nf_bench_header("bench_replan", extra);

	static struct window w[2][MAX_REPS][MAX_WIN];
	double warm[2][MAX_REPS];
	uint64_t prom[2][MAX_REPS];
	for (int r = 0; r < reps; r++)
		for (int on = 0; on < 2; on++)
			if (run(store, budget, on ? 1024 : 0, n, w[on][r], &warm[on][r], &prom[on][r]) < 0)
				return 1;

	uint32_t nw = n / WIN;
	struct window m[2][MAX_WIN];
	double v[MAX_REPS];
	printf("tokens\thot_hit_off\thot_hit_on\tms_per_tok_off\tms_per_tok_on\tkib_per_tok_off\tkib_per_tok_on\n");
	for (uint32_t k = 0; k < nw; k++) {
		for (int on = 0; on < 2; on++) {
			for (int r = 0; r < reps; r++)
				v[r] = w[on][r][k].hot;
			m[on][k].hot = median(v, reps);
			for (int r = 0; r < reps; r++)
				v[r] = w[on][r][k].ms;
			m[on][k].ms = median(v, reps);
			for (int r = 0; r < reps; r++)
				v[r] = w[on][r][k].kib;
			m[on][k].kib = median(v, reps);
		}
		printf("%u-%u\t%.3f\t%.3f\t%.1f\t%.1f\t%.0f\t%.0f\n", k * WIN, (k + 1) * WIN - 1, m[0][k].hot,
		       m[1][k].hot, m[0][k].ms, m[1][k].ms, m[0][k].kib, m[1][k].kib);
	}
	for (int r = 0; r < reps; r++)
		v[r] = warm[1][r];
	double before = median(v, reps);
	/* where re-planning ends (its last two windows), and the first window
	 * from which it stays within 90% of that */
	double end_on = nw > 1 ? (m[1][nw - 1].hot + m[1][nw - 2].hot) / 2 : m[1][0].hot;
	double end_off = nw > 1 ? (m[0][nw - 1].hot + m[0][nw - 2].hot) / 2 : m[0][0].hot;
	uint32_t rec = nw;
	for (uint32_t k = nw; k-- > 0;) {
		if (m[1][k].hot < 0.9 * end_on)
			break;
		rec = k;
	}
	double ms_on = 0, ms_off = 0;
	for (uint32_t k = 0; k <= rec && k < nw; k++)
		ms_on += m[1][k].ms, ms_off += m[0][k].ms;
	uint32_t span = rec < nw ? rec + 1 : nw;
	printf("# hot hit rate: %.3f on set A (calibrated), %.3f in the first %u tokens of set B; at the end %.3f "
	       "with re-planning, %.3f without\n",
	       before, m[1][0].hot, WIN, end_on, end_off);
	printf("# re-planning reaches 90%% of its final hot hit rate after %u tokens; over those, %.2f tok/s with "
	       "re-planning, %.2f without (%.2fx); %llu neurons promoted\n",
	       span * WIN, 1e3 * span / ms_on, 1e3 * span / ms_off, ms_off / ms_on,
	       (unsigned long long)prom[1][0]);
	return 0;
}
