/*
 * test_pipeline_attnstream.c - attention streamed from the store per layer
 * (nf_ctx_stream_attn, `--stream-attn`, and automatically when the pinned
 * dense weights exceed --memory-budget):
 *  - the streamed output equals the pinned output (logits within 1e-5, the
 *    same greedy tokens) for every model in ../shared/testdata, imported;
 *  - with more layers than buffers every layer is re-read every step, and
 *    with as many buffers as layers nothing is read twice;
 *  - a deferred, unstreamed attention refuses to run;
 *  - an I/O error (fault backend) or a corrupt attention object fails the
 *    eval with that error, and the next evals too, without a crash;
 *  - the CLI: a budget below the dense weights streams, states its
 *    minimum when even streaming does not fit, and stays within budget +
 *    the printed overhead (VmHWM) at that minimum; --stream-attn gives the
 *    same tokens as pinned attention.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/import.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "nflash/cache.h"
#include "nflash/stream.h"
#include "nflash/synth.h"
#include "util_pipeline.h"

#define TD "../shared/testdata/"
#define N_GREEDY 16
#define MAX_VOCAB 512

static const char *const models[] = {
	TD "models/tiny-llama-f32.gguf",  TD "models/tiny-llama-f16.gguf",
	TD "models/tiny-llama-q8_0.gguf", TD "models/tiny-llama-q4_0.gguf",
	TD "models/tiny-moe-f32.gguf",    TD "powerinfer/tiny-relullama-ff1024-f32.pwri.gguf",
};

static struct nf_model *load(const char *path, bool defer)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	struct nf_model_opts o = { .prefault = true, .store_unpack_ffn = true, .store_defer_attn = defer };
	int rc = nf_model_load(path, &o, &m, &d);
	cr_assert_eq(rc, 0, "%s: %s", path, nf_diag_msg(&d, rc));
	return m;
}

static void stream(struct nf_ctx *c, uint32_t n_slots, const struct nf_io_fault_opts *fault)
{
	struct nf_stream_opts o;
	struct nf_diag d = { 0 };
	nf_stream_opts_default(&o);
	o.n_slots = n_slots;
	/* the stream reads through the model's cache, on its I/O context:
	 * a fresh one (a fault backend's, or the default, which also clears
	 * an earlier run's sticky error) */
	struct nf_io_opts io;
	nf_io_opts_default(&io);
	if (fault) {
		io.backend = NF_IO_FAULT;
		io.fault = *fault;
	}
	int rc = nf_cache_reopen_io(nf_model_cache(nf_ctx_model(c)), &io, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	rc = nf_ctx_stream_attn(c, &o, &d);
	cr_assert_eq(rc, 0, "stream: %s", nf_diag_msg(&d, rc));
}

/* An 8-layer model whose attention (about 96 MiB) is most of its dense
 * weights, as a 7B model's is; path receives the store. */
static void make_deep(char *gguf, size_t glen, char *store, size_t slen)
{
	struct nf_synth_params p;
	struct nf_diag d = { 0 };
	nf_synth_params_init(&p);
	cr_assert_eq(nf_synth_shape(&p, "tiny", &d), 0);
	p.n_embd = 1024;
	p.n_ff = 1024;
	p.n_layer = 8;
	p.n_head = 8;
	p.n_head_kv = 4;
	p.dtype = NF_DTYPE_F32;
	p.n_threads = 2;
	cr_assert_eq(nf_synth_validate(&p, &d), 0, "%s", d.msg);
	pl_tmp_path(gguf, glen, "as-gguf");
	cr_assert_eq(nf_synth_write(&p, gguf, &d), 0, "%s", d.msg);
	pl_tmp_path(store, slen, "as-store");
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	struct nf_import_report r;
	int rc = nf_import(gguf, store, &o, &r, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
}

Test(pipeline, attn_streamed_equals_pinned_for_every_testdata_model)
{
	for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
		char store[256];
		pl_import(models[i], store, sizeof(store));
		struct nf_model *pinned = load(store, false), *deferred = load(store, true);
		cr_assert(nf_model_attn_in_memory(pinned) && !nf_model_attn_in_memory(deferred));
		uint32_t nv = nf_model_hparams(pinned)->n_vocab, L = nf_model_hparams(pinned)->n_layer;
		cr_assert_leq(nv, MAX_VOCAB);
		struct nf_ctx *a = pl_open_ctx(pinned, 2), *b = pl_open_ctx(deferred, 2);
		/* the same model's own pinned attention, streamed anyway */
		struct nf_ctx *c = pl_open_ctx(pinned, 1);
		stream(b, 2, NULL);
		stream(c, 3, NULL);
		cr_expect_eq(nf_ctx_attn_stream_bytes(b), nf_model_attn_stream_bytes(deferred, 2));
		cr_expect_geq(nf_ctx_attn_stream_bytes(b), 2 * nf_model_attn_bytes(deferred) / L);
		float la[MAX_VOCAB], lb[MAX_VOCAB], lc[MAX_VOCAB];
		int32_t ga[N_GREEDY], gb[N_GREEDY], gc[N_GREEDY];
		pl_run(a, pl_prompt, 8, la, ga, N_GREEDY);
		pl_run(b, pl_prompt, 8, lb, gb, N_GREEDY);
		pl_run(c, pl_prompt, 8, lc, gc, N_GREEDY);
		double db = pl_max_diff(la, lb, nv), dc = pl_max_diff(la, lc, nv);
		cr_expect(db <= 1e-5 && dc <= 1e-5, "%s: streamed logits differ by %g / %g", models[i], db, dc);
		cr_expect_arr_eq(ga, gb, sizeof(ga), "%s: greedy tokens differ (2 buffers)", models[i]);
		cr_expect_arr_eq(ga, gc, sizeof(ga), "%s: greedy tokens differ (3 buffers)", models[i]);
		/* 2 layers, 2 buffers: each layer read once, then kept */
		struct nf_stream_stats st;
		cr_assert(nf_ctx_attn_stats(b, &st));
		cr_expect_eq(st.groups_read, L, "%s: %llu layer reads for %u layers", models[i],
			     (unsigned long long)st.groups_read, L);
		cr_expect_eq(st.acquires, (uint64_t)L * N_GREEDY);
		nf_ctx_close(a);
		nf_ctx_close(b);
		nf_ctx_close(c);
		nf_model_free(pinned);
		nf_model_free(deferred);
		unlink(store);
	}
}

Test(pipeline, attn_streamed_rereads_each_layer_every_step)
{
	char gguf[256], store[256];
	make_deep(gguf, sizeof(gguf), store, sizeof(store));
	struct nf_model *pinned = load(store, false), *deferred = load(store, true);
	uint32_t nv = nf_model_hparams(pinned)->n_vocab, L = nf_model_hparams(pinned)->n_layer;
	/* not streamed, not loaded: refuses to run */
	struct nf_ctx *b = pl_open_ctx(deferred, 2);
	int32_t id = 1;
	cr_expect_eq(nf_ctx_eval(b, &id, 1), NF_EUNSUPPORTED);
	nf_ctx_reset(b);
	stream(b, 2, NULL);
	struct nf_ctx *a = pl_open_ctx(pinned, 2);
	float la[MAX_VOCAB], lb[MAX_VOCAB];
	int32_t ga[4], gb[4];
	pl_run(a, pl_prompt, 8, la, ga, 4);
	pl_run(b, pl_prompt, 8, lb, gb, 4);
	double diff = pl_max_diff(la, lb, nv);
	cr_expect(diff <= 1e-5, "streamed logits differ by %g", diff);
	cr_expect_arr_eq(ga, gb, sizeof(ga));
	/* 4 forward steps of 8 layers with 2 buffers: every layer of every
	 * step read (the last release prefetches the next step's first) */
	struct nf_stream_stats st;
	cr_assert(nf_ctx_attn_stats(b, &st));
	cr_expect_geq(st.groups_read, 4ull * L);
	cr_expect_leq(st.groups_read, 4ull * L + 2);
	cr_expect_geq(st.bytes_read, 4 * nf_model_attn_bytes(deferred));
	/* the first 3 layers pinned, the other 5 streamed: same output, 5
	 * layers read a step */
	struct nf_model *part = load(store, true);
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_model_attn_load(part, 3, &d), 0, "%s", d.msg);
	cr_expect_eq(nf_model_attn_layers_in_memory(part), 3);
	cr_expect(!nf_model_attn_in_memory(part));
	struct nf_ctx *p = pl_open_ctx(part, 2);
	stream(p, 2, NULL);
	pl_run(p, pl_prompt, 8, lb, gb, 4);
	cr_expect(pl_max_diff(la, lb, nv) <= 1e-5);
	cr_expect_arr_eq(ga, gb, sizeof(ga));
	cr_assert(nf_ctx_attn_stats(p, &st));
	cr_expect_geq(st.groups_read, 4ull * (L - 3));
	cr_expect_leq(st.groups_read, 4ull * (L - 3) + 2);
	cr_expect_eq(st.acquires, 4ull * (L - 3));
	nf_ctx_close(p);
	nf_model_free(part);
	/* attention now loaded into memory: runs without a stream, same output */
	cr_assert_eq(nf_model_attn_load(deferred, UINT32_MAX, &d), 0, "%s", d.msg);
	struct nf_ctx *c = pl_open_ctx(deferred, 2);
	pl_run(c, pl_prompt, 8, lb, gb, 4);
	cr_expect(pl_max_diff(la, lb, nv) <= 1e-5);
	cr_expect_arr_eq(ga, gb, sizeof(ga));
	nf_ctx_close(a);
	nf_ctx_close(b);
	nf_ctx_close(c);
	nf_model_free(pinned);
	nf_model_free(deferred);
	unlink(gguf);
	unlink(store);
}

Test(pipeline, attn_stream_read_errors_fail_the_eval)
{
	char store[256];
	pl_import(models[0], store, sizeof(store));
	struct nf_model *m = load(store, true);

	/* EIO on the 6th read: layer 1's attention during the first eval */
	struct nf_io_fault_opts f = { .inner = NF_IO_AUTO, .n_rules = 1 };
	f.rules[0] = (struct nf_io_fault_rule){ .kind = NF_IO_FAULT_EIO, .nth = 5 };
	struct nf_ctx *c = pl_open_ctx(m, 2);
	stream(c, 2, &f);
	int rc = nf_ctx_eval(c, pl_prompt, 8);
	cr_expect_eq(rc, -EIO, "eval returned %d (%s)", rc, nf_strerror(rc));
	int32_t id = 1;
	cr_expect_eq(nf_ctx_eval(c, &id, 1), -EIO, "the error does not stick");
	nf_ctx_close(c);

	/* a corrupt attention object: its checksum fails the eval */
	const struct nf_store_object *o = nf_store_object_find(nf_model_store(m), "blk.1.attn_k.weight");
	cr_assert_not_null(o);
	int fd = open(store, O_RDWR);
	cr_assert_geq(fd, 0);
	unsigned char byte;
	cr_assert_eq(pread(fd, &byte, 1, (off_t)(o->offset + 100)), 1);
	byte ^= 0x40;
	cr_assert_eq(pwrite(fd, &byte, 1, (off_t)(o->offset + 100)), 1);
	cr_assert_eq(fsync(fd), 0);
	close(fd);
	c = pl_open_ctx(m, 2);
	stream(c, 2, NULL);
	rc = nf_ctx_eval(c, pl_prompt, 8);
	cr_expect_eq(rc, NF_ECHECKSUM, "eval returned %d (%s)", rc, nf_strerror(rc));
	nf_ctx_close(c);
	nf_model_free(m);
	unlink(store);
}

/* The "ids" array of generate's JSON, as a string. */
static void json_ids(const char *json, char *out, size_t len)
{
	const char *at = strstr(json, "\"ids\":[");
	cr_assert_not_null(at, "no ids in %s", json);
	const char *end = strchr(at, ']');
	cr_assert_not_null(end);
	snprintf(out, len, "%.*s", (int)(end - at), at);
}

Test(pipeline, attn_streamed_under_a_budget_below_the_dense_weights)
{
	if (access(PL_NFLASH, X_OK) != 0)
		cr_skip_test("%s is not built", PL_NFLASH);
	char gguf[256], store[256], args[1024], ids_a[512], ids_b[512];
	make_deep(gguf, sizeof(gguf), store, sizeof(store));
	struct nf_model *m = load(store, true);
	unsigned long long attn = nf_model_attn_bytes(m), dense = nf_model_weight_bytes(m) + attn;
	nf_model_free(m);
	static char out[1 << 16], err[1 << 16];
	const char *ids = "1,278,263,13,300,72,101,259";

	/* even streaming cannot fit: refused, with the streaming minimum */
	snprintf(args, sizeof(args), "generate -m %s --ids %s -n 4 --temp 0 --ignore-eos -c 64 -t 2 "
		 "--memory-budget 20M --json", store, ids);
	int rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_expect_eq(rc, 1, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "even with attention streamed"), "%s", err);
	const char *at = strstr(err, "at least ");
	cr_assert_not_null(at, "no minimum in: %s", err);
	double min_mib = strtod(at + 9, NULL);
	cr_assert(min_mib > 20.0 && min_mib * 1048576.0 < (double)dense,
		  "minimum %.1f MiB, dense weights %llu bytes", min_mib, dense);

	/* the minimum (rounded up) runs, streamed, within budget + overhead */
	unsigned long long budget = (unsigned long long)(min_mib + 1.0) << 20;
	snprintf(args, sizeof(args), "generate -m %s --ids %s -n 4 --temp 0 --ignore-eos -c 64 -t 2 "
		 "--memory-budget %llu --json", store, ids, budget);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "attention streamed from the store"), "not said at start: %s", err);
	cr_expect(strstr(out, "\"attn_streamed\":true"), "%s", out);
	unsigned long long hwm = pl_json_u64(out, "vm_hwm_bytes"), over = pl_json_u64(out, "overhead_bytes");
	cr_expect(hwm <= budget + over, "VmHWM %llu > budget %llu + overhead %llu", hwm, budget, over);
	cr_expect(hwm < dense, "VmHWM %llu is not below the dense weights' %llu bytes: proves nothing",
		  hwm, dense);
	cr_expect(pl_json_u64(out, "attn_bytes_read") >= 4 * attn, "%s", out);
	json_ids(out, ids_a, sizeof(ids_a));

	/* pinned (no budget) gives the same tokens; --stream-attn too */
	snprintf(args, sizeof(args), "generate -m %s --ids %s -n 4 --temp 0 --ignore-eos -c 64 -t 2 --json",
		 store, ids);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "exit %d: %s", rc, err);
	cr_expect(strstr(out, "\"attn_streamed\":false"), "%s", out);
	json_ids(out, ids_b, sizeof(ids_b));
	cr_expect_str_eq(ids_a, ids_b);
	snprintf(args, sizeof(args), "generate -m %s --ids %s -n 4 --temp 0 --ignore-eos -c 64 -t 2 "
		 "--stream-attn --json", store, ids);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "exit %d: %s", rc, err);
	cr_expect(strstr(out, "\"attn_streamed\":true"), "%s", out);
	json_ids(out, ids_b, sizeof(ids_b));
	cr_expect_str_eq(ids_a, ids_b);

	/* --stream-attn on a GGUF is a usage error */
	snprintf(args, sizeof(args), "generate -m %s --ids %s -n 1 --stream-attn", gguf, ids);
	rc = pl_run_cli(args, out, sizeof(out), err, sizeof(err));
	cr_expect_eq(rc, 2, "exit %d: %s", rc, err);
	cr_expect(strstr(err, "--stream-attn"), "%s", err);
	unlink(gguf);
	unlink(store);
}
