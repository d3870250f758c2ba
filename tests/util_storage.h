/*
 * util_storage.h - helpers for the storage tests: scratch directories,
 * small stores with deterministic contents, and running a command with its
 * output captured.
 */
#ifndef NFLASH_TESTS_UTIL_STORAGE_H
#define NFLASH_TESTS_UTIL_STORAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/store.h"

struct ts_dir {
	char dir[128];
	char path[192];     /* dir/store.nfs */
};

/* mkdtemp under base ("/tmp", "/dev/shm", ...); false if impossible. */
bool ts_dir_make(struct ts_dir *t, const char *base);
/* Remove the directory and everything in it. */
void ts_dir_remove(struct ts_dir *t);
/* Number of entries in t->dir (excluding . and ..). */
int ts_dir_count(const struct ts_dir *t);

/* Deterministic bytes for (seed). */
void ts_fill(uint8_t *p, size_t n, uint64_t seed);

/*
 * A small store: dense "emb" {dim, 10} and "norm" {dim} (f32) in dtype,
 * FFN blk.0.ffn with gate (n bundles), FFN blk.1.ffn without gate, FFN
 * blk.2.ffn.1 (expert 1) with gate. dim = 64, n = 37. Object k's dense bytes
 * are ts_fill(.., 100 + k); bundle i row r of FFN object k is
 * ts_fill(.., k << 32 | i << 2 | r).
 */
#define TS_DIM 64
#define TS_N 37
int ts_make_store(const char *path, uint32_t dtype, uint32_t extent_bundles, uint32_t block_size,
		  const struct nf_io_sys *sys);
/* Compare a read buffer with what ts_make_store wrote; 0 if equal. For an
 * FFN, buf holds n bundles starting at slot first (at stride). */
int ts_check_dense(const struct nf_store_object *o, const uint8_t *buf);
int ts_check_bundles(const struct nf_store_object *o, const uint32_t *slots, uint32_t n,
		     const uint8_t *buf);

/* Patch bytes of a file at off. */
void ts_patch(const char *path, uint64_t off, const void *p, size_t n);
void ts_read(const char *path, uint64_t off, void *p, size_t n);
/* Flip bit `bit` of byte off. */
void ts_flip(const char *path, uint64_t off, int bit);

/* A request completion recorder for nf_io callbacks: cookie is a struct ts_done. */
struct ts_done {
	int calls, result;
};
void ts_on_done(void *cookie, int result);

/* Run nf_cmd_store(argv) in a child with stdout and stderr captured into
 * out (NUL-terminated, truncated to cap). Returns the exit code. */
int ts_run_store_cmd(char *const argv[], char *out, size_t cap);
/* The same for any subcommand function (nf_cmd_import, ...). */
int ts_run_cmd(int (*cmd)(int, char **), char *const argv[], char *out, size_t cap);

/* Field-by-field equality of two bundle layouts (memcmp would read padding). */
struct nf_bundle_layout;
bool ts_same_layout(const struct nf_bundle_layout *a, const struct nf_bundle_layout *b);

#endif
