/*
 * fuzz_tok.c - libFuzzer target for the tokenizers (`make fuzz-tok`).
 *
 * Loads the LLaMA SentencePiece and GPT-2 vocabularies once (directory in
 * NF_FUZZ_VOCAB, default ../../shared/testdata/vocab), then encodes each input
 * with both, with and without special-token parsing. Checks: every id is in
 * the vocabulary, and for valid UTF-8 without special-token text the pieces
 * concatenate back to the input (SPM: behind the added space; U+2581 comes
 * back as a space).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/gguf.h"
#include "nflash/tokenizer.h"

static struct nf_tok *toks[2];

static struct nf_tok *load(const char *dir, const char *name)
{
	char path[4096];
	struct nf_gguf *g;
	struct nf_tok *t;
	struct nf_diag d = {0};
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	int rc = nf_gguf_open(path, 0, &g, &d);
	if (rc == 0)
		rc = nf_tok_open(g, &t, &d);
	if (rc < 0) {
		fprintf(stderr, "fuzz_tok: %s\n", nf_diag_msg(&d, rc));
		exit(1);
	}
	nf_gguf_close(g);
	return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	const char *dir = getenv("NF_FUZZ_VOCAB");
	if (!dir)
		dir = "../../shared/testdata/vocab";
	toks[0] = load(dir, "ggml-vocab-llama-spm.gguf");
	toks[1] = load(dir, "ggml-vocab-gpt-2.gguf");
	(void)argc;
	(void)argv;
	return 0;
}

static int utf8_valid(const unsigned char *s, size_t n)
{
	for (size_t i = 0; i < n;) {
		unsigned c = s[i];
		size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
		if (!k || i + k > n)
			return 0;
		uint32_t cp = k == 1 ? c : c & (0x7fu >> k);
		for (size_t j = 1; j < k; j++) {
			if ((s[i + j] & 0xc0) != 0x80)
				return 0;
			cp = (cp << 6) | (s[i + j] & 0x3f);
		}
		static const uint32_t min[5] = { 0, 0, 0x80, 0x800, 0x10000 };
		if (cp < min[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			return 0;
		i += k;
	}
	return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *text = (const char *)data;
	int valid = utf8_valid(data, size) && !memchr(data, '<', size);
	for (int k = 0; k < 2; k++) {
		const struct nf_tok *t = toks[k];
		for (unsigned flags = 0; flags < 4; flags++) {
			size_t n = 0, cap = size * 3 + 8;
			int32_t *ids = malloc(cap * sizeof(*ids));
			if (nf_tok_encode(t, text, size, flags, ids, cap, &n) != 0)
				abort();
			for (size_t i = 0; i < n; i++)
				if (ids[i] < 0 || (uint32_t)ids[i] >= nf_tok_n_vocab(t))
					abort();
			if (valid && flags == 0) {
				char *dec = malloc(size * 4 + 16);
				size_t dl = 0;
				for (size_t i = 0; i < n; i++) {
					int len = nf_tok_piece(t, ids[i], false, dec + dl, size * 4 + 16 - dl);
					if (len < 0 || dl + (size_t)len > size * 4 + 16)
						abort();
					dl += (size_t)len;
				}
				/* expected: the text with U+2581 as space, SPM behind a space */
				char *want = malloc(size + 2);
				size_t wl = 0;
				if (k == 0 && size)
					want[wl++] = ' ';
				for (size_t i = 0; i < size; i++) {
					if (k == 0 && i + 3 <= size && !memcmp(text + i, "\xe2\x96\x81", 3)) {
						want[wl++] = ' ';
						i += 2;
					} else {
						want[wl++] = text[i];
					}
				}
				if (dl != wl || memcmp(dec, want, wl))
					abort();
				free(want);
				free(dec);
			}
			free(ids);
		}
	}
	return 0;
}
