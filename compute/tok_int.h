/*
 * tok_int.h - private parts of the tokenizer shared by tokenizer.c (vocabulary,
 * special tokens, detokenizer), tok_spm.c and tok_bpe.c.
 */
#ifndef NFLASH_TOK_INT_H
#define NFLASH_TOK_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/tokenizer.h"

/* One BPE merge "a b": the pair's parts point into merge_mem. */
struct nf_tok_merge {
	const char *a, *b;
	uint32_t alen, blen;
};

/* BPE pre-tokenizers (llama.cpp's LLAMA_VOCAB_PRE_TYPE_*): which regex cuts
 * the text into words. */
enum nf_tok_pre {
	NF_TOK_PRE_GPT2 = 0,   /* 's|'t|... ?\p{L}+| ?\p{N}+|... */
	NF_TOK_PRE_LLAMA3,     /* (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|... */
};

struct nf_tok {
	enum nf_tok_kind kind;
	enum nf_tok_pre pre;
	bool ignore_merges;       /* a word that is a token is that token (llama3) */
	uint32_t n_vocab;
	const char **text;        /* NUL-terminated; empty tokens renamed "[EMPTY_i]" */
	uint32_t *len;
	float *score;
	uint8_t *attr;            /* enum nf_tok_attr */
	bool *eog;
	char *text_mem;

	uint32_t *map;            /* text -> id + 1, open addressing; the last duplicate wins */
	size_t map_mask;

	struct nf_tok_merge *merges;  /* index = rank */
	size_t n_merges;
	char *merge_mem;
	uint32_t *mmap;           /* (a, b) -> rank + 1; the first duplicate wins */
	size_t mmap_mask;

	int32_t *special;         /* control/user-defined/unknown ids, longest text first */
	size_t n_special;

	int32_t bos, eos, unk;
	bool add_bos, add_eos, add_space_prefix;
	int32_t byte_tok[256];    /* SPM byte fallback, -1 if none */
};

/* A growing list of ids; err is set (-ENOMEM) instead of failing each push. */
struct nf_tok_ids {
	int32_t *v;
	size_t n, cap;
	int err;
};
void nf_tok_ids_push(struct nf_tok_ids *o, int32_t id);

/* id of the token whose text is s[0..n), or -1. */
int32_t nf_tok_lookup(const struct nf_tok *t, const char *s, size_t n);
/* rank of the merge (a, b), or -1. */
int32_t nf_tok_merge_rank(const struct nf_tok *t, const char *a, size_t an, const char *b, size_t bn);

/*
 * A max-heap of merge candidates: largest key first, then smallest left.
 * SPM uses the piece score as key, BPE minus the merge rank.
 */
struct nf_tok_bigram {
	double key;
	int32_t left, right;
	size_t size;              /* bytes of the merged text when pushed */
};
struct nf_tok_heap {
	struct nf_tok_bigram *v;
	size_t n, cap;
	int err;
};
void nf_tok_heap_push(struct nf_tok_heap *h, struct nf_tok_bigram b);
struct nf_tok_bigram nf_tok_heap_pop(struct nf_tok_heap *h);

/* A symbol in the merge list: text[0..n) with prev/next indices (-1 = none). */
struct nf_tok_sym {
	const char *text;
	size_t n;
	int32_t prev, next;
};

/* Pushes the candidate pair (l, r) if it merges (l or r may be -1). */
typedef void (*nf_tok_pair_fn)(const struct nf_tok *t, struct nf_tok_sym *sym,
			       struct nf_tok_heap *h, int32_t l, int32_t r);
/*
 * Split text[0..len) into UTF-8 character symbols (sym has room for len),
 * then merge adjacent ones best candidate first until none is left. The
 * surviving symbols are chained from index 0. Returns the symbol count
 * (0 for empty text); h->err tells of a failed allocation.
 */
int32_t nf_tok_merge_syms(const struct nf_tok *t, const char *text, size_t len,
			  struct nf_tok_sym *sym, struct nf_tok_heap *h, nf_tok_pair_fn pair);

/* Length of the UTF-8 sequence a lead byte announces (1 for stray bytes), as llama.cpp. */
static inline size_t nf_tok_utf8_len(unsigned char c)
{
	static const uint8_t lookup[16] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4 };
	return lookup[c >> 4];
}

/*
 * UTF-8 as llama.cpp reads it: a sequence is taken by its lead byte if the
 * continuation bytes are there (no overlong or surrogate checks, up to
 * 0x1FFFFF); anything else is one byte read as U+FFFD. Returns bytes used
 * (>= 1; n must be >= 1).
 */
size_t nf_tok_utf8_decode(const char *s, size_t n, uint32_t *cp);
/* Encode cp into out (4 bytes room); code points past U+10FFFF give U+FFFD. */
size_t nf_tok_utf8_encode(uint32_t cp, char *out);

/* Encoders for one run of raw text (no special tokens inside). */
int nf_tok_spm_encode(const struct nf_tok *t, const char *text, size_t len, bool space_prefix,
		      struct nf_tok_ids *out);
int nf_tok_bpe_encode(const struct nf_tok *t, const char *text, size_t len, struct nf_tok_ids *out);

/* BPE: the byte a code point of the byte-level alphabet stands for, or -1. */
int nf_tok_bpe_cp_to_byte(uint32_t cp);

/* Unicode tables (unicode_tables.c) and a lookup in them. */
extern const uint32_t nf_uc_letter[][2];
extern const size_t nf_uc_letter_n;
extern const uint32_t nf_uc_number[][2];
extern const size_t nf_uc_number_n;
bool nf_uc_in(const uint32_t (*ranges)[2], size_t n, uint32_t cp);

#endif
