/*
 * nflash/import.h - GGUF (llama.cpp's or PowerInfer's) to store.
 *
 * The store holds (docs/IMPORT.md, docs/FORMAT.md):
 *  - the blob "gguf.metadata": a GGUF image with every key/value of the
 *    source and no tensors (hyperparameters, vocabulary);
 *  - one dense object per non-FFN tensor, named as the tensor, bytes as in
 *    the file (embeddings, attention, norms, output, router, predictors);
 *  - for each FFN whose ffn_down is Q8_0 or Q4_0 (QCOL form), the dense F16
 *    object "<ffn>.down_scales";
 *  - one FFN object of neuron bundles per layer ("blk.L.ffn") or per
 *    (layer, expert) of the 3-D `_exps` tensors ("blk.L.ffn" for expert 0,
 *    "blk.L.ffn.E" after it), in the bundle layout of nflash/bundle.h;
 *    PowerInfer's ffn_down_t and the regular ffn_down both become down
 *    columns.
 *
 *	struct nf_import_opts o;
 *	nf_import_opts_default(&o);
 *	struct nf_import_report r;
 *	struct nf_diag d = {0};
 *	if (nf_import("m.gguf", "m.nfl", &o, &r, &d) < 0) fprintf(stderr, "%s\n", d.msg);
 *
 * Creation is crash-safe (the store writer's temporary file and rename);
 * after the rename every object is read back with O_DIRECT and its crc32c
 * checked, and a store that fails this is removed again.
 *
 * Thread-safety: nf_import() uses only its arguments; concurrent imports
 * to different outputs are independent.
 */
#ifndef NFLASH_IMPORT_H
#define NFLASH_IMPORT_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "nflash/error.h"
#include "nflash/io.h"
#include "nflash/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Name of the metadata blob in an imported store. */
#define NF_IMPORT_META_NAME NF_STORE_META_NAME

enum nf_import_phase {
	NF_IMPORT_PHASE_WRITE = 1,   /* done/total: bytes of object data written */
	NF_IMPORT_PHASE_VERIFY = 2,  /* done/total: bytes read back and checked */
};

struct nf_import_opts {
	uint32_t extent_bundles;     /* bundles per extent; 0: 16 */
	uint32_t block_size;         /* bundle alignment B, power of two in [512, 1 MiB]; 0: 4096 */
	bool overwrite;              /* replace an existing output (else NF_EUSAGE) */
	bool no_verify;              /* skip the read-back */
	/* Each FFN's gate rows as a dense object too (neuron order,
	 * NF_STORE_GATE_ROWS_SUFFIX), for gate-first exact mode: +1/3 of the
	 * FFN bytes (gate and up of equal size and a down of the same width).
	 * 1: every FFN with a gate; 0: none (nf_import_opts_default);
	 * NF_IMPORT_GATE_AUTO: the FFNs exact mode would run, those of a ReLU
	 * or dReLU model with no predictor for their layer (`nflash import`'s
	 * default): without gate rows exact mode reads every bundle. */
	int gate_objects;
	const struct nf_io_sys *sys; /* NULL: nf_io_sys_default (tests inject faults) */
	/* Polled between chunks; when it becomes nonzero the import stops with
	 * -EINTR and leaves nothing under the output name. May be NULL. */
	const volatile sig_atomic_t *cancel;
	/* Called now and then; may be NULL. */
	void (*progress)(void *user, enum nf_import_phase phase, uint64_t done, uint64_t total);
	void *progress_user;
};

void nf_import_opts_default(struct nf_import_opts *o);

#define NF_IMPORT_GATE_AUTO (-1)

struct nf_import_report {
	uint32_t n_dense;            /* dense objects from tensors */
	uint32_t n_scales;           /* QCOL scale objects */
	uint32_t n_ffn;              /* FFN objects */
	uint32_t n_layer, n_expert;  /* n_expert 0 for dense FFNs */
	uint32_t n_qcol;             /* FFN objects with a QCOL down part */
	uint32_t n_gate_rows;        /* gate-rows objects (gate_objects) */
	bool powerinfer;             /* source had the PWRI magic */
	uint64_t meta_bytes, dense_bytes, ffn_bytes;
	uint64_t file_size;
	uint64_t verified_bytes;     /* read back and checked (0 with no_verify) */
	double write_s, verify_s;
};

/*
 * nf_import - build the store at out_path from the GGUF at gguf_path.
 * o may be NULL (defaults), report may be NULL. Returns 0, or: NF_EMAGIC /
 * NF_EFORMAT / NF_ETRUNCATED (not a valid GGUF), NF_EUNSUPPORTED (a tensor
 * type or an FFN with no exact bundle form), NF_ENOTFOUND (an FFN tensor
 * missing), NF_EUSAGE (bad options, output exists), NF_ECHECKSUM (the
 * read-back found damage), -EINTR (cancelled) or -errno; d names the file
 * and the tensor. On any error nothing is left under out_path (unless it
 * existed before and overwrite was false, in which case it is untouched).
 */
int nf_import(const char *gguf_path, const char *out_path, const struct nf_import_opts *o,
	      struct nf_import_report *report, struct nf_diag *d);

#ifdef __cplusplus
}
#endif
#endif /* NFLASH_IMPORT_H */
