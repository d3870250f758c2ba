/*
 * tests/util_pipeline.h - helpers of the pipeline tests: a store holding a
 * GGUF model's FFNs as neuron bundles (float weights only: the store keeps
 * gate, up and down column in one type; `import` does the general case),
 * tiny synthetic models, logits comparison.
 *
 * Not thread-safe; used from one test at a time.
 */
#ifndef NFLASH_TESTS_UTIL_PIPELINE_H
#define NFLASH_TESTS_UTIL_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/model.h"

/*
 * pl_store_from_model - write every dense layer's FFN of m to a store at
 * path: bundle j = gate row j, up row j, down column j. With shuffle, the
 * neuron -> slot permutation is a seeded shuffle. extent_bundles 0 takes
 * the default. Returns 0 or a negative error (the message in msg).
 */
int pl_store_from_model(const struct nf_model *m, const char *path, uint32_t extent_bundles,
			bool shuffle, char *msg, size_t msg_len);

/* Write a tiny synthetic model (nflash synth --shape tiny) with activation
 * act ("relu", "drelu", "silu"), dtype, and PowerInfer predictor or not. */
int pl_synth_tiny(const char *path, const char *act, uint32_t dtype, bool predictor);

/* max |a[i] - b[i]| */
double pl_max_diff(const float *a, const float *b, size_t n);

/* Path of a fresh file under /tmp (name gets a unique suffix). */
void pl_tmp_path(char *out, size_t len, const char *stem);

#endif
