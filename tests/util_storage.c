/*
 * util_storage.c - helpers for the storage tests (util_storage.h).
 */
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nflash/dtype.h"
#include "nflash/bundle.h"
#include "util_storage.h"

int nf_cmd_store(int argc, char **argv);

bool ts_dir_make(struct ts_dir *t, const char *base)
{
	snprintf(t->dir, sizeof(t->dir), "%s/nflash-test.XXXXXX", base);
	if (!mkdtemp(t->dir))
		return false;
	snprintf(t->path, sizeof(t->path), "%s/store.nfs", t->dir);
	return true;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f)
{
	(void)st;
	(void)flag;
	(void)f;
	return remove(p);
}

void ts_dir_remove(struct ts_dir *t)
{
	nftw(t->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

int ts_dir_count(const struct ts_dir *t)
{
	DIR *d = opendir(t->dir);
	int n = 0;
	if (!d)
		return -1;
	struct dirent *e;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			n++;
	closedir(d);
	return n;
}

void ts_fill(uint8_t *p, size_t n, uint64_t seed)
{
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
	for (size_t i = 0; i < n; i++) {
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		p[i] = (uint8_t)(s >> 24);
	}
}

static uint64_t row_seed(uint32_t k, uint32_t i, uint32_t r)
{
	return (uint64_t)k << 32 | (uint64_t)i << 2 | r;
}

int ts_make_store(const char *path, uint32_t dtype, uint32_t extent_bundles, uint32_t block_size,
		  const struct nf_io_sys *sys)
{
	struct nf_store_create_opts co = { .block_size = block_size, .extent_bundles = extent_bundles,
					   .sys = sys };
	struct nf_store_writer *w;
	struct nf_diag d = {0};
	int rc = nf_store_writer_open(path, &co, &w, &d);
	if (rc < 0)
		return rc;
	uint64_t emb[2] = { TS_DIM, 10 }, norm[1] = { TS_DIM };
	if ((rc = nf_store_writer_add_dense(w, "emb", dtype, 2, emb, &d)) < 0 ||
	    (rc = nf_store_writer_add_dense(w, "norm", NF_DTYPE_F32, 1, norm, &d)) < 0 ||
	    (rc = nf_store_writer_add_ffn(w, "blk.0.ffn", 0, 0, dtype, TS_DIM, TS_N, true, 0, &d)) < 0 ||
	    (rc = nf_store_writer_add_ffn(w, "blk.1.ffn", 1, 0, dtype, TS_DIM, TS_N, false, 0, &d)) < 0 ||
	    (rc = nf_store_writer_add_ffn(w, "blk.2.ffn.1", 2, 1, dtype, TS_DIM, TS_N, true, 0, &d)) < 0 ||
	    (rc = nf_store_writer_begin(w, &d)) < 0)
		goto out;
	uint8_t buf[1 << 16], rows[3][4096];
	for (uint32_t k = 0; k < nf_store_writer_object_count(w); k++) {
		const struct nf_store_object *o = nf_store_writer_object(w, k);
		if (o->kind == NF_STORE_KIND_DENSE) {
			ts_fill(buf, o->length, 100 + k);
			/* two calls, to exercise streaming */
			if ((rc = nf_store_writer_write_dense(w, buf, o->length / 2)) < 0 ||
			    (rc = nf_store_writer_write_dense(w, buf + o->length / 2, o->length - o->length / 2)) < 0)
				goto out;
			continue;
		}
		for (uint32_t i = 0; i < o->n_bundles; i++) {
			for (uint32_t r = 0; r < 3; r++)
				ts_fill(rows[r], o->row_bytes, row_seed(k, i, r));
			if (o->has_gate)
				rc = nf_store_writer_write_bundle(w, rows[0], rows[1], rows[2]);
			else
				rc = nf_store_writer_write_bundle(w, NULL, rows[1], rows[2]);
			if (rc < 0)
				goto out;
		}
	}
	rc = nf_store_writer_finish(w, &d);
out:
	nf_store_writer_close(w);
	return rc;
}

int ts_check_dense(const struct nf_store_object *o, const uint8_t *buf)
{
	uint8_t want[1 << 16];
	ts_fill(want, o->length, 100 + o->index);
	return memcmp(want, buf, o->length) ? -1 : 0;
}

int ts_check_bundles(const struct nf_store_object *o, const uint32_t *slots, uint32_t n,
		     const uint8_t *buf)
{
	uint8_t row[4096];
	for (uint32_t j = 0; j < n; j++) {
		const uint8_t *b = buf + (size_t)j * o->stride;
		uint32_t i = slots ? slots[j] : j;
		uint32_t rr = 0;
		for (uint32_t r = o->has_gate ? 0 : 1; r < 3; r++, rr++) {
			ts_fill(row, o->row_bytes, row_seed(o->index, i, r));
			if (memcmp(row, b + rr * o->row_bytes, o->row_bytes))
				return -1;
		}
		for (uint32_t p = o->bundle_bytes; p < o->stride; p++)
			if (b[p])
				return -2;
	}
	return 0;
}

void ts_patch(const char *path, uint64_t off, const void *p, size_t n)
{
	int fd = open(path, O_WRONLY);
	if (fd < 0 || pwrite(fd, p, n, (off_t)off) != (ssize_t)n)
		abort();
	close(fd);
}

void ts_read(const char *path, uint64_t off, void *p, size_t n)
{
	int fd = open(path, O_RDONLY);
	if (fd < 0 || pread(fd, p, n, (off_t)off) != (ssize_t)n)
		abort();
	close(fd);
}

void ts_flip(const char *path, uint64_t off, int bit)
{
	uint8_t b;
	ts_read(path, off, &b, 1);
	b ^= (uint8_t)(1u << bit);
	ts_patch(path, off, &b, 1);
}

int ts_run_store_cmd(char *const argv[], char *out, size_t cap)
{
	return ts_run_cmd(nf_cmd_store, argv, out, cap);
}

bool ts_same_layout(const struct nf_bundle_layout *a, const struct nf_bundle_layout *b)
{
	return a->dtype == b->dtype && a->dim == b->dim && a->n_neurons == b->n_neurons &&
	       a->has_gate == b->has_gate && a->row_bytes == b->row_bytes &&
	       a->down_form == b->down_form && a->down_dtype == b->down_dtype &&
	       a->down_off == b->down_off && a->down_bytes == b->down_bytes &&
	       a->bundle_bytes == b->bundle_bytes && a->stride == b->stride;
}

int ts_run_cmd(int (*cmd)(int, char **), char *const argv[], char *out, size_t cap)
{
	char tmpl[] = "/tmp/nflash-out.XXXXXX";
	int fd = mkstemp(tmpl);
	if (fd < 0)
		return -1;
	unlink(tmpl);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	if (pid == 0) {
		dup2(fd, 1);
		dup2(fd, 2);
		int argc = 0;
		while (argv[argc])
			argc++;
		int rc = cmd(argc, (char **)argv);
		fflush(stdout);
		fflush(stderr);
		_exit(rc);
	}
	int st = 0;
	waitpid(pid, &st, 0);
	ssize_t n = pread(fd, out, cap - 1, 0);
	out[n > 0 ? n : 0] = '\0';
	close(fd);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void ts_on_done(void *cookie, int result)
{
	struct ts_done *d = cookie;
	d->calls++;
	d->result = result;
}
