/*
 * nflash/dtype.h - element types shared by GGUF files, stores and kernels.
 *
 * Values equal ggml's type ids, so a GGUF tensor type can be stored as is.
 * Quantized types are stored in blocks, bit-exact with ggml's layout: Q4_0
 * and Q8_0 hold 32 values per block with one fp16 scale; the K-quants
 * (Q2_K..Q6_K) hold 256 values per super-block with 16 or 8 sub-block
 * scales (and mins) quantized against fp16 super-block scales; Q8_K is the
 * activation type of the K-quant dot products (f32 scale, int8 values, and
 * the sums of each 16 values).
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
	NF_DTYPE_Q4_1 = 3,
	NF_DTYPE_Q5_0 = 6,
	NF_DTYPE_Q5_1 = 7,
	NF_DTYPE_Q8_0 = 8,
	NF_DTYPE_Q8_1 = 9,
	NF_DTYPE_Q2_K = 10,
	NF_DTYPE_Q3_K = 11,
	NF_DTYPE_Q4_K = 12,
	NF_DTYPE_Q5_K = 13,
	NF_DTYPE_Q6_K = 14,
	NF_DTYPE_Q8_K = 15,
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

/* ggml's other 32-value blocks, which llama-quantize writes for its Q4_1,
 * Q5_0 and Q5_1 recipes and for the rows of a K-quant recipe that are not
 * a multiple of 256 (Q4_K -> Q5_0, Q5_K -> Q5_1). Quants as Q4_0's
 * (qs[j]: low nibble value j, high nibble value 16 + j); qh bit j the fifth
 * bit of value j. */
struct nf_block_q4_1 {
	uint16_t d, m;          /* fp16; value = q * d + m */
	uint8_t qs[NF_QK / 2];
};
_Static_assert(sizeof(struct nf_block_q4_1) == 20, "q4_1 block is 20 bytes");
struct nf_block_q5_0 {
	uint16_t d;             /* value = (q - 16) * d */
	uint8_t qh[4];
	uint8_t qs[NF_QK / 2];
};
_Static_assert(sizeof(struct nf_block_q5_0) == 22, "q5_0 block is 22 bytes");
struct nf_block_q5_1 {
	uint16_t d, m;          /* value = q * d + m */
	uint8_t qh[4];
	uint8_t qs[NF_QK / 2];
};
_Static_assert(sizeof(struct nf_block_q5_1) == 24, "q5_1 block is 24 bytes");
/* Activations for Q4_1 / Q5_1 dot products: value = q * d, s = d * sum(q) (fp16). */
struct nf_block_q8_1 {
	uint16_t d, s;
	int8_t qs[NF_QK];
};
_Static_assert(sizeof(struct nf_block_q8_1) == 36, "q8_1 block is 36 bytes");

#define NF_QK_K 256 /* values per K-quant super-block */
#define NF_K_SCALE_SIZE 12

/* value = (d * sc) * q - dmin * m per 16 values; sc = scales & 15, m = scales >> 4 */
struct nf_block_q2_K {
	uint8_t scales[NF_QK_K / 16];
	uint8_t qs[NF_QK_K / 4];  /* 2 bits: value 128h+32k+l is (qs[32h+l] >> 2k) & 3 */
	uint16_t d, dmin;          /* fp16 */
};
_Static_assert(sizeof(struct nf_block_q2_K) == 84, "q2_K block is 84 bytes");

/* value = (d * (sc - 32)) * (q - 4 * !hbit) per 16 values; 6-bit scales packed in 12 bytes */
struct nf_block_q3_K {
	uint8_t hmask[NF_QK_K / 8]; /* bit 4h+k of hmask[l]: high bit of value 128h+32k+l */
	uint8_t qs[NF_QK_K / 4];    /* low 2 bits, as q2_K */
	uint8_t scales[NF_K_SCALE_SIZE];
	uint16_t d;
};
_Static_assert(sizeof(struct nf_block_q3_K) == 110, "q3_K block is 110 bytes");

/* value = (d * sc) * q - dmin * m per 32 values; 6-bit scales and mins in 12 bytes */
struct nf_block_q4_K {
	uint16_t d, dmin;
	uint8_t scales[NF_K_SCALE_SIZE];
	uint8_t qs[NF_QK_K / 2];  /* qs[32c+l]: value 64c+l low nibble, 64c+32+l high nibble */
};
_Static_assert(sizeof(struct nf_block_q4_K) == 144, "q4_K block is 144 bytes");

/* as q4_K with a fifth bit: bit 2c (2c+1) of qh[l] for value 64c+l (64c+32+l) */
struct nf_block_q5_K {
	uint16_t d, dmin;
	uint8_t scales[NF_K_SCALE_SIZE];
	uint8_t qh[NF_QK_K / 8];
	uint8_t qs[NF_QK_K / 2];
};
_Static_assert(sizeof(struct nf_block_q5_K) == 176, "q5_K block is 176 bytes");

/* value = (d * sc) * (q - 32) per 16 values; q: 4 low bits in ql, 2 high in qh */
struct nf_block_q6_K {
	uint8_t ql[NF_QK_K / 2];
	uint8_t qh[NF_QK_K / 4];
	int8_t scales[NF_QK_K / 16];
	uint16_t d;
};
_Static_assert(sizeof(struct nf_block_q6_K) == 210, "q6_K block is 210 bytes");

/* Activations for K-quant dot products: value = d * q, bsums[j] = sum of q[16j..16j+15]. */
struct nf_block_q8_K {
	float d;
	int8_t qs[NF_QK_K];
	int16_t bsums[NF_QK_K / 16];
};
_Static_assert(sizeof(struct nf_block_q8_K) == 292, "q8_K block is 292 bytes");

/*
 * A K-quant super-block as integers, the one form kernels and bundles use:
 * value i = (d * sc[i / 16]) * q[i] - dmin * mn[i / 16] in f32 (ggml's
 * dequantization, one rounding per product). q carries the type's offset
 * (q3_K: q - 4 * !hbit, q6_K: q - 32); types without mins have dmin = 0
 * and mn = 0; per-32 scales (q4_K, q5_K) appear twice.
 */
struct nf_kblock {
	float d, dmin;
	int16_t sc[NF_QK_K / 16];
	int16_t mn[NF_QK_K / 16];
	int8_t q[NF_QK_K];
};

/* True for the K-quant weight types (q2_K..q6_K; not q8_K). */
bool nf_dtype_is_kquant(uint32_t t);
/* Unpack super-block blk of K-quant type t (nf_dtype_is_kquant). */
void nf_kblock_unpack(uint32_t t, const void *blk, struct nf_kblock *out);
/* Only d, dmin, sc and mn of blk (q untouched): for code that reads the
 * quants elsewhere. */
void nf_kblock_unpack_scales(uint32_t t, const void *blk, struct nf_kblock *out);
/* Pack kb into a block of type t; -1 (blk unspecified) if a field is out of
 * the type's range or per-32 scales differ within a pair. d and dmin are
 * stored as fp16. */
int nf_kblock_pack(uint32_t t, const struct nf_kblock *kb, void *blk);
/* Bits of one stored quant of K-quant type t (2..6), and the quant's
 * offset (value = raw - offset: 4 for q3_K, 32 for q6_K, else 0). */
uint32_t nf_kquant_bits(uint32_t t);
int nf_kquant_offset(uint32_t t);
/* The byte range [*qoff, *qoff + *qlen) of a t block that holds quants;
 * the rest of the block (scales, mins, d, dmin) is its "head". */
void nf_kquant_quant_span(uint32_t t, size_t *qoff, size_t *qlen);
/* Raw quant (0 .. 2^bits - 1) of value i of block blk; set writes it. */
uint32_t nf_kquant_get(uint32_t t, const void *blk, uint32_t i);
void nf_kquant_set(uint32_t t, void *blk, uint32_t i, uint32_t raw);

/* The 256 f32 values of an unpacked super-block, as ggml dequantizes. */
void nf_kblock_dequantize(const struct nf_kblock *kb, float *y);
/* Encode f32 values as K-quant type t (simple fit; n a multiple of 256). */
void nf_quantize_row_kquant(uint32_t t, const float *x, void *y, size_t n);

/* True for the types above. */
bool nf_dtype_valid(uint32_t t);
/* True for Q4_1, Q5_0 and Q5_1 (read in memory; no neuron-bundle form). */
bool nf_dtype_is_legacy(uint32_t t);
/* "f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1",
 * "q2_K".."q8_K", "bf16", or "unknown". */
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
/* Q4_1, Q5_0, Q5_1 as ggml's reference rule; their 32 quants 0..2^b - 1
 * (Q5_0's with the offset 16 not yet taken) of block blk: */
void nf_quant5_unpack(uint32_t t, const void *blk, uint8_t q[NF_QK]);
/* Convert a row of any supported type to f32. */
void nf_dequantize_row(uint32_t t, const void *src, float *dst, size_t n);
/* Encode a row of f32 into type t (any type above). The K-quant encoders
 * are simple min/max fits (valid files, not ggml's error-minimising
 * search); q8_K is ggml's quantize_row_q8_K_ref bit for bit. n a multiple
 * of the block length. */
void nf_quantize_row(uint32_t t, const float *src, void *dst, size_t n);
void nf_quantize_row_q8_K(const float *x, struct nf_block_q8_K *y, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_DTYPE_H */
