/*
 * store_profile.c - the profile side of `nflash store`: `store relayout`
 * (copy a store with each FFN's bundles in the profile's layout) and the profile
 * summary `store inspect` prints.
 *
 * Invariants: relayout never writes over its input (OUT must differ from
 * IN) and leaves nothing under OUT unless the copy is complete and
 * verified (nf_store_relayout); errors name the file or flag.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "nflash/store.h"
#include "cli.h"
#include "store_profile.h"

/* How concentrated a profile is, and whether the store is laid out by it. */
struct prof_summary {
	double top10_share;        /* of all counts, held by the top 10% neurons of each FFN */
	bool hot_first;            /* every FFN's slot order is descending count */
	bool has_order;            /* the profile has a co-activation order */
	bool follows_order;        /* every FFN's slots are in that order */
	uint32_t n_ffn;
};

static int cmp_desc(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x > y ? -1 : x < y;
}

static void summarize(const struct nf_store *s, const struct nf_store_profile *p, struct prof_summary *o)
{
	uint64_t all = 0, top = 0;
	memset(o, 0, sizeof(*o));
	o->hot_first = true;
	o->has_order = o->follows_order = p->order != NULL;
	uint32_t max_n = 0;
	for (uint32_t i = 0; i < p->n_objects; i++)
		max_n = p->lens[i] > max_n ? p->lens[i] : max_n;
	uint32_t *tmp = malloc((max_n ? max_n : 1) * sizeof(uint32_t));
	uint32_t *by_slot = malloc((max_n ? max_n : 1) * sizeof(uint32_t));
	for (uint32_t i = 0; i < p->n_objects && tmp && by_slot; i++) {
		if (!p->counts[i])
			continue;
		const struct nf_store_object *ob = nf_store_object_get(s, i);
		uint32_t n = p->lens[i];
		o->n_ffn++;
		memcpy(tmp, p->counts[i], n * sizeof(uint32_t));
		qsort(tmp, n, sizeof(uint32_t), cmp_desc);
		for (uint32_t k = 0; k < n; k++) {
			all += tmp[k];
			if (k < (n + 9) / 10)
				top += tmp[k];
		}
		for (uint32_t k = 0; k < n; k++)
			by_slot[ob->perm[k]] = p->counts[i][k];
		for (uint32_t k = 1; k < n && o->hot_first; k++)
			if (by_slot[k] > by_slot[k - 1])
				o->hot_first = false;
		for (uint32_t r = 0; r < n && o->follows_order; r++)
			if (!p->order[i] || ob->perm[p->order[i][r]] != r)
				o->follows_order = false;
	}
	free(tmp);
	free(by_slot);
	o->top10_share = all ? (double)top / (double)all : 0.0;
}

void nf_store_profile_print(const struct nf_store *s, struct nf_json *j)
{
	struct nf_diag d = { 0 };
	struct nf_store_profile *p = NULL;
	int rc = nf_store_has_profile(s) ? nf_store_profile_read(s, &p, &d) : 0;
	struct prof_summary sm = { 0 };
	if (p)
		summarize(s, p, &sm);
	if (j) {
		nf_json_obj_begin(j, "profile");
		nf_json_bool(j, "present", nf_store_has_profile(s));
		if (rc < 0)
			nf_json_str(j, "error", nf_diag_msg(&d, rc));
		if (p) {
			nf_json_u64(j, "tokens", p->tokens);
			nf_json_str(j, "source", nf_store_profile_source_name(p->source));
			nf_json_u64(j, "created_ns", p->created_ns);
			nf_json_u64(j, "ffn_objects", sm.n_ffn);
			nf_json_dbl(j, "top10_share", sm.top10_share);
			nf_json_bool(j, "hot_first_layout", sm.hot_first || sm.follows_order);
			nf_json_bool(j, "coactivation_order", sm.has_order);
			nf_json_str(j, "layout", sm.follows_order ? "coactivation" : sm.hot_first ? "hot_first" : "neuron");
		}
		nf_json_obj_end(j);
	} else if (rc < 0) {
		printf("profile     damaged: %s\n", nf_diag_msg(&d, rc));
	} else if (p) {
		printf("profile     %llu calibration tokens (%s), %u FFNs; top 10%% of neurons fire %.1f%% of the "
		       "time;%s layout %s\n",
		       (unsigned long long)p->tokens, nf_store_profile_source_name(p->source), sm.n_ffn,
		       100.0 * sm.top10_share, sm.has_order ? " co-activation order planned;" : "",
		       sm.follows_order ? "hot first, then co-activated (relayouted)"
		       : sm.hot_first	? "hot-first (relayouted)"
					: "neuron order");
	} else {
		printf("profile     none (the hot set is learned online; see `nflash generate --profile`)\n");
	}
	nf_store_profile_free(p);
}

static const char relayout_usage[] =
	"usage: nflash store relayout IN OUT [--profile-from STORE] [--by-count] [--bundle-align B]\n"
	"\n"
	"Writes a copy of the store IN to OUT with each FFN's neuron bundles in the\n"
	"profile's layout: the most frequent first, so the cache preloads each\n"
	"layer's hot neurons in a few large sequential reads, then neurons that\n"
	"fired together in the calibration run side by side, so a token's misses\n"
	"take fewer reads (a profile without that plan, from an older nflash: all\n"
	"in descending firing count). Neuron ids, the model's output and every other\n"
	"object are unchanged; the profile is stored in OUT. The profile is IN's\n"
	"(`nflash generate -m IN --profile ...`) or STORE's (same model).\n"
	"OUT appears only when complete and verified.\n"
	"\n"
	"  --profile-from STORE  take the profile from STORE (same model)\n"
	"  --by-count            descending firing count only, ignoring the planned\n"
	"                        co-activation order (to compare the two layouts)\n"
	"  --bundle-align B      OUT's bundle alignment (block size), a power of two\n"
	"                        from 512 to 1M (default IN's); smaller packs bundles\n"
	"                        closer: fewer bytes read per neuron\n";

static void relayout_progress(void *user, uint64_t done, uint64_t total)
{
	struct nf_progress *p = user;
	p->total = total;
	nf_progress_update(p, done);
}

int nf_store_cmd_relayout(int argc, char **argv)
{
	const char *in = NULL, *out = NULL, *from = NULL;
	bool by_count = false;
	uint32_t align = 0;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
			fputs(relayout_usage, stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(argv[i], "--by-count")) {
			by_count = true;
		} else if (!strcmp(argv[i], "--profile-from")) {
			if (!(from = nf_cli_value(argc, argv, &i)))
				return NF_EXIT_USAGE;
		} else if (!strcmp(argv[i], "--bundle-align")) {
			const char *v = nf_cli_value(argc, argv, &i);
			if (!v || nf_cli_block_size("--bundle-align", v, &align) < 0)
				return NF_EXIT_USAGE;
		} else if (argv[i][0] == '-' || (in && out)) {
			nf_cli_err("store relayout: unexpected argument '%s' (see --help)", argv[i]);
			return NF_EXIT_USAGE;
		} else if (!in) {
			in = argv[i];
		} else {
			out = argv[i];
		}
	}
	if (!in || !out) {
		nf_cli_err("store relayout: IN and OUT are required (see --help)");
		return NF_EXIT_USAGE;
	}
	struct stat a, b;
	if (!strcmp(in, out) || (stat(in, &a) == 0 && stat(out, &b) == 0 && a.st_dev == b.st_dev &&
				 a.st_ino == b.st_ino)) {
		nf_cli_err("store relayout: OUT must be another file than IN");
		return NF_EXIT_USAGE;
	}
	struct nf_diag d = { 0 };
	struct nf_store *src = NULL;
	struct nf_store_profile *p = NULL;
	int rc = 0;
	if (from) {
		if ((rc = nf_store_open(from, NULL, &src, &d)) < 0 || (rc = nf_store_profile_read(src, &p, &d)) < 0) {
			nf_cli_err("--profile-from %s", nf_diag_msg(&d, rc));
			nf_store_close(src);
			return NF_EXIT_FAIL;
		}
		nf_store_close(src);
	}
	bool p_has_order = p ? p->order != NULL : false;
	if (!p) {
		/* only to say which layout is written: the relayout reads it again */
		struct nf_store *s = NULL;
		struct nf_store_profile *q = NULL;
		if (nf_store_open(in, NULL, &s, NULL) == 0 && nf_store_profile_read(s, &q, NULL) == 0)
			p_has_order = q->order != NULL;
		nf_store_profile_free(q);
		nf_store_close(s);
	}
	struct nf_progress pr;
	nf_progress_start(&pr, "relayout", 0, true);
	struct nf_store_relayout_opts o = {
		.profile = p, .progress = relayout_progress, .progress_user = &pr, .by_count = by_count,
		.block_size = align,
	};
	double t0 = nf_cli_now();
	nf_cli_report_stale(out);
	rc = nf_store_relayout(in, out, &o, &d);
	nf_progress_end(&pr);
	nf_store_profile_free(p);
	if (rc < 0) {
		nf_cli_err("store relayout: %s", nf_diag_msg(&d, rc));
		return NF_EXIT_FAIL;
	}
	fprintf(stderr, "nflash: %s written from %s in the profile's layout (%s) and verified in %.1f s\n", out, in,
		p_has_order && !by_count ? "hot first, then co-activated" : "by firing count", nf_cli_now() - t0);
	return NF_EXIT_OK;
}
