/*
 * store_format.h - the on-disk structures of a store (docs/FORMAT.md).
 *
 * Private to storage/ (tests include it to forge damaged stores). Every
 * field is fixed-width little-endian; sizes are _Static_assert'ed; values of
 * the enums in store.h that reach the disk are only ever appended.
 *
 * Layout of a store file (B = block size, a power of two >= 512):
 *
 *   [0, 4096)            superblock slot 0
 *   [4096, 8192)         superblock slot 1
 *   [data_start, ...)    object data, each object at a multiple of B;
 *                        data_start = max(8192, B)
 *   [table_offset, +len) object table: n_objects entries, then the aux
 *                        arrays of FFN objects (extent crcs, permutation)
 *
 * Superblock of generation g lives in slot g % 2; the reader takes the valid
 * copy with the highest generation.
 */
#ifndef NFLASH_STORE_FORMAT_H
#define NFLASH_STORE_FORMAT_H

#include <stddef.h>
#include <stdint.h>

/* Bytes "\x89NFSTORE" on disk: read as a little-endian u64 this is the value
 * below; a big-endian reader sees NF_STORE_MAGIC_SWAPPED instead. */
#define NF_STORE_MAGIC         0x45524f5453464e89ULL
#define NF_STORE_MAGIC_SWAPPED 0x894e4653544f5245ULL
#define NF_STORE_VERSION       1u
#define NF_STORE_SB_SLOT       4096u   /* bytes per superblock slot */
#define NF_STORE_SB_AREA       8192u   /* both slots */
#define NF_STORE_NAME_MAX      64      /* bytes of a name, NUL included */
#define NF_STORE_MAX_DIMS      4

/* Feature flags. Readers refuse unknown incompat bits and ignore unknown
 * compat bits (docs/FORMAT.md items 16-18). */
#define NF_STORE_INCOMPAT_DOWN_FORMS (1ULL << 0) /* FFN objects use NF_STORE_OBJ_QCOL / _DOWN_DTYPE */
#define NF_STORE_INCOMPAT_BLOB       (1ULL << 1) /* objects of kind NF_STORE_KIND_BLOB */
/* Compat: the superblock points at a profile section (docs/FORMAT.md
 * item 19); a reader that does not know it ignores the section. */
#define NF_STORE_COMPAT_PROFILE      (1ULL << 0)
/* Compat: the superblock points at a plan section (item 20). */
#define NF_STORE_COMPAT_PLAN         (1ULL << 1)
/* Compat: every FFN object has bundle checksums (item 22); a reader that
 * does not know them reads the store as before. */
#define NF_STORE_COMPAT_BUNDLE_CRC   (1ULL << 2)
#define NF_STORE_COMPAT_KNOWN   (NF_STORE_COMPAT_PROFILE | NF_STORE_COMPAT_PLAN | NF_STORE_COMPAT_BUNDLE_CRC)
#define NF_STORE_INCOMPAT_KNOWN (NF_STORE_INCOMPAT_DOWN_FORMS | NF_STORE_INCOMPAT_BLOB)

/* Object entry flags. */
#define NF_STORE_OBJ_GATE       1u   /* FFN bundles hold a gate row */
#define NF_STORE_OBJ_QCOL       2u   /* FFN down part in QCOL form (nflash/bundle.h) */
#define NF_STORE_OBJ_DOWN_DTYPE 4u   /* FFN: down_dtype holds the down part's type */
#define NF_STORE_OBJ_DOWN_T     8u   /* FFN: the source down matrix was transposed (ffn_down_t) */

struct nf_store_sb_disk {
	uint64_t magic;          /* NF_STORE_MAGIC */
	uint32_t version;        /* NF_STORE_VERSION */
	uint32_t sb_size;        /* sizeof(struct nf_store_sb_disk) */
	uint64_t generation;     /* slot = generation % 2 */
	uint64_t compat;         /* feature flags a reader may ignore */
	uint64_t incompat;       /* feature flags a reader must know */
	uint32_t block_size;     /* B: alignment of every object and bundle stride */
	uint32_t n_objects;      /* entries in the object table */
	uint64_t file_size;      /* total bytes of the store */
	uint64_t data_start;     /* first byte of object data */
	uint64_t table_offset;   /* object table, a multiple of B */
	uint64_t table_length;   /* entries + aux arrays, bytes */
	uint32_t table_crc;      /* crc32c of the table_length bytes */
	uint32_t reserved0;
	uint64_t created_ns;     /* CLOCK_REALTIME at creation */
	uint8_t uuid[16];        /* random, identifies the store */
	/* NF_STORE_COMPAT_PROFILE: the profile section (all zero without it) */
	uint64_t profile_offset; /* multiple of B, outside objects and table */
	uint64_t profile_length; /* bytes of header, entries and counts */
	uint32_t profile_crc;    /* crc32c of those bytes */
	uint32_t plan_crc;       /* NF_STORE_COMPAT_PLAN: crc32c of the plan section */
	uint64_t plan_offset;    /* multiple of B, outside objects and table */
	uint64_t plan_length;    /* bytes of the plan section (no padding) */
	uint8_t reserved[100];   /* zero */
	uint32_t crc;            /* crc32c of the bytes before this field */
};
_Static_assert(sizeof(struct nf_store_sb_disk) == 256, "superblock is 256 bytes");
_Static_assert(offsetof(struct nf_store_sb_disk, plan_crc) == 132 &&
	       offsetof(struct nf_store_sb_disk, plan_offset) == 136 &&
	       offsetof(struct nf_store_sb_disk, plan_length) == 144, "plan fields (docs/FORMAT.md item 5)");
_Static_assert(offsetof(struct nf_store_sb_disk, profile_offset) == 112 &&
	       offsetof(struct nf_store_sb_disk, crc) == 252, "superblock field offsets (docs/FORMAT.md item 5)");

/* One object table entry. kind is enum nf_store_kind. Fields marked FFN are
 * zero for dense objects. */
struct nf_store_obj_disk {
	char name[NF_STORE_NAME_MAX];     /* NUL-terminated, NUL-padded */
	uint32_t kind;                    /* enum nf_store_kind */
	uint32_t dtype;                   /* enum nf_dtype (ggml type id) */
	uint32_t n_dims;                  /* 1..4 */
	uint32_t flags;                   /* NF_STORE_OBJ_* */
	uint64_t shape[NF_STORE_MAX_DIMS];/* ggml order: shape[0] is the row length */
	uint64_t offset;                  /* first data byte, multiple of B */
	uint64_t length;                  /* data bytes (FFN: n_bundles * stride) */
	uint32_t crc;                     /* dense: crc32c of the data; FFN: of its aux arrays */
	uint32_t layer;                   /* FFN */
	uint32_t expert;                  /* FFN */
	uint32_t n_bundles;               /* FFN: neurons */
	uint32_t dim;                     /* FFN: values per gate/up row and down column */
	uint32_t bundle_bytes;            /* FFN: payload bytes of one bundle */
	uint32_t stride;                  /* FFN: bytes from one bundle to the next, multiple of B */
	uint32_t extent_bundles;          /* FFN: bundles per extent (the last may hold fewer) */
	uint32_t n_extents;               /* FFN */
	uint32_t down_dtype;              /* FFN with NF_STORE_OBJ_DOWN_DTYPE, else 0 */
	uint64_t aux_offset;              /* FFN: u32 extent_crc[n_extents], u32 perm[n_bundles] */
	uint64_t aux_length;              /* FFN: 4 * (n_extents + n_bundles) */
	uint64_t bcrc_offset;             /* FFN: u32 bundle_crc[n_bundles] in the table, or 0 (item 22) */
	uint32_t bcrc_crc;                /* FFN: crc32c of that array */
	uint8_t reserved[60];             /* zero */
};
_Static_assert(sizeof(struct nf_store_obj_disk) == 256, "object entry is 256 bytes");
_Static_assert(offsetof(struct nf_store_obj_disk, bcrc_offset) == 184 &&
	       offsetof(struct nf_store_obj_disk, bcrc_crc) == 192, "bundle checksum fields (docs/FORMAT.md item 9)");

/* The profile section (docs/FORMAT.md item 19): this header, then n_ffn
 * entries, then each entry's n_bundles u32 counts, indexed by neuron id. */
#define NF_STORE_PROFILE_MAGIC   0x4c49464f5250464eULL  /* "NFPROFIL" */
#define NF_STORE_PROFILE_VERSION 1u
struct nf_store_profile_disk {
	uint64_t magic;          /* NF_STORE_PROFILE_MAGIC */
	uint32_t version;        /* NF_STORE_PROFILE_VERSION */
	uint32_t n_ffn;          /* entries */
	uint64_t tokens;         /* calibration tokens counted */
	uint32_t source;         /* enum nf_store_profile_source */
	uint32_t flags;          /* NF_STORE_PROFILE_F_* (unknown bits ignored) */
	uint64_t created_ns;     /* CLOCK_REALTIME when counted */
	uint8_t reserved[24];    /* zero */
};
_Static_assert(sizeof(struct nf_store_profile_disk) == 64, "profile header is 64 bytes");
/* flags: after every entry's counts, the same entries' layout orders
 * (n_bundles neuron ids each, a permutation), in the same order */
#define NF_STORE_PROFILE_F_ORDER 1u
struct nf_store_profile_entry_disk {
	uint32_t obj_index;      /* an FFN object of the table */
	uint32_t n_bundles;      /* its neurons: counts that follow */
};
_Static_assert(sizeof(struct nf_store_profile_entry_disk) == 8, "profile entry is 8 bytes");

/* The plan section (docs/FORMAT.md item 20): this header, the device
 * points, the kernel rates, then the plan entries by budget. Doubles are
 * IEEE 754 binary64, little-endian. */
#define NF_STORE_PLAN_MAGIC   0x31534e414c50464eULL  /* "NFPLANS1" */
#define NF_STORE_PLAN_VERSION 1u
struct nf_store_plan_disk {
	uint64_t magic;          /* NF_STORE_PLAN_MAGIC */
	uint32_t version;        /* NF_STORE_PLAN_VERSION */
	uint32_t n_points;       /* device points that follow */
	uint32_t n_rates;        /* kernel rates after them */
	uint32_t n_entries;      /* plans after them */
	uint64_t created_ns;     /* CLOCK_REALTIME when measured */
	uint64_t mem_read_gbs;   /* double: memory-read bandwidth, GB/s */
	uint8_t reserved[24];    /* zero */
};
_Static_assert(sizeof(struct nf_store_plan_disk) == 64, "plan header is 64 bytes");
struct nf_store_plan_point_disk {
	uint32_t req_bytes, qd;
	uint64_t mb_s, cpu_us, lat_us;   /* doubles */
};
_Static_assert(sizeof(struct nf_store_plan_point_disk) == 32, "plan device point is 32 bytes");
struct nf_store_plan_rate_disk {
	uint32_t dtype, threads;
	uint64_t gb_s;                   /* double */
};
_Static_assert(sizeof(struct nf_store_plan_rate_disk) == 16, "plan kernel rate is 16 bytes");
struct nf_store_plan_entry_disk {
	uint64_t budget;
	uint32_t n_ctx, kv_type, n_batch, n_threads, qd, read_gap, cold_slots, attn_pin, flags, hot_slots;
	uint64_t pred[8];                /* doubles: tok/s, I/O wait share, bytes, reads, t_dense, t_ffn, t_io, t_token */
	uint8_t reserved[16];            /* zero */
};
_Static_assert(sizeof(struct nf_store_plan_entry_disk) == 128, "plan entry is 128 bytes");

struct nf_store_object;
struct nf_store_info;
struct nf_store_profile;

/* The profile section of p for a store of block size bs: a malloc'd
 * buffer of *len bytes (rounded up to bs, zero padded), its crc32c over
 * the unpadded *used bytes. */
int nf_store_profile_encode(const struct nf_store_profile *p, uint32_t bs, uint8_t **out,
			    uint64_t *len, uint64_t *used, uint32_t *crc);

/* Shared by the reader and the writers (store.c). */
uint32_t nf_store_sb_crc(const struct nf_store_sb_disk *sb);
void nf_store_obj_encode(const struct nf_store_object *o, struct nf_store_obj_disk *e);
/* The object table (entries, then FFN aux arrays from each object's
 * extent_crc and perm) in a malloc'd buffer, its length and crc32c. */
int nf_store_table_encode(const struct nf_store_object *const *objs, uint32_t n, uint8_t **out,
			  uint64_t *len, uint32_t *crc);
/* A sealed superblock from in (generation, sizes, table) and table_crc. */
void nf_store_sb_build(struct nf_store_sb_disk *sb, const struct nf_store_info *in, uint32_t table_crc);
/* data_start for block size bs. */
static inline uint64_t nf_store_data_start(uint32_t bs)
{
	return bs > NF_STORE_SB_AREA ? bs : NF_STORE_SB_AREA;
}

/* Read a section of the store s ([off, off + len), checked against crc;
 * what names it in errors) into a new buffer *out (free()). */
int nf_store_section_read(const struct nf_store *s, uint64_t off, uint64_t len, uint32_t crc, const char *what,
			  uint8_t **out, struct nf_diag *d);

/* The plan section (storage/store_plan.c): check p as a reader would
 * (NF_EPLAN naming the field), encode it padded to bs. */
struct nf_store_plan;
int nf_store_plan_check(const struct nf_store_plan *p, const char *path, struct nf_diag *d);
int nf_store_plan_encode(const struct nf_store_plan *p, uint32_t bs, uint8_t **out, uint64_t *len, uint64_t *used,
			 uint32_t *crc);

#endif /* NFLASH_STORE_FORMAT_H */
