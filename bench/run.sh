#!/bin/sh
# Runs every benchmark: each bench/bench_*.sh script, then each compiled
# $B/bench/bench_* program. BENCH=name runs only those whose name contains it.
# Output: per benchmark a header line and tab-separated rows (STYLE.md, 13).
B=${1:-build}
status=0
for s in bench/bench_*.sh; do
	[ -e "$s" ] || continue
	case "$s" in *"${BENCH:-}"*) ;; *) continue ;; esac
	echo "== $s"
	sh "$s" "$B" || { echo "bench: $s failed" >&2; status=1; }
done
for p in "$B"/bench/bench_*; do
	[ -x "$p" ] || continue
	case "$p" in *"${BENCH:-}"*) ;; *) continue ;; esac
	echo "== $p"
	"$p" || { echo "bench: $p failed" >&2; status=1; }
done
exit $status
