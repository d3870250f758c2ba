/*
 * fuzz_gguf.c - libFuzzer target for the GGUF reader (`make fuzz`).
 *
 * Parses the input with nf_gguf_open_mem() and, if it is accepted, walks
 * every key (typed getters, every array element) and every tensor (lookup
 * by name, first and last data byte, nf_gguf_read_tensor), so ASan/UBSan
 * see every pointer the reader hands out. Invariants checked: a rejected
 * input leaves *out untouched and sets a message; an accepted one has
 * every tensor's data inside the input.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nflash/gguf.h"

static void walk_kv(const struct nf_gguf *g, const struct nf_gguf_kv *kv)
{
	uint32_t u32;
	uint64_t u64;
	float f;
	bool b;
	const char *s;
	const struct nf_gguf_kv *a;
	volatile size_t sink = 0;

	if (nf_gguf_find_kv(g, kv->key) != kv)
		abort();
	nf_gguf_get_u32(g, kv->key, &u32);
	nf_gguf_get_u64(g, kv->key, &u64);
	nf_gguf_get_f32(g, kv->key, &f);
	nf_gguf_get_bool(g, kv->key, &b);
	if (nf_gguf_get_str(g, kv->key, &s) == 0)
		sink += strlen(s);
	if (nf_gguf_get_arr(g, kv->key, &a) == 0) {
		for (uint64_t i = 0; i < a->arr_n; i++) {
			uint64_t len;
			const char *e = nf_gguf_arr_str(a, i, &len);
			if (e) {
				if (strlen(e) > len || e[len] != '\0')
					abort();
				sink += len;
			} else {
				sink += (size_t)nf_gguf_arr_i64(a, i);
				sink += nf_gguf_arr_f32(a, i) > 0.0f;
			}
		}
	}
	(void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct nf_gguf *g = (struct nf_gguf *)(uintptr_t)1;
	struct nf_diag d = {0};
	int rc = nf_gguf_open_mem(data, size, &g, &d);
	if (rc < 0) {
		if (g != (struct nf_gguf *)(uintptr_t)1 || !d.msg[0] || rc != d.code)
			abort();
		return 0;
	}
	for (size_t i = 0; i < nf_gguf_n_kv(g); i++)
		walk_kv(g, nf_gguf_kv_at(g, i));
	for (size_t i = 0; i < nf_gguf_n_tensors(g); i++) {
		const struct nf_gguf_tensor *t = nf_gguf_tensor_at(g, i);
		if (nf_gguf_find_tensor(g, t->name) != t)
			abort();
		if (t->offset > size || t->size > size - t->offset)
			abort();
		if (t->size) {
			const uint8_t *p = t->data;
			uint8_t first, last;
			if (nf_gguf_read_tensor(g, t, 0, &first, 1) || first != p[0])
				abort();
			if (nf_gguf_read_tensor(g, t, t->size - 1, &last, 1) || last != p[t->size - 1])
				abort();
		}
	}
	nf_gguf_close(g);
	return 0;
}
