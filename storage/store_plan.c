/*
 * store_plan.c - a store's execution plans (docs/FORMAT.md item 20): the
 * device and kernel figures `nflash plan` measured, and per memory budget
 * the settings it chose and what it predicted.
 *
 * Invariants:
 *  1. The section is read whole and checked (crc32c from the superblock,
 *     magic, version, exact length, every field in range, budgets strictly
 *     ascending) before any entry is used; a damaged plan is never followed.
 *  2. Writing checks the plan with the reader's own rules first, so nothing
 *     a reader would refuse is ever written.
 *  3. Encoding is deterministic: padding and reserved bytes are zero.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nflash/crc32c.h"
#include "nflash/store.h"
#include "store_format.h"

bool nf_store_has_plan(const struct nf_store *s)
{
	return nf_store_info(s)->plan_length != 0;
}

void nf_store_plan_free(struct nf_store_plan *p)
{
	if (!p)
		return;
	free(p->points);
	free(p->rates);
	free(p->entries);
	free(p);
}

const struct nf_store_plan_entry *nf_store_plan_pick(const struct nf_store_plan *p, uint64_t budget)
{
	const struct nf_store_plan_entry *best = NULL;
	for (uint32_t i = 0; p && i < p->n_entries; i++)
		if (!budget || p->entries[i].budget <= budget)
			best = &p->entries[i];
	return best;
}

static uint64_t dbits(double v)
{
	uint64_t u;
	memcpy(&u, &v, sizeof(u));
	return htole64(u);
}

static double dval(uint64_t le)
{
	uint64_t u = le64toh(le);
	double v;
	memcpy(&v, &u, sizeof(v));
	return v;
}

#define PLANFAIL(...) nf_diag_fail(d, NF_EPLAN, __VA_ARGS__)

static bool ok_num(double v)
{
	return isfinite(v) && v >= 0;
}

int nf_store_plan_check(const struct nf_store_plan *p, const char *path, struct nf_diag *d)
{
	if (p->n_points > 4096 || p->n_rates > 4096 || p->n_entries > 4096)
		return PLANFAIL("%s: plan: %u device points, %u kernel rates, %u entries: at most 4096 each", path,
				p->n_points, p->n_rates, p->n_entries);
	if (!ok_num(p->mem_read_gb_s))
		return PLANFAIL("%s: plan: mem_read_gbs is not a finite non-negative number", path);
	for (uint32_t i = 0; i < p->n_points; i++) {
		const struct nf_store_dev_point *q = &p->points[i];
		if (!q->req_bytes || !q->qd || q->qd > 4096 || !ok_num(q->mb_s) || !ok_num(q->cpu_us) ||
		    !ok_num(q->lat_us))
			return PLANFAIL("%s: plan: device point %u (%u bytes, qd %u) is out of range", path, i,
					q->req_bytes, q->qd);
	}
	for (uint32_t i = 0; i < p->n_rates; i++)
		if (!p->rates[i].threads || !ok_num(p->rates[i].gb_s))
			return PLANFAIL("%s: plan: kernel rate %u is out of range", path, i);
	for (uint32_t i = 0; i < p->n_entries; i++) {
		const struct nf_store_plan_entry *e = &p->entries[i];
		const double pred[] = { e->tok_per_s, e->io_wait_share, e->bytes_per_token, e->reads_per_token,
					e->t_dense_s, e->t_ffn_s, e->t_io_s, e->t_token_s };
		const char *bad = !e->budget                       ? "budget"
				  : i && e->budget <= p->entries[i - 1].budget ? "budget (not ascending)"
				  : !e->n_ctx                          ? "n_ctx"
				  : e->kv_type > 1                     ? "kv_type"
				  : !e->n_batch || e->n_batch > 65536  ? "n_batch"
				  : e->n_threads > 1024                ? "n_threads"
				  : !e->qd || e->qd > 4096             ? "qd"
				  : e->read_gap > 64                   ? "read_gap"
				  : e->flags & ~NF_STORE_PLAN_F_ALL ? "flags"
								       : NULL;
		for (size_t k = 0; !bad && k < sizeof(pred) / sizeof(pred[0]); k++)
			if (!ok_num(pred[k]))
				bad = "a prediction";
		if (!bad && e->io_wait_share > 1)
			bad = "io_wait_share";
		if (bad)
			return PLANFAIL("%s: plan entry %u (budget %llu): %s is out of range", path, i,
					(unsigned long long)e->budget, bad);
	}
	return 0;
}

static uint64_t section_bytes(uint32_t np, uint32_t nr, uint32_t ne)
{
	return sizeof(struct nf_store_plan_disk) + (uint64_t)np * sizeof(struct nf_store_plan_point_disk) +
	       (uint64_t)nr * sizeof(struct nf_store_plan_rate_disk) +
	       (uint64_t)ne * sizeof(struct nf_store_plan_entry_disk);
}

int nf_store_plan_encode(const struct nf_store_plan *p, uint32_t bs, uint8_t **out, uint64_t *len, uint64_t *used,
			 uint32_t *crc)
{
	uint64_t total = section_bytes(p->n_points, p->n_rates, p->n_entries);
	uint64_t padded = (total + bs - 1) / bs * bs;
	uint8_t *buf = calloc(1, padded);
	if (!buf)
		return -ENOMEM;
	struct nf_store_plan_disk h;
	memset(&h, 0, sizeof(h));
	h.magic = htole64(NF_STORE_PLAN_MAGIC);
	h.version = htole32(NF_STORE_PLAN_VERSION);
	h.n_points = htole32(p->n_points);
	h.n_rates = htole32(p->n_rates);
	h.n_entries = htole32(p->n_entries);
	h.created_ns = htole64(p->created_ns);
	h.mem_read_gbs = dbits(p->mem_read_gb_s);
	memcpy(buf, &h, sizeof(h));
	uint64_t off = sizeof(h);
	for (uint32_t i = 0; i < p->n_points; i++, off += sizeof(struct nf_store_plan_point_disk)) {
		const struct nf_store_dev_point *q = &p->points[i];
		struct nf_store_plan_point_disk x = { htole32(q->req_bytes), htole32(q->qd), dbits(q->mb_s),
						      dbits(q->cpu_us), dbits(q->lat_us) };
		memcpy(buf + off, &x, sizeof(x));
	}
	for (uint32_t i = 0; i < p->n_rates; i++, off += sizeof(struct nf_store_plan_rate_disk)) {
		const struct nf_store_kernel_rate *r = &p->rates[i];
		struct nf_store_plan_rate_disk x = { htole32(r->dtype), htole32(r->threads), dbits(r->gb_s) };
		memcpy(buf + off, &x, sizeof(x));
	}
	for (uint32_t i = 0; i < p->n_entries; i++, off += sizeof(struct nf_store_plan_entry_disk)) {
		const struct nf_store_plan_entry *e = &p->entries[i];
		struct nf_store_plan_entry_disk x;
		memset(&x, 0, sizeof(x));
		x.budget = htole64(e->budget);
		x.n_ctx = htole32(e->n_ctx);
		x.kv_type = htole32(e->kv_type);
		x.n_batch = htole32(e->n_batch);
		x.n_threads = htole32(e->n_threads);
		x.qd = htole32(e->qd);
		x.read_gap = htole32(e->read_gap);
		x.cold_slots = htole32(e->cold_slots);
		x.attn_pin = htole32(e->attn_pin);
		x.flags = htole32(e->flags);
		x.hot_slots = htole32(e->hot_slots);
		const double pred[8] = { e->tok_per_s, e->io_wait_share, e->bytes_per_token, e->reads_per_token,
					 e->t_dense_s, e->t_ffn_s, e->t_io_s, e->t_token_s };
		for (int k = 0; k < 8; k++)
			x.pred[k] = dbits(pred[k]);
		memcpy(buf + off, &x, sizeof(x));
	}
	*out = buf;
	*len = padded;
	*used = total;
	*crc = nf_crc32c(0, buf, total);
	return 0;
}

static int decode(const uint8_t *buf, uint64_t len, const char *path, struct nf_store_plan *p, struct nf_diag *d)
{
	struct nf_store_plan_disk h;
	memcpy(&h, buf, sizeof(h));
	if (le64toh(h.magic) != NF_STORE_PLAN_MAGIC)
		return nf_diag_fail(d, NF_EPLAN, "%s: plan: bad magic", path);
	if (le32toh(h.version) != NF_STORE_PLAN_VERSION)
		return nf_diag_fail(d, NF_EVERSION, "%s: plan: version %u is not supported (this nflash reads %u)",
				    path, le32toh(h.version), NF_STORE_PLAN_VERSION);
	p->n_points = le32toh(h.n_points);
	p->n_rates = le32toh(h.n_rates);
	p->n_entries = le32toh(h.n_entries);
	if (p->n_points > 4096 || p->n_rates > 4096 || p->n_entries > 4096 ||
	    section_bytes(p->n_points, p->n_rates, p->n_entries) != len)
		return nf_diag_fail(d, NF_EPLAN, "%s: plan: %u points, %u rates and %u entries do not make %llu bytes",
				    path, p->n_points, p->n_rates, p->n_entries, (unsigned long long)len);
	p->created_ns = le64toh(h.created_ns);
	p->mem_read_gb_s = dval(h.mem_read_gbs);
	p->points = calloc(p->n_points + 1, sizeof(*p->points));
	p->rates = calloc(p->n_rates + 1, sizeof(*p->rates));
	p->entries = calloc(p->n_entries + 1, sizeof(*p->entries));
	if (!p->points || !p->rates || !p->entries)
		return -ENOMEM;
	uint64_t off = sizeof(h);
	for (uint32_t i = 0; i < p->n_points; i++, off += sizeof(struct nf_store_plan_point_disk)) {
		struct nf_store_plan_point_disk x;
		memcpy(&x, buf + off, sizeof(x));
		p->points[i] = (struct nf_store_dev_point){ le32toh(x.req_bytes), le32toh(x.qd), dval(x.mb_s),
							    dval(x.cpu_us), dval(x.lat_us) };
	}
	for (uint32_t i = 0; i < p->n_rates; i++, off += sizeof(struct nf_store_plan_rate_disk)) {
		struct nf_store_plan_rate_disk x;
		memcpy(&x, buf + off, sizeof(x));
		p->rates[i] = (struct nf_store_kernel_rate){ le32toh(x.dtype), le32toh(x.threads), dval(x.gb_s) };
	}
	for (uint32_t i = 0; i < p->n_entries; i++, off += sizeof(struct nf_store_plan_entry_disk)) {
		struct nf_store_plan_entry_disk x;
		memcpy(&x, buf + off, sizeof(x));
		struct nf_store_plan_entry *e = &p->entries[i];
		e->budget = le64toh(x.budget);
		e->n_ctx = le32toh(x.n_ctx);
		e->kv_type = le32toh(x.kv_type);
		e->n_batch = le32toh(x.n_batch);
		e->n_threads = le32toh(x.n_threads);
		e->qd = le32toh(x.qd);
		e->read_gap = le32toh(x.read_gap);
		e->cold_slots = le32toh(x.cold_slots);
		e->attn_pin = le32toh(x.attn_pin);
		e->flags = le32toh(x.flags);
		e->hot_slots = le32toh(x.hot_slots);
		double *pred[8] = { &e->tok_per_s, &e->io_wait_share, &e->bytes_per_token, &e->reads_per_token,
				    &e->t_dense_s, &e->t_ffn_s, &e->t_io_s, &e->t_token_s };
		for (int k = 0; k < 8; k++)
			*pred[k] = dval(x.pred[k]);
	}
	return nf_store_plan_check(p, path, d);
}

int nf_store_plan_read(const struct nf_store *s, struct nf_store_plan **out, struct nf_diag *d)
{
	const struct nf_store_info *in = nf_store_info(s);
	const char *path = nf_store_path(s);
	uint8_t *buf = NULL;
	struct nf_store_plan *p = NULL;
	int rc;
	*out = NULL;
	if (!in->plan_length)
		return nf_diag_fail(d, -ENOENT, "%s: the store has no plan (run `nflash plan` first)", path);
	uint64_t len = in->plan_length;
	if (len < sizeof(struct nf_store_plan_disk) || len > section_bytes(4096, 4096, 4096))
		return nf_diag_fail(d, NF_EPLAN, "%s: plan_length %llu is not a plan section", path,
				    (unsigned long long)len);
	if (!(p = calloc(1, sizeof(*p))))
		return nf_diag_fail(d, -ENOMEM, "%s: no memory for the plan", path);
	if ((rc = nf_store_section_read(s, in->plan_offset, len, in->plan_crc, "plan", &buf, d)) < 0)
		goto out;
	if ((rc = decode(buf, len, path, p, d)) < 0)
		goto out;
	*out = p;
	p = NULL;
	rc = 0;
out:
	free(buf);
	nf_store_plan_free(p);
	return rc;
}
