/*
 * planner/import.c - GGUF to store (include/nflash/import.h, docs/IMPORT.md).
 *
 * Invariants:
 *  1. Everything is checked before the first byte is written: every FFN
 *     tensor present with the shapes and types its layer implies, every
 *     bundle layout exact, every name storable. Errors name the file and
 *     the tensor; the hyperparameters pass the runtime's own check
 *     (nf_model_hparams_read), so import never writes what eval refuses.
 *  2. Bytes are copied, never converted: dense objects are the tensors'
 *     bytes; bundles are nf_bundle_pack() of the tensors (lossless by
 *     construction, see storage/bundle.c).
 *  3. Nothing appears under the output name unless the whole store was
 *     written, fsync'd and renamed (the store writer), and read back with
 *     every crc32c matching; a store that fails the read-back is removed.
 *     An existing output is never replaced unless asked.
 *  4. Memory stays bounded: the source is mapped, bundles are packed in
 *     chunks of about 1 MiB, and the read-back uses fixed-size buffers.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nflash/bundle.h"
#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "nflash/import.h"
#include "nflash/io.h"
#include "nflash/model.h"
#include "nflash/store.h"

#define CHUNK_BYTES (1u << 20)
#define VERIFY_BYTES (4u << 20)

enum part { P_GATE, P_UP, P_DOWN, P_DOWN_T, P_GATE_X, P_UP_X, P_DOWN_X, P_COUNT };

static const char *const part_name[P_COUNT] = {
	"ffn_gate", "ffn_up", "ffn_down", "ffn_down_t", "ffn_gate_exps", "ffn_up_exps",
	"ffn_down_exps",
};

struct ffn {
	uint32_t layer, expert;
	char name[48];
	struct nf_bundle_src src;
	struct nf_bundle_layout L;
	bool down_t;
};

struct import {
	const char *path, *out;
	struct nf_gguf *g;
	const struct nf_import_opts *o;
	struct nf_diag *d;
	uint32_t n_layer;
	/* per layer, per part: the tensor or NULL */
	const struct nf_gguf_tensor *(*parts)[P_COUNT];
	struct ffn *ffns;
	uint32_t n_ffn;
	uint8_t *meta;
	size_t meta_len;
	struct nf_import_report rep;
	bool relu;                   /* ReLU or dReLU FFNs (NF_IMPORT_GATE_AUTO) */
};

void nf_import_opts_default(struct nf_import_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->extent_bundles = 16;
	o->block_size = NF_STORE_BLOCK_DEFAULT;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool cancelled(const struct import *im)
{
	return im->o->cancel && *im->o->cancel;
}

/* "blk.N.<part>.weight" -> part and N; -1 for any other name. */
static int ffn_part(const char *name, uint32_t *layer)
{
	unsigned l;
	int n = 0;
	if (sscanf(name, "blk.%u.%n", &l, &n) != 1 || n == 0)
		return -1;
	for (int p = 0; p < P_COUNT; p++) {
		size_t k = strlen(part_name[p]);
		if (!strncmp(name + n, part_name[p], k) && !strcmp(name + n + k, ".weight")) {
			*layer = l;
			return p;
		}
	}
	return -1;
}

/* The number of layers: <arch>.block_count, else 1 + the highest blk.N. */
static int count_layers(struct import *im)
{
	const char *arch;
	char key[96];
	uint32_t n = 0;
	if (nf_gguf_get_str(im->g, "general.architecture", &arch) == 0) {
		snprintf(key, sizeof(key), "%s.block_count", arch);
		if (nf_gguf_get_u32(im->g, key, &n) == 0 && n > 0 && n <= 65536) {
			im->n_layer = n;
			return 0;
		}
	}
	for (size_t i = 0; i < nf_gguf_n_tensors(im->g); i++) {
		unsigned l;
		if (sscanf(nf_gguf_tensor_at(im->g, i)->name, "blk.%u.", &l) == 1 && l < 65536 &&
		    l + 1 > n)
			n = l + 1;
	}
	im->n_layer = n;
	return 0;
}

static int want_shape(struct import *im, const struct nf_gguf_tensor *t, uint32_t n_dims,
		      uint64_t a, uint64_t b, uint64_t c)
{
	uint64_t ne[3] = { a, b, c };
	bool ok = t->n_dims == n_dims;
	for (uint32_t k = 0; k < 3 && ok; k++)
		ok = t->ne[k] == (k < n_dims ? ne[k] : 1);
	if (!ok)
		return nf_diag_fail(im->d, NF_EFORMAT,
				    "%s: tensor %s: shape [%llu, %llu, %llu] where [%llu, %llu, %llu] "
				    "was expected", im->path, t->name, (unsigned long long)t->ne[0],
				    (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
				    (unsigned long long)a, (unsigned long long)b,
				    (unsigned long long)(n_dims > 2 ? c : 1));
	if (!t->data)
		return nf_diag_fail(im->d, NF_EFORMAT, "%s: tensor %s: data not mapped", im->path,
				    t->name);
	return 0;
}

static int missing(struct import *im, uint32_t l, int part, const char *why)
{
	return nf_diag_fail(im->d, NF_ENOTFOUND, "%s: missing tensor blk.%u.%s.weight%s", im->path,
			    l, part_name[part], why);
}

static int add_ffn(struct import *im, uint32_t l, uint32_t e, const struct nf_bundle_src *src,
		   bool down_t, const struct nf_gguf_tensor *up, const struct nf_gguf_tensor *down)
{
	struct ffn *f = &im->ffns[im->n_ffn];
	f->layer = l;
	f->expert = e;
	f->src = *src;
	f->down_t = down_t;
	if (e == 0)
		snprintf(f->name, sizeof(f->name), "blk.%u.ffn", l);
	else
		snprintf(f->name, sizeof(f->name), "blk.%u.ffn.%u", l, e);
	int rc = nf_bundle_layout_make(src, im->o->block_size, &f->L);
	if (rc == NF_EUNSUPPORTED)
		return nf_diag_fail(im->d, rc,
				    "%s: tensors %s (%s) and %s (%s): no exact neuron bundle form for "
				    "these types", im->path, up->name, nf_dtype_name(up->type),
				    down->name, nf_dtype_name(down->type));
	if (rc < 0)
		return nf_diag_fail(im->d, rc,
				    "%s: tensors %s and %s: n_embd %u / n_ff %u do not split into "
				    "whole %s blocks per neuron", im->path, up->name, down->name,
				    src->n_embd, src->n_ff, nf_dtype_name(down->type));
	im->n_ffn++;
	if (f->L.down_form == NF_DOWN_QCOL)
		im->rep.n_qcol++;
	return 0;
}

/* Check layer l's FFN tensors and add its FFN objects. */
static int plan_layer(struct import *im, uint32_t l)
{
	const struct nf_gguf_tensor *const *t = im->parts[l];
	int rc;
	if (t[P_UP_X] || t[P_GATE_X] || t[P_DOWN_X]) {
		if (!t[P_UP_X])
			return missing(im, l, P_UP_X, "");
		if (!t[P_DOWN_X])
			return missing(im, l, P_DOWN_X, "");
		const struct nf_gguf_tensor *u = t[P_UP_X], *g = t[P_GATE_X], *dn = t[P_DOWN_X];
		uint64_t E = u->ne[0], F = u->ne[1], X = u->ne[2];
		if (u->n_dims != 3 || E == 0 || F == 0 || X == 0 || E > UINT32_MAX || F > UINT32_MAX ||
		    X > 4096)
			return want_shape(im, u, 3, E, F, X ? X : 1);
		if ((rc = want_shape(im, u, 3, E, F, X)) < 0 ||
		    (g && (rc = want_shape(im, g, 3, E, F, X)) < 0) ||
		    (rc = want_shape(im, dn, 3, F, E, X)) < 0)
			return rc;
		if (g && g->type != u->type)
			return nf_diag_fail(im->d, NF_EUNSUPPORTED,
					    "%s: tensors %s (%s) and %s (%s): gate and up must share a type",
					    im->path, g->name, nf_dtype_name(g->type), u->name,
					    nf_dtype_name(u->type));
		if (X > im->rep.n_expert)
			im->rep.n_expert = (uint32_t)X;
		for (uint64_t e = 0; e < X; e++) {
			struct nf_bundle_src s = {
				.gate = g ? (const uint8_t *)g->data + e * (g->size / X) : NULL,
				.up = (const uint8_t *)u->data + e * (u->size / X),
				.down = (const uint8_t *)dn->data + e * (dn->size / X),
				.dtype_gate_up = u->type, .dtype_down = dn->type,
				.n_embd = (uint32_t)E, .n_ff = (uint32_t)F,
			};
			if ((rc = add_ffn(im, l, (uint32_t)e, &s, false, u, dn)) < 0)
				return rc;
		}
		return 0;
	}
	if (!t[P_UP])
		return missing(im, l, P_UP, "");
	if (!t[P_DOWN] && !t[P_DOWN_T])
		return missing(im, l, P_DOWN, " (nor ffn_down_t)");
	if (t[P_DOWN] && t[P_DOWN_T])
		return nf_diag_fail(im->d, NF_EFORMAT, "%s: layer %u has both %s and %s", im->path, l,
				    t[P_DOWN]->name, t[P_DOWN_T]->name);
	const struct nf_gguf_tensor *u = t[P_UP], *g = t[P_GATE];
	const struct nf_gguf_tensor *dn = t[P_DOWN] ? t[P_DOWN] : t[P_DOWN_T];
	uint64_t E = u->ne[0], F = u->ne[1];
	if (u->n_dims != 2 || E == 0 || F == 0 || E > UINT32_MAX || F > UINT32_MAX)
		return want_shape(im, u, 2, E ? E : 1, F ? F : 1, 1);
	if ((g && (rc = want_shape(im, g, 2, E, F, 1)) < 0) ||
	    (rc = want_shape(im, u, 2, E, F, 1)) < 0 ||
	    (rc = t[P_DOWN] ? want_shape(im, dn, 2, F, E, 1) : want_shape(im, dn, 2, E, F, 1)) < 0)
		return rc;
	if (g && g->type != u->type)
		return nf_diag_fail(im->d, NF_EUNSUPPORTED,
				    "%s: tensors %s (%s) and %s (%s): gate and up must share a type",
				    im->path, g->name, nf_dtype_name(g->type), u->name,
				    nf_dtype_name(u->type));
	struct nf_bundle_src s = {
		.gate = g ? g->data : NULL, .up = u->data,
		.down = t[P_DOWN] ? dn->data : NULL, .down_t = t[P_DOWN] ? NULL : dn->data,
		.dtype_gate_up = u->type, .dtype_down = dn->type,
		.n_embd = (uint32_t)E, .n_ff = (uint32_t)F,
	};
	return add_ffn(im, l, 0, &s, !t[P_DOWN], u, dn);
}

static int plan(struct import *im)
{
	int rc = count_layers(im);
	if (rc < 0)
		return rc;
	size_t nt = nf_gguf_n_tensors(im->g);
	im->parts = calloc(im->n_layer ? im->n_layer : 1, sizeof(*im->parts));
	if (!im->parts)
		return nf_diag_fail(im->d, -ENOMEM, "%s: out of memory", im->path);
	size_t max_ffn = 0;
	for (size_t i = 0; i < nt; i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(im->g, i);
		uint32_t l;
		int p = ffn_part(t->name, &l);
		if (p < 0)
			continue;
		if (l >= im->n_layer)
			return nf_diag_fail(im->d, NF_EFORMAT,
					    "%s: tensor %s: layer %u, but the model has %u layers",
					    im->path, t->name, l, im->n_layer);
		im->parts[l][p] = t;
		if (p == P_UP_X)
			max_ffn += t->ne[2];
	}
	max_ffn += im->n_layer;
	im->ffns = calloc(max_ffn ? max_ffn : 1, sizeof(*im->ffns));
	if (!im->ffns)
		return nf_diag_fail(im->d, -ENOMEM, "%s: out of memory", im->path);
	if (im->n_layer == 0)
		return nf_diag_fail(im->d, NF_ENOTFOUND, "%s: no layers (no blk.N tensors)", im->path);
	for (uint32_t l = 0; l < im->n_layer; l++)
		if ((rc = plan_layer(im, l)) < 0)
			return rc;
	/* Files mix down types per layer (a Q4_K_M file's down matrices are
	 * Q4_K or Q6_K): every FFN gets the largest stride, so that one cache
	 * slot size serves every layer (docs/FORMAT.md item 23). */
	uint32_t stride = 0;
	for (uint32_t i = 0; i < im->n_ffn; i++)
		stride = im->ffns[i].L.stride > stride ? im->ffns[i].L.stride : stride;
	for (uint32_t i = 0; i < im->n_ffn; i++)
		im->ffns[i].L.stride = stride;
	im->rep.n_layer = im->n_layer;
	return 0;
}

/* ---- the metadata blob ----------------------------------------------------- */

/* A GGUF with every key/value of the source and no tensors, built with the
 * GGUF writer in a private temporary directory beside the output, read back
 * into memory and removed. */
static int make_meta(struct import *im)
{
	char *tdir = NULL, *tfile = NULL;
	struct nf_gguf_writer *w = NULL;
	const struct nf_io_sys *sys = im->o->sys ? im->o->sys : &nf_io_sys_default;
	int fd = -1;
	int dfd = -1;      /* holds the directory's lock: a sweep leaves it alone */
	int rc = nf_io_tmp_create(im->o->sys, im->out, true, &tdir, &dfd, im->d);
	if (rc < 0)
		return rc;
	rc = -ENOMEM;
	if (asprintf(&tfile, "%s/meta.gguf", tdir) < 0) {
		tfile = NULL;
		goto out;
	}
	rc = nf_gguf_writer_open_sys(tfile, nf_gguf_is_powerinfer(im->g), im->o->sys, &w, im->d);
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_kv(im->g); i++) {
		const struct nf_gguf_kv *kv = nf_gguf_kv_at(im->g, i);
		rc = nf_gguf_writer_kv_copy(w, kv);
		if (rc < 0)
			nf_diag_fail(im->d, rc, "%s: key %s: cannot copy it: %s", im->path, kv->key,
				     nf_strerror(rc));
	}
	if (rc == 0) {
		rc = nf_gguf_writer_finish(w, im->d);
		w = NULL;
	}
	if (rc < 0)
		goto out;
	fd = sys->open(tfile, O_RDONLY, 0);
	struct stat st;
	if (fd < 0 || sys->fstat(fd, &st) < 0) {
		rc = nf_diag_fail(im->d, -errno, "%s: %s", tfile, nf_strerror(-errno));
		goto out;
	}
	im->meta_len = (size_t)st.st_size;
	im->meta = malloc(im->meta_len ? im->meta_len : 1);
	if (!im->meta) {
		rc = -ENOMEM;
		goto out;
	}
	if ((rc = nf_io_pread_full(sys, fd, im->meta, im->meta_len, 0)) < 0) {
		rc = nf_diag_fail(im->d, rc, "%s: reading it back: %s", tfile, nf_strerror(rc));
		goto out;
	}
	/* The image must parse: the model reads it back from the store. */
	struct nf_gguf *chk;
	rc = nf_gguf_open_mem(im->meta, im->meta_len, &chk, im->d);
	nf_gguf_close(chk);
out:
	if (rc == -ENOMEM)
		nf_diag_fail(im->d, rc, "%s: out of memory", im->out);
	if (fd >= 0)
		sys->close(fd);
	nf_gguf_writer_abort(w);
	if (tfile)
		sys->unlink(tfile);
	rmdir(tdir);
	sys->close(dfd);
	free(tfile);
	free(tdir);
	return rc;
}

/* ---- writing ------------------------------------------------------------------ */

static void progress(struct import *im, enum nf_import_phase ph, uint64_t done, uint64_t total)
{
	if (im->o->progress)
		im->o->progress(im->o->progress_user, ph, done, total);
}

static void scales_name(const struct ffn *f, char *buf, size_t n)
{
	snprintf(buf, n, "%s.down_scales", f->name);
}

static void gate_rows_name(const struct ffn *f, char *buf, size_t n)
{
	snprintf(buf, n, "%s" NF_STORE_GATE_ROWS_SUFFIX, f->name);
}

/* The FFNs whose gate rows get their own object (gate_objects): with
 * NF_IMPORT_GATE_AUTO those exact mode runs, a ReLU/dReLU FFN whose layer
 * has no predictor (blk.N.fc1.weight; a mixture's are per layer too). */
static bool has_gate_rows(const struct import *im, const struct ffn *f)
{
	if (!im->o->gate_objects || !f->src.gate || !f->L.has_gate)
		return false;
	if (im->o->gate_objects > 0)
		return true;
	char nm[64];
	snprintf(nm, sizeof(nm), "blk.%u.fc1.weight", f->layer);
	return im->relu && !nf_gguf_find_tensor(im->g, nm);
}

static int declare(struct import *im, struct nf_store_writer *w)
{
	struct nf_diag *d = im->d;
	int rc = nf_store_writer_add_blob(w, NF_IMPORT_META_NAME, im->meta_len, d);
	if (rc < 0)
		return rc;
	im->rep.meta_bytes = im->meta_len;
	for (size_t i = 0; i < nf_gguf_n_tensors(im->g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(im->g, i);
		uint32_t l;
		if (ffn_part(t->name, &l) >= 0)
			continue;
		if (!t->data)
			return nf_diag_fail(d, NF_EFORMAT, "%s: tensor %s: data not mapped", im->path,
					    t->name);
		if (strlen(t->name) >= 64 || !strcmp(t->name, NF_IMPORT_META_NAME))
			return nf_diag_fail(d, NF_EUNSUPPORTED,
					    "%s: tensor %s: the name cannot be a store object name "
					    "(1..63 bytes, not %s)", im->path, t->name, NF_IMPORT_META_NAME);
		if ((rc = nf_store_writer_add_dense(w, t->name, t->type, t->n_dims, t->ne, d)) < 0)
			return nf_diag_fail(d, rc, "%s: tensor %s: %s", im->path, t->name,
					    nf_strerror(rc));
		im->rep.n_dense++;
		im->rep.dense_bytes += t->size;
	}
	for (uint32_t i = 0; i < im->n_ffn; i++) {
		const struct ffn *f = &im->ffns[i];
		if (f->L.down_form != NF_DOWN_QCOL)
			continue;
		char nm[80];
		uint64_t shape[2];
		nf_bundle_scales_shape(&f->L, shape);
		scales_name(f, nm, sizeof(nm));
		if ((rc = nf_store_writer_add_dense(w, nm, NF_DTYPE_F16, 2, shape, d)) < 0)
			return rc;
		im->rep.n_scales++;
		im->rep.dense_bytes += shape[0] * shape[1] * 2;
	}
	for (uint32_t i = 0; i < im->n_ffn; i++) {
		const struct ffn *f = &im->ffns[i];
		if (!has_gate_rows(im, f))
			continue;
		char nm[80];
		uint64_t shape[2] = { f->L.dim, f->L.n_neurons };
		gate_rows_name(f, nm, sizeof(nm));
		if ((rc = nf_store_writer_add_dense(w, nm, f->L.dtype, 2, shape, d)) < 0)
			return rc;
		im->rep.dense_bytes += (uint64_t)f->L.n_neurons * f->L.row_bytes;
		im->rep.n_gate_rows++;
	}
	for (uint32_t i = 0; i < im->n_ffn; i++) {
		const struct ffn *f = &im->ffns[i];
		if ((rc = nf_store_writer_add_ffn_layout(w, f->name, f->layer, f->expert, &f->L,
							 f->down_t, im->o->extent_bundles, d)) < 0)
			return rc;
		im->rep.ffn_bytes += (uint64_t)f->L.n_neurons * f->L.stride;
	}
	im->rep.n_ffn = im->n_ffn;
	return 0;
}

/* Drop the mapped source pages of [p, p + n) from this process: they were
 * copied, and a model larger than memory must not stay resident through
 * the mapping (the page cache keeps them as long as the kernel likes). */
static void drop_source(const void *p, uint64_t n)
{
	uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095, e = (uintptr_t)p + n;
	if (n)
		madvise((void *)a, e - a, MADV_DONTNEED);
}

/* Drop one FFN's source matrices (a page shared with a neighbouring
 * expert's slice is simply read again if needed). */
static void drop_ffn_source(const struct ffn *f, bool down_only)
{
	uint64_t gu = (uint64_t)f->L.n_neurons * f->L.row_bytes;
	uint64_t dn = f->src.down_t ? (uint64_t)f->L.n_neurons * f->L.down_bytes
				    : nf_dtype_row_size(f->src.dtype_down, f->L.n_neurons) * f->L.dim;
	drop_source(f->src.down_t ? f->src.down_t : f->src.down, dn);
	if (down_only)
		return;
	if (f->src.gate)
		drop_source(f->src.gate, gu);
	drop_source(f->src.up, gu);
}

static int write_bytes(struct import *im, struct nf_store_writer *w, const void *p, uint64_t n,
		       const char *what)
{
	const uint8_t *b = p;
	while (n) {
		size_t k = n < CHUNK_BYTES ? (size_t)n : CHUNK_BYTES;
		int rc = nf_store_writer_write_dense(w, b, k);
		if (rc < 0)
			return nf_diag_fail(im->d, rc, "%s: writing %s: %s", im->out, what,
					    nf_strerror(rc));
		if (cancelled(im))
			return nf_diag_fail(im->d, -EINTR, "%s: import interrupted", im->out);
		b += k;
		n -= k;
		progress(im, NF_IMPORT_PHASE_WRITE, nf_store_writer_done(w), nf_store_writer_total(w));
	}
	return 0;
}

static int write_all(struct import *im, struct nf_store_writer *w)
{
	int rc = write_bytes(im, w, im->meta, im->meta_len, NF_IMPORT_META_NAME);
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(im->g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(im->g, i);
		uint32_t l;
		if (ffn_part(t->name, &l) < 0) {
			rc = write_bytes(im, w, t->data, t->size, t->name);
			drop_source(t->data, t->size);
		}
	}
	uint16_t *scales = NULL;
	uint8_t *buf = NULL;
	for (uint32_t i = 0; rc == 0 && i < im->n_ffn; i++) {
		const struct ffn *f = &im->ffns[i];
		if (f->L.down_form != NF_DOWN_QCOL)
			continue;
		uint64_t shape[2];
		nf_bundle_scales_shape(&f->L, shape);
		size_t n = (size_t)(shape[0] * shape[1]);
		uint16_t *p = realloc(scales, n * sizeof(*p));
		if (!p) {
			rc = nf_diag_fail(im->d, -ENOMEM, "%s: out of memory", im->out);
			break;
		}
		scales = p;
		nf_bundle_pack_scales(&f->src, scales);
		char nm[80];
		scales_name(f, nm, sizeof(nm));
		drop_ffn_source(f, true);
		rc = write_bytes(im, w, scales, n * sizeof(*scales), nm);
	}
	free(scales);
	for (uint32_t i = 0; rc == 0 && i < im->n_ffn; i++) {
		const struct ffn *f = &im->ffns[i];
		char nm[80];
		gate_rows_name(f, nm, sizeof(nm));
		if (has_gate_rows(im, f))
			rc = write_bytes(im, w, f->src.gate, (uint64_t)f->L.n_neurons * f->L.row_bytes, nm);
	}
	for (uint32_t i = 0; rc == 0 && i < im->n_ffn; i++) {
		const struct ffn *f = &im->ffns[i];
		uint32_t per = CHUNK_BYTES / f->L.stride ? CHUNK_BYTES / f->L.stride : 1;
		free(buf);
		buf = malloc((size_t)per * f->L.stride);
		if (!buf) {
			rc = nf_diag_fail(im->d, -ENOMEM, "%s: out of memory", im->out);
			break;
		}
		for (uint32_t first = 0; rc == 0 && first < f->L.n_neurons; first += per) {
			uint32_t n = f->L.n_neurons - first < per ? f->L.n_neurons - first : per;
			nf_bundle_pack(&f->src, &f->L, first, n, buf);
			rc = nf_store_writer_write_bundles(w, buf, n);
			if (rc < 0)
				nf_diag_fail(im->d, rc, "%s: writing FFN %s: %s", im->out, f->name,
					     nf_strerror(rc));
			else if (cancelled(im))
				rc = nf_diag_fail(im->d, -EINTR, "%s: import interrupted", im->out);
			progress(im, NF_IMPORT_PHASE_WRITE, nf_store_writer_done(w),
				 nf_store_writer_total(w));
		}
		drop_ffn_source(f, false);
	}
	free(buf);
	return rc;
}

/* ---- read-back ------------------------------------------------------------------ */

struct vdone {
	int calls, result;
};

static void on_done(void *cookie, int result)
{
	struct vdone *v = cookie;
	v->calls++;
	if (result < 0 && v->result == 0)
		v->result = result;
}

/* Read every object back with O_DIRECT; the I/O engine checks each dense
 * object's and each extent's crc32c on completion. */
static int verify(struct import *im)
{
	struct nf_store *s = NULL;
	struct nf_io_ctx *io = NULL;
	uint8_t *buf = NULL;
	struct nf_store_open_opts so = { .sys = im->o->sys };
	int rc = nf_store_open(im->out, &so, &s, im->d);
	if (rc < 0)
		return rc;
	struct nf_io_opts io_o;
	nf_io_opts_default(&io_o);
	io_o.quiet = true;
	io_o.sys = im->o->sys;
	if ((rc = nf_io_ctx_open(s, &io_o, &io, im->d)) < 0)
		goto out;
	uint32_t bs = nf_store_info(s)->block_size;
	uint64_t cap = VERIFY_BYTES, total = 0, done = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		uint64_t need = ob->kind == NF_STORE_KIND_FFN ? (uint64_t)ob->extent_bundles * ob->stride
							      : nf_store_object_buf_size(ob, bs);
		if (need > cap)
			cap = need;
		total += ob->length;
	}
	buf = nf_io_buf_alloc(cap, nf_io_ctx_align(io) > bs ? nf_io_ctx_align(io) : bs);
	if (!buf) {
		rc = nf_diag_fail(im->d, -ENOMEM, "%s: out of memory for the read-back", im->out);
		goto out;
	}
	for (uint32_t i = 0; i < nf_store_object_count(s) && rc == 0; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		uint32_t step = 1, n_steps = 1;
		if (ob->kind == NF_STORE_KIND_FFN) {
			uint64_t ext = (uint64_t)ob->extent_bundles * ob->stride;
			step = (uint32_t)(cap / ext);   /* cap holds at least one extent */
			n_steps = ob->n_extents;
		}
		for (uint32_t e = 0; e < n_steps && rc == 0; e += step) {
			struct vdone v = { 0 };
			uint32_t cnt = n_steps - e < step ? n_steps - e : step;
			rc = ob->kind == NF_STORE_KIND_FFN
				? nf_io_ctx_read_extents(io, ob, e, cnt, buf, on_done, &v)
				: nf_io_ctx_read_object(io, ob, buf, on_done, &v);
			if (rc == 0) {
				int w = nf_io_ctx_wait(io, 0, -1);
				rc = v.result ? v.result : (w < 0 ? w : 0);
			}
			if (rc < 0) {
				if (ob->kind == NF_STORE_KIND_FFN)
					nf_diag_fail(im->d, rc, "%s: read-back of %s extents %u..%u: %s",
						     im->out, ob->name, e, e + cnt - 1, nf_strerror(rc));
				else
					nf_diag_fail(im->d, rc, "%s: read-back of %s: %s", im->out,
						     ob->name, nf_strerror(rc));
				break;
			}
			if (ob->kind == NF_STORE_KIND_FFN) {
				uint64_t off, len, o2, l2;
				nf_store_extent_span(ob, e, &off, &len);
				nf_store_extent_span(ob, e + cnt - 1, &o2, &l2);
				done += o2 + l2 - off;
			} else {
				done += ob->length;
			}
			progress(im, NF_IMPORT_PHASE_VERIFY, done, total);
			if (cancelled(im))
				rc = nf_diag_fail(im->d, -EINTR, "%s: import interrupted", im->out);
		}
	}
	im->rep.verified_bytes = done;
out:
	nf_io_buf_free(buf);
	nf_io_ctx_close(io);
	nf_store_close(s);
	return rc;
}

int nf_import(const char *gguf_path, const char *out_path, const struct nf_import_opts *opts,
	      struct nf_import_report *report, struct nf_diag *d)
{
	struct nf_import_opts defaults;
	struct import im = { .path = gguf_path, .out = out_path, .d = d };
	struct nf_store_writer *w = NULL;
	bool published = false;
	int rc;

	nf_import_opts_default(&defaults);
	if (!opts)
		opts = &defaults;
	im.o = opts;
	if (opts->block_size && (opts->block_size < NF_STORE_BLOCK_MIN ||
				 opts->block_size > NF_STORE_BLOCK_MAX ||
				 (opts->block_size & (opts->block_size - 1))))
		return nf_diag_fail(d, NF_EUSAGE, "bundle alignment %u is not a power of two in [%u, %u]",
				    opts->block_size, NF_STORE_BLOCK_MIN, NF_STORE_BLOCK_MAX);
	if (opts->block_size == 0 || opts->extent_bundles == 0) {
		defaults = *opts;
		if (!defaults.block_size)
			defaults.block_size = NF_STORE_BLOCK_DEFAULT;
		if (!defaults.extent_bundles)
			defaults.extent_bundles = 16;
		im.o = opts = &defaults;
	}
	struct stat st;
	if ((rc = nf_io_target_check(opts->sys, out_path, d)) < 0)
		return rc;
	if (!opts->overwrite && stat(out_path, &st) == 0)
		return nf_diag_fail(d, NF_EUSAGE,
				    "%s: already exists and is kept (nflash import --force replaces it)",
				    out_path);

	double t0 = now_s();
	rc = nf_gguf_open_sys(gguf_path, NF_GGUF_MMAP, opts->sys, &im.g, d);
	if (rc < 0)
		goto out;
	im.rep.powerinfer = nf_gguf_is_powerinfer(im.g);
	/* The runtime's own hyperparameter check: a store eval would refuse
	 * (head_count 0, eps NaN) is never written. */
	struct nf_model_hparams hp;
	if ((rc = nf_model_hparams_read(im.g, &hp, d)) < 0)
		goto out;
	im.relu = hp.act == NF_FFN_RELU || hp.act == NF_FFN_DRELU;
	if ((rc = plan(&im)) < 0 || (rc = make_meta(&im)) < 0)
		goto out;

	struct nf_store_create_opts co = {
		.block_size = opts->block_size, .extent_bundles = opts->extent_bundles,
		.sys = opts->sys,
	};
	if ((rc = nf_store_writer_open(out_path, &co, &w, d)) < 0 || (rc = declare(&im, w)) < 0 ||
	    (rc = nf_store_writer_begin(w, d)) < 0 || (rc = write_all(&im, w)) < 0)
		goto out;
	if (cancelled(&im)) {
		rc = nf_diag_fail(d, -EINTR, "%s: import interrupted", out_path);
		goto out;
	}
	if ((rc = nf_store_writer_finish(w, d)) < 0)
		goto out;
	published = true;
	nf_store_writer_close(w);
	w = NULL;
	im.rep.write_s = now_s() - t0;

	if (!opts->no_verify) {
		t0 = now_s();
		rc = verify(&im);
		im.rep.verify_s = now_s() - t0;
		if (rc < 0)
			goto out;
	}
	struct nf_store *s;
	if (nf_store_open(out_path, NULL, &s, NULL) == 0) {
		im.rep.file_size = nf_store_info(s)->file_size;
		nf_store_close(s);
	}
	if (report)
		*report = im.rep;
out:
	nf_store_writer_close(w);
	if (rc < 0 && published)
		unlink(out_path);   /* a store that failed its read-back is not kept */
	nf_gguf_close(im.g);
	free(im.parts);
	free(im.ffns);
	free(im.meta);
	return rc;
}
