/*
 * util_ref.c - parser for the reference files (see util_ref.h).
 *
 * Invariants: counts are bounded before allocation (at most 1<<24 values),
 * every number is checked to be whole and in range, and the section
 * headers must appear in order (n_input, n_vocab, n_greedy).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util_ref.h"

#define REF_MAX_COUNT (1u << 24)

struct ref_reader {
	FILE *f;
	const char *path;
	struct nf_diag *diag;
};

/* Next whitespace-separated word into buf; 0, or NF_EFORMAT at EOF. */
static int word(struct ref_reader *rr, char *buf, size_t cap, const char *what)
{
	if (fscanf(rr->f, " ") < 0 && ferror(rr->f))
		return nf_diag_fail(rr->diag, -EIO, "%s: read error", rr->path);
	size_t n = 0;
	int c;
	while ((c = fgetc(rr->f)) != EOF && !(c == ' ' || c == '\n' || c == '\t' || c == '\r')) {
		if (n + 1 >= cap)
			return nf_diag_fail(rr->diag, NF_EFORMAT, "%s: %s: value too long", rr->path, what);
		buf[n++] = (char)c;
	}
	buf[n] = 0;
	if (n == 0)
		return nf_diag_fail(rr->diag, NF_EFORMAT, "%s: missing %s", rr->path, what);
	return 0;
}

static int integer(struct ref_reader *rr, const char *what, long long lo, long long hi, long long *out)
{
	char buf[64], *end;
	int rc = word(rr, buf, sizeof(buf), what);
	if (rc < 0)
		return rc;
	errno = 0;
	long long v = strtoll(buf, &end, 10);
	if (*end || errno || v < lo || v > hi)
		return nf_diag_fail(rr->diag, NF_EFORMAT, "%s: %s: bad value '%s'", rr->path, what, buf);
	*out = v;
	return 0;
}

static int header(struct ref_reader *rr, const char *key, size_t *count)
{
	char buf[64];
	int rc = word(rr, buf, sizeof(buf), key);
	if (rc < 0)
		return rc;
	if (strcmp(buf, key))
		return nf_diag_fail(rr->diag, NF_EFORMAT, "%s: expected '%s', found '%s'", rr->path, key, buf);
	long long v;
	rc = integer(rr, key, 1, REF_MAX_COUNT, &v);
	*count = (size_t)v;
	return rc;
}

static int ids(struct ref_reader *rr, const char *what, size_t n, int32_t **out)
{
	int32_t *v = malloc(n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	*out = v;
	for (size_t i = 0; i < n; i++) {
		long long x;
		int rc = integer(rr, what, 0, INT32_MAX, &x);
		if (rc < 0)
			return rc;
		v[i] = (int32_t)x;
	}
	return 0;
}

int nf_ref_load(const char *path, struct nf_ref *r, struct nf_diag *diag)
{
	memset(r, 0, sizeof(*r));
	struct ref_reader rr = { .f = fopen(path, "r"), .path = path, .diag = diag };
	if (!rr.f)
		return nf_diag_fail(diag, -errno, "%s: %s", path, strerror(errno));
	int rc = header(&rr, "n_input", &r->n_input);
	if (rc == 0)
		rc = ids(&rr, "prompt id", r->n_input, &r->input);
	if (rc == 0)
		rc = header(&rr, "n_vocab", &r->n_vocab);
	if (rc == 0) {
		r->logits = malloc(r->n_vocab * sizeof(*r->logits));
		rc = r->logits ? 0 : -ENOMEM;
	}
	for (size_t i = 0; rc == 0 && i < r->n_vocab; i++) {
		char buf[64], *end;
		rc = word(&rr, buf, sizeof(buf), "logit");
		if (rc < 0)
			break;
		errno = 0;
		r->logits[i] = strtof(buf, &end);
		if (*end || errno || !isfinite(r->logits[i]))
			rc = nf_diag_fail(diag, NF_EFORMAT, "%s: logit %zu: bad value '%s'", path, i, buf);
	}
	if (rc == 0)
		rc = header(&rr, "n_greedy", &r->n_greedy);
	if (rc == 0)
		rc = ids(&rr, "greedy id", r->n_greedy, &r->greedy);
	fclose(rr.f);
	if (rc < 0)
		nf_ref_free(r);
	return rc;
}

void nf_ref_free(struct nf_ref *r)
{
	free(r->input);
	free(r->logits);
	free(r->greedy);
	memset(r, 0, sizeof(*r));
}
