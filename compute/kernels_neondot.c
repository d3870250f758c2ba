/*
 * kernels_neondot.c - the kernel table for arm64 NEON with the dot-product
 * extension (sdot, FEAT_DotProd): the Q8_0, Q4_0 and K-quant products take
 * their block sums from vdotq_s32; every other entry is kernels_neon.c's.
 *
 * Invariants:
 * 1. sdot's lane j is the sum of the four products 4j..4j+3, exactly the
 *    lanes the reference sums (kernels_neon_q.h), so results have the
 *    reference's bits, as the plain NEON table's do.
 * 2. Only this file is compiled with +dotprod, and kernels.c hands out its
 *    table only when AT_HWCAP has HWCAP_ASIMDDP.
 */
#include <arm_neon.h>

#include "kernels_impl.h"

static inline int32x4_t dot16(int8x16_t a, int8x16_t b)
{
	return vdotq_s32(vdupq_n_s32(0), a, b);
}

#include "kernels_neon_q.h"
#include "kernels_neon_kquant.h"

const struct nf_kernels nf_kernels_table_neondot = {
	.isa = "neon-dot",
	NF_KNEON_SHARED_ENTRIES,
	NF_KNEON_QUANT_ENTRIES,
	NF_KNEON_KQUANT_ENTRIES,
	NF_KREF_LEGACY_ENTRIES,
};
