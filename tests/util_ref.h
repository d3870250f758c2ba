/*
 * tests/util_ref.h - reads the NAME.ref.txt files of ../shared/testdata:
 * llama.cpp's last-position logits and greedy continuation for a prompt
 * given as token ids (format in ../shared/testdata/README.md).
 *
 *	struct nf_ref r;
 *	if (nf_ref_load("x.ref.txt", &r, &diag) == 0) { ...; nf_ref_free(&r); }
 *
 * Not thread-safe per object; distinct objects are independent.
 */
#ifndef NFLASH_TESTS_UTIL_REF_H
#define NFLASH_TESTS_UTIL_REF_H

#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"

/* Tests' own time limits are multiplied by this: a cross build's suite runs
 * under qemu-user, several times slower than the machine (the Makefile
 * passes 10 there). */
#ifndef NF_TEST_SLOWDOWN
#define NF_TEST_SLOWDOWN 1
#endif

struct nf_ref {
	int32_t *input;     /* n_input prompt ids */
	size_t n_input;
	float *logits;      /* n_vocab logits of the last prompt position */
	size_t n_vocab;
	int32_t *greedy;    /* n_greedy ids of the greedy continuation */
	size_t n_greedy;
};

/*
 * nf_ref_load - parse path. 0 on success (the caller frees r with
 * nf_ref_free), NF_EFORMAT with a message naming the line's field, or a
 * negative errno if the file cannot be read. On failure r is empty.
 */
int nf_ref_load(const char *path, struct nf_ref *r, struct nf_diag *diag);
/* Free r's arrays and zero it; accepts an empty r. */
void nf_ref_free(struct nf_ref *r);

#endif
