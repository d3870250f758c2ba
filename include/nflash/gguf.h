/*
 * nflash/gguf.h - GGUF reader and writer (llama.cpp's and PowerInfer's files).
 *
 * The reader parses GGUF v2 and v3 (little-endian), and PowerInfer's flavour,
 * which is GGUF with the magic "PWRI". Every length, count, offset, type and
 * shape is validated before use; a bad file gives a negative NF_E* code and a
 * diagnostic naming the field, never an out-of-bounds read.
 *
 *	struct nf_gguf *g;
 *	struct nf_diag d = {0};
 *	int rc = nf_gguf_open("model.gguf", NF_GGUF_MMAP, &g, &d);
 *	if (rc < 0) { fprintf(stderr, "%s\n", nf_diag_msg(&d, rc)); return rc; }
 *	uint32_t n_embd;
 *	nf_gguf_get_u32(g, "llama.embedding_length", &n_embd);
 *	const struct nf_gguf_tensor *t = nf_gguf_find_tensor(g, "token_embd.weight");
 *	// t->data points into the mapping (NF_GGUF_MMAP), else nf_gguf_read_tensor()
 *	nf_gguf_close(g);
 *
 * The writer streams a file: declare key/values and tensor infos, then write
 * tensor data in declaration order. It writes a temporary file beside the
 * final name and renames it only in nf_gguf_writer_finish(), after fsync,
 * so an interrupted write never leaves a file under the final name.
 *
 * Thread-safety: a reader is immutable after open; concurrent lookups and
 * reads are safe. A writer is used by one thread.
 */
#ifndef NFLASH_GGUF_H
#define NFLASH_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nflash/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Value types, as numbered in the GGUF specification. */
enum nf_gguf_type {
	NF_GGUF_UINT8 = 0, NF_GGUF_INT8 = 1, NF_GGUF_UINT16 = 2, NF_GGUF_INT16 = 3,
	NF_GGUF_UINT32 = 4, NF_GGUF_INT32 = 5, NF_GGUF_FLOAT32 = 6, NF_GGUF_BOOL = 7,
	NF_GGUF_STRING = 8, NF_GGUF_ARRAY = 9, NF_GGUF_UINT64 = 10, NF_GGUF_INT64 = 11,
	NF_GGUF_FLOAT64 = 12,
};

struct nf_gguf; /* a parsed file; opaque */

#define NF_GGUF_MAX_DIMS 4
#define NF_GGUF_DEFAULT_ALIGNMENT 32

/* One key/value. Strings are NUL-terminated copies owned by the reader. */
struct nf_gguf_kv {
	const char *key;
	uint32_t type;            /* enum nf_gguf_type */
	union {
		uint64_t u64;     /* any unsigned integer type, widened */
		int64_t i64;      /* any signed integer type, widened */
		double f64;       /* FLOAT32 or FLOAT64, widened */
		bool b;
		const char *str;  /* STRING */
	} v;
	/* ARRAY only: element type and count. Numeric elements are at arr_data,
	 * packed little-endian as in the file (use nf_gguf_arr_* to read them);
	 * string elements are reached with nf_gguf_arr_str(). */
	uint32_t arr_type;
	uint64_t arr_n;
	const void *arr_data;
};

struct nf_gguf_tensor {
	const char *name;
	uint32_t n_dims;
	uint64_t ne[NF_GGUF_MAX_DIMS]; /* ne[0] is the row length (fastest); unused dims are 1 */
	uint32_t type;                 /* enum nf_dtype (ggml type id), validated */
	uint64_t offset;               /* absolute file offset of the data */
	uint64_t size;                 /* bytes of data */
	const void *data;              /* into the mapping with NF_GGUF_MMAP, else NULL */
};

enum nf_gguf_flags {
	NF_GGUF_MMAP = 1 << 0, /* map the tensor data read-only (MAP_PRIVATE) */
};

/*
 * nf_gguf_open - parse the file at path. flags: NF_GGUF_MMAP or 0.
 * Returns 0 and sets *out, or a negative code with *out untouched and, if
 * diag is given, a message naming the file and the bad field. Tensor types
 * other than F32/F16/BF16/Q8_0/Q4_0 give NF_EUNSUPPORTED naming the tensor.
 * The caller closes *out with nf_gguf_close().
 */
int nf_gguf_open(const char *path, unsigned flags, struct nf_gguf **out, struct nf_diag *diag);
/* The same with every system call (open, fstat, mmap, pread, close) made
 * through sys (NULL: nf_io_sys_default), so tests can make them fail. */
struct nf_io_sys;
int nf_gguf_open_sys(const char *path, unsigned flags, const struct nf_io_sys *sys,
		     struct nf_gguf **out, struct nf_diag *diag);

/*
 * nf_gguf_open_mem - parse a GGUF image in memory (len bytes at buf, which
 * must outlive the reader). Tensor data pointers point into buf. Used by
 * the fuzz target and by tests.
 */
int nf_gguf_open_mem(const void *buf, size_t len, struct nf_gguf **out, struct nf_diag *diag);

/* nf_gguf_close - unmap and free everything. Accepts NULL. */
void nf_gguf_close(struct nf_gguf *g);

uint32_t nf_gguf_version(const struct nf_gguf *g);
bool nf_gguf_is_powerinfer(const struct nf_gguf *g);   /* magic "PWRI" */
uint64_t nf_gguf_alignment(const struct nf_gguf *g);
uint64_t nf_gguf_data_offset(const struct nf_gguf *g);  /* start of tensor data */
uint64_t nf_gguf_file_size(const struct nf_gguf *g);
const char *nf_gguf_path(const struct nf_gguf *g);      /* "<memory>" for open_mem */

/* The descriptor the reader keeps open (read-only), e.g. for O_DIRECT reads
 * of its own; -1 for open_mem. Owned by the reader. */
int nf_gguf_fd(const struct nf_gguf *g);

/* Names of value types ("uint32", ..., "unknown") and their sizes in bytes
 * (0 for STRING, ARRAY and unknown types). Pure, thread-safe. */
const char *nf_gguf_type_name(uint32_t type);
size_t nf_gguf_type_size(uint32_t type);
/* ggml's name for a tensor type id ("q4_K", "iq2_xs", ...), "unknown" if none. */
const char *nf_gguf_ggml_type_name(uint32_t ggml_type);

size_t nf_gguf_n_kv(const struct nf_gguf *g);
const struct nf_gguf_kv *nf_gguf_kv_at(const struct nf_gguf *g, size_t i);
const struct nf_gguf_kv *nf_gguf_find_kv(const struct nf_gguf *g, const char *key);

/*
 * Typed getters: 0 on success, NF_ENOTFOUND if the key is absent, NF_EFORMAT
 * if it has another type or does not fit (any integer type is accepted for
 * the integer getters if the value is in range; any float type for f32).
 */
int nf_gguf_get_u32(const struct nf_gguf *g, const char *key, uint32_t *out);
int nf_gguf_get_u64(const struct nf_gguf *g, const char *key, uint64_t *out);
int nf_gguf_get_f32(const struct nf_gguf *g, const char *key, float *out);
int nf_gguf_get_bool(const struct nf_gguf *g, const char *key, bool *out);
int nf_gguf_get_str(const struct nf_gguf *g, const char *key, const char **out);
/* An array key: element type and count; NF_EFORMAT if not an array. */
int nf_gguf_get_arr(const struct nf_gguf *g, const char *key, const struct nf_gguf_kv **out);

/* Array element i, converted; i must be < kv->arr_n and the element type compatible. */
const char *nf_gguf_arr_str(const struct nf_gguf_kv *kv, uint64_t i, uint64_t *len);
float nf_gguf_arr_f32(const struct nf_gguf_kv *kv, uint64_t i);
int64_t nf_gguf_arr_i64(const struct nf_gguf_kv *kv, uint64_t i);

size_t nf_gguf_n_tensors(const struct nf_gguf *g);
const struct nf_gguf_tensor *nf_gguf_tensor_at(const struct nf_gguf *g, size_t i);
/* NULL if absent. */
const struct nf_gguf_tensor *nf_gguf_find_tensor(const struct nf_gguf *g, const char *name);

/*
 * nf_gguf_read_tensor - copy bytes [off, off+len) of tensor t's data into
 * buf with pread (or memcpy for a mapping). NF_EFORMAT if out of range,
 * -errno on I/O error, NF_ESHORT on a short read.
 */
int nf_gguf_read_tensor(const struct nf_gguf *g, const struct nf_gguf_tensor *t,
			uint64_t off, void *buf, size_t len);

/* ---- writer ------------------------------------------------------------ */

struct nf_gguf_writer;

/*
 * nf_gguf_writer_open - start writing path (through a temporary file in the
 * same directory). powerinfer selects the "PWRI" magic. Version 3.
 */
int nf_gguf_writer_open(const char *path, bool powerinfer, struct nf_gguf_writer **out,
			struct nf_diag *diag);
/* The same with every system call (open, pwrite, fsync, close, rename,
 * unlink) made through sys (NULL: nf_io_sys_default). */
int nf_gguf_writer_open_sys(const char *path, bool powerinfer, const struct nf_io_sys *sys,
			    struct nf_gguf_writer **out, struct nf_diag *diag);

/*
 * Key/values, in the order they should appear, all before the first
 * nf_gguf_writer_write(). Strings are copied. A key "general.alignment"
 * (uint32, a power of two, declared before any tensor) sets the data
 * alignment, else it is 32.
 * Each writer function returns 0, NF_EUSAGE (duplicate key or tensor name,
 * declaration after data, bad type or shape, more data than declared),
 * NF_EUNSUPPORTED (tensor type not readable by nflash), -ENOMEM, or -errno
 * from the file system. Errors stick: after a failure every later call
 * returns the same error and nf_gguf_writer_finish() removes the file.
 */
int nf_gguf_writer_kv_u32(struct nf_gguf_writer *w, const char *key, uint32_t v);
int nf_gguf_writer_kv_i32(struct nf_gguf_writer *w, const char *key, int32_t v);
int nf_gguf_writer_kv_u64(struct nf_gguf_writer *w, const char *key, uint64_t v);
int nf_gguf_writer_kv_f32(struct nf_gguf_writer *w, const char *key, float v);
int nf_gguf_writer_kv_bool(struct nf_gguf_writer *w, const char *key, bool v);
int nf_gguf_writer_kv_str(struct nf_gguf_writer *w, const char *key, const char *v);
int nf_gguf_writer_kv_arr_str(struct nf_gguf_writer *w, const char *key,
			      const char *const *v, uint64_t n);
int nf_gguf_writer_kv_arr_f32(struct nf_gguf_writer *w, const char *key, const float *v, uint64_t n);
int nf_gguf_writer_kv_arr_i32(struct nf_gguf_writer *w, const char *key, const int32_t *v, uint64_t n);

/* Any scalar of a numeric or bool type (type is enum nf_gguf_type, not STRING
 * or ARRAY); val points to the value in host (little-endian) layout. */
int nf_gguf_writer_kv_scalar(struct nf_gguf_writer *w, const char *key, uint32_t type,
			     const void *val);
/* An array of n numeric or bool elements of type elem_type, packed. */
int nf_gguf_writer_kv_arr(struct nf_gguf_writer *w, const char *key, uint32_t elem_type,
			  const void *data, uint64_t n);
/* Copy a key/value read by a reader (any type), e.g. to carry the vocabulary
 * over when converting a file. */
int nf_gguf_writer_kv_copy(struct nf_gguf_writer *w, const struct nf_gguf_kv *kv);

/*
 * nf_gguf_writer_tensor - declare a tensor (all before any data). ne[0] is
 * the row length and must be a multiple of the type's block length.
 */
int nf_gguf_writer_tensor(struct nf_gguf_writer *w, const char *name, uint32_t type,
			  uint32_t n_dims, const uint64_t *ne);

/*
 * nf_gguf_writer_write - append data for the tensors in declaration order;
 * may be called with any chunking. The header is written on the first call;
 * padding between tensors is inserted automatically.
 */
int nf_gguf_writer_write(struct nf_gguf_writer *w, const void *buf, size_t len);

/*
 * nf_gguf_writer_finish - check every declared byte was written, fsync,
 * rename to the final name, fsync the directory, free w. On failure the
 * temporary file is removed and w is freed.
 */
int nf_gguf_writer_finish(struct nf_gguf_writer *w, struct nf_diag *diag);

/* nf_gguf_writer_abort - remove the temporary file and free w. Accepts NULL. */
void nf_gguf_writer_abort(struct nf_gguf_writer *w);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_GGUF_H */
