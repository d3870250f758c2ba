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
	mc->n_batch = 512;
	mc->kv_type = NF_KV_F32;
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
		"  -b, --batch-size N    prompt tokens per forward step (default 512)\n"
		"  --kv-type f32|f16     KV cache element type (default f32)\n"
		"  --sparse-mode MODE    predictor|exact|dense|off|auto (default auto: predictor where\n"
		"                        the file has one, exact for ReLU/dReLU, the built-in dense FFN\n"
		"                        otherwise)\n"
		"  --sparse-threshold X  predictor threshold (default: powerinfer.sparse_threshold, or 0)\n"
		"  --memory-budget SIZE  limit on what the engine holds (K/M/G suffixes); the KV cache\n"
		"                        for -c counts against it\n"
		"  --stats               per-token and total FFN statistics on stderr\n"
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
		"  --profile             count how often each FFN neuron fires over this run\n"
		"                        (calibration) and store the counts in the store (-m STORE\n"
		"                        or --ffn-store); tokens are evaluated one at a time. The\n"
		"                        cache then preloads each layer's hottest neurons at start;\n"
		"                        `nflash store relayout` puts them first in the file\n");
}

/* Bytes the process holds before the model: program, libraries, thread
 * stacks, allocator slack. Printed at start; the budget check allows it. */
#define NF_CLI_OVERHEAD (24ull << 20)

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

/* Bytes of the FFN weights (gate, up, down) the model maps. */
static uint64_t ffn_weight_bytes(const struct nf_model *m)
{
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	uint64_t b = 0;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		const struct nf_weight *w[] = { &L->gate, &L->up, &L->down, &L->down_t };
		for (size_t i = 0; i < 4; i++)
			if (w[i]->data)
				b += (uint64_t)w[i]->nrows * w[i]->row_bytes * w[i]->n_expert;
	}
	return b;
}

/*
 * The store and its cache: the arena gets what the budget leaves after the
 * dense weights (*weights, reduced to them here), the KV cache and scratch
 * (an estimate: the engine's tables are small and counted after).
 */
static int open_cache(struct nf_model_cli *mc, uint64_t *weights)
{
	struct nf_diag d = { 0 };
	struct nf_store *store = nf_model_store(mc->model);
	const char *spath = mc->path;
	int rc;
	if (!store) {
		if ((rc = nf_store_open(mc->ffn_store, NULL, &mc->store, &d)) < 0) {
			nf_cli_err("--ffn-store %s", nf_diag_msg(&d, rc));
			return NF_EXIT_FAIL;
		}
		store = mc->store;
		spath = mc->ffn_store;
	}
	*weights -= ffn_weight_bytes(mc->model);
	const struct nf_model_hparams *hp = nf_model_hparams(mc->model);
	/* The cold segment: one layer's bundles by default, what a prefill
	 * batch or a dense FFN reads at once. A predictor-mode decode needs
	 * only a token's misses; with a smaller cold segment the engine halves
	 * batches and splits a token's chunks into windows (same output,
	 * slower prefill: docs/PIPELINE.md "Cold segment"). --cold-slots N sets
	 * it; by default predictor mode takes a quarter layer when a whole one
	 * would leave no room to pin attention. */
	bool predictor = (mc->sparse_mode == NF_SPARSE_PREDICTOR ||
			  ((mc->sparse_mode < 0 || mc->sparse_mode == NF_SPARSE_AUTO) &&
			   nf_model_layer(mc->model, 0)->fc1.data)) &&
			 hp->n_expert == 0;
	uint32_t small_cold = hp->n_ff / 4 > 256 ? hp->n_ff / 4 : 256;
	uint32_t cold_slots = mc->cold_slots > 0 ? (uint32_t)mc->cold_slots : 0;
	uint64_t min = nf_cache_min_bytes_for(store, cold_slots);
	const char *cold_what = cold_slots ? "the --cold-slots bundles" : "one layer's neurons";
	/* the sparse engine's tables (per-group outputs, per-neuron arrays,
	 * per-thread scratch) and the cache's metadata, rounded up */
	uint64_t groups = (hp->n_ff + 31) / 32;
	uint64_t engine = groups * hp->n_embd * 4 + (uint64_t)hp->n_ff * 72 +
			  (uint64_t)hp->n_layer * hp->n_ff * 8 + 64ull * (hp->n_embd * 4 + 256) + (1u << 20) +
			  /* batches: each token's prepared input and neuron masks */
			  (uint64_t)nf_ctx_n_batch(mc->ctx) * (hp->n_embd * 4 + 64 + groups * 4) +
			  64ull * hp->n_embd * 4;
	uint64_t fixed = *weights + nf_ctx_bytes(mc->ctx) + engine;
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.io.quiet = false;
	o.use_profile = !mc->profile;   /* a calibration run counts from zero */
	if (mc->profile) {
		/* the hot segment as large as a run with the profile will have
		 * (its size is the head of the co-activation layout), and the
		 * record the layout is planned from, counted in the budget */
		o.hot_fraction = o.profile_hot_fraction;
		o.sig_tokens = NF_PROFILE_SIG_TOKENS;
		uint64_t neurons = 0;
		for (uint32_t i = 0; i < nf_store_object_count(store); i++) {
			const struct nf_store_object *ob = nf_store_object_get(store, i);
			if (ob->kind == NF_STORE_KIND_FFN)
				neurons += ob->n_bundles;
		}
		uint64_t rec = neurons * ((NF_PROFILE_SIG_TOKENS + 63) / 64) * 8;
		fixed += rec;
		/* what this calibration run holds that a run under the same
		 * budget does not: the record, and (mostly) the KV cache of a
		 * long -c; the layout's head counts them as hot */
		mc->profile_extra = rec + nf_ctx_bytes(mc->ctx);
		mc->profile_rec = rec;
	}
	if (mc->io_backend)
		o.io.backend = (enum nf_io_backend)nf_io_backend_parse(mc->io_backend);
	if (mc->qd)
		o.io.qd = (unsigned)mc->qd;
	if (mc->read_gap >= 0)
		o.max_gap = (uint32_t)mc->read_gap;
	/* Attention left in the store at load: pinned if the budget holds it,
	 * else streamed per layer through two buffers, but for the first
	 * --attn-pin-layers layers (docs/PIPELINE.md "Streamed attention"). */
	uint64_t attn = nf_model_attn_in_memory(mc->model) ? 0 : nf_model_attn_bytes(mc->model);
	struct nf_stream_opts so;
	nf_stream_opts_default(&so);
	so.io.backend = o.io.backend;
	uint64_t sbytes = nf_model_attn_stream_bytes(mc->model, so.n_slots);
	if (mc->cold_slots < 0 && predictor && mc->budget && mc->budget < fixed + attn + min) {
		cold_slots = small_cold;
		min = nf_cache_min_bytes_for(store, cold_slots);
		cold_what = "a quarter of a layer's neurons (predictor mode, tight budget)";
	}
	o.min_cold_slots = cold_slots;
	bool stream = attn && (mc->stream_attn || (mc->budget && mc->budget < fixed + attn + min));
	uint32_t pin = stream ? (uint32_t)(mc->attn_pin < (long)hp->n_layer ? mc->attn_pin : hp->n_layer) : hp->n_layer;
	uint64_t pin_bytes = attn / hp->n_layer * pin;
	if (pin == hp->n_layer)
		stream = false;
	if (mc->budget) {
		uint64_t need = fixed + (stream ? sbytes + pin_bytes : attn) + min;
		if (mc->budget < need && stream) {
			nf_cli_err("--memory-budget %.1f MiB is too small for %s even with attention streamed: "
				   "at least %.1f MiB needed (%.1f MiB pinned dense weights%s + %.1f MiB attention "
				   "buffers (%u layers' worth) + %.1f MiB KV cache and scratch + %.1f MiB engine "
				   "tables + %.1f MiB: %s in the cache; a smaller -c lowers the KV cache)",
				   mib(mc->budget), spath, mib(need), mib(*weights + pin_bytes),
				   pin ? " with --attn-pin-layers' attention" : "", mib(sbytes), so.n_slots,
				   mib(nf_ctx_bytes(mc->ctx)), mib(engine), mib(min), cold_what);
			return NF_EXIT_FAIL;
		}
		if (mc->budget < need) {
			nf_cli_err("--memory-budget %.1f MiB is too small for %s: at least %.1f MiB "
				   "needed (%.1f MiB dense weights + %.1f MiB KV cache and scratch + %.1f MiB engine "
				   "tables + %.1f MiB: %s in the cache)",
				   mib(mc->budget), spath, mib(need), mib(*weights + attn),
				   mib(nf_ctx_bytes(mc->ctx)), mib(engine), mib(min), cold_what);
			return NF_EXIT_FAIL;
		}
	}
	if (attn && pin && (rc = nf_model_attn_load(mc->model, pin, &d)) < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	if (stream) {
		if ((rc = nf_ctx_stream_attn(mc->ctx, &so, &d)) < 0) {
			nf_cli_err("%s: streaming attention: %s", spath, nf_diag_msg(&d, rc));
			return NF_EXIT_FAIL;
		}
		mc->attn_streamed = true;
		char pinned[64] = "";
		if (pin)
			snprintf(pinned, sizeof(pinned), ", attention of layers 0-%u", pin - 1);
		fprintf(stderr,
			"nflash: attention streamed from the store%s: %u layers x %.1f MiB read at every "
			"forward step through %u buffers (%.1f MiB); pinned: norms, embeddings, output%s%s "
			"(%.1f MiB, where the pinned set would be %.1f MiB)\n",
			mc->stream_attn ? " (--stream-attn)" : " (the pinned dense weights do not fit the budget)",
			hp->n_layer - pin, mib(attn / hp->n_layer), so.n_slots, mib(sbytes),
			nf_model_layer(mc->model, 0)->fc1.data ? ", predictors" : "", pinned,
			mib(*weights + pin_bytes), mib(*weights + attn));
		*weights += pin_bytes;
		fixed += sbytes + pin_bytes;
	} else if (attn) {
		*weights += attn;
		fixed += attn;
	}
	if (mc->budget) {
		o.arena_bytes = mc->budget - fixed;
		o.prefault = true;
	} else {
		/* no budget: room for every bundle of the store */
		uint64_t all = 0;
		for (uint32_t i = 0; i < nf_store_object_count(store); i++) {
			const struct nf_store_object *ob = nf_store_object_get(store, i);
			if (ob->kind == NF_STORE_KIND_FFN)
				all += (uint64_t)ob->n_bundles * ob->stride;
		}
		o.arena_bytes = all * 2 + min;
	}
	rc = nf_cache_open(store, &o, &mc->cache, &d);
	if (rc < 0) {
		nf_cli_err("%s: %s", spath, nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	return NF_EXIT_OK;
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
	 * MoE FFNs are not sparse: in memory the built-in FFN runs them, from
	 * a store their routed experts stream as dense FFNs. */
	if (mc->sparse_mode < 0) {
		bool pred = !hp->n_expert && nf_model_layer(mc->model, 0)->fc1.data;
		if (hp->n_expert || (!pred && hp->act == NF_FFN_SILU))
			sp.mode = NF_SPARSE_OFF;
	}
	sp.threshold_set = mc->threshold_set;
	sp.threshold = (float)mc->threshold;
	bool streamed = mc->ffn_store || !nf_model_ffn_in_memory(mc->model);
	sp.measure_recall = mc->stats && !streamed;
	uint64_t weights = nf_model_weight_bytes(mc->model);
	mc->overhead = NF_CLI_OVERHEAD;
	if (streamed) {
		if (sp.mode == NF_SPARSE_OFF)
			sp.mode = NF_SPARSE_DENSE;
		int rc = open_cache(mc, &weights);
		if (rc != NF_EXIT_OK)
			return rc;
		sp.cache = mc->cache;
		struct nf_cache_layout cl;
		nf_cache_layout_get(mc->cache, &cl);
		/* a profile's hot set is loaded already; else learn it online */
		sp.hot_after = cl.hot_from_profile ? 0 : 4;
		if (cl.profile_error)
			nf_cli_warn("%s: the store's profile is not used (%s); the hot set is learned online",
				    mc->ffn_store ? mc->ffn_store : mc->path, nf_strerror(cl.profile_error));
	} else if (mc->profile) {
		nf_cli_err("--profile counts the neurons read through a store's cache: give -m STORE (from "
			   "`nflash import`) or --ffn-store STORE");
		return NF_EXIT_USAGE;
	}
	int rc = nf_sparse_open(mc->ctx, &sp, &mc->sparse, &d);
	if (rc < 0) {
		nf_cli_err("%s: %s", mc->path, nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	/* A GGUF held in memory: the Q4_0 matrices only dense products read
	 * go into 8-row groups (same bits, faster kernels; no-op where the
	 * kernels have none); the FFN's too when the built-in FFN runs it. */
	if (!streamed && !mc->io_mmap && !nf_model_store(mc->model)) {
		unsigned what = NF_REPACK_ATTN | NF_REPACK_OUTPUT;
		if (nf_sparse_mode_of(mc->sparse) == NF_SPARSE_OFF)
			what |= NF_REPACK_FFN;
		rc = nf_model_repack(mc->model, what);
		if (rc < 0) {
			nf_cli_err("%s: repacking Q4_0 matrices: %s", mc->path, nf_strerror(rc));
			return NF_EXIT_FAIL;
		}
	}
	mc->reserved = nf_ctx_bytes(mc->ctx) + nf_sparse_bytes(mc->sparse) + mc->profile_rec;
	if (streamed) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(mc->cache, &cl);
		char abuf[64] = "";
		if (mc->attn_streamed)
			snprintf(abuf, sizeof(abuf), " + attention buffers %.1f MiB (streamed)",
				 mib(nf_ctx_attn_stream_bytes(mc->ctx)));
		char rbuf[96] = "";
		if (mc->profile_rec)
			snprintf(rbuf, sizeof(rbuf), ", --profile's co-activation record %.1f MiB", mib(mc->profile_rec));
		fprintf(stderr,
			"nflash: memory: dense weights %.1f MiB (pinned)%s, neuron cache %.1f MiB (hot %.1f MiB / %u "
			"slots%s, cold %.1f MiB / %u slots%s%s), reserved %.1f MiB (KV cache %.1f MiB for -c %u, "
			"scratch and tables %.1f MiB%s); fixed overhead %.1f MiB\n",
			mib(weights), abuf, mib(cl.arena), mib(cl.hot), cl.hot_slots,
			cl.hot_from_profile ? " from the profile" : " learned online", mib(cl.cold), cl.cold_slots,
			cl.hugepages ? ", hugepages" : "", cl.numa ? ", NUMA-placed" : "", mib(mc->reserved),
			mib(nf_ctx_bytes_kv(mc->ctx)), nf_ctx_n_ctx(mc->ctx),
			mib(mc->reserved - mc->profile_rec - nf_ctx_bytes_kv(mc->ctx)), rbuf, mib(mc->overhead));
		weights += cl.arena + nf_ctx_attn_stream_bytes(mc->ctx);
		if (mc->budget && weights + mc->reserved > mc->budget) {
			nf_cli_err("--memory-budget %.1f MiB: the engine's tables came to %.1f MiB, more than "
				   "estimated; at least %.1f MiB needed",
				   mib(mc->budget), mib(mc->reserved), mib(weights + mc->reserved));
			return NF_EXIT_FAIL;
		}
	}
	if (mc->budget && !streamed) {
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
		fprintf(f, ", budget %.1f MiB + fixed overhead %.1f MiB", mib(mc->budget), mib(mc->overhead));
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
	if (mc->cache) {
		struct nf_cache_layout cl;
		nf_cache_layout_get(mc->cache, &cl);
		nf_json_str(j, "hot_source", cl.hot_from_profile ? "profile" : "online");
		nf_json_u64(j, "profile_tokens", cl.profile_tokens);
		nf_json_u64(j, "hot_bytes", c.hot_bytes);
		nf_json_u64(j, "hot_requests", c.hot_requests);
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
	nf_json_u64(j, "budget_bytes", mc->budget);
	nf_json_u64(j, "reserved_bytes", mc->reserved);
	nf_json_u64(j, "overhead_bytes", mc->overhead);
	nf_json_obj_end(j);
	nf_json_u64(j, "vm_hwm_bytes", nf_model_cli_vm_hwm());
}

/*
 * --io mmap runs a GGUF from its mapping; it refuses a store (-m or
 * --ffn-store) and --memory-budget (the page cache, under whatever memory
 * limit the caller sets, e.g. a cgroup, decides what stays resident).
 */
static int mmap_check(const struct nf_model_cli *mc)
{
	if (mc->ffn_store) {
		nf_cli_err("--io mmap: cannot be combined with --ffn-store (mmap mode maps the GGUF's own "
			   "weights; drop --io mmap to stream from the store)");
		return NF_EXIT_USAGE;
	}
	if (mc->budget) {
		nf_cli_err("--io mmap: cannot be combined with --memory-budget (the page cache holds the "
			   "weights; limit memory with a cgroup instead)");
		return NF_EXIT_USAGE;
	}
	unsigned char magic[4] = { 0 };
	FILE *f = fopen(mc->path, "rb");
	if (!f)
		return NF_EXIT_OK;  /* the load names the error */
	size_t n = fread(magic, 1, sizeof(magic), f);
	fclose(f);
	if (n == sizeof(magic) && memcmp(magic, "GGUF", 4) && memcmp(magic, "PWRI", 4)) {
		nf_cli_err("--io mmap: %s is not a GGUF file (a store from `nflash import` is read with "
			   "O_DIRECT through the neuron cache; mmap mode needs the GGUF)", mc->path);
		return NF_EXIT_USAGE;
	}
	return NF_EXIT_OK;
}

int nf_model_cli_open(struct nf_model_cli *mc)
{
	if (!mc->path) {
		nf_cli_err("-m MODEL is required");
		return NF_EXIT_USAGE;
	}
	struct nf_diag d = { 0 };
	double t0 = nf_cli_now();
	if (mc->io_mmap && mmap_check(mc) != NF_EXIT_OK)
		return NF_EXIT_USAGE;
	/* Streamed FFNs (--ffn-store, or a store-backed model's own) are never
	 * brought into memory: a GGUF's FFN pages are not prefaulted, a store's
	 * FFN stays in the store. The built-in FFN (--sparse-mode off, MoE)
	 * needs a store's FFN unpacked (store_unpack_ffn). */
	if (mc->io_mmap && mc->sparse_mode < 0)
		mc->sparse_mode = NF_SPARSE_OFF;
	bool off = mc->sparse_mode == NF_SPARSE_OFF;
	/* A store's attention stays in the store until the budget is sized
	 * (open_cache pins or streams it). */
	struct nf_model_opts mo = { .prefault = !mc->ffn_store && !mc->io_mmap, .store_unpack_ffn = off,
				    .store_defer_attn = !off };
	if (mc->stream_attn && (off || mc->ffn_store || mc->io_mmap)) {
		nf_cli_err("--stream-attn: needs a store (-m OUT.nfl from nflash import) whose FFN is streamed "
			   "(not --sparse-mode off, --ffn-store or --io mmap)");
		return NF_EXIT_USAGE;
	}
	int rc = nf_model_load(mc->path, &mo, &mc->model, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	if (mc->stream_attn && !nf_model_store(mc->model)) {
		nf_cli_err("--stream-attn: %s is a GGUF; attention is streamed from a store (nflash import)",
			   mc->path);
		nf_model_free(mc->model);
		mc->model = NULL;
		return NF_EXIT_USAGE;
	}
	if (mc->ffn_store && nf_model_store(mc->model)) {
		nf_cli_err("--ffn-store: %s is a store already; its own bundles are used", mc->path);
		nf_model_free(mc->model);
		mc->model = NULL;
		return NF_EXIT_USAGE;
	}
	const struct nf_model_hparams *hp = nf_model_hparams(mc->model);
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_ctx = (uint32_t)mc->n_ctx;
	cp.n_batch = mc->profile ? 1u : (uint32_t)mc->n_batch;   /* --profile counts each token */
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

/* Plan every FFN's co-activation layout from the cache's record into
 * p->order (nflash/coact.h). The head is the share of neurons the cache
 * keeps hot under this budget. Prints what the layout saves on the
 * calibration tokens themselves. Returns 0 or -ENOMEM (no order then). */
static int plan_orders(struct nf_model_cli *mc, struct nf_store *store, struct nf_store_profile *p)
{
	struct nf_cache_layout cl;
	struct nf_cache_geom g;
	nf_cache_layout_get(mc->cache, &cl);
	nf_cache_geometry(mc->cache, &g);
	uint32_t n_ffn = 0, gap = mc->read_gap >= 0 ? (uint32_t)mc->read_gap : 4;
	for (uint32_t i = 0; i < p->n_objects; i++)
		n_ffn += p->counts[i] != NULL;
	if (!n_ffn || !(p->order = calloc(p->n_objects, sizeof(*p->order))))
		return -ENOMEM;
	/* the head of each FFN: its share of the hot set a run under this
	 * budget will load (nf_cache_hot_quota), counting what only this
	 * calibration run holds (KV cache, record) as hot */
	uint32_t *quota = calloc((size_t)g.n_layer * g.n_expert, sizeof(uint32_t));
	if (!quota)
		return -ENOMEM;
	nf_cache_hot_quota(mc->cache, cl.hot_slots + mc->profile_extra / g.stride, quota);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	double by_count = 0, coact = 0;
	uint32_t tokens_max = 0, head_sum = 0, done = 0;
	struct nf_progress pr;
	nf_progress_start(&pr, "planning the layout", n_ffn, false);
	for (uint32_t i = 0; i < p->n_objects; i++) {
		const struct nf_store_object *ob = nf_store_object_get(store, i);
		if (!p->counts[i])
			continue;
		uint32_t n = p->lens[i], tokens, words;
		uint32_t head = quota[ob->layer * g.n_expert + ob->expert];
		const uint64_t *sig = nf_cache_signatures(mc->cache, ob->layer, ob->expert, &tokens, &words);
		bool ok = (p->order[i] = malloc((size_t)n * sizeof(uint32_t))) &&
			  nf_coact_order(p->counts[i], NULL, 0, n, head, p->order[i]) == 0;
		if (ok && sig && tokens)
			by_count += nf_coact_runs(sig, words, tokens, n, p->order[i], head, gap);
		if (!ok || nf_coact_order(p->counts[i], sig, words, n, head, p->order[i]) < 0) {
			nf_progress_end(&pr);
			free(quota);
			return -ENOMEM;
		}
		if (sig && tokens)
			coact += nf_coact_runs(sig, words, tokens, n, p->order[i], head, gap);
		tokens_max = tokens > tokens_max ? tokens : tokens_max;
		head_sum += head < n ? head : n;
		nf_progress_update(&pr, ++done);
	}
	nf_progress_end(&pr);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
	fprintf(stderr,
		"nflash: co-activation layout of %u FFNs planned in %.1f s from %u calibration tokens: after the "
		"%u most frequent neurons per FFN (mean), a calibration token's reads (gap %u) %.0f by count -> %.0f "
		"co-activated\n",
		n_ffn, secs, tokens_max, head_sum / n_ffn, gap, by_count, coact);
	free(quota);
	return 0;
}

int nf_model_cli_profile_save(struct nf_model_cli *mc, uint64_t tokens)
{
	if (!mc->profile || !mc->cache)
		return NF_EXIT_OK;
	struct nf_diag d = { 0 };
	struct nf_store *store = mc->store ? mc->store : nf_model_store(mc->model);
	const char *path = mc->store ? mc->ffn_store : mc->path;
	struct nf_store_profile *p = NULL;
	int rc = nf_store_profile_alloc(store, &p);
	if (rc < 0) {
		nf_cli_err("--profile: %s", nf_strerror(rc));
		return NF_EXIT_FAIL;
	}
	for (uint32_t i = 0; i < p->n_objects; i++) {
		const struct nf_store_object *ob = nf_store_object_get(store, i);
		const uint32_t *cnt = ob->kind == NF_STORE_KIND_FFN ? nf_cache_counts(mc->cache, ob->layer, ob->expert)
								      : NULL;
		if (cnt && p->counts[i])
			memcpy(p->counts[i], cnt, (size_t)p->lens[i] * sizeof(uint32_t));
	}
	enum nf_sparse_mode m = nf_sparse_mode_of(mc->sparse);
	p->source = m == NF_SPARSE_PREDICTOR ? NF_STORE_PROFILE_PREDICTOR
		    : m == NF_SPARSE_EXACT   ? NF_STORE_PROFILE_EXACT
					     : NF_STORE_PROFILE_DENSE;
	p->tokens = tokens;
	if (plan_orders(mc, store, p) < 0) {
		nf_cli_warn("--profile: no memory to plan the co-activation layout; storing counts only");
		for (uint32_t i = 0; p->order && i < p->n_objects; i++)
			free(p->order[i]);
		free(p->order);
		p->order = NULL;
	}
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	p->created_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	rc = nf_store_update_profile(path, NULL, p, &d);
	nf_store_profile_free(p);
	if (rc < 0) {
		nf_cli_err("--profile: %s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	fprintf(stderr, "nflash: profile of %llu tokens (%s mode) stored in %s\n", (unsigned long long)tokens,
		nf_sparse_mode_name(m), path);
	return NF_EXIT_OK;
}

void nf_model_cli_close(struct nf_model_cli *mc)
{
	nf_sparse_close(mc->sparse);
	mc->sparse = NULL;
	nf_cache_close(mc->cache);
	mc->cache = NULL;
	nf_store_close(mc->store);
	mc->store = NULL;
	nf_ctx_close(mc->ctx);
	nf_model_free(mc->model);
	mc->ctx = NULL;
	mc->model = NULL;
}
