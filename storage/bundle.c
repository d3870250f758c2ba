/*
 * storage/bundle.c - packing GGUF FFN matrices into neuron bundles
 * (include/nflash/bundle.h).
 *
 * Invariants:
 *  1. Packing is lossless: gate/up rows are byte copies of the source rows;
 *     a ROW down part is a byte copy of column i (float types, element by
 *     element) or of ffn_down_t row i; a QCOL down part holds exactly the
 *     quants of column i, and nf_bundle_pack_scales() exactly their scales.
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

/* Column i of a float matrix with n_rows rows of n_cols elements of esz bytes. */
static void copy_column(const uint8_t *m, size_t esz, uint32_t n_rows, uint32_t n_cols,
			uint32_t i, uint8_t *dst)
{
	for (uint32_t r = 0; r < n_rows; r++)
		memcpy(dst + (size_t)r * esz, m + ((size_t)r * n_cols + i) * esz, esz);
}

static void qcol_q8_0(const struct nf_block_q8_0 *down, uint32_t n_embd, uint32_t n_ff,
		      uint32_t i, int8_t *dst)
{
	size_t nb = n_ff / NF_QK;
	for (uint32_t r = 0; r < n_embd; r++)
		dst[r] = down[(size_t)r * nb + i / NF_QK].qs[i % NF_QK];
}

static uint8_t q4_nibble(const struct nf_block_q4_0 *b, uint32_t j)
{
	return j < NF_QK / 2 ? (b->qs[j] & 0x0f) : (b->qs[j - NF_QK / 2] >> 4);
}

static void qcol_q4_0(const struct nf_block_q4_0 *down, uint32_t n_embd, uint32_t n_ff,
		      uint32_t i, uint8_t *dst)
{
	size_t nb = n_ff / NF_QK;
	for (uint32_t r = 0; r < n_embd; r += 2) {
		uint8_t lo = q4_nibble(&down[(size_t)r * nb + i / NF_QK], i % NF_QK);
		uint8_t hi = q4_nibble(&down[(size_t)(r + 1) * nb + i / NF_QK], i % NF_QK);
		dst[r / 2] = (uint8_t)(lo | (hi << 4));
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
		p = o + L->down_off;
		if (src->down_t) {
			memcpy(p, (const uint8_t *)src->down_t + (size_t)i * L->down_bytes,
			       L->down_bytes);
		} else if (L->down_form == NF_DOWN_ROW) {
			size_t esz = nf_dtype_block_size(L->down_dtype);
			copy_column(src->down, esz, L->dim, L->n_neurons, i, p);
		} else if (L->down_dtype == NF_DTYPE_Q8_0) {
			qcol_q8_0(src->down, L->dim, L->n_neurons, i, (int8_t *)p);
		} else {
			qcol_q4_0(src->down, L->dim, L->n_neurons, i, p);
		}
		memset(o + L->bundle_bytes, 0, L->stride - L->bundle_bytes);
	}
}

void nf_bundle_pack_scales(const struct nf_bundle_src *src, uint16_t *out)
{
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
	size_t nb = n / NF_QK;
	uint32_t j = i % NF_QK;
	for (uint32_t r = 0; r < dim; r++) {
		uint16_t d = scales[(size_t)(i / NF_QK) * dim + r];
		if (L->down_dtype == NF_DTYPE_Q8_0) {
			struct nf_block_q8_0 *blk = (struct nf_block_q8_0 *)dst->down + (size_t)r * nb + i / NF_QK;
			blk->d = d;
			blk->qs[j] = ((const int8_t *)p)[r];
		} else {
			struct nf_block_q4_0 *blk = (struct nf_block_q4_0 *)dst->down + (size_t)r * nb + i / NF_QK;
			uint8_t v = (p[r / 2] >> (4 * (r % 2))) & 0x0f;
			blk->d = d;
			if (j < NF_QK / 2)
				blk->qs[j] = (uint8_t)((blk->qs[j] & 0xf0) | v);
			else
				blk->qs[j - NF_QK / 2] = (uint8_t)((blk->qs[j - NF_QK / 2] & 0x0f) | (v << 4));
		}
	}
}
