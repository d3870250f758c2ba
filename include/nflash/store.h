/*
 * nflash/store.h - the store: one file holding a model laid out for flash.
 *
 * A store holds named dense objects (embeddings, attention matrices, norms,
 * predictors, output) and FFN objects, one per (layer, expert). An FFN
 * object is N neuron bundles: bundle i holds gate row i, up row i and down
 * column i in the model's type (up and down only for FFNs without a gate),
 * padded to a stride that is a multiple of the block size. Bundles are
 * grouped into extents, the unit that is read, cached and checksummed;
 * a permutation maps neuron ids to bundle slots. docs/FORMAT.md has the
 * byte layout.
 *
 * Reading (metadata only; data goes through nflash/io.h):
 *
 *	struct nf_store *s;
 *	if (nf_store_open("model.nfs", NULL, &s, &diag) < 0) ...
 *	const struct nf_store_object *ffn = nf_store_ffn_find(s, layer, 0);
 *	uint32_t slot = ffn->perm[neuron];
 *	uint64_t off = nf_store_bundle_offset(ffn, slot);
 *	nf_store_close(s);
 *
 * Writing streams: declare every object, begin, write the objects' bytes in
 * declaration order, finish. The file appears under its name only when
 * finish succeeded (temporary file, fsync, rename, fsync of the directory).
 *
 *	struct nf_store_writer *w;
 *	nf_store_writer_open("out.nfs", NULL, &w, &diag);
 *	nf_store_writer_add_dense(w, "token_embd.weight", NF_DTYPE_Q4_0, 2, shape, &diag);
 *	nf_store_writer_add_ffn(w, "blk.0.ffn", 0, 0, NF_DTYPE_Q4_0, 4096, 11008, true, 0, &diag);
 *	nf_store_writer_begin(w, &diag);
 *	nf_store_writer_write_dense(w, bytes, n);      // any number of calls
 *	nf_store_writer_write_bundle(w, gate, up, down); // 11008 calls
 *	nf_store_writer_finish(w, &diag);
 *	nf_store_writer_close(w);
 *
 * Thread-safety: a store is read-only after open and may be shared by
 * threads; a writer is used by one thread.
 */
#ifndef NFLASH_STORE_H
#define NFLASH_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"
#include "nflash/io.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Stored on disk: only ever append. */
enum nf_store_kind {
	NF_STORE_KIND_DENSE = 1,
	NF_STORE_KIND_FFN = 2,
	NF_STORE_KIND_BLOB = 3,    /* opaque bytes, e.g. the GGUF metadata (docs/FORMAT.md 17) */
};

/* The blob holding a store's GGUF metadata (docs/FORMAT.md item 17). */
#define NF_STORE_META_NAME "gguf.metadata"

/* "dense", "ffn", "blob" or "unknown". */
const char *nf_store_kind_name(uint32_t kind);

#define NF_STORE_BLOCK_DEFAULT 4096u
#define NF_STORE_BLOCK_MIN 512u
#define NF_STORE_BLOCK_MAX (1u << 20)

/* One object, decoded. Pointers are owned by the store or writer. */
struct nf_store_object {
	char name[64];
	uint32_t index;            /* position in the object table */
	uint32_t kind;             /* enum nf_store_kind */
	uint32_t dtype;            /* enum nf_dtype */
	uint32_t n_dims;
	uint64_t shape[4];         /* ggml order; FFN: {dim, n_bundles, 2 or 3} */
	uint64_t offset;           /* first byte in the file */
	uint64_t length;           /* data bytes */
	uint32_t crc;              /* dense: crc32c of the data */
	/* FFN objects only */
	uint32_t layer, expert;
	uint32_t n_bundles;
	uint32_t dim;              /* values per gate/up row and down column */
	bool has_gate;
	uint32_t row_bytes;        /* bytes of one row of dim values */
	uint32_t bundle_bytes;     /* payload: down_off + down_bytes */
	uint32_t stride;           /* bundle i starts at offset + i * stride */
	uint32_t extent_bundles;   /* bundles per extent; the last may hold fewer */
	uint32_t n_extents;
	const uint32_t *extent_crc;/* [n_extents]: crc32c of each extent's bytes */
	const uint32_t *perm;      /* [n_bundles]: neuron id -> bundle slot */
	const uint32_t *bundle_crc;/* [n_bundles] by slot: crc32c of the bundle's bundle_bytes,
				    * or NULL (a store from before docs/FORMAT.md item 22) */
	/* The down part of a bundle (nflash/bundle.h): ROW (a row of dim values
	 * in down_dtype, which is dtype unless the store says otherwise) or QCOL
	 * (quants only; scales in the dense object nf_store_ffn_scales()). */
	uint32_t down_form;        /* enum nf_down_form */
	uint32_t down_dtype;       /* enum nf_dtype */
	uint32_t down_off;         /* byte offset of the down part in a bundle */
	uint32_t down_bytes;
	bool down_transposed;      /* the source was PowerInfer's ffn_down_t */
};

struct nf_store_info {
	uint32_t version;
	uint64_t generation;       /* of the superblock in use */
	int sb_slot;               /* 0 or 1 */
	int other_sb_error;        /* 0, or why the other copy was not usable */
	uint64_t compat, incompat;
	uint32_t block_size;
	uint64_t file_size;
	uint64_t data_start;
	uint64_t table_offset, table_length;
	uint32_t table_crc;
	uint32_t n_objects, n_ffn;
	uint64_t created_ns;
	uint8_t uuid[16];
	/* the profile section (docs/FORMAT.md item 19); length 0: none */
	uint64_t profile_offset, profile_length;
	uint32_t profile_crc;
	/* the plan section (docs/FORMAT.md item 20); length 0: none */
	uint64_t plan_offset, plan_length;
	uint32_t plan_crc;
};

struct nf_store;

struct nf_store_open_opts {
	const struct nf_io_sys *sys;   /* NULL: nf_io_sys_default */
};

/*
 * nf_store_open - open and validate a store: both superblocks (the valid
 * one with the higher generation is used), the object table and every
 * object's bounds and geometry. Data is not read. Returns 0 and *out, or
 * NF_EMAGIC, NF_EVERSION, NF_EINCOMPAT, NF_ECHECKSUM, NF_ETRUNCATED,
 * NF_EFORMAT or a negative errno, with d naming the file and the field.
 */
int nf_store_open(const char *path, const struct nf_store_open_opts *o, struct nf_store **out,
		  struct nf_diag *d);
/* Frees the store. NULL is allowed. */
void nf_store_close(struct nf_store *s);

/*
 * nf_store_probe - does path look like a store, by the test nf_store_open
 * makes first: the store magic (either byte order) in superblock 0 or in
 * superblock 1? A store whose superblock 0 is damaged is still a store (it
 * opens from superblock 1). Nothing is validated; false when path cannot be
 * read. Thread-safe.
 */
bool nf_store_probe(const char *path);

const struct nf_store_info *nf_store_info(const struct nf_store *s);
/* What an open store holds in memory: its object table (permutations,
 * bundle and extent checksums) and the parsed objects. */
uint64_t nf_store_mem_bytes(const struct nf_store *s);
const char *nf_store_path(const struct nf_store *s);
const struct nf_io_sys *nf_store_sys(const struct nf_store *s);
uint32_t nf_store_object_count(const struct nf_store *s);
/* Object i (0 <= i < count), else NULL. */
const struct nf_store_object *nf_store_object_get(const struct nf_store *s, uint32_t i);
/* By name or by (layer, expert); NULL when absent. */
const struct nf_store_object *nf_store_object_find(const struct nf_store *s, const char *name);
const struct nf_store_object *nf_store_ffn_find(const struct nf_store *s, uint32_t layer,
						uint32_t expert);

struct nf_bundle_layout;
/* The bundle layout of FFN object obj (for nf_bundle_pack and the sparse FFN). */
void nf_store_ffn_layout(const struct nf_store_object *obj, struct nf_bundle_layout *out);
/* The dense object holding the fp16 down scales of a QCOL FFN object: named
 * "<ffn name>.down_scales", n_embd x n_ff/32 f16 (nflash/bundle.h); NULL
 * when obj is not QCOL or the object is absent. */
const struct nf_store_object *nf_store_ffn_scales(const struct nf_store *s,
						  const struct nf_store_object *obj);
/* Suffix of the dense object holding an FFN's gate rows in neuron-id order
 * (`nflash import --gate-objects`): "<ffn name>.gate_rows", the gate's
 * dtype, shape {dim, n_neurons}. Gate-first exact mode reads it whole, then
 * only the bundles of neurons whose gate is positive; a model's load never
 * pins it. */
#define NF_STORE_GATE_ROWS_SUFFIX ".gate_rows"
/* FFN object obj's gate-rows object, or NULL (none, no gate, or a shape,
 * dtype or length that does not match obj). */
const struct nf_store_object *nf_store_ffn_gate_rows(const struct nf_store *s, const struct nf_store_object *obj);
/* Whether name is a gate-rows object's (ends with the suffix). */
bool nf_store_is_gate_rows_name(const char *name);

/* Bytes a buffer needs to read the whole object (length rounded up to the block size). */
uint64_t nf_store_object_buf_size(const struct nf_store_object *obj, uint32_t block_size);
/* File offset of bundle slot i. */
uint64_t nf_store_bundle_offset(const struct nf_store_object *obj, uint32_t slot);
/* First slot and count of bundles of extent e. */
void nf_store_extent_bundles(const struct nf_store_object *obj, uint32_t e, uint32_t *first,
			     uint32_t *count);
/* File offset and byte length of extent e. */
void nf_store_extent_span(const struct nf_store_object *obj, uint32_t e, uint64_t *offset,
			  uint64_t *length);
/* 0 if buf (extent e's bytes) matches its crc32c, else NF_ECHECKSUM. */
int nf_store_extent_check(const struct nf_store_object *obj, uint32_t e, const void *buf);
/* 0 if buf (a dense object's length bytes) matches its crc32c, else NF_ECHECKSUM. */
int nf_store_object_check(const struct nf_store_object *obj, const void *buf);
/* 0 if buf (bundle slot's bytes) matches its crc32c, NF_ECHECKSUM if not;
 * 1 when the store has no bundle checksums (nothing was checked). */
int nf_store_bundle_check(const struct nf_store_object *obj, uint32_t slot, const void *buf);

/* ---- writing ------------------------------------------------------------ */

struct nf_store_create_opts {
	uint32_t block_size;       /* bundle alignment, power of two in [512, 1 MiB]; 0: 4096 */
	uint32_t extent_bundles;   /* default bundles per extent; 0: 16 */
	const struct nf_io_sys *sys;  /* NULL: nf_io_sys_default */
};

struct nf_store_writer;

/*
 * nf_store_writer_open - start creating a store at path. Creates a
 * temporary file in the same directory; nothing appears under path until
 * nf_store_writer_finish() succeeds. Returns 0 and *out, or a negative
 * error (d says why). Close the writer in every case after success.
 */
int nf_store_writer_open(const char *path, const struct nf_store_create_opts *o,
			 struct nf_store_writer **out, struct nf_diag *d);

/*
 * Declare objects, in the order their bytes will be written. Names are
 * unique, 1..63 bytes. shape is in ggml order (shape[0] a row); shape[0]
 * must be a multiple of the dtype's block length. extent_bundles 0 takes
 * the writer's default. Return 0, NF_EUSAGE or NF_EFORMAT (d says why), or
 * -ENOMEM.
 */
int nf_store_writer_add_dense(struct nf_store_writer *w, const char *name, uint32_t dtype,
			      uint32_t n_dims, const uint64_t *shape, struct nf_diag *d);
int nf_store_writer_add_ffn(struct nf_store_writer *w, const char *name, uint32_t layer,
			    uint32_t expert, uint32_t dtype, uint32_t dim, uint32_t n_bundles,
			    bool has_gate, uint32_t extent_bundles, struct nf_diag *d);
/* An FFN object with the bundle layout L (from nf_bundle_layout_make() with
 * the writer's block size: L->stride must be bundle_bytes rounded up to
 * it). down_transposed records that the source was ffn_down_t. Other
 * forms than ROW with down_dtype == dtype set an incompat bit. */
int nf_store_writer_add_ffn_layout(struct nf_store_writer *w, const char *name, uint32_t layer,
				   uint32_t expert, const struct nf_bundle_layout *L,
				   bool down_transposed, uint32_t extent_bundles, struct nf_diag *d);
/* A blob of len bytes (> 0), written with nf_store_writer_write_dense(). */
int nf_store_writer_add_blob(struct nf_store_writer *w, const char *name, uint64_t len,
			     struct nf_diag *d);

/* Fix the layout; after it, objects are written in declaration order. */
int nf_store_writer_begin(struct nf_store_writer *w, struct nf_diag *d);

/* Objects as laid out by begin(), index 0..count-1 (offsets are final). */
uint32_t nf_store_writer_object_count(const struct nf_store_writer *w);
const struct nf_store_object *nf_store_writer_object(const struct nf_store_writer *w, uint32_t i);

/*
 * Write the next bytes of the current dense (or blob) object; len may be any size
 * up to what is left of it. Returns 0, NF_EUSAGE (current object is an FFN
 * or too many bytes) or the writer's sticky I/O error.
 */
int nf_store_writer_write_dense(struct nf_store_writer *w, const void *data, size_t len);
/* Write the next bundle of the current FFN object: row_bytes for gate and
 * up, down_bytes for down; gate must be NULL exactly when the FFN has no
 * gate. */
int nf_store_writer_write_bundle(struct nf_store_writer *w, const void *gate, const void *up,
				 const void *down);
/* Write the next n bundles of the current FFN object, given laid out at the
 * object's stride (padding bytes are written as zeros whatever they hold). */
int nf_store_writer_write_bundles(struct nf_store_writer *w, const void *bundles, uint32_t n);
/* Replace FFN object i's permutation (neuron -> slot; must be a bijection). */
int nf_store_writer_set_perm(struct nf_store_writer *w, uint32_t i, const uint32_t *perm,
			     struct nf_diag *d);

/* Bytes of object data declared, and written so far (for progress). */
uint64_t nf_store_writer_total(const struct nf_store_writer *w);
uint64_t nf_store_writer_done(const struct nf_store_writer *w);

/*
 * nf_store_writer_finish - check every object was written, write the
 * object table and both superblocks, fsync, rename into place and fsync
 * the directory. Returns 0, or an error after which nothing is under path
 * (the temporary file is removed by close).
 */
int nf_store_writer_finish(struct nf_store_writer *w, struct nf_diag *d);
/* Free the writer; removes the temporary file unless finish succeeded. NULL allowed. */
void nf_store_writer_close(struct nf_store_writer *w);

/* ---- updating in place ------------------------------------------------------ */

/*
 * nf_store_update_perm - replace FFN object obj_index's neuron -> slot map
 * in the store at path, in place, as a new generation: the new object table
 * is appended after the current end of the file and fsync'd, then the
 * superblock of generation g + 1 is written over the older of the two
 * copies (slot (g + 1) % 2) and fsync'd. A crash at any point leaves the
 * store readable at generation g or g + 1. The caller must have moved the
 * bundles to match (a relayout); data is not touched here. Regular files
 * only (the file grows by the table). Returns 0, or a negative error with d
 * naming the cause (the store is then unchanged at generation g, or
 * complete at g + 1 if only the final fsync failed).
 */
int nf_store_update_perm(const char *path, const struct nf_store_open_opts *o, uint32_t obj_index,
			 const uint32_t *perm, struct nf_diag *d);

/* ---- activation profile ------------------------------------------------------ */

/*
 * A profile: per FFN object, how often each neuron fired over some
 * calibration tokens (docs/FORMAT.md item 19). The segmented cache
 * preloads each layer's most frequent neurons from it; a relayout puts
 * them first in the file. Counts are indexed by neuron id, so they survive
 * a relayout unchanged.
 */

/* What "fired" meant when counting. Stored on disk: only ever append. */
enum nf_store_profile_source {
	NF_STORE_PROFILE_UNKNOWN = 0,
	NF_STORE_PROFILE_PREDICTOR = 1,   /* predicted active */
	NF_STORE_PROFILE_EXACT = 2,       /* requested by the exact mode (see docs/PIPELINE.md) */
	NF_STORE_PROFILE_DENSE = 3,       /* every neuron (no information) */
};
/* "unknown", "predictor", "exact", "dense". */
const char *nf_store_profile_source_name(uint32_t source);

struct nf_store_profile {
	uint64_t tokens;           /* calibration tokens counted */
	uint32_t source;           /* enum nf_store_profile_source */
	uint64_t created_ns;
	uint32_t n_objects;        /* entries of counts: the store's object count */
	uint32_t **counts;         /* [n_objects]: FFN object i's n_bundles counts, else NULL */
	/* [n_objects] or NULL: FFN object i's suggested bundle order (neuron
	 * ids by store slot, a permutation of its n_bundles neurons: the most
	 * frequent first, then co-activated neurons next to each other; see
	 * nf_coact_order), else NULL. Stored when every FFN has one. */
	uint32_t **order;
	uint32_t *lens;            /* [n_objects]: entries of counts[i] (0 when NULL) */
};

/* order[0..n) is a permutation of 0..n-1. */
bool nf_store_profile_order_valid(const uint32_t *order, uint32_t n);

/* True when the store has a profile section (it is read and checked by
 * nf_store_profile_read). */
bool nf_store_has_profile(const struct nf_store *s);

/*
 * nf_store_profile_alloc - a zeroed profile shaped for store s (counts for
 * every FFN object). Returns 0 and *out (free with nf_store_profile_free),
 * or -ENOMEM.
 */
int nf_store_profile_alloc(const struct nf_store *s, struct nf_store_profile **out);
/* Frees p and its counts. NULL allowed. */
void nf_store_profile_free(struct nf_store_profile *p);

/*
 * nf_store_profile_read - read and check store s's profile section (crc,
 * header, every entry naming an FFN object of this store with its neuron
 * count). Returns 0 and *out (free with nf_store_profile_free), -ENOENT
 * when the store has none, NF_ECHECKSUM, NF_EFORMAT, NF_EVERSION or a read
 * error (d names the field). Thread-safe (reads with pread).
 */
int nf_store_profile_read(const struct nf_store *s, struct nf_store_profile **out,
			  struct nf_diag *d);

/*
 * nf_store_update_check - can path be updated in place (opened for writing)?
 * For a long run that updates the store at its end (--profile): it fails
 * before the work, not after. 0, or a negative errno with d saying the store
 * cannot be written (read-only file system, immutable file, no permission).
 */
int nf_store_update_check(const char *path, struct nf_diag *d);

/*
 * nf_store_update_profile - store p (shaped for this store, see
 * nf_store_profile_alloc) in the store at path, in place, as a new
 * generation, as nf_store_update_perm() does: the profile section is
 * appended after the end of the file and fsync'd, then the superblock of
 * generation g + 1 (compat bit NF_STORE_COMPAT_PROFILE, pointing at it) is
 * written over the older copy and fsync'd. A crash leaves the store valid
 * at generation g (the old profile or none) or g + 1. Replaces any earlier
 * profile (its bytes stay in the file, unreferenced). Returns 0 or a
 * negative error with d naming the cause.
 */
int nf_store_update_profile(const char *path, const struct nf_store_open_opts *o,
			    const struct nf_store_profile *p, struct nf_diag *d);

/* Give the store being written a profile (shaped for the writer's objects:
 * n_objects equal, counts for exactly the FFN objects). Copied; any time
 * before finish. Returns 0, NF_EUSAGE or -ENOMEM. */
int nf_store_writer_set_profile(struct nf_store_writer *w, const struct nf_store_profile *p,
				struct nf_diag *d);

/* ---- execution plans ----------------------------------------------------------- */

/*
 * Plans (docs/FORMAT.md item 20): what `nflash plan` measured of the device
 * and the kernels, and for each memory budget it planned, the settings it
 * chose and what it predicted. Plain data; the planner writes it, the engine
 * follows the entry for its budget (nflash/plan.h).
 */
struct nf_store_dev_point {
	uint32_t req_bytes, qd;     /* random O_DIRECT reads of this size at this depth */
	double mb_s;                /* throughput, MB/s (1e6 bytes) */
	double cpu_us;              /* CPU time per request (submit + reap), microseconds */
	double lat_us;              /* mean latency, microseconds */
};
struct nf_store_kernel_rate {
	uint32_t dtype, threads;    /* gemv of this weight type on this many threads */
	double gb_s;                /* weight bytes per second, GB/s */
};
/* Entry flags. Stored on disk: only ever append. */
#define NF_STORE_PLAN_F_STREAM_ATTN 1u  /* attention streamed, not pinned */
#define NF_STORE_PLAN_F_GATE_FIRST 2u   /* exact mode: gate rows first (measured faster) */
#define NF_STORE_PLAN_F_ROUTE_SET 4u    /* route-ahead prefetch decided by measurement: */
#define NF_STORE_PLAN_F_ROUTE_ON 8u     /* on (with ROUTE_SET), else off */
#define NF_STORE_PLAN_F_ALL 15u
struct nf_store_plan_entry {
	uint64_t budget;            /* the memory budget it was planned for, bytes */
	uint32_t n_ctx, kv_type, n_batch, n_threads, qd, read_gap, cold_slots, attn_pin, flags;
	uint32_t hot_slots;         /* bundles the hot segment holds (informational) */
	/* predictions */
	double tok_per_s, io_wait_share, bytes_per_token, reads_per_token;
	/* per token: dense compute; the FFN layers' compute (kernels, the
	 * reads' CPU and checksums, the fixed cost per layer: their time less
	 * the I/O wait, as `--stats` counts compute); their reads; the total */
	double t_dense_s, t_ffn_s, t_io_s, t_token_s;
};
struct nf_store_plan {
	uint64_t created_ns;
	double mem_read_gb_s;
	uint32_t n_points, n_rates, n_entries;
	struct nf_store_dev_point *points;
	struct nf_store_kernel_rate *rates;
	struct nf_store_plan_entry *entries;  /* ascending budgets, no two equal */
};

/* True when the store has a plan section. */
bool nf_store_has_plan(const struct nf_store *s);
/*
 * nf_store_plan_read - read and check store s's plan section (crc, header,
 * lengths, every field in range, budgets ascending). Returns 0 and *out
 * (free with nf_store_plan_free), -ENOENT when there is none, NF_ECHECKSUM,
 * NF_EVERSION, NF_EPLAN (a field out of range: d names it) or a read error.
 * Thread-safe (pread).
 */
int nf_store_plan_read(const struct nf_store *s, struct nf_store_plan **out, struct nf_diag *d);
void nf_store_plan_free(struct nf_store_plan *p);
/* The entry for budget: the one with the largest budget at or below it;
 * NULL if every entry's is larger (or p is NULL). budget 0 (none): the
 * largest. */
const struct nf_store_plan_entry *nf_store_plan_pick(const struct nf_store_plan *p, uint64_t budget);
/*
 * nf_store_update_plan - store p in the store at path, in place, as a new
 * generation, exactly as nf_store_update_profile stores a profile (append,
 * fsync, superblock g + 1, fsync): a crash leaves generation g (the old plans
 * or none) or g + 1. Replaces the earlier section. p is checked as the
 * reader checks it first (NF_EPLAN). Returns 0 or a negative error with d
 * naming the cause.
 */
int nf_store_update_plan(const char *path, const struct nf_store_open_opts *o, const struct nf_store_plan *p,
			 struct nf_diag *d);

/* ---- relayout ------------------------------------------------------------------ */

struct nf_store_relayout_opts {
	const struct nf_store_profile *profile; /* NULL: the input's own (required then) */
	const struct nf_io_sys *sys;            /* NULL: nf_io_sys_default */
	/* Called now and then with bytes written and total; may be NULL. */
	void (*progress)(void *user, uint64_t done, uint64_t total);
	void *progress_user;
	/* Ignore the profile's co-activation order: descending count only
	 * (for comparisons; default false). */
	bool by_count;
	/* The copy's block size, which is its bundle alignment: a power of two
	 * in [NF_STORE_BLOCK_MIN, NF_STORE_BLOCK_MAX] (0: the input's). A
	 * smaller one packs bundles closer (a 7B q4_0 bundle of 6656 bytes
	 * takes 8 KiB at 4096, 7 KiB at 512), so fewer bytes are read and more
	 * bundles fit a cache; reads stay aligned to the device's O_DIRECT
	 * alignment as long as it is no larger. */
	uint32_t block_size;
};

/*
 * nf_store_relayout - write a copy of the store at in to out with each
 * FFN's bundles in the profile's co-activation order where it has one
 * (nf_store_profile.order, unless o->by_count), else in descending profile
 * count (slot 0 the hottest; ties in neuron order), the permutation (neuron -> slot) updated to match, so
 * neuron ids, the maths and every other object are unchanged; the profile
 * is stored in the copy; o->block_size may change the bundle alignment
 * (bundle bytes are unchanged). Crash-safe like every creation (nothing under out
 * unless complete); everything read is checked against its crc32c, and the
 * copy is re-read and checked after it is written. Returns 0, -ENOENT (no
 * profile), or a negative error with d naming the cause.
 */
int nf_store_relayout(const char *in, const char *out, const struct nf_store_relayout_opts *o,
		      struct nf_diag *d);

/* ---- fake stores ---------------------------------------------------------- */

/*
 * A store with a real model's geometry and random contents (valid fp16
 * scales, random quants), for benchmarking the storage layer before a
 * model is imported. Objects: token_embd.weight, output_norm.weight,
 * output.weight, per layer blk.L.attn_norm/attn_q/attn_k/attn_v/
 * attn_output/ffn_norm (.weight) and, with experts > 1, blk.L.ffn_gate_inp;
 * then every FFN as blk.L.ffn (expert 0) or blk.L.ffn.E, so the FFNs are
 * one contiguous run at the end of the data area.
 */
struct nf_store_fake_opts {
	uint32_t layers, dim, ffn, experts, vocab;
	uint32_t dtype;            /* enum nf_dtype of matrices (norms are f32) */
	bool no_gate;              /* FFNs hold up + down only */
	uint64_t seed;
	struct nf_store_create_opts create;
	/* Called now and then with bytes written and total; may be NULL. */
	void (*progress)(void *user, uint64_t done, uint64_t total);
	void *progress_user;
};

/* Defaults: 1 layer, dim 256, ffn 688, 1 expert, vocab 32000, q4_0, seed 1. */
void nf_store_fake_opts_default(struct nf_store_fake_opts *o);

/* Create the fake store at path (crash-safe, as the writer). 0 or a
 * negative error with d saying why; nothing is left under path on error. */
int nf_store_fake_create(const char *path, const struct nf_store_fake_opts *o, struct nf_diag *d);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_STORE_H */
