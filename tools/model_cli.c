/*
 * model_cli.c - the flags generate and eval share, and opening the model
 * (see model_cli.h).
 *
 * Invariants: every error names the flag or the file; the load time covers
 * parsing, mapping and prefaulting the weights and allocating the context.
 */
#include <string.h>

#include "nflash/error.h"
#include "cli.h"
#include "model_cli.h"

void nf_model_cli_init(struct nf_model_cli *mc)
{
	memset(mc, 0, sizeof(*mc));
	mc->n_batch = 512;
	mc->kv_type = NF_KV_F32;
	mc->sparse_mode = -1;
}

int nf_model_cli_flag(struct nf_model_cli *mc, int argc, char **argv, int *i)
{
	const char *f = argv[*i], *v;
	if (!strcmp(f, "-m") || !strcmp(f, "--model")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		mc->path = v;
	} else if (!strcmp(f, "-c") || !strcmp(f, "--ctx-size")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1 << 24, &mc->n_ctx) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "-t") || !strcmp(f, "--threads")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1024, &mc->n_threads) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "-b") || !strcmp(f, "--batch-size")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 1, 1 << 16, &mc->n_batch) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "--kv-type")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		if (!strcmp(v, "f32")) {
			mc->kv_type = NF_KV_F32;
		} else if (!strcmp(v, "f16")) {
			mc->kv_type = NF_KV_F16;
		} else {
			nf_cli_err("%s: expected f32 or f16, got '%s'", f, v);
			return NF_EUSAGE;
		}
	} else if (!strcmp(f, "--sparse-mode")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		int m = nf_sparse_mode_parse(v);
		if (m < 0) {
			nf_cli_err("%s: expected auto, predictor, exact, dense or off, got '%s'", f, v);
			return NF_EUSAGE;
		}
		mc->sparse_mode = m;
	} else if (!strcmp(f, "--sparse-threshold")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_double(f, v, &mc->threshold) < 0)
			return NF_EUSAGE;
		mc->threshold_set = true;
	} else if (!strcmp(f, "--memory-budget")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_size(f, v, &mc->budget) < 0)
			return NF_EUSAGE;
		if (mc->budget == 0) {
			nf_cli_err("%s: must be positive", f);
			return NF_EUSAGE;
		}
	} else if (!strcmp(f, "--stats")) {
		mc->stats = true;
	} else {
		return 0;
	}
	return 1;
}

void nf_model_cli_help(FILE *f)
{
	fprintf(f,
		"  -m, --model FILE      GGUF model (llama.cpp or PowerInfer file); required\n"
		"  -c, --ctx-size N      context length in tokens (default: the model's)\n"
		"  -t, --threads N       compute threads (default: all CPUs)\n"
		"  -b, --batch-size N    prompt tokens per forward step (default 512)\n"
		"  --kv-type f32|f16     KV cache element type (default f32)\n"
		"  --sparse-mode MODE    predictor|exact|dense|off|auto (default auto: predictor where\n"
		"                        the file has one, exact for ReLU/dReLU, the built-in dense FFN\n"
		"                        otherwise)\n"
		"  --sparse-threshold X  predictor threshold (default: powerinfer.sparse_threshold, or 0)\n"
		"  --memory-budget SIZE  limit on what the engine holds (K/M/G suffixes); the KV cache\n"
		"                        for -c counts against it\n"
		"  --stats               per-token and total FFN statistics on stderr\n");
}

/* Bytes the process holds before the model: program, libraries, thread
 * stacks, allocator slack. Printed at start; the budget check allows it. */
#define NF_CLI_OVERHEAD (48ull << 20)

uint64_t nf_model_cli_vm_hwm(void)
{
	FILE *f = fopen("/proc/self/status", "r");
	if (!f)
		return 0;
	char line[256];
	unsigned long long kb = 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmHWM: %llu kB", &kb) == 1)
			break;
	fclose(f);
	return (uint64_t)kb * 1024;
}

static double mib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0);
}

/* The sparse engine and the budget check, after the context is open. */
static int open_engine(struct nf_model_cli *mc)
{
	struct nf_diag d = { 0 };
	const struct nf_model_hparams *hp = nf_model_hparams(mc->model);
	struct nf_sparse_params sp;
	nf_sparse_params_init(&sp);
	sp.mode = mc->sparse_mode < 0 ? NF_SPARSE_AUTO : (enum nf_sparse_mode)mc->sparse_mode;
	/* In memory, "dense" by default is the built-in FFN (the same sums);
	 * MoE FFNs are not sparse yet. */
	if (mc->sparse_mode < 0) {
		bool pred = !hp->n_expert && nf_model_layer(mc->model, 0)->fc1.data;
		if (hp->n_expert || (!pred && hp->act == NF_FFN_SILU))
			sp.mode = NF_SPARSE_OFF;
	}
	sp.threshold_set = mc->threshold_set;
	sp.threshold = (float)mc->threshold;
	sp.measure_recall = mc->stats;
	int rc = nf_sparse_open(mc->ctx, &sp, &mc->sparse, &d);
	if (rc < 0) {
		nf_cli_err("%s: %s", mc->path, nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	uint64_t weights = nf_model_weight_bytes(mc->model);
	mc->reserved = nf_ctx_bytes(mc->ctx) + nf_sparse_bytes(mc->sparse);
	mc->overhead = NF_CLI_OVERHEAD;
	if (mc->budget) {
		uint64_t need = weights + mc->reserved;
		fprintf(stderr,
			"nflash: memory budget %.1f MiB: weights in memory %.1f MiB (pinned), reserved %.1f MiB "
			"(KV cache %.1f MiB for -c %u, scratch and tables %.1f MiB); fixed overhead %.1f MiB\n",
			mib(mc->budget), mib(weights), mib(mc->reserved), mib(nf_ctx_bytes_kv(mc->ctx)),
			nf_ctx_n_ctx(mc->ctx), mib(mc->reserved - nf_ctx_bytes_kv(mc->ctx)), mib(mc->overhead));
		if (need > mc->budget) {
			nf_cli_err("--memory-budget %.1f MiB is too small for %s: at least %.1f MiB needed "
				   "(%.1f MiB of weights held in memory + %.1f MiB KV cache and scratch; "
				   "a smaller -c lowers the KV cache)",
				   mib(mc->budget), mc->path, mib(need), mib(weights), mib(mc->reserved));
			return NF_EXIT_FAIL;
		}
	}
	if (mc->stats)
		fprintf(stderr, "nflash: FFN mode %s%s\n", nf_sparse_mode_name(nf_sparse_mode_of(mc->sparse)),
			nf_sparse_mode_of(mc->sparse) == NF_SPARSE_OFF ? " (built-in dense FFN)" : "");
	mc->t_last = nf_cli_now();
	return NF_EXIT_OK;
}

static void stats_line(FILE *f, const char *label, const struct nf_sparse_stats *d, double t)
{
	double act = d->neurons_total ? 100.0 * (double)d->neurons_active / (double)d->neurons_total : 0.0;
	double wait = t > 0 ? 100.0 * d->t_wait / t : 0.0;
	fprintf(f,
		"nflash: %s: %.2f ms, FFN %.2f ms (wait %.2f ms, %.1f%%), active %.1f%% of %llu neurons, "
		"read 0 B in 0 requests (mean 0 B), hit rate memory 100.0%%",
		label, t * 1e3, d->t_ffn * 1e3, d->t_wait * 1e3, wait, act,
		(unsigned long long)d->neurons_total);
	if (d->recall_fired)
		fprintf(f, ", predictor recall %.1f%%", 100.0 * (double)d->recall_hit / (double)d->recall_fired);
	fprintf(f, "\n");
}

static void stats_delta(const struct nf_sparse_stats *a, const struct nf_sparse_stats *b,
			struct nf_sparse_stats *d)
{
	d->ffn_calls = a->ffn_calls - b->ffn_calls;
	d->neurons_total = a->neurons_total - b->neurons_total;
	d->neurons_active = a->neurons_active - b->neurons_active;
	d->groups_ready_now = a->groups_ready_now - b->groups_ready_now;
	d->groups_ready_later = a->groups_ready_later - b->groups_ready_later;
	d->t_ffn = a->t_ffn - b->t_ffn;
	d->t_wait = a->t_wait - b->t_wait;
	d->recall_fired = a->recall_fired - b->recall_fired;
	d->recall_hit = a->recall_hit - b->recall_hit;
}

void nf_model_cli_stats_step(struct nf_model_cli *mc, FILE *f, const char *label)
{
	if (!mc->stats || !mc->sparse)
		return;
	struct nf_sparse_stats now, d;
	nf_sparse_stats_get(mc->sparse, &now);
	stats_delta(&now, &mc->last, &d);
	double t = nf_cli_now();
	stats_line(f, label, &d, t - mc->t_last);
	mc->last = now;
	mc->t_last = t;
}

void nf_model_cli_stats_total(struct nf_model_cli *mc, FILE *f, double t_total)
{
	if (!mc->stats || !mc->sparse)
		return;
	struct nf_sparse_stats now;
	nf_sparse_stats_get(mc->sparse, &now);
	stats_line(f, "total", &now, t_total);
	fprintf(f, "nflash: peak resident %.1f MiB (VmHWM)", mib(nf_model_cli_vm_hwm()));
	if (mc->budget)
		fprintf(f, ", budget %.1f MiB + fixed overhead %.1f MiB", mib(mc->budget), mib(mc->overhead));
	fprintf(f, "\n");
}

void nf_model_cli_stats_json(struct nf_model_cli *mc, struct nf_json *j, double t_total)
{
	struct nf_sparse_stats st = { 0 };
	if (mc->sparse)
		nf_sparse_stats_get(mc->sparse, &st);
	nf_json_obj_begin(j, "stats");
	nf_json_str(j, "sparse_mode", mc->sparse ? nf_sparse_mode_name(nf_sparse_mode_of(mc->sparse)) : "off");
	nf_json_u64(j, "bytes_read", 0);
	nf_json_u64(j, "requests", 0);
	nf_json_dbl(j, "mean_request_bytes", 0.0);
	nf_json_dbl(j, "hit_rate", 1.0);
	nf_json_obj_begin(j, "hit_rate_segments");
	nf_json_dbl(j, "memory", 1.0);
	nf_json_obj_end(j);
	nf_json_dbl(j, "ffn_ms", st.t_ffn * 1e3);
	nf_json_dbl(j, "compute_ms", (st.t_ffn - st.t_wait) * 1e3);
	nf_json_dbl(j, "io_wait_ms", st.t_wait * 1e3);
	nf_json_dbl(j, "io_wait_share", t_total > 0 ? st.t_wait / t_total : 0.0);
	nf_json_dbl(j, "overlap_pct", 100.0);
	nf_json_u64(j, "neurons_total", st.neurons_total);
	nf_json_u64(j, "neurons_active", st.neurons_active);
	if (st.recall_fired)
		nf_json_dbl(j, "predictor_recall", (double)st.recall_hit / (double)st.recall_fired);
	nf_json_u64(j, "budget_bytes", mc->budget);
	nf_json_u64(j, "reserved_bytes", mc->reserved);
	nf_json_u64(j, "overhead_bytes", mc->overhead);
	nf_json_obj_end(j);
	nf_json_u64(j, "vm_hwm_bytes", nf_model_cli_vm_hwm());
}

int nf_model_cli_open(struct nf_model_cli *mc)
{
	if (!mc->path) {
		nf_cli_err("-m MODEL is required");
		return NF_EXIT_USAGE;
	}
	struct nf_diag d = { 0 };
	double t0 = nf_cli_now();
	int rc = nf_model_load(mc->path, NULL, &mc->model, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	const struct nf_model_hparams *hp = nf_model_hparams(mc->model);
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = (uint32_t)mc->n_ctx;
	cp.n_batch = (uint32_t)mc->n_batch;
	cp.n_threads = (int)mc->n_threads;
	cp.kv_type = mc->kv_type;
	if (mc->n_ctx > (long)hp->n_ctx_train)
		nf_cli_warn("-c %ld exceeds the model's training context %u", mc->n_ctx, hp->n_ctx_train);
	rc = nf_ctx_open(mc->model, &cp, &mc->ctx, &d);
	if (rc < 0) {
		nf_cli_err("%s: %s", mc->path, nf_diag_msg(&d, rc));
		nf_model_free(mc->model);
		mc->model = NULL;
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	if ((rc = open_engine(mc)) != NF_EXIT_OK) {
		nf_model_cli_close(mc);
		return rc;
	}
	mc->load_s = nf_cli_now() - t0;
	return NF_EXIT_OK;
}

void nf_model_cli_close(struct nf_model_cli *mc)
{
	nf_sparse_close(mc->sparse);
	mc->sparse = NULL;
	nf_ctx_close(mc->ctx);
	nf_model_free(mc->model);
	mc->ctx = NULL;
	mc->model = NULL;
}
