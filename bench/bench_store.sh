#!/bin/sh
# bench_store.sh BUILD_DIR - FFN reads from a 7B-shaped store: nflash vs fio.
#
# Builds (or reuses) a fake store shaped like LLaMA-7B's FFNs (dim 4096,
# ffn 11008, 32 layers, q4_0, 4 KiB-aligned 8 KiB bundles, 16-bundle
# extents; vocab 128256 so the file is over 4 GiB), then for each backend
# (aio, uring), queue depth (1, 8, 32) and pattern runs `nflash store
# bench` and, right after it, fio with the equivalent job on the same file
# and byte range:
#   random      nflash: each step reads 10% of one FFN's bundles, sorted and
#               coalesced; fio: randread, bs = bundle stride, offsets aligned
#               to the stride (blockalign) over the FFN span
#   sequential  nflash: whole extents in order; fio: read, bs = extent size
# Each row alternates nflash and fio BENCH_REPS times (default 3; who goes
# first alternates too) and reports medians. Page caches are dropped between runs (when root). Prints a header, then
# one tab-separated row per configuration with the ratio nflash/fio of MB/s.
#
# nflash runs without crc32c verification (fio does not checksum); a third
# run per row measures it with verification on (nflash_verify_MBps).
#
# Environment: NFLASH_BENCH_DIR (where the store lives; default
# BUILD_DIR/bench-data), BENCH_SECONDS (per run, default 3), BENCH_BACKENDS
# (default "aio uring"), BENCH_QDS (default "1 8 32"), BENCH_PATTERNS
# (default "random sequential").
set -eu
B=${1:-build}
NF="$B/nflash"
DIR=${NFLASH_BENCH_DIR:-$B/bench-data}
SECS=${BENCH_SECONDS:-3}
STORE="$DIR/7b-q4_0.nfs"

command -v fio >/dev/null 2>&1 || { echo "bench_store: fio is not installed (make deps)" >&2; exit 1; }
[ -x "$NF" ] || { echo "bench_store: $NF not built" >&2; exit 1; }
mkdir -p "$DIR"

if ! "$NF" store inspect "$STORE" >/dev/null 2>&1; then
	rm -f "$STORE"
	echo "bench_store: creating $STORE (about 4.4 GiB)" >&2
	"$NF" store mkfake "$STORE" --layers 32 --dim 4096 --ffn 11008 --vocab 128256 \
		--dtype q4_0 --extent-bundles 16 --seed 1
fi

# Geometry for the equivalent fio jobs.
js=$("$NF" store inspect "$STORE" --json)
jget() { printf '%s\n' "$js" | sed -n "s/^ *\"$1\": *\([0-9]*\).*/\1/p" | head -n 1; }
SPAN_OFF=$(jget ffn_span_offset)
SPAN_LEN=$(jget ffn_span_bytes)
STRIDE=$(jget ffn_stride)
EXTENT=$(jget ffn_extent_bytes)

drop_caches() {
	sync
	[ -w /proc/sys/vm/drop_caches ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
}

# Value of a key in nflash's one-line JSON.
nget() { printf '%s\n' "$1" | sed -n "s/.*\"$2\": *\([-0-9.e+]*\).*/\1/p"; }
# Median of whitespace-separated numbers.
median() { printf '%s\n' $1 | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# run_nflash BACKEND PATTERN QD [--no-verify]: sets n_mb n_avg n_p50 n_p99 n_crc
run_nflash() {
	drop_caches
	out=$("$NF" store bench "$STORE" --backend "$1" --pattern "$2" --qd "$3" \
		--seconds "$SECS" --active 0.1 --json ${4:-})
	n_mb=$(nget "$out" mb_per_s)
	n_avg=$(nget "$out" avg_read_bytes)
	n_p50=$(nget "$out" p50_us)
	n_p99=$(nget "$out" p99_us)
	n_crc=$(nget "$out" verify_cpu_share)
}

# run_fio ENGINE PATTERN QD: sets f_mb f_p50 f_p99, and bs
run_fio() {
	drop_caches
	if [ "$2" = random ]; then
		bs=$STRIDE
		rw="--rw=randread --blockalign=$STRIDE --norandommap --randrepeat=0"
	else
		bs=$EXTENT
		rw="--rw=read"
	fi
	# shellcheck disable=SC2086
	f=$(fio --name=nflash-eq --filename="$STORE" --readonly --direct=1 \
		--ioengine="$1" --iodepth="$3" --bs="$bs" $rw \
		--offset="$SPAN_OFF" --size="$SPAN_LEN" --runtime="$SECS" --time_based \
		--ramp_time=0.5 --lat_percentiles=1 --clat_percentiles=0 --minimal)
	# terse v3: 7 read KiB/s, 24 p50 (us), 30 p99 (us) of total latency (lat_percentiles)
	f_mb=$(printf '%s\n' "$f" | cut -d';' -f7 | awk '{print $1 * 1024 / 1e6}')
	f_p50=$(printf '%s\n' "$f" | cut -d';' -f24 | cut -d= -f2)
	f_p99=$(printf '%s\n' "$f" | cut -d';' -f30 | cut -d= -f2)
}

REPS=${BENCH_REPS:-3}
echo "# bench_store: $(uname -n) $(uname -r) $(nproc) cpus; store $STORE ($(du -h "$STORE" | cut -f1)); stride $STRIDE B, extent $EXTENT B; ${SECS}s per run, medians of $REPS alternating nflash/fio runs; fio $(fio --version)"
printf 'backend\tpattern\tqd\tbs_B\tnflash_avg_read_B\tnflash_MBps\tfio_MBps\tratio\tnflash_p50_us\tfio_p50_us\tnflash_p99_us\tfio_p99_us\tnflash_verify_MBps\tcrc_time_pct\n'
for be in ${BENCH_BACKENDS:-aio uring}; do
	case $be in aio) engine=libaio ;; uring) engine=io_uring ;; esac
	for qd in ${BENCH_QDS:-1 8 32}; do
		for pat in ${BENCH_PATTERNS:-random sequential}; do
			N_MB="" N_P50="" N_P99="" F_MB="" F_P50="" F_P99=""
			r=0
			while [ $r -lt "$REPS" ]; do
				# who goes first alternates, so neither side always reads
				# right after the other warmed the host's cache
				[ $((r % 2)) = 1 ] && run_fio "$engine" "$pat" "$qd"
				run_nflash "$be" "$pat" "$qd" --no-verify
				N_MB="$N_MB $n_mb" N_P50="$N_P50 $n_p50" N_P99="$N_P99 $n_p99"
				[ $((r % 2)) = 0 ] && run_fio "$engine" "$pat" "$qd"
				F_MB="$F_MB $f_mb" F_P50="$F_P50 $f_p50" F_P99="$F_P99 $f_p99"
				r=$((r + 1))
			done
			n_avg_keep=$n_avg
			run_nflash "$be" "$pat" "$qd"
			awk -v be="$be" -v pat="$pat" -v qd="$qd" -v bs="$bs" -v avg="$n_avg_keep" \
				-v nmb="$(median "$N_MB")" -v fmb="$(median "$F_MB")" \
				-v np50="$(median "$N_P50")" -v fp50="$(median "$F_P50")" \
				-v np99="$(median "$N_P99")" -v fp99="$(median "$F_P99")" \
				-v vmb="$n_mb" -v vcrc="$n_crc" 'BEGIN {
				ratio = 0
				if (fmb > 0) ratio = nmb / fmb
				printf("%s\t%s\t%d\t%d\t%.0f\t%.1f\t%.1f\t%.2f\t%.0f\t%.0f\t%.0f\t%.0f\t%.1f\t%.1f\n",
					be, pat, qd, bs, avg, nmb, fmb, ratio, np50, fp50, np99, fp99,
					vmb, vcrc * 100) }'
		done
	done
done
