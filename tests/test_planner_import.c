/*
 * test_planner_import.c - `nflash import` and models served from a store:
 * every testdata model imported and verified; store-backed logits equal to
 * the GGUF's bit for bit (FFN unpacked by the load option); the FFN seam
 * (nf_model_ffn_layout) matching the GGUF's bundles; a store-backed model
 * without a provider refusing to run; damage caught; interrupted imports
 * and bad input leaving nothing behind, with errors naming the tensor.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/bundle.h"
#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/import.h"
#include "nflash/io.h"
#include "nflash/model.h"
#include "nflash/store.h"
#include "../storage/store_format.h"
#include "util_ref.h"
#include "util_storage.h"

int nf_cmd_import(int argc, char **argv);

#define TD "../shared/testdata/"
static const char *const models[] = {
	"models/tiny-llama-f32", "models/tiny-llama-f16", "models/tiny-llama-q8_0",
	"models/tiny-llama-q4_0", "models/tiny-moe-f32", "models/tiny-moe-q8_0",
	"powerinfer/tiny-relullama-ff1024-f32.pwri",
};
#define N_MODELS (sizeof(models) / sizeof(models[0]))

static void gguf_path(size_t i, char *buf, size_t n)
{
	snprintf(buf, n, TD "%s.gguf", models[i]);
}

static void import_ok(const char *in, const char *out, uint32_t extent, uint32_t align,
		      struct nf_import_report *r)
{
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	o.extent_bundles = extent;
	o.block_size = align;
	struct nf_diag d = { 0 };
	int rc = nf_import(in, out, &o, r, &d);
	cr_assert_eq(rc, 0, "import %s: %s", in, nf_diag_msg(&d, rc));
}

/* ---- import of every model ------------------------------------------------- */

Test(import, every_testdata_model_imports_and_verifies)
{
	for (size_t m = 0; m < N_MODELS; m++) {
		struct ts_dir t;
		char in[256];
		gguf_path(m, in, sizeof(in));
		cr_assert(ts_dir_make(&t, "/tmp"));
		struct nf_import_report r;
		/* Odd extent sizes and both alignments. */
		import_ok(in, t.path, m % 2 ? 5 : 16, m % 3 ? 4096 : 512, &r);

		struct nf_gguf *g;
		struct nf_diag d = { 0 };
		cr_assert_eq(nf_gguf_open(in, NF_GGUF_MMAP, &g, &d), 0);
		struct nf_store *s;
		cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
		uint32_t nx = r.n_expert ? r.n_expert : 1;
		cr_assert_eq(r.n_layer, 2, "%s", in);
		cr_assert_eq(r.n_ffn, r.n_layer * nx);
		cr_assert_eq(nf_store_info(s)->n_ffn, r.n_ffn);
		cr_assert_eq(r.powerinfer, strstr(in, "pwri") != NULL);
		cr_assert_eq(r.verified_bytes, r.meta_bytes + r.dense_bytes + r.ffn_bytes);
		cr_assert_eq(r.n_scales, r.n_qcol);
		cr_assert_eq(r.n_qcol > 0, strstr(in, "q8_0") || strstr(in, "q4_0"));
		/* One dense object per non-FFN tensor, same type and shape. */
		size_t n_dense = 0;
		for (size_t i = 0; i < nf_gguf_n_tensors(g); i++) {
			const struct nf_gguf_tensor *gt = nf_gguf_tensor_at(g, i);
			const struct nf_store_object *o = nf_store_object_find(s, gt->name);
			if (strstr(gt->name, ".ffn_gate.") || strstr(gt->name, ".ffn_up.") ||
			    strstr(gt->name, ".ffn_down") || strstr(gt->name, "_exps.")) {
				cr_assert_null(o, "%s: FFN tensor %s stored dense", in, gt->name);
				continue;
			}
			n_dense++;
			cr_assert(o && o->kind == NF_STORE_KIND_DENSE, "%s: %s missing", in, gt->name);
			cr_assert_eq(o->dtype, gt->type);
			cr_assert_eq(o->length, gt->size);
			for (uint32_t k = 0; k < gt->n_dims; k++)
				cr_assert_eq(o->shape[k], gt->ne[k]);
		}
		cr_assert_eq(r.n_dense, n_dense);
		/* Every FFN object's layout is the GGUF's bundle layout. */
		for (uint32_t l = 0; l < r.n_layer; l++)
			for (uint32_t e = 0; e < nx; e++) {
				const struct nf_store_object *o = nf_store_ffn_find(s, l, e);
				cr_assert_not_null(o, "%s: FFN %u/%u", in, l, e);
				cr_assert_eq(o->extent_bundles, m % 2 ? 5u : 16u);
				cr_assert_eq(o->down_transposed, r.powerinfer);
				cr_assert_eq(o->down_form == NF_DOWN_QCOL, nf_store_ffn_scales(s, o) != NULL);
			}
		nf_store_close(s);
		nf_gguf_close(g);

		static char out[1 << 16];
		char *argv[] = { "store", "verify", t.path, NULL };
		cr_assert_eq(ts_run_store_cmd(argv, out, sizeof(out)), 0, "%s: %s", in, out);
		char *insp[] = { "store", "inspect", "--json", t.path, NULL };
		cr_assert_eq(ts_run_store_cmd(insp, out, sizeof(out)), 0, "%s: %s", in, out);
		cr_assert(strstr(out, "\"kind\": \"blob\"") && strstr(out, "\"kind\": \"ffn\""), "%s", out);
		cr_assert_eq(strstr(out, "\"down_form\": \"qcol\"") != NULL, r.n_qcol > 0, "%s", in);
		cr_assert_eq(ts_dir_count(&t), 1, "%s: temporary files left", in);
		ts_dir_remove(&t);
	}
}

Test(import, metadata_blob_holds_every_key)
{
	struct ts_dir t;
	char in[256];
	gguf_path(6, in, sizeof(in));
	cr_assert(ts_dir_make(&t, "/tmp"));
	import_ok(in, t.path, 16, 4096, NULL);
	struct nf_model *m;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_model_load(t.path, NULL, &m, &d), 0, "%s", d.msg);
	struct nf_gguf *g;
	cr_assert_eq(nf_gguf_open(in, 0, &g, &d), 0);
	const struct nf_gguf *mg = nf_model_gguf(m);
	cr_assert_eq(nf_gguf_n_kv(mg), nf_gguf_n_kv(g));
	cr_assert(nf_gguf_is_powerinfer(mg), "the PWRI flavour is kept");
	cr_assert_eq(nf_gguf_n_tensors(mg), 0);
	for (size_t i = 0; i < nf_gguf_n_kv(g); i++) {
		const struct nf_gguf_kv *a = nf_gguf_kv_at(g, i), *b = nf_gguf_kv_at(mg, i);
		cr_assert_str_eq(a->key, b->key);
		cr_assert_eq(a->type, b->type, "%s", a->key);
		cr_assert_eq(a->arr_n, b->arr_n, "%s", a->key);
	}
	cr_assert(nf_model_hparams(m)->powerinfer);
	nf_gguf_close(g);
	nf_model_free(m);
	ts_dir_remove(&t);
}

/* ---- store-backed models ---------------------------------------------------- */

static void eval_logits(const char *path, bool unpack, const struct nf_ref *ref, float *logits,
			int32_t *greedy, size_t n_greedy)
{
	struct nf_model_opts mo = { .prefault = true, .store_unpack_ffn = unpack };
	struct nf_model *m;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_model_load(path, &mo, &m, &d), 0, "%s: %s", path, d.msg);
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_threads = 1;
	cp.n_ctx = 64;
	struct nf_ctx *c;
	cr_assert_eq(nf_ctx_open(m, &cp, &c, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_ctx_eval(c, ref->input, ref->n_input), 0);
	uint32_t nv = nf_model_hparams(m)->n_vocab;
	memcpy(logits, nf_ctx_logits(c), nv * sizeof(float));
	for (size_t i = 0; i < n_greedy; i++) {
		const float *lg = nf_ctx_logits(c);
		int32_t best = 0;
		for (uint32_t k = 1; k < nv; k++)
			if (lg[k] > lg[best])
				best = (int32_t)k;
		greedy[i] = best;
		cr_assert_eq(nf_ctx_eval(c, &best, 1), 0);
	}
	nf_ctx_close(c);
	nf_model_free(m);
}

Test(import, store_logits_equal_gguf_logits_bit_for_bit)
{
	for (size_t i = 0; i < N_MODELS; i++) {
		char in[256], refp[256];
		gguf_path(i, in, sizeof(in));
		snprintf(refp, sizeof(refp), TD "%s.ref.txt", models[i]);
		struct nf_ref ref;
		struct nf_diag d = { 0 };
		cr_assert_eq(nf_ref_load(refp, &ref, &d), 0, "%s", d.msg);
		struct ts_dir t;
		cr_assert(ts_dir_make(&t, "/tmp"));
		import_ok(in, t.path, 16, 4096, NULL);
		float *a = calloc(ref.n_vocab, sizeof(float)), *b = calloc(ref.n_vocab, sizeof(float));
		int32_t ga[6], gb[6];
		eval_logits(in, false, &ref, a, ga, 6);
		eval_logits(t.path, true, &ref, b, gb, 6);
		cr_assert(memcmp(a, b, ref.n_vocab * sizeof(float)) == 0,
			  "%s: store-backed logits differ from the GGUF's", in);
		cr_assert(memcmp(ga, gb, sizeof(ga)) == 0, "%s: greedy continuations differ", in);
		free(a);
		free(b);
		nf_ref_free(&ref);
		ts_dir_remove(&t);
	}
}

Test(import, ffn_seam_matches_the_gguf_bundles_and_builtin_refuses)
{
	for (size_t i = 0; i < N_MODELS; i++) {
		char in[256];
		gguf_path(i, in, sizeof(in));
		struct ts_dir t;
		cr_assert(ts_dir_make(&t, "/tmp"));
		import_ok(in, t.path, 8, 4096, NULL);
		struct nf_model *gm, *sm;
		struct nf_diag d = { 0 };
		cr_assert_eq(nf_model_load(in, NULL, &gm, &d), 0);
		cr_assert_eq(nf_model_load(t.path, NULL, &sm, &d), 0, "%s", d.msg);
		cr_assert_null(nf_model_store(gm));
		cr_assert_eq(nf_model_ffn_layout(gm, 0, 0, NULL, NULL, NULL, NULL), NF_ENOTFOUND);
		cr_assert_not_null(nf_model_store(sm));
		cr_assert(nf_model_ffn_in_memory(gm) && !nf_model_ffn_in_memory(sm));
		const struct nf_model_hparams *hp = nf_model_hparams(gm);
		uint32_t nx = hp->n_expert ? hp->n_expert : 1;
		cr_assert_eq(nf_model_ffn_layout(sm, hp->n_layer, 0, NULL, NULL, NULL, NULL), NF_EUSAGE);
		cr_assert_eq(nf_model_ffn_layout(sm, 0, nx, NULL, NULL, NULL, NULL), NF_EUSAGE);
		for (uint32_t l = 0; l < hp->n_layer; l++) {
			const struct nf_layer_weights *L = nf_model_layer(gm, l);
			/* The store-backed model binds no FFN matrix, but everything else. */
			const struct nf_layer_weights *S = nf_model_layer(sm, l);
			cr_assert_null(S->up.data);
			cr_assert_null(S->up_exps.data);
			cr_assert(memcmp(S->wq.data, L->wq.data, L->wq.row_bytes * L->wq.nrows) == 0);
			cr_assert_eq(S->fc1.data != NULL, L->fc1.data != NULL);
			for (uint32_t e = 0; e < nx; e++) {
				struct nf_weight g = hp->n_expert ? L->gate_exps : L->gate;
				struct nf_weight u = hp->n_expert ? L->up_exps : L->up;
				struct nf_weight dn = hp->n_expert ? L->down_exps : L->down;
				struct nf_bundle_src src = {
					.gate = (const uint8_t *)g.data + e * g.expert_bytes,
					.up = (const uint8_t *)u.data + e * u.expert_bytes,
					.down = dn.data ? (const uint8_t *)dn.data + e * dn.expert_bytes : NULL,
					.down_t = dn.data ? NULL : L->down_t.data,
					.dtype_gate_up = u.dtype,
					.dtype_down = dn.data ? dn.dtype : L->down_t.dtype,
					.n_embd = hp->n_embd, .n_ff = hp->n_ff,
				};
				struct nf_bundle_layout want, got;
				cr_assert_eq(nf_bundle_layout_make(&src, 4096, &want), 0);
				const struct nf_store_object *obj;
				const uint16_t *scales;
				bool dt;
				cr_assert_eq(nf_model_ffn_layout(sm, l, e, &obj, &got, &scales, &dt), 0);
				cr_assert(ts_same_layout(&want, &got), "%s L%u E%u layout", in, l, e);
				cr_assert_eq(obj->layer, l);
				cr_assert_eq(obj->expert, e);
				cr_assert_eq(dt, src.down_t != NULL);
				if (want.down_form == NF_DOWN_QCOL) {
					uint16_t *sc = malloc((size_t)hp->n_ff / 32 * hp->n_embd * 2);
					nf_bundle_pack_scales(&src, sc);
					cr_assert(scales && memcmp(sc, scales, (size_t)hp->n_ff / 32 * hp->n_embd * 2) == 0);
					free(sc);
				} else {
					cr_assert_null(scales);
				}
			}
		}
		/* No FFN provider: eval refuses cleanly instead of crashing. */
		struct nf_ctx_params cp = nf_ctx_defaults();
		cp.n_threads = 1;
		cp.n_ctx = 16;
		struct nf_ctx *c;
		cr_assert_eq(nf_ctx_open(sm, &cp, &c, &d), 0, "%s", d.msg);
		int32_t id = 1;
		cr_assert_eq(nf_ctx_eval(c, &id, 1), NF_EUNSUPPORTED);
		nf_ctx_close(c);
		nf_model_free(sm);
		nf_model_free(gm);
		ts_dir_remove(&t);
	}
}

/* Copy store `in` to `out` with every FFN's bundles in reverse slot order
 * and the permutation saying so: the maths must not change. */
static void copy_reversed(const char *in, const char *out)
{
	struct nf_store *s;
	struct nf_store_writer *w;
	struct nf_io_ctx *io;
	struct nf_io_opts io_o;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(in, NULL, &s, &d), 0);
	nf_io_opts_default(&io_o);
	io_o.quiet = true;
	cr_assert_eq(nf_io_ctx_open(s, &io_o, &io, &d), 0);
	struct nf_store_create_opts co = { .block_size = nf_store_info(s)->block_size };
	cr_assert_eq(nf_store_writer_open(out, &co, &w, &d), 0);
	uint32_t n = nf_store_object_count(s);
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		if (o->kind == NF_STORE_KIND_BLOB) {
			cr_assert_eq(nf_store_writer_add_blob(w, o->name, o->length, &d), 0);
		} else if (o->kind == NF_STORE_KIND_DENSE) {
			cr_assert_eq(nf_store_writer_add_dense(w, o->name, o->dtype, o->n_dims, o->shape, &d), 0);
		} else {
			struct nf_bundle_layout L;
			nf_store_ffn_layout(o, &L);
			cr_assert_eq(nf_store_writer_add_ffn_layout(w, o->name, o->layer, o->expert, &L,
								    o->down_transposed, o->extent_bundles, &d), 0);
			uint32_t *perm = malloc(o->n_bundles * sizeof(*perm));
			for (uint32_t k = 0; k < o->n_bundles; k++)
				perm[k] = o->n_bundles - 1 - o->perm[k];
			cr_assert_eq(nf_store_writer_set_perm(w, i, perm, &d), 0, "%s", d.msg);
			free(perm);
		}
	}
	cr_assert_eq(nf_store_writer_begin(w, &d), 0);
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		uint8_t *buf = nf_io_buf_alloc(nf_store_object_buf_size(o, co.block_size), 4096);
		struct ts_done done = { 0 };
		cr_assert_eq(nf_io_ctx_read_object(io, o, buf, ts_on_done, &done), 0);
		nf_io_ctx_wait(io, 0, -1);
		cr_assert_eq(done.result, 0);
		if (o->kind != NF_STORE_KIND_FFN)
			cr_assert_eq(nf_store_writer_write_dense(w, buf, o->length), 0);
		else
			for (uint32_t k = o->n_bundles; k-- > 0;)
				cr_assert_eq(nf_store_writer_write_bundles(w, buf + (size_t)k * o->stride, 1), 0);
		nf_io_buf_free(buf);
	}
	cr_assert_eq(nf_store_writer_finish(w, &d), 0, "%s", d.msg);
	nf_store_writer_close(w);
	nf_io_ctx_close(io);
	nf_store_close(s);
}

Test(import, permuted_bundles_give_the_same_logits)
{
	const size_t which[] = { 3, 5, 6 };   /* q4_0 (QCOL), MoE q8_0, PowerInfer (down_t) */
	for (size_t w = 0; w < 3; w++) {
		char in[256], refp[256], rev[256];
		gguf_path(which[w], in, sizeof(in));
		snprintf(refp, sizeof(refp), TD "%s.ref.txt", models[which[w]]);
		struct nf_ref ref;
		struct nf_diag d = { 0 };
		cr_assert_eq(nf_ref_load(refp, &ref, &d), 0);
		struct ts_dir t;
		cr_assert(ts_dir_make(&t, "/tmp"));
		import_ok(in, t.path, 16, 4096, NULL);
		snprintf(rev, sizeof(rev), "%s/rev.nfs", t.dir);
		copy_reversed(t.path, rev);
		float *a = calloc(ref.n_vocab, sizeof(float)), *b = calloc(ref.n_vocab, sizeof(float));
		int32_t ga[2], gb[2];
		eval_logits(in, false, &ref, a, ga, 2);
		eval_logits(rev, true, &ref, b, gb, 2);
		cr_assert(memcmp(a, b, ref.n_vocab * sizeof(float)) == 0,
			  "%s: logits from the permuted store differ", in);
		free(a);
		free(b);
		nf_ref_free(&ref);
		ts_dir_remove(&t);
	}
}

/* ---- damage ---------------------------------------------------------------------- */

static int load_err(const char *path, struct nf_diag *d)
{
	struct nf_model_opts mo = { .store_unpack_ffn = true };
	struct nf_model *m = NULL;
	memset(d, 0, sizeof(*d));
	int rc = nf_model_load(path, &mo, &m, d);
	nf_model_free(m);
	return rc;
}

Test(import, flipped_bit_in_an_extent_or_dense_object_is_caught)
{
	struct ts_dir t;
	char in[256];
	gguf_path(3, in, sizeof(in));   /* q4_0: QCOL bundles */
	cr_assert(ts_dir_make(&t, "/tmp"));
	import_ok(in, t.path, 4, 4096, NULL);
	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0);
	const struct nf_store_object *f = nf_store_ffn_find(s, 1, 0);
	uint64_t eoff, elen;
	nf_store_extent_span(f, 3, &eoff, &elen);
	uint64_t ffn_at = eoff + f->stride + f->down_off + 5; /* a down quant of bundle 13 */
	const struct nf_store_object *w = nf_store_object_find(s, "blk.0.attn_v.weight");
	uint64_t dense_at = w->offset + w->length / 2;
	nf_store_close(s);

	cr_assert_eq(load_err(t.path, &d), 0, "%s", d.msg);
	ts_flip(t.path, ffn_at, 3);
	cr_assert_eq(load_err(t.path, &d), NF_ECHECKSUM);
	cr_assert(strstr(d.msg, "blk.1.ffn"), "%s", d.msg);
	char out[8192];
	char *argv[] = { "store", "verify", t.path, NULL };
	cr_assert_eq(ts_run_store_cmd(argv, out, sizeof(out)), 1, "%s", out);
	cr_assert(strstr(out, "blk.1.ffn"), "%s", out);
	ts_flip(t.path, ffn_at, 3);
	cr_assert_eq(load_err(t.path, &d), 0, "%s", d.msg);

	/* Dense objects are verified even when the FFN stays in the store. */
	ts_flip(t.path, dense_at, 0);
	struct nf_model *m = NULL;
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_model_load(t.path, NULL, &m, &d), NF_ECHECKSUM);
	cr_assert(strstr(d.msg, "blk.0.attn_v.weight"), "%s", d.msg);
	cr_assert_null(m);
	ts_flip(t.path, dense_at, 0);

	/* The token embedding, read a row at a time and never pinned, is
	 * checked whole at load all the same. */
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0);
	const struct nf_store_object *te = nf_store_object_find(s, "token_embd.weight");
	cr_assert(te && nf_store_object_find(s, "output.weight"));
	uint64_t embd_at = te->offset + te->length - 7;
	nf_store_close(s);
	cr_assert_eq(load_err(t.path, &d), 0, "%s", d.msg);
	ts_flip(t.path, embd_at, 6);
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_model_load(t.path, NULL, &m, &d), NF_ECHECKSUM);
	cr_assert(strstr(d.msg, "token_embd.weight"), "%s", d.msg);
	cr_assert_null(m);
	ts_dir_remove(&t);
}

/* A store-backed model with its own output matrix leaves the token
 * embedding in the store: the weights in memory are the GGUF's less the
 * embedding, and every row, the first and the last included, reads back
 * what the GGUF holds (the same logits, bit for bit). */
Test(import, token_embedding_rows_are_read_from_the_store)
{
	char in[256];
	gguf_path(3, in, sizeof(in));   /* q4_0, untied output */
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	import_ok(in, t.path, 16, 4096, NULL);
	struct nf_model *m[2];
	struct nf_diag d = { 0 };
	struct nf_model_opts mo = { .prefault = true, .store_unpack_ffn = true };
	cr_assert_eq(nf_model_load(in, NULL, &m[0], &d), 0, "%s", d.msg);
	cr_assert_eq(nf_model_load(t.path, &mo, &m[1], &d), 0, "%s", d.msg);
	const struct nf_model_hparams *hp = nf_model_hparams(m[0]);
	/* in memory without the FFN: every dense object but the embedding */
	struct nf_store *s;
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	uint64_t dense = 0, embd = nf_store_object_find(s, "token_embd.weight")->length;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		if (o->kind == NF_STORE_KIND_DENSE)
			dense += o->length;
	}
	nf_store_close(s);
	struct nf_model *bare;
	cr_assert_eq(nf_model_load(t.path, NULL, &bare, &d), 0, "%s", d.msg);
	cr_expect_eq(nf_model_weight_bytes(bare) + embd, dense, "in memory %llu + embedding %llu, dense objects %llu",
		     (unsigned long long)nf_model_weight_bytes(bare), (unsigned long long)embd,
		     (unsigned long long)dense);
	nf_model_free(bare);
	/* a batch of more rows than are read at a time (64), then single steps */
	int32_t ids[152];
	for (int i = 0; i < 150; i++)
		ids[i] = (int32_t)((i * 37u) % hp->n_vocab);
	ids[3] = 0;
	ids[100] = (int32_t)hp->n_vocab - 1;
	ids[150] = 0;
	ids[151] = (int32_t)hp->n_vocab - 1;
	float *lg[2];
	for (int k = 0; k < 2; k++) {
		struct nf_ctx_params cp = nf_ctx_defaults();
		cp.n_threads = 2;
		cp.n_ctx = 256;
		cp.n_batch = 256;
		struct nf_ctx *c;
		cr_assert_eq(nf_ctx_open(m[k], &cp, &c, &d), 0, "%s", d.msg);
		cr_assert_eq(nf_ctx_eval(c, ids, 150), 0);
		cr_assert_eq(nf_ctx_eval(c, ids + 150, 1), 0);
		cr_assert_eq(nf_ctx_eval(c, ids + 151, 1), 0);
		lg[k] = malloc(hp->n_vocab * sizeof(float));
		memcpy(lg[k], nf_ctx_logits(c), hp->n_vocab * sizeof(float));
		nf_ctx_close(c);
	}
	cr_expect(memcmp(lg[0], lg[1], hp->n_vocab * sizeof(float)) == 0, "store rows give other logits");
	free(lg[0]);
	free(lg[1]);
	nf_model_free(m[0]);
	nf_model_free(m[1]);
	ts_dir_remove(&t);
}

/* ---- interrupted imports --------------------------------------------------------- */

struct cancel_at {
	volatile sig_atomic_t flag;
	uint64_t at;
	int calls;
};

static void cancel_progress(void *user, enum nf_import_phase ph, uint64_t done, uint64_t total)
{
	struct cancel_at *c = user;
	c->calls++;
	if (ph == NF_IMPORT_PHASE_WRITE && done >= c->at)
		c->flag = 1;
}

Test(import, cancelled_import_leaves_nothing)
{
	struct ts_dir t;
	char in[256];
	gguf_path(6, in, sizeof(in));
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct cancel_at c = { .at = 4u << 20 };
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	o.cancel = &c.flag;
	o.progress = cancel_progress;
	o.progress_user = &c;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_import(in, t.path, &o, NULL, &d), -EINTR, "%s", d.msg);
	cr_assert_gt(c.calls, 1);
	cr_assert_eq(ts_dir_count(&t), 0, "an interrupted import left a file");
	ts_dir_remove(&t);
}

static int fail_fsync(int fd)
{
	(void)fd;
	errno = EIO;
	return -1;
}

static ssize_t fail_late_pwrite(int fd, const void *buf, size_t len, off_t off)
{
	if (off + (off_t)len > (off_t)(1 << 20)) {
		errno = ENOSPC;
		return -1;
	}
	return pwrite(fd, buf, len, off);
}

Test(import, failed_write_or_fsync_leaves_nothing)
{
	char in[256];
	gguf_path(4, in, sizeof(in));
	for (int k = 0; k < 2; k++) {
		struct ts_dir t;
		cr_assert(ts_dir_make(&t, "/tmp"));
		struct nf_io_sys sys = nf_io_sys_default;
		if (k == 0)
			sys.fsync = fail_fsync;
		else
			sys.pwrite = fail_late_pwrite;
		struct nf_import_opts o;
		nf_import_opts_default(&o);
		o.sys = &sys;
		struct nf_diag d = { 0 };
		int rc = nf_import(in, t.path, &o, NULL, &d);
		cr_assert_eq(rc, k == 0 ? -EIO : -ENOSPC, "%s", nf_diag_msg(&d, rc));
		cr_assert(strstr(d.msg, t.dir), "message names the output: %s", d.msg);
		cr_assert_eq(ts_dir_count(&t), 0, "a failed import left a file");
		ts_dir_remove(&t);
	}
}

/* ---- a fault at every step (issue #16) ------------------------------------------- */

/* Every system call import makes goes through this table: the step-th call
 * (counting all of them) fails, as EIO, or as a short write followed by
 * ENOSPC (a full disk). */
static int step_at, step_n;
static bool step_short;
static char step_kind[4096];     /* of each call in a clean run: 'w' for pwrite */
static int n_mmap, n_meta_open;
static int step_hit(void)
{
	return ++step_n == step_at;
}
#define STEP_FAIL(ret) do { if (step_hit()) { errno = EIO; return ret; } } while (0)
static int st_open(const char *p, int f, mode_t m)
{
	n_meta_open += strstr(p, "meta.gguf") != NULL;
	STEP_FAIL(-1);
	return nf_io_sys_default.open(p, f, m);
}
static int st_close(int fd) { if (step_hit()) { close(fd); errno = EIO; return -1; } return close(fd); }
static ssize_t st_pread(int fd, void *b, size_t n, off_t o) { STEP_FAIL(-1); return pread(fd, b, n, o); }
static ssize_t st_pwrite(int fd, const void *b, size_t n, off_t o)
{
	if (step_n < (int)sizeof(step_kind))
		step_kind[step_n] = 'w';
	if (step_hit()) {
		if (step_short && n > 1) {
			step_at = step_n + 1;     /* the rest: the disk is full */
			return pwrite(fd, b, n / 2, o);
		}
		errno = step_short ? ENOSPC : EIO;
		return -1;
	}
	return pwrite(fd, b, n, o);
}
static int st_fstat(int fd, struct stat *st) { STEP_FAIL(-1); return fstat(fd, st); }
static int st_statx(int d, const char *p, int f, unsigned m, struct statx *x)
{
	STEP_FAIL(-1);
	return nf_io_sys_default.statx(d, p, f, m, x);
}
static int st_fsync(int fd) { STEP_FAIL(-1); return fsync(fd); }
static int st_rename(const char *a, const char *b) { STEP_FAIL(-1); return rename(a, b); }
static int st_flock(int fd, int op) { STEP_FAIL(-1); return nf_io_sys_default.flock(fd, op); }
static void *st_mmap(void *a, size_t n, int p, int f, int fd, off_t o)
{
	n_mmap++;
	STEP_FAIL(MAP_FAILED);
	return nf_io_sys_default.mmap(a, n, p, f, fd, o);
}

/* Import with the step-th system call failing: the output is absent or a
 * whole store that verifies, never anything else under the final name. */
Test(import, a_fault_at_every_step_leaves_nothing_or_a_valid_store)
{
	char in[256];
	gguf_path(0, in, sizeof(in));
	struct nf_io_sys sys = nf_io_sys_default;
	sys.open = st_open;
	sys.close = st_close;
	sys.pread = st_pread;
	sys.pwrite = st_pwrite;
	sys.fstat = st_fstat;
	sys.statx = st_statx;
	sys.fsync = st_fsync;
	sys.rename = st_rename;
	sys.flock = st_flock;
	sys.mmap = st_mmap;
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	o.sys = &sys;
	o.block_size = 512;
	o.extent_bundles = 8;
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	step_at = -1;
	step_n = 0;
	memset(step_kind, 0, sizeof(step_kind));
	struct nf_diag d = { 0 };
	int rc = nf_import(in, t.path, &o, NULL, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	int total = step_n;
	cr_assert_lt(total, (int)sizeof(step_kind));
	/* the GGUF reader and writer go through the table too */
	cr_assert_gt(n_mmap, 0, "the GGUF reader maps the source behind the table's back");
	cr_assert_gt(n_meta_open, 0, "the GGUF writer opens its file behind the table's back");
	unlink(t.path);
	int failed = 0;
	for (int mode = 0; mode < 2; mode++)
		for (int k = 1; k <= total; k++) {
			if (mode == 1 && step_kind[k - 1] != 'w')
				continue;       /* a short write only where there is a write */
			step_short = mode == 1;
			step_at = k;
			step_n = 0;
			memset(&d, 0, sizeof(d));
			rc = nf_import(in, t.path, &o, NULL, &d);
			failed += rc < 0;
			if (rc < 0)
				cr_expect(d.msg[0], "step %d: an error without a message", k);
			if (access(t.path, F_OK) == 0) {
				char out[4096];
				char *const argv[] = { "store", "verify", t.path, NULL };
				int v = ts_run_store_cmd(argv, out, sizeof(out));
				cr_expect_eq(v, 0, "step %d (%s, import rc %d: %s): the file under the final "
					     "name does not verify: %s", k, mode ? "short write" : "EIO", rc,
					     d.msg, out);
				unlink(t.path);
			} else {
				cr_expect_lt(rc, 0, "step %d: import succeeded without a store", k);
			}
			cr_expect_eq(nf_io_tmp_sweep(t.dir, true, NULL, NULL), 0,
				     "step %d (%s): a temporary file was left (%s)", k,
				     mode ? "short write" : "EIO", d.msg);
		}
	cr_expect_gt(failed, total / 2, "only %d faults of %d steps made import fail", failed, total);
	ts_dir_remove(&t);
}

/* ---- bad input --------------------------------------------------------------------- */

/* Copy src to dst without tensor `skip` (NULL: all); returns 0. */
static void copy_gguf(const char *src, const char *dst, const char *skip)
{
	struct nf_gguf *g;
	struct nf_gguf_writer *w;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_gguf_open(src, NF_GGUF_MMAP, &g, &d), 0);
	cr_assert_eq(nf_gguf_writer_open(dst, nf_gguf_is_powerinfer(g), &w, &d), 0);
	for (size_t i = 0; i < nf_gguf_n_kv(g); i++)
		cr_assert_eq(nf_gguf_writer_kv_copy(w, nf_gguf_kv_at(g, i)), 0);
	for (size_t i = 0; i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		if (!skip || strcmp(t->name, skip))
			cr_assert_eq(nf_gguf_writer_tensor(w, t->name, t->type, t->n_dims, t->ne), 0);
	}
	for (size_t i = 0; i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		if (!skip || strcmp(t->name, skip))
			cr_assert_eq(nf_gguf_writer_write(w, t->data, t->size), 0);
	}
	cr_assert_eq(nf_gguf_writer_finish(w, &d), 0, "%s", d.msg);
	nf_gguf_close(g);
}

static int import_err(const char *in, const char *out, struct nf_diag *d)
{
	memset(d, 0, sizeof(*d));
	return nf_import(in, out, NULL, NULL, d);
}

Test(import, bad_input_named_and_nothing_left)
{
	struct ts_dir t, src;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert(ts_dir_make(&src, "/tmp"));
	struct nf_diag d;
	char p[256], in[256];

	/* Not a GGUF. */
	snprintf(p, sizeof(p), "%s/not.gguf", src.dir);
	FILE *f = fopen(p, "w");
	fputs("hello, this is not a model at all, just some text\n", f);
	fclose(f);
	cr_assert_eq(import_err(p, t.path, &d), NF_EMAGIC);
	cr_assert(strstr(d.msg, "not.gguf"), "%s", d.msg);
	/* Absent file. */
	snprintf(p, sizeof(p), "%s/absent.gguf", src.dir);
	cr_assert_eq(import_err(p, t.path, &d), -ENOENT);
	cr_assert(strstr(d.msg, "absent.gguf"), "%s", d.msg);

	/* A missing FFN tensor, regular and PowerInfer and MoE. */
	const struct { size_t model; const char *drop, *named; int code; } cases[] = {
		{ 0, "blk.1.ffn_down.weight", "blk.1.ffn_down.weight", NF_ENOTFOUND },
		{ 0, "blk.0.ffn_up.weight", "blk.0.ffn_up.weight", NF_ENOTFOUND },
		{ 6, "blk.1.ffn_down_t.weight", "blk.1.ffn_down.weight", NF_ENOTFOUND },
		{ 5, "blk.0.ffn_down_exps.weight", "blk.0.ffn_down_exps.weight", NF_ENOTFOUND },
	};
	for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
		gguf_path(cases[k].model, in, sizeof(in));
		snprintf(p, sizeof(p), "%s/cut%zu.gguf", src.dir, k);
		copy_gguf(in, p, cases[k].drop);
		cr_assert_eq(import_err(p, t.path, &d), cases[k].code, "%s", d.msg);
		cr_assert(strstr(d.msg, cases[k].named) && strstr(d.msg, p), "%s", d.msg);
	}

	/* An unsupported tensor type: patch blk.0.ffn_up's type id to q5_0. */
	gguf_path(0, in, sizeof(in));
	snprintf(p, sizeof(p), "%s/q5.gguf", src.dir);
	copy_gguf(in, p, NULL);
	{
		FILE *fp = fopen(p, "rb");
		static char buf[1 << 16];
		size_t n = fread(buf, 1, sizeof(buf), fp);
		fclose(fp);
		const char *name = "blk.0.ffn_up.weight";
		char *at = memmem(buf, n, name, strlen(name));
		cr_assert_not_null(at);
		uint64_t off = (uint64_t)(at - buf) + strlen(name);
		uint32_t nd;
		memcpy(&nd, buf + off, 4);
		cr_assert_eq(nd, 2);
		uint32_t type = 6; /* q5_0 */
		ts_patch(p, off + 4 + 8 * nd, &type, 4);
	}
	cr_assert_eq(import_err(p, t.path, &d), NF_EUNSUPPORTED, "%s", d.msg);
	cr_assert(strstr(d.msg, "blk.0.ffn_up.weight"), "%s", d.msg);

	cr_assert_eq(ts_dir_count(&t), 0, "failed imports left files");

	/* An existing output is not replaced unless asked. */
	gguf_path(0, in, sizeof(in));
	f = fopen(t.path, "w");
	fputs("precious", f);
	fclose(f);
	cr_assert_eq(import_err(in, t.path, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "exists"), "%s", d.msg);
	char keep[16] = { 0 };
	ts_read(t.path, 0, keep, 8);
	cr_assert_str_eq(keep, "precious");
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	o.overwrite = true;
	cr_assert_eq(nf_import(in, t.path, &o, NULL, &d), 0, "%s", d.msg);
	ts_dir_remove(&t);
	ts_dir_remove(&src);
}

/* ---- the command ------------------------------------------------------------------ */

Test(import, command_flags_json_and_errors)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	char out[16384], in[256];
	gguf_path(5, in, sizeof(in));
	char *help[] = { "import", "--help", NULL };
	cr_assert_eq(ts_run_cmd(nf_cmd_import, help, out, sizeof(out)), 0);
	cr_assert(strstr(out, "--extent-bundles") && strstr(out, "--bundle-align"), "%s", out);
	char *bad_align[] = { "import", in, t.path, "--bundle-align", "3000", NULL };
	cr_assert_eq(ts_run_cmd(nf_cmd_import, bad_align, out, sizeof(out)), 2);
	cr_assert(strstr(out, "--bundle-align"), "%s", out);
	char *missing[] = { "import", in, NULL };
	cr_assert_eq(ts_run_cmd(nf_cmd_import, missing, out, sizeof(out)), 2);
	char *bad_in[] = { "import", "/nonexistent/x.gguf", t.path, NULL };
	cr_assert_eq(ts_run_cmd(nf_cmd_import, bad_in, out, sizeof(out)), 1);
	cr_assert(strstr(out, "/nonexistent/x.gguf"), "%s", out);
	char *ok[] = { "import", in, t.path, "--extent-bundles", "3", "--bundle-align", "1K",
		       "--json", NULL };
	cr_assert_eq(ts_run_cmd(nf_cmd_import, ok, out, sizeof(out)), 0, "%s", out);
	cr_assert(strstr(out, "\"ffn_objects\": 8") && strstr(out, "\"n_expert\": 4"), "%s", out);
	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0);
	cr_assert_eq(nf_store_info(s)->block_size, 1024);
	cr_assert_eq(nf_store_ffn_find(s, 1, 3)->extent_bundles, 3);
	nf_store_close(s);
	ts_dir_remove(&t);
}
