/*
 * test_storage_crc32c.c - CRC-32C against published vectors; the SSE4.2
 * and table versions agree on every length and alignment.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "nflash/crc32c.h"
#include "util_storage.h"

/* RFC 3720 (iSCSI) B.4 vectors and the classic check value. */
static void known(uint32_t (*f)(uint32_t, const void *, size_t), const char *name)
{
	uint8_t buf[32];
	cr_assert_eq(f(0, "123456789", 9), 0xE3069283u, "%s: check value", name);
	cr_assert_eq(f(0, NULL, 0), 0u, "%s: empty", name);
	memset(buf, 0, 32);
	cr_assert_eq(f(0, buf, 32), 0x8A9136AAu, "%s: 32 zeros", name);
	memset(buf, 0xff, 32);
	cr_assert_eq(f(0, buf, 32), 0x62A8AB43u, "%s: 32 x 0xff", name);
	for (int i = 0; i < 32; i++)
		buf[i] = (uint8_t)i;
	cr_assert_eq(f(0, buf, 32), 0x46DD794Eu, "%s: 0..31", name);
	for (int i = 0; i < 32; i++)
		buf[i] = (uint8_t)(31 - i);
	cr_assert_eq(f(0, buf, 32), 0x113FDB5Cu, "%s: 31..0", name);
}

Test(storage, crc32c_vectors)
{
	known(nf_crc32c_sw, "table");
	known(nf_crc32c, "dispatch");
	if (!nf_crc32c_hw_available())
		cr_skip_test("no CRC-32C instructions (SSE4.2 / arm64 CRC32) on this CPU: hardware version not tested");
	known(nf_crc32c_hw, "hardware");
}

Test(storage, crc32c_hw_matches_table)
{
	if (!nf_crc32c_hw_available())
		cr_skip_test("no CRC-32C instructions (SSE4.2 / arm64 CRC32) on this CPU");
	static uint8_t buf[3 * 8192 * 3 + 3 * 256 * 2 + 100];
	ts_fill(buf, sizeof(buf), 7);
	for (size_t off = 0; off < 9; off++)
		for (size_t len = 0; len < 1000; len++)   /* short lengths, 3 x 256-byte blocks */
			cr_assert_eq(nf_crc32c_hw(0x1234, buf + off, len), nf_crc32c_sw(0x1234, buf + off, len),
				     "off %zu len %zu", off, len);
	/* around the 3 x 8192 and 3 x 256 block boundaries, and long buffers */
	static const size_t lens[] = { 24575, 24576, 24577, 24576 + 767, 24576 + 768, 24576 + 776,
				       49152, 49152 + 768 + 13, sizeof(buf) - 9 };
	for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++)
		for (size_t off = 0; off < 9; off += 3)
			cr_assert_eq(nf_crc32c_hw(7, buf + off, lens[k]), nf_crc32c_sw(7, buf + off, lens[k]),
				     "off %zu len %zu", off, lens[k]);
}

Test(storage, crc32c_continues)
{
	static uint8_t buf[5000];
	ts_fill(buf, sizeof(buf), 9);
	uint32_t whole = nf_crc32c(0, buf, sizeof(buf));
	for (size_t cut = 0; cut <= sizeof(buf); cut += 499)
		cr_assert_eq(nf_crc32c(nf_crc32c(0, buf, cut), buf + cut, sizeof(buf) - cut), whole);
	cr_assert_neq(nf_crc32c(0, buf, sizeof(buf) - 1), whole);
}
