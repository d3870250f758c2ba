/*
 * test_storage_gguf.c - GGUF reader and writer: the shared test files, a
 * writer->reader round trip of every key and tensor type, malformed images
 * (each must give its own error code and a message naming the field, never
 * a crash: run under ASan, every image is an exact-size heap copy), and
 * interrupted writers.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"

#define TESTDATA "../shared/testdata"

/* ---- helpers ------------------------------------------------------------ */

static void *slurp(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f, "open %s", path);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	void *p = malloc(n ? (size_t)n : 1);
	cr_assert(p);
	cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	*len = (size_t)n;
	return p;
}

static char *tmpdir_new(void)
{
	char *d = strdup("/tmp/nf-gguf-XXXXXX");
	cr_assert(mkdtemp(d));
	return d;
}

static int dir_entries(const char *dir)
{
	DIR *d = opendir(dir);
	cr_assert(d);
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			n++;
	closedir(d);
	return n;
}

static void rm_rf(const char *dir)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	char p[512];
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
			snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
			unlink(p);
		}
	closedir(d);
	rmdir(dir);
}

/* Open an exact-size heap copy of len bytes of img; returns rc, fills d. */
static int open_copy(const void *img, size_t len, struct nf_diag *d)
{
	void *p = malloc(len ? len : 1);
	memcpy(p, img, len);
	struct nf_gguf *g = NULL;
	memset(d, 0, sizeof(*d));
	int rc = nf_gguf_open_mem(p, len, &g, d);
	if (rc == 0) {
		/* walk everything, as a consumer would */
		for (size_t i = 0; i < nf_gguf_n_kv(g); i++) {
			const struct nf_gguf_kv *kv = nf_gguf_kv_at(g, i);
			cr_assert_eq(nf_gguf_find_kv(g, kv->key), kv);
		}
		for (size_t i = 0; i < nf_gguf_n_tensors(g); i++) {
			const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
			cr_assert_eq(nf_gguf_find_tensor(g, t->name), t);
			cr_assert_leq(t->offset + t->size, len);
		}
		nf_gguf_close(g);
	} else {
		cr_assert_null(g);
	}
	free(p);
	return rc;
}

/* A byte builder for hand-made images. */
struct bb {
	uint8_t *p;
	size_t len, cap;
};

static void bb_put(struct bb *b, const void *p, size_t n)
{
	if (b->len + n > b->cap) {
		b->cap = (b->len + n) * 2 + 64;
		b->p = realloc(b->p, b->cap);
	}
	memcpy(b->p + b->len, p, n);
	b->len += n;
}
static void bb_u32(struct bb *b, uint32_t v) { bb_put(b, &v, 4); }
static void bb_u64(struct bb *b, uint64_t v) { bb_put(b, &v, 8); }
static void bb_str(struct bb *b, const char *s) { bb_u64(b, strlen(s)); bb_put(b, s, strlen(s)); }
static void bb_hdr(struct bb *b, const char *magic, uint32_t version, uint64_t n_t, uint64_t n_kv)
{
	bb_put(b, magic, 4);
	bb_u32(b, version);
	bb_u64(b, n_t);
	bb_u64(b, n_kv);
}
static void bb_kv_u32(struct bb *b, const char *key, uint32_t v)
{
	bb_str(b, key);
	bb_u32(b, NF_GGUF_UINT32);
	bb_u32(b, v);
}
static void bb_tensor(struct bb *b, const char *name, uint32_t n_dims, const uint64_t *ne,
		      uint32_t type, uint64_t off)
{
	bb_str(b, name);
	bb_u32(b, n_dims);
	for (uint32_t i = 0; i < n_dims; i++)
		bb_u64(b, ne[i]);
	bb_u32(b, type);
	bb_u64(b, off);
}
static void bb_pad(struct bb *b, size_t a)
{
	while (b->len % a)
		bb_put(b, "", 1);
}
static void bb_zeros(struct bb *b, size_t n)
{
	while (n--)
		bb_put(b, "", 1);
}

/* Expect rc and a message that names <memory> and contains every word. */
static void expect(struct bb *b, int code, const char *w1, const char *w2)
{
	struct nf_diag d;
	int rc = open_copy(b->p, b->len, &d);
	cr_assert_eq(rc, code, "rc %d (%s), want %d (%s); msg: %s", rc, nf_strerror(rc), code,
		     nf_strerror(code), d.msg);
	cr_assert(strstr(d.msg, "<memory>"), "message names no file: %s", d.msg);
	if (w1)
		cr_assert(strstr(d.msg, w1), "message lacks '%s': %s", w1, d.msg);
	if (w2)
		cr_assert(strstr(d.msg, w2), "message lacks '%s': %s", w2, d.msg);
	free(b->p);
	memset(b, 0, sizeof(*b));
}

/* ---- the shared test files --------------------------------------------- */

Test(gguf, testdata_files_open)
{
	glob_t gl;
	cr_assert_eq(glob(TESTDATA "/*/*.gguf", 0, NULL, &gl), 0, "no testdata");
	cr_assert_geq(gl.gl_pathc, 9);
	for (size_t f = 0; f < gl.gl_pathc; f++) {
		const char *path = gl.gl_pathv[f];
		struct nf_gguf *g, *gm;
		struct nf_diag d = {0};
		int rc = nf_gguf_open(path, 0, &g, &d);
		cr_assert_eq(rc, 0, "%s: %s", path, nf_diag_msg(&d, rc));
		rc = nf_gguf_open(path, NF_GGUF_MMAP, &gm, &d);
		cr_assert_eq(rc, 0, "%s: %s", path, nf_diag_msg(&d, rc));
		cr_assert_eq(nf_gguf_version(g), 3);
		cr_assert_eq(nf_gguf_is_powerinfer(g), strstr(path, ".pwri.") != NULL, "%s", path);
		cr_assert_eq(nf_gguf_alignment(g), 32);
		cr_assert_str_eq(nf_gguf_path(g), path);
		struct stat st;
		cr_assert_eq(stat(path, &st), 0);
		cr_assert_eq(nf_gguf_file_size(g), (uint64_t)st.st_size);

		const char *arch, *model;
		cr_assert_eq(nf_gguf_get_str(g, "general.architecture", &arch), 0, "%s", path);
		cr_assert_eq(nf_gguf_get_str(g, "tokenizer.ggml.model", &model), 0, "%s", path);
		const struct nf_gguf_kv *tokens;
		cr_assert_eq(nf_gguf_get_arr(g, "tokenizer.ggml.tokens", &tokens), 0);
		cr_assert_eq(tokens->arr_type, NF_GGUF_STRING);
		uint32_t bos, eos;
		cr_assert_eq(nf_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &bos), 0);
		cr_assert_eq(nf_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &eos), 0);
		cr_assert_lt(bos, tokens->arr_n);
		cr_assert_lt(eos, tokens->arr_n);
		if (!strcmp(model, "llama")) {
			const struct nf_gguf_kv *scores;
			cr_assert_eq(nf_gguf_get_arr(g, "tokenizer.ggml.scores", &scores), 0);
			cr_assert_eq(scores->arr_n, tokens->arr_n);
			cr_assert_str_eq(nf_gguf_arr_str(tokens, 1, NULL), "<s>");
			cr_assert_str_eq(nf_gguf_arr_str(tokens, 2, NULL), "</s>");
			cr_assert_str_eq(nf_gguf_arr_str(tokens, 3 + 0x41, NULL), "<0x41>");
		} else {
			cr_assert_str_eq(model, "gpt2");
			cr_assert_eq(tokens->arr_n, 50257);
			const struct nf_gguf_kv *merges;
			cr_assert_eq(nf_gguf_get_arr(g, "tokenizer.ggml.merges", &merges), 0);
			cr_assert_eq(merges->arr_n, 50000);
			uint64_t len;
			cr_assert_str_eq(nf_gguf_arr_str(tokens, 50256, &len), "<|endoftext|>");
			cr_assert_eq(len, 13);
		}
		cr_assert_null(nf_gguf_arr_str(tokens, tokens->arr_n, NULL));

		if (strstr(path, "/vocab/")) {
			cr_assert_eq(nf_gguf_n_tensors(g), 0);
		} else {
			uint32_t n_embd, n_vocab = 0;
			cr_assert_eq(nf_gguf_get_u32(g, "llama.embedding_length", &n_embd), 0);
			uint64_t want_vocab = strstr(path, "/real/") ? 512 : 320;
			cr_assert_eq(tokens->arr_n, want_vocab, "%s", path);
			const struct nf_gguf_tensor *emb = nf_gguf_find_tensor(g, "token_embd.weight");
			cr_assert(emb, "%s: no token_embd", path);
			cr_assert_eq(emb->n_dims, 2);
			cr_assert_eq(emb->ne[0], n_embd);
			cr_assert_eq(emb->ne[1], tokens->arr_n);
			if (nf_gguf_get_u32(g, "llama.vocab_size", &n_vocab) == 0)
				cr_assert_eq(n_vocab, want_vocab);
			cr_assert_null(nf_gguf_find_tensor(g, "no.such.tensor"));
		}
		if (nf_gguf_is_powerinfer(g)) {
			float th = -1;
			cr_assert_eq(nf_gguf_get_f32(g, "powerinfer.sparse_threshold", &th), 0);
			cr_assert_eq(th, 0.0f);
			const struct nf_gguf_tensor *fc1 = nf_gguf_find_tensor(g, "blk.0.fc1.weight");
			const struct nf_gguf_tensor *fc2 = nf_gguf_find_tensor(g, "blk.1.fc2.weight");
			const struct nf_gguf_tensor *dt = nf_gguf_find_tensor(g, "blk.1.ffn_down_t.weight");
			cr_assert(fc1 && fc2 && dt);
			cr_assert(fc1->ne[0] == 128 && fc1->ne[1] == 64);
			cr_assert(fc2->ne[0] == 64 && fc2->ne[1] == 1024);
			cr_assert_eq(dt->type, NF_DTYPE_F16);
		}
		cr_assert_eq(nf_gguf_n_tensors(g), nf_gguf_n_tensors(gm));
		uint8_t buf[256];
		for (size_t i = 0; i < nf_gguf_n_tensors(g); i++) {
			const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
			const struct nf_gguf_tensor *tm = nf_gguf_tensor_at(gm, i);
			cr_assert_null(t->data);
			cr_assert_not_null(tm->data);
			cr_assert_geq(t->offset, nf_gguf_data_offset(g));
			cr_assert_eq(t->offset % nf_gguf_alignment(g), 0);
			cr_assert_leq(t->offset + t->size, nf_gguf_file_size(g));
			cr_assert_eq(t->size, nf_dtype_row_size(t->type, t->ne[0]) * t->ne[1] * t->ne[2] * t->ne[3]);
			size_t n = t->size < sizeof(buf) ? (size_t)t->size : sizeof(buf);
			cr_assert_eq(nf_gguf_read_tensor(g, t, t->size - n, buf, n), 0);
			cr_assert_eq(memcmp(buf, (const uint8_t *)tm->data + t->size - n, n), 0);
			cr_assert_eq(nf_gguf_read_tensor(g, t, t->size - n + 1, buf, n), NF_EFORMAT);
		}
		nf_gguf_close(g);
		nf_gguf_close(gm);
	}
	globfree(&gl);
}

Test(gguf, open_errors_name_the_file)
{
	struct nf_gguf *g = NULL;
	struct nf_diag d = {0};
	cr_assert_eq(nf_gguf_open("/nonexistent/x.gguf", 0, &g, &d), -ENOENT);
	cr_assert(strstr(d.msg, "/nonexistent/x.gguf"), "%s", d.msg);
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_gguf_open("/tmp", 0, &g, &d), -EINVAL);
	cr_assert(strstr(d.msg, "/tmp"), "%s", d.msg);

	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/empty.gguf", dir);
	int fd = open(path, O_CREAT | O_WRONLY, 0644);
	cr_assert_geq(fd, 0);
	close(fd);
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_gguf_open(path, 0, &g, &d), NF_ETRUNCATED);
	cr_assert(strstr(d.msg, path) && strstr(d.msg, "magic"), "%s", d.msg);
	/* a real file cut in the middle of its tensor data */
	size_t len;
	uint8_t *img = slurp(TESTDATA "/models/tiny-llama-q4_0.gguf", &len);
	fd = open(path, O_WRONLY | O_TRUNC);
	cr_assert_eq(write(fd, img, len - 100), (ssize_t)(len - 100));
	close(fd);
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_gguf_open(path, NF_GGUF_MMAP, &g, &d), NF_ETRUNCATED);
	cr_assert(strstr(d.msg, path) && strstr(d.msg, "blk.1.ffn_up.weight"), "%s", d.msg);
	cr_assert_null(g);
	free(img);
	rm_rf(dir);
	free(dir);
}

/* ---- writer -> reader round trip -------------------------------------- */

static uint8_t pattern(size_t tensor, uint64_t i) { return (uint8_t)(i * 31 + tensor * 7 + (i >> 8)); }

static void roundtrip(bool powerinfer, uint32_t alignment, size_t chunk)
{
	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/rt.gguf", dir);
	struct nf_gguf_writer *w;
	struct nf_diag d = {0};
	cr_assert_eq(nf_gguf_writer_open(path, powerinfer, &w, &d), 0, "%s", d.msg);
	if (alignment)
		cr_assert_eq(nf_gguf_writer_kv_u32(w, "general.alignment", alignment), 0);
	/* every scalar type */
	uint8_t u8 = 250; int8_t i8 = -120; uint16_t u16 = 65000; int16_t i16 = -32000;
	uint32_t u32 = 4000000000u; int32_t i32 = -2000000000; float f32 = 3.25f;
	uint8_t b = 1; uint64_t u64 = 0xfedcba9876543210ull; int64_t i64 = INT64_MIN + 5;
	double f64 = -1.0 / 3.0;
	cr_assert_eq(nf_gguf_writer_kv_scalar(w, "t.u8", NF_GGUF_UINT8, &u8), 0);
	cr_assert_eq(nf_gguf_writer_kv_scalar(w, "t.i8", NF_GGUF_INT8, &i8), 0);
	cr_assert_eq(nf_gguf_writer_kv_scalar(w, "t.u16", NF_GGUF_UINT16, &u16), 0);
	cr_assert_eq(nf_gguf_writer_kv_scalar(w, "t.i16", NF_GGUF_INT16, &i16), 0);
	cr_assert_eq(nf_gguf_writer_kv_u32(w, "t.u32", u32), 0);
	cr_assert_eq(nf_gguf_writer_kv_i32(w, "t.i32", i32), 0);
	cr_assert_eq(nf_gguf_writer_kv_f32(w, "t.f32", f32), 0);
	cr_assert_eq(nf_gguf_writer_kv_bool(w, "t.bool", b), 0);
	cr_assert_eq(nf_gguf_writer_kv_str(w, "t.str", "h\xc3\xa9llo"), 0);
	cr_assert_eq(nf_gguf_writer_kv_u64(w, "t.u64", u64), 0);
	cr_assert_eq(nf_gguf_writer_kv_scalar(w, "t.i64", NF_GGUF_INT64, &i64), 0);
	cr_assert_eq(nf_gguf_writer_kv_scalar(w, "t.f64", NF_GGUF_FLOAT64, &f64), 0);
	cr_assert_eq(nf_gguf_writer_kv_str(w, "t.empty", ""), 0);
	/* every array element type */
	uint8_t raw[8 * 5];
	for (size_t i = 0; i < sizeof(raw); i++)
		raw[i] = (uint8_t)(i * 37 + 1);
	for (uint32_t et = 0; et <= NF_GGUF_FLOAT64; et++) {
		if (et == NF_GGUF_STRING || et == NF_GGUF_ARRAY)
			continue;
		char key[32];
		snprintf(key, sizeof(key), "a.%s", nf_gguf_type_name(et));
		uint8_t v[8 * 5];
		memcpy(v, raw, sizeof(v));
		if (et == NF_GGUF_BOOL)
			for (int i = 0; i < 5; i++)
				v[i] = i & 1;
		cr_assert_eq(nf_gguf_writer_kv_arr(w, key, et, v, 5), 0, "%s", key);
	}
	const char *strs[] = { "a", "", "\xe2\x96\x81" "bc", "<0x0A>" };
	cr_assert_eq(nf_gguf_writer_kv_arr_str(w, "a.string", strs, 4), 0);
	float fs[3] = { 1.5f, -2.0f, 1e-30f };
	int32_t is[3] = { -1, 0, 7 };
	cr_assert_eq(nf_gguf_writer_kv_arr_f32(w, "a.f32", fs, 3), 0);
	cr_assert_eq(nf_gguf_writer_kv_arr_i32(w, "a.i32", is, 3), 0);
	cr_assert_eq(nf_gguf_writer_kv_arr_i32(w, "a.none", NULL, 0), 0);

	/* tensors: every type, 1..4 dims, a zero-sized one */
	struct { const char *name; uint32_t type, n_dims; uint64_t ne[4]; } ts[] = {
		{ "w.f32", NF_DTYPE_F32, 2, { 7, 3 } },
		{ "w.f16", NF_DTYPE_F16, 1, { 5 } },
		{ "w.bf16", NF_DTYPE_BF16, 3, { 3, 2, 2 } },
		{ "w.q8_0", NF_DTYPE_Q8_0, 2, { 64, 3 } },
		{ "w.q4_0", NF_DTYPE_Q4_0, 4, { 32, 2, 1, 3 } },
		{ "w.empty", NF_DTYPE_F32, 2, { 4, 0 } },
		{ "w.last", NF_DTYPE_Q4_0, 1, { 96 } },
	};
	size_t nt = sizeof(ts) / sizeof(ts[0]);
	uint64_t sizes[16], total = 0;
	for (size_t i = 0; i < nt; i++) {
		cr_assert_eq(nf_gguf_writer_tensor(w, ts[i].name, ts[i].type, ts[i].n_dims, ts[i].ne), 0);
		sizes[i] = nf_dtype_row_size(ts[i].type, ts[i].ne[0]);
		for (uint32_t k = 1; k < ts[i].n_dims; k++)
			sizes[i] *= ts[i].ne[k];
		total += sizes[i];
	}
	/* stream all data in odd chunks across tensor boundaries */
	uint8_t *all = malloc(total);
	for (size_t i = 0, o = 0; i < nt; o += sizes[i], i++)
		for (uint64_t k = 0; k < sizes[i]; k++)
			all[o + k] = pattern(i, k);
	for (size_t o = 0; o < total; o += chunk)
		cr_assert_eq(nf_gguf_writer_write(w, all + o, total - o < chunk ? total - o : chunk), 0);
	/* nothing under the final name until finish */
	cr_assert_eq(access(path, F_OK), -1);
	cr_assert_eq(nf_gguf_writer_finish(w, &d), 0, "%s", d.msg);
	cr_assert_eq(dir_entries(dir), 1, "temporary file left behind");

	for (int pass = 0; pass < 2; pass++) {
		struct nf_gguf *g;
		int rc = nf_gguf_open(path, pass ? NF_GGUF_MMAP : 0, &g, &d);
		cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
		uint64_t a = alignment ? alignment : 32;
		cr_assert_eq(nf_gguf_is_powerinfer(g), powerinfer);
		cr_assert_eq(nf_gguf_alignment(g), a);
		cr_assert_eq(nf_gguf_file_size(g) % a, 0, "file ends aligned");
		const struct nf_gguf_kv *kv;
		uint32_t x32; uint64_t x64; float xf; bool xb; const char *xs;
		cr_assert(kv = nf_gguf_find_kv(g, "t.u8")); cr_assert_eq(kv->type, NF_GGUF_UINT8); cr_assert_eq(kv->v.u64, u8);
		cr_assert(kv = nf_gguf_find_kv(g, "t.i8")); cr_assert_eq(kv->type, NF_GGUF_INT8); cr_assert_eq(kv->v.i64, i8);
		cr_assert(kv = nf_gguf_find_kv(g, "t.u16")); cr_assert_eq(kv->v.u64, u16);
		cr_assert(kv = nf_gguf_find_kv(g, "t.i16")); cr_assert_eq(kv->v.i64, i16);
		cr_assert(kv = nf_gguf_find_kv(g, "t.i32")); cr_assert_eq(kv->type, NF_GGUF_INT32); cr_assert_eq(kv->v.i64, i32);
		cr_assert(kv = nf_gguf_find_kv(g, "t.i64")); cr_assert_eq(kv->v.i64, i64);
		cr_assert(kv = nf_gguf_find_kv(g, "t.f64")); cr_assert_eq(kv->type, NF_GGUF_FLOAT64); cr_assert_eq(kv->v.f64, f64);
		cr_assert_eq(nf_gguf_get_u32(g, "t.u32", &x32), 0); cr_assert_eq(x32, u32);
		cr_assert_eq(nf_gguf_get_u32(g, "t.u8", &x32), 0); cr_assert_eq(x32, u8);
		cr_assert_eq(nf_gguf_get_u32(g, "t.u64", &x32), NF_EFORMAT);
		cr_assert_eq(nf_gguf_get_u32(g, "t.i32", &x32), NF_EFORMAT);
		cr_assert_eq(nf_gguf_get_u64(g, "t.u64", &x64), 0); cr_assert_eq(x64, u64);
		cr_assert_eq(nf_gguf_get_f32(g, "t.f32", &xf), 0); cr_assert_eq(xf, f32);
		cr_assert_eq(nf_gguf_get_f32(g, "t.f64", &xf), 0); cr_assert_eq(xf, (float)f64);
		cr_assert_eq(nf_gguf_get_f32(g, "t.u32", &xf), NF_EFORMAT);
		cr_assert_eq(nf_gguf_get_bool(g, "t.bool", &xb), 0); cr_assert(xb);
		cr_assert_eq(nf_gguf_get_str(g, "t.str", &xs), 0); cr_assert_str_eq(xs, "h\xc3\xa9llo");
		cr_assert_eq(nf_gguf_get_str(g, "t.empty", &xs), 0); cr_assert_str_eq(xs, "");
		cr_assert_eq(nf_gguf_get_str(g, "t.u8", &xs), NF_EFORMAT);
		cr_assert_eq(nf_gguf_get_str(g, "missing", &xs), NF_ENOTFOUND);
		cr_assert_eq(nf_gguf_get_arr(g, "t.u8", &kv), NF_EFORMAT);

		for (uint32_t et = 0; et <= NF_GGUF_FLOAT64; et++) {
			if (et == NF_GGUF_STRING || et == NF_GGUF_ARRAY)
				continue;
			char key[32];
			snprintf(key, sizeof(key), "a.%s", nf_gguf_type_name(et));
			cr_assert_eq(nf_gguf_get_arr(g, key, &kv), 0, "%s", key);
			cr_assert_eq(kv->arr_type, et);
			cr_assert_eq(kv->arr_n, 5);
			size_t es = nf_gguf_type_size(et);
			if (et == NF_GGUF_BOOL) {
				for (int i = 0; i < 5; i++)
					cr_assert_eq(nf_gguf_arr_i64(kv, i), i & 1);
			} else {
				cr_assert_eq(memcmp(kv->arr_data, raw, 5 * es), 0, "%s", key);
			}
		}
		cr_assert_eq(nf_gguf_get_arr(g, "a.string", &kv), 0);
		cr_assert_eq(kv->arr_n, 4);
		for (int i = 0; i < 4; i++) {
			uint64_t len;
			cr_assert_str_eq(nf_gguf_arr_str(kv, i, &len), strs[i]);
			cr_assert_eq(len, strlen(strs[i]));
		}
		cr_assert_eq(nf_gguf_get_arr(g, "a.f32", &kv), 0);
		for (int i = 0; i < 3; i++)
			cr_assert_eq(nf_gguf_arr_f32(kv, i), fs[i]);
		cr_assert_null(nf_gguf_arr_str(kv, 0, NULL));
		cr_assert_eq(nf_gguf_get_arr(g, "a.i32", &kv), 0);
		for (int i = 0; i < 3; i++) {
			cr_assert_eq(nf_gguf_arr_i64(kv, i), is[i]);
			cr_assert_eq(nf_gguf_arr_f32(kv, i), (float)is[i]);
		}
		cr_assert_eq(nf_gguf_get_arr(g, "a.none", &kv), 0);
		cr_assert_eq(kv->arr_n, 0);

		cr_assert_eq(nf_gguf_n_tensors(g), nt);
		for (size_t i = 0; i < nt; i++) {
			const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
			cr_assert_str_eq(t->name, ts[i].name);
			cr_assert_eq(nf_gguf_find_tensor(g, ts[i].name), t);
			cr_assert_eq(t->type, ts[i].type);
			cr_assert_eq(t->n_dims, ts[i].n_dims);
			for (uint32_t k = 0; k < 4; k++)
				cr_assert_eq(t->ne[k], k < ts[i].n_dims ? ts[i].ne[k] : 1);
			cr_assert_eq(t->size, sizes[i]);
			cr_assert_eq(t->offset % a, 0);
			uint8_t *buf = malloc(sizes[i] + 1);
			cr_assert_eq(nf_gguf_read_tensor(g, t, 0, buf, sizes[i]), 0);
			for (uint64_t k = 0; k < sizes[i]; k++)
				cr_assert_eq(buf[k], pattern(i, k), "%s byte %lu", t->name, (unsigned long)k);
			if (pass)
				cr_assert_eq(memcmp(t->data, buf, sizes[i]), 0);
			free(buf);
		}
		nf_gguf_close(g);
	}
	free(all);
	rm_rf(dir);
	free(dir);
}

Test(gguf, roundtrip_every_type) { roundtrip(false, 0, 7); }
Test(gguf, roundtrip_powerinfer_align64_big_chunks) { roundtrip(true, 64, 1 << 20); }
Test(gguf, roundtrip_byte_at_a_time) { roundtrip(false, 0, 1); }

/* Copying every key of a real vocabulary gives an identical key set. */
Test(gguf, kv_copy_preserves_vocab)
{
	const char *src = TESTDATA "/vocab/ggml-vocab-gpt-2.gguf";
	struct nf_gguf *g, *h;
	struct nf_diag d = {0};
	cr_assert_eq(nf_gguf_open(src, 0, &g, &d), 0, "%s", d.msg);
	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/copy.gguf", dir);
	struct nf_gguf_writer *w;
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	for (size_t i = 0; i < nf_gguf_n_kv(g); i++)
		cr_assert_eq(nf_gguf_writer_kv_copy(w, nf_gguf_kv_at(g, i)), 0);
	cr_assert_eq(nf_gguf_writer_finish(w, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_gguf_open(path, 0, &h, &d), 0, "%s", d.msg);
	cr_assert_eq(nf_gguf_n_kv(h), nf_gguf_n_kv(g));
	for (size_t i = 0; i < nf_gguf_n_kv(g); i++) {
		const struct nf_gguf_kv *a = nf_gguf_kv_at(g, i), *b = nf_gguf_kv_at(h, i);
		cr_assert_str_eq(a->key, b->key);
		cr_assert_eq(a->type, b->type);
		if (a->type == NF_GGUF_STRING)
			cr_assert_str_eq(a->v.str, b->v.str);
		else if (a->type != NF_GGUF_ARRAY)
			cr_assert_eq(a->v.u64, b->v.u64);
		else if (a->arr_type == NF_GGUF_STRING)
			for (uint64_t k = 0; k < a->arr_n; k++)
				cr_assert_str_eq(nf_gguf_arr_str(a, k, NULL), nf_gguf_arr_str(b, k, NULL));
		else
			cr_assert_eq(memcmp(a->arr_data, b->arr_data, a->arr_n * nf_gguf_type_size(a->arr_type)), 0);
	}
	/* the original file is byte-identical: same layout, same order */
	size_t la, lb;
	void *pa = slurp(src, &la), *pb = slurp(path, &lb);
	cr_assert_eq(memcmp(pa, pb, la < lb ? la : lb), 0);
	free(pa);
	free(pb);
	nf_gguf_close(g);
	nf_gguf_close(h);
	rm_rf(dir);
	free(dir);
}

/* ---- writer misuse and interruption ------------------------------------ */

Test(gguf, writer_errors_stick_and_leave_nothing)
{
	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/bad.gguf", dir);
	struct nf_gguf_writer *w;
	struct nf_diag d = {0};
	uint64_t ne[2] = { 32, 2 }, odd[1] = { 16 };

	/* duplicate key: the error sticks until finish, which removes the file */
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_kv_u32(w, "k", 1), 0);
	cr_assert_eq(nf_gguf_writer_kv_u32(w, "k", 2), NF_EUSAGE);
	cr_assert_eq(nf_gguf_writer_kv_u32(w, "other", 2), NF_EUSAGE);
	cr_assert_eq(nf_gguf_writer_finish(w, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, path), "%s", d.msg);
	cr_assert_eq(dir_entries(dir), 0);

	/* unsupported type, bad block multiple, bad alignment, duplicate tensor */
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", 20, 2, ne), NF_EUNSUPPORTED); /* iq4_nl */
	nf_gguf_writer_abort(w);
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", NF_DTYPE_Q8_0, 1, odd), NF_EUSAGE);
	nf_gguf_writer_abort(w);
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_kv_u32(w, "general.alignment", 48), NF_EUSAGE);
	nf_gguf_writer_abort(w);
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", NF_DTYPE_F32, 2, ne), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", NF_DTYPE_F32, 2, ne), NF_EUSAGE);
	nf_gguf_writer_abort(w);
	cr_assert_eq(dir_entries(dir), 0);

	/* too much data, then too little */
	uint8_t data[300] = {0};
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", NF_DTYPE_F32, 2, ne), 0);
	cr_assert_eq(nf_gguf_writer_write(w, data, 256), 0);
	cr_assert_eq(nf_gguf_writer_write(w, data, 1), NF_EUSAGE);
	cr_assert_eq(nf_gguf_writer_tensor(w, "y", NF_DTYPE_F32, 2, ne), NF_EUSAGE);
	cr_assert_eq(nf_gguf_writer_finish(w, NULL), NF_EUSAGE);
	cr_assert_eq(dir_entries(dir), 0);
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, &d), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", NF_DTYPE_F32, 2, ne), 0);
	cr_assert_eq(nf_gguf_writer_write(w, data, 255), 0);
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_gguf_writer_finish(w, &d), NF_EUSAGE);
	cr_assert(strstr(d.msg, "'x'") && strstr(d.msg, "255"), "%s", d.msg);
	cr_assert_eq(dir_entries(dir), 0);

	/* a directory that does not exist */
	memset(&d, 0, sizeof(d));
	cr_assert_eq(nf_gguf_writer_open("/nonexistent/dir/x.gguf", false, &w, &d), -ENOENT);
	cr_assert(strstr(d.msg, "/nonexistent/dir/x.gguf"), "%s", d.msg);
	rm_rf(dir);
	free(dir);
}

Test(gguf, abort_leaves_old_file_intact)
{
	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/m.gguf", dir);
	FILE *f = fopen(path, "w");
	fputs("old", f);
	fclose(f);
	struct nf_gguf_writer *w;
	uint64_t ne[1] = { 1024 };
	float x[1024] = {0};
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, NULL), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "x", NF_DTYPE_F32, 1, ne), 0);
	cr_assert_eq(nf_gguf_writer_write(w, x, 1000), 0);
	nf_gguf_writer_abort(w);
	cr_assert_eq(dir_entries(dir), 1);
	size_t len;
	char *s = slurp(path, &len);
	cr_assert(len == 3 && !memcmp(s, "old", 3));
	free(s);
	rm_rf(dir);
	free(dir);
}

/* A writer process killed between writes leaves no file under the final name. */
Test(gguf, killed_writer_leaves_no_file)
{
	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/k.gguf", dir);
	for (int stage = 0; stage < 3; stage++) {
		int pfd[2];
		cr_assert_eq(pipe(pfd), 0);
		pid_t pid = fork();
		cr_assert_geq(pid, 0);
		if (pid == 0) {
			struct nf_gguf_writer *w;
			uint64_t ne[1] = { 1 << 20 };
			static float x[1 << 18];
			if (nf_gguf_writer_open(path, false, &w, NULL) < 0)
				_exit(1);
			nf_gguf_writer_tensor(w, "x", NF_DTYPE_F32, 1, ne);
			for (int i = 0; i < stage * 2; i++)
				nf_gguf_writer_write(w, x, sizeof(x));
			if (write(pfd[1], "r", 1) != 1)
				_exit(1);
			for (;;)
				pause();      /* between writes: killed here */
		}
		close(pfd[1]);
		char c;
		cr_assert_eq(read(pfd[0], &c, 1), 1);
		close(pfd[0]);
		kill(pid, SIGKILL);
		int st;
		cr_assert_eq(waitpid(pid, &st, 0), pid);
		cr_assert(WIFSIGNALED(st));
		cr_assert_eq(access(path, F_OK), -1, "stage %d left a file under the final name", stage);
		cr_assert_eq(errno, ENOENT);
	}
	rm_rf(dir);
	free(dir);
}

/* ---- malformed images -------------------------------------------------- */

/* A small valid file from the writer; each truncation must fail cleanly. */
Test(gguf, every_truncation_is_reported)
{
	char *dir = tmpdir_new();
	char path[256];
	snprintf(path, sizeof(path), "%s/t.gguf", dir);
	struct nf_gguf_writer *w;
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, NULL), 0);
	const char *toks[] = { "<unk>", "a", "bc" };
	float sc[3] = { 0, -1, -2 };
	cr_assert_eq(nf_gguf_writer_kv_str(w, "general.architecture", "llama"), 0);
	cr_assert_eq(nf_gguf_writer_kv_arr_str(w, "tokenizer.ggml.tokens", toks, 3), 0);
	cr_assert_eq(nf_gguf_writer_kv_arr_f32(w, "tokenizer.ggml.scores", sc, 3), 0);
	cr_assert_eq(nf_gguf_writer_kv_bool(w, "b", true), 0);
	uint64_t ne1[2] = { 32, 2 }, ne2[1] = { 5 };
	cr_assert_eq(nf_gguf_writer_tensor(w, "q", NF_DTYPE_Q8_0, 2, ne1), 0);
	cr_assert_eq(nf_gguf_writer_tensor(w, "f", NF_DTYPE_F16, 1, ne2), 0);
	uint8_t data[68 + 10];
	for (size_t i = 0; i < sizeof(data); i++)
		data[i] = (uint8_t)i;
	cr_assert_eq(nf_gguf_writer_write(w, data, sizeof(data)), 0);
	cr_assert_eq(nf_gguf_writer_finish(w, NULL), 0);
	size_t len;
	uint8_t *img = slurp(path, &len);
	struct nf_diag d;
	cr_assert_eq(open_copy(img, len, &d), 0, "%s", d.msg);
	struct nf_gguf *g;
	cr_assert_eq(nf_gguf_open_mem(img, len, &g, NULL), 0);
	uint64_t needed = nf_gguf_tensor_at(g, 1)->offset + nf_gguf_tensor_at(g, 1)->size;
	nf_gguf_close(g);
	cr_assert_lt(needed, len);
	for (size_t cut = 0; cut < len; cut++) {
		int rc = open_copy(img, cut, &d);
		if (cut >= needed) {
			cr_assert_eq(rc, 0, "cut %zu: %s", cut, d.msg);
		} else {
			cr_assert_eq(rc, NF_ETRUNCATED, "cut %zu: rc %d %s", cut, rc, d.msg);
			cr_assert(strstr(d.msg, "<memory>: truncated"), "cut %zu: %s", cut, d.msg);
		}
	}
	free(img);
	rm_rf(dir);
	free(dir);
}

Test(gguf, bad_magic_and_versions)
{
	struct bb b = {0};
	bb_hdr(&b, "GGUX", 3, 0, 0);
	expect(&b, NF_EMAGIC, "magic", NULL);
	bb_hdr(&b, "GGML", 3, 0, 0);
	expect(&b, NF_EMAGIC, "magic", NULL);
	bb_hdr(&b, "GGUF", 4, 0, 0);
	expect(&b, NF_EVERSION, "version", "4");
	bb_hdr(&b, "PWRI", 1000, 0, 0);
	expect(&b, NF_EVERSION, "version", "1000");
	bb_hdr(&b, "GGUF", 1, 0, 0);
	expect(&b, NF_EVERSION, "version", NULL);
	bb_hdr(&b, "GGUF", 0x03000000, 0, 0);
	expect(&b, NF_EUNSUPPORTED, "big-endian", NULL);
	/* v2 and the PowerInfer magic are accepted */
	struct nf_diag d;
	bb_hdr(&b, "PWRI", 2, 0, 0);
	cr_assert_eq(open_copy(b.p, b.len, &d), 0, "%s", d.msg);
	free(b.p);
}

Test(gguf, huge_counts_and_lengths)
{
	struct bb b = {0};
	bb_hdr(&b, "GGUF", 3, 0, 1ull << 60);
	expect(&b, NF_ETRUNCATED, "n_kv", NULL);
	bb_hdr(&b, "GGUF", 3, UINT64_MAX, 0);
	expect(&b, NF_ETRUNCATED, "n_tensors", NULL);
	/* key name length */
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_u64(&b, UINT64_MAX);
	bb_zeros(&b, 16);
	expect(&b, NF_ETRUNCATED, "key #0 name", NULL);
	/* string value length */
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "general.name");
	bb_u32(&b, NF_GGUF_STRING);
	bb_u64(&b, 1ull << 62);
	bb_zeros(&b, 16);
	expect(&b, NF_ETRUNCATED, "general.name", "string value");
	/* array count */
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "arr");
	bb_u32(&b, NF_GGUF_ARRAY);
	bb_u32(&b, NF_GGUF_UINT32);
	bb_u64(&b, 1ull << 62);
	bb_zeros(&b, 64);
	expect(&b, NF_ETRUNCATED, "'arr'", "array length");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "strs");
	bb_u32(&b, NF_GGUF_ARRAY);
	bb_u32(&b, NF_GGUF_STRING);
	bb_u64(&b, UINT64_MAX / 8);
	bb_zeros(&b, 64);
	expect(&b, NF_ETRUNCATED, "'strs'", "array length");
	/* a tensor name of huge length */
	bb_hdr(&b, "GGUF", 3, 1, 0);
	bb_u64(&b, 1ull << 40);
	bb_zeros(&b, 40);
	expect(&b, NF_ETRUNCATED, "tensor #0 name", NULL);
}

Test(gguf, bad_keys)
{
	struct bb b = {0};
	bb_hdr(&b, "GGUF", 3, 0, 2);
	bb_kv_u32(&b, "a", 1);
	bb_kv_u32(&b, "a", 2);
	expect(&b, NF_EFORMAT, "'a'", "twice");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "k");
	bb_u32(&b, 13);
	bb_u32(&b, 0);
	expect(&b, NF_EFORMAT, "'k'", "unknown value type 13");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "k");
	bb_u32(&b, NF_GGUF_BOOL);
	bb_put(&b, "\x02", 1);
	expect(&b, NF_EFORMAT, "'k'", "bool");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "k");
	bb_u32(&b, NF_GGUF_ARRAY);
	bb_u32(&b, NF_GGUF_ARRAY);
	bb_u64(&b, 1);
	expect(&b, NF_EUNSUPPORTED, "'k'", "arrays of arrays");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "k");
	bb_u32(&b, NF_GGUF_ARRAY);
	bb_u32(&b, 77);
	bb_u64(&b, 1);
	expect(&b, NF_EFORMAT, "'k'", "element type 77");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_u64(&b, 0);
	bb_u32(&b, NF_GGUF_UINT8);
	bb_zeros(&b, 4);
	expect(&b, NF_EFORMAT, "key #0", "empty");
	/* alignment: not a power of two, zero, wrong type */
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_kv_u32(&b, "general.alignment", 48);
	expect(&b, NF_EFORMAT, "general.alignment", "48");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_kv_u32(&b, "general.alignment", 0);
	expect(&b, NF_EFORMAT, "general.alignment", "power of two");
	bb_hdr(&b, "GGUF", 3, 0, 1);
	bb_str(&b, "general.alignment");
	bb_u32(&b, NF_GGUF_STRING);
	bb_str(&b, "32");
	expect(&b, NF_EFORMAT, "general.alignment", "string");
}

/* One tensor, data of size bytes at offset off (relative), file holding have bytes of data. */
static void one_tensor(struct bb *b, const char *name, uint32_t n_dims, const uint64_t *ne,
		       uint32_t type, uint64_t off, size_t have)
{
	bb_hdr(b, "GGUF", 3, 1, 0);
	bb_tensor(b, name, n_dims, ne, type, off);
	bb_pad(b, 32);
	bb_zeros(b, have);
}

Test(gguf, bad_tensors)
{
	struct bb b = {0};
	uint64_t ne[4] = { 32, 2, 1, 1 };
	struct nf_diag d;
	one_tensor(&b, "ok", 2, ne, NF_DTYPE_F32, 0, 256);
	cr_assert_eq(open_copy(b.p, b.len, &d), 0, "%s", d.msg);
	free(b.p);
	memset(&b, 0, sizeof(b));

	one_tensor(&b, "past", 2, ne, NF_DTYPE_F32, 0, 255);
	expect(&b, NF_ETRUNCATED, "'past'", "past the end");
	one_tensor(&b, "far", 2, ne, NF_DTYPE_F32, 1ull << 40, 256);
	expect(&b, NF_ETRUNCATED, "'far'", "past the end");
	one_tensor(&b, "wrap", 2, ne, NF_DTYPE_F32, UINT64_MAX - 31, 256);
	expect(&b, NF_EFORMAT, "'wrap'", "overflows");
	one_tensor(&b, "mis", 2, ne, NF_DTYPE_F32, 4, 260);
	expect(&b, NF_EFORMAT, "'mis'", "alignment");
	one_tensor(&b, "iq4", 2, ne, 20, 0, 256);
	expect(&b, NF_EUNSUPPORTED, "'iq4'", "iq4_nl");
	one_tensor(&b, "q81", 2, ne, NF_DTYPE_Q8_1, 0, 256);
	expect(&b, NF_EUNSUPPORTED, "'q81'", "q8_1");
	one_tensor(&b, "k4", 2, ne, NF_DTYPE_Q4_K, 0, 256);
	expect(&b, NF_EFORMAT, "'k4'", "q4_K's block of 256");
	one_tensor(&b, "t99", 2, ne, 99, 0, 256);
	expect(&b, NF_EUNSUPPORTED, "'t99'", "unknown (99)");
	uint64_t big[3] = { 1ull << 32, 1ull << 32, 1ull << 2 };
	one_tensor(&b, "ovf", 3, big, NF_DTYPE_F32, 0, 256);
	expect(&b, NF_EFORMAT, "'ovf'", "overflow");
	uint64_t big0[1] = { 1ull << 63 };
	one_tensor(&b, "ovf0", 1, big0, NF_DTYPE_F32, 0, 256);
	expect(&b, NF_EFORMAT, "'ovf0'", "overflow");
	uint64_t bytes_ovf[2] = { 1ull << 61, 4 };  /* elements fit, bytes do not */
	one_tensor(&b, "ovfb", 2, bytes_ovf, NF_DTYPE_F32, 0, 256);
	expect(&b, NF_EFORMAT, "'ovfb'", "overflow");
	uint64_t odd[1] = { 48 };
	one_tensor(&b, "blk", 1, odd, NF_DTYPE_Q4_0, 0, 256);
	expect(&b, NF_EFORMAT, "'blk'", "multiple");
	uint64_t ne5[5] = { 1, 1, 1, 1, 1 };
	one_tensor(&b, "dims", 5, ne5, NF_DTYPE_F32, 0, 256);
	expect(&b, NF_EFORMAT, "'dims'", "n_dims");
	one_tensor(&b, "dims0", 0, ne5, NF_DTYPE_F32, 0, 256);
	expect(&b, NF_EFORMAT, "'dims0'", "n_dims");

	/* duplicate names, overlapping data */
	bb_hdr(&b, "GGUF", 3, 2, 0);
	bb_tensor(&b, "dup", 2, ne, NF_DTYPE_F32, 0);
	bb_tensor(&b, "dup", 2, ne, NF_DTYPE_F32, 256);
	bb_pad(&b, 32);
	bb_zeros(&b, 512);
	expect(&b, NF_EFORMAT, "'dup'", "twice");
	bb_hdr(&b, "GGUF", 3, 2, 0);
	bb_tensor(&b, "a", 2, ne, NF_DTYPE_F32, 0);
	bb_tensor(&b, "b", 2, ne, NF_DTYPE_F32, 224);
	bb_pad(&b, 32);
	bb_zeros(&b, 512);
	expect(&b, NF_EFORMAT, "'a' and 'b'", "overlap");
	/* a name too long for ggml */
	char name[70];
	memset(name, 'n', 65);
	name[65] = 0;
	one_tensor(&b, name, 2, ne, NF_DTYPE_F32, 0, 256);
	expect(&b, NF_EFORMAT, "tensor #0", "longer than 64");
	/* a custom alignment is honoured for placement */
	bb_hdr(&b, "GGUF", 3, 1, 1);
	bb_kv_u32(&b, "general.alignment", 64);
	bb_tensor(&b, "x", 2, ne, NF_DTYPE_F32, 32);
	bb_pad(&b, 64);
	bb_zeros(&b, 512);
	expect(&b, NF_EFORMAT, "'x'", "alignment 64");
}
