/*
 * tok_bpe.c - byte-level BPE ("gpt2" vocabularies) with GPT-2's pre-tokenizer
 * (or Llama 3's, llama3_split below), as llama.cpp's llm_tokenizer_bpe_session
 * and its hand-written matcher for
 *
 *	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *
 * The text is decoded to code points (invalid UTF-8 -> U+FFFD per byte), cut
 * into words by the regex above, each word re-encoded to UTF-8 and every byte
 * mapped to GPT-2's printable alphabet; within a word, adjacent symbols are
 * merged by the lowest merge rank first (ties: leftmost). A final symbol with
 * no token is emitted byte by byte where single bytes are tokens.
 *
 * Invariants:
 *  1. The matcher looks at code points only inside the current text; past
 *     its end a position has no flags, which ends every run.
 *  2. Code points above U+10FFFF (possible from 4-byte sequences) have no
 *     Unicode flags, as in llama.cpp, and match no class.
 *  3. Symbols are contiguous in the word buffer (see tok_spm.c), so a pair is
 *     current iff both symbols live and their lengths sum to its size.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tok_int.h"

/* ---- UTF-8 and Unicode classes ------------------------------------------ */

size_t nf_tok_utf8_decode(const char *str, size_t n, uint32_t *cp)
{
	const unsigned char *s = (const unsigned char *)str;
	unsigned c = s[0];
	if (!(c & 0x80)) {
		*cp = c;
		return 1;
	}
	size_t need = !(c & 0x40) ? 0 : !(c & 0x20) ? 2 : !(c & 0x10) ? 3 : !(c & 0x08) ? 4 : 0;
	if (need == 0 || need > n)
		goto invalid;
	for (size_t i = 1; i < need; i++)
		if ((s[i] & 0xc0) != 0x80)
			goto invalid;
	switch (need) {
	case 2: *cp = ((c & 0x1f) << 6) | (s[1] & 0x3f); break;
	case 3: *cp = ((c & 0x0f) << 12) | ((s[1] & 0x3f) << 6) | (s[2] & 0x3f); break;
	default: *cp = ((c & 0x07) << 18) | ((s[1] & 0x3f) << 12) | ((s[2] & 0x3f) << 6) | (s[3] & 0x3f); break;
	}
	return need;
invalid:
	*cp = 0xFFFD;
	return 1;
}

size_t nf_tok_utf8_encode(uint32_t cp, char *out)
{
	unsigned char *o = (unsigned char *)out;
	if (cp > 0x10FFFF)
		cp = 0xFFFD;
	if (cp < 0x80) {
		o[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		o[0] = (unsigned char)(0xc0 | (cp >> 6));
		o[1] = (unsigned char)(0x80 | (cp & 0x3f));
		return 2;
	}
	if (cp < 0x10000) {
		o[0] = (unsigned char)(0xe0 | (cp >> 12));
		o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
		o[2] = (unsigned char)(0x80 | (cp & 0x3f));
		return 3;
	}
	o[0] = (unsigned char)(0xf0 | (cp >> 18));
	o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
	o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
	o[3] = (unsigned char)(0x80 | (cp & 0x3f));
	return 4;
}

bool nf_uc_in(const uint32_t (*r)[2], size_t n, uint32_t cp)
{
	size_t lo = 0, hi = n;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (cp < r[mid][0])
			hi = mid;
		else if (cp > r[mid][1])
			lo = mid + 1;
		else
			return true;
	}
	return false;
}

/* \s: Unicode White_Space. */
static bool uc_space(uint32_t cp)
{
	return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
	       (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
	       cp == 0x205f || cp == 0x3000;
}

/* GPT-2's byte -> code point alphabet: printable Latin-1 bytes stand for
 * themselves, the other 68 bytes for U+0100.. in byte order. */
static bool byte_printable(unsigned b)
{
	return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

/* The non-printable bytes are 0x00-0x20 (33), 0x7f-0xa0 (34) and 0xad. */
static uint32_t byte_to_cp(unsigned b)
{
	if (byte_printable(b))
		return b;
	return 0x100 + (b <= 0x20 ? b : b <= 0xa0 ? 33 + (b - 0x7f) : 67);
}

int nf_tok_bpe_cp_to_byte(uint32_t cp)
{
	if (cp < 0x100)
		return byte_printable(cp) ? (int)cp : -1;
	uint32_t k = cp - 0x100;
	return k < 33 ? (int)k : k < 67 ? (int)(0x7f + k - 33) : k == 67 ? 0xad : -1;
}

/* ---- the GPT-2 pre-tokenizer -------------------------------------------- */

enum { F_VALID = 1, F_LETTER = 2, F_NUMBER = 4, F_SPACE = 8 };

static unsigned flags_at(const uint32_t *cps, size_t n, size_t pos)
{
	if (pos >= n || cps[pos] > 0x10FFFF)
		return 0;
	uint32_t cp = cps[pos];
	unsigned f = F_VALID;
	if (uc_space(cp))
		f |= F_SPACE;
	if (nf_uc_in(nf_uc_letter, nf_uc_letter_n, cp))
		f |= F_LETTER;
	else if (nf_uc_in(nf_uc_number, nf_uc_number_n, cp))
		f |= F_NUMBER;
	return f;
}

static bool is_other(unsigned f)
{
	return (f & F_VALID) && !(f & (F_SPACE | F_LETTER | F_NUMBER));
}

static uint32_t ascii_lower(uint32_t cp)
{
	return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
}

/* The length of 's 't 're 've 'm 'll 'd at pos, 0 if none there; fold: any
 * case (Llama 3's (?i:...); only ASCII letters lower-case to the letters
 * tested, so an ASCII fold is exact). */
static size_t contraction(const uint32_t *cps, size_t n, size_t pos, bool fold)
{
	if (cps[pos] != '\'' || pos + 1 >= n)
		return 0;
	uint32_t c1 = fold ? ascii_lower(cps[pos + 1]) : cps[pos + 1];
	if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
		return 2;
	if (pos + 2 >= n)
		return 0;
	uint32_t c2 = fold ? ascii_lower(cps[pos + 2]) : cps[pos + 2];
	return (c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l') ? 3 : 0;
}

/* The end of the word at pos when nothing before matched: with nl (Llama
 * 3) \s*[\r\n]+ up to the last CR/LF of the whitespace run, then
 * \s+(?!\S) (all but the run's last space when text follows), \s+, or one
 * code point. */
static size_t space_end(const uint32_t *cps, size_t n, size_t pos, bool nl)
{
	size_t ws = 0, last_nl = 0;
	while (flags_at(cps, n, pos + ws) & F_SPACE) {
		if (nl && (cps[pos + ws] == '\r' || cps[pos + ws] == '\n'))
			last_nl = pos + ws + 1;
		ws++;
	}
	if (last_nl)
		return last_nl;
	if (ws > 1 && pos + ws < n)
		return pos + ws - 1;
	return pos + (ws ? ws : 1);
}

/* Cut cps[0..n) into words; ends[i] is the end of word i. Returns the count. */
static size_t gpt2_split(const uint32_t *cps, size_t n, size_t *ends)
{
	size_t nw = 0, pos = 0;
	while (pos < n) {
		uint32_t cp = cps[pos];
		size_t cl = contraction(cps, n, pos, false);
		if (cl) {
			pos += cl;
			ends[nw++] = pos;
			continue;
		}
		unsigned f = cp == ' ' ? flags_at(cps, n, pos + 1) : flags_at(cps, n, pos);
		unsigned cls = (f & F_LETTER) ? F_LETTER : (f & F_NUMBER) ? F_NUMBER : is_other(f) ? F_VALID : 0;
		if (cls) {
			/* ' ?' then a run of letters, of numbers, or of anything else but space */
			pos += cp == ' ';
			for (;;) {
				unsigned g = flags_at(cps, n, pos);
				if (cls == F_VALID ? !is_other(g) : !(g & cls))
					break;
				pos++;
			}
			ends[nw++] = pos;
			continue;
		}
		pos = space_end(cps, n, pos, false);
		ends[nw++] = pos;
	}
	return nw;
}

/*
 * Llama 3's pre-tokenizer, as llama.cpp's hand-written matcher for
 *
 *	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *	 ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 */

static size_t llama3_split(const uint32_t *cps, size_t n, size_t *ends)
{
	size_t nw = 0, pos = 0;
	while (pos < n) {
		uint32_t cp = cps[pos];
		unsigned f = flags_at(cps, n, pos);
		size_t cl = contraction(cps, n, pos, true);
		if (cl) {
			pos += cl;
			ends[nw++] = pos;
			continue;
		}
		/* [^\r\n\p{L}\p{N}]?\p{L}+ */
		if (cp != '\r' && cp != '\n' && !(f & F_NUMBER) &&
		    ((f & F_LETTER) || (flags_at(cps, n, pos + 1) & F_LETTER))) {
			pos++;
			while (flags_at(cps, n, pos) & F_LETTER)
				pos++;
			ends[nw++] = pos;
			continue;
		}
		/* \p{N}{1,3} */
		if (f & F_NUMBER) {
			size_t run = 0;
			while ((flags_at(cps, n, pos) & F_NUMBER) && run < 3) {
				pos++;
				run++;
			}
			ends[nw++] = pos;
			continue;
		}
		/* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
		unsigned f2 = cp == ' ' ? flags_at(cps, n, pos + 1) : f;
		if (is_other(f2) && f) {
			pos += cp == ' ';
			while (is_other(flags_at(cps, n, pos)))
				pos++;
			while (pos < n && (cps[pos] == '\r' || cps[pos] == '\n'))
				pos++;
			ends[nw++] = pos;
			continue;
		}
		pos = space_end(cps, n, pos, true);
		ends[nw++] = pos;
	}
	return nw;
}

/* ---- merging ------------------------------------------------------------ */

static void try_pair(const struct nf_tok *t, struct nf_tok_sym *sym, struct nf_tok_heap *h,
		     int32_t l, int32_t r)
{
	if (l < 0 || r < 0)
		return;
	int32_t rank = nf_tok_merge_rank(t, sym[l].text, sym[l].n, sym[r].text, sym[r].n);
	if (rank < 0)
		return;
	nf_tok_heap_push(h, (struct nf_tok_bigram){ -(double)rank, l, r, sym[l].n + sym[r].n });
}

static void bpe_word(const struct nf_tok *t, const char *w, size_t wlen, struct nf_tok_sym *sym,
		     struct nf_tok_heap *h, struct nf_tok_ids *out)
{
	if (t->ignore_merges) {
		int32_t id = nf_tok_lookup(t, w, wlen);
		if (id >= 0) {
			nf_tok_ids_push(out, id);
			return;
		}
	}
	int32_t n_sym = nf_tok_merge_syms(t, w, wlen, sym, h, try_pair);
	if (h->err) {
		out->err = h->err;
		return;
	}
	for (int32_t i = 0; n_sym && i != -1; i = sym[i].next) {
		int32_t id = nf_tok_lookup(t, sym[i].text, sym[i].n);
		if (id >= 0) {
			nf_tok_ids_push(out, id);
			continue;
		}
		for (size_t k = 0; k < sym[i].n; k++) {
			int32_t b = nf_tok_lookup(t, sym[i].text + k, 1);
			if (b >= 0)
				nf_tok_ids_push(out, b);
		}
	}
}

/* Bytes code point cp takes once each of its UTF-8 bytes is mapped (1 or 2 each). */
static size_t mapped_len(uint32_t cp)
{
	char u[4];
	size_t un = nf_tok_utf8_encode(cp, u), n = 0;
	for (size_t j = 0; j < un; j++)
		n += byte_to_cp((unsigned char)u[j]) < 0x80 ? 1 : 2;
	return n;
}

int nf_tok_bpe_encode(const struct nf_tok *t, const char *text, size_t len, struct nf_tok_ids *out)
{
	if (len == 0)
		return 0;
	uint32_t *cps = malloc(len * sizeof(*cps));
	size_t *ends = malloc(len * sizeof(*ends));
	char *word = NULL;
	struct nf_tok_sym *sym = NULL;
	struct nf_tok_heap h = {0};
	int rc = 0;
	if (!cps || !ends) {
		rc = -ENOMEM;
		goto out;
	}
	size_t n = 0;
	for (size_t off = 0; off < len; n++)
		off += nf_tok_utf8_decode(text + off, len - off, &cps[n]);
	size_t nw = t->pre == NF_TOK_PRE_LLAMA3 ? llama3_split(cps, n, ends) : gpt2_split(cps, n, ends), longest = 0;
	for (size_t i = 0, start = 0; i < nw; start = ends[i], i++) {
		size_t wl = 0;
		for (size_t k = start; k < ends[i]; k++)
			wl += mapped_len(cps[k]);
		if (wl > longest)
			longest = wl;
	}
	word = malloc(longest);
	sym = malloc(longest * sizeof(*sym));
	if (!word || !sym) {
		rc = -ENOMEM;
		goto out;
	}
	for (size_t i = 0, start = 0; i < nw && !out->err; start = ends[i], i++) {
		size_t wl = 0;
		for (size_t k = start; k < ends[i]; k++) {
			char u[4];
			size_t un = nf_tok_utf8_encode(cps[k], u);
			for (size_t j = 0; j < un; j++)
				wl += nf_tok_utf8_encode(byte_to_cp((unsigned char)u[j]), word + wl);
		}
		bpe_word(t, word, wl, sym, &h, out);
	}
	rc = out->err;
out:
	free(h.v);
	free(sym);
	free(word);
	free(ends);
	free(cps);
	return rc;
}
