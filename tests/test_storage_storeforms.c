/*
 * test_storage_storeforms.c - the store format extensions for import
 * (docs/FORMAT.md items 16-18): FFN objects with a QCOL down part or a down
 * type of their own, blob objects, the incompat bits that make readers
 * which do not know them refuse cleanly, and stores without them staying
 * exactly as before (incompat 0).
 */
#include <criterion/criterion.h>
#include <endian.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/bundle.h"
#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "../storage/store_format.h"
#include "util_storage.h"

#define DIM 64
#define NFF 96

/* A Q8_0 FFN with random quants, packed with the QCOL form, and an F32
 * gate/up FFN with an F16 down_t (ROW, down dtype of its own). */
struct forms {
	struct nf_block_q8_0 gate[NFF * DIM / 32], up[NFF * DIM / 32], down[DIM * NFF / 32];
	float g32[NFF * DIM], u32[NFF * DIM];
	uint16_t dt16[NFF * DIM];
	struct nf_bundle_src q, p;
	struct nf_bundle_layout lq, lp;
	uint16_t scales[NFF / 32 * DIM];
	uint8_t *bq, *bp;
	uint8_t blob[1000];
};

static struct forms *make_forms(uint32_t block)
{
	struct forms *f = calloc(1, sizeof(*f));
	ts_fill((uint8_t *)f->gate, sizeof(f->gate), 1);
	ts_fill((uint8_t *)f->up, sizeof(f->up), 2);
	ts_fill((uint8_t *)f->down, sizeof(f->down), 3);
	for (size_t i = 0; i < sizeof(f->gate) / sizeof(f->gate[0]); i++)
		f->gate[i].d = f->up[i].d = f->down[i].d = nf_fp32_to_fp16(0.01f * (float)(i % 7 + 1));
	for (size_t i = 0; i < NFF * DIM; i++) {
		f->g32[i] = (float)i * 0.5f;
		f->u32[i] = -(float)i;
		f->dt16[i] = nf_fp32_to_fp16((float)i / 1024.0f);
	}
	ts_fill(f->blob, sizeof(f->blob), 4);
	f->q = (struct nf_bundle_src){ .gate = f->gate, .up = f->up, .down = f->down,
				       .dtype_gate_up = NF_DTYPE_Q8_0, .dtype_down = NF_DTYPE_Q8_0,
				       .n_embd = DIM, .n_ff = NFF };
	f->p = (struct nf_bundle_src){ .gate = f->g32, .up = f->u32, .down_t = f->dt16,
				       .dtype_gate_up = NF_DTYPE_F32, .dtype_down = NF_DTYPE_F16,
				       .n_embd = DIM, .n_ff = NFF };
	cr_assert_eq(nf_bundle_layout_make(&f->q, block, &f->lq), 0);
	cr_assert_eq(nf_bundle_layout_make(&f->p, block, &f->lp), 0);
	cr_assert_eq(f->lq.down_form, NF_DOWN_QCOL);
	nf_bundle_pack_scales(&f->q, f->scales);
	f->bq = nf_io_buf_alloc((size_t)NFF * f->lq.stride, 4096);
	f->bp = nf_io_buf_alloc((size_t)NFF * f->lp.stride, 4096);
	nf_bundle_pack(&f->q, &f->lq, 0, NFF, f->bq);
	nf_bundle_pack(&f->p, &f->lp, 0, NFF, f->bp);
	return f;
}

static void free_forms(struct forms *f)
{
	nf_io_buf_free(f->bq);
	nf_io_buf_free(f->bp);
	free(f);
}

static void write_store(const char *path, struct forms *f, uint32_t block)
{
	struct nf_store_create_opts o = { .block_size = block, .extent_bundles = 10 };
	struct nf_store_writer *w;
	struct nf_diag d = { 0 };
	uint64_t sshape[2] = { DIM, NFF / 32 };
	cr_assert_eq(nf_store_writer_open(path, &o, &w, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_writer_add_blob(w, "gguf.metadata", sizeof(f->blob), &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_writer_add_dense(w, "blk.0.ffn.down_scales", NF_DTYPE_F16, 2, sshape, &d), 0);
	cr_assert_eq(nf_store_writer_add_ffn_layout(w, "blk.0.ffn", 0, 0, &f->lq, false, 0, &d), 0,
		     "%s", d.msg);
	cr_assert_eq(nf_store_writer_add_ffn_layout(w, "blk.1.ffn", 1, 0, &f->lp, true, 7, &d), 0,
		     "%s", d.msg);
	cr_assert_eq(nf_store_writer_begin(w, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_writer_write_dense(w, f->blob, sizeof(f->blob)), 0);
	cr_assert_eq(nf_store_writer_write_dense(w, f->scales, sizeof(f->scales)), 0);
	cr_assert_eq(nf_store_writer_write_bundles(w, f->bq, NFF), 0);
	/* The single-bundle call too, with the down part given separately. */
	for (uint32_t i = 0; i < NFF; i++) {
		const uint8_t *b = f->bp + (size_t)i * f->lp.stride;
		cr_assert_eq(nf_store_writer_write_bundle(w, b, b + f->lp.row_bytes, b + f->lp.down_off), 0);
	}
	cr_assert_eq(nf_store_writer_finish(w, &d), 0, "%s", d.msg);
	nf_store_writer_close(w);
}

static void read_all(struct nf_store *s, const struct nf_store_object *o, uint8_t *buf)
{
	struct nf_io_ctx *io;
	struct nf_io_opts opt;
	struct nf_diag d = { 0 };
	nf_io_opts_default(&opt);
	opt.quiet = true;
	cr_assert_eq(nf_io_ctx_open(s, &opt, &io, &d), 0, "%s", d.msg);
	struct ts_done done = { 0 };
	cr_assert_eq(nf_io_ctx_read_object(io, o, buf, ts_on_done, &done), 0);
	nf_io_ctx_wait(io, 0, -1);
	cr_assert_eq(done.calls, 1);
	cr_assert_eq(done.result, 0, "%s: %s", o->name, nf_strerror(done.result));
	nf_io_ctx_close(io);
}

static void round_trip(uint32_t block)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct forms *f = make_forms(block);
	write_store(t.path, f, block);

	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->incompat,
		     NF_STORE_INCOMPAT_BLOB | NF_STORE_INCOMPAT_DOWN_FORMS);
	const struct nf_store_object *blob = nf_store_object_find(s, "gguf.metadata");
	cr_assert(blob && blob->kind == NF_STORE_KIND_BLOB && blob->length == sizeof(f->blob));
	cr_assert_str_eq(nf_store_kind_name(blob->kind), "blob");
	const struct nf_store_object *q = nf_store_ffn_find(s, 0, 0), *p = nf_store_ffn_find(s, 1, 0);
	cr_assert(q && p);
	struct nf_bundle_layout L;
	nf_store_ffn_layout(q, &L);
	cr_assert(ts_same_layout(&L, &f->lq), "QCOL layout differs after a round trip");
	nf_store_ffn_layout(p, &L);
	cr_assert(ts_same_layout(&L, &f->lp), "ROW f16 layout differs after a round trip");
	cr_assert(p->down_transposed && !q->down_transposed);
	cr_assert_eq(p->down_dtype, NF_DTYPE_F16);
	const struct nf_store_object *sc = nf_store_ffn_scales(s, q);
	cr_assert(sc && !strcmp(sc->name, "blk.0.ffn.down_scales"));
	cr_assert_null(nf_store_ffn_scales(s, p));

	size_t cap = (size_t)NFF * f->lp.stride + (size_t)NFF * f->lq.stride + 65536;
	uint8_t *buf = nf_io_buf_alloc(cap, 4096);
	read_all(s, blob, buf);
	cr_assert(memcmp(buf, f->blob, sizeof(f->blob)) == 0);
	read_all(s, sc, buf);
	cr_assert(memcmp(buf, f->scales, sizeof(f->scales)) == 0);
	read_all(s, q, buf);
	cr_assert(memcmp(buf, f->bq, (size_t)NFF * f->lq.stride) == 0);
	read_all(s, p, buf);
	cr_assert(memcmp(buf, f->bp, (size_t)NFF * f->lp.stride) == 0);
	nf_io_buf_free(buf);
	nf_store_close(s);

	/* store verify knows blobs. */
	char out[4096];
	char *argv[] = { "store", "verify", t.path, NULL };
	cr_assert_eq(ts_run_store_cmd(argv, out, sizeof(out)), 0, "%s", out);
	free_forms(f);
	ts_dir_remove(&t);
}

Test(storeforms, qcol_row_f16_and_blob_round_trip_4k) { round_trip(4096); }
Test(storeforms, qcol_row_f16_and_blob_round_trip_512) { round_trip(512); }

Test(storeforms, old_stores_keep_incompat_zero)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	cr_assert_eq(ts_make_store(t.path, NF_DTYPE_Q4_0, 4, 4096, NULL), 0);
	struct nf_store *s;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_store_info(s)->incompat, 0);
	const struct nf_store_object *o = nf_store_ffn_find(s, 0, 0);
	cr_assert_eq(o->down_form, NF_DOWN_ROW);
	cr_assert_eq(o->down_dtype, o->dtype);
	cr_assert_eq(o->down_bytes, o->row_bytes);
	nf_store_close(s);
	ts_dir_remove(&t);
}

static void set_incompat(const char *path, uint64_t v)
{
	for (int slot = 0; slot < 2; slot++) {
		struct nf_store_sb_disk sb;
		ts_read(path, (uint64_t)slot * NF_STORE_SB_SLOT, &sb, sizeof(sb));
		sb.incompat = htole64(v);
		sb.crc = htole32(nf_store_sb_crc(&sb));
		ts_patch(path, (uint64_t)slot * NF_STORE_SB_SLOT, &sb, sizeof(sb));
	}
}

Test(storeforms, unknown_or_missing_feature_bits_are_refused)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct forms *f = make_forms(4096);
	write_store(t.path, f, 4096);
	struct nf_store *s = NULL;
	struct nf_diag d = { 0 };

	/* A reader that does not know a feature sees an unknown incompat bit. */
	set_incompat(t.path, NF_STORE_INCOMPAT_KNOWN | (1ull << 40));
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), NF_EINCOMPAT);
	cr_assert(strstr(d.msg, "incompatible"), "%s", d.msg);
	/* Blob objects without their bit are malformed, not silently read. */
	memset(&d, 0, sizeof(d));
	set_incompat(t.path, NF_STORE_INCOMPAT_DOWN_FORMS);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "gguf.metadata"), "%s", d.msg);
	memset(&d, 0, sizeof(d));
	set_incompat(t.path, NF_STORE_INCOMPAT_BLOB);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), NF_EFORMAT);
	cr_assert(strstr(d.msg, "blk.0.ffn"), "%s", d.msg);
	set_incompat(t.path, NF_STORE_INCOMPAT_KNOWN);
	cr_assert_eq(nf_store_open(t.path, NULL, &s, &d), 0);
	nf_store_close(s);
	free_forms(f);
	ts_dir_remove(&t);
}

Test(storeforms, writer_rejects_a_layout_for_another_block_size)
{
	struct ts_dir t;
	cr_assert(ts_dir_make(&t, "/tmp"));
	struct forms *f = make_forms(512);
	struct nf_store_create_opts o = { .block_size = 4096 };
	struct nf_store_writer *w;
	struct nf_diag d = { 0 };
	cr_assert_eq(nf_store_writer_open(t.path, &o, &w, &d), 0);
	cr_assert_eq(nf_store_writer_add_ffn_layout(w, "x", 0, 0, &f->lq, false, 0, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "block size"), "%s", d.msg);
	cr_assert_eq(nf_store_writer_add_blob(w, "b", 0, &d), NF_EUSAGE);
	nf_store_writer_close(w);
	cr_assert_eq(ts_dir_count(&t), 0);
	free_forms(f);
	ts_dir_remove(&t);
}
