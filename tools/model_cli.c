/*
 * model_cli.c - the flags generate and eval share, and opening the model
 * (see model_cli.h).
 *
 * Invariants: every error names the flag or the file; the load time covers
 * parsing, mapping and prefaulting the weights and allocating the context.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nflash/coact.h"
#include "nflash/error.h"
#include "nflash/store.h"
#include "cli.h"
#include "model_cli.h"

void nf_model_cli_init(struct nf_model_cli *mc)
{
	memset(mc, 0, sizeof(*mc));
	mc->kv_type = -1;
	mc->replan_moves = -1;
	mc->route_prefetch = -1;
	mc->repack = -1;
	mc->gate_first = -1;
	mc->sparse_mode = -1;
	mc->read_gap = -1;
	mc->cold_slots = -1;
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
	} else if (!strcmp(f, "--recall")) {
		mc->recall = mc->stats = true;
	} else if (!strcmp(f, "--stream-attn")) {
		mc->stream_attn = true;
	} else if (!strcmp(f, "--attn-pin-layers")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1 << 20, &mc->attn_pin) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "--ffn-store")) {
		if (!(mc->ffn_store = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
	} else if (!strcmp(f, "--io")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		mc->io_mmap = !strcmp(v, "mmap");
		mc->io_backend = mc->io_mmap ? NULL : v;
		int b = mc->io_mmap ? 0 : nf_io_backend_parse(v);
		if (b < 0 || b == NF_IO_FAULT) {
			nf_cli_err("%s: expected auto, aio, uring, sync or mmap, got '%s'", f, v);
			return NF_EUSAGE;
		}
	} else if (!strcmp(f, "--profile")) {
		mc->profile = true;
	} else if (!strcmp(f, "--cold-slots")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1L << 30, &mc->cold_slots) < 0)
			return -1;
		if (mc->cold_slots > 0 && mc->cold_slots < 128) {
			/* the engine's unit of work is a chunk of up to 95 neurons */
			nf_cli_err("--cold-slots: %ld is below 128, the least a chunk of neurons needs (0: one "
				   "layer)", mc->cold_slots);
			return -1;
		}
	} else if (!strcmp(f, "--replan-moves")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 1 << 20, &mc->replan_moves) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "--route-prefetch") || !strcmp(f, "--gate-first") || !strcmp(f, "--repack")) {
		if (!(v = nf_cli_value(argc, argv, i)))
			return NF_EUSAGE;
		if (strcmp(v, "on") && strcmp(v, "off")) {
			nf_cli_err("%s: '%s' is neither on nor off", f, v);
			return NF_EUSAGE;
		}
		*(!strcmp(f, "--gate-first") ? &mc->gate_first
		  : !strcmp(f, "--repack")   ? &mc->repack
					     : &mc->route_prefetch) = !strcmp(v, "on");
	} else if (!strcmp(f, "--read-gap")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 0, 64, &mc->read_gap) < 0)
			return NF_EUSAGE;
	} else if (!strcmp(f, "--qd")) {
		if (!(v = nf_cli_value(argc, argv, i)) || nf_cli_int(f, v, 1, 4096, &mc->qd) < 0)
			return NF_EUSAGE;
	} else {
		return 0;
	}
	return 1;
}

void nf_model_cli_help(FILE *f)
{
	fprintf(f,
		"  -m, --model FILE      GGUF model (llama.cpp or PowerInfer file), or a store\n"
		"                        made by `nflash import`; required\n"
		"  -c, --ctx-size N      context length in tokens (default: the model's)\n"
		"  -t, --threads N       compute threads (default: all CPUs)\n"
		"  -b, --batch-size N    prompt tokens per forward step (default: the plan's, or 512)\n"
		"  --kv-type f32|f16     KV cache element type (default: the plan's, or f16 as llama.cpp)\n"
		"  --sparse-mode MODE    predictor|exact|dense|off|auto (default auto: predictor where\n"
		"                        the file has one, exact for ReLU/dReLU, the built-in dense FFN\n"
		"                        otherwise)\n"
		"  --sparse-threshold X  predictor threshold (default: powerinfer.sparse_threshold, or 0)\n"
		"  --memory-budget SIZE  limit on what the engine holds (K/M/G suffixes); the KV cache\n"
		"                        for -c counts against it\n"
		"  --stats               per-token and total FFN statistics on stderr\n"
		"  --recall              --stats, plus the predictor's recall: in memory, each layer's\n"
		"                        gate is computed in full to check the prediction (a 7B\n"
		"                        decode ran 1.8x slower); not for timing runs\n"
		"  --stream-attn         store only: read each layer's attention weights from the store\n"
		"                        at every step through 2 layer buffers, instead of pinning them\n"
		"                        (automatic when the pinned dense weights do not fit the budget)\n"
		"  --attn-pin-layers N   when attention is streamed, keep the first N layers' attention\n"
		"                        pinned (default 0: the budget left goes to the neuron cache)\n"
		"  --ffn-store FILE      read the FFN neuron bundles from this store through the\n"
		"                        segmented cache (O_DIRECT) instead of the GGUF's weights\n"
		"  --io aio|uring|sync   I/O backend for --ffn-store and stores (default auto)\n"
		"  --io mmap             baseline (llama.cpp's default loader): a GGUF run dense\n"
		"                        through its read-only mapping, pages faulted in on demand\n"
		"                        through the page cache (no prefault, no budget, no store)\n"
		"  --qd N                reads in flight for stores and --ffn-store (default 256)\n"
		"  --read-gap N          join misses up to N bundles apart into one read, reading the\n"
		"                        bundles between them too (default 4; 0: adjacent only)\n"
		"  --cold-slots N        cold segment of N bundles (>= 128) instead of one layer's:\n"
		"                        more room for hot neurons, batches and dense layers read in\n"
		"                        parts (same output, slower prefill; default: one layer, or a\n"
		"                        quarter layer in predictor mode when a whole one would\n"
		"                        leave no room to pin attention)\n"
		"  --route-prefetch on|off  from a store, decode: read ahead, while layer L computes,\n"
		"                        what layer L+1 will ask for, guessed from layer L's FFN\n"
		"                        input: a mixture's routed experts (its router), a dense\n"
		"                        FFN's predicted neurons (its predictor); same output\n"
		"                        (default: the plan's, which measured both; else on, but\n"
		"                        off for experts in predictor mode)\n"
		"  --gate-first on|off   exact mode from a store with gate rows (import writes them\n"
		"                        for ReLU models without predictors): read each FFN's gate\n"
		"                        rows first, then only the bundles of neurons whose gate\n"
		"                        is positive (default: the plan's, which measured both;\n"
		"                        else on for a dense FFN, off for a mixture's experts)\n"
		"  --repack on|off       Q4_0/Q8_0/K-quant attention and output (and the FFN of a\n"
		"                        dense run in memory) in the kernels' 8-row groups: same\n"
		"                        bits, faster (default on; off for A/B runs)\n"
		"  --replan-moves N      online re-planning: every 16 tokens, move up to N neurons\n"
		"                        that now fire clearly more than hot ones of their layer\n"
		"                        from the cold segment into the hot one (memcpy, no I/O;\n"
		"                        counts halve every 64 tokens; default 1024, 0: off)\n"
		"  --profile             count how often each FFN neuron fires over this run\n"
		"                        (calibration) and store the counts in the store (-m STORE\n"
		"                        or --ffn-store); tokens are evaluated one at a time. The\n"
		"                        cache then preloads each layer's hottest neurons at start;\n"
		"                        `nflash store relayout` puts them first in the file\n");
}

uint64_t nf_model_cli_vm_hwm(void)
{
	return nf_engine_vm_hwm();
}

static double mib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0);
}

static void stats_line(FILE *f, const char *label, const struct nf_sparse_stats *d,
		       const struct nf_cache_stats *c, const struct nf_stream_stats *a, double t)
{
	double act = d->neurons_total ? 100.0 * (double)d->neurons_active / (double)d->neurons_total : 0.0;
	double wait = t > 0 ? 100.0 * d->t_wait / t : 0.0;
	double overlap = d->t_io > 0 ? 100.0 * (1.0 - d->t_wait / d->t_io) : 100.0;
	fprintf(f, "nflash: %s: %.2f ms, FFN %.2f ms (compute %.2f ms, I/O wait %.2f ms = %.1f%%, overlap %.0f%%), "
		"active %.1f%% of %llu neurons",
		label, t * 1e3, d->t_ffn * 1e3, (d->t_ffn - d->t_wait) * 1e3, d->t_wait * 1e3, wait,
		overlap < 0 ? 0 : overlap, act, (unsigned long long)d->neurons_total);
	if (c) {
		double lk = c->lookups ? (double)c->lookups : 1.0;
		fprintf(f, ", read %.1f KiB in %llu requests (mean %.1f KiB), hits hot %.1f%% cold %.1f%% miss %.1f%%",
			(double)c->bytes_read / 1024.0, (unsigned long long)c->requests,
			c->requests ? (double)(c->bytes_read - c->hot_bytes) / (double)c->requests / 1024.0 : 0.0,
			100.0 * (double)c->hits_hot / lk, 100.0 * (double)c->hits_cold / lk,
			100.0 * (double)c->misses / lk);
	} else {
		fprintf(f, ", read 0 B (weights in memory: every neuron a hit)");
	}
	if (d->hot_loads)
		fprintf(f, ", hot segment refilled in %.2f ms", d->t_hot * 1e3);
	if (d->recall_fired)
		fprintf(f, ", predictor recall %.1f%%", 100.0 * (double)d->recall_hit / (double)d->recall_fired);
	if (a)
		fprintf(f, "; attention streamed: read %.1f MiB (%llu layers), waited %.2f ms = %.1f%%",
			(double)a->bytes_read / (1024.0 * 1024.0), (unsigned long long)a->groups_read,
			a->t_wait * 1e3, t > 0 ? 100.0 * a->t_wait / t : 0.0);
	fprintf(f, "\n");
}

static void attn_delta(const struct nf_stream_stats *a, const struct nf_stream_stats *b,
		       struct nf_stream_stats *d)
{
	d->bytes_read = a->bytes_read - b->bytes_read;
	d->objects_read = a->objects_read - b->objects_read;
	d->groups_read = a->groups_read - b->groups_read;
	d->acquires = a->acquires - b->acquires;
	d->waits = a->waits - b->waits;
	d->t_wait = a->t_wait - b->t_wait;
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
	d->t_io = a->t_io - b->t_io;
	d->hot_loads = a->hot_loads - b->hot_loads;
	d->t_hot = a->t_hot - b->t_hot;
	d->recall_fired = a->recall_fired - b->recall_fired;
	d->recall_hit = a->recall_hit - b->recall_hit;
}

static void cache_delta(const struct nf_cache_stats *a, const struct nf_cache_stats *b,
			struct nf_cache_stats *d)
{
	d->lookups = a->lookups - b->lookups;
	d->hits_hot = a->hits_hot - b->hits_hot;
	d->hits_cold = a->hits_cold - b->hits_cold;
	d->misses = a->misses - b->misses;
	d->requests = a->requests - b->requests;
	d->bytes_read = a->bytes_read - b->bytes_read;
	d->hot_loads = a->hot_loads - b->hot_loads;
	d->hot_bytes = a->hot_bytes - b->hot_bytes;
	d->hot_requests = a->hot_requests - b->hot_requests;
	d->evictions = a->evictions - b->evictions;
	d->errors = a->errors - b->errors;
}

void nf_model_cli_stats_step(struct nf_model_cli *mc, FILE *f, const char *label)
{
	if (!mc->stats || !mc->sparse)
		return;
	struct nf_sparse_stats now, d;
	struct nf_cache_stats cnow, cd;
	nf_sparse_stats_get(mc->sparse, &now);
	stats_delta(&now, &mc->last, &d);
	if (mc->cache) {
		nf_cache_stats_get(mc->cache, &cnow);
		cache_delta(&cnow, &mc->clast, &cd);
		mc->clast = cnow;
	}
	struct nf_stream_stats anow, ad;
	bool attn = nf_ctx_attn_stats(mc->ctx, &anow);
	if (attn) {
		attn_delta(&anow, &mc->alast, &ad);
		mc->alast = anow;
	}
	double t = nf_cli_now();
	stats_line(f, label, &d, mc->cache ? &cd : NULL, attn ? &ad : NULL, t - mc->t_last);
	mc->last = now;
	mc->t_last = t;
}

/* A mixture of experts' per-expert statistics (NULL otherwise), and its
 * layers and experts. */
static const struct nf_sparse_expert_stats *expert_stats(const struct nf_model_cli *mc, uint32_t *n_layer,
							  uint32_t *n_expert)
{
	const struct nf_sparse_expert_stats *xs = mc->sparse && mc->ctx ? nf_sparse_expert_stats(mc->sparse) : NULL;
	if (xs) {
		const struct nf_model_hparams *hp = nf_model_hparams(nf_ctx_model(mc->ctx));
		*n_layer = hp->n_layer;
		*n_expert = hp->n_expert;
	}
	return xs;
}

/* One line per layer: each expert's tokens routed and hit rate. */
static void experts_lines(const struct nf_model_cli *mc, FILE *f)
{
	uint32_t nl, nx;
	const struct nf_sparse_expert_stats *xs = expert_stats(mc, &nl, &nx);
	struct nf_sparse_stats st = { 0 };
	if (mc->sparse)
		nf_sparse_stats_get(mc->sparse, &st);
	if (xs && st.route_guesses)
		fprintf(f, "nflash: route-ahead guess (layer L+1's router on layer L's FFN input, decode): %.1f%% of "
			"%llu routed experts\n",
			100.0 * (double)st.route_guess_hits / (double)st.route_guesses,
			(unsigned long long)st.route_guesses);
	if (mc->cache && (xs || st.route_prefetches)) {
		struct nf_cache_stats c;
		struct nf_cache_layout cl;
		nf_cache_stats_get(mc->cache, &c);
		nf_cache_layout_get(mc->cache, &cl);
		/* bundles the reads brought in: those asked for and the gaps between */
		double stride = cl.cold_slots ? (double)cl.cold / cl.cold_slots : 0.0;
		double got = stride > 0 ? (double)c.prefetch_bytes / stride : 0.0;
		if (!xs && st.ahead_guessed)
			fprintf(f, "nflash: layer-ahead guess (layer L+1's predictor on layer L's FFN input, decode): "
				"%.1f%% of %llu guessed neurons computed, %.1f%% of %llu computed guessed%s\n",
				100.0 * (double)st.ahead_right / (double)st.ahead_guessed,
				(unsigned long long)st.ahead_guessed,
				st.ahead_needed ? 100.0 * (double)st.ahead_right / (double)st.ahead_needed : 0.0,
				(unsigned long long)st.ahead_needed,
				st.ahead_stopped ? "; stopped: too few right to pay for its reads" : "");
		if (st.route_prefetches)
			fprintf(f, "nflash: %s prefetch: %llu %s, %.1f MiB in %llu reads (%llu bundles asked for, %.0f "
				"with the gaps), %llu of those found later (%.1f%%), %llu lookups waited for one in "
				"flight\n",
				xs ? "route-ahead" : "layer-ahead", (unsigned long long)st.route_prefetches,
				xs ? "experts" : "layers", (double)c.prefetch_bytes / 1048576.0,
				(unsigned long long)c.prefetch_requests, (unsigned long long)c.prefetch_neurons, got,
				(unsigned long long)c.prefetch_hits, got > 0 ? 100.0 * (double)c.prefetch_hits / got : 0.0,
				(unsigned long long)c.prefetch_waits);
		else
			fprintf(f, "nflash: route-ahead prefetch: off\n");
	}
	for (uint32_t il = 0; xs && il < nl; il++) {
		fprintf(f, "nflash: layer %u experts (tokens routed, cache hit rate):", il);
		for (uint32_t e = 0; e < nx; e++) {
			const struct nf_sparse_expert_stats *x = &xs[(size_t)il * nx + e];
			if (mc->cache && x->lookups)
				 fprintf(f, "%s e%u %llu tok %.1f%%", e ? "," : "", e, (unsigned long long)x->routed,
					100.0 * (double)x->hits / (double)x->lookups);
			else
				fprintf(f, "%s e%u %llu tok", e ? "," : "", e, (unsigned long long)x->routed);
		}
		fprintf(f, "\n");
	}
}

void nf_model_cli_stats_total(struct nf_model_cli *mc, FILE *f, double t_total)
{
	if (!mc->stats || !mc->sparse)
		return;
	struct nf_sparse_stats now;
	struct nf_cache_stats c;
	nf_sparse_stats_get(mc->sparse, &now);
	if (mc->cache)
		nf_cache_stats_get(mc->cache, &c);
	struct nf_stream_stats a;
	bool attn = nf_ctx_attn_stats(mc->ctx, &a);
	stats_line(f, "total", &now, mc->cache ? &c : NULL, attn ? &a : NULL, t_total);
	experts_lines(mc, f);
	if (now.gate_reads)
		fprintf(f, "nflash: gate-first: %llu gate-rows reads, %.1f MiB (besides the bundles' %.1f MiB)\n",
			(unsigned long long)now.gate_reads, mib(now.gate_bytes), mib(c.bytes_read));
	if (mc->cache) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(mc->cache, &cl);
		if (cl.hot_from_profile)
			fprintf(f, "nflash: hot set from the store's profile (%llu calibration tokens): %.1f MiB in %llu "
				"reads at open\n", (unsigned long long)cl.profile_tokens, mib(c.hot_bytes),
				(unsigned long long)c.hot_requests);
		else
			fprintf(f, "nflash: hot set learned online (no profile used)\n");
	}
	fprintf(f, "nflash: peak resident %.1f MiB (VmHWM)", mib(nf_model_cli_vm_hwm()));
	if (mc->budget)
		fprintf(f, ", budget %.1f MiB (the fixed overhead, %.1f MiB, included)", mib(mc->budget),
			mib(mc->overhead));
	fprintf(f, "\n");
}

void nf_model_cli_stats_json(struct nf_model_cli *mc, struct nf_json *j, double t_total)
{
	struct nf_sparse_stats st = { 0 };
	struct nf_cache_stats c = { 0 };
	if (mc->sparse)
		nf_sparse_stats_get(mc->sparse, &st);
	if (mc->cache)
		nf_cache_stats_get(mc->cache, &c);
	double lk = c.lookups ? (double)c.lookups : 1.0;
	nf_json_obj_begin(j, "stats");
	nf_json_str(j, "sparse_mode", mc->sparse ? nf_sparse_mode_name(nf_sparse_mode_of(mc->sparse)) : "off");
	nf_json_str(j, "ffn_source", mc->cache ? "store" : "memory");
	nf_json_u64(j, "bytes_read", c.bytes_read);
	nf_json_u64(j, "requests", c.requests);
	nf_json_dbl(j, "mean_request_bytes",
		    c.requests ? (double)(c.bytes_read - c.hot_bytes) / (double)c.requests : 0.0);
	nf_json_dbl(j, "hit_rate", mc->cache ? (double)(c.hits_hot + c.hits_cold) / lk : 1.0);
	nf_json_obj_begin(j, "hit_rate_segments");
	if (mc->cache) {
		nf_json_dbl(j, "hot", (double)c.hits_hot / lk);
		nf_json_dbl(j, "cold", (double)c.hits_cold / lk);
	} else {
		nf_json_dbl(j, "memory", 1.0);
	}
	nf_json_obj_end(j);
	nf_json_u64(j, "lookups", c.lookups);
	nf_json_u64(j, "misses", c.misses);
	nf_json_u64(j, "evictions", c.evictions);
	nf_json_u64(j, "gap_bundles", c.gap_bundles);
	nf_json_u64(j, "promotions", c.promotions);
	if (mc->cache) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(mc->cache, &cl);
		nf_json_str(j, "hot_source", cl.hot_from_profile ? "profile" : "online");
		nf_json_u64(j, "profile_tokens", cl.profile_tokens);
		nf_json_u64(j, "hot_bytes", c.hot_bytes);
		nf_json_u64(j, "hot_requests", c.hot_requests);
		nf_json_u64(j, "hot_slots", cl.hot_slots);
		nf_json_u64(j, "hot_slots_on_loan", cl.hot_slots - cl.hot_floor);
		nf_json_u64(j, "cold_slots", cl.cold_slots);
		nf_json_dbl(j, "verify_ms", c.verify_ns / 1e6);
	}
	nf_json_u64(j, "hot_loads", st.hot_loads);
	nf_json_dbl(j, "hot_load_ms", st.t_hot * 1e3);
	nf_json_dbl(j, "ffn_ms", st.t_ffn * 1e3);
	nf_json_dbl(j, "compute_ms", (st.t_ffn - st.t_wait) * 1e3);
	nf_json_dbl(j, "io_wait_ms", st.t_wait * 1e3);
	nf_json_dbl(j, "io_wait_share", t_total > 0 ? st.t_wait / t_total : 0.0);
	nf_json_dbl(j, "overlap_pct", st.t_io > 0 ? fmax(0.0, 100.0 * (1.0 - st.t_wait / st.t_io)) : 100.0);
	nf_json_u64(j, "neurons_total", st.neurons_total);
	nf_json_u64(j, "neurons_active", st.neurons_active);
	nf_json_u64(j, "gate_reads", st.gate_reads);
	nf_json_u64(j, "gate_bytes_read", st.gate_bytes);
	if (st.recall_fired)
		nf_json_dbl(j, "predictor_recall", (double)st.recall_hit / (double)st.recall_fired);
	struct nf_stream_stats a = { 0 };
	bool attn = mc->ctx && nf_ctx_attn_stats(mc->ctx, &a);
	nf_json_bool(j, "attn_streamed", attn);
	nf_json_u64(j, "attn_bytes_read", a.bytes_read);
	nf_json_u64(j, "attn_layers_read", a.groups_read);
	nf_json_dbl(j, "attn_wait_ms", a.t_wait * 1e3);
	nf_json_dbl(j, "attn_wait_share", t_total > 0 ? a.t_wait / t_total : 0.0);
	nf_json_u64(j, "attn_buffer_bytes", mc->ctx ? nf_ctx_attn_stream_bytes(mc->ctx) : 0);
	uint32_t nl, nx;
	const struct nf_sparse_expert_stats *xs = expert_stats(mc, &nl, &nx);
	if (mc->cache) {
		/* read ahead: a mixture's guessed experts, a dense FFN's layers */
		nf_json_u64(j, "route_prefetches", st.route_prefetches);
		nf_json_u64(j, "route_prefetch_reads", c.prefetch_requests);
		nf_json_u64(j, "route_prefetch_bytes", c.prefetch_bytes);
		nf_json_u64(j, "route_prefetch_neurons", c.prefetch_neurons);
		nf_json_u64(j, "route_prefetch_hits", c.prefetch_hits);
		nf_json_u64(j, "route_prefetch_waits", c.prefetch_waits);
		nf_json_u64(j, "ahead_guessed", st.ahead_guessed);
		nf_json_u64(j, "ahead_right", st.ahead_right);
		nf_json_u64(j, "ahead_needed", st.ahead_needed);
		nf_json_bool(j, "ahead_stopped", st.ahead_stopped);
	}
	if (xs) {
		nf_json_u64(j, "moe_together", st.moe_together);
		nf_json_u64(j, "route_guesses", st.route_guesses);
		nf_json_u64(j, "route_guess_hits", st.route_guess_hits);
		/* per expert: tokens routed, neurons computed, cache hit rate */
		nf_json_arr_begin(j, "experts");
		for (uint32_t il = 0; il < nl; il++)
			for (uint32_t e = 0; e < nx; e++) {
				const struct nf_sparse_expert_stats *x = &xs[(size_t)il * nx + e];
				nf_json_obj_begin(j, NULL);
				nf_json_u64(j, "layer", il);
				nf_json_u64(j, "expert", e);
				nf_json_u64(j, "routed", x->routed);
				nf_json_u64(j, "neurons_active", x->neurons_active);
				nf_json_u64(j, "lookups", x->lookups);
				nf_json_u64(j, "hits", x->hits);
				nf_json_dbl(j, "hit_rate",
					    !mc->cache ? 1.0 : x->lookups ? (double)x->hits / (double)x->lookups : 0.0);
				nf_json_obj_end(j);
			}
		nf_json_arr_end(j);
	}
	nf_json_u64(j, "budget_bytes", mc->budget);
	nf_json_u64(j, "reserved_bytes", mc->reserved);
	nf_json_u64(j, "kv_lent_bytes", mc->kv_lent);
	nf_json_u64(j, "overhead_bytes", mc->overhead);
	nf_json_obj_end(j);
	nf_json_u64(j, "vm_hwm_bytes", nf_model_cli_vm_hwm());
}

/* The exit code for an engine or store error: NF_EUSAGE means a flag does
 * not fit this model. */
static int exit_code(int rc)
{
	return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
}

void nf_model_cli_engine_opts(const struct nf_model_cli *mc, struct nf_engine_opts *o)
{
	nf_engine_opts_default(o);
	o->path = mc->path;
	o->ffn_store = mc->ffn_store;
	o->budget = mc->budget;
	o->n_ctx = (uint32_t)mc->n_ctx;
	o->n_batch = (uint32_t)mc->n_batch;
	o->n_threads = (int)mc->n_threads;
	o->kv_type = mc->kv_type;
	o->sparse_mode = mc->sparse_mode;
	o->threshold_set = mc->threshold_set;
	o->threshold = (float)mc->threshold;
	o->io_backend = mc->io_backend ? nf_io_backend_parse(mc->io_backend) : -1;
	o->io_mmap = mc->io_mmap;
	o->qd = (uint32_t)mc->qd;
	o->read_gap = (int)mc->read_gap;
	o->stream_attn = mc->stream_attn;
	o->attn_pin = (uint32_t)mc->attn_pin;
	o->cold_slots = (int)mc->cold_slots;
	o->replan_moves = (int)mc->replan_moves;
	o->route_prefetch = mc->route_prefetch;
	o->gate_first = mc->gate_first;
	o->no_repack = mc->repack == 0;
	o->profile = mc->profile;
	o->profile_sig_tokens = NF_PROFILE_SIG_TOKENS;
	o->measure_recall = mc->stats && mc->recall;
	o->log = stderr;
}

int nf_model_cli_open(struct nf_model_cli *mc)
{
	struct nf_engine_opts o;
	nf_model_cli_engine_opts(mc, &o);
	struct nf_diag d = { 0 };
	/* --profile writes the store at the end: find out now, not after minutes */
	const char *upd = mc->ffn_store ? mc->ffn_store : mc->path;
	if (mc->profile && nf_store_probe(upd) && nf_store_update_check(upd, &d) < 0) {
		nf_cli_err("--profile: %s", d.msg);
		return NF_EXIT_FAIL;
	}
	int rc = nf_engine_open(&o, &mc->engine, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return exit_code(rc);
	}
	struct nf_engine_info info;
	nf_engine_info(mc->engine, &info);
	/* what the engine resolved (the plan's, or the defaults) */
	mc->kv_type = nf_engine_opts(mc->engine)->kv_type;
	mc->n_batch = (long)nf_engine_opts(mc->engine)->n_batch;
	mc->model = nf_engine_model(mc->engine);
	mc->ctx = nf_engine_ctx(mc->engine);
	mc->sparse = nf_engine_sparse(mc->engine);
	mc->cache = nf_engine_cache(mc->engine);
	mc->load_s = info.load_s;
	mc->reserved = info.reserved;
	mc->kv_lent = info.kv_lent;
	mc->overhead = info.overhead;
	mc->attn_streamed = info.attn_streamed;
	mc->profile_rec = info.profile_rec;
	if (mc->stats)
		fprintf(stderr, "nflash: FFN mode %s%s\n", nf_sparse_mode_name(nf_sparse_mode_of(mc->sparse)),
			nf_sparse_mode_of(mc->sparse) == NF_SPARSE_OFF ? " (built-in dense FFN)" : "");
	mc->t_last = nf_cli_now();
	return NF_EXIT_OK;
}

static void progress_fn(void *arg, const char *label, uint64_t done, uint64_t total)
{
	struct nf_progress *p = arg;
	if (done == 0)
		nf_progress_start(p, label, total, false);
	nf_progress_update(p, done);
	if (done == total)
		nf_progress_end(p);
}

int nf_model_cli_profile_save(struct nf_model_cli *mc, uint64_t tokens)
{
	if (!mc->profile || !mc->cache)
		return NF_EXIT_OK;
	struct nf_diag d = { 0 };
	struct nf_progress p;
	struct nf_coact_progress pr = { .fn = progress_fn, .arg = &p };
	int rc = nf_coact_profile_save(mc->engine, tokens, &pr, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	return NF_EXIT_OK;
}

const char *nf_model_cli_strerror(const struct nf_model_cli *mc, int rc)
{
	const char *why = nf_cache_error_detail(mc->cache);
	return why[0] ? why : nf_strerror(rc);
}

void nf_model_cli_close(struct nf_model_cli *mc)
{
	nf_engine_close(mc->engine);
	mc->engine = NULL;
	mc->sparse = NULL;
	mc->cache = NULL;
	mc->ctx = NULL;
	mc->model = NULL;
}
