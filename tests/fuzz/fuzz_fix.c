/*
 * fuzz_fix.c - see fuzz_fix.h. Layouts are those of storage/store_format.h
 * (docs/FORMAT.md); offsets into the input are bounds-checked before every
 * access, because the input is arbitrary.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>

#include "nflash/crc32c.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "../../storage/store_format.h"
#include "fuzz_fix.h"

size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);

/* ---- the input as a file -------------------------------------------------- */

#define MEM_FD 1000
static const uint8_t *mem;
static size_t mem_len;

void fuzz_mem_set(const uint8_t *data, size_t size)
{
	mem = data;
	mem_len = size;
}

static int mem_open(const char *path, int flags, mode_t mode)
{
	(void)path;
	(void)mode;
	if ((flags & O_ACCMODE) != O_RDONLY) {
		errno = EROFS;
		return -1;
	}
	return MEM_FD;
}

static int mem_close(int fd)
{
	return fd == MEM_FD ? 0 : -1;
}

static ssize_t mem_pread(int fd, void *buf, size_t len, off_t off)
{
	if (fd != MEM_FD || off < 0) {
		errno = EBADF;
		return -1;
	}
	if ((uint64_t)off >= mem_len)
		return 0;
	size_t n = mem_len - (size_t)off < len ? mem_len - (size_t)off : len;
	memcpy(buf, mem + off, n);
	return (ssize_t)n;
}

static int mem_fstat(int fd, struct stat *st)
{
	memset(st, 0, sizeof(*st));
	st->st_mode = S_IFREG | 0444;
	st->st_size = (off_t)mem_len;
	return fd == MEM_FD ? 0 : -1;
}

static struct nf_io_sys mem_table;
static const struct nf_io_sys *mem_table_init(void)
{
	mem_table = nf_io_sys_default;
	mem_table.open = mem_open;
	mem_table.close = mem_close;
	mem_table.pread = mem_pread;
	mem_table.fstat = mem_fstat;
	return &mem_table;
}
const struct nf_io_sys *const fuzz_mem_sys = &mem_table;
__attribute__((constructor)) static void mem_ctor(void) { mem_table_init(); }

/* ---- crc fix-up --------------------------------------------------------------- */

static bool in(size_t size, uint64_t off, uint64_t len)
{
	return off <= size && len <= size - off;
}

static void put32(uint8_t *p, uint32_t v)
{
	v = htole32(v);
	memcpy(p, &v, 4);
}

static uint64_t get64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return le64toh(v);
}

static uint32_t get32(const uint8_t *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return le32toh(v);
}

static void fix_table(uint8_t *t, uint64_t tlen, uint32_t n)
{
	const uint64_t es = sizeof(struct nf_store_obj_disk);
	for (uint64_t i = 0; i < n && (i + 1) * es <= tlen; i++) {
		uint8_t *e = t + i * es;
		if (get32(e + offsetof(struct nf_store_obj_disk, kind)) != NF_STORE_KIND_FFN)
			continue;
		uint64_t ao = get64(e + offsetof(struct nf_store_obj_disk, aux_offset));
		uint64_t al = get64(e + offsetof(struct nf_store_obj_disk, aux_length));
		if (in(tlen, ao, al))
			put32(e + offsetof(struct nf_store_obj_disk, crc), nf_crc32c(0, t + ao, al));
		uint64_t bo = get64(e + offsetof(struct nf_store_obj_disk, bcrc_offset));
		uint64_t bl = 4ull * get32(e + offsetof(struct nf_store_obj_disk, n_bundles));
		if (bo && in(tlen, bo, bl))
			put32(e + offsetof(struct nf_store_obj_disk, bcrc_crc), nf_crc32c(0, t + bo, bl));
	}
}

void fuzz_store_fix(uint8_t *data, size_t size)
{
	for (int slot = 0; slot < 2; slot++) {
		uint64_t at = (uint64_t)slot * NF_STORE_SB_SLOT;
		if (!in(size, at, sizeof(struct nf_store_sb_disk)))
			return;
		uint8_t *sb = data + at;
		if (get64(sb) != NF_STORE_MAGIC)
			continue;
#define F(field) offsetof(struct nf_store_sb_disk, field)
		uint64_t to = get64(sb + F(table_offset)), tl = get64(sb + F(table_length));
		if (in(size, to, tl)) {
			fix_table(data + to, tl, get32(sb + F(n_objects)));
			put32(sb + F(table_crc), nf_crc32c(0, data + to, tl));
		}
		uint64_t po = get64(sb + F(profile_offset)), pl = get64(sb + F(profile_length));
		if (pl && in(size, po, pl))
			put32(sb + F(profile_crc), nf_crc32c(0, data + po, pl));
		uint64_t qo = get64(sb + F(plan_offset)), ql = get64(sb + F(plan_length));
		if (ql && in(size, qo, ql))
			put32(sb + F(plan_crc), nf_crc32c(0, data + qo, ql));
		put32(sb + F(crc), nf_crc32c(0, sb, F(crc)));
#undef F
	}
}

size_t fuzz_store_mutate(uint8_t *data, size_t size, size_t max_size, unsigned int seed)
{
	size = LLVMFuzzerMutate(data, size, max_size);
	if (seed % 8)
		fuzz_store_fix(data, size);
	return size;
}
