/*
 * tests/util_pipeline.c - see util_pipeline.h.
 *
 * Invariant: the store written holds exactly the model's bytes (gate and
 * up rows copied, down columns gathered element by element), so an engine
 * reading it computes on the same values as on the GGUF.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/import.h"
#include "nflash/kernels.h"
#include "nflash/sampler.h"
#include "nflash/sparse.h"
#include "nflash/store.h"
#include "nflash/synth.h"
#include "util_pipeline.h"

int pl_store_from_model(const struct nf_model *m, const char *path, uint32_t extent_bundles,
			bool shuffle, char *msg, size_t msg_len)
{
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	struct nf_diag d = { 0 };
	struct nf_store_writer *w = NULL;
	uint32_t E = hp->n_embd, F = hp->n_ff;
	const struct nf_layer_weights *L0 = nf_model_layer(m, 0);
	uint32_t dt = L0->up.dtype;
	size_t esz = dt == NF_DTYPE_F32 ? 4 : 2;
	char *down = NULL;
	uint32_t *perm = NULL, *inv = NULL;
	int rc = NF_EUNSUPPORTED;
	if (hp->n_expert || (dt != NF_DTYPE_F32 && dt != NF_DTYPE_F16)) {
		snprintf(msg, msg_len, "only dense float models");
		return rc;
	}
	if ((rc = nf_store_writer_open(path, NULL, &w, &d)) < 0)
		goto out;
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		char name[64];
		snprintf(name, sizeof(name), "blk.%u.ffn", il);
		if ((rc = nf_store_writer_add_ffn(w, name, il, 0, dt, E, F, L0->gate.data != NULL,
						  extent_bundles, &d)) < 0)
			goto out;
	}
	if ((rc = nf_store_writer_begin(w, &d)) < 0)
		goto out;
	rc = -ENOMEM;
	if (!(down = malloc((size_t)E * esz)) || !(perm = malloc(F * sizeof(uint32_t))) ||
	    !(inv = malloc(F * sizeof(uint32_t))))
		goto out;
	for (uint32_t j = 0; j < F; j++)
		perm[j] = j;
	if (shuffle) {
		uint64_t x = 88172645463325252ull;
		for (uint32_t j = F - 1; j > 0; j--) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			uint32_t k = (uint32_t)(x % (j + 1));
			uint32_t t = perm[j];
			perm[j] = perm[k];
			perm[k] = t;
		}
	}
	for (uint32_t j = 0; j < F; j++)
		inv[perm[j]] = j; /* slot -> neuron */
	for (uint32_t il = 0; il < hp->n_layer; il++) {
		const struct nf_layer_weights *L = nf_model_layer(m, il);
		if (L->up.dtype != dt || (L->down_t.data ? L->down_t.dtype : L->down.dtype) != dt) {
			rc = NF_EUNSUPPORTED;
			snprintf(msg, msg_len, "layer %u: mixed weight types", il);
			goto out;
		}
		for (uint32_t s = 0; s < F; s++) {
			uint32_t j = inv[s];
			const char *g = L->gate.data ? (const char *)L->gate.data + (size_t)j * L->gate.row_bytes : NULL;
			const char *u = (const char *)L->up.data + (size_t)j * L->up.row_bytes;
			const char *dn;
			if (L->down_t.data) {
				dn = (const char *)L->down_t.data + (size_t)j * L->down_t.row_bytes;
			} else {
				for (uint32_t r = 0; r < E; r++)
					memcpy(down + (size_t)r * esz,
					       (const char *)L->down.data + (size_t)r * L->down.row_bytes + (size_t)j * esz, esz);
				dn = down;
			}
			if ((rc = nf_store_writer_write_bundle(w, g, u, dn)) < 0)
				goto out;
		}
		if (shuffle && (rc = nf_store_writer_set_perm(w, il, perm, &d)) < 0)
			goto out;
	}
	rc = nf_store_writer_finish(w, &d);
out:
	if (rc < 0 && msg[0] == 0)
		snprintf(msg, msg_len, "%s", nf_diag_msg(&d, rc));
	nf_store_writer_close(w);
	free(down);
	free(perm);
	free(inv);
	return rc;
}

int pl_synth_tiny(const char *path, const char *act, uint32_t dtype, bool predictor)
{
	return pl_synth_tiny_moe(path, act, dtype, predictor, 0);
}

int pl_synth_tiny_moe(const char *path, const char *act, uint32_t dtype, bool predictor, uint32_t n_expert)
{
	struct nf_synth_params p;
	struct nf_diag d = { 0 };
	nf_synth_params_init(&p);
	int rc = nf_synth_shape(&p, "tiny", &d);
	if (rc < 0)
		return rc;
	p.act = (enum nf_synth_act)nf_synth_act_parse(act);
	p.dtype = dtype;
	if (nf_dtype_is_kquant(dtype))
		p.n_embd = 256; /* K-quant rows: whole super-blocks */
	p.predictor = predictor;
	if (n_expert) {
		p.n_expert = n_expert;
		p.n_expert_used = 2;
	}
	p.n_threads = 1;
	if ((rc = nf_synth_validate(&p, &d)) < 0)
		return rc;
	return nf_synth_write(&p, path, &d);
}

/* Round v (n values) as the kernels prepare an input for weight type dt. */
void pl_round_for(uint32_t dt, const float *v, float *out, size_t n)
{
	if (dt == NF_DTYPE_F32) {
		memcpy(out, v, n * sizeof(float));
		return;
	}
	uint32_t dot = nf_ktype_dot_dtype(nf_ktype_of(dt));
	void *q = malloc(nf_dtype_row_size(dot, n));
	nf_quantize_row(dot, v, q, n);
	nf_dequantize_row(dot, q, out, n);
	free(q);
}

double pl_dotd(const struct nf_weight *w, uint32_t r, const float *x, float *row)
{
	nf_dequantize_row(w->dtype, (const char *)w->data + (size_t)r * w->row_bytes, row, w->n);
	double s = 0;
	for (uint32_t i = 0; i < w->n; i++)
		s += (double)row[i] * (double)x[i];
	return s;
}

struct nf_sparse *pl_engine(struct nf_ctx *c, enum nf_sparse_mode mode, struct nf_cache *cache)
{
	struct nf_sparse_params sp;
	nf_sparse_params_init(&sp);
	sp.mode = mode;
	sp.cache = cache;
	struct nf_sparse *s = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_sparse_open(c, &sp, &s, &d);
	cr_assert_eq(rc, 0, "nf_sparse_open(%s): %s", nf_sparse_mode_name(mode), nf_diag_msg(&d, rc));
	return s;
}

struct nf_cache *pl_open_cache(const char *store_path, struct nf_store **st, uint64_t arena,
			       const struct nf_io_fault_rule *fault, uint32_t min_cold_slots)
{
	struct nf_diag d = { 0 };
	int rc = nf_store_open(store_path, NULL, st, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	struct nf_cache_opts o;
	nf_cache_opts_default(&o);
	o.arena_bytes = arena;
	o.min_cold_slots = min_cold_slots;
	o.io.quiet = true;
	if (fault) {
		o.io.backend = NF_IO_FAULT;
		o.io.fault.inner = NF_IO_AUTO;
		o.io.fault.n_rules = 1;
		o.io.fault.rules[0] = *fault;
	}
	struct nf_cache *c = NULL;
	rc = nf_cache_open(*st, &o, &c, &d);
	cr_assert_eq(rc, 0, "nf_cache_open: %s", nf_diag_msg(&d, rc));
	return c;
}

double pl_max_diff(const float *a, const float *b, size_t n)
{
	double m = 0.0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)a[i] - (double)b[i]);
		if (d > m || isnan(d))
			m = isnan(d) ? INFINITY : d;
	}
	return m;
}

void pl_tmp_path(char *out, size_t len, const char *stem)
{
	static const char *const dirs[] = { "/tmp" };
	snprintf(out, len, "%s/nf-%s-%d-XXXXXX", dirs[0], stem, (int)getpid());
	int fd = mkstemp(out);
	if (fd >= 0) {
		close(fd);
		unlink(out);
	}
}

const int32_t pl_prompt[8] = { 1, 278, 263, 13, 300, 72, 101, 259 };

struct nf_model *pl_load(const char *path, bool prefault, bool unpack)
{
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	struct nf_model_opts o = { .prefault = prefault, .store_unpack_ffn = unpack };
	int rc = nf_model_load(path, &o, &m, &d);
	cr_assert_eq(rc, 0, "%s: %s", path, nf_diag_msg(&d, rc));
	return m;
}

struct nf_ctx *pl_open_ctx(struct nf_model *m, int threads)
{
	struct nf_ctx_params cp = nf_ctx_defaults();
	cp.n_threads = threads;
	cp.n_ctx = 64;
	struct nf_ctx *c = NULL;
	struct nf_diag d = { 0 };
	int rc = nf_ctx_open(m, &cp, &c, &d);
	cr_assert_eq(rc, 0, "nf_ctx_open: %s", nf_diag_msg(&d, rc));
	return c;
}

void pl_run(struct nf_ctx *c, const int32_t *ids, size_t n_ids, float *lg, int32_t *greedy, size_t n)
{
	uint32_t nv = nf_model_hparams(nf_ctx_model(c))->n_vocab;
	nf_ctx_reset(c);
	int rc = nf_ctx_eval(c, ids, n_ids);
	cr_assert_eq(rc, 0, "eval: %s", nf_strerror(rc));
	memcpy(lg, nf_ctx_logits(c), nv * sizeof(float));
	for (size_t i = 0; i < n; i++) {
		int32_t id = nf_sampler_argmax(nf_ctx_logits(c), nv);
		greedy[i] = id;
		if (i + 1 < n) {
			rc = nf_ctx_eval(c, &id, 1);
			cr_assert_eq(rc, 0, "eval: %s", nf_strerror(rc));
		}
	}
}

void pl_import(const char *gguf, char *out, size_t len)
{
	pl_import_with(gguf, out, len, false);
}

void pl_import_with(const char *gguf, char *out, size_t len, bool gate_objects)
{
	pl_tmp_path(out, len, "import");
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	o.block_size = 512;
	o.extent_bundles = 8;
	o.gate_objects = gate_objects;
	struct nf_import_report r;
	struct nf_diag d = { 0 };
	int rc = nf_import(gguf, out, &o, &r, &d);
	cr_assert_eq(rc, 0, "import %s: %s", gguf, nf_diag_msg(&d, rc));
}

int pl_run_cli(const char *args, char *out, size_t out_len, char *err, size_t err_len)
{
	char ef[256];
	pl_tmp_path(ef, sizeof(ef), "cli-err");
	size_t len = strlen(PL_NFLASH_CMD) + strlen(args) + sizeof(ef) + 16;
	char *cmd = malloc(len);
	cr_assert_not_null(cmd);
	snprintf(cmd, len, PL_NFLASH_CMD " %s 2>%s", args, ef);
	FILE *p = popen(cmd, "r");
	free(cmd);
	cr_assert_not_null(p);
	size_t n = fread(out, 1, out_len - 1, p);
	out[n] = 0;
	int st = pclose(p);
	FILE *e = fopen(ef, "r");
	n = e ? fread(err, 1, err_len - 1, e) : 0;
	err[n] = 0;
	if (e)
		fclose(e);
	unlink(ef);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

unsigned long long pl_json_u64(const char *json, const char *key)
{
	char k[64];
	snprintf(k, sizeof(k), "\"%s\":", key);
	const char *at = strstr(json, k);
	cr_assert_not_null(at, "no %s in %s", key, json);
	return strtoull(at + strlen(k), NULL, 10);
}

void pl_make_wide_model(const char *stem, uint32_t n_ctx, char *gguf, char *store, size_t len)
{
	struct nf_synth_params p;
	struct nf_diag d = { 0 };
	char name[64];
	nf_synth_params_init(&p);
	cr_assert_eq(nf_synth_shape(&p, "tiny", &d), 0);
	p.n_embd = 256;
	p.n_ff = 8192;
	p.n_layer = 4;
	p.n_head = 4;
	p.n_head_kv = 2;
	if (n_ctx)
		p.n_ctx = n_ctx;
	p.dtype = NF_DTYPE_F32;
	p.n_threads = 2;
	cr_assert_eq(nf_synth_validate(&p, &d), 0, "%s", d.msg);
	snprintf(name, sizeof(name), "%s-gguf", stem);
	pl_tmp_path(gguf, len, name);
	cr_assert_eq(nf_synth_write(&p, gguf, &d), 0, "%s", d.msg);
	snprintf(name, sizeof(name), "%s-store", stem);
	pl_tmp_path(store, len, name);
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	struct nf_import_report r;
	int rc = nf_import(gguf, store, &o, &r, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
}
