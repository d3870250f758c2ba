/*
 * cli.c - flag parsing, progress bars and JSON output for the subcommands.
 *
 * Invariants: a parse error always names the flag and the bad value; the
 * progress bar never writes to a non-terminal; JSON output is valid UTF-8
 * passthrough with control characters escaped.
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
	p->tty = isatty(STDERR_FILENO) && !getenv("NFLASH_NO_PROGRESS");
	p->t0 = p->last = nf_cli_now();
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
	if (!p->tty)
		return;
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

/* ---- JSON -------------------------------------------------------------- */

void nf_json_init(struct nf_json *j, FILE *f, bool pretty)
{
	memset(j, 0, sizeof(*j));
	j->f = f;
	j->pretty = pretty;
}

static void json_escape(FILE *f, const char *s)
{
	fputc('"', f);
	for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
		switch (*p) {
		case '"': fputs("\\\"", f); break;
		case '\\': fputs("\\\\", f); break;
		case '\n': fputs("\\n", f); break;
		case '\r': fputs("\\r", f); break;
		case '\t': fputs("\\t", f); break;
		default:
			if (*p < 0x20)
				fprintf(f, "\\u%04x", *p);
			else
				fputc(*p, f);
		}
	}
	fputc('"', f);
}

static void json_key(struct nf_json *j, const char *key)
{
	if (j->need_comma[j->depth])
		fputc(',', j->f);
	if (j->pretty && j->depth > 0) {
		fputc('\n', j->f);
		for (int i = 0; i < j->depth; i++)
			fputs("  ", j->f);
	}
	j->need_comma[j->depth] = true;
	if (key) {
		json_escape(j->f, key);
		fputs(j->pretty ? ": " : ":", j->f);
	}
}

static void json_open(struct nf_json *j, const char *key, char c)
{
	json_key(j, key);
	fputc(c, j->f);
	if (j->depth < 63)
		j->depth++;
	j->need_comma[j->depth] = false;
}

static void json_close(struct nf_json *j, char c)
{
	bool had = j->need_comma[j->depth];
	if (j->depth > 0)
		j->depth--;
	if (j->pretty && had) {
		fputc('\n', j->f);
		for (int i = 0; i < j->depth; i++)
			fputs("  ", j->f);
	}
	fputc(c, j->f);
}

void nf_json_obj_begin(struct nf_json *j, const char *key) { json_open(j, key, '{'); }
void nf_json_obj_end(struct nf_json *j) { json_close(j, '}'); }
void nf_json_arr_begin(struct nf_json *j, const char *key) { json_open(j, key, '['); }
void nf_json_arr_end(struct nf_json *j) { json_close(j, ']'); }

void nf_json_str(struct nf_json *j, const char *key, const char *v)
{
	json_key(j, key);
	if (v)
		json_escape(j->f, v);
	else
		fputs("null", j->f);
}

void nf_json_u64(struct nf_json *j, const char *key, uint64_t v)
{
	json_key(j, key);
	fprintf(j->f, "%llu", (unsigned long long)v);
}

void nf_json_i64(struct nf_json *j, const char *key, int64_t v)
{
	json_key(j, key);
	fprintf(j->f, "%lld", (long long)v);
}

void nf_json_dbl(struct nf_json *j, const char *key, double v)
{
	json_key(j, key);
	if (isfinite(v))
		fprintf(j->f, "%.6g", v);
	else
		fputs("null", j->f);
}

void nf_json_bool(struct nf_json *j, const char *key, bool v)
{
	json_key(j, key);
	fputs(v ? "true" : "false", j->f);
}

void nf_json_finish(struct nf_json *j)
{
	fputc('\n', j->f);
	fflush(j->f);
}
