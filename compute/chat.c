/*
 * chat.c - chat template families: detection by substrings of the Jinja
 * text, and each family's prompt format written directly (no Jinja).
 *
 * Invariants: detection is a pure function of the template text, checked in
 * a fixed order (ChatML, then [INST] families, Phi-3, Zephyr, Gemma,
 * LLaMA-3) so that a template matching several heuristics always lands in
 * the same family; the formats follow llama.cpp's llama_chat_apply_template
 * output byte for byte for the families it shares (tests/test_compute_chat.c
 * holds its vectors).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/chat.h"
#include "nflash/error.h"

static const char *const family_names[NF_CHAT_N_FAMILIES] = {
	[NF_CHAT_UNKNOWN] = "unknown",
	[NF_CHAT_CHATML] = "chatml",
	[NF_CHAT_LLAMA2] = "llama2",
	[NF_CHAT_LLAMA2_SYS] = "llama2-sys",
	[NF_CHAT_LLAMA2_SYS_BOS] = "llama2-sys-bos",
	[NF_CHAT_LLAMA2_SYS_STRIP] = "llama2-sys-strip",
	[NF_CHAT_MISTRAL_V1] = "mistral-v1",
	[NF_CHAT_MISTRAL_V3] = "mistral-v3",
	[NF_CHAT_MISTRAL_V3_TEKKEN] = "mistral-v3-tekken",
	[NF_CHAT_MISTRAL_V7] = "mistral-v7",
	[NF_CHAT_LLAMA3] = "llama3",
	[NF_CHAT_ZEPHYR] = "zephyr",
	[NF_CHAT_GEMMA] = "gemma",
	[NF_CHAT_PHI3] = "phi3",
};

const char *nf_chat_family_name(enum nf_chat_family f)
{
	return (unsigned)f < NF_CHAT_N_FAMILIES ? family_names[f] : "unknown";
}

enum nf_chat_family nf_chat_family_parse(const char *name)
{
	if (!name)
		return NF_CHAT_UNKNOWN;
	for (int f = 1; f < NF_CHAT_N_FAMILIES; f++)
		if (!strcmp(name, family_names[f]))
			return (enum nf_chat_family)f;
	return NF_CHAT_UNKNOWN;
}

static bool has(const char *s, const char *what)
{
	return strstr(s, what) != NULL;
}

static enum nf_chat_family detect_inst(const char *t)
{
	if (has(t, "[SYSTEM_PROMPT]"))
		return NF_CHAT_MISTRAL_V7;
	/* mistralai's official v1 / v3 / v3-tekken templates */
	if (has(t, "' [INST] ' + system_message") || has(t, "[AVAILABLE_TOOLS]")) {
		if (has(t, " [INST]"))
			return NF_CHAT_MISTRAL_V1;
		if (has(t, "\"[INST]\""))
			return NF_CHAT_MISTRAL_V3_TEKKEN;
		return NF_CHAT_MISTRAL_V3;
	}
	/* LLaMA-2 and the templates derived from it */
	if (has(t, "content.strip()"))
		return NF_CHAT_LLAMA2_SYS_STRIP;
	if (has(t, "bos_token + '[INST]"))
		return NF_CHAT_LLAMA2_SYS_BOS;
	if (has(t, "<<SYS>>"))
		return NF_CHAT_LLAMA2_SYS;
	return NF_CHAT_LLAMA2;
}

enum nf_chat_family nf_chat_detect(const char *t)
{
	if (!t)
		return NF_CHAT_UNKNOWN;
	enum nf_chat_family named = nf_chat_family_parse(t);
	if (named != NF_CHAT_UNKNOWN)
		return named;
	if (has(t, "<|im_start|>"))
		return has(t, "<|im_sep|>") ? NF_CHAT_UNKNOWN : NF_CHAT_CHATML;   /* Phi-4 is not ChatML */
	if (!strncmp(t, "mistral", 7) || has(t, "[INST]"))
		return detect_inst(t);
	if (has(t, "<|assistant|>") && has(t, "<|end|>"))
		return NF_CHAT_PHI3;
	/* Zephyr closes every turn with the end-of-sequence token: written
	 * literally (<|endoftext|>, </s>) or as eos_token */
	if (has(t, "<|user|>") && has(t, "<|assistant|>") &&
	    (has(t, "<|endoftext|>") || has(t, "eos_token") || has(t, "</s>")))
		return NF_CHAT_ZEPHYR;
	if (has(t, "<|user|>") && has(t, "<|endoftext|>"))
		return NF_CHAT_ZEPHYR;
	if (has(t, "<start_of_turn>"))
		return NF_CHAT_GEMMA;
	if (has(t, "<|start_header_id|>") && has(t, "<|end_header_id|>"))
		return NF_CHAT_LLAMA3;
	return NF_CHAT_UNKNOWN;
}

/* ---- formats ------------------------------------------------------------ */

/* s without leading and trailing ASCII white space, as (pointer, length). */
static void trim(const char *s, const char **p, size_t *n)
{
	size_t b = 0, e = strlen(s);
	while (b < e && isspace((unsigned char)s[b]))
		b++;
	while (e > b && isspace((unsigned char)s[e - 1]))
		e--;
	*p = s + b;
	*n = e - b;
}

static void put_trimmed(FILE *f, const char *s)
{
	const char *p;
	size_t n;
	trim(s, &p, &n);
	fwrite(p, 1, n, f);
}

static bool is_role(const struct nf_chat_msg *m, const char *role)
{
	return !strcmp(m->role, role);
}

static void fmt_llama2(FILE *f, enum nf_chat_family fam, const struct nf_chat_msg *m, size_t n)
{
	bool sys = fam != NF_CHAT_LLAMA2, bos = fam == NF_CHAT_LLAMA2_SYS_BOS,
	     strip = fam == NF_CHAT_LLAMA2_SYS_STRIP;
	bool in_turn = true;    /* the first [INST] follows the BOS the tokenizer adds */
	fputs("[INST] ", f);
	for (size_t i = 0; i < n; i++) {
		if (!in_turn) {
			fputs(bos ? "<s>[INST] " : "[INST] ", f);
			in_turn = true;
		}
		const char *c = m[i].content;
		if (is_role(&m[i], "system"))
			fputs(sys ? "<<SYS>>\n" : "", f);
		if (strip)
			put_trimmed(f, c);
		else
			fputs(c, f);
		if (is_role(&m[i], "system")) {
			fputs(sys ? "\n<</SYS>>\n\n" : "\n", f);
		} else if (is_role(&m[i], "user")) {
			fputs(" [/INST]", f);
		} else {
			fputs("</s>", f);
			in_turn = false;
		}
	}
}

static void fmt_mistral(FILE *f, enum nf_chat_family fam, const struct nf_chat_msg *m, size_t n)
{
	const char *lead = fam == NF_CHAT_MISTRAL_V1 ? " " : "";
	const char *trail = fam == NF_CHAT_MISTRAL_V3_TEKKEN ? "" : " ";
	bool in_turn = false;
	for (size_t i = 0; i < n; i++) {
		if (!in_turn) {
			fprintf(f, "%s[INST]%s", lead, trail);
			in_turn = true;
		}
		if (is_role(&m[i], "system")) {
			fprintf(f, "%s\n\n", m[i].content);
		} else if (is_role(&m[i], "user")) {
			fprintf(f, "%s%s[/INST]", m[i].content, lead);
		} else {
			fputs(trail, f);
			if (fam == NF_CHAT_MISTRAL_V3)
				put_trimmed(f, m[i].content);
			else
				fputs(m[i].content, f);
			fputs("</s>", f);
			in_turn = false;
		}
	}
}

static void fmt_mistral_v7(FILE *f, const struct nf_chat_msg *m, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (is_role(&m[i], "system"))
			fprintf(f, "[SYSTEM_PROMPT] %s[/SYSTEM_PROMPT]", m[i].content);
		else if (is_role(&m[i], "user"))
			fprintf(f, "[INST] %s[/INST]", m[i].content);
		else
			fprintf(f, " %s</s>", m[i].content);
	}
}

/* Gemma has no system turn: the system text opens the next user turn. */
static void fmt_gemma(FILE *f, const struct nf_chat_msg *m, size_t n, bool add)
{
	const char *sys = NULL;
	for (size_t i = 0; i < n; i++) {
		if (is_role(&m[i], "system")) {
			sys = m[i].content;
			continue;
		}
		bool model = is_role(&m[i], "assistant");
		fprintf(f, "<start_of_turn>%s\n", model ? "model" : m[i].role);
		if (sys && !model) {
			const char *p;
			size_t len;
			trim(sys, &p, &len);
			if (len) {
				fwrite(p, 1, len, f);
				fputs("\n\n", f);
			}
			sys = NULL;
		}
		put_trimmed(f, m[i].content);
		fputs("<end_of_turn>\n", f);
	}
	if (add)
		fputs("<start_of_turn>model\n", f);
}

int nf_chat_apply(enum nf_chat_family fam, const struct nf_chat_msg *m, size_t n, bool add,
		  const char *eos, char **out, size_t *len)
{
	if ((unsigned)fam >= NF_CHAT_N_FAMILIES || fam == NF_CHAT_UNKNOWN || (n && !m) || !out || !len)
		return NF_EUSAGE;
	for (size_t i = 0; i < n; i++)
		if (!m[i].role || !m[i].content)
			return NF_EUSAGE;
	if (!eos)
		eos = "</s>";
	char *buf = NULL;
	size_t size = 0;
	FILE *f = open_memstream(&buf, &size);
	if (!f)
		return -ENOMEM;
	switch (fam) {
	case NF_CHAT_CHATML:
		for (size_t i = 0; i < n; i++)
			fprintf(f, "<|im_start|>%s\n%s<|im_end|>\n", m[i].role, m[i].content);
		if (add)
			fputs("<|im_start|>assistant\n", f);
		break;
	case NF_CHAT_LLAMA2:
	case NF_CHAT_LLAMA2_SYS:
	case NF_CHAT_LLAMA2_SYS_BOS:
	case NF_CHAT_LLAMA2_SYS_STRIP:
		fmt_llama2(f, fam, m, n);
		break;
	case NF_CHAT_MISTRAL_V1:
	case NF_CHAT_MISTRAL_V3:
	case NF_CHAT_MISTRAL_V3_TEKKEN:
		fmt_mistral(f, fam, m, n);
		break;
	case NF_CHAT_MISTRAL_V7:
		fmt_mistral_v7(f, m, n);
		break;
	case NF_CHAT_LLAMA3:
		for (size_t i = 0; i < n; i++) {
			fprintf(f, "<|start_header_id|>%s<|end_header_id|>\n\n", m[i].role);
			put_trimmed(f, m[i].content);
			fputs("<|eot_id|>", f);
		}
		if (add)
			fputs("<|start_header_id|>assistant<|end_header_id|>\n\n", f);
		break;
	case NF_CHAT_ZEPHYR:
		for (size_t i = 0; i < n; i++)
			fprintf(f, "<|%s|>\n%s%s\n", m[i].role, m[i].content, eos);
		if (add)
			fputs("<|assistant|>\n", f);
		break;
	case NF_CHAT_GEMMA:
		fmt_gemma(f, m, n, add);
		break;
	case NF_CHAT_PHI3:
		for (size_t i = 0; i < n; i++)
			fprintf(f, "<|%s|>\n%s<|end|>\n", m[i].role, m[i].content);
		if (add)
			fputs("<|assistant|>\n", f);
		break;
	default:
		break;
	}
	if (fclose(f) != 0 || !buf) {
		free(buf);
		return -ENOMEM;
	}
	*out = buf;
	*len = size;
	return 0;
}
