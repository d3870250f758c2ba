/*
 * storage/bundle.c - packing GGUF FFN matrices into neuron bundles
 * (include/nflash/bundle.h).
 *
 * Invariants:
 *  1. Packing is lossless: gate/up rows are byte copies of the source rows;
 *     a ROW down part is a byte copy of column i (float types, element by
 *     element) or of ffn_down_t row i; a QCOL down part holds exactly the
 *     quants of column i, and nf_bundle_pack_scales() exactly their scales
 *     (K-quants: the raw quants bit-packed, and each block's head bytes).
 *  4. A QCOL down part of a K-quant type is written whole (zeroed, then
 *     its bits set), so bytes between values never carry stale data.
 *  2. Every byte of a bundle past bundle_bytes up to stride is zero.
 *  3. nf_bundle_layout_make() validates everything nf_bundle_pack() relies
 *     on, so pack never checks and never fails.
 */
#include "nflash/bundle.h"

#include <string.h>

#include "nflash/dtype.h"
#include "nflash/error.h"

static bool is_float_type(uint32_t t)
{
	return t == NF_DTYPE_F32 || t == NF_DTYPE_F16 || t == NF_DTYPE_BF16;
}

int nf_bundle_layout_make(const struct nf_bundle_src *src, uint32_t block_size,
			  struct nf_bundle_layout *out)
{
	struct nf_bundle_layout L;
	uint64_t row_bytes, down_bytes, down_off, bundle, stride;

	if (!src || !out || !src->up || (!src->down == !src->down_t))
		return NF_EUSAGE;
	if (block_size < 512 || (block_size & (block_size - 1)))
		return NF_EUSAGE;
	if (src->n_embd == 0 || src->n_ff == 0)
		return NF_EFORMAT;
	if (!nf_dtype_valid(src->dtype_gate_up) || !nf_dtype_valid(src->dtype_down))
		return NF_EUNSUPPORTED;

	memset(&L, 0, sizeof(L));
	L.dtype = src->dtype_gate_up;
	L.dim = src->n_embd;
	L.n_neurons = src->n_ff;
	L.has_gate = src->gate != NULL;
	row_bytes = nf_dtype_row_size(L.dtype, L.dim);
	if (row_bytes == 0)
		return NF_EFORMAT; /* n_embd not a multiple of the block length */

	if (src->down_t) {
		/* PowerInfer: rows of down_t already are down columns. */
		L.down_form = NF_DOWN_ROW;
		L.down_dtype = src->dtype_down;
		down_bytes = nf_dtype_row_size(src->dtype_down, L.dim);
		if (down_bytes == 0)
			return NF_EFORMAT;
	} else if (is_float_type(src->dtype_down)) {
		L.down_form = NF_DOWN_ROW;
		L.down_dtype = src->dtype_down;
		down_bytes = nf_dtype_row_size(src->dtype_down, L.dim);
	} else if (nf_dtype_is_kquant(src->dtype_down)) {
		/* Super-blocks run along n_ff: column i's raw quants, bit-packed. */
		if (src->n_ff % NF_QK_K || (uint64_t)L.dim * nf_kquant_bits(src->dtype_down) % 8)
			return NF_EFORMAT;
		L.down_form = NF_DOWN_QCOL;
		L.down_dtype = src->dtype_down;
		down_bytes = (uint64_t)L.dim * nf_kquant_bits(src->dtype_down) / 8;
	} else if (src->dtype_down == NF_DTYPE_Q8_0 || src->dtype_down == NF_DTYPE_Q4_0) {
		/* Blocks run along n_ff: the column's quants split from their scales. */
		if (src->n_ff % NF_QK)
			return NF_EFORMAT;
		L.down_form = NF_DOWN_QCOL;
		L.down_dtype = src->dtype_down;
		if (src->dtype_down == NF_DTYPE_Q8_0) {
			down_bytes = L.dim;
		} else {
			if (L.dim % 2)
				return NF_EFORMAT;
			down_bytes = L.dim / 2;
		}
	} else {
		return NF_EUNSUPPORTED;
	}

	down_off = (L.has_gate ? 2 : 1) * row_bytes;
	bundle = down_off + down_bytes;
	stride = (bundle + block_size - 1) / block_size * block_size;
	if (stride > UINT32_MAX)
		return NF_EFORMAT;
	L.row_bytes = (uint32_t)row_bytes;
	L.down_off = (uint32_t)down_off;
	L.down_bytes = (uint32_t)down_bytes;
	L.bundle_bytes = (uint32_t)bundle;
	L.stride = (uint32_t)stride;
	*out = L;
	return 0;
}

size_t nf_bundle_head_bytes(uint32_t down_dtype)
{
	size_t qoff, qlen;
	if (!nf_dtype_is_kquant(down_dtype))
		return sizeof(uint16_t);
	nf_kquant_quant_span(down_dtype, &qoff, &qlen);
	return nf_dtype_block_size(down_dtype) - qlen;
}

void nf_bundle_scales_shape(const struct nf_bundle_layout *L, uint64_t shape[2])
{
	shape[0] = (uint64_t)L->dim * nf_bundle_head_bytes(L->down_dtype) / sizeof(uint16_t);
	shape[1] = L->n_neurons / nf_dtype_block_len(L->down_dtype);
}

/* b bits at bit offset r * b of a K column: read and write */
static uint32_t kcol_get(const uint8_t *c, uint32_t r, uint32_t b)
{
	uint32_t at = r * b, o = at / 8, sh = at % 8;
	uint32_t v = c[o];
	if (sh + b > 8)
		v |= (uint32_t)c[o + 1] << 8;
	return (v >> sh) & ((1u << b) - 1);
}

static void kcol_put(uint8_t *c, uint32_t r, uint32_t b, uint32_t raw)
{
	uint32_t at = r * b, o = at / 8, sh = at % 8;
	c[o] |= (uint8_t)(raw << sh);
	if (sh + b > 8)
		c[o + 1] |= (uint8_t)(raw >> (8 - sh));
}

uint32_t nf_bundle_kcol_get(const void *col, uint32_t r, uint32_t bits)
{
	return kcol_get(col, r, bits);
}

static uint8_t q4_nibble(const struct nf_block_q4_0 *b, uint32_t j)
{
	return j < NF_QK / 2 ? (b->qs[j] & 0x0f) : (b->qs[j - NF_QK / 2] >> 4);
}

/*
 * The down parts of neurons [first, first + n) from the regular down matrix
 * (dim rows of n_ff values). Rows outer, neurons inner: each source row is
 * read once, sequentially, for the whole chunk (a neuron-outer gather would
 * touch one cache line per row per neuron).
 */
void nf_bundle_pack_down_columns(const struct nf_bundle_src *src, const struct nf_bundle_layout *L,
				 uint32_t first, uint32_t n, void *outv)
{
	uint8_t *out = outv;
	uint32_t dim = L->dim, n_ff = L->n_neurons;
	uint8_t *base = out + L->down_off;
	size_t stride = L->stride;

	if (L->down_form == NF_DOWN_ROW) {
		size_t esz = nf_dtype_block_size(L->down_dtype);
		const uint8_t *m = src->down;
		for (uint32_t r = 0; r < dim; r++) {
			const uint8_t *row = m + ((size_t)r * n_ff + first) * esz;
			for (uint32_t k = 0; k < n; k++)
				memcpy(base + k * stride + (size_t)r * esz, row + (size_t)k * esz, esz);
		}
		return;
	}
	if (nf_dtype_is_kquant(L->down_dtype)) {
		uint32_t t = L->down_dtype, b = nf_kquant_bits(t);
		size_t bs = nf_dtype_block_size(t), nbk = n_ff / NF_QK_K;
		for (uint32_t k = 0; k < n; k++)
			memset(base + k * stride, 0, L->down_bytes);
		for (uint32_t r = 0; r < dim; r++) {
			const uint8_t *row = (const uint8_t *)src->down + (size_t)r * nbk * bs;
			for (uint32_t k = 0; k < n; k++) {
				uint32_t i = first + k;
				kcol_put(base + k * stride, r, b, nf_kquant_get(t, row + (i / NF_QK_K) * bs, i % NF_QK_K));
			}
		}
		return;
	}
	size_t nb = n_ff / NF_QK;
	if (L->down_dtype == NF_DTYPE_Q8_0) {
		const struct nf_block_q8_0 *down = src->down;
		for (uint32_t r = 0; r < dim; r++) {
			const struct nf_block_q8_0 *row = down + (size_t)r * nb;
			for (uint32_t k = 0; k < n; k++) {
				uint32_t i = first + k;
				base[k * stride + r] = (uint8_t)row[i / NF_QK].qs[i % NF_QK];
			}
		}
		return;
	}
	const struct nf_block_q4_0 *down = src->down;
	for (uint32_t r = 0; r < dim; r += 2) {
		const struct nf_block_q4_0 *lo_row = down + (size_t)r * nb, *hi_row = lo_row + nb;
		for (uint32_t k = 0; k < n; k++) {
			uint32_t i = first + k;
			uint8_t lo = q4_nibble(&lo_row[i / NF_QK], i % NF_QK);
			uint8_t hi = q4_nibble(&hi_row[i / NF_QK], i % NF_QK);
			base[k * stride + r / 2] = (uint8_t)(lo | (hi << 4));
		}
	}
}

void nf_bundle_pack(const struct nf_bundle_src *src, const struct nf_bundle_layout *L,
		    uint32_t first, uint32_t n, void *out)
{
	const uint8_t *gate = src->gate, *up = src->up;
	uint8_t *o = out;

	for (uint32_t k = 0; k < n; k++, o += L->stride) {
		uint32_t i = first + k;
		uint8_t *p = o;

		if (L->has_gate) {
			memcpy(p, gate + (size_t)i * L->row_bytes, L->row_bytes);
			p += L->row_bytes;
		}
		memcpy(p, up + (size_t)i * L->row_bytes, L->row_bytes);
		if (src->down_t)
			memcpy(o + L->down_off,
			       (const uint8_t *)src->down_t + (size_t)i * L->down_bytes, L->down_bytes);
		memset(o + L->bundle_bytes, 0, L->stride - L->bundle_bytes);
	}
	if (!src->down_t)
		nf_bundle_pack_down_columns(src, L, first, n, out);
}

void nf_bundle_pack_scales(const struct nf_bundle_src *src, uint16_t *out)
{
	if (nf_dtype_is_kquant(src->dtype_down)) {
		/* head bytes of block (b, r) at (b * dim + r) * hb: the block
		 * without its quant span */
		uint32_t t = src->dtype_down, nbk = src->n_ff / NF_QK_K;
		size_t bs = nf_dtype_block_size(t), hb = nf_bundle_head_bytes(t), qoff, qlen;
		nf_kquant_quant_span(t, &qoff, &qlen);
		for (uint32_t b = 0; b < nbk; b++)
			for (uint32_t r = 0; r < src->n_embd; r++) {
				const uint8_t *blk = (const uint8_t *)src->down + ((size_t)r * nbk + b) * bs;
				uint8_t *h = (uint8_t *)out + ((size_t)b * src->n_embd + r) * hb;
				memcpy(h, blk, qoff);
				memcpy(h + qoff, blk + qoff + qlen, bs - qoff - qlen);
			}
		return;
	}
	uint32_t nb = src->n_ff / NF_QK;
	const uint8_t *down = src->down;
	size_t bsz = nf_dtype_block_size(src->dtype_down);

	for (uint32_t b = 0; b < nb; b++) {
		for (uint32_t r = 0; r < src->n_embd; r++) {
			uint16_t d;
			/* d is the first field of both block types. */
			memcpy(&d, down + ((size_t)r * nb + b) * bsz, sizeof(d));
			out[(size_t)b * src->n_embd + r] = d;
		}
	}
}

/* Row r of QCOL neuron i (down part p) into its block of the regular down
 * matrix: the scale, and the one quant (Q4_0: nibble) of that column. */
static void put_qcol(const struct nf_bundle_layout *L, void *down, const uint16_t *scales,
		     uint32_t r, uint32_t i, const uint8_t *p)
{
	if (nf_dtype_is_kquant(L->down_dtype)) {
		uint32_t t = L->down_dtype, nbk = L->n_neurons / NF_QK_K;
		size_t bs = nf_dtype_block_size(t), hb = nf_bundle_head_bytes(t), qoff, qlen;
		nf_kquant_quant_span(t, &qoff, &qlen);
		uint8_t *blk = (uint8_t *)down + ((size_t)r * nbk + i / NF_QK_K) * bs;
		const uint8_t *h = (const uint8_t *)scales + ((size_t)(i / NF_QK_K) * L->dim + r) * hb;
		memcpy(blk, h, qoff);
		memcpy(blk + qoff + qlen, h + qoff, bs - qoff - qlen);
		nf_kquant_set(t, blk, i % NF_QK_K, kcol_get(p, r, nf_kquant_bits(t)));
		return;
	}
	size_t blk_i = (size_t)r * (L->n_neurons / NF_QK) + i / NF_QK;
	uint32_t j = i % NF_QK;
	uint16_t d = scales[(size_t)(i / NF_QK) * L->dim + r];
	if (L->down_dtype == NF_DTYPE_Q8_0) {
		struct nf_block_q8_0 *blk = (struct nf_block_q8_0 *)down + blk_i;
		blk->d = d;
		blk->qs[j] = ((const int8_t *)p)[r];
		return;
	}
	struct nf_block_q4_0 *blk = (struct nf_block_q4_0 *)down + blk_i;
	uint8_t v = (p[r / 2] >> (4 * (r % 2))) & 0x0f;
	blk->d = d;
	if (j < NF_QK / 2)
		blk->qs[j] = (uint8_t)((blk->qs[j] & 0xf0) | v);
	else
		blk->qs[j - NF_QK / 2] = (uint8_t)((blk->qs[j - NF_QK / 2] & 0x0f) | (v << 4));
}

void nf_bundle_unpack(const struct nf_bundle_layout *L, const void *bundle, uint32_t i,
		      const uint16_t *scales, const struct nf_bundle_dst *dst)
{
	const uint8_t *b = bundle, *p = b + L->down_off;
	uint32_t dim = L->dim, n = L->n_neurons;

	if (L->has_gate && dst->gate)
		memcpy((uint8_t *)dst->gate + (size_t)i * L->row_bytes, b, L->row_bytes);
	if (dst->up)
		memcpy((uint8_t *)dst->up + (size_t)i * L->row_bytes,
		       b + (L->has_gate ? L->row_bytes : 0), L->row_bytes);
	if (dst->down_t && L->down_form == NF_DOWN_ROW) {
		memcpy((uint8_t *)dst->down_t + (size_t)i * L->down_bytes, p, L->down_bytes);
		return;
	}
	if (!dst->down)
		return;
	if (L->down_form == NF_DOWN_ROW) {
		size_t esz = nf_dtype_block_size(L->down_dtype);
		uint8_t *d = dst->down;
		for (uint32_t r = 0; r < dim; r++)
			memcpy(d + ((size_t)r * n + i) * esz, p + (size_t)r * esz, esz);
		return;
	}
	for (uint32_t r = 0; r < dim; r++)
		put_qcol(L, dst->down, scales, r, i, p);
}

void nf_bundle_unpack_many(const struct nf_bundle_layout *L, const void *bundles, uint32_t first,
			   uint32_t n, const uint16_t *scales, const struct nf_bundle_dst *dst)
{
	const uint8_t *b = bundles;
	struct nf_bundle_dst rows = *dst;
	size_t stride = L->stride;

	/* Gate, up and transposed down: whole rows per neuron. */
	rows.down = NULL;
	for (uint32_t k = 0; k < n; k++)
		nf_bundle_unpack(L, b + k * stride, first + k, scales, &rows);
	if (!dst->down || (dst->down_t && L->down_form == NF_DOWN_ROW))
		return;
	uint32_t dim = L->dim, n_ff = L->n_neurons;
	const uint8_t *base = b + L->down_off;
	if (L->down_form == NF_DOWN_ROW) {
		size_t esz = nf_dtype_block_size(L->down_dtype);
		for (uint32_t r = 0; r < dim; r++) {
			uint8_t *row = (uint8_t *)dst->down + ((size_t)r * n_ff + first) * esz;
			for (uint32_t k = 0; k < n; k++)
				memcpy(row + (size_t)k * esz, base + k * stride + (size_t)r * esz, esz);
		}
		return;
	}
	for (uint32_t r = 0; r < dim; r++)
		for (uint32_t k = 0; k < n; k++)
			put_qcol(L, dst->down, scales, r, first + k, base + k * stride);
}
