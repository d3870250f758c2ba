/*
 * store.c - `nflash store mkfake|inspect|verify|bench|relayout`: the storage-layer
 * tools.
 *
 * Invariants: every subcommand takes --help; errors name the flag or the
 * file and field; exit codes follow cli.h (verify exits 1 when it finds
 * damage); figures printed by bench are measured over the timed period
 * only, after a short warm-up.
 */
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "nflash/bundle.h"
#include "nflash/dtype.h"
#include "nflash/io.h"
#include "nflash/store.h"
#include "cli.h"
#include "plan_cli.h"
#include "store_profile.h"
#include "trace.h"

int nf_cmd_store(int argc, char **argv);

static bool is_help(const char *a)
{
	return !strcmp(a, "--help") || !strcmp(a, "-h");
}

/* ---- mkfake ---------------------------------------------------------- */

static const char mkfake_usage[] =
	"usage: nflash store mkfake OUT --layers L --dim D --ffn N [options]\n"
	"\n"
	"Writes a store with a model's geometry and random contents.\n"
	"\n"
	"  --layers L           transformer layers\n"
	"  --dim D              model width (values per FFN row)\n"
	"  --ffn N              FFN neurons per layer (bundles per FFN object)\n"
	"  --experts E          FFN experts per layer (default 1)\n"
	"  --vocab V            vocabulary size of the embeddings (default 32000)\n"
	"  --dtype T            q4_0 (default), q8_0, f16, f32 or bf16\n"
	"  --extent-bundles K   bundles per extent (default 16)\n"
	"  --bundle-align B     bundle stride alignment and block size, power of two >= 512 (default 4096)\n"
	"  --no-gate            FFNs without gate rows (up + down only)\n"
	"  --seed S             contents seed (default 1)\n";

static void mkfake_progress(void *user, uint64_t done, uint64_t total)
{
	struct nf_progress *p = user;
	p->total = total;
	nf_progress_update(p, done);
}

static int cmd_mkfake(int argc, char **argv)
{
	struct nf_store_fake_opts o;
	nf_store_fake_opts_default(&o);
	const char *out = NULL;
	bool have_l = false, have_d = false, have_f = false;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v;
		long x;
		uint64_t u;
		if (is_help(a)) {
			fputs(mkfake_usage, stdout);
			return NF_EXIT_OK;
		}
#define VAL() do { if (!(v = nf_cli_value(argc, argv, &i))) return NF_EXIT_USAGE; } while (0)
		if (!strcmp(a, "--layers")) {
			VAL();
			if (nf_cli_int(a, v, 1, 1 << 16, &x) < 0)
				return NF_EXIT_USAGE;
			o.layers = (uint32_t)x;
			have_l = true;
		} else if (!strcmp(a, "--dim")) {
			VAL();
			if (nf_cli_int(a, v, 1, 1 << 20, &x) < 0)
				return NF_EXIT_USAGE;
			o.dim = (uint32_t)x;
			have_d = true;
		} else if (!strcmp(a, "--ffn")) {
			VAL();
			if (nf_cli_int(a, v, 1, 1 << 24, &x) < 0)
				return NF_EXIT_USAGE;
			o.ffn = (uint32_t)x;
			have_f = true;
		} else if (!strcmp(a, "--experts")) {
			VAL();
			if (nf_cli_int(a, v, 1, 1024, &x) < 0)
				return NF_EXIT_USAGE;
			o.experts = (uint32_t)x;
		} else if (!strcmp(a, "--vocab")) {
			VAL();
			if (nf_cli_int(a, v, 1, 1 << 24, &x) < 0)
				return NF_EXIT_USAGE;
			o.vocab = (uint32_t)x;
		} else if (!strcmp(a, "--dtype")) {
			VAL();
			int t = nf_dtype_parse(v);
			if (t < 0 || nf_dtype_is_legacy((uint32_t)t) || t == NF_DTYPE_Q8_1) {
				nf_cli_err("--dtype: unknown type '%s' (q4_0, q8_0, f16, f32, bf16)", v);
				return NF_EXIT_USAGE;
			}
			o.dtype = (uint32_t)t;
		} else if (!strcmp(a, "--extent-bundles")) {
			VAL();
			if (nf_cli_int(a, v, 1, 1 << 24, &x) < 0)
				return NF_EXIT_USAGE;
			o.create.extent_bundles = (uint32_t)x;
		} else if (!strcmp(a, "--bundle-align")) {
			VAL();
			if (nf_cli_size(a, v, &u) < 0)
				return NF_EXIT_USAGE;
			if (u < NF_STORE_BLOCK_MIN || u > NF_STORE_BLOCK_MAX || (u & (u - 1))) {
				nf_cli_err("--bundle-align: %llu is not a power of two in [512, 1M]",
					   (unsigned long long)u);
				return NF_EXIT_USAGE;
			}
			o.create.block_size = (uint32_t)u;
		} else if (!strcmp(a, "--seed")) {
			VAL();
			if (nf_cli_u64(a, v, &o.seed) < 0)
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--no-gate")) {
			o.no_gate = true;
		} else if (a[0] == '-') {
			nf_cli_err("store mkfake: unknown option '%s' (see --help)", a);
			return NF_EXIT_USAGE;
		} else if (!out) {
			out = a;
		} else {
			nf_cli_err("store mkfake: unexpected argument '%s'", a);
			return NF_EXIT_USAGE;
		}
	}
	if (!out || !have_l || !have_d || !have_f) {
		nf_cli_err("store mkfake: OUT, --layers, --dim and --ffn are required (see --help)");
		return NF_EXIT_USAGE;
	}
	struct nf_progress p;
	nf_progress_start(&p, "mkfake", 1, true);
	o.progress = mkfake_progress;
	o.progress_user = &p;
	struct nf_diag d = {0};
	double t0 = nf_cli_now();
	/* total is known only after layout; the callback reports it first */
	int rc = nf_store_fake_create(out, &o, &d);
	nf_progress_end(&p);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	double dt = nf_cli_now() - t0;
	fprintf(stderr, "nflash: wrote %s: %.2f GiB in %.1f s (%.0f MB/s)\n", out,
		p.done / 1073741824.0, dt, dt > 0 ? p.done / dt / 1e6 : 0);
	return NF_EXIT_OK;
}

/* ---- inspect --------------------------------------------------------- */

static const char inspect_usage[] =
	"usage: nflash store inspect STORE [--json]\n"
	"\n"
	"Prints a store's superblock, geometry, profile, plans and object table.\n";

static int open_store(const char *path, struct nf_store **s)
{
	struct nf_diag d = {0};
	int rc = nf_store_open(path, NULL, s, &d);
	if (rc < 0)
		nf_cli_err("%s", nf_diag_msg(&d, rc));
	return rc;
}

static void shape_str(const struct nf_store_object *o, char *buf, size_t n)
{
	size_t k = 0;
	buf[0] = 0;
	for (uint32_t i = 0; i < o->n_dims && k < n; i++)
		k += (size_t)snprintf(buf + k, n - k, "%s%llu", i ? "x" : "", (unsigned long long)o->shape[i]);
}

static int cmd_inspect(int argc, char **argv)
{
	const char *path = NULL;
	bool json = false;
	for (int i = 1; i < argc; i++) {
		if (is_help(argv[i])) {
			fputs(inspect_usage, stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(argv[i], "--json")) {
			json = true;
		} else if (argv[i][0] == '-' || path) {
			nf_cli_err("store inspect: unexpected argument '%s' (see --help)", argv[i]);
			return NF_EXIT_USAGE;
		} else {
			path = argv[i];
		}
	}
	if (!path) {
		nf_cli_err("store inspect: STORE is required");
		return NF_EXIT_USAGE;
	}
	struct nf_store *s;
	if (open_store(path, &s) < 0)
		return NF_EXIT_FAIL;
	const struct nf_store_info *in = nf_store_info(s);
	uint64_t ffn_bytes = 0, dense_bytes = 0, extents = 0, bundles = 0;
	uint64_t ffn_lo = UINT64_MAX, ffn_hi = 0;
	const struct nf_store_object *ffn0 = NULL;
	for (uint32_t i = 0; i < in->n_objects; i++) {
		const struct nf_store_object *o = nf_store_object_get(s, i);
		if (o->kind == NF_STORE_KIND_FFN) {
			if (!ffn0)
				ffn0 = o;
			if (o->offset < ffn_lo)
				ffn_lo = o->offset;
			if (o->offset + o->length > ffn_hi)
				ffn_hi = o->offset + o->length;
			ffn_bytes += o->length;
			extents += o->n_extents;
			bundles += o->n_bundles;
		} else {
			dense_bytes += o->length;
		}
	}
	char uuid[33];
	for (int i = 0; i < 16; i++)
		snprintf(uuid + 2 * i, 3, "%02x", in->uuid[i]);
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, true);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "path", path);
		nf_json_u64(&j, "version", in->version);
		nf_json_u64(&j, "generation", in->generation);
		nf_json_i64(&j, "superblock", in->sb_slot);
		nf_json_str(&j, "other_superblock", in->other_sb_error ? nf_strerror(in->other_sb_error) : "ok");
		nf_json_str(&j, "uuid", uuid);
		nf_json_u64(&j, "block_size", in->block_size);
		nf_json_u64(&j, "file_size", in->file_size);
		nf_json_u64(&j, "n_objects", in->n_objects);
		nf_json_u64(&j, "n_ffn", in->n_ffn);
		nf_json_u64(&j, "dense_bytes", dense_bytes);
		nf_json_u64(&j, "ffn_bytes", ffn_bytes);
		nf_json_u64(&j, "extents", extents);
		nf_json_u64(&j, "bundles", bundles);
		/* The span holding every FFN (contiguous in stores from mkfake), and
		 * the first FFN's geometry: what an equivalent fio job needs. */
		nf_json_u64(&j, "ffn_span_offset", ffn0 ? ffn_lo : 0);
		nf_json_u64(&j, "ffn_span_bytes", ffn0 ? ffn_hi - ffn_lo : 0);
		nf_json_u64(&j, "ffn_stride", ffn0 ? ffn0->stride : 0);
		nf_json_u64(&j, "ffn_extent_bytes", ffn0 ? (uint64_t)ffn0->extent_bundles * ffn0->stride : 0);
		nf_store_profile_print(s, &j);
		nf_plan_print(s, &j);
		nf_json_arr_begin(&j, "objects");
		for (uint32_t i = 0; i < in->n_objects; i++) {
			const struct nf_store_object *o = nf_store_object_get(s, i);
			nf_json_obj_begin(&j, NULL);
			nf_json_str(&j, "name", o->name);
			nf_json_str(&j, "kind", nf_store_kind_name(o->kind));
			nf_json_str(&j, "dtype", (o->kind == NF_STORE_KIND_BLOB ? "-" : nf_dtype_name(o->dtype)));
			nf_json_arr_begin(&j, "shape");
			for (uint32_t k = 0; k < o->n_dims; k++)
				nf_json_u64(&j, NULL, o->shape[k]);
			nf_json_arr_end(&j);
			nf_json_u64(&j, "offset", o->offset);
			nf_json_u64(&j, "length", o->length);
			if (o->kind == NF_STORE_KIND_FFN) {
				nf_json_u64(&j, "layer", o->layer);
				nf_json_u64(&j, "expert", o->expert);
				nf_json_u64(&j, "bundles", o->n_bundles);
				nf_json_bool(&j, "gate", o->has_gate);
				nf_json_u64(&j, "bundle_bytes", o->bundle_bytes);
				nf_json_str(&j, "down_form", o->down_form == NF_DOWN_QCOL ? "qcol" : "row");
				nf_json_str(&j, "down_dtype", nf_dtype_name(o->down_dtype));
				nf_json_u64(&j, "stride", o->stride);
				nf_json_u64(&j, "extent_bundles", o->extent_bundles);
				nf_json_u64(&j, "extents", o->n_extents);
			}
			nf_json_obj_end(&j);
		}
		nf_json_arr_end(&j);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		printf("store       %s\n", path);
		printf("version     %u, generation %llu (superblock %d; other copy: %s)\n", in->version,
		       (unsigned long long)in->generation, in->sb_slot,
		       in->other_sb_error ? nf_strerror(in->other_sb_error) : "ok");
		printf("uuid        %s\n", uuid);
		printf("block size  %u\n", in->block_size);
		printf("file size   %llu (%.2f GiB)\n", (unsigned long long)in->file_size,
		       in->file_size / 1073741824.0);
		printf("objects     %u (%u FFN): dense %.1f MiB, FFN %.1f MiB in %llu extents, %llu bundles\n",
		       in->n_objects, in->n_ffn, dense_bytes / 1048576.0, ffn_bytes / 1048576.0,
		       (unsigned long long)extents, (unsigned long long)bundles);
		nf_store_profile_print(s, NULL);
		nf_plan_print(s, NULL);
		printf("\n%-32s %-5s %-5s %-20s %12s %12s  %s\n", "name", "kind", "type", "shape",
		       "offset", "length", "bundles/stride/extent");
		for (uint32_t i = 0; i < in->n_objects; i++) {
			const struct nf_store_object *o = nf_store_object_get(s, i);
			char sh[96];
			shape_str(o, sh, sizeof(sh));
			printf("%-32s %-5s %-5s %-20s %12llu %12llu", o->name,
			       nf_store_kind_name(o->kind), (o->kind == NF_STORE_KIND_BLOB ? "-" : nf_dtype_name(o->dtype)), sh,
			       (unsigned long long)o->offset, (unsigned long long)o->length);
			if (o->kind == NF_STORE_KIND_FFN)
				printf("  %u x %u B (%u used%s), %u per extent",
				       o->n_bundles, o->stride, o->bundle_bytes, o->has_gate ? ", gate+up+down" : ", up+down",
				       o->extent_bundles);
			printf("\n");
		}
	}
	nf_store_close(s);
	return NF_EXIT_OK;
}

/* ---- verify ---------------------------------------------------------- */

static const char verify_usage[] =
	"usage: nflash store verify STORE|DIR [--json] [--backend aio|uring|sync]\n"
	"\n"
	"Reads every object and extent and checks every crc32c, then every section\n"
	"beside them (the profile, the plan). Exits 0 when all are intact, 1 naming each bad\n"
	"object, extent or section (or on a read error). Temporary files killed writers\n"
	"left beside the store (.NAME.nflash-tmp.PID.HEX) are reported too.\n"
	"\n"
	"With a directory: lists the temporary files killed writers left in it, as\n"
	"`store clean --dry-run` does; exits 0 when there are none, 1 when there are.\n";

#define VERIFY_SLOTS 8
#define VERIFY_CHUNK (8u << 20)

struct vslot {
	struct verify *v;
	const struct nf_store_object *obj;
	uint32_t first, count;
	uint8_t *buf;
	bool busy;
};

struct bad {
	const struct nf_store_object *obj;   /* NULL: a section */
	int64_t extent;     /* -1: the whole dense object */
	int err;
	const char *section;
	char msg[160];      /* a section's diagnosis */
};

/*
 * Sections beside the objects, each checked whole by `verify`. A new
 * section adds a row. The FFN permutations need none:
 * nf_store_open checks their crc32c and that each is a bijection, so a
 * store that opened has sound ones.
 */
struct section_check {
	const char *name;
	bool (*present)(const struct nf_store *s);
	int (*check)(const struct nf_store *s, struct nf_diag *d);
};

static int check_profile(const struct nf_store *s, struct nf_diag *d)
{
	struct nf_store_profile *p = NULL;
	int rc = nf_store_profile_read(s, &p, d);
	nf_store_profile_free(p);
	return rc;
}

static int check_plan(const struct nf_store *s, struct nf_diag *d)
{
	struct nf_store_plan *p = NULL;
	int rc = nf_store_plan_read(s, &p, d);
	nf_store_plan_free(p);
	return rc;
}

static const struct section_check sections[] = {
	{ "profile", nf_store_has_profile, check_profile },
	{ "plan", nf_store_has_plan, check_plan },
};

struct verify {
	struct vslot slot[VERIFY_SLOTS];
	struct bad *bad;
	size_t n_bad, cap_bad;
	uint64_t objects, extents, bytes, sections;
	int io_err;
};

/* Record a bad object, extent or section; NULL when out of memory. */
static struct bad *add_bad(struct verify *v, const struct nf_store_object *obj, int64_t e, int err)
{
	if (v->n_bad == v->cap_bad) {
		size_t cap = v->cap_bad ? v->cap_bad * 2 : 16;
		struct bad *b = realloc(v->bad, cap * sizeof(*b));
		if (!b)
			return NULL;
		v->bad = b;
		v->cap_bad = cap;
	}
	v->bad[v->n_bad] = (struct bad){ .obj = obj, .extent = e, .err = err };
	return &v->bad[v->n_bad++];
}

/* Check every section the store has; a bad one is added to v->bad. */
static void verify_sections(struct verify *v, const struct nf_store *s)
{
	for (size_t k = 0; k < sizeof(sections) / sizeof(sections[0]); k++) {
		if (!sections[k].present(s))
			continue;
		v->sections++;
		struct nf_diag d = { 0 };
		int rc = sections[k].check(s, &d);
		if (rc == 0)
			continue;
		struct bad *b = add_bad(v, NULL, -1, rc);
		if (!b) {
			v->io_err = -ENOMEM;
			return;
		}
		b->section = sections[k].name;
		snprintf(b->msg, sizeof(b->msg), "%s", nf_diag_msg(&d, rc));
	}
}

static void verify_done(void *cookie, int result)
{
	struct vslot *sl = cookie;
	struct verify *v = sl->v;
	sl->busy = false;
	if (result == NF_ECHECKSUM) {
		if (sl->obj->kind != NF_STORE_KIND_FFN) {
			add_bad(v, sl->obj, -1, result);
			return;
		}
		uint64_t base, len;
		nf_store_extent_span(sl->obj, sl->first, &base, &len);
		for (uint32_t e = sl->first; e < sl->first + sl->count; e++) {
			uint64_t off;
			nf_store_extent_span(sl->obj, e, &off, &len);
			if (nf_store_extent_check(sl->obj, e, sl->buf + (off - base)) < 0)
				add_bad(v, sl->obj, e, result);
		}
	} else if (result < 0) {
		add_bad(v, sl->obj, -1, result);
		if (!v->io_err)
			v->io_err = result;
	} else if (sl->obj->kind == NF_STORE_KIND_FFN) {
		/* the extents are sound: their bundle checksums must agree */
		uint64_t base, len, off;
		nf_store_extent_span(sl->obj, sl->first, &base, &len);
		for (uint32_t e = sl->first; e < sl->first + sl->count; e++) {
			uint32_t f, c;
			nf_store_extent_bundles(sl->obj, e, &f, &c);
			nf_store_extent_span(sl->obj, e, &off, &len);
			for (uint32_t b = 0; b < c; b++)
				if (nf_store_bundle_check(sl->obj, f + b, sl->buf + (off - base) +
							  (uint64_t)b * sl->obj->stride) < 0) {
					add_bad(v, sl->obj, e, NF_ECHECKSUM);
					break;
				}
		}
	}
}

static struct vslot *free_slot(struct verify *v, struct nf_io_ctx *io)
{
	for (;;) {
		for (int i = 0; i < VERIFY_SLOTS; i++)
			if (!v->slot[i].busy)
				return &v->slot[i];
		int rc = nf_io_ctx_wait(io, 1, -1);
		if (rc < 0)
			return NULL;
	}
}

/* The temporaries killed writers left in a directory (nf_io_tmp_sweep). */
struct stale {
	char **paths;
	uint64_t *bytes;
	size_t n, cap;
	uint64_t total;
};

static void stale_add(void *user, const char *path, uint64_t bytes, int rc)
{
	struct stale *st = user;
	(void)rc;
	if (st->n == st->cap) {
		size_t cap = st->cap ? st->cap * 2 : 8;
		char **p = realloc(st->paths, cap * sizeof(*p));
		if (p)
			st->paths = p;
		uint64_t *b = p ? realloc(st->bytes, cap * sizeof(*b)) : NULL;
		if (!b)
			return;            /* out of memory: the count stays short */
		st->bytes = b;
		st->cap = cap;
	}
	char *copy = strdup(path);
	if (!copy)
		return;
	st->paths[st->n] = copy;
	st->bytes[st->n++] = bytes;
	st->total += bytes;
}

static void stale_free(struct stale *st)
{
	for (size_t i = 0; i < st->n; i++)
		free(st->paths[i]);
	free(st->paths);
	free(st->bytes);
}

static void stale_json(struct nf_json *j, const struct stale *st)
{
	nf_json_arr_begin(j, "stale_temporaries");
	for (size_t i = 0; i < st->n; i++) {
		nf_json_obj_begin(j, NULL);
		nf_json_str(j, "path", st->paths[i]);
		nf_json_u64(j, "bytes", st->bytes[i]);
		nf_json_obj_end(j);
	}
	nf_json_arr_end(j);
}

/* `store verify DIR`: the stale temporaries in DIR; exit 1 when there are. */
static int verify_dir(const char *dir, bool json)
{
	struct stale st = { 0 };
	int rc = nf_io_tmp_sweep(dir, false, stale_add, &st);
	if (rc < 0) {
		nf_cli_err("%s: %s", dir, nf_strerror(rc));
		return NF_EXIT_FAIL;
	}
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, true);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "path", dir);
		nf_json_bool(&j, "ok", st.n == 0);
		stale_json(&j, &st);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		for (size_t i = 0; i < st.n; i++)
			printf("stale %s (%.1f MB)\n", st.paths[i], st.bytes[i] / 1e6);
		printf("%s: %zu stale temporary file%s, %.1f MB", dir, st.n, st.n == 1 ? "" : "s", st.total / 1e6);
		if (st.n)
			printf("; `nflash store clean %s` removes them", dir);
		putchar('\n');
	}
	int ret = st.n ? NF_EXIT_FAIL : NF_EXIT_OK;
	stale_free(&st);
	return ret;
}

static int cmd_verify(int argc, char **argv)
{
	const char *path = NULL;
	bool json = false;
	struct nf_io_opts o;
	nf_io_opts_default(&o);
	o.qd = 16;
	o.max_coalesce = VERIFY_CHUNK;
	for (int i = 1; i < argc; i++) {
		const char *v;
		if (is_help(argv[i])) {
			fputs(verify_usage, stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(argv[i], "--json")) {
			json = true;
		} else if (!strcmp(argv[i], "--backend")) {
			if (!(v = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
			int b = nf_io_backend_parse(v);
			if (b < 0 || b == NF_IO_FAULT) {
				nf_cli_err("--backend: unknown backend '%s' (aio, uring, sync)", v);
				return NF_EXIT_USAGE;
			}
			o.backend = (enum nf_io_backend)b;
		} else if (argv[i][0] == '-' || path) {
			nf_cli_err("store verify: unexpected argument '%s' (see --help)", argv[i]);
			return NF_EXIT_USAGE;
		} else {
			path = argv[i];
		}
	}
	if (!path) {
		nf_cli_err("store verify: STORE is required");
		return NF_EXIT_USAGE;
	}
	struct stat pst;
	if (stat(path, &pst) == 0 && S_ISDIR(pst.st_mode))
		return verify_dir(path, json);
	struct nf_store *s;
	if (open_store(path, &s) < 0)
		return NF_EXIT_FAIL;
	/* the temporaries killed writers left beside the store */
	struct stale st = { 0 };
	char *pdir = strdup(path);
	if (pdir)
		nf_io_tmp_sweep(dirname(pdir), false, stale_add, &st);
	struct nf_diag d = {0};
	struct nf_io_ctx *io = NULL;
	struct verify v;
	memset(&v, 0, sizeof(v));
	uint8_t *big = NULL;
	int ret = NF_EXIT_FAIL;
	if (nf_io_ctx_open(s, &o, &io, &d) < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, d.code));
		goto out;
	}
	uint32_t align = nf_io_ctx_align(io);
	uint64_t max_dense = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		uint64_t n = nf_store_object_buf_size(ob, nf_store_info(s)->block_size);
		if (ob->kind != NF_STORE_KIND_FFN && n > max_dense)
			max_dense = n;
	}
	for (int i = 0; i < VERIFY_SLOTS; i++) {
		v.slot[i].v = &v;
		v.slot[i].buf = nf_io_buf_alloc(VERIFY_CHUNK, align);
		if (!v.slot[i].buf) {
			nf_cli_err("out of memory");
			goto out;
		}
	}
	big = max_dense ? nf_io_buf_alloc(max_dense, align) : NULL;
	if (max_dense && !big) {
		nf_cli_err("out of memory for a %llu-byte object", (unsigned long long)max_dense);
		goto out;
	}
	struct nf_progress p;
	nf_progress_start(&p, "verify", nf_store_info(s)->file_size, true);
	for (uint32_t i = 0; i < nf_store_object_count(s) && !v.io_err; i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		v.objects++;
		if (ob->kind != NF_STORE_KIND_FFN) {
			/* Dense objects (and blobs) are checked whole, one at a time, in `big`
			 * (the wait also drains the FFN reads still in flight). */
			struct vslot dl = { .v = &v, .obj = ob, .buf = big, .busy = true };
			int rc = nf_io_ctx_read_object(io, ob, big, verify_done, &dl);
			if (rc == 0)
				rc = nf_io_ctx_wait(io, 0, -1);
			if (rc < 0 && !v.io_err) {   /* a failed read already reported itself */
				v.io_err = rc;
				add_bad(&v, ob, -1, rc);
			}
			v.bytes += ob->length;
		} else {
			uint64_t ext = (uint64_t)ob->extent_bundles * ob->stride;
			uint32_t per = ext <= VERIFY_CHUNK ? (uint32_t)(VERIFY_CHUNK / ext) : 0;
			if (per == 0) {
				nf_cli_err("%s: extent of %llu bytes is larger than the verify buffer",
					   ob->name, (unsigned long long)ext);
				goto out;
			}
			for (uint32_t e = 0; e < ob->n_extents && !v.io_err; e += per) {
				struct vslot *sl = free_slot(&v, io);
				if (!sl)
					break;
				sl->obj = ob;
				sl->first = e;
				sl->count = ob->n_extents - e < per ? ob->n_extents - e : per;
				sl->busy = true;
				int rc = nf_io_ctx_read_extents(io, ob, sl->first, sl->count, sl->buf,
								verify_done, sl);
				if (rc < 0) {
					sl->busy = false;
					v.io_err = rc;
					add_bad(&v, ob, -1, rc);
				}
				v.extents += sl->count;
			}
			v.bytes += ob->length;
		}
		nf_progress_update(&p, v.bytes);
	}
	int rc = nf_io_ctx_wait(io, 0, -1);
	if (rc < 0 && !v.io_err)
		v.io_err = rc;
	if (!v.io_err)
		verify_sections(&v, s);
	nf_progress_end(&p);
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, true);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "path", path);
		nf_json_bool(&j, "ok", v.n_bad == 0 && !v.io_err);
		nf_json_u64(&j, "objects", v.objects);
		nf_json_u64(&j, "extents", v.extents);
		nf_json_u64(&j, "bytes", v.bytes);
		nf_json_arr_begin(&j, "sections");
		for (size_t k = 0; k < sizeof(sections) / sizeof(sections[0]); k++)
			if (sections[k].present(s))
				nf_json_str(&j, NULL, sections[k].name);
		nf_json_arr_end(&j);
		nf_json_arr_begin(&j, "bad");
		for (size_t k = 0; k < v.n_bad; k++) {
			nf_json_obj_begin(&j, NULL);
			if (v.bad[k].obj) {
				nf_json_str(&j, "object", v.bad[k].obj->name);
				nf_json_i64(&j, "extent", v.bad[k].extent);
				nf_json_str(&j, "error", nf_strerror(v.bad[k].err));
			} else {
				nf_json_str(&j, "section", v.bad[k].section);
				nf_json_str(&j, "error", v.bad[k].msg);
			}
			nf_json_obj_end(&j);
		}
		nf_json_arr_end(&j);
		stale_json(&j, &st);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		for (size_t k = 0; k < v.n_bad; k++) {
			const struct bad *b = &v.bad[k];
			if (!b->obj) {
				printf("bad: %s: %s\n", b->section, b->msg);
			} else if (b->extent >= 0) {
				uint32_t f, c;
				nf_store_extent_bundles(b->obj, (uint32_t)b->extent, &f, &c);
				printf("bad: %s extent %lld (bundles %u..%u): %s\n", b->obj->name,
				       (long long)b->extent, f, f + c - 1, nf_strerror(b->err));
			} else {
				printf("bad: %s: %s\n", b->obj->name, nf_strerror(b->err));
			}
		}
		char secs[128] = "";
		size_t at = 0;
		for (size_t k = 0; k < sizeof(sections) / sizeof(sections[0]); k++)
			if (sections[k].present(s) && at < sizeof(secs))
				at += (size_t)snprintf(secs + at, sizeof(secs) - at, "%s%s", at ? ", " : ", sections: ",
						       sections[k].name);
		printf("%s: %llu objects, %llu extents%s, %.2f GiB checked: %s\n", path,
		       (unsigned long long)v.objects, (unsigned long long)v.extents, secs,
		       v.bytes / 1073741824.0,
		       v.n_bad || v.io_err ? "DAMAGED" : "ok");
		/* not the store's damage (exit status unchanged), but worth knowing */
		for (size_t k = 0; k < st.n; k++)
			nf_cli_warn("%s (%.1f MB) was left by a writer that is gone; `nflash store clean %s` removes it",
				    st.paths[k], st.bytes[k] / 1e6, pdir);
	}
	ret = v.n_bad || v.io_err ? NF_EXIT_FAIL : NF_EXIT_OK;
out:
	stale_free(&st);
	free(pdir);
	nf_io_ctx_close(io);
	for (int i = 0; i < VERIFY_SLOTS; i++)
		nf_io_buf_free(v.slot[i].buf);
	nf_io_buf_free(big);
	free(v.bad);
	nf_store_close(s);
	return ret;
}

/* ---- bench ----------------------------------------------------------- */

static const char bench_usage[] =
	"usage: nflash store bench STORE [options]\n"
	"\n"
	"Measures FFN reads from a store.\n"
	"\n"
	"  --backend B        aio (default), uring or sync\n"
	"  --pattern P        random (default): each step reads FRACTION of one random\n"
	"                     FFN's bundles, sorted and coalesced (sparse decode);\n"
	"                     sequential: whole extents in file order\n"
	"  --active FRACTION  share of an FFN's bundles read per step (default 0.1)\n"
	"  --qd N             reads in flight (default 32)\n"
	"  --seconds S        measured time (default 5; after 0.5 s warm-up)\n"
	"  --max-coalesce B   largest single read (default 1M)\n"
	"  --no-verify        skip crc32c checks of whole extents read\n"
	"  --completion M     poll (default): completions reaped by this thread;\n"
	"                     thread: by the I/O context's completion thread\n"
	"  --seed S           random pattern seed (default 1)\n"
	"  --trace            also trace this process's block I/O with eBPF over the\n"
	"                     measured period: device latency next to the engine's\n"
	"                     (needs root and BTF; warns and carries on otherwise)\n"
	"  --json             one JSON object with backend, pattern, qd, bundle_bytes,\n"
	"                     reads_per_s, mb_per_s, p50_us, p99_us and more\n";

#define LAT_MAX (1u << 22)

struct bstep;

struct bench {
	uint32_t *lat_us;      /* per-read latencies of the measured period */
	size_t n_lat;
	bool measuring, stop;
	uint64_t reads, bytes, bundles;
	int err;
	/* the read generator */
	struct nf_io_ctx *io;
	const struct nf_store_object **ffn;
	uint32_t n_ffn, per_step, n_steps;
	uint64_t *ext_base;       /* sequential: extents before FFN k (n_ffn + 1 entries) */
	uint64_t next_ext;        /* sequential: next extent in file order, atomic */
	bool sequential;
	double active;
	uint8_t *bufs;
	size_t step_bytes;
	struct bstep *steps;
	struct nf_trace_probe *probe;   /* --trace (tools/trace.h) */
};

static void bench_on_read(void *user, uint64_t off, uint32_t len, int64_t res, uint64_t lat_ns)
{
	struct bench *b = user;
	if (!__atomic_load_n(&b->measuring, __ATOMIC_RELAXED))
		return;
	b->reads++;
	if (res > 0)
		b->bytes += (uint64_t)res;
	if (b->n_lat < LAT_MAX)
		b->lat_us[b->n_lat++] = (uint32_t)(lat_ns / 1000 > UINT32_MAX ? UINT32_MAX : lat_ns / 1000);
}

/* A step owns everything its issue() touches (the completion thread may
 * issue one step while the main thread issues another). */
struct bstep {
	struct bench *b;
	uint32_t index, n;
	uint32_t *slots, *pool;   /* random */
	uint64_t seed;            /* random */
};

static int bench_issue(struct bench *b, struct bstep *sp);

/* Completion: account, then issue the step's next read right away, so the
 * queue refills from the callback, not after the whole batch is handled. */
static void bench_done(void *cookie, int result)
{
	struct bstep *st = cookie;
	struct bench *b = st->b;
	if (result < 0 && !b->err)
		b->err = result;
	if (__atomic_load_n(&b->measuring, __ATOMIC_RELAXED))
		b->bundles += st->n;
	if (!__atomic_load_n(&b->stop, __ATOMIC_RELAXED) && !b->err)
		bench_issue(b, st);
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static uint64_t xrand(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

static uint64_t mix_seed(uint64_t seed, uint32_t i)
{
	uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	z ^= z >> 31;
	return z ? z : 1;
}

static int bench_issue(struct bench *b, struct bstep *sp)
{
	uint8_t *buf = b->bufs + (size_t)sp->index * b->step_bytes;
	int rc;
	if (b->sequential) {
		/* Whichever step is free takes the next extent in file order, as
		 * fio does: the device sees one ascending stream. */
		uint64_t g = __atomic_fetch_add(&b->next_ext, 1, __ATOMIC_RELAXED) % b->ext_base[b->n_ffn];
		uint32_t lo = 0, hi = b->n_ffn - 1;
		while (lo < hi) {   /* last FFN whose base <= g */
			uint32_t mid = (lo + hi + 1) / 2;
			if (b->ext_base[mid] <= g)
				lo = mid;
			else
				hi = mid - 1;
		}
		const struct nf_store_object *ob = b->ffn[lo];
		uint32_t e = (uint32_t)(g - b->ext_base[lo]), f, c;
		nf_store_extent_bundles(ob, e, &f, &c);
		sp->n = c;
		rc = nf_io_ctx_read_extents(b->io, ob, e, 1, buf, bench_done, sp);
	} else {
		const struct nf_store_object *ob = b->ffn[xrand(&sp->seed) % b->n_ffn];
		uint32_t k = (uint32_t)ceil(b->active * ob->n_bundles), *sl = sp->slots, *pool = sp->pool;
		if (k > b->per_step)
			k = b->per_step;
		for (uint32_t j = 0; j < ob->n_bundles; j++)
			pool[j] = j;
		for (uint32_t j = 0; j < k; j++) {   /* partial Fisher-Yates */
			uint32_t r = j + (uint32_t)(xrand(&sp->seed) % (ob->n_bundles - j));
			uint32_t t = pool[j];
			pool[j] = pool[r];
			pool[r] = t;
			sl[j] = pool[j];
		}
		qsort(sl, k, sizeof(uint32_t), cmp_u32);
		sp->n = k;
		rc = nf_io_ctx_read_bundles(b->io, ob, sl, k, buf, bench_done, sp);
	}
	if (rc < 0 && !b->err)
		b->err = rc;
	return rc;
}

/*
 * The measured period. `--trace` (the trace helper's, include/nflash/
 * iotrace.h) starts its probes in measure_begin and collects them in
 * measure_end; nothing else runs between the two but the reads.
 */
static void measure_begin(struct bench *b)
{
	nf_trace_probe_mark(b->probe);
	__atomic_store_n(&b->measuring, true, __ATOMIC_RELAXED);
}

static void measure_end(struct bench *b)
{
	__atomic_store_n(&b->measuring, false, __ATOMIC_RELAXED);
	nf_trace_probe_collect(b->probe);
}

static int cmd_bench(int argc, char **argv)
{
	const char *path = NULL;
	bool json = false, sequential = false, trace = false;
	double active = 0.1, seconds = 5;
	uint64_t seed = 1;
	struct nf_io_opts o;
	nf_io_opts_default(&o);
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v;
		long x;
		uint64_t u;
		if (is_help(a)) {
			fputs(bench_usage, stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(a, "--json")) {
			json = true;
		} else if (!strcmp(a, "--no-verify")) {
			o.no_verify = true;
		} else if (!strcmp(a, "--trace")) {
			trace = true;
		} else if (!strcmp(a, "--completion")) {
			VAL();
			if (!strcmp(v, "poll"))
				o.completion = NF_IO_COMPLETION_POLL;
			else if (!strcmp(v, "thread"))
				o.completion = NF_IO_COMPLETION_THREAD;
			else {
				nf_cli_err("--completion: expected poll or thread, got '%s'", v);
				return NF_EXIT_USAGE;
			}
		} else if (!strcmp(a, "--backend")) {
			VAL();
			int bk = nf_io_backend_parse(v);
			if (bk < 0 || bk == NF_IO_FAULT) {
				nf_cli_err("--backend: unknown backend '%s' (aio, uring, sync)", v);
				return NF_EXIT_USAGE;
			}
			o.backend = (enum nf_io_backend)bk;
		} else if (!strcmp(a, "--pattern")) {
			VAL();
			if (!strcmp(v, "random"))
				sequential = false;
			else if (!strcmp(v, "sequential"))
				sequential = true;
			else {
				nf_cli_err("--pattern: expected random or sequential, got '%s'", v);
				return NF_EXIT_USAGE;
			}
		} else if (!strcmp(a, "--active")) {
			VAL();
			if (nf_cli_double(a, v, &active) < 0)
				return NF_EXIT_USAGE;
			if (!(active > 0 && active <= 1)) {
				nf_cli_err("--active: %g is not in (0, 1]", active);
				return NF_EXIT_USAGE;
			}
		} else if (!strcmp(a, "--qd")) {
			VAL();
			if (nf_cli_int(a, v, 1, 4096, &x) < 0)
				return NF_EXIT_USAGE;
			o.qd = (unsigned)x;
		} else if (!strcmp(a, "--seconds")) {
			VAL();
			if (nf_cli_double(a, v, &seconds) < 0)
				return NF_EXIT_USAGE;
			if (!(seconds > 0 && seconds < 86400)) {
				nf_cli_err("--seconds: %g is not in (0, 86400)", seconds);
				return NF_EXIT_USAGE;
			}
		} else if (!strcmp(a, "--max-coalesce")) {
			VAL();
			if (nf_cli_size(a, v, &u) < 0)
				return NF_EXIT_USAGE;
			if (u < 512 || u > (1u << 30)) {
				nf_cli_err("--max-coalesce: %llu is not in [512, 1G]", (unsigned long long)u);
				return NF_EXIT_USAGE;
			}
			o.max_coalesce = (uint32_t)u;
		} else if (!strcmp(a, "--seed")) {
			VAL();
			if (nf_cli_u64(a, v, &seed) < 0)
				return NF_EXIT_USAGE;
		} else if (a[0] == '-' || path) {
			nf_cli_err("store bench: unexpected argument '%s' (see --help)", a);
			return NF_EXIT_USAGE;
		} else {
			path = a;
		}
	}
	if (!path) {
		nf_cli_err("store bench: STORE is required");
		return NF_EXIT_USAGE;
	}
	if (seed == 0)
		seed = 0x9e3779b97f4a7c15ull;
	struct nf_store *s;
	if (open_store(path, &s) < 0)
		return NF_EXIT_FAIL;
	int ret = NF_EXIT_FAIL;
	struct nf_io_ctx *io = NULL;
	struct bench b;
	struct nf_trace_probe probe;
	memset(&b, 0, sizeof(b));
	memset(&probe, 0, sizeof(probe));
	b.probe = &probe;
	b.sequential = sequential;
	b.active = active;
	unsigned n_steps = 0;

	b.ffn = calloc(nf_store_object_count(s) + 1, sizeof(*b.ffn));
	b.lat_us = malloc(LAT_MAX * sizeof(uint32_t));
	if (!b.ffn || !b.lat_us) {
		nf_cli_err("out of memory");
		goto out;
	}
	uint32_t max_bundles = 0, stride = 0;
	for (uint32_t i = 0; i < nf_store_object_count(s); i++) {
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		if (ob->kind != NF_STORE_KIND_FFN)
			continue;
		b.ffn[b.n_ffn++] = ob;
		if (ob->n_bundles > max_bundles)
			max_bundles = ob->n_bundles;
		if (ob->stride > stride)
			stride = ob->stride;
	}
	if (b.n_ffn == 0) {
		nf_cli_err("%s: no FFN objects to read", path);
		goto out;
	}
	/* Attach (and hold SIGINT/SIGTERM) before the I/O context starts any
	 * completion thread, which then inherits the mask; not measured. */
	nf_trace_probe_start(&probe, trace);
	o.on_read = bench_on_read;
	o.on_read_user = &b;
	struct nf_diag d = {0};
	int rc = nf_io_ctx_open(s, &o, &io, &d);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		goto out;
	}
	b.io = io;
	uint32_t align = nf_io_ctx_align(io);
	if (sequential) {
		/* One request per extent; qd requests in flight, each its own buffer. */
		n_steps = o.qd;
		b.step_bytes = (size_t)b.ffn[0]->extent_bundles * stride;
	} else {
		/* Two steps in flight, so the queue stays full across step boundaries. */
		b.per_step = (uint32_t)ceil(active * max_bundles);
		if (b.per_step == 0)
			b.per_step = 1;
		n_steps = 2;
		b.step_bytes = (size_t)b.per_step * stride;
	}
	b.n_steps = n_steps;
	b.ext_base = malloc((b.n_ffn + 1) * sizeof(uint64_t));
	if (!b.ext_base) {
		nf_cli_err("out of memory");
		goto out;
	}
	b.ext_base[0] = 0;
	for (uint32_t k = 0; k < b.n_ffn; k++)
		b.ext_base[k + 1] = b.ext_base[k] + b.ffn[k]->n_extents;
	b.steps = calloc(n_steps, sizeof(*b.steps));
	b.bufs = nf_io_buf_alloc(b.step_bytes * n_steps, align);
	if (!b.steps || !b.bufs) {
		nf_cli_err("out of memory for %u x %zu-byte buffers", n_steps, b.step_bytes);
		goto out;
	}
	for (unsigned i = 0; i < n_steps; i++) {
		struct bstep *sp = &b.steps[i];
		sp->b = &b;
		sp->index = i;
		sp->seed = mix_seed(seed, i);
		if (!sequential && (!(sp->slots = malloc(b.per_step * sizeof(uint32_t))) ||
				    !(sp->pool = malloc(max_bundles * sizeof(uint32_t))))) {
			nf_cli_err("out of memory");
			goto out;
		}
	}

	double warm = 0.5, t_start = nf_cli_now(), t_meas = 0, t_end = 0;
	struct nf_io_stats st0 = {0}, st1;
	for (unsigned i = 0; i < n_steps && !b.err; i++)
		bench_issue(&b, &b.steps[i]);
	while (!b.err) {
		double now = nf_cli_now();
		if (!b.measuring && t_meas == 0 && now - t_start >= warm) {
			nf_io_ctx_stats(io, &st0);
			t_meas = now;
			measure_begin(&b);
		}
		if (b.measuring && now - t_meas >= seconds) {
			measure_end(&b);
			t_end = now;
			break;
		}
		rc = nf_io_ctx_wait(io, 1, 100);
		if (rc < 0 && rc != -ETIMEDOUT && !b.err)
			b.err = rc;
		if (nf_trace_probe_interrupted(&probe) && !b.err)
			b.err = -EINTR;   /* Ctrl-C while tracing: unpin first (probe_stop) */
	}
	__atomic_store_n(&b.stop, true, __ATOMIC_RELAXED);
	nf_io_ctx_wait(io, 0, -1);
	if (b.err) {
		if (!nf_trace_probe_interrupted(&probe))
			nf_cli_err("%s: reading failed: %s", path, nf_strerror(b.err));
		goto out;
	}
	nf_io_ctx_stats(io, &st1);
	double dt = t_end - t_meas;
	qsort(b.lat_us, b.n_lat, sizeof(uint32_t), cmp_u32);
	double p50 = b.n_lat ? b.lat_us[b.n_lat / 2] : 0;
	double p99 = b.n_lat ? b.lat_us[(size_t)((b.n_lat - 1) * 0.99)] : 0;
	double mbps = b.bytes / dt / 1e6, rps = b.reads / dt, bps = b.bundles / dt;
	double verify_share = 0;
	double meas_ns = dt * 1e9;
	if (meas_ns > 0)
		verify_share = (double)(st1.verify_ns - st0.verify_ns) / meas_ns;
	const char *bname = nf_io_backend_name(nf_io_ctx_backend(io));
	double avg_read = b.reads ? (double)b.bytes / b.reads : 0;
	struct nf_trace_engine_lat elat = { .reads = b.n_lat, .p50_us = p50, .p99_us = p99 };
	for (size_t i = 0; i < b.n_lat; i++)
		elat.mean_us += b.lat_us[i];
	if (b.n_lat)
		elat.mean_us /= (double)b.n_lat;
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, false);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "backend", bname);
		nf_json_str(&j, "pattern", sequential ? "sequential" : "random");
		nf_json_u64(&j, "qd", o.qd);
		nf_json_str(&j, "completion", o.completion == NF_IO_COMPLETION_THREAD ? "thread" : "poll");
		nf_json_dbl(&j, "active", sequential ? 1.0 : active);
		nf_json_u64(&j, "bundle_bytes", stride);
		nf_json_u64(&j, "extent_bytes", (uint64_t)b.ffn[0]->extent_bundles * stride);
		nf_json_dbl(&j, "avg_read_bytes", avg_read);
		nf_json_dbl(&j, "seconds", dt);
		nf_json_u64(&j, "reads", b.reads);
		nf_json_dbl(&j, "reads_per_s", rps);
		nf_json_dbl(&j, "bundles_per_s", bps);
		nf_json_dbl(&j, "mb_per_s", mbps);
		nf_json_dbl(&j, "p50_us", p50);
		nf_json_dbl(&j, "p99_us", p99);
		nf_json_bool(&j, "verify", !o.no_verify);
		nf_json_dbl(&j, "verified_mb", (double)(st1.verified - st0.verified) / 1e6);
		nf_json_dbl(&j, "verify_cpu_share", verify_share);
		nf_trace_probe_report(&probe, NULL, &j, &elat);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		printf("%s  backend %s  pattern %s  qd %u%s  bundle %u B\n", path, bname,
		       sequential ? "sequential" : "random", o.qd, o.no_verify ? "  no-verify" : "", stride);
		if (!sequential)
			printf("  step: %.3g of an FFN's bundles (%u), sorted and coalesced\n", active, b.per_step);
		printf("  %.0f bundles/s  %.1f MB/s  %.0f reads/s (avg %.0f B)  latency p50 %.0f us  p99 %.0f us\n",
		       bps, mbps, rps, avg_read, p50, p99);
		printf("  crc32c: %.1f MB verified, %.2f%% of the measured time\n",
		       (double)(st1.verified - st0.verified) / 1e6, verify_share * 100);
		nf_trace_probe_report(&probe, stdout, NULL, &elat);
	}
	ret = NF_EXIT_OK;
out:
	nf_trace_probe_stop(&probe);
	nf_io_ctx_close(io);
	nf_io_buf_free(b.bufs);
	for (unsigned i = 0; b.steps && i < n_steps; i++) {
		free(b.steps[i].slots);
		free(b.steps[i].pool);
	}
	free(b.steps);
	free(b.ext_base);
	free(b.ffn);
	free(b.lat_us);
	nf_store_close(s);
	return ret;
}

/* ---- clean ----------------------------------------------------------- */

static const char clean_usage[] =
	"usage: nflash store clean DIR [--dry-run]\n"
	"\n"
	"Removes the temporary files (.NAME.nflash-tmp.PID.HEX) that killed imports,\n"
	"relayouts, mkfakes and synths left in DIR: those whose process is gone and\n"
	"whose lock nobody holds. A running writer's file is never touched.\n"
	"--dry-run lists them only.\n";

struct clean {
	uint64_t n, bytes;
	int err;
	bool dry;
};

static void clean_one(void *user, const char *path, uint64_t bytes, int rc)
{
	struct clean *c = user;
	if (rc < 0) {
		nf_cli_err("%s: cannot remove: %s", path, nf_strerror(rc));
		c->err = rc;
		return;
	}
	printf("%s %s (%.1f MB)\n", c->dry ? "stale" : "removed", path, bytes / 1e6);
	c->n++;
	c->bytes += bytes;
}

static int cmd_clean(int argc, char **argv)
{
	const char *dir = NULL;
	struct clean c = { 0 };
	for (int i = 1; i < argc; i++) {
		if (is_help(argv[i])) {
			fputs(clean_usage, stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(argv[i], "--dry-run")) {
			c.dry = true;
		} else if (argv[i][0] == '-' || dir) {
			nf_cli_err("store clean: unexpected argument '%s' (see --help)", argv[i]);
			return NF_EXIT_USAGE;
		} else {
			dir = argv[i];
		}
	}
	if (!dir) {
		nf_cli_err("store clean: DIR is required");
		return NF_EXIT_USAGE;
	}
	int rc = nf_io_tmp_sweep(dir, !c.dry, clean_one, &c);
	if (rc < 0) {
		nf_cli_err("%s: %s", dir, nf_strerror(rc));
		return NF_EXIT_FAIL;
	}
	printf("%s: %llu stale temporary file%s, %.1f MB %s\n", dir, (unsigned long long)c.n,
	       c.n == 1 ? "" : "s", c.bytes / 1e6, c.dry ? "to remove" : "removed");
	return c.err ? NF_EXIT_FAIL : NF_EXIT_OK;
}

/* ---- dispatch -------------------------------------------------------- */

static const char store_usage[] =
	"usage: nflash store <mkfake|inspect|verify|bench|relayout|clean> ... [--help]\n"
	"\n"
	"  mkfake   write a store with a model's geometry and random contents\n"
	"  inspect  print a store's superblock and object table\n"
	"  verify   read everything and check every crc32c (exit 1 on damage)\n"
	"  bench    measure sparse (random bundles) or sequential (extents) reads\n"
	"  relayout copy a store in its profile's layout: hottest first, co-activated side by side\n"
	"  clean    remove the temporary files killed writers left in a directory\n";

int nf_cmd_store(int argc, char **argv)
{
	if (argc < 2) {
		fputs(store_usage, stderr);
		return NF_EXIT_USAGE;
	}
	const char *sub = argv[1];
	if (is_help(sub)) {
		fputs(store_usage, stdout);
		return NF_EXIT_OK;
	}
	if (!strcmp(sub, "mkfake"))
		return cmd_mkfake(argc - 1, argv + 1);
	if (!strcmp(sub, "inspect"))
		return cmd_inspect(argc - 1, argv + 1);
	if (!strcmp(sub, "verify"))
		return cmd_verify(argc - 1, argv + 1);
	if (!strcmp(sub, "bench"))
		return cmd_bench(argc - 1, argv + 1);
	if (!strcmp(sub, "relayout"))
		return nf_store_cmd_relayout(argc - 1, argv + 1);
	if (!strcmp(sub, "clean"))
		return cmd_clean(argc - 1, argv + 1);
	nf_cli_err("store: unknown subcommand '%s' (mkfake, inspect, verify, bench, relayout, clean)", sub);
	return NF_EXIT_USAGE;
}
