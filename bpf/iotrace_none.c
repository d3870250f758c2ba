/*
 * bpf/iotrace_none.c - the iotrace API for builds without eBPF (BPF=0):
 * every entry point that would need libbpf fails with NF_EUNSUPPORTED and
 * says so, so callers (nflash trace, store bench --trace, tests) need no
 * #ifdef. With BPF=1 this file compiles to nothing and bpf/iotrace.c
 * provides the real functions.
 *
 * Invariant: the functions here never touch the system.
 */
#include "nflash/iotrace.h"

#if !NF_HAVE_BPF
int nf_iotrace_open(pid_t tgid, const char *tag, unsigned flags,
		    struct nf_iotrace **out, struct nf_diag *d)
{
	*out = NULL;
	return nf_diag_fail(d, NF_EUNSUPPORTED, "nflash was built without eBPF support (BPF=0)");
}

int nf_iotrace_snapshot(struct nf_iotrace *t, struct nf_iotrace_stats *s)
{
	return NF_EUNSUPPORTED;
}

const char *nf_iotrace_pin_dir(const struct nf_iotrace *t)
{
	return "";
}

const char *nf_iotrace_mode(const struct nf_iotrace *t)
{
	return "none";
}

int nf_iotrace_events_poll(struct nf_iotrace *t, int timeout_ms,
			   void (*cb)(void *ctx, const struct nf_iotrace_event *e), void *ctx)
{
	return NF_EUNSUPPORTED;
}

void nf_iotrace_close(struct nf_iotrace *t)
{
}

int nf_iotrace_clean_stale(bool quiet)
{
	return 0;
}
#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int nf_iotrace_none_unused;
#endif
