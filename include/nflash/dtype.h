/*
 * nflash/dtype.h - element types shared by GGUF files, stores and kernels.
 *
 * Values equal ggml's type ids, so a GGUF tensor type can be stored as is.
 * Quantized types are stored in blocks: Q4_0 and Q8_0 hold 32 values per
 * block with one fp16 scale, bit-exact with ggml's layout.
 *
 *	size_t bytes = nf_dtype_row_size(NF_DTYPE_Q4_0, 4096);   // 2304
 *	nf_quantize_row_q8_0(x, blocks, 4096);
 *
 * Every function here is pure and thread-safe.
 */
#ifndef NFLASH_DTYPE_H
#define NFLASH_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum nf_dtype {
	NF_DTYPE_F32  = 0,
	NF_DTYPE_F16  = 1,
	NF_DTYPE_Q4_0 = 2,
	NF_DTYPE_Q8_0 = 8,
	NF_DTYPE_BF16 = 30,
};

#define NF_QK 32 /* values per Q4_0 / Q8_0 block */

struct nf_block_q4_0 {
	uint16_t d;             /* fp16 scale */
	uint8_t qs[NF_QK / 2];  /* low nibbles: values 0..15, high: 16..31; value = (q - 8) * d */
};
_Static_assert(sizeof(struct nf_block_q4_0) == 18, "q4_0 block is 18 bytes");

struct nf_block_q8_0 {
	uint16_t d;             /* fp16 scale */
	int8_t qs[NF_QK];       /* value = q * d */
};
_Static_assert(sizeof(struct nf_block_q8_0) == 34, "q8_0 block is 34 bytes");

/* True for the types above. */
bool nf_dtype_valid(uint32_t t);
/* "f32", "f16", "q4_0", "q8_0", "bf16", or "unknown". */
const char *nf_dtype_name(uint32_t t);
/* Parse a name as printed by nf_dtype_name (case-insensitive); -1 if unknown. */
int nf_dtype_parse(const char *name);
/* Values per block (1 for float types) and bytes per block. 0 for unknown types. */
size_t nf_dtype_block_len(uint32_t t);
size_t nf_dtype_block_size(uint32_t t);
/* Bytes of a row of n values; 0 if n is not a multiple of the block length. */
size_t nf_dtype_row_size(uint32_t t, uint64_t n);

/* IEEE half and bfloat16 conversions, round to nearest even. */
float nf_fp16_to_fp32(uint16_t h);
uint16_t nf_fp32_to_fp16(float f);
float nf_bf16_to_fp32(uint16_t h);
uint16_t nf_fp32_to_bf16(float f);

/* Reference quantizers (as ggml's quantize_row_*_ref); n a multiple of 32. */
void nf_quantize_row_q8_0(const float *x, struct nf_block_q8_0 *y, size_t n);
void nf_quantize_row_q4_0(const float *x, struct nf_block_q4_0 *y, size_t n);
/* Convert a row of any supported type to f32. */
void nf_dequantize_row(uint32_t t, const void *src, float *dst, size_t n);
/* Encode a row of f32 into type t (f32, f16, bf16, q8_0, q4_0). */
void nf_quantize_row(uint32_t t, const float *src, void *dst, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_DTYPE_H */
