/*
 * error.c - nf_strerror() and struct nf_diag.
 *
 * Invariant: project codes are decoded from a constant table; anything else
 * negative is an errno and goes to strerror_r's thread-safe GNU variant
 * through a fixed table of common values, so the result is always static.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "nflash/error.h"

static const char *const nf_errstr[] = {
	[1]  = "bad magic (not an nflash/GGUF file of this kind)",
	[2]  = "unsupported format version",
	[3]  = "unknown incompatible feature flag",
	[4]  = "checksum mismatch",
	[5]  = "file is truncated",
	[6]  = "malformed field",
	[7]  = "unsupported feature or type",
	[8]  = "memory budget too small",
	[9]  = "bad plan",
	[10] = "short read or write",
	[11] = "not found",
	[12] = "bad usage",
	[13] = "request not aligned for O_DIRECT",
};

const char *nf_strerror(int err)
{
	if (err == 0)
		return "success";
	if (err <= -NF_E_BASE) {
		int i = -err - NF_E_BASE;
		if (i > 0 && i < (int)(sizeof(nf_errstr) / sizeof(nf_errstr[0])) && nf_errstr[i])
			return nf_errstr[i];
		return "unknown nflash error";
	}
	if (err < 0)
		err = -err;
	/* strerrordesc_np (glibc 2.32+) returns a static string, thread-safe. */
	const char *s = strerrordesc_np(err);
	return s ? s : "unknown error";
}

int nf_diag_fail(struct nf_diag *d, int code, const char *fmt, ...)
{
	if (d && d->msg[0] == '\0') {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(d->msg, sizeof(d->msg), fmt, ap);
		va_end(ap);
		d->code = code;
	}
	return code;
}

int nf_diag_prefix(struct nf_diag *d, int code, const char *fmt, ...)
{
	if (!d)
		return code;
	char head[256], tail[sizeof(d->msg)];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(head, sizeof(head), fmt, ap);
	va_end(ap);
	snprintf(tail, sizeof(tail), "%s", d->msg[0] ? d->msg : nf_strerror(code));
	/* truncation keeps the head: the name of the file or flag */
	size_t n = strlen(head);
	if (n > sizeof(d->msg) - 3)
		n = sizeof(d->msg) - 3;
	memcpy(d->msg, head, n);
	memcpy(d->msg + n, ": ", 2);
	size_t room = sizeof(d->msg) - n - 2, t = strlen(tail);
	t = t < room - 1 ? t : room - 1;
	memcpy(d->msg + n + 2, tail, t);
	d->msg[n + 2 + t] = '\0';
	d->code = code;
	return code;
}

const char *nf_diag_msg(const struct nf_diag *d, int code)
{
	if (d && d->msg[0])
		return d->msg;
	return nf_strerror(code);
}
