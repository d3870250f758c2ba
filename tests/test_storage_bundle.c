/*
 * test_storage_bundle.c - neuron bundle layout and packing, checked on every
 * FFN and every expert of the models in ../shared/testdata against the
 * source matrices: gate/up rows byte for byte, the down part giving back
 * exactly column i (ROW: the dequantized row equals the dequantized column,
 * or the ffn_down_t row bytes; QCOL: quants times scales equal the
 * dequantized ffn_down column), padding zero; and nf_bundle_unpack() giving
 * the source matrices back byte for byte.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/bundle.h"
#include "nflash/dtype.h"
#include "nflash/gguf.h"

static const char *const files[] = {
	"../shared/testdata/models/tiny-llama-f32.gguf",
	"../shared/testdata/models/tiny-llama-f16.gguf",
	"../shared/testdata/models/tiny-llama-q8_0.gguf",
	"../shared/testdata/models/tiny-llama-q4_0.gguf",
	"../shared/testdata/models/tiny-moe-f32.gguf",
	"../shared/testdata/models/tiny-moe-q8_0.gguf",
	"../shared/testdata/powerinfer/tiny-relullama-ff1024-f32.pwri.gguf",
	"../shared/testdata/kquant/tiny-llama-q4_k_m.gguf",
	"../shared/testdata/kquant/tiny-llama-q4_k_s.gguf",
	"../shared/testdata/kquant/tiny-llama-q5_k_m.gguf",
	"../shared/testdata/kquant/tiny-llama-q6_k.gguf",
};

static const struct nf_gguf_tensor *tensor(struct nf_gguf *g, int layer, const char *what)
{
	char name[96];
	snprintf(name, sizeof(name), "blk.%d.%s.weight", layer, what);
	return nf_gguf_find_tensor(g, name);
}

/* Check every bundle of one FFN against src; returns the number of neurons. */
static void check_ffn(const char *file, int layer, int expert, const struct nf_bundle_src *src,
		      uint32_t block)
{
	struct nf_bundle_layout L;
	int rc = nf_bundle_layout_make(src, block, &L);
	cr_assert_eq(rc, 0, "%s layer %d expert %d: layout rc %d", file, layer, expert, rc);
	cr_assert_eq(L.stride % block, 0);
	cr_assert_geq(L.stride, L.bundle_bytes);
	cr_assert_lt(L.stride - L.bundle_bytes, block);
	cr_assert_eq(L.bundle_bytes, L.down_off + L.down_bytes);
	cr_assert_eq(L.down_off, (L.has_gate ? 2u : 1u) * L.row_bytes);
	cr_assert_eq(L.row_bytes, nf_dtype_row_size(src->dtype_gate_up, src->n_embd));

	uint32_t n = src->n_ff, dim = src->n_embd;
	uint8_t *buf = malloc((size_t)n * L.stride);
	memset(buf, 0xa5, (size_t)n * L.stride);
	/* Two calls with an odd split, to test `first`. */
	uint32_t half = n / 3;
	nf_bundle_pack(src, &L, 0, half, buf);
	nf_bundle_pack(src, &L, half, n - half, buf + (size_t)half * L.stride);

	uint16_t *scales = NULL;
	if (L.down_form == NF_DOWN_QCOL) {
		uint64_t shape[2];
		nf_bundle_scales_shape(&L, shape);
		scales = malloc((size_t)(shape[0] * shape[1]) * sizeof(uint16_t));
		nf_bundle_pack_scales(src, scales);
	}
	/* The dequantized source down matrix (regular layout), dim x n. */
	float *down = NULL;
	if (src->down) {
		size_t rs = nf_dtype_row_size(src->dtype_down, n);
		down = malloc((size_t)dim * n * sizeof(float));
		for (uint32_t r = 0; r < dim; r++)
			nf_dequantize_row(src->dtype_down, (const uint8_t *)src->down + r * rs,
					  down + (size_t)r * n, n);
	}
	float *col = malloc(dim * sizeof(float));

	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *b = buf + (size_t)i * L.stride;
		const uint8_t *p = b;
		if (L.has_gate) {
			cr_assert(memcmp(p, (const uint8_t *)src->gate + (size_t)i * L.row_bytes,
					 L.row_bytes) == 0, "%s L%d E%d gate row %u", file, layer, expert, i);
			p += L.row_bytes;
		}
		cr_assert(memcmp(p, (const uint8_t *)src->up + (size_t)i * L.row_bytes,
				 L.row_bytes) == 0, "%s L%d E%d up row %u", file, layer, expert, i);
		p = b + L.down_off;
		if (src->down_t) {
			cr_assert_eq(L.down_form, NF_DOWN_ROW);
			cr_assert(memcmp(p, (const uint8_t *)src->down_t + (size_t)i * L.down_bytes,
					 L.down_bytes) == 0, "%s L%d down_t row %u", file, layer, i);
		} else if (L.down_form == NF_DOWN_ROW) {
			nf_dequantize_row(L.down_dtype, p, col, dim);
			for (uint32_t r = 0; r < dim; r++)
				cr_assert(memcmp(&col[r], &down[(size_t)r * n + i], 4) == 0,
					  "%s L%d E%d down[%u][%u]", file, layer, expert, r, i);
		} else if (nf_dtype_is_kquant(L.down_dtype)) {
			/* K: the head of block (i / 256, r) and the column's raw
			 * quant give ggml's dequantized value */
			uint32_t t = L.down_dtype;
			size_t hb = nf_bundle_head_bytes(t), bs = nf_dtype_block_size(t), qoff, qlen;
			nf_kquant_quant_span(t, &qoff, &qlen);
			for (uint32_t r = 0; r < dim; r++) {
				uint8_t blk[256] = { 0 };
				const uint8_t *h = (const uint8_t *)scales + ((size_t)(i / 256) * dim + r) * hb;
				memcpy(blk, h, qoff);
				memcpy(blk + qoff + qlen, h + qoff, bs - qoff - qlen);
				struct nf_kblock kb;
				nf_kblock_unpack_scales(t, blk, &kb);
				int q = (int)nf_bundle_kcol_get(p, r, nf_kquant_bits(t)) - nf_kquant_offset(t);
				uint32_t j = (i % 256) / 16;
				float v = (kb.d * (float)kb.sc[j]) * (float)q - kb.dmin * (float)kb.mn[j];
				cr_assert(memcmp(&v, &down[(size_t)r * n + i], 4) == 0,
					  "%s L%d kcol down[%u][%u]: %g vs %g", file, layer, r, i, v,
					  down[(size_t)r * n + i]);
			}
		} else {
			for (uint32_t r = 0; r < dim; r++) {
				int q = L.down_dtype == NF_DTYPE_Q8_0 ? ((const int8_t *)p)[r]
					: ((p[r / 2] >> (4 * (r % 2))) & 0x0f) - 8;
				float d = nf_fp16_to_fp32(scales[(size_t)(i / NF_QK) * dim + r]);
				float v = (float)q * d;
				cr_assert(memcmp(&v, &down[(size_t)r * n + i], 4) == 0,
					  "%s L%d E%d qcol down[%u][%u]: %g vs %g", file, layer, expert,
					  r, i, v, down[(size_t)r * n + i]);
			}
		}
		for (uint32_t k = L.bundle_bytes; k < L.stride; k++)
			cr_assert_eq(b[k], 0, "%s padding byte %u of bundle %u", file, k, i);
	}
	/* Unpacking every bundle (in reverse order) gives the source back byte for byte. */
	size_t gu = (size_t)n * L.row_bytes;
	size_t dsz = src->down ? nf_dtype_row_size(src->dtype_down, n) * dim : (size_t)n * L.down_bytes;
	uint8_t *ug = malloc(gu), *uu = malloc(gu), *ud = malloc(dsz);
	memset(ug, 0xa5, gu);
	memset(uu, 0xa5, gu);
	memset(ud, 0xa5, dsz);
	struct nf_bundle_dst dst = { .gate = ug, .up = uu, .down = src->down ? ud : NULL,
				     .down_t = src->down ? NULL : ud };
	for (uint32_t i = n; i-- > 0;)
		nf_bundle_unpack(&L, buf + (size_t)i * L.stride, i, scales, &dst);
	if (src->gate)
		cr_assert(memcmp(ug, src->gate, gu) == 0, "%s L%d E%d: unpacked gate", file, layer, expert);
	cr_assert(memcmp(uu, src->up, gu) == 0, "%s L%d E%d: unpacked up", file, layer, expert);
	cr_assert(memcmp(ud, src->down ? src->down : src->down_t, dsz) == 0,
		  "%s L%d E%d: unpacked down", file, layer, expert);
	/* The same through nf_bundle_unpack_many, in chunks of 64 (the last shorter). */
	memset(ug, 0x5a, gu);
	memset(uu, 0x5a, gu);
	memset(ud, 0x5a, dsz);
	for (uint32_t i0 = 0; i0 < n; i0 += 64)
		nf_bundle_unpack_many(&L, buf + (size_t)i0 * L.stride, i0, n - i0 < 64 ? n - i0 : 64,
				      scales, &dst);
	if (src->gate)
		cr_assert(memcmp(ug, src->gate, gu) == 0, "%s L%d E%d: unpack_many gate", file, layer, expert);
	cr_assert(memcmp(uu, src->up, gu) == 0, "%s L%d E%d: unpack_many up", file, layer, expert);
	cr_assert(memcmp(ud, src->down ? src->down : src->down_t, dsz) == 0,
		  "%s L%d E%d: unpack_many down", file, layer, expert);
	free(ug);
	free(uu);
	free(ud);
	free(col);
	free(down);
	free(scales);
	free(buf);
}

static int check_file(const char *file, uint32_t block)
{
	struct nf_gguf *g;
	struct nf_diag d = {0};
	int rc = nf_gguf_open(file, NF_GGUF_MMAP, &g, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	int n_ffn = 0;
	for (int l = 0;; l++) {
		const struct nf_gguf_tensor *up = tensor(g, l, "ffn_up");
		const struct nf_gguf_tensor *ue = tensor(g, l, "ffn_up_exps");
		if (up) {
			const struct nf_gguf_tensor *gate = tensor(g, l, "ffn_gate");
			const struct nf_gguf_tensor *dn = tensor(g, l, "ffn_down");
			const struct nf_gguf_tensor *dt = tensor(g, l, "ffn_down_t");
			cr_assert(dn || dt);
			struct nf_bundle_src s = {
				.gate = gate ? gate->data : NULL, .up = up->data,
				.down = dn ? dn->data : NULL, .down_t = dn ? NULL : dt->data,
				.dtype_gate_up = up->type, .dtype_down = dn ? dn->type : dt->type,
				.n_embd = (uint32_t)up->ne[0], .n_ff = (uint32_t)up->ne[1],
			};
			if (gate)
				cr_assert_eq(gate->type, up->type);
			check_ffn(file, l, -1, &s, block);
			n_ffn++;
		} else if (ue) {
			const struct nf_gguf_tensor *ge = tensor(g, l, "ffn_gate_exps");
			const struct nf_gguf_tensor *de = tensor(g, l, "ffn_down_exps");
			cr_assert(ge && de);
			cr_assert_eq(ue->ne[2], de->ne[2]);
			for (uint64_t e = 0; e < ue->ne[2]; e++) {
				struct nf_bundle_src s = {
					.gate = (const uint8_t *)ge->data + e * (ge->size / ge->ne[2]),
					.up = (const uint8_t *)ue->data + e * (ue->size / ue->ne[2]),
					.down = (const uint8_t *)de->data + e * (de->size / de->ne[2]),
					.dtype_gate_up = ue->type, .dtype_down = de->type,
					.n_embd = (uint32_t)ue->ne[0], .n_ff = (uint32_t)ue->ne[1],
				};
				check_ffn(file, l, (int)e, &s, block);
				n_ffn++;
			}
		} else {
			break;
		}
	}
	nf_gguf_close(g);
	return n_ffn;
}

Test(bundle, every_ffn_of_testdata_4k)
{
	for (size_t f = 0; f < sizeof(files) / sizeof(files[0]); f++) {
		int n = check_file(files[f], 4096);
		cr_assert_gt(n, 0, "%s: no FFN found", files[f]);
	}
}

Test(bundle, every_ffn_of_testdata_512)
{
	for (size_t f = 0; f < sizeof(files) / sizeof(files[0]); f++)
		cr_assert_gt(check_file(files[f], 512), 0);
}

Test(bundle, forms_chosen_by_down_type)
{
	static uint8_t m[4];
	struct nf_bundle_src s = { .gate = m, .up = m, .down = m, .n_embd = 64, .n_ff = 96,
				   .dtype_gate_up = NF_DTYPE_Q4_0 };
	struct nf_bundle_layout L;

	s.dtype_down = NF_DTYPE_Q4_0;
	cr_assert_eq(nf_bundle_layout_make(&s, 512, &L), 0);
	cr_assert_eq(L.down_form, NF_DOWN_QCOL);
	cr_assert_eq(L.down_bytes, 32);
	cr_assert_eq(L.row_bytes, 36);
	cr_assert_eq(L.bundle_bytes, 36 * 2 + 32);
	cr_assert_eq(L.stride, 512);

	s.dtype_down = NF_DTYPE_Q8_0;
	cr_assert_eq(nf_bundle_layout_make(&s, 512, &L), 0);
	cr_assert_eq(L.down_form, NF_DOWN_QCOL);
	cr_assert_eq(L.down_bytes, 64);

	s.dtype_down = NF_DTYPE_BF16;
	cr_assert_eq(nf_bundle_layout_make(&s, 512, &L), 0);
	cr_assert_eq(L.down_form, NF_DOWN_ROW);
	cr_assert_eq(L.down_bytes, 128);

	/* down_t in a quantized type stays ROW. */
	s.down = NULL;
	s.down_t = m;
	s.dtype_down = NF_DTYPE_Q8_0;
	cr_assert_eq(nf_bundle_layout_make(&s, 512, &L), 0);
	cr_assert_eq(L.down_form, NF_DOWN_ROW);
	cr_assert_eq(L.down_bytes, 68);

	/* No gate: up row first. */
	s.gate = NULL;
	cr_assert_eq(nf_bundle_layout_make(&s, 1024, &L), 0);
	cr_assert_eq(L.down_off, 36);
	cr_assert_eq(L.stride, 1024);
}

Test(bundle, layout_errors)
{
	static uint8_t m[4];
	struct nf_bundle_src s = { .gate = m, .up = m, .down = m, .n_embd = 64, .n_ff = 96,
				   .dtype_gate_up = NF_DTYPE_F32, .dtype_down = NF_DTYPE_Q8_0 };
	struct nf_bundle_layout L;

	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), 0);
	cr_assert_eq(nf_bundle_layout_make(&s, 256, &L), NF_EUSAGE);
	cr_assert_eq(nf_bundle_layout_make(&s, 1000, &L), NF_EUSAGE);
	s.n_ff = 100; /* QCOL needs whole blocks along n_ff */
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), NF_EFORMAT);
	s.dtype_down = NF_DTYPE_F16; /* a float down is fine with any n_ff */
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), 0);
	s.dtype_down = NF_DTYPE_Q4_K; /* K-quant QCOL needs whole super-blocks along n_ff */
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), NF_EFORMAT);
	s.n_ff = 512;
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), 0);
	cr_assert_eq(L.down_form, NF_DOWN_QCOL);
	cr_assert_eq(L.down_bytes, 64 * 4 / 8);
	s.n_ff = 96;
	s.dtype_down = 3; /* q4_1: no exact bundle form */
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), NF_EUNSUPPORTED);
	s.dtype_down = NF_DTYPE_F32;
	s.dtype_gate_up = NF_DTYPE_Q8_0;
	s.n_embd = 48; /* rows not whole blocks */
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), NF_EFORMAT);
	s.n_embd = 64;
	s.down_t = m; /* both down and down_t */
	cr_assert_eq(nf_bundle_layout_make(&s, 4096, &L), NF_EUSAGE);
}
