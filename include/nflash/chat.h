/*
 * nflash/chat.h - chat templates: turn a list of messages into the prompt
 * text a chat model was trained on.
 *
 * A GGUF stores its template as Jinja text (tokenizer.chat_template).
 * nflash does not run Jinja: nf_chat_detect() recognises the common
 * families by substrings of that text, as llama.cpp's
 * llama_chat_apply_template does, and nf_chat_apply() writes the family's
 * format directly. Families: ChatML, LLaMA-2 (and its variants with a
 * <<SYS>> block, a BOS inside the history, stripped messages), Mistral
 * (v1, v3, v3-tekken, v7), LLaMA-3, Zephyr, Gemma, Phi-3.
 *
 *	int fam = nf_chat_detect(template_text);      // NF_CHAT_UNKNOWN: not recognised
 *	struct nf_chat_msg m[] = { { "system", "Be brief." }, { "user", "Hi" } };
 *	char *prompt; size_t len;
 *	nf_chat_apply(fam, m, 2, true, "</s>", &prompt, &len);
 *	... tokenize prompt with NF_TOK_PARSE_SPECIAL ...
 *	free(prompt);
 *
 * The prompt carries no BOS: the tokenizer adds it (NF_TOK_ADD_SPECIAL).
 * Stateless and thread-safe.
 */
#ifndef NFLASH_CHAT_H
#define NFLASH_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum nf_chat_family {
	NF_CHAT_UNKNOWN = 0,
	NF_CHAT_CHATML,
	NF_CHAT_LLAMA2,            /* [INST] ... [/INST]; a system message is prefixed as text */
	NF_CHAT_LLAMA2_SYS,        /* with a <<SYS>> block */
	NF_CHAT_LLAMA2_SYS_BOS,    /* and <s> before each later [INST] */
	NF_CHAT_LLAMA2_SYS_STRIP,  /* and messages stripped of outer white space */
	NF_CHAT_MISTRAL_V1,
	NF_CHAT_MISTRAL_V3,
	NF_CHAT_MISTRAL_V3_TEKKEN,
	NF_CHAT_MISTRAL_V7,
	NF_CHAT_LLAMA3,
	NF_CHAT_ZEPHYR,
	NF_CHAT_GEMMA,
	NF_CHAT_PHI3,
	NF_CHAT_N_FAMILIES
};

/* One message. role is "system", "user" or "assistant" (any other role is
 * written as given by the families that spell roles out, and treated as
 * "assistant" by those that do not); content is UTF-8 text. */
struct nf_chat_msg {
	const char *role;
	const char *content;
};

/*
 * nf_chat_detect - the family of a Jinja chat template, by substrings of
 * its text (the same heuristics llama.cpp uses), or a family's name as
 * nf_chat_family_name() spells it. NF_CHAT_UNKNOWN when neither; NULL
 * gives NF_CHAT_UNKNOWN.
 */
enum nf_chat_family nf_chat_detect(const char *tmpl);

/* "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip",
 * "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7", "llama3",
 * "zephyr", "gemma", "phi3"; "unknown" for anything else. */
const char *nf_chat_family_name(enum nf_chat_family f);
/* The family named name (as above), or NF_CHAT_UNKNOWN. */
enum nf_chat_family nf_chat_family_parse(const char *name);

/*
 * nf_chat_apply - the prompt for n messages in family f's format; with
 * add_assistant, followed by the opening of the assistant's turn. eos is
 * the vocabulary's end-of-sequence text, used by the families whose
 * template writes eos_token (Zephyr; LLaMA-2 and Mistral write "</s>" as
 * llama.cpp does); NULL means "</s>". On success *out is a NUL-terminated
 * string the caller frees and *len its length. Returns 0, NF_EUSAGE
 * (unknown family, a NULL role or content) or -ENOMEM.
 */
int nf_chat_apply(enum nf_chat_family f, const struct nf_chat_msg *msgs, size_t n, bool add_assistant,
		  const char *eos, char **out, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_CHAT_H */
