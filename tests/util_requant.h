/*
 * tests/util_requant.h - a GGUF with every 2-D tensor requantized to one
 * type by nflash's reference quantizers (ggml's rounding rules), keys and
 * the other tensors copied: a llama.cpp file of random, non-grid weights,
 * as `llama-quantize --allow-requantize --pure` would make it, written the
 * same way every time (tests/peer's references for such files were made
 * by llama.cpp from this function's output).
 *
 *	struct nf_diag d = { 0 };
 *	if (nf_test_requant_gguf("in.gguf", "out.gguf", NF_DTYPE_Q5_0, &d) < 0) ...
 */
#ifndef NFLASH_TESTS_UTIL_REQUANT_H
#define NFLASH_TESTS_UTIL_REQUANT_H

#include <stdint.h>

#include "nflash/error.h"

/* 0, or a negative code with d naming the file or tensor. */
int nf_test_requant_gguf(const char *src, const char *dst, uint32_t type, struct nf_diag *d);

#endif
