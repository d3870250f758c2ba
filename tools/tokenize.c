/*
 * tokenize.c - `nflash tokenize`: the token ids of a text, as llama.cpp's
 * tokenizer would give them for the same GGUF vocabulary.
 *
 * Output: the ids on one line, space-separated (BOS first when the
 * vocabulary asks for one, unless --no-bos); with --json one object
 * {"model", "ids", "n_tokens"}; with --pieces one "id<TAB>piece" line per
 * token instead. Special-token text such as "<s>" is parsed as the token,
 * as llama-tokenize does, unless --no-parse-special.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "nflash/gguf.h"
#include "nflash/tokenizer.h"

int nf_cmd_tokenize(int argc, char **argv);

static void usage(FILE *f)
{
	fprintf(f,
		"usage: nflash tokenize -m MODEL [--no-bos] [--no-parse-special] [--json | --pieces] TEXT\n"
		"\n"
		"Prints the token ids of TEXT, space-separated, as llama.cpp tokenizes it\n"
		"with MODEL's vocabulary (SentencePiece \"llama\" or byte-level BPE \"gpt2\").\n"
		"\n"
		"  -m, --model MODEL     a GGUF file (its tokenizer.ggml.* keys)\n"
		"  -p, --prompt TEXT     the text (or give it as the last argument)\n"
		"  --no-bos              do not add BOS/EOS, even if the vocabulary asks\n"
		"  --no-parse-special    keep text like \"<s>\" as text, not the control token\n"
		"  --json                print {\"model\", \"ids\", \"n_tokens\"}\n"
		"  --pieces              print one \"id<TAB>piece\" line per token\n"
		"  -h, --help            this text\n");
}

int nf_cmd_tokenize(int argc, char **argv)
{
	const char *model = NULL, *text = NULL;
	bool bos = true, parse_special = true, json = false, pieces = false;
	struct nf_gguf *g = NULL;
	struct nf_tok *tok = NULL;
	struct nf_diag d = {0};
	int32_t *ids = NULL;
	int ret = NF_EXIT_FAIL;

	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
			usage(stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
			if (!(model = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
			if (!(text = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--no-bos")) {
			bos = false;
		} else if (!strcmp(a, "--no-parse-special")) {
			parse_special = false;
		} else if (!strcmp(a, "--json")) {
			json = true;
		} else if (!strcmp(a, "--pieces")) {
			pieces = true;
		} else if (a[0] == '-' && a[1] != '\0' && strcmp(a, "--")) {
			nf_cli_err("tokenize: unknown option '%s' (try 'nflash tokenize --help')", a);
			return NF_EXIT_USAGE;
		} else {
			if (!strcmp(a, "--") && i + 1 < argc)
				a = argv[++i];
			if (text) {
				nf_cli_err("tokenize: give the text as one argument (quote it)");
				return NF_EXIT_USAGE;
			}
			text = a;
		}
	}
	if (!model) {
		nf_cli_err("tokenize: -m MODEL is required (try 'nflash tokenize --help')");
		return NF_EXIT_USAGE;
	}
	if (!text) {
		nf_cli_err("tokenize: no TEXT given (try 'nflash tokenize --help')");
		return NF_EXIT_USAGE;
	}
	if (json && pieces) {
		nf_cli_err("tokenize: --json and --pieces exclude each other");
		return NF_EXIT_USAGE;
	}

	int rc = nf_gguf_open(model, 0, &g, &d);
	if (rc == 0)
		rc = nf_tok_open(g, &tok, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		goto out;
	}
	unsigned flags = (bos ? NF_TOK_ADD_SPECIAL : 0) | (parse_special ? NF_TOK_PARSE_SPECIAL : 0);
	size_t len = strlen(text), cap = len + 8, n = 0;
	ids = malloc(cap * sizeof(*ids));
	rc = ids ? nf_tok_encode(tok, text, len, flags, ids, cap, &n) : -ENOMEM;
	if (rc == -ENOSPC) {
		int32_t *bigger = realloc(ids, n * sizeof(*ids));
		rc = bigger ? nf_tok_encode(tok, text, len, flags, bigger, n, &n) : -ENOMEM;
		if (bigger)
			ids = bigger;
	}
	if (rc < 0) {
		nf_cli_err("%s: tokenizing failed: %s", model, nf_strerror(rc));
		goto out;
	}
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "model", model);
		nf_json_arr_begin(&j, "ids");
		for (size_t i = 0; i < n; i++)
			nf_json_i64(&j, NULL, ids[i]);
		nf_json_arr_end(&j);
		nf_json_u64(&j, "n_tokens", n);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else if (pieces) {
		for (size_t i = 0; i < n; i++) {
			char buf[256];
			int k = nf_tok_piece(tok, ids[i], true, buf, sizeof(buf));
			if (k < 0)
				k = 0;
			printf("%d\t%.*s\n", ids[i], k < (int)sizeof(buf) ? k : (int)sizeof(buf), buf);
		}
	} else {
		for (size_t i = 0; i < n; i++)
			printf("%s%d", i ? " " : "", ids[i]);
		printf("\n");
	}
	ret = fflush(stdout) == 0 ? NF_EXIT_OK : NF_EXIT_FAIL;
out:
	free(ids);
	nf_tok_close(tok);
	nf_gguf_close(g);
	return ret;
}
