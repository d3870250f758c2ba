/*
 * store_fake.c - stores with a real model's geometry and random contents.
 *
 * Invariants: contents depend only on the options (seed included), so two
 * runs give identical files up to the superblocks' uuid and time; every
 * quantized block has a finite, non-zero fp16 scale, so kernels reading a
 * fake store compute finite numbers. Generation is cheap (one PRNG word per
 * 8 bytes) so creating a multi-GiB store runs at disk speed.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/dtype.h"
#include "nflash/store.h"

static uint64_t rnd(uint64_t *s)
{
	/* xorshift64* */
	uint64_t x = *s;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*s = x;
	return x * 0x2545f4914f6cdd1dull;
}

/* Fill len bytes (whole rows of dtype t) with random valid values. */
static void fill(uint32_t t, uint8_t *p, size_t len, uint64_t *s)
{
	size_t i = 0;
	for (; i + 8 <= len; i += 8) {
		uint64_t v = rnd(s);
		memcpy(p + i, &v, 8);
	}
	if (i < len) {
		uint64_t v = rnd(s);
		memcpy(p + i, &v, len - i);
	}
	switch (t) {
	case NF_DTYPE_F32:
		for (i = 0; i + 4 <= len; i += 4) {
			uint32_t r;
			memcpy(&r, p + i, 4);
			r = (r & 0x807fffffu) | 0x3d000000u;   /* |x| in [1/32, 1/16) */
			memcpy(p + i, &r, 4);
		}
		break;
	case NF_DTYPE_F16:
	case NF_DTYPE_BF16:
		for (i = 0; i + 2 <= len; i += 2) {
			uint16_t r;
			memcpy(&r, p + i, 2);
			r = t == NF_DTYPE_F16 ? (uint16_t)((r & 0x83ffu) | 0x2800u)
					      : (uint16_t)((r & 0x807fu) | 0x3d00u);
			memcpy(p + i, &r, 2);
		}
		break;
	default: {
		size_t bs = nf_dtype_block_size(t);
		for (i = 0; i + bs <= len; i += bs) {
			uint16_t d;
			memcpy(&d, p + i, 2);
			d = (uint16_t)((d & 0x03ffu) | 0x2000u);  /* ~0.008 .. 0.016 */
			memcpy(p + i, &d, 2);
		}
	}
	}
}

void nf_store_fake_opts_default(struct nf_store_fake_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->layers = 1;
	o->dim = 256;
	o->ffn = 688;
	o->experts = 1;
	o->vocab = 32000;
	o->dtype = NF_DTYPE_Q4_0;
	o->seed = 1;
}

static int declare(struct nf_store_writer *w, const struct nf_store_fake_opts *o, struct nf_diag *d)
{
	char name[64];
	int rc;
	uint64_t emb[2] = { o->dim, o->vocab }, vec[1] = { o->dim }, sq[2] = { o->dim, o->dim };
	uint64_t router[2] = { o->dim, o->experts };
	if ((rc = nf_store_writer_add_dense(w, "token_embd.weight", o->dtype, 2, emb, d)) < 0 ||
	    (rc = nf_store_writer_add_dense(w, "output_norm.weight", NF_DTYPE_F32, 1, vec, d)) < 0 ||
	    (rc = nf_store_writer_add_dense(w, "output.weight", o->dtype, 2, emb, d)) < 0)
		return rc;
	static const char *const per_layer[] = { "attn_norm", "attn_q", "attn_k", "attn_v",
						 "attn_output", "ffn_norm" };
	for (uint32_t l = 0; l < o->layers; l++) {
		for (size_t k = 0; k < sizeof(per_layer) / sizeof(per_layer[0]); k++) {
			bool norm = strstr(per_layer[k], "norm") != NULL;
			snprintf(name, sizeof(name), "blk.%u.%s.weight", l, per_layer[k]);
			rc = nf_store_writer_add_dense(w, name, norm ? NF_DTYPE_F32 : o->dtype,
						       norm ? 1 : 2, norm ? vec : sq, d);
			if (rc < 0)
				return rc;
		}
		if (o->experts > 1) {
			snprintf(name, sizeof(name), "blk.%u.ffn_gate_inp.weight", l);
			if ((rc = nf_store_writer_add_dense(w, name, NF_DTYPE_F32, 2, router, d)) < 0)
				return rc;
		}
	}
	for (uint32_t l = 0; l < o->layers; l++)
		for (uint32_t e = 0; e < o->experts; e++) {
			if (o->experts > 1)
				snprintf(name, sizeof(name), "blk.%u.ffn.%u", l, e);
			else
				snprintf(name, sizeof(name), "blk.%u.ffn", l);
			rc = nf_store_writer_add_ffn(w, name, l, e, o->dtype, o->dim, o->ffn,
						     !o->no_gate, 0, d);
			if (rc < 0)
				return rc;
		}
	return 0;
}

int nf_store_fake_create(const char *path, const struct nf_store_fake_opts *o, struct nf_diag *d)
{
	if (!o->layers || !o->dim || !o->ffn || !o->experts || !o->vocab)
		return nf_diag_fail(d, NF_EUSAGE, "layers, dim, ffn, experts and vocab must be positive");
	if (nf_dtype_row_size(o->dtype, o->dim) == 0)
		return nf_diag_fail(d, NF_EUSAGE, "dim %u is not a multiple of the %s block length %zu",
				    o->dim, nf_dtype_name(o->dtype), nf_dtype_block_len(o->dtype));
	struct nf_store_writer *w = NULL;
	uint8_t *buf = NULL;
	uint64_t seed = o->seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
	int rc = nf_store_writer_open(path, &o->create, &w, d);
	if (rc < 0)
		return rc;
	if ((rc = declare(w, o, d)) < 0 || (rc = nf_store_writer_begin(w, d)) < 0)
		goto out;
	const size_t chunk = 8u << 20;
	buf = malloc(chunk);
	if (!buf) {
		rc = -ENOMEM;
		goto out;
	}
	uint32_t n = nf_store_writer_object_count(w);
	for (uint32_t i = 0; i < n; i++) {
		const struct nf_store_object *ob = nf_store_writer_object(w, i);
		if (ob->kind == NF_STORE_KIND_DENSE) {
			size_t row = nf_dtype_row_size(ob->dtype, ob->shape[0]);
			size_t rows_per = chunk / row ? chunk / row : 1;
			for (uint64_t left = ob->length; left;) {
				size_t k = rows_per * row;
				if (k > left)
					k = (size_t)left;
				if (k > chunk) {
					rc = nf_diag_fail(d, NF_EUSAGE, "%s: row of %zu bytes too long", ob->name, row);
					goto out;
				}
				fill(ob->dtype, buf, k, &seed);
				if ((rc = nf_store_writer_write_dense(w, buf, k)) < 0)
					goto write_failed;
				left -= k;
			}
		} else {
			uint32_t per = (uint32_t)(chunk / ob->stride);
			if (per == 0) {
				rc = nf_diag_fail(d, NF_EUSAGE, "%s: bundle stride %u too large", ob->name, ob->stride);
				goto out;
			}
			for (uint32_t b = 0; b < ob->n_bundles; b += per) {
				uint32_t k = ob->n_bundles - b < per ? ob->n_bundles - b : per;
				for (uint32_t j = 0; j < k; j++)
					fill(ob->dtype, buf + (size_t)j * ob->stride, ob->bundle_bytes, &seed);
				if ((rc = nf_store_writer_write_bundles(w, buf, k)) < 0)
					goto write_failed;
			}
		}
		if (o->progress)
			o->progress(o->progress_user, nf_store_writer_done(w), nf_store_writer_total(w));
	}
	rc = nf_store_writer_finish(w, d);
	goto out;
write_failed:
	nf_diag_fail(d, rc, "%s: writing: %s", path, nf_strerror(rc));
out:
	free(buf);
	nf_store_writer_close(w);
	return rc;
}
