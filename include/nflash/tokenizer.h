/*
 * nflash/tokenizer.h - text <-> token ids, built from a GGUF's vocabulary.
 *
 * Two tokenizers, each reproducing llama.cpp's algorithm exactly:
 *  - SentencePiece-style (`tokenizer.ggml.model` = "llama"): spaces become
 *    U+2581, a space is prefixed to the text (add_space_prefix, default on),
 *    adjacent pieces are merged best score first, and a character with no
 *    piece falls back to its byte tokens <0xNN>.
 *  - Byte-level BPE ("gpt2", with `tokenizer.ggml.pre` = "gpt-2" or another
 *    name llama.cpp maps to the GPT-2 pre-tokenizer): the text is split by
 *    GPT-2's pre-tokenizer regex, each byte is mapped to a printable code
 *    point, and pieces are merged lowest merge rank first.
 * Special tokens (control, user-defined, unknown) found in the text are
 * split out first, as llama.cpp does: user-defined ones always, control and
 * unknown ones only with NF_TOK_PARSE_SPECIAL.
 *
 *	struct nf_tok *tok;
 *	int rc = nf_tok_open(gguf, &tok, &diag);
 *	int32_t ids[256];
 *	size_t n;
 *	rc = nf_tok_encode(tok, "Hello world", 11, NF_TOK_ADD_SPECIAL, ids, 256, &n);
 *	char piece[64];
 *	int len = nf_tok_piece(tok, ids[1], false, piece, sizeof(piece));
 *	nf_tok_close(tok);
 *
 * Thread-safety: a tokenizer is immutable after nf_tok_open(); every
 * function may be called from several threads at once.
 */
#ifndef NFLASH_TOKENIZER_H
#define NFLASH_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"
#include "nflash/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

struct nf_tok;

enum nf_tok_kind {
	NF_TOK_SPM = 1, /* SentencePiece-style, "llama" */
	NF_TOK_BPE = 2, /* byte-level BPE, "gpt2" */
};

/* Token types, as in tokenizer.ggml.token_type (llama.cpp's numbering). */
enum nf_tok_attr {
	NF_TOK_UNDEFINED = 0, NF_TOK_NORMAL = 1, NF_TOK_UNKNOWN = 2, NF_TOK_CONTROL = 3,
	NF_TOK_USER_DEFINED = 4, NF_TOK_UNUSED = 5, NF_TOK_BYTE = 6,
};

enum nf_tok_flags {
	NF_TOK_ADD_SPECIAL   = 1 << 0, /* BOS/EOS as the vocabulary asks (add_bos_token, add_eos_token) */
	NF_TOK_PARSE_SPECIAL = 1 << 1, /* text like "<s>" becomes the control token */
};

/*
 * nf_tok_open - build a tokenizer from g's tokenizer.ggml.* keys. The
 * tokenizer copies what it needs: g may be closed afterwards. Returns 0, or
 * NF_ENOTFOUND (no vocabulary), NF_EFORMAT (keys of the wrong type or
 * length), NF_EUNSUPPORTED (another tokenizer model or pre-tokenizer),
 * -ENOMEM; diag names the file and the key. Close with nf_tok_close().
 */
int nf_tok_open(const struct nf_gguf *g, struct nf_tok **out, struct nf_diag *diag);

/* nf_tok_close - free everything. Accepts NULL. */
void nf_tok_close(struct nf_tok *t);

/*
 * nf_tok_encode - tokenize len bytes of UTF-8 text (any bytes are accepted;
 * invalid UTF-8 is handled as llama.cpp does). Writes up to cap ids and sets
 * *n to the number of ids of the whole result; returns 0, or -ENOSPC if cap
 * was too small (then call again with cap >= *n), or -ENOMEM.
 */
int nf_tok_encode(const struct nf_tok *t, const char *text, size_t len, unsigned flags,
		  int32_t *ids, size_t cap, size_t *n);

/*
 * nf_tok_piece - the bytes token id stands for, as llama.cpp's
 * token_to_piece: SPM pieces with U+2581 turned into spaces, <0xNN> byte
 * tokens as that byte; BPE pieces mapped back from the byte-level alphabet.
 * Control and unknown tokens give their text only when special is true,
 * else nothing. Copies at most cap bytes (no NUL) and returns the piece's
 * full length, so a result > cap means it was cut; NF_EUSAGE for a bad id.
 */
int nf_tok_piece(const struct nf_tok *t, int32_t id, bool special, char *buf, size_t cap);

/* The token's text as stored in the vocabulary (NUL-terminated), or NULL. */
const char *nf_tok_text(const struct nf_tok *t, int32_t id);
/* enum nf_tok_attr of id; NF_TOK_UNDEFINED for a bad id. */
int nf_tok_attr(const struct nf_tok *t, int32_t id);

enum nf_tok_kind nf_tok_kind(const struct nf_tok *t);
uint32_t nf_tok_n_vocab(const struct nf_tok *t);
/* Special ids, -1 if the vocabulary has none. */
int32_t nf_tok_bos(const struct nf_tok *t);
int32_t nf_tok_eos(const struct nf_tok *t);
/* Whether NF_TOK_ADD_SPECIAL adds a BOS (tokenizer.ggml.add_bos_token, default on for SPM). */
bool nf_tok_add_bos(const struct nf_tok *t);
/* End of generation: EOS, and tokens such as <|endoftext|>, <|eot_id|>, <|im_end|>. */
bool nf_tok_is_eog(const struct nf_tok *t, int32_t id);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_TOKENIZER_H */
