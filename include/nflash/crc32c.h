/*
 * nflash/crc32c.h - CRC-32C (Castagnoli), the checksum of every on-disk
 * structure and extent in a store.
 *
 * The value is the standard one (iSCSI, ext4, LevelDB): reflected polynomial
 * 0x82F63B78, initial value and final xor 0xFFFFFFFF, so
 * nf_crc32c(0, "123456789", 9) == 0xE3069283. Passing a previous result as
 * crc continues the checksum over more bytes:
 *
 *	uint32_t c = nf_crc32c(0, a, na);
 *	c = nf_crc32c(c, b, nb);          // == nf_crc32c(0, a||b, na + nb)
 *
 * nf_crc32c() uses the SSE4.2 crc32 instruction when the CPU has it and a
 * table otherwise; both are exposed so tests can compare them. All functions
 * are pure and thread-safe.
 */
#ifndef NFLASH_CRC32C_H
#define NFLASH_CRC32C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CRC-32C of buf[0..len) continuing from crc (0 to start). buf may be NULL if len is 0. */
uint32_t nf_crc32c(uint32_t crc, const void *buf, size_t len);
/* The table-driven version, on any CPU. */
uint32_t nf_crc32c_sw(uint32_t crc, const void *buf, size_t len);
/* The hardware version (SSE4.2 on x86-64, CRC32 on arm64); call only when
 * nf_crc32c_hw_available(). */
uint32_t nf_crc32c_hw(uint32_t crc, const void *buf, size_t len);
/* True when this CPU has the instructions nf_crc32c_hw needs. */
bool nf_crc32c_hw_available(void);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_CRC32C_H */
