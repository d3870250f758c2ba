/*
 * fuzz_seeds.c - write a small seed corpus for fuzz_gguf from real files.
 *
 *	fuzz_seeds OUTDIR FILE.gguf...
 *
 * For each input it writes (1) a shrunken copy made with the nflash writer:
 * every key kept, arrays cut to 8 elements, every tensor kept with its type
 * and rank but one block per dimension, so the seed keeps the structure
 * of a real model in a few KiB; and (2) the input's first 4 KiB. Seeds are
 * generated at `make fuzz` time and never committed. The inputs are every
 * testdata GGUF, the K-quant files of ../shared/testdata/kquant included
 * (Q4_K/Q5_K/Q6_K tensors with 256-value blocks).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/dtype.h"
#include "nflash/gguf.h"

static int shrink(const char *in, const char *out)
{
	struct nf_gguf *g;
	struct nf_gguf_writer *w;
	struct nf_diag d = {0};
	int rc = nf_gguf_open(in, 0, &g, &d);
	if (rc < 0) {
		fprintf(stderr, "fuzz_seeds: %s\n", nf_diag_msg(&d, rc));
		return rc;
	}
	rc = nf_gguf_writer_open(out, nf_gguf_is_powerinfer(g), &w, &d);
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_kv(g); i++) {
		struct nf_gguf_kv kv = *nf_gguf_kv_at(g, i);
		if (kv.type == NF_GGUF_ARRAY && kv.arr_n > 8) {
			if (kv.arr_type == NF_GGUF_STRING) {
				const char *s[8];
				for (int k = 0; k < 8; k++)
					s[k] = nf_gguf_arr_str(&kv, (uint64_t)k, NULL);
				rc = nf_gguf_writer_kv_arr_str(w, kv.key, s, 8);
				continue;
			}
			kv.arr_n = 8;
		}
		rc = nf_gguf_writer_kv_copy(w, &kv);
	}
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		uint64_t ne[NF_GGUF_MAX_DIMS] = { nf_dtype_block_len(t->type), 1, 1, 1 };
		rc = nf_gguf_writer_tensor(w, t->name, t->type, t->n_dims, ne);
	}
	static const uint8_t zeros[512]; /* the largest block: q8_K, 292 bytes */
	for (size_t i = 0; rc == 0 && i < nf_gguf_n_tensors(g); i++)
		rc = nf_gguf_writer_write(w, zeros, nf_dtype_block_size(nf_gguf_tensor_at(g, i)->type));
	if (rc == 0)
		rc = nf_gguf_writer_finish(w, &d);
	else
		nf_gguf_writer_abort(w);
	if (rc < 0)
		fprintf(stderr, "fuzz_seeds: %s: %s\n", out, nf_diag_msg(&d, rc));
	nf_gguf_close(g);
	return rc;
}

static int head(const char *in, const char *out)
{
	FILE *f = fopen(in, "rb"), *o = fopen(out, "wb");
	char buf[4096];
	size_t n = f ? fread(buf, 1, sizeof(buf), f) : 0;
	int rc = (f && o && fwrite(buf, 1, n, o) == n) ? 0 : -1;
	if (f)
		fclose(f);
	if (o && fclose(o))
		rc = -1;
	return rc;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: fuzz_seeds OUTDIR FILE.gguf...\n");
		return 2;
	}
	for (int i = 2; i < argc; i++) {
		const char *base = strrchr(argv[i], '/');
		base = base ? base + 1 : argv[i];
		char out[4096];
		snprintf(out, sizeof(out), "%s/small-%s", argv[1], base);
		if (shrink(argv[i], out) < 0)
			return 1;
		snprintf(out, sizeof(out), "%s/head-%s", argv[1], base);
		if (head(argv[i], out) < 0)
			return 1;
	}
	return 0;
}
