/*
 * test_compute_tokenizer.c - the tokenizers against llama.cpp's own cases
 * (../shared/testdata/vocab/NAME.gguf.inp/.out, ids without BOS), the
 * detokenizer (pieces concatenate back to the text), special tokens, and
 * vocabularies with bad keys.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/gguf.h"
#include "nflash/tokenizer.h"

#define VOCAB "../shared/testdata/vocab/"

static char *slurp(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f, "open %s", path);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *p = malloc((size_t)n + 1);
	cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
	p[n] = '\0';
	fclose(f);
	*len = (size_t)n;
	return p;
}

static struct nf_tok *open_tok(const char *path, struct nf_gguf **gout)
{
	struct nf_gguf *g;
	struct nf_tok *t;
	struct nf_diag d = {0};
	int rc = nf_gguf_open(path, 0, &g, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	rc = nf_tok_open(g, &t, &d);
	cr_assert_eq(rc, 0, "%s", nf_diag_msg(&d, rc));
	if (gout)
		*gout = g;
	else
		nf_gguf_close(g);
	return t;
}

/* Encode without specials into a fresh array; *n gets the count. */
static int32_t *encode(const struct nf_tok *t, const char *s, size_t len, unsigned flags, size_t *n)
{
	size_t cap = len * 2 + 8;
	int32_t *ids = malloc(cap * sizeof(*ids));
	int rc = nf_tok_encode(t, s, len, flags, ids, cap, n);
	cr_assert_eq(rc, 0, "encode rc %d", rc);
	return ids;
}

/* Concatenate the pieces of ids. */
static char *decode(const struct nf_tok *t, const int32_t *ids, size_t n, size_t *len)
{
	size_t cap = 64, pos = 0;
	char *out = malloc(cap);
	for (size_t i = 0; i < n; i++) {
		int k = nf_tok_piece(t, ids[i], false, NULL, 0);
		cr_assert_geq(k, 0);
		if (pos + (size_t)k + 1 > cap) {
			cap = (pos + (size_t)k + 1) * 2;
			out = realloc(out, cap);
		}
		cr_assert_eq(nf_tok_piece(t, ids[i], false, out + pos, (size_t)k), k);
		pos += (size_t)k;
	}
	out[pos] = '\0';
	*len = pos;
	return out;
}

/* The cases of ipath (texts between separators) against the ids of opath's
 * lines, with the vocabulary at path. */
static void run_cases_at(const char *name, const char *path, const char *ipath, const char *opath, int n_cases)
{
	struct nf_tok *t = open_tok(path, NULL);
	size_t ilen, olen;
	char *inp = slurp(ipath, &ilen), *outs = slurp(opath, &olen);
	static const char sep[] = "\n__ggml_vocab_test__\n";
	char *p = inp, *line = outs;
	int cases = 0, failed = 0;
	for (char *s; (s = strstr(p, sep)); p = s + strlen(sep), cases++) {
		size_t len = (size_t)(s - p);
		char *eol = strchr(line, '\n');
		cr_assert(eol, "%s: fewer lines than cases", opath);
		*eol = '\0';
		/* expected ids */
		int32_t want[1024];
		size_t nw = 0;
		for (char *q = line; *q;) {
			char *end;
			long v = strtol(q, &end, 10);
			if (end == q)
				break;
			want[nw++] = (int32_t)v;
			q = end;
		}
		size_t n;
		int32_t *got = encode(t, p, len, 0, &n);
		bool same = n == nw && !memcmp(got, want, n * sizeof(*got));
		if (!same) {
			failed++;
			fprintf(stderr, "%s case %d '%.*s':\n  want%s\n  got ", name, cases, (int)len, p, line);
			for (size_t i = 0; i < n; i++)
				fprintf(stderr, " %d", got[i]);
			fprintf(stderr, "\n");
		}
		/* pieces give the text back (SPM: behind the added space) */
		size_t dl;
		char *dec = decode(t, got, n, &dl);
		bool spm = nf_tok_kind(t) == NF_TOK_SPM;
		size_t skip = spm && len ? 1 : 0;
		cr_assert_eq(dl, len + skip, "%s case %d: decoded %zu bytes, want %zu", name, cases, dl, len + skip);
		cr_assert_eq(memcmp(dec + skip, p, len), 0, "%s case %d: decoded text differs", name, cases);
		free(dec);
		free(got);
		line = eol + 1;
	}
	cr_assert_eq(cases, n_cases, "%s: %d cases", name, cases);
	cr_assert_eq(failed, 0, "%s: %d of %d cases differ (see stderr)", name, failed, cases);
	free(inp);
	free(outs);
	nf_tok_close(t);
}

static void run_cases(const char *name)
{
	char path[256], ipath[300], opath[300];
	snprintf(path, sizeof(path), VOCAB "%s", name);
	snprintf(ipath, sizeof(ipath), "%s.inp", path);
	snprintf(opath, sizeof(opath), "%s.out", path);
	run_cases_at(name, path, ipath, opath, 46);
}

Test(tokenizer, llama_spm_cases) { run_cases("ggml-vocab-llama-spm.gguf"); }
Test(tokenizer, gpt2_bpe_cases) { run_cases("ggml-vocab-gpt-2.gguf"); }

/*
 * Llama 3's pre-tokenizer (tokenizer.ggml.pre "llama-bpe"): the GPT-2
 * vocabulary with that name, as llama.cpp tokenizes it (digits in threes,
 * case-insensitive contractions, a letter run taking one leading non-letter,
 * newlines kept with the whitespace before them, a word that is a token
 * taken whole). tests/peer/llama3-pre.inp/.out: 210 texts and llama.cpp's
 * ids for them on this file (tests/peer/README.md).
 */
Test(tokenizer, llama3_pre_cases)
{
	struct nf_gguf *g;
	cr_assert_eq(nf_gguf_open(VOCAB "ggml-vocab-gpt-2.gguf", 0, &g, NULL), 0);
	char path[] = "/tmp/nf-tok-l3-XXXXXX";
	int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	close(fd);
	struct nf_gguf_writer *w;
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, NULL), 0);
	for (size_t i = 0; i < nf_gguf_n_kv(g); i++) {
		const struct nf_gguf_kv *kv = nf_gguf_kv_at(g, i);
		if (strcmp(kv->key, "tokenizer.ggml.pre"))
			cr_assert_eq(nf_gguf_writer_kv_copy(w, kv), 0);
		else
			cr_assert_eq(nf_gguf_writer_kv_str(w, kv->key, "llama-bpe"), 0);
	}
	cr_assert_eq(nf_gguf_writer_finish(w, NULL), 0);
	nf_gguf_close(g);
	struct nf_tok *t = open_tok(path, NULL);
	cr_assert(nf_tok_add_bos(t), "llama-bpe adds BOS unless the file says otherwise");
	nf_tok_close(t);
	run_cases_at("llama-bpe", path, "tests/peer/llama3-pre.inp", "tests/peer/llama3-pre.out", 210);
	unlink(path);
}

Test(tokenizer, vocab_metadata_and_specials)
{
	struct nf_tok *t = open_tok(VOCAB "ggml-vocab-llama-spm.gguf", NULL);
	cr_assert_eq(nf_tok_kind(t), NF_TOK_SPM);
	cr_assert_eq(nf_tok_n_vocab(t), 32000);
	cr_assert_eq(nf_tok_bos(t), 1);
	cr_assert_eq(nf_tok_eos(t), 2);
	cr_assert(nf_tok_add_bos(t));
	cr_assert(nf_tok_is_eog(t, 2));
	cr_assert(!nf_tok_is_eog(t, 1));
	cr_assert_str_eq(nf_tok_text(t, 1), "<s>");
	cr_assert_null(nf_tok_text(t, 32000));
	cr_assert_eq(nf_tok_attr(t, 1), NF_TOK_CONTROL);
	cr_assert_eq(nf_tok_attr(t, 13), NF_TOK_BYTE);

	size_t n;
	int32_t *ids = encode(t, "Hello world", 11, NF_TOK_ADD_SPECIAL, &n);
	cr_assert(n == 3 && ids[0] == 1 && ids[1] == 15043 && ids[2] == 3186);
	free(ids);
	/* control text stays text unless asked */
	ids = encode(t, "<s>Hi", 5, 0, &n);
	cr_assert_gt(n, 2);
	cr_assert_neq(ids[0], 1);
	free(ids);
	ids = encode(t, "<s>Hello", 8, NF_TOK_PARSE_SPECIAL, &n);
	cr_assert(n == 2 && ids[0] == 1 && ids[1] == 15043, "n %zu", n);   /* space prefix after a special */
	free(ids);
	/* too small a buffer: -ENOSPC and the size needed */
	int32_t small[1];
	cr_assert_eq(nf_tok_encode(t, "Hello world", 11, 0, small, 1, &n), -ENOSPC);
	cr_assert_eq(n, 2);
	/* pieces */
	char buf[16];
	cr_assert_eq(nf_tok_piece(t, 1, false, buf, sizeof(buf)), 0);
	cr_assert_eq(nf_tok_piece(t, 1, true, buf, sizeof(buf)), 3);
	cr_assert_eq(memcmp(buf, "<s>", 3), 0);
	cr_assert_eq(nf_tok_piece(t, 13, false, buf, sizeof(buf)), 1);
	cr_assert_eq(buf[0], '\n');
	cr_assert_eq(nf_tok_piece(t, 15043, false, buf, 3), 6);   /* " Hello", cut at 3 */
	cr_assert_eq(memcmp(buf, " He", 3), 0);
	cr_assert_eq(nf_tok_piece(t, -1, false, buf, 3), NF_EUSAGE);
	nf_tok_close(t);

	t = open_tok(VOCAB "ggml-vocab-gpt-2.gguf", NULL);
	cr_assert_eq(nf_tok_kind(t), NF_TOK_BPE);
	cr_assert_eq(nf_tok_n_vocab(t), 50257);
	cr_assert_eq(nf_tok_bos(t), 50256);
	cr_assert(!nf_tok_add_bos(t));
	cr_assert(nf_tok_is_eog(t, 50256));
	ids = encode(t, "Hello<|endoftext|>", 18, NF_TOK_ADD_SPECIAL | NF_TOK_PARSE_SPECIAL, &n);
	cr_assert(n == 2 && ids[0] == 15496 && ids[1] == 50256, "n %zu", n);
	free(ids);
	cr_assert_eq(nf_tok_piece(t, 220, false, buf, sizeof(buf)), 1);
	cr_assert_eq(buf[0], ' ');
	cr_assert_eq(nf_tok_piece(t, 50256, false, buf, sizeof(buf)), 0);
	nf_tok_close(t);
}

/* Strict UTF-8 check (no overlongs, surrogates or code points past U+10FFFF). */
static bool utf8_valid(const unsigned char *s, size_t n)
{
	for (size_t i = 0; i < n;) {
		unsigned c = s[i];
		size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
		if (!k || i + k > n)
			return false;
		uint32_t cp = k == 1 ? c : c & (0x7f >> k);
		for (size_t j = 1; j < k; j++) {
			if ((s[i + j] & 0xc0) != 0x80)
				return false;
			cp = (cp << 6) | (s[i + j] & 0x3f);
		}
		static const uint32_t min[5] = { 0, 0, 0x80, 0x800, 0x10000 };
		if (cp < min[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			return false;
		i += k;
	}
	return true;
}

/* Pieces give back any valid UTF-8 text; any bytes at all encode to valid ids. */
Test(tokenizer, random_bytes_round_trip)
{
	const char *files[] = { VOCAB "ggml-vocab-llama-spm.gguf", VOCAB "ggml-vocab-gpt-2.gguf",
				"../shared/testdata/models/tiny-llama-q4_0.gguf" };
	static const char *alphabet[] = { "a", "Z", " ", "  ", "\n", "\t", "3", "'s", "'ll", "\xc3\xa9",
		"\xe2\x96\x81", "\xf0\x9f\x98\x81", "\xe4\xb8\xad", "\xff", "\xc3", "\x80", "!", "<s>",
		"\xc2\xa0", "\xe2\x80\x83", "\xd9\xa3", "\xc2\xbd", "\xf4\x90\x80\x80" };
	uint32_t seed = 7;
	for (size_t f = 0; f < 3; f++) {
		struct nf_tok *t = open_tok(files[f], NULL);
		for (int it = 0; it < 300; it++) {
			char s[256];
			size_t len = 0;
			int parts = 1 + (int)((seed = seed * 1103515245u + 12345u) >> 16) % 12;
			for (int k = 0; k < parts; k++) {
				seed = seed * 1103515245u + 12345u;
				const char *a = alphabet[(seed >> 16) % (sizeof(alphabet) / sizeof(alphabet[0]))];
				memcpy(s + len, a, strlen(a));
				len += strlen(a);
			}
			size_t n, dl;
			int32_t *ids = encode(t, s, len, 0, &n);
			for (size_t i = 0; i < n; i++)
				cr_assert(ids[i] >= 0 && (uint32_t)ids[i] < nf_tok_n_vocab(t));
			char *dec = decode(t, ids, n, &dl);
			bool spm = nf_tok_kind(t) == NF_TOK_SPM;
			/* invalid UTF-8 is not kept byte for byte, by llama.cpp either */
			if (!utf8_valid((const unsigned char *)s, len)) {
				free(dec);
				free(ids);
				continue;
			}
			if (spm) {
				/* U+2581 in the text comes back as the space it stands for */
				char want[256];
				size_t wl = 0;
				for (size_t i = 0; i < len; i++) {
					if (i + 3 <= len && !memcmp(s + i, "\xe2\x96\x81", 3)) {
						want[wl++] = ' ';
						i += 2;
					} else {
						want[wl++] = s[i];
					}
				}
				cr_assert(dl == wl + 1 && dec[0] == ' ' && !memcmp(dec + 1, want, wl),
					  "%s: '%.*s' came back as '%s'", files[f], (int)len, s, dec);
			} else {
				cr_assert(dl == len && !memcmp(dec, s, len), "'%.*s' came back as '%s'",
					  (int)len, s, dec);
			}
			free(dec);
			free(ids);
		}
		nf_tok_close(t);
	}
}

/* Arbitrary bytes and long texts: valid ids, nothing read out of bounds (ASan). */
Test(tokenizer, random_bytes_and_long_text)
{
	const char *files[] = { VOCAB "ggml-vocab-llama-spm.gguf", VOCAB "ggml-vocab-gpt-2.gguf" };
	uint32_t seed = 99;
	for (size_t f = 0; f < 2; f++) {
		struct nf_tok *t = open_tok(files[f], NULL);
		for (int it = 0; it < 500; it++) {
			char s[200];
			seed = seed * 1103515245u + 12345u;
			size_t len = (seed >> 16) % sizeof(s);
			for (size_t i = 0; i < len; i++) {
				seed = seed * 1103515245u + 12345u;
				s[i] = (char)(seed >> 24);
			}
			char *exact = malloc(len ? len : 1);   /* no slack for ASan */
			memcpy(exact, s, len);
			size_t n;
			int32_t *ids = encode(t, exact, len, NF_TOK_PARSE_SPECIAL, &n);
			for (size_t i = 0; i < n; i++)
				cr_assert(ids[i] >= 0 && (uint32_t)ids[i] < nf_tok_n_vocab(t));
			free(ids);
			free(exact);
		}
		/* every test case at once, 8 times over */
		char path[300];
		snprintf(path, sizeof(path), "%s.inp", files[f]);
		size_t il;
		char *inp = slurp(path, &il);
		char *big = malloc(il * 8);
		for (int k = 0; k < 8; k++)
			memcpy(big + k * il, inp, il);
		size_t n, dl;
		int32_t *ids = encode(t, big, il * 8, 0, &n);
		cr_assert_gt(n, il);
		char *dec = decode(t, ids, n, &dl);
		size_t skip = nf_tok_kind(t) == NF_TOK_SPM;
		cr_assert(dl == il * 8 + skip && !memcmp(dec + skip, big, il * 8));
		free(dec);
		free(ids);
		free(big);
		free(inp);
		nf_tok_close(t);
	}
}

/* The tiny models' toy vocabulary: 3 specials, 256 byte tokens, 61 pieces. */
Test(tokenizer, toy_vocab)
{
	struct nf_tok *t = open_tok("../shared/testdata/models/tiny-llama-f32.gguf", NULL);
	cr_assert_eq(nf_tok_n_vocab(t), 320);
	char buf[8];
	cr_assert_eq(nf_tok_piece(t, 3 + 'A', false, buf, sizeof(buf)), 1);
	cr_assert_eq(buf[0], 'A');
	size_t n;
	int32_t *ids = encode(t, "\x01", 1, NF_TOK_ADD_SPECIAL, &n);
	/* BOS, then the prefix space (a piece or its byte), then byte 0x01 */
	cr_assert_geq(n, 3);
	cr_assert_eq(ids[0], 1);
	cr_assert_eq(ids[n - 1], 3 + 1);
	free(ids);
	nf_tok_close(t);
}

/* A vocabulary-only file with the given keys; returns its path (caller unlinks). */
static char *write_vocab(const char *model, const char *pre, uint64_t n_scores, bool merges)
{
	char *path = strdup("/tmp/nf-tok-XXXXXX");
	int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	close(fd);
	struct nf_gguf_writer *w;
	cr_assert_eq(nf_gguf_writer_open(path, false, &w, NULL), 0);
	const char *toks[] = { "<unk>", "<s>", "</s>", "a", "b", "ab" };
	float sc[6] = { 0, 0, 0, -1, -1, -2 };
	if (model)
		nf_gguf_writer_kv_str(w, "tokenizer.ggml.model", model);
	if (pre)
		nf_gguf_writer_kv_str(w, "tokenizer.ggml.pre", pre);
	nf_gguf_writer_kv_arr_str(w, "tokenizer.ggml.tokens", toks, 6);
	nf_gguf_writer_kv_arr_f32(w, "tokenizer.ggml.scores", sc, n_scores);
	if (merges) {
		const char *m[] = { "a b" };
		nf_gguf_writer_kv_arr_str(w, "tokenizer.ggml.merges", m, 1);
	}
	cr_assert_eq(nf_gguf_writer_finish(w, NULL), 0);
	return path;
}

static void expect_open(const char *path, int code, const char *word)
{
	struct nf_gguf *g;
	struct nf_tok *t = NULL;
	struct nf_diag d = {0};
	cr_assert_eq(nf_gguf_open(path, 0, &g, NULL), 0);
	cr_assert_eq(nf_tok_open(g, &t, &d), code, "%s", d.msg);
	cr_assert(strstr(d.msg, path) && strstr(d.msg, word), "%s", d.msg);
	cr_assert_null(t);
	nf_gguf_close(g);
	unlink(path);
}

Test(tokenizer, bad_vocabularies)
{
	char *p;
	expect_open(p = write_vocab(NULL, NULL, 6, false), NF_ENOTFOUND, "tokenizer.ggml.model");
	free(p);
	expect_open(p = write_vocab("llama", NULL, 5, false), NF_EFORMAT, "tokenizer.ggml.scores");
	free(p);
	expect_open(p = write_vocab("bert", NULL, 6, false), NF_EUNSUPPORTED, "bert");
	free(p);
	expect_open(p = write_vocab("gpt2", "qwen2", 6, true), NF_EUNSUPPORTED, "qwen2");
	free(p);
	expect_open(p = write_vocab("gpt2", "gpt-2", 6, false), NF_ENOTFOUND, "tokenizer.ggml.merges");
	free(p);

	/* a minimal valid SPM and BPE vocabulary work */
	p = write_vocab("llama", NULL, 6, false);
	struct nf_gguf *g;
	struct nf_tok *t;
	cr_assert_eq(nf_gguf_open(p, 0, &g, NULL), 0);
	cr_assert_eq(nf_tok_open(g, &t, NULL), 0);
	nf_gguf_close(g);          /* the tokenizer keeps its own copy */
	int32_t ids[8];
	size_t n;
	cr_assert_eq(nf_tok_encode(t, "ab", 2, 0, ids, 8, &n), 0);
	/* no "\u2581" piece and no byte tokens: the prefix becomes 3 <unk> */
	cr_assert(n == 4 && ids[0] == 0 && ids[3] == 5, "n %zu", n);
	nf_tok_close(t);
	unlink(p);
	free(p);
	p = write_vocab("gpt2", "gpt-2", 6, true);
	cr_assert_eq(nf_gguf_open(p, 0, &g, NULL), 0);
	cr_assert_eq(nf_tok_open(g, &t, NULL), 0);
	cr_assert_eq(nf_tok_encode(t, "abba", 4, 0, ids, 8, &n), 0);
	cr_assert(n == 3 && ids[0] == 5 && ids[1] == 4 && ids[2] == 3, "n %zu", n);
	nf_tok_close(t);
	nf_gguf_close(g);
	unlink(p);
	free(p);
}

/* GPT-2's byte alphabet: a bijection of the 256 bytes onto code points below
 * U+0144, printable Latin-1 bytes mapped to themselves. */
Test(tokenizer, gpt2_byte_alphabet)
{
	struct nf_tok *t = open_tok(VOCAB "ggml-vocab-gpt-2.gguf", NULL);
	bool seen[256] = { false };
	/* tokens 0..255 of GPT-2 are the 256 single-byte symbols */
	for (int32_t id = 0; id < 256; id++) {
		char b[4];
		cr_assert_eq(nf_tok_piece(t, id, false, b, sizeof(b)), 1, "token %d", id);
		unsigned char c = (unsigned char)b[0];
		cr_assert(!seen[c], "byte %#x twice", c);
		seen[c] = true;
		const char *txt = nf_tok_text(t, id);
		if ((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || c >= 0xae) {
			char want[4] = {0};
			if (c < 0x80)
				want[0] = (char)c;
			else
				want[0] = (char)(0xc0 | (c >> 6)), want[1] = (char)(0x80 | (c & 0x3f));
			cr_assert_str_eq(txt, want);
		}
	}
	nf_tok_close(t);
}
