/*
 * tok_spm.c - SentencePiece-style tokenizer ("llama" vocabularies), as
 * llama.cpp's llm_tokenizer_spm_session.
 *
 * The text (with a space prefixed when asked) has every ' ' replaced by
 * U+2581, is split into UTF-8 characters, and adjacent symbols are merged
 * while their concatenation is a vocabulary piece, highest piece score first
 * (ties: leftmost). Each final symbol is its piece, or, for a character the
 * vocabulary lacks, its bytes as <0xNN> tokens (byte fallback).
 *
 * Invariants:
 *  1. Symbols in the list are contiguous in the buffer: a symbol's text ends
 *     where its next one's starts, so a candidate pair is still current iff
 *     both symbols are alive and their lengths still sum to the pair's size.
 *  2. A final symbol is either a merge result, which is always a piece, or a
 *     single character: llama.cpp's rev_merge re-segmentation can only ever
 *     see the latter, for which no merged text can be equal (a merge spans
 *     two whole characters), so it reduces to the byte fallback used here.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tok_int.h"

static void try_pair(const struct nf_tok *t, struct nf_tok_sym *sym, struct nf_tok_heap *h,
		     int32_t l, int32_t r)
{
	if (l < 0 || r < 0)
		return;
	size_t n = sym[l].n + sym[r].n;
	int32_t id = nf_tok_lookup(t, sym[l].text, n);
	if (id < 0)
		return;
	nf_tok_heap_push(h, (struct nf_tok_bigram){ t->score[id], l, r, n });
}

int nf_tok_spm_encode(const struct nf_tok *t, const char *text, size_t len, bool space_prefix,
		      struct nf_tok_ids *out)
{
	size_t spaces = space_prefix;
	for (size_t i = 0; i < len; i++)
		spaces += text[i] == ' ';
	size_t blen = len + space_prefix + 2 * spaces;
	if (blen == 0)
		return 0;
	char *buf = malloc(blen);
	struct nf_tok_sym *sym = malloc(blen * sizeof(*sym));
	struct nf_tok_heap h = {0};
	int rc = 0;
	if (!buf || !sym) {
		rc = -ENOMEM;
		goto out;
	}
	size_t b = 0;
	if (space_prefix) {
		memcpy(buf, "\xe2\x96\x81", 3);
		b = 3;
	}
	for (size_t i = 0; i < len; i++) {
		if (text[i] == ' ') {
			memcpy(buf + b, "\xe2\x96\x81", 3);
			b += 3;
		} else {
			buf[b++] = text[i];
		}
	}
	nf_tok_merge_syms(t, buf, blen, sym, &h, try_pair);   /* blen > 0: symbol 0 exists */
	if ((rc = h.err) < 0)
		goto out;
	for (int32_t i = 0; i != -1; i = sym[i].next) {
		int32_t id = nf_tok_lookup(t, sym[i].text, sym[i].n);
		if (id >= 0) {
			nf_tok_ids_push(out, id);
			continue;
		}
		for (size_t k = 0; k < sym[i].n; k++) {
			int32_t bt = t->byte_tok[(unsigned char)sym[i].text[k]];
			if (bt < 0)
				bt = t->unk;
			if (bt >= 0)
				nf_tok_ids_push(out, bt);
		}
	}
	rc = out->err;
out:
	free(h.v);
	free(sym);
	free(buf);
	return rc;
}
