/*
 * tokenizer.c - vocabulary loading, special-token splitting, the shared merge
 * heap, and the detokenizer (token -> bytes). The merge algorithms live in
 * tok_spm.c and tok_bpe.c.
 *
 * Invariants:
 *  1. After nf_tok_open() everything is read-only; encode() allocates its
 *     own scratch, so concurrent calls are safe.
 *  2. Lookups follow llama.cpp: the text -> id map keeps the LAST id of a
 *     duplicated text, the merge map keeps the FIRST rank of a duplicated
 *     pair, and an empty token text is renamed "[EMPTY_<id>]".
 *  3. Every array read from the file (scores, token types) is checked to
 *     have one entry per token before use; special ids outside the
 *     vocabulary fall back to the default, then to -1.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_int.h"

/* ---- small containers --------------------------------------------------- */

void nf_tok_ids_push(struct nf_tok_ids *o, int32_t id)
{
	if (o->err)
		return;
	if (o->n == o->cap) {
		size_t cap = o->cap ? o->cap * 2 : 64;
		int32_t *v = realloc(o->v, cap * sizeof(*v));
		if (!v) {
			o->err = -ENOMEM;
			return;
		}
		o->v = v;
		o->cap = cap;
	}
	o->v[o->n++] = id;
}

static bool bigram_before(const struct nf_tok_bigram *a, const struct nf_tok_bigram *b)
{
	return a->key > b->key || (a->key == b->key && a->left < b->left);
}

void nf_tok_heap_push(struct nf_tok_heap *h, struct nf_tok_bigram b)
{
	if (h->err)
		return;
	if (h->n == h->cap) {
		size_t cap = h->cap ? h->cap * 2 : 64;
		struct nf_tok_bigram *v = realloc(h->v, cap * sizeof(*v));
		if (!v) {
			h->err = -ENOMEM;
			return;
		}
		h->v = v;
		h->cap = cap;
	}
	size_t i = h->n++;
	while (i > 0) {
		size_t p = (i - 1) / 2;
		if (!bigram_before(&b, &h->v[p]))
			break;
		h->v[i] = h->v[p];
		i = p;
	}
	h->v[i] = b;
}

struct nf_tok_bigram nf_tok_heap_pop(struct nf_tok_heap *h)
{
	struct nf_tok_bigram top = h->v[0], last = h->v[--h->n];
	size_t i = 0;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= h->n)
			break;
		if (c + 1 < h->n && bigram_before(&h->v[c + 1], &h->v[c]))
			c++;
		if (!bigram_before(&h->v[c], &last))
			break;
		h->v[i] = h->v[c];
		i = c;
	}
	if (h->n)
		h->v[i] = last;
	return top;
}

int32_t nf_tok_merge_syms(const struct nf_tok *t, const char *text, size_t len,
			  struct nf_tok_sym *sym, struct nf_tok_heap *h, nf_tok_pair_fn pair)
{
	int32_t n_sym = 0;
	for (size_t off = 0; off < len; n_sym++) {
		size_t n = nf_tok_utf8_len((unsigned char)text[off]);
		if (n > len - off)
			n = len - off;
		sym[n_sym] = (struct nf_tok_sym){ text + off, n, n_sym - 1, off + n == len ? -1 : n_sym + 1 };
		off += n;
	}
	h->n = 0;
	for (int32_t i = 1; i < n_sym; i++)
		pair(t, sym, h, i - 1, i);
	while (h->n && !h->err) {
		struct nf_tok_bigram bg = nf_tok_heap_pop(h);
		struct nf_tok_sym *l = &sym[bg.left], *r = &sym[bg.right];
		/* stale: a side was merged away or grew since the pair was pushed */
		if (l->n == 0 || r->n == 0 || l->n + r->n != bg.size)
			continue;
		l->n += r->n;
		r->n = 0;
		l->next = r->next;
		if (r->next >= 0)
			sym[r->next].prev = bg.left;
		pair(t, sym, h, l->prev, bg.left);
		pair(t, sym, h, bg.left, l->next);
	}
	return n_sym;
}

static uint64_t hash_mem(const void *p, size_t n, uint64_t h)
{
	const unsigned char *s = p;
	for (size_t i = 0; i < n; i++)
		h = (h ^ s[i]) * 1099511628211ull;
	return h;
}
#define HASH_SEED 1469598103934665603ull

static size_t slots_for(size_t n)
{
	size_t s = 16;
	while (s < 2 * n)
		s <<= 1;
	return s;
}

int32_t nf_tok_lookup(const struct nf_tok *t, const char *s, size_t n)
{
	for (size_t h = hash_mem(s, n, HASH_SEED) & t->map_mask;; h = (h + 1) & t->map_mask) {
		uint32_t e = t->map[h];
		if (!e)
			return -1;
		if (t->len[e - 1] == n && !memcmp(t->text[e - 1], s, n))
			return (int32_t)(e - 1);
	}
}

static uint64_t merge_hash(const char *a, size_t an, const char *b, size_t bn)
{
	uint64_t h = hash_mem(a, an, HASH_SEED);
	h = (h ^ 0x1ff) * 1099511628211ull;   /* separator no byte can equal */
	return hash_mem(b, bn, h);
}

int32_t nf_tok_merge_rank(const struct nf_tok *t, const char *a, size_t an, const char *b, size_t bn)
{
	if (!t->mmap)
		return -1;
	for (size_t h = merge_hash(a, an, b, bn) & t->mmap_mask;; h = (h + 1) & t->mmap_mask) {
		uint32_t e = t->mmap[h];
		if (!e)
			return -1;
		const struct nf_tok_merge *m = &t->merges[e - 1];
		if (m->alen == an && m->blen == bn && !memcmp(m->a, a, an) && !memcmp(m->b, b, bn))
			return (int32_t)(e - 1);
	}
}

/* ---- loading ------------------------------------------------------------ */

static int get_array(const struct nf_gguf *g, const char *key, bool required, uint64_t n_expect,
		     const struct nf_gguf_kv **out, struct nf_diag *d)
{
	const struct nf_gguf_kv *kv = NULL;
	int rc = nf_gguf_get_arr(g, key, &kv);
	*out = NULL;
	if (rc == NF_ENOTFOUND && !required)
		return 0;
	if (rc == NF_ENOTFOUND)
		return nf_diag_fail(d, NF_ENOTFOUND, "%s: key %s is missing", nf_gguf_path(g), key);
	if (rc < 0)
		return nf_diag_fail(d, NF_EFORMAT, "%s: key %s is not an array", nf_gguf_path(g), key);
	if (n_expect != UINT64_MAX && kv->arr_n != n_expect)
		return nf_diag_fail(d, NF_EFORMAT, "%s: key %s has %" PRIu64 " entries, expected %" PRIu64
				    " (one per token)", nf_gguf_path(g), key, kv->arr_n, n_expect);
	*out = kv;
	return 0;
}

static bool is_int_type(uint32_t t)
{
	return t == NF_GGUF_UINT8 || t == NF_GGUF_INT8 || t == NF_GGUF_UINT16 || t == NF_GGUF_INT16 ||
	       t == NF_GGUF_UINT32 || t == NF_GGUF_INT32 || t == NF_GGUF_UINT64 || t == NF_GGUF_INT64;
}

/* A special id key: keep dflt if absent or out of range; -1 if dflt is out of range too. */
static int32_t special_id(const struct nf_gguf *g, const char *key, int32_t dflt, uint32_t n_vocab)
{
	uint32_t v;
	if (nf_gguf_get_u32(g, key, &v) == 0 && v < n_vocab)
		return (int32_t)v;
	return dflt >= 0 && (uint32_t)dflt < n_vocab ? dflt : -1;
}

static bool get_flag(const struct nf_gguf *g, const char *key, bool dflt)
{
	bool b;
	return nf_gguf_get_bool(g, key, &b) == 0 ? b : dflt;
}

/* Pre-tokenizer names llama.cpp maps to the Llama 3 regex; the first four
 * also take a word that is a token whole (ignore_merges) and add BOS. */
static int pre_llama3(const char *pre)
{
	static const char *const names[] = { "llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe" };
	for (int i = 0; i < (int)(sizeof(names) / sizeof(names[0])); i++)
		if (!strcmp(pre, names[i]))
			return i < 4 ? 2 : 1;
	return 0;
}

/* Pre-tokenizer names llama.cpp maps to the GPT-2 regex. */
static bool pre_is_gpt2(const char *pre)
{
	static const char *const names[] = {
		"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
		"a.x-4.0", "mellum", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo",
		"jais", "exaone4",
	};
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!strcmp(pre, names[i]))
			return true;
	return false;
}

static int load_tokens(struct nf_tok *t, const struct nf_gguf *g, const struct nf_gguf_kv *toks,
		       const struct nf_gguf_kv *scores, const struct nf_gguf_kv *types, struct nf_diag *d)
{
	uint32_t n = t->n_vocab;
	size_t bytes = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t len;
		nf_gguf_arr_str(toks, i, &len);
		bytes += (len ? len : 24) + 1;
	}
	t->text = calloc(n, sizeof(*t->text));
	t->len = calloc(n, sizeof(*t->len));
	t->score = calloc(n, sizeof(*t->score));
	t->attr = calloc(n, sizeof(*t->attr));
	t->eog = calloc(n, sizeof(*t->eog));
	t->text_mem = malloc(bytes);
	t->map_mask = slots_for(n) - 1;
	t->map = calloc(t->map_mask + 1, sizeof(*t->map));
	if (!t->text || !t->len || !t->score || !t->attr || !t->eog || !t->text_mem || !t->map)
		return nf_diag_fail(d, -ENOMEM, "%s: out of memory for the vocabulary", nf_gguf_path(g));
	char *p = t->text_mem;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t len;
		const char *s = nf_gguf_arr_str(toks, i, &len);
		if (len > UINT32_MAX)
			return nf_diag_fail(d, NF_EFORMAT, "%s: token %" PRIu32 " is too long", nf_gguf_path(g), i);
		if (len == 0)
			len = (uint64_t)sprintf(p, "[EMPTY_%" PRIu32 "]", i);
		else
			memcpy(p, s, (size_t)len);
		p[len] = '\0';
		t->text[i] = p;
		t->len[i] = (uint32_t)len;
		p += len + 1;
		t->score[i] = scores ? nf_gguf_arr_f32(scores, i) : 0.0f;
		int64_t ty = types ? nf_gguf_arr_i64(types, i) : NF_TOK_NORMAL;
		t->attr[i] = (ty >= NF_TOK_NORMAL && ty <= NF_TOK_BYTE) ? (uint8_t)ty : NF_TOK_UNDEFINED;
		size_t h = hash_mem(t->text[i], len, HASH_SEED) & t->map_mask;
		for (;; h = (h + 1) & t->map_mask) {
			uint32_t e = t->map[h];
			if (!e || (t->len[e - 1] == len && !memcmp(t->text[e - 1], t->text[i], len)))
				break;
		}
		t->map[h] = i + 1;
	}
	return 0;
}

static int load_merges(struct nf_tok *t, const struct nf_gguf *g, const struct nf_gguf_kv *kv,
		       struct nf_diag *d)
{
	size_t n = (size_t)kv->arr_n, bytes = 0;
	for (size_t i = 0; i < n; i++) {
		uint64_t len;
		nf_gguf_arr_str(kv, i, &len);
		bytes += (size_t)len + 1;
	}
	t->merges = calloc(n ? n : 1, sizeof(*t->merges));
	t->merge_mem = malloc(bytes ? bytes : 1);
	t->mmap_mask = slots_for(n) - 1;
	t->mmap = calloc(t->mmap_mask + 1, sizeof(*t->mmap));
	if (!t->merges || !t->merge_mem || !t->mmap)
		return nf_diag_fail(d, -ENOMEM, "%s: out of memory for the merges", nf_gguf_path(g));
	if (n > INT32_MAX)
		return nf_diag_fail(d, NF_EFORMAT, "%s: too many merges", nf_gguf_path(g));
	char *p = t->merge_mem;
	for (size_t i = 0; i < n; i++) {
		uint64_t len;
		const char *s = nf_gguf_arr_str(kv, i, &len);
		memcpy(p, s, (size_t)len);
		p[len] = '\0';
		/* split at the first space after the first byte; none: an empty pair */
		const char *sp = len > 1 ? memchr(p + 1, ' ', (size_t)len - 1) : NULL;
		struct nf_tok_merge *m = &t->merges[i];
		if (sp) {
			m->a = p;
			m->alen = (uint32_t)(sp - p);
			m->b = sp + 1;
			m->blen = (uint32_t)(len - m->alen - 1);
		} else {
			m->a = m->b = p + len;
			m->alen = m->blen = 0;
		}
		p += len + 1;
		size_t h = merge_hash(m->a, m->alen, m->b, m->blen) & t->mmap_mask;
		bool dup = false;
		for (;; h = (h + 1) & t->mmap_mask) {
			uint32_t e = t->mmap[h];
			if (!e)
				break;
			const struct nf_tok_merge *o = &t->merges[e - 1];
			if (o->alen == m->alen && o->blen == m->blen && !memcmp(o->a, m->a, m->alen) &&
			    !memcmp(o->b, m->b, m->blen)) {
				dup = true;
				break;
			}
		}
		if (!dup)
			t->mmap[h] = (uint32_t)i + 1;
	}
	t->n_merges = n;
	return 0;
}

static int cmp_special(const void *x, const void *y, void *arg)
{
	const struct nf_tok *t = arg;
	int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
	if (t->len[a] != t->len[b])
		return t->len[a] > t->len[b] ? -1 : 1;
	return a < b ? -1 : a > b;
}

#define BAR "\xef\xbd\x9c"  /* U+FF5C, DeepSeek's fullwidth bar */
#define SPU "\xe2\x96\x81"  /* U+2581 */

static void find_special(struct nf_tok *t)
{
	/*
	 * Texts llama.cpp recognises as end-of-turn, end-of-generation and
	 * fill-in-the-middle tokens: it forces them to control type (so they
	 * are split out of text only with parse_special), and the first group
	 * ends generation.
	 */
	static const char *const eog_texts[] = {
		"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
		"<|eom_id|>", "<EOT>", "<" BAR "end" SPU "of" SPU "sentence" BAR ">",
		"<|fim_pad|>", "<fim-pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
		"<REPO>", "<|file_sep|>",
	};
	static const char *const fim_texts[] = {
		"<|fim_prefix|>", "<fim-prefix>", "<" BAR "fim" SPU "begin" BAR ">", "<PRE>",
		"<|fim_suffix|>", "<fim-suffix>", "<" BAR "fim" SPU "hole" BAR ">", "<SUF>",
		"<|fim_middle|>", "<fim-middle>", "<" BAR "fim" SPU "end" BAR ">", "<MID>",
	};
	for (size_t k = 0; k < sizeof(eog_texts) / sizeof(eog_texts[0]); k++) {
		int32_t id = nf_tok_lookup(t, eog_texts[k], strlen(eog_texts[k]));
		if (id >= 0) {
			t->eog[id] = true;
			t->attr[id] = NF_TOK_CONTROL;
		}
	}
	for (size_t k = 0; k < sizeof(fim_texts) / sizeof(fim_texts[0]); k++) {
		int32_t id = nf_tok_lookup(t, fim_texts[k], strlen(fim_texts[k]));
		if (id >= 0)
			t->attr[id] = NF_TOK_CONTROL;
	}
	if (t->eos >= 0)
		t->eog[t->eos] = true;
	t->n_special = 0;
	for (uint32_t i = 0; i < t->n_vocab; i++)
		if (t->attr[i] == NF_TOK_CONTROL || t->attr[i] == NF_TOK_USER_DEFINED ||
		    t->attr[i] == NF_TOK_UNKNOWN)
			t->special[t->n_special++] = (int32_t)i;
	qsort_r(t->special, t->n_special, sizeof(*t->special), cmp_special, t);
}

int nf_tok_open(const struct nf_gguf *g, struct nf_tok **out, struct nf_diag *diag)
{
	const char *path = nf_gguf_path(g), *model, *pre = NULL;
	const struct nf_gguf_kv *toks, *scores, *types, *merges = NULL;
	int rc;

	rc = nf_gguf_get_str(g, "tokenizer.ggml.model", &model);
	if (rc == NF_ENOTFOUND)
		return nf_diag_fail(diag, rc, "%s: key tokenizer.ggml.model is missing: the file has no vocabulary", path);
	if (rc < 0)
		return nf_diag_fail(diag, NF_EFORMAT, "%s: key tokenizer.ggml.model is not a string", path);
	struct nf_tok *t = calloc(1, sizeof(*t));
	if (!t)
		return nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
	if (!strcmp(model, "llama")) {
		t->kind = NF_TOK_SPM;
	} else if (!strcmp(model, "gpt2")) {
		t->kind = NF_TOK_BPE;
		int l3 = 0;
		if (nf_gguf_get_str(g, "tokenizer.ggml.pre", &pre) < 0 ||
		    (!pre_is_gpt2(pre) && !(l3 = pre_llama3(pre)))) {
			rc = nf_diag_fail(diag, NF_EUNSUPPORTED,
					  "%s: tokenizer.ggml.pre '%s' is not supported (nflash implements the GPT-2 pre-tokenizer: gpt-2, phi-2, mpt, olmo, ..., and Llama 3's: llama-bpe, llama3, falcon3, dbrx, smaug-bpe)",
					  path, pre ? pre : "(missing)");
			goto fail;
		}
		t->pre = l3 ? NF_TOK_PRE_LLAMA3 : NF_TOK_PRE_GPT2;
		t->ignore_merges = l3 == 2;
	} else {
		rc = nf_diag_fail(diag, NF_EUNSUPPORTED,
				  "%s: tokenizer.ggml.model '%s' is not supported (nflash reads llama and gpt2)",
				  path, model);
		goto fail;
	}
	if ((rc = get_array(g, "tokenizer.ggml.tokens", true, UINT64_MAX, &toks, diag)) < 0)
		goto fail;
	if (toks->arr_type != NF_GGUF_STRING || toks->arr_n == 0 || toks->arr_n > INT32_MAX) {
		rc = nf_diag_fail(diag, NF_EFORMAT, "%s: key tokenizer.ggml.tokens must be 1..2^31-1 strings",
				  path);
		goto fail;
	}
	t->n_vocab = (uint32_t)toks->arr_n;
	if ((rc = get_array(g, "tokenizer.ggml.scores", false, t->n_vocab, &scores, diag)) < 0 ||
	    (rc = get_array(g, "tokenizer.ggml.token_type", false, t->n_vocab, &types, diag)) < 0)
		goto fail;
	if (scores && scores->arr_type != NF_GGUF_FLOAT32 && scores->arr_type != NF_GGUF_FLOAT64) {
		rc = nf_diag_fail(diag, NF_EFORMAT, "%s: key tokenizer.ggml.scores is not an array of floats", path);
		goto fail;
	}
	if (types && !is_int_type(types->arr_type)) {
		rc = nf_diag_fail(diag, NF_EFORMAT, "%s: key tokenizer.ggml.token_type is not an array of integers", path);
		goto fail;
	}
	if (t->kind == NF_TOK_BPE) {
		if ((rc = get_array(g, "tokenizer.ggml.merges", true, UINT64_MAX, &merges, diag)) < 0)
			goto fail;
		if (merges->arr_type != NF_GGUF_STRING) {
			rc = nf_diag_fail(diag, NF_EFORMAT, "%s: key tokenizer.ggml.merges is not an array of strings", path);
			goto fail;
		}
	}
	if ((rc = load_tokens(t, g, toks, scores, types, diag)) < 0)
		goto fail;
	if (merges && (rc = load_merges(t, g, merges, diag)) < 0)
		goto fail;

	bool spm = t->kind == NF_TOK_SPM;
	t->bos = special_id(g, "tokenizer.ggml.bos_token_id", spm ? 1 : 11, t->n_vocab);
	t->eos = special_id(g, "tokenizer.ggml.eos_token_id", spm ? 2 : 11, t->n_vocab);
	t->unk = special_id(g, "tokenizer.ggml.unknown_token_id", spm ? 0 : -1, t->n_vocab);
	t->add_bos = get_flag(g, "tokenizer.ggml.add_bos_token", spm || t->ignore_merges);
	t->add_eos = get_flag(g, "tokenizer.ggml.add_eos_token", false);
	t->add_space_prefix = get_flag(g, "tokenizer.ggml.add_space_prefix", spm);
	for (int b = 0; b < 256; b++) {
		char hex[8];
		snprintf(hex, sizeof(hex), "<0x%02X>", b);
		char one = (char)b;
		t->byte_tok[b] = nf_tok_lookup(t, hex, 6);
		if (t->byte_tok[b] < 0)
			t->byte_tok[b] = nf_tok_lookup(t, &one, 1);
	}
	t->special = malloc(t->n_vocab * sizeof(*t->special));
	if (!t->special) {
		rc = nf_diag_fail(diag, -ENOMEM, "%s: out of memory", path);
		goto fail;
	}
	find_special(t);
	*out = t;
	return 0;

fail:
	nf_tok_close(t);
	return rc;
}

void nf_tok_close(struct nf_tok *t)
{
	if (!t)
		return;
	free(t->text);
	free(t->len);
	free(t->score);
	free(t->attr);
	free(t->eog);
	free(t->text_mem);
	free(t->map);
	free(t->merges);
	free(t->merge_mem);
	free(t->mmap);
	free(t->special);
	free(t);
}

/* ---- encoding ----------------------------------------------------------- */

struct frag {
	int32_t id;      /* token, or -1 for raw text [off, off + len) */
	size_t off, len;
};

struct frags {
	struct frag *v;
	size_t n, cap;
};

static int frags_add(struct frags *f, int32_t id, size_t off, size_t len)
{
	if (f->n == f->cap) {
		size_t cap = f->cap ? f->cap * 2 : 16;
		struct frag *v = realloc(f->v, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		f->v = v;
		f->cap = cap;
	}
	f->v[f->n++] = (struct frag){ id, off, len };
	return 0;
}

/* Split raw fragments at every occurrence of each special token, longest first. */
static int partition(const struct nf_tok *t, const char *text, size_t len, bool parse_special,
		     struct frags *out)
{
	struct frags cur = {0}, next = {0};
	int rc = len ? frags_add(&cur, -1, 0, len) : 0;
	for (size_t k = 0; rc == 0 && k < t->n_special; k++) {
		int32_t id = t->special[k];
		if (!parse_special && t->attr[id] != NF_TOK_USER_DEFINED)
			continue;
		const char *s = t->text[id];
		size_t sl = t->len[id];
		next.n = 0;
		for (size_t i = 0; rc == 0 && i < cur.n; i++) {
			struct frag f = cur.v[i];
			if (f.id >= 0 || f.len < sl) {
				rc = frags_add(&next, f.id, f.off, f.len);
				continue;
			}
			size_t pos = f.off, end = f.off + f.len;
			const char *m;
			while (rc == 0 && pos < end && (m = memmem(text + pos, end - pos, s, sl))) {
				size_t at = (size_t)(m - text);
				if (at > pos)
					rc = frags_add(&next, -1, pos, at - pos);
				if (rc == 0)
					rc = frags_add(&next, id, 0, 0);
				pos = at + sl;
			}
			if (rc == 0 && pos < end)
				rc = frags_add(&next, -1, pos, end - pos);
		}
		struct frags tmp = cur;
		cur = next;
		next = tmp;
	}
	free(next.v);
	if (rc < 0) {
		free(cur.v);
		return rc;
	}
	*out = cur;
	return 0;
}

int nf_tok_encode(const struct nf_tok *t, const char *text, size_t len, unsigned flags,
		  int32_t *ids, size_t cap, size_t *n)
{
	struct frags fr = {0};
	struct nf_tok_ids o = {0};
	bool add = flags & NF_TOK_ADD_SPECIAL;
	int rc = partition(t, text, len, flags & NF_TOK_PARSE_SPECIAL, &fr);
	if (rc < 0)
		return rc;
	if (add && t->add_bos && t->bos >= 0)
		nf_tok_ids_push(&o, t->bos);
	bool prev_special = true;   /* SPM: a space goes before text that starts or follows a special token */
	for (size_t i = 0; rc == 0 && i < fr.n; i++) {
		const struct frag *f = &fr.v[i];
		if (f->id >= 0) {
			nf_tok_ids_push(&o, f->id);
			prev_special = true;
		} else if (t->kind == NF_TOK_SPM) {
			rc = nf_tok_spm_encode(t, text + f->off, f->len, t->add_space_prefix && prev_special, &o);
			prev_special = false;
		} else {
			rc = nf_tok_bpe_encode(t, text + f->off, f->len, &o);
		}
	}
	if (add && t->add_eos && t->eos >= 0)
		nf_tok_ids_push(&o, t->eos);
	if (rc == 0)
		rc = o.err;
	if (rc == 0) {
		*n = o.n;
		if (o.n > cap)
			rc = -ENOSPC;
		else if (o.n)
			memcpy(ids, o.v, o.n * sizeof(*ids));
	}
	free(o.v);
	free(fr.v);
	return rc;
}

/* ---- decoding ----------------------------------------------------------- */

static void put(char *buf, size_t cap, size_t *pos, const void *p, size_t n)
{
	if (*pos < cap)
		memcpy(buf + *pos, p, n < cap - *pos ? n : cap - *pos);
	*pos += n;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9') return c - '0';
	if (c >= 'a' && c <= 'f') return c - 'a' + 10;
	if (c >= 'A' && c <= 'F') return c - 'A' + 10;
	return -1;
}

int nf_tok_piece(const struct nf_tok *t, int32_t id, bool special, char *buf, size_t cap)
{
	if (id < 0 || (uint32_t)id >= t->n_vocab)
		return NF_EUSAGE;
	const char *s = t->text[id];
	size_t len = t->len[id], pos = 0;
	int attr = t->attr[id];
	if (attr == NF_TOK_UNKNOWN || attr == NF_TOK_CONTROL)
		return special ? (put(buf, cap, &pos, s, len), (int)pos) : 0;
	if (attr == NF_TOK_USER_DEFINED) {
		put(buf, cap, &pos, s, len);
	} else if (attr == NF_TOK_BYTE && t->kind == NF_TOK_SPM) {
		/* "<0xNN>" */
		int hi = len >= 5 ? hexval(s[3]) : -1, lo = len >= 5 ? hexval(s[4]) : -1;
		unsigned char b = (unsigned char)((hi < 0 || lo < 0) ? 0 : hi * 16 + lo);
		put(buf, cap, &pos, &b, 1);
	} else if (attr == NF_TOK_NORMAL && t->kind == NF_TOK_SPM) {
		for (size_t i = 0; i < len;) {
			if (i + 3 <= len && !memcmp(s + i, "\xe2\x96\x81", 3)) {
				put(buf, cap, &pos, " ", 1);
				i += 3;
			} else {
				put(buf, cap, &pos, s + i, 1);
				i++;
			}
		}
	} else if (attr == NF_TOK_NORMAL) {
		/* BPE: each code point of the byte-level alphabet stands for one byte */
		for (size_t i = 0; i < len;) {
			uint32_t cp;
			i += nf_tok_utf8_decode(s + i, len - i, &cp);
			int b = nf_tok_bpe_cp_to_byte(cp);
			if (b >= 0) {
				unsigned char c = (unsigned char)b;
				put(buf, cap, &pos, &c, 1);
				continue;
			}
			/* as llama.cpp: [UNK_BYTE_0x<its UTF-8 in hex><token text>] */
			char u[4], hex[9];
			size_t un = nf_tok_utf8_encode(cp, u), hn = 0;
			for (size_t k = 0; k < un; k++)
				hn += (size_t)snprintf(hex + hn, sizeof(hex) - hn, "%02x", (unsigned char)u[k]);
			put(buf, cap, &pos, "[UNK_BYTE_0x", 12);
			put(buf, cap, &pos, hex, hn);
			put(buf, cap, &pos, s, len);
			put(buf, cap, &pos, "]", 1);
		}
	} else if (attr == NF_TOK_BYTE) {
		/* BPE byte token: its one code point's byte */
		uint32_t cp;
		nf_tok_utf8_decode(s, len, &cp);
		int b = nf_tok_bpe_cp_to_byte(cp);
		if (b >= 0) {
			unsigned char c = (unsigned char)b;
			put(buf, cap, &pos, &c, 1);
		}
	}
	return pos > INT32_MAX ? INT32_MAX : (int)pos;
}

/* ---- accessors ---------------------------------------------------------- */

const char *nf_tok_text(const struct nf_tok *t, int32_t id)
{
	return id >= 0 && (uint32_t)id < t->n_vocab ? t->text[id] : NULL;
}

int nf_tok_attr(const struct nf_tok *t, int32_t id)
{
	return id >= 0 && (uint32_t)id < t->n_vocab ? t->attr[id] : NF_TOK_UNDEFINED;
}

enum nf_tok_kind nf_tok_kind(const struct nf_tok *t) { return t->kind; }
uint32_t nf_tok_n_vocab(const struct nf_tok *t) { return t->n_vocab; }
int32_t nf_tok_bos(const struct nf_tok *t) { return t->bos; }
int32_t nf_tok_eos(const struct nf_tok *t) { return t->eos; }
bool nf_tok_add_bos(const struct nf_tok *t) { return t->add_bos; }

bool nf_tok_is_eog(const struct nf_tok *t, int32_t id)
{
	return id >= 0 && (uint32_t)id < t->n_vocab && t->eog[id];
}
