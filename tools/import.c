/*
 * import.c - `nflash import MODEL.gguf OUT.nfl`: build a store from a GGUF
 * (llama.cpp's or PowerInfer's); see include/nflash/import.h, docs/IMPORT.md.
 *
 * Invariants: every error names the flag, the file or the tensor; Ctrl-C
 * (SIGINT) or SIGTERM stops the import and leaves nothing under OUT; an
 * existing OUT is only replaced with --force.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "nflash/import.h"
#include "nflash/store.h"

int nf_cmd_import(int argc, char **argv);

static void usage(FILE *f)
{
	fprintf(f,
		"usage: nflash import MODEL.gguf OUT.nfl [--extent-bundles K] [--bundle-align B]\n"
		"                     [--force] [--no-verify] [--gate-objects|--no-gate-objects]\n"
		"                     [--json]\n"
		"\n"
		"Builds a store from a GGUF file (llama.cpp's, or PowerInfer's with\n"
		"ffn_down_t and predictors): the metadata, one dense object per non-FFN\n"
		"tensor (same names), and one FFN object of neuron bundles per layer and\n"
		"per expert. Then reads everything back and checks every crc32c.\n"
		"\n"
		"  --extent-bundles K   bundles per extent, the unit read and checksummed (default 16)\n"
		"  --bundle-align B     bundle and object alignment, a power of two from 512\n"
		"                       to 1M (default 4096; K/M suffixes)\n"
		"  --force              replace OUT if it exists\n"
		"  --no-verify          skip the read-back\n"
		"  --gate-objects       also store each FFN's gate rows as one object, so that\n"
		"                       exact mode can read gates first (--gate-first; +1/3 of\n"
		"                       the FFN bytes on disk). Default: for the FFNs exact\n"
		"                       mode runs (ReLU/dReLU, no predictor), which else read\n"
		"                       every bundle a token\n"
		"  --no-gate-objects    no gate rows, not even those\n"
		"  --json               print a report as one JSON object\n"
		"  -h, --help           this text\n"
		"\n"
		"Exit status: 0 done, 1 the import failed (nothing is left under OUT), 2 usage.\n");
}

/* The one mutable global here: a signal handler can reach nothing else. */
static volatile sig_atomic_t import_cancel;

static void on_signal(int sig)
{
	(void)sig;
	import_cancel = 1;
}

struct prog {
	struct nf_progress bar;
	enum nf_import_phase phase;
	bool started;
};

static void on_progress(void *user, enum nf_import_phase phase, uint64_t done, uint64_t total)
{
	struct prog *p = user;
	if (!p->started || p->phase != phase) {
		if (p->started)
			nf_progress_end(&p->bar);
		nf_progress_start(&p->bar, phase == NF_IMPORT_PHASE_WRITE ? "import" : "verify", total,
				  true);
		p->phase = phase;
		p->started = true;
	}
	nf_progress_update(&p->bar, done);
}

int nf_cmd_import(int argc, char **argv)
{
	const char *in = NULL, *out = NULL, *v;
	bool json = false;
	struct nf_import_opts o;
	nf_import_opts_default(&o);
	o.gate_objects = NF_IMPORT_GATE_AUTO;

	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
			usage(stdout);
			return NF_EXIT_OK;
		} else if (!strcmp(a, "--extent-bundles")) {
			long k;
			if (!(v = nf_cli_value(argc, argv, &i)) ||
			    nf_cli_int(a, v, 1, 1 << 20, &k) < 0)
				return NF_EXIT_USAGE;
			o.extent_bundles = (uint32_t)k;
		} else if (!strcmp(a, "--bundle-align")) {
			if (!(v = nf_cli_value(argc, argv, &i)) || nf_cli_block_size(a, v, &o.block_size) < 0)
				return NF_EXIT_USAGE;
		} else if (!strcmp(a, "--force")) {
			o.overwrite = true;
		} else if (!strcmp(a, "--no-verify")) {
			o.no_verify = true;
		} else if (!strcmp(a, "--gate-objects")) {
			o.gate_objects = 1;
		} else if (!strcmp(a, "--no-gate-objects")) {
			o.gate_objects = 0;
		} else if (!strcmp(a, "--json")) {
			json = true;
		} else if (a[0] == '-' && a[1]) {
			nf_cli_err("import: unknown flag '%s' (see nflash import --help)", a);
			return NF_EXIT_USAGE;
		} else if (!in) {
			in = a;
		} else if (!out) {
			out = a;
		} else {
			nf_cli_err("import: unexpected argument '%s'", a);
			return NF_EXIT_USAGE;
		}
	}
	if (!in || !out) {
		nf_cli_err("import: MODEL.gguf and OUT.nfl are required (see nflash import --help)");
		return NF_EXIT_USAGE;
	}

	struct sigaction sa, old_int, old_term;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigemptyset(&sa.sa_mask);
	import_cancel = 0;
	sigaction(SIGINT, &sa, &old_int);
	sigaction(SIGTERM, &sa, &old_term);
	struct prog p = { 0 };
	o.cancel = &import_cancel;
	o.progress = on_progress;
	o.progress_user = &p;

	struct nf_import_report r;
	struct nf_diag d = { 0 };
	nf_cli_report_stale(out);
	int rc = nf_import(in, out, &o, &r, &d);
	if (p.started)
		nf_progress_end(&p.bar);
	sigaction(SIGINT, &old_int, NULL);
	sigaction(SIGTERM, &old_term, NULL);
	if (rc < 0) {
		nf_cli_err("%s", nf_diag_msg(&d, rc));
		return rc == NF_EUSAGE ? NF_EXIT_USAGE : NF_EXIT_FAIL;
	}
	if (json) {
		struct nf_json j;
		nf_json_init(&j, stdout, true);
		nf_json_obj_begin(&j, NULL);
		nf_json_str(&j, "model", in);
		nf_json_str(&j, "store", out);
		nf_json_bool(&j, "powerinfer", r.powerinfer);
		nf_json_u64(&j, "n_layer", r.n_layer);
		nf_json_u64(&j, "n_expert", r.n_expert);
		nf_json_u64(&j, "dense_objects", r.n_dense);
		nf_json_u64(&j, "scale_objects", r.n_scales);
		nf_json_u64(&j, "ffn_objects", r.n_ffn);
		nf_json_u64(&j, "qcol_ffn_objects", r.n_qcol);
		nf_json_u64(&j, "gate_rows_objects", r.n_gate_rows);
		nf_json_u64(&j, "meta_bytes", r.meta_bytes);
		nf_json_u64(&j, "dense_bytes", r.dense_bytes);
		nf_json_u64(&j, "ffn_bytes", r.ffn_bytes);
		nf_json_u64(&j, "file_size", r.file_size);
		nf_json_u64(&j, "verified_bytes", r.verified_bytes);
		nf_json_dbl(&j, "write_s", r.write_s);
		nf_json_dbl(&j, "verify_s", r.verify_s);
		nf_json_obj_end(&j);
		nf_json_finish(&j);
	} else {
		char gates[160] = "";
		if (r.n_gate_rows)
			snprintf(gates, sizeof(gates), ", %u gate-rows objects (%s)", r.n_gate_rows,
				 o.gate_objects > 0 ? "--gate-objects"
						    : "ReLU/dReLU FFNs with no predictor: for gate-first reads, "
						      "--no-gate-objects skips them");
		printf("%s -> %s: %u layers%s, %u dense objects, %u FFN objects (%u with QCOL down, "
		       "%u scale objects)%s, %.1f MiB; written in %.2f s, %s\n",
		       in, out, r.n_layer, r.powerinfer ? " (PowerInfer)" : "", r.n_dense, r.n_ffn,
		       r.n_qcol, r.n_scales, gates, r.file_size / 1048576.0, r.write_s,
		       o.no_verify ? "not verified" : "every crc32c verified");
	}
	return NF_EXIT_OK;
}
