#!/usr/bin/env python3
# Regenerates storage/crc32c_shift.h: for n = 8192 and 256, the linear map
# "append n zero bytes" on a raw (not inverted) CRC-32C register, split into
# four 256-entry tables by input byte. Column b is the register 1 << b after
# n zero bytes. Usage: python3 storage/gen_crc32c_shift.py > storage/crc32c_shift.h
P = 0x82F63B78
T = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ P if c & 1 else c >> 1
    T.append(c)


def zeros(reg, n):
    for _ in range(n):
        reg = T[reg & 0xFF] ^ (reg >> 8)
    return reg


def tables(n):
    col = [zeros(1 << b, n) for b in range(32)]
    out = []
    for k in range(4):
        row = []
        for v in range(256):
            x = 0
            for j in range(8):
                if v >> j & 1:
                    x ^= col[8 * k + j]
            row.append(x)
        out.append(row)
    return out


def emit(name, n):
    s = '/* The operator "append %d zero bytes" on a raw CRC-32C register, split by byte. */\n' % n
    s += 'static const uint32_t %s[4][256] = {\n' % name
    for row in tables(n):
        s += '\t{\n'
        for i in range(0, 256, 6):
            s += '\t\t' + ' '.join('0x%08x,' % x for x in row[i:i + 6]) + '\n'
        s += '\t},\n'
    return s + '};\n'


print('''/*
 * crc32c_shift.h - generated constant tables for combining CRC-32C streams
 * (storage/crc32c.c), written by storage/gen_crc32c_shift.py from the polynomial:
 * column b of the operator is the register 1 << b after n zero bytes.
 */
#ifndef NFLASH_CRC32C_SHIFT_H
#define NFLASH_CRC32C_SHIFT_H

#include <stdint.h>

#define NF_CRC32C_LONG 8192
#define NF_CRC32C_SHORT 256
''')
print(emit('nf_crc32c_long', 8192))
print(emit('nf_crc32c_short', 256) + '\n#endif')
