/*
 * nflash/bundle.h - how one FFN's neurons are laid out as bundles, and how
 * they are packed from GGUF matrices. Shared by import (which writes them to
 * a store), the in-memory sparse path (which packs a GGUF's FFNs into RAM)
 * and the sparse FFN compute (which reads them from the cache).
 *
 * Bundle i holds, back to back: gate row i (if the FFN has a gate), up row i
 * (each `dim` values in `dtype`), then the down part for neuron i, then zero
 * padding to `stride`. The down part has one of two forms:
 *
 *  - NF_DOWN_ROW: down column i as a row of `dim` values in `down_dtype`.
 *    Exact for float down matrices (transposed) and for PowerInfer's
 *    `ffn_down_t` in any type (whose rows already are down columns).
 *
 *  - NF_DOWN_QCOL: for a regular quantized `ffn_down` (Q8_0 or Q4_0 blocks
 *    run along n_ff), the quants of column i without their scales: for Q8_0,
 *    dim int8 values q[r]; for Q4_0, dim/2 bytes where byte k holds rows 2k
 *    (low nibble) and 2k+1 (high nibble), value = nibble - 8. The scales,
 *    fp16 d[b][r] for block b = neuron / 32 and output row r, live in a
 *    separate dense object (`down_scales`, n_ff/32 x dim fp16, pinned), so
 *    the engine computes exactly what ggml computes: per output row r,
 *    sum over blocks b of d[b][r] * dx[b] * sum_{i in b} q[r][i] * qx[i],
 *    with the activation vector quantized to Q8_0 along n_ff (dx, qx).
 *    Consequence: the down contribution of block b needs the activations of
 *    every active neuron of that block (a data dependency, not a barrier).
 *    For a K-quant ffn_down (Q2_K..Q6_K, super-blocks of 256 neurons) the
 *    column holds the raw quants of column i bit-packed (nf_kquant_bits
 *    bits each, row r at bit r * bits, low bits first), and the scales
 *    object holds each block's head (the block's bytes outside its quant
 *    span: d, dmin, sub-block scales and mins, in block order,
 *    nf_bundle_head_bytes each) for block b = neuron / 256 and row r at
 *    (b * dim + r); the activations are quantized to Q8_K per 256 neurons.
 *
 * Thread-safety: the functions are pure.
 */
#ifndef NFLASH_BUNDLE_H
#define NFLASH_BUNDLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum nf_down_form {
	NF_DOWN_ROW = 0,
	NF_DOWN_QCOL = 1,
};

struct nf_bundle_layout {
	uint32_t dtype;        /* enum nf_dtype of gate and up rows */
	uint32_t dim;          /* n_embd: values per gate/up row and down column */
	uint32_t n_neurons;    /* n_ff of this FFN (per expert) */
	bool has_gate;
	uint32_t row_bytes;    /* nf_dtype_row_size(dtype, dim) */
	uint32_t down_form;    /* enum nf_down_form */
	uint32_t down_dtype;   /* ROW: dtype of the down row; QCOL: Q8_0, Q4_0 or a K-quant */
	uint32_t down_off;     /* byte offset of the down part in a bundle */
	uint32_t down_bytes;   /* ROW: nf_dtype_row_size(down_dtype, dim); QCOL: dim, dim/2, or
				* dim * nf_kquant_bits / 8 */
	uint32_t bundle_bytes; /* down_off + down_bytes */
	uint32_t stride;       /* bundle_bytes rounded up to the block size */
};

/*
 * A GGUF FFN as packing input: row-major matrices as stored in the file.
 * gate/up: n_ff rows of n_embd values. Exactly one of down (n_embd rows of
 * n_ff values, the regular layout) and down_t (n_ff rows of n_embd values,
 * PowerInfer's) is non-NULL. gate is NULL for FFNs without a gate.
 */
struct nf_bundle_src {
	const void *gate, *up, *down, *down_t;
	uint32_t dtype_gate_up;   /* gate and up must share one type */
	uint32_t dtype_down;      /* type of down or down_t */
	uint32_t n_embd, n_ff;
};

/*
 * nf_bundle_layout_make - the layout for src with bundles padded to a
 * multiple of block_size (a power of two >= 512). Returns 0, or NF_EUNSUPPORTED
 * (gate and up of different types, a down type with no exact bundle form),
 * NF_EFORMAT (dims not multiples of the block length).
 */
int nf_bundle_layout_make(const struct nf_bundle_src *src, uint32_t block_size,
			  struct nf_bundle_layout *out);

/*
 * nf_bundle_pack - write bundles of neurons [first, first + n) into out
 * (n * L->stride bytes, padding zeroed). Pure; never allocates.
 */
void nf_bundle_pack(const struct nf_bundle_src *src, const struct nf_bundle_layout *L,
		    uint32_t first, uint32_t n, void *out);

/*
 * nf_bundle_pack_down_columns - only the down parts of nf_bundle_pack, for
 * a regular (not transposed) down matrix: part k at out + k * L->stride +
 * L->down_off. For engines that keep columns without gate/up rows.
 */
void nf_bundle_pack_down_columns(const struct nf_bundle_src *src, const struct nf_bundle_layout *L,
				 uint32_t first, uint32_t n, void *out);

/*
 * nf_bundle_pack_scales - for NF_DOWN_QCOL: the fp16 scales d[b][r], b in
 * [0, n_ff/32), r in [0, n_embd), into out (n_ff/32 * n_embd uint16_t);
 * for a K-quant down the heads (n_ff/256 * n_embd * head bytes).
 */
void nf_bundle_pack_scales(const struct nf_bundle_src *src, uint16_t *out);
/* Bytes of one block's scales entry for a QCOL down of down_dtype: 2 (the
 * fp16 d of Q4_0/Q8_0), or a K-quant block's head bytes (an even number). */
size_t nf_bundle_head_bytes(uint32_t down_dtype);
/* The scales object of a QCOL layout as a 2-D array of uint16 words:
 * shape[0] = dim * head bytes / 2, shape[1] = n_neurons / block length. */
void nf_bundle_scales_shape(const struct nf_bundle_layout *L, uint64_t shape[2]);
/* Raw quant of row r in a K-quant QCOL column of `bits` bits per value. */
uint32_t nf_bundle_kcol_get(const void *col, uint32_t r, uint32_t bits);

/*
 * The inverse of packing, for engines that want the GGUF layout back (a
 * store-backed model with its FFN unpacked into memory, tests). Matrices as
 * in struct nf_bundle_src: gate/up n_ff rows of n_embd values; down n_embd
 * rows of n_ff values (only for float down types or QCOL), or down_t n_ff
 * rows of n_embd values (ROW form, any type). Unused pointers are NULL.
 */
struct nf_bundle_dst {
	void *gate, *up, *down, *down_t;
};

/*
 * nf_bundle_unpack - scatter the bundle of neuron `neuron` (L->stride bytes
 * at bundle) into dst. For QCOL, scales are the n_ff/32 x dim fp16 scales
 * (nf_bundle_pack_scales) and down receives whole Q8_0/Q4_0 blocks once
 * every neuron of a block was unpacked; other neurons' bytes are kept.
 * Unpacking every neuron gives back the packed source byte for byte. Pure;
 * never allocates; distinct neurons of different blocks (32 neurons; 256
 * for K-quant downs) may be unpacked concurrently (their quants share
 * bytes).
 */
void nf_bundle_unpack(const struct nf_bundle_layout *L, const void *bundle, uint32_t neuron,
		      const uint16_t *scales, const struct nf_bundle_dst *dst);

/*
 * nf_bundle_unpack_many - nf_bundle_unpack of neurons [first, first + n),
 * whose bundles lie back to back at L->stride in `bundles` (as
 * nf_bundle_pack writes them). The down part is scattered rows outer, so a
 * chunk of a few dozen neurons touches each destination row once: call it
 * per chunk of about 64 neurons for speed. Same result as one
 * nf_bundle_unpack per neuron.
 */
void nf_bundle_unpack_many(const struct nf_bundle_layout *L, const void *bundles, uint32_t first,
			   uint32_t n, const uint16_t *scales, const struct nf_bundle_dst *dst);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_BUNDLE_H */
