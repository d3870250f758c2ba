/*
 * fuzz_seeds.c - write a small seed corpus for fuzz_gguf from real files.
 *
 *	fuzz_seeds OUTDIR FILE.gguf...
 *	fuzz_seeds --stores OUTDIR     seeds for fuzz_store and fuzz_model
 *
 * For each input it writes (1) a shrunken copy made with the nflash writer:
 * every key kept, arrays cut to 8 elements, every tensor kept with its type
 * and rank but one block per dimension, so the seed keeps the structure
 * of a real model in a few KiB; and (2) the input's first 4 KiB. Seeds are
 * generated at `make fuzz` time and never committed. The inputs are every
 * testdata GGUF, the K-quant files of ../shared/testdata/kquant included
 * (Q4_K/Q5_K/Q6_K tensors with 256-value blocks); the first input is also
 * written with its 2-D tensors as Q4_1, Q5_0 and Q5_1 (llama-quantize's
 * fallback types).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/dtype.h"
#include "nflash/engine.h"
#include "nflash/gguf.h"
#include "nflash/import.h"
#include "nflash/plan.h"
#include "nflash/store.h"
#include "nflash/synth.h"

/* as_type: 0 to keep each tensor's type, else the type of every 2-D one */
static int shrink(const char *in, const char *out, uint32_t as_type)
{
	struct nf_gguf *g;
	struct nf_gguf_writer *w;
	struct nf_diag d = {0};
	int rc = nf_gguf_open(in, 0, &g, &d);
	if (rc < 0) {
		fprintf(stderr, "fuzz_seeds: %s\n", nf_diag_msg(&d, rc));
		return rc;
	}
	rc = nf_gguf_writer_open(out, nf_gguf_is_powerinfer(g), &w, &d);
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_kv(g); i++) {
		struct nf_gguf_kv kv = *nf_gguf_kv_at(g, i);
		if (kv.type == NF_GGUF_ARRAY && kv.arr_n > 8) {
			if (kv.arr_type == NF_GGUF_STRING) {
				const char *s[8];
				for (int k = 0; k < 8; k++)
					s[k] = nf_gguf_arr_str(&kv, (uint64_t)k, NULL);
				rc = nf_gguf_writer_kv_arr_str(w, kv.key, s, 8);
				continue;
			}
			kv.arr_n = 8;
		}
		rc = nf_gguf_writer_kv_copy(w, &kv);
	}
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		uint32_t type = as_type && t->n_dims == 2 ? as_type : t->type;
		uint64_t ne[NF_GGUF_MAX_DIMS] = { nf_dtype_block_len(type), 1, 1, 1 };
		rc = nf_gguf_writer_tensor(w, t->name, type, t->n_dims, ne);
	}
	static const uint8_t zeros[512]; /* the largest block: q8_K, 292 bytes */
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		uint32_t type = as_type && t->n_dims == 2 ? as_type : t->type;
		rc = nf_gguf_writer_write(w, zeros, nf_dtype_block_size(type));
	}
	if (rc == 0)
		rc = nf_gguf_writer_finish(w, &d);
	else
		nf_gguf_writer_abort(w);
	if (rc < 0)
		fprintf(stderr, "fuzz_seeds: %s: %s\n", out, nf_diag_msg(&d, rc));
	nf_gguf_close(g);
	return rc;
}

static int head(const char *in, const char *out)
{
	FILE *f = fopen(in, "rb"), *o = fopen(out, "wb");
	char buf[4096];
	size_t n = f ? fread(buf, 1, sizeof(buf), f) : 0;
	int rc = (f && o && fwrite(buf, 1, n, o) == n) ? 0 : -1;
	if (f)
		fclose(f);
	if (o && fclose(o))
		rc = -1;
	return rc;
}

/* Stores with a plan (docs/PLAN.md, FORMAT.md item 20), as `nflash plan
 * STORE --memory-budget B` writes one: the tiny model imported again and
 * planned for two budgets (device and kernels measured for half a second,
 * calibrated on 16 tokens, laid out in the profile's order), and a fake
 * store holding that same plan (small enough for fuzz_store's length cap). */
static int plan_seeds(const char *dir, const struct nf_store_fake_opts *fo, struct nf_diag *d)
{
	char gguf[4096], store[4096], fake[4096];
	snprintf(gguf, sizeof(gguf), "%s/model.gguf", dir);
	snprintf(store, sizeof(store), "%s/model-plan.nfs", dir);
	snprintf(fake, sizeof(fake), "%s/fake-plan.nfs", dir);
	struct nf_import_opts io;
	nf_import_opts_default(&io);
	io.block_size = 512;
	io.extent_bundles = 8;
	int rc = nf_import(gguf, store, &io, NULL, d);
	if (rc < 0)
		return rc;
	/* budgets above what this process holds: the planner counts it as overhead */
	uint64_t base = nf_engine_overhead_now() >> 20 << 20;
	uint64_t budgets[2] = { base + (64ull << 20), base + (128ull << 20) };
	struct nf_plan_opts po;
	nf_plan_opts_default(&po);
	po.store = store;
	po.budgets = budgets;
	po.n_budgets = 2;
	po.calib_tokens = 16;
	po.n_threads = 1;
	po.device.seconds = 0.5;
	struct nf_store_plan *p = NULL;
	if ((rc = nf_plan_run(&po, &p, d)) < 0)
		return rc;
	if ((rc = nf_store_fake_create(fake, fo, d)) == 0)
		rc = nf_store_update_plan(fake, NULL, p, d);
	nf_store_plan_free(p);
	return rc;
}

/* Small real stores (block size 512, so a few KiB each): a fake one, the
 * same with a profile, tiny synthetic models as GGUF (llama.cpp and
 * PowerInfer flavours) and as imported stores, and two with a plan. */
static int stores(const char *dir)
{
	char p[4096], q[4096];
	struct nf_diag d = {0};
	struct nf_store_fake_opts fo;
	nf_store_fake_opts_default(&fo);
	fo.dim = 32;
	fo.ffn = 40;
	fo.vocab = 8;
	fo.dtype = NF_DTYPE_Q8_0;
	fo.create.block_size = 512;
	fo.create.extent_bundles = 4;
	snprintf(p, sizeof(p), "%s/fake.nfs", dir);
	int rc = nf_store_fake_create(p, &fo, &d);
	snprintf(q, sizeof(q), "%s/fake-profile.nfs", dir);
	if (rc == 0)
		rc = nf_store_fake_create(q, &fo, &d);
	struct nf_store *s = NULL;
	struct nf_store_profile *prof = NULL;
	if (rc == 0 && (rc = nf_store_open(q, NULL, &s, &d)) == 0 &&
	    (rc = nf_store_profile_alloc(s, &prof)) == 0) {
		for (uint32_t i = 0; i < prof->n_objects; i++)
			for (uint32_t j = 0; j < prof->lens[i]; j++)
				prof->counts[i][j] = (j * 7 + i) % 11;
		prof->tokens = 3;
		rc = nf_store_update_profile(q, NULL, prof, &d);
	}
	nf_store_profile_free(prof);
	nf_store_close(s);
	for (int pred = 0; rc == 0 && pred < 2; pred++) {
		struct nf_synth_params sp;
		nf_synth_params_init(&sp);
		sp.shape = "custom";
		sp.n_embd = 128;
		sp.n_ff = 128;
		sp.dtype = NF_DTYPE_Q4_0;
		sp.n_layer = 1;
		sp.n_head = 4;
		sp.n_head_kv = 4;
		sp.n_vocab = 259;
		sp.n_ctx = 32;
		sp.pred_rank = 4;
		sp.predictor = pred;
		snprintf(p, sizeof(p), "%s/model%s.gguf", dir, pred ? "-pwri" : "");
		if ((rc = nf_synth_validate(&sp, &d)) < 0 || (rc = nf_synth_write(&sp, p, &d)) < 0)
			break;
		snprintf(q, sizeof(q), "%s/model%s.nfs", dir, pred ? "-pwri" : "");
		struct nf_import_opts io;
		nf_import_opts_default(&io);
		io.block_size = 512;
		io.extent_bundles = 8;
		rc = nf_import(p, q, &io, NULL, &d);
	}
	if (rc == 0)
		rc = plan_seeds(dir, &fo, &d);
	if (rc < 0)
		fprintf(stderr, "fuzz_seeds: %s\n", nf_diag_msg(&d, rc));
	return rc < 0;
}

int main(int argc, char **argv)
{
	if (argc == 3 && !strcmp(argv[1], "--stores"))
		return stores(argv[2]);
	if (argc < 3) {
		fprintf(stderr, "usage: fuzz_seeds OUTDIR FILE.gguf...\n");
		return 2;
	}
	for (int i = 2; i < argc; i++) {
		const char *base = strrchr(argv[i], '/');
		base = base ? base + 1 : argv[i];
		char out[4096];
		snprintf(out, sizeof(out), "%s/small-%s", argv[1], base);
		if (shrink(argv[i], out, 0) < 0)
			return 1;
		static const uint32_t legacy[] = { NF_DTYPE_Q4_1, NF_DTYPE_Q5_0, NF_DTYPE_Q5_1 };
		for (size_t k = 0; i == 2 && k < 3; k++) {
			snprintf(out, sizeof(out), "%s/small-%s-%s", argv[1], nf_dtype_name(legacy[k]), base);
			if (shrink(argv[i], out, legacy[k]) < 0)
				return 1;
		}
		snprintf(out, sizeof(out), "%s/head-%s", argv[1], base);
		if (head(argv[i], out) < 0)
			return 1;
	}
	return 0;
}
