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

#include "nflash/cache.h"
#include "nflash/model.h"
#include "nflash/sparse.h"

/* Tests' own time limits are multiplied by this: a cross build's suite runs
 * under qemu-user, several times slower than the machine (the Makefile
 * passes 10 there). */
#ifndef NF_TEST_SLOWDOWN
#define NF_TEST_SLOWDOWN 1
#endif

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
/* The same as a mixture of n_expert experts, 2 routed per token (0: dense;
 * with predictor, one predictor per expert). */
int pl_synth_tiny_moe(const char *path, const char *act, uint32_t dtype, bool predictor, uint32_t n_expert);

/* Criterion-asserting helpers: load a model (GGUF or store; unpack: a
 * store's FFN into memory), open a context (n_ctx 64), run the 8-token
 * test prompt at once then n greedy tokens (EOS does not stop; logits of
 * the prompt's last position into lg). */
extern const int32_t pl_prompt[8];
struct nf_model *pl_load(const char *path, bool prefault, bool unpack);
struct nf_ctx *pl_open_ctx(struct nf_model *m, int threads);
void pl_run(struct nf_ctx *c, const int32_t *ids, size_t n_ids, float *lg, int32_t *greedy, size_t n);

/* nflash import gguf (bundles aligned to 512, extents of 8) to a fresh
 * path under /tmp, written to out. */
void pl_import(const char *gguf, char *out, size_t len);
/* The same, with each FFN's gate rows as an object too (--gate-objects). */
void pl_import_with(const char *gguf, char *out, size_t len, bool gate_objects);

/* A ReLU model with predictors whose FFNs (4 layers x 8192 neurons of dim
 * 256, F32: about 100 MB) do not fit small budgets, training context
 * n_ctx, written as a GGUF and imported as a store, at fresh /tmp paths
 * named from stem (Criterion-asserting). */
void pl_make_wide_model(const char *stem, uint32_t n_ctx, char *gguf, char *store, size_t len);

/* A cache over the store at store_path (opened into *st) with an arena
 * of arena bytes, a cold segment of at least min_cold_slots (0: the
 * default), and with fault, reads through the fault backend applying that
 * rule (Criterion-asserting). */

struct nf_cache *pl_open_cache(const char *store_path, struct nf_store **st, uint64_t arena,
			       const struct nf_io_fault_rule *fault, uint32_t min_cold_slots);

/* The sparse engine on c in mode, with cache or in memory (NULL)
 * (Criterion-asserting). */
struct nf_sparse *pl_engine(struct nf_ctx *c, enum nf_sparse_mode mode, struct nf_cache *cache);

/* Round v (n values) into out as the kernels prepare an input for weight
 * type dt; row r of w times x in double (row: w->n floats of scratch). */
void pl_round_for(uint32_t dt, const float *v, float *out, size_t n);
double pl_dotd(const struct nf_weight *w, uint32_t r, const float *x, float *row);

/* max |a[i] - b[i]| */
double pl_max_diff(const float *a, const float *b, size_t n);

/* The nflash binary, relative to the repository root (a cross build's
 * Makefile passes its own). PL_NFLASH_CMD starts a shell command that runs
 * it: through $NF_QEMU when the tests themselves run under qemu-user. */
#ifdef NF_TEST_NFLASH
#define PL_NFLASH NF_TEST_NFLASH
#else
#define PL_NFLASH "build/nflash"
#endif
#define PL_NFLASH_CMD "${NF_QEMU:+$NF_QEMU }" PL_NFLASH

/* Run PL_NFLASH with args (a shell command line): stdout into out, stderr
 * into err (both NUL-terminated, truncated to their lengths); returns the
 * exit status, -1 if it did not exit. */
int pl_run_cli(const char *args, char *out, size_t out_len, char *err, size_t err_len);

/* The number after "key": in json (Criterion-asserts that it is there). */
unsigned long long pl_json_u64(const char *json, const char *key);

/* Path of a fresh file under /tmp (name gets a unique suffix). */
void pl_tmp_path(char *out, size_t len, const char *stem);

#endif
