#!/bin/sh
# bench_trace.sh BUILD_DIR - overhead of the eBPF tracer on the engine's reads.
#
# Runs `nflash store bench` without and with --trace, alternating (the order
# flips every rep), BENCH_REPS times each (default 7), on one store whose bundles are 4 KiB and extents
# 64 KiB, in two configurations:
#   4K QD1    random bundles, --max-coalesce 4K: every read is one 4 KiB request
#   64K QD32  sequential extents: every read is one 64 KiB request
# and prints, per configuration, the medians of reads/s off and on and their
# ratio (target >= 0.95), with the traced device latency for reference,
# and the CPU time the eBPF programs took per traced request (one extra run
# under `nflash trace --prog-stats`).
# crc32c verification is off in both so only the tracer differs.
#
# Needs root and a kernel with BTF (the traced runs); prints a note and exits
# 0 otherwise. Environment: NFLASH_BENCH_DIR (default BUILD_DIR/bench-data),
# BENCH_SECONDS (per run, default 2), BENCH_REPS (default 7).
set -eu
B=${1:-build}
NF="$B/nflash"
DIR=${NFLASH_BENCH_DIR:-$B/bench-data}
SECS=${BENCH_SECONDS:-2}
REPS=${BENCH_REPS:-7}
STORE="$DIR/trace-4k.nfs"

[ -x "$NF" ] || { echo "bench_trace: $NF not built" >&2; exit 1; }
if [ "$(id -u)" != 0 ] || [ ! -r /sys/kernel/btf/vmlinux ]; then
	echo "bench_trace: skipped: needs root and /sys/kernel/btf/vmlinux"
	exit 0
fi
mkdir -p "$DIR"
if ! "$NF" store inspect "$STORE" >/dev/null 2>&1; then
	rm -f "$STORE"
	echo "bench_trace: creating $STORE (about 0.5 GiB)" >&2
	"$NF" store mkfake "$STORE" --layers 8 --dim 2048 --ffn 11008 --dtype q4_0 \
		--extent-bundles 16 --bundle-align 4096 --seed 1 >&2
fi

nget() { printf '%s\n' "$1" | sed -n "s/.*\"$2\": *\([-0-9.e+]*\).*/\1/p" | head -n 1; }
median() { printf '%s\n' $1 | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

printf '# bench_trace: %s, kernel %s, %s cpus, %s s per run, %s alternating reps, medians\n' \
	"$(uname -m)" "$(uname -r)" "$(nproc)" "$SECS" "$REPS"
printf 'config\toff_reads_per_s\ton_reads_per_s\tratio\toff_MBps\ton_MBps\ttrace_mode\tdevice_mean_us\tengine_mean_us\tbpf_ns_per_req\n'

run_config() {   # name, bench args...
	name=$1
	shift
	off="" on="" offmb="" onmb="" dev="" eng="" mode=""
	i=0
	while [ $i -lt "$REPS" ]; do
		# alternate which goes first, so a drifting neighbour load hits both
		if [ $((i % 2)) = 0 ]; then order="off on"; else order="on off"; fi
		for which in $order; do
			if [ "$which" = off ]; then
				j=$("$NF" store bench "$STORE" --seconds "$SECS" --no-verify --json "$@")
				off="$off $(nget "$j" reads_per_s)"
				offmb="$offmb $(nget "$j" mb_per_s)"
				continue
			fi
			j=$("$NF" store bench "$STORE" --seconds "$SECS" --no-verify --json --trace "$@")
			case "$j" in
			*'"trace":{"error"'*)
				echo "bench_trace: --trace could not attach: $j" >&2
				return 1 ;;
			esac
			on="$on $(nget "$j" reads_per_s)"
			onmb="$onmb $(nget "$j" mb_per_s)"
			dev="$dev $(nget "$j" device_mean_us)"
			eng="$eng $(nget "$j" engine_mean_us)"
			mode=$(printf '%s\n' "$j" | sed -n 's/.*"mode":"\([a-z_]*\)".*/\1/p')
		done
		i=$((i + 1))
	done
	# CPU time of all the tracer's programs (every process's block events and
	# syscalls go through them) per traced request: an upper bound on the
	# added CPU cost, free of the device noise that dominates the A/B ratio.
	j=$("$NF" trace --prog-stats --json -- "$NF" store bench "$STORE" --seconds "$SECS" --no-verify "$@" 2>/dev/null | tail -n 1)
	pns=$(nget "$j" prog_ns_per_request)
	mo=$(median "$off")
	mn=$(median "$on")
	printf '%s\t%.0f\t%.0f\t%.3f\t%.1f\t%.1f\t%s\t%.1f\t%.1f\t%.0f\n' "$name" "$mo" "$mn" \
		"$(awk -v a="$mn" -v b="$mo" 'BEGIN {print (b > 0) ? a / b : 0}')" \
		"$(median "$offmb")" "$(median "$onmb")" "$mode" "$(median "$dev")" "$(median "$eng")" "${pns:-0}"
}

run_config 4K_QD1 --qd 1 --pattern random --max-coalesce 4K
run_config 64K_QD32 --qd 32 --pattern sequential
