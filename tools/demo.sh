#!/bin/sh
# demo.sh BUILD_DIR - `make demo`: build a 7B-shaped fake store (once; it is
# reused) and compare nflash's sparse-decode and sequential reads with fio
# on it, briefly. A later issue turns this into text generation.
#
# Environment: DEMO_DIR (default ./demo), DEMO_SECONDS (per run, default 2),
# DEMO_REPS (alternations per row, default 1).
set -eu
B=${1:-build}
DEMO_DIR=${DEMO_DIR:-demo}
mkdir -p "$DEMO_DIR"
echo "demo: 7B-shaped store in $DEMO_DIR (dim 4096, ffn 11008, 32 layers, q4_0)" >&2
NFLASH_BENCH_DIR=$DEMO_DIR BENCH_SECONDS=${DEMO_SECONDS:-2} BENCH_REPS=${DEMO_REPS:-1} \
	BENCH_BACKENDS=aio BENCH_QDS="1 32" \
	sh bench/bench_store.sh "$B"
"$B/nflash" store inspect "$DEMO_DIR/7b-q4_0.nfs" | sed -n '1,6p'
