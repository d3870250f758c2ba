/*
 * fuzz_model.c - libFuzzer target for model loading above the readers
 * (`make fuzz`): nf_model_load() on the input as a file, GGUF (llama.cpp or
 * PowerInfer) or store, exactly as `nflash eval -m FILE` loads it:
 * hyperparameters, every tensor bound and checked against them, a store's
 * metadata blob and dense objects. An accepted model is then asked for
 * its layout (hparams, every layer, the FFN seam of a store). Store inputs
 * get their crcs recomputed after mutation (fuzz_fix.c), so the loader
 * sees mutated structure rather than checksum errors.
 *
 * The input lives in a memfd, rewritten for each run, and is loaded by its
 * /proc/self/fd path (the loader maps GGUFs and reads stores by path).
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nflash/model.h"
#include "fuzz_fix.h"

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed)
{
	return fuzz_store_mutate(data, size, max_size, seed);
}

static int mfd = -1;
static char path[64];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (mfd < 0) {
		mfd = memfd_create("nflash-fuzz-model", MFD_CLOEXEC);
		if (mfd < 0)
			abort();
		snprintf(path, sizeof(path), "/proc/self/fd/%d", mfd);
	}
	/* overwrite, then cut to size: the memfd keeps its pages from run to
	 * run (truncating to 0 first freed and refaulted them every run) */
	if ((size && pwrite(mfd, data, size, 0) != (ssize_t)size) || ftruncate(mfd, (off_t)size) < 0)
		abort();
	struct nf_model *m = NULL;
	struct nf_diag d = { 0 };
	struct nf_model_opts o = { .prefault = false };
	int rc = nf_model_load(path, &o, &m, &d);
	if (rc < 0) {
		if (m || !d.msg[0])
			abort();
		return 0;
	}
	const struct nf_model_hparams *hp = nf_model_hparams(m);
	volatile uint64_t sink = 0;
	for (uint32_t l = 0; l < hp->n_layer; l++) {
		const struct nf_layer_weights *L = nf_model_layer(m, l);
		sink += (uintptr_t)L->attn_norm;
	}
	sink += nf_model_weight_bytes(m);
	(void)sink;
	nf_model_free(m);
	return 0;
}
