/*
 * peer_logits.c - llama.cpp's logits for a prompt, in testdata's NAME.ref.txt
 * format: n_input, the ids, n_vocab, the last prompt position's logits
 * (%.6e), n_greedy 16 and the greedy continuation (argmax, lowest id on
 * ties). One batch, 2 threads, F32 KV cache, context 512, as the
 * references in ../shared/testdata were made; with PEER_TBT set in the
 * environment the prompt goes in one token per llama_decode instead.
 * Not part of the build: it links the llama.cpp peer of ../shared/PEERS.md (see README.md here).
 */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv)
{
	if (argc < 3 || argc - 2 > 512) {
		fprintf(stderr, "usage: peer_logits MODEL.gguf ID...\n");
		return 2;
	}
	int n = argc - 2;
	static llama_token ids[512];
	for (int i = 0; i < n; i++)
		ids[i] = atoi(argv[i + 2]);
	llama_backend_init();
	struct llama_model *m = llama_model_load_from_file(argv[1], llama_model_default_params());
	if (!m)
		return 1;
	struct llama_context_params cp = llama_context_default_params();
	cp.n_ctx = cp.n_batch = cp.n_ubatch = 512;
	cp.n_threads = cp.n_threads_batch = 2;
	cp.type_k = cp.type_v = GGML_TYPE_F32;
	struct llama_context *c = llama_init_from_model(m, cp);
	int nv = llama_vocab_n_tokens(llama_model_get_vocab(m));
	if (!c)
		return 1;
	if (getenv("PEER_TBT")) {
		/* one llama_decode per prompt token, as a decode step runs */
		for (int i = 0; i < n; i++)
			if (llama_decode(c, llama_batch_get_one(ids + i, 1)))
				return 1;
	} else if (llama_decode(c, llama_batch_get_one(ids, n))) {
		return 1;
	}
	const float *lg = llama_get_logits_ith(c, -1);
	printf("n_input %d\n", n);
	for (int i = 0; i < n; i++)
		printf("%d%c", ids[i], i + 1 < n ? ' ' : '\n');
	printf("n_vocab %d\n", nv);
	for (int i = 0; i < nv; i++)
		printf("%.6e\n", lg[i]);
	printf("n_greedy 16\n");
	for (int k = 0; k < 16; k++) {
		int b = 0;
		for (int i = 1; i < nv; i++)
			if (lg[i] > lg[b])
				b = i;
		printf("%d%c", b, k < 15 ? ' ' : '\n');
		llama_token t = b;
		if (llama_decode(c, llama_batch_get_one(&t, 1)))
			return 1;
		lg = llama_get_logits_ith(c, -1);
	}
	llama_free(c);
	llama_model_free(m);
	return 0;
}
