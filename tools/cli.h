/*
 * tools/cli.h - helpers every `nflash` subcommand shares: flag parsing with
 * errors that name the flag, a progress bar for long work, JSON output
 * for --json reports (jansson), and the meaning of exit codes.
 *
 * Exit codes (documented in README.md):
 *   0  success
 *   1  the operation failed: bad or corrupt file, I/O error, verify found damage
 *   2  usage error, or this machine cannot run it (not root, no BTF, ...)
 *
 * Not thread-safe; used from the command's main thread only.
 */
#ifndef NFLASH_TOOLS_CLI_H
#define NFLASH_TOOLS_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

enum { NF_EXIT_OK = 0, NF_EXIT_FAIL = 1, NF_EXIT_USAGE = 2 };

/* One subcommand: tools/<name>.c defines nf_cmd_<name>(). */
struct nf_cmd {
	const char *name;
	int (*run)(int argc, char **argv);   /* argv[0] is the subcommand name */
	const char *summary;
};

/* Print "nflash: <message>\n" to stderr. */
void nf_cli_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void nf_cli_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/*
 * Value of flag argv[*i]: advances *i and returns argv[*i], or prints
 * "nflash: FLAG needs a value" and returns NULL.
 */
const char *nf_cli_value(int argc, char **argv, int *i);

/* Parsers: 0 on success; on bad input print an error naming flag, return NF_EUSAGE. */
int nf_cli_u64(const char *flag, const char *s, uint64_t *out);
int nf_cli_int(const char *flag, const char *s, long min, long max, long *out);
int nf_cli_double(const char *flag, const char *s, double *out);
/* "4096", "64K", "1.5G", "2GiB": binary units (K = 1024). */
int nf_cli_size(const char *flag, const char *s, uint64_t *out);
/* A store block size (bundle alignment): a size that is a power of two
 * from 512 to 1M. */
int nf_cli_block_size(const char *flag, const char *s, uint32_t *out);
/* "1,2,3" -> malloc'd array the caller frees. */
int nf_cli_ids(const char *flag, const char *s, int32_t **ids, size_t *n);

/*
 * nf_cli_out_ok - flush f and check that nothing written to it was lost
 * (ENOSPC on `> /dev/full`, EPIPE, EIO). On a loss, says so on stderr
 * ("nflash: writing standard output: ...", what names the stream) and
 * returns false; later calls keep returning false.
 */
bool nf_cli_out_ok(FILE *f, const char *what);

/*
 * nf_cli_report_stale - warn about each temporary file a killed writer left
 * in the directory of out (the output a command is about to write), with
 * its size and the command that removes it (`nflash store clean DIR`).
 */
void nf_cli_report_stale(const char *out);

/* Monotonic seconds. */
double nf_cli_now(void);

/*
 * Progress bar on stderr, drawn only when stderr is a terminal and at most
 * 10 times a second. unit_bytes makes it show MB/s; otherwise items/s.
 */
struct nf_progress {
	const char *label;
	uint64_t total;
	uint64_t done;
	double t0, last;
	bool tty, unit_bytes, drawn;
	bool lines;   /* no terminal: a line every 30 s of a long step */
};
void nf_progress_start(struct nf_progress *p, const char *label, uint64_t total, bool unit_bytes);
void nf_progress_update(struct nf_progress *p, uint64_t done);
void nf_progress_end(struct nf_progress *p);

/*
 * JSON for --json reports, through jansson: the calls build a tree that is
 * written (compact, or indented by 2 when pretty) when the top-level value
 * closes. key is NULL inside arrays. Strings that are not valid UTF-8 get
 * U+FFFD for each bad byte. Non-finite doubles are written as null, doubles
 * with 6 significant digits. An allocation or write failure sets failed.
 */
#define NF_JSON_MAX_DEPTH 64
struct json_t;
struct nf_json {
	FILE *f;
	int depth;
	struct json_t *stack[NF_JSON_MAX_DEPTH];
	bool pretty;
	bool failed;
};
void nf_json_init(struct nf_json *j, FILE *f, bool pretty);
void nf_json_obj_begin(struct nf_json *j, const char *key);
void nf_json_obj_end(struct nf_json *j);
void nf_json_arr_begin(struct nf_json *j, const char *key);
void nf_json_arr_end(struct nf_json *j);
void nf_json_str(struct nf_json *j, const char *key, const char *v);
void nf_json_u64(struct nf_json *j, const char *key, uint64_t v);
void nf_json_i64(struct nf_json *j, const char *key, int64_t v);
void nf_json_dbl(struct nf_json *j, const char *key, double v);
void nf_json_bool(struct nf_json *j, const char *key, bool v);
/* Closes what is still open (writing it) and ends the output with a newline. */
void nf_json_finish(struct nf_json *j);

/* A jansson string of n bytes of s, invalid UTF-8 bytes replaced by
 * U+FFFD; NULL only when out of memory. New reference. */
struct json_t *nf_json_string_lossy(const char *s, size_t n);
/* Bytes of s[0..n) that form whole, valid UTF-8 code points from the start
 * (just the first code point when one_char; 0 if it is invalid or cut). */
size_t nf_utf8_valid_prefix(const char *s, size_t n, bool one_char);

#endif
