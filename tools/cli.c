/*
 * cli.c - flag parsing, progress bars and JSON output for the subcommands.
 *
 * Invariants: a parse error always names the flag and the bad value; the
 * progress bar never writes to a non-terminal (a long step writes a plain line
 * every 30 s there instead); JSON output is written by
 * jansson and is valid UTF-8 (invalid input bytes become U+FFFD).
 */
#include <ctype.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "nflash/store.h"

#include "nflash/error.h"
#include "nflash/io.h"
#include "cli.h"

void nf_cli_err(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("nflash: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

void nf_cli_warn(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("nflash: warning: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

const char *nf_cli_value(int argc, char **argv, int *i)
{
	if (*i + 1 >= argc) {
		nf_cli_err("%s needs a value", argv[*i]);
		return NULL;
	}
	return argv[++*i];
}

int nf_cli_u64(const char *flag, const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!s || !isdigit((unsigned char)*s))   /* strtoull would take " -5" and wrap it */
		goto bad;
	unsigned long long v = strtoull(s, &end, 10);   /* decimal: 010 is ten */
	if (errno || *end)
		goto bad;
	*out = v;
	return 0;
bad:
	nf_cli_err("%s: expected a non-negative whole number, got '%s'", flag, s ? s : "");
	return NF_EUSAGE;
}

int nf_cli_int(const char *flag, const char *s, long min, long max, long *out)
{
	char *end;
	errno = 0;
	bool digits = s && (isdigit((unsigned char)s[0]) ||
			    (s[0] == '-' && isdigit((unsigned char)s[1])));
	long v = digits ? strtol(s, &end, 10) : 0;   /* decimal: 010 is ten, 08 is eight */
	if (!digits || errno || *end) {
		nf_cli_err("%s: expected a whole number, got '%s'", flag, s ? s : "");
		return NF_EUSAGE;
	}
	if (v < min || v > max) {
		nf_cli_err("%s: %ld is out of range [%ld, %ld]", flag, v, min, max);
		return NF_EUSAGE;
	}
	*out = v;
	return 0;
}

int nf_cli_double(const char *flag, const char *s, double *out)
{
	char *end;
	errno = 0;
	double v = s && *s ? strtod(s, &end) : 0;
	if (!s || !*s || errno || *end || !isfinite(v)) {
		nf_cli_err("%s: expected a number, got '%s'", flag, s ? s : "");
		return NF_EUSAGE;
	}
	*out = v;
	return 0;
}

int nf_cli_size(const char *flag, const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!s || !*s || *s == '-')
		goto bad;
	double v = strtod(s, &end);
	if (errno || end == s || !isfinite(v) || v < 0)
		goto bad;
	double mul = 1;
	switch (*end) {
	case 'k': case 'K': mul = 1024.0; end++; break;
	case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
	case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
	case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
	default: break;
	}
	if (mul > 1 && (end[0] == 'i' || end[0] == 'I') && (end[1] == 'B' || end[1] == 'b'))
		end += 2;
	else if (*end == 'B' || *end == 'b')
		end++;
	if (*end || v * mul > 1.8e19)
		goto bad;
	*out = (uint64_t)(v * mul);
	return 0;
bad:
	nf_cli_err("%s: expected a size such as 4096, 64K, 1.5G, got '%s'", flag, s ? s : "");
	return NF_EUSAGE;
}

int nf_cli_block_size(const char *flag, const char *s, uint32_t *out)
{
	uint64_t b;
	if (nf_cli_size(flag, s, &b) < 0)
		return NF_EUSAGE;
	if (b < NF_STORE_BLOCK_MIN || b > NF_STORE_BLOCK_MAX || (b & (b - 1))) {
		nf_cli_err("%s: expected a power of two from 512 to 1M, got '%s'", flag, s);
		return NF_EUSAGE;
	}
	*out = (uint32_t)b;
	return 0;
}

int nf_cli_ids(const char *flag, const char *s, int32_t **ids, size_t *n)
{
	size_t cap = 1;
	for (const char *p = s; *p; p++)
		cap += *p == ',';
	int32_t *v = malloc(cap * sizeof(*v));
	if (!v)
		return -ENOMEM;
	size_t k = 0;
	const char *p = s;
	while (*p) {
		char *end;
		errno = 0;
		long x = strtol(p, &end, 10);
		if (end == p || errno || x < 0 || x > INT32_MAX || (*end && *end != ',')) {
			nf_cli_err("%s: expected comma-separated token ids, bad at '%s'", flag, p);
			free(v);
			return NF_EUSAGE;
		}
		v[k++] = (int32_t)x;
		p = *end ? end + 1 : end;
	}
	if (k == 0) {
		nf_cli_err("%s: no token ids given", flag);
		free(v);
		return NF_EUSAGE;
	}
	*ids = v;
	*n = k;
	return 0;
}

bool nf_cli_out_ok(FILE *f, const char *what)
{
	errno = 0;
	if (fflush(f) == 0 && !ferror(f))
		return true;
	int e = errno ? errno : EIO;
	if (f != stderr)
		nf_cli_err("writing %s: %s", what, strerror(e));
	return false;
}

static void stale_warn(void *user, const char *path, uint64_t bytes, int rc)
{
	nf_cli_warn("%s (%.1f MB) was left by a writer that is gone; `nflash store clean %s` removes it",
		    path, bytes / 1e6, (const char *)user);
}

void nf_cli_report_stale(const char *out)
{
	char *copy = strdup(out);
	if (!copy)
		return;
	const char *dir = dirname(copy);
	nf_io_tmp_sweep(dir, false, stale_warn, (void *)dir);
	free(copy);
}

double nf_cli_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- progress ---------------------------------------------------------- */

void nf_progress_start(struct nf_progress *p, const char *label, uint64_t total, bool unit_bytes)
{
	memset(p, 0, sizeof(*p));
	p->label = label;
	p->total = total;
	p->unit_bytes = unit_bytes;
	bool quiet = getenv("NFLASH_NO_PROGRESS") != NULL;
	p->tty = isatty(STDERR_FILENO) && !quiet;
	p->lines = !p->tty && !quiet;
	p->t0 = p->last = nf_cli_now();
}

/* Without a terminal: a line every NF_PROGRESS_LINE_S seconds of a long
 * step, so that a log shows how far it is and how long it has left. */
#define NF_PROGRESS_LINE_S 30.0

static void progress_line(struct nf_progress *p, double now)
{
	double dt = now - p->t0, frac = p->total ? (double)p->done / p->total : 0;
	double eta = frac > 0 && frac < 1 ? dt * (1 - frac) / frac : 0;
	fprintf(stderr, "nflash: %s: %llu of %llu%s (%.1f%%), %.0f s, eta %.0f s\n", p->label,
		(unsigned long long)(p->unit_bytes ? p->done >> 20 : p->done),
		(unsigned long long)(p->unit_bytes ? p->total >> 20 : p->total), p->unit_bytes ? " MiB" : "",
		frac * 100, dt, eta);
}

static void progress_draw(struct nf_progress *p, double now)
{
	double frac = p->total ? (double)p->done / p->total : 0;
	if (frac > 1)
		frac = 1;
	double dt = now - p->t0;
	double rate = dt > 0 ? p->done / dt : 0;
	char bar[31];
	int fill = (int)(frac * 30);
	for (int i = 0; i < 30; i++)
		bar[i] = i < fill ? '#' : '.';
	bar[30] = 0;
	double eta = rate > 0 && p->total > p->done ? (p->total - p->done) / rate : 0;
	if (p->unit_bytes)
		fprintf(stderr, "\r%-14s [%s] %5.1f%% %8.1f MB/s  eta %4.0fs ", p->label, bar,
			frac * 100, rate / 1e6, eta);
	else
		fprintf(stderr, "\r%-14s [%s] %5.1f%% %10.0f/s  eta %4.0fs ", p->label, bar,
			frac * 100, rate, eta);
	fflush(stderr);
	p->drawn = true;
}

void nf_progress_update(struct nf_progress *p, uint64_t done)
{
	p->done = done;
	if (!p->tty) {
		double now = p->lines ? nf_cli_now() : 0;
		if (p->lines && now - p->last >= NF_PROGRESS_LINE_S && done < p->total) {
			p->last = now;
			progress_line(p, now);
		}
		return;
	}
	double now = nf_cli_now();
	if (now - p->last < 0.1 && done < p->total)
		return;
	p->last = now;
	progress_draw(p, now);
}

void nf_progress_end(struct nf_progress *p)
{
	if (!p->tty)
		return;
	p->done = p->total;
	progress_draw(p, nf_cli_now());
	fprintf(stderr, " %.1fs\n", nf_cli_now() - p->t0);
}

/* ---- JSON (jansson) ------------------------------------------------------ */

/*
 * The writer builds a jansson tree and dumps it when the top-level value
 * closes, so every report goes through one JSON library and its escaping.
 * Keys are the program's own ASCII literals (no UTF-8 check); string values
 * are checked and invalid bytes become U+FFFD.
 */

json_t *nf_json_string_lossy(const char *s, size_t n)
{
	json_t *v = json_stringn(s, n);
	if (v)
		return v;
	/* invalid UTF-8: copy the valid sequences, U+FFFD for each bad byte */
	char *buf = malloc(n * 3 + 1);
	if (!buf)
		return NULL;
	size_t o = 0;
	const unsigned char *p = (const unsigned char *)s;
	for (size_t i = 0; i < n;) {
		size_t len = nf_utf8_valid_prefix((const char *)p + i, n - i, true);
		if (len == 0) {
			memcpy(buf + o, "\xef\xbf\xbd", 3);
			o += 3;
			i++;
			continue;
		}
		memcpy(buf + o, p + i, len);
		o += len;
		i += len;
	}
	v = json_stringn(buf, o);
	free(buf);
	return v;
}

/* Length of the leading complete, valid UTF-8 sequence of s (one code
 * point) when one_char, else of the longest valid prefix made of whole
 * code points. Embedded NULs count as valid. */
size_t nf_utf8_valid_prefix(const char *s, size_t n, bool one_char)
{
	const unsigned char *p = (const unsigned char *)s;
	size_t i = 0;
	while (i < n) {
		unsigned c = p[i];
		size_t len;
		uint32_t cp, min;
		if (c < 0x80) {
			len = 1, cp = c, min = 0;
		} else if ((c & 0xe0) == 0xc0) {
			len = 2, cp = c & 0x1f, min = 0x80;
		} else if ((c & 0xf0) == 0xe0) {
			len = 3, cp = c & 0x0f, min = 0x800;
		} else if ((c & 0xf8) == 0xf0) {
			len = 4, cp = c & 0x07, min = 0x10000;
		} else {
			break;
		}
		if (i + len > n)
			break;
		size_t k;
		for (k = 1; k < len; k++) {
			if ((p[i + k] & 0xc0) != 0x80)
				break;
			cp = (cp << 6) | (p[i + k] & 0x3f);
		}
		if (k < len || cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			break;
		i += len;
		if (one_char)
			return i;
	}
	return i;
}

void nf_json_init(struct nf_json *j, FILE *f, bool pretty)
{
	memset(j, 0, sizeof(*j));
	j->f = f;
	j->pretty = pretty;
}

static void json_dump_root(struct nf_json *j, json_t *v)
{
	size_t flags = (j->pretty ? JSON_INDENT(2) : JSON_COMPACT) | JSON_REAL_PRECISION(6) |
		       JSON_ENCODE_ANY;
	if (json_dumpf(v, j->f, flags) < 0)
		j->failed = true;
}

/* Attach v (a new reference, may be NULL after an allocation failure) to
 * the value being built, or write it when it is the top-level value. */
static void json_put(struct nf_json *j, const char *key, json_t *v)
{
	if (!v) {
		j->failed = true;
		return;
	}
	if (j->depth == 0) {
		json_dump_root(j, v);
		json_decref(v);
		return;
	}
	json_t *parent = j->stack[j->depth - 1];
	int rc = json_is_object(parent) ? json_object_set_new_nocheck(parent, key ? key : "", v)
					: json_array_append_new(parent, v);
	if (rc < 0)
		j->failed = true;
}

static void json_open(struct nf_json *j, const char *key, json_t *v)
{
	if (!v || j->depth >= NF_JSON_MAX_DEPTH) {
		json_decref(v);
		j->failed = true;
		return;
	}
	if (j->depth > 0)
		json_put(j, key, json_incref(v));
	j->stack[j->depth++] = v;
}

static void json_close(struct nf_json *j)
{
	if (j->depth == 0)
		return;
	json_t *v = j->stack[--j->depth];
	if (j->depth == 0)
		json_dump_root(j, v);
	json_decref(v);
}

void nf_json_obj_begin(struct nf_json *j, const char *key) { json_open(j, key, json_object()); }
void nf_json_obj_end(struct nf_json *j) { json_close(j); }
void nf_json_arr_begin(struct nf_json *j, const char *key) { json_open(j, key, json_array()); }
void nf_json_arr_end(struct nf_json *j) { json_close(j); }

void nf_json_str(struct nf_json *j, const char *key, const char *v)
{
	json_put(j, key, v ? nf_json_string_lossy(v, strlen(v)) : json_null());
}

void nf_json_u64(struct nf_json *j, const char *key, uint64_t v)
{
	/* jansson's integers are signed 64-bit; larger values go as reals */
	json_put(j, key, v <= (uint64_t)INT64_MAX ? json_integer((json_int_t)v) : json_real((double)v));
}

void nf_json_i64(struct nf_json *j, const char *key, int64_t v)
{
	json_put(j, key, json_integer((json_int_t)v));
}

void nf_json_dbl(struct nf_json *j, const char *key, double v)
{
	json_put(j, key, isfinite(v) ? json_real(v) : json_null());
}

void nf_json_bool(struct nf_json *j, const char *key, bool v)
{
	json_put(j, key, json_boolean(v));
}

void nf_json_finish(struct nf_json *j)
{
	while (j->depth > 0)
		json_close(j);
	fputc('\n', j->f);
	fflush(j->f);
}
