/*
 * nflash/error.h - error codes and diagnostics shared by every module.
 *
 * Every nflash function that can fail returns int: 0 on success, a negative
 * errno (-EIO, -ENOMEM, ...) for system errors, or one of the project codes
 * below, which live in a reserved range far from errno values. nf_strerror()
 * decodes both.
 *
 * Functions that parse untrusted input also take an optional
 * struct nf_diag *, which receives a sentence naming what was wrong (the
 * file, the field, the flag). Passing NULL is always allowed.
 *
 *	struct nf_diag d = {0};
 *	int rc = nf_gguf_open(path, &g, &d);
 *	if (rc < 0)
 *		fprintf(stderr, "nflash: %s\n", d.msg[0] ? d.msg : nf_strerror(rc));
 */
#ifndef NFLASH_ERROR_H
#define NFLASH_ERROR_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Project errors: negative, below -NF_E_BASE, never collide with errno. */
#define NF_E_BASE 10000
enum nf_errcode {
	NF_EMAGIC       = -(NF_E_BASE + 1),  /* bad magic: not this kind of file */
	NF_EVERSION     = -(NF_E_BASE + 2),  /* unsupported (future) version */
	NF_EINCOMPAT    = -(NF_E_BASE + 3),  /* unknown incompatible feature flag */
	NF_ECHECKSUM    = -(NF_E_BASE + 4),  /* crc32c mismatch */
	NF_ETRUNCATED   = -(NF_E_BASE + 5),  /* file shorter than its metadata says */
	NF_EFORMAT      = -(NF_E_BASE + 6),  /* malformed field (bounds, overflow, alignment) */
	NF_EUNSUPPORTED = -(NF_E_BASE + 7),  /* valid but unsupported (tensor type, arch) */
	NF_EBUDGET      = -(NF_E_BASE + 8),  /* memory budget too small */
	NF_EPLAN        = -(NF_E_BASE + 9),  /* bad plan */
	NF_ESHORT       = -(NF_E_BASE + 10), /* short read or write */
	NF_ENOTFOUND    = -(NF_E_BASE + 11), /* named object or tensor is absent */
	NF_EUSAGE       = -(NF_E_BASE + 12), /* bad argument from the caller or user */
	NF_EALIGN       = -(NF_E_BASE + 13), /* request violates O_DIRECT alignment */
};

/*
 * nf_strerror - a static string for a return code (errno or NF_E*).
 * Thread-safe; never returns NULL.
 */
const char *nf_strerror(int err);

/* A diagnostic: the code and a sentence naming what went wrong. */
struct nf_diag {
	int code;
	char msg[512];
};

/*
 * nf_diag_fail - record code and a printf-style message in d (d may be
 * NULL) and return code, so callers can write `return nf_diag_fail(...)`.
 * A diagnostic already set is kept: the first, most specific, wins.
 */
int nf_diag_fail(struct nf_diag *d, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* nf_diag_prefix - put "PREFIX: " (printf-style) before d's message (or
 * before nf_strerror(code) if none was set) and return code: how a caller
 * names the file or flag a callee's error concerns. */
int nf_diag_prefix(struct nf_diag *d, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* nf_diag_msg - d's message if one was set, else nf_strerror(code). */
const char *nf_diag_msg(const struct nf_diag *d, int code);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_ERROR_H */
