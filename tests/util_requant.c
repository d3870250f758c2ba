/*
 * util_requant.c - see util_requant.h.
 */
#include <errno.h>
#include <stdlib.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"
#include "util_requant.h"

static int write_tensors(const struct nf_gguf *g, struct nf_gguf_writer *w, uint32_t type)
{
	int rc = 0;
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		if (t->n_dims != 2) {
			rc = nf_gguf_writer_write(w, t->data, t->size);
			continue;
		}
		size_t n = t->ne[0], sb = nf_dtype_row_size(t->type, n), db = nf_dtype_row_size(type, n);
		float *row = malloc(n * sizeof(float));
		char *q = malloc(db);
		if (!row || !q)
			rc = -ENOMEM;
		for (uint64_t r = 0; rc == 0 && r < t->ne[1]; r++) {
			nf_dequantize_row(t->type, (const char *)t->data + r * sb, row, n);
			nf_quantize_row(type, row, q, n);
			rc = nf_gguf_writer_write(w, q, db);
		}
		free(row);
		free(q);
	}
	return rc;
}

int nf_test_requant_gguf(const char *src, const char *dst, uint32_t type, struct nf_diag *d)
{
	struct nf_gguf *g;
	struct nf_gguf_writer *w;
	int rc = nf_gguf_open(src, NF_GGUF_MMAP, &g, d);
	if (rc < 0)
		return rc;
	if ((rc = nf_gguf_writer_open(dst, false, &w, d)) < 0) {
		nf_gguf_close(g);
		return rc;
	}
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_kv(g); i++)
		rc = nf_gguf_writer_kv_copy(w, nf_gguf_kv_at(g, i));
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		rc = nf_gguf_writer_tensor(w, t->name, t->n_dims == 2 ? type : t->type, t->n_dims, t->ne);
	}
	if (rc == 0)
		rc = write_tensors(g, w, type);
	if (rc < 0)
		nf_gguf_writer_abort(w);
	else
		rc = nf_gguf_writer_finish(w, d);
	nf_gguf_close(g);
	return rc;
}
