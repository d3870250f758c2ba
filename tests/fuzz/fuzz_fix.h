/*
 * fuzz_fix.h - shared by the store and model fuzz targets: an in-memory
 * syscall table that serves a store from the fuzz input, and a checksum
 * fix-up so mutated stores get past their crc32c checks and the structure
 * parsers behind them (superblocks, object table, aux and bundle-checksum
 * arrays, profile and plan sections) are exercised, not only the checks.
 */
#ifndef NFLASH_FUZZ_FIX_H
#define NFLASH_FUZZ_FIX_H

#include <stddef.h>
#include <stdint.h>

struct nf_io_sys;

/* A table whose open() of any path opens the bytes set by fuzz_mem_set. */
extern const struct nf_io_sys *const fuzz_mem_sys;
void fuzz_mem_set(const uint8_t *data, size_t size);

/* Recompute, in place, every crc32c a store's reader checks: per superblock
 * copy (in order: each FFN entry's aux and bundle-checksum crcs, the table
 * crc, the profile and plan crcs, the superblock crc). Inputs that are not
 * stores (no magic) are left alone. */
void fuzz_store_fix(uint8_t *data, size_t size);

/* LLVMFuzzerCustomMutator body: mutate, then fix the crcs of 7 inputs in 8
 * (the 8th keeps its bad crcs, so the checks themselves stay covered). */
size_t fuzz_store_mutate(uint8_t *data, size_t size, size_t max_size, unsigned int seed);

#endif
