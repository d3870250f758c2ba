#!/usr/bin/env bash
# recipes.sh - nflash's logits against llama.cpp's for every standard llama-quantize recipe
# of kquant/tiny-llama-q6_k.gguf, from the GGUF and from its store at the minimum budget the
# engine states. Not part of the build or the tests: it needs the llama.cpp peer
# (../shared/PEERS.md) and peer_logits built against an AMX-free build of it (README.md here).
#
# usage: tests/peer/recipes.sh PEER_DIR PEER_LOGITS [WORKDIR]
#   PEER_DIR     the peer's tree (its build/bin/llama-quantize is used)
#   PEER_LOGITS  tests/peer/peer_logits.c built against the AMX-free peer
# Prints a Markdown table: per recipe, the largest logit difference over three prompts.
set -euo pipefail
PEER=${1:?usage: recipes.sh PEER_DIR PEER_LOGITS [WORKDIR]}
LOGITS=${2:?usage: recipes.sh PEER_DIR PEER_LOGITS [WORKDIR]}
W=${3:-$(mktemp -d /tmp/nflash-recipes.XXXXXX)}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
NF=$ROOT/build/nflash
SRC=$ROOT/../shared/testdata/kquant/tiny-llama-q6_k.gguf
mkdir -p "$W"
maxdiff() { # peer_logits output, nflash eval output
	python3 - "$1" "$2" <<'PY'
import sys
t = open(sys.argv[1]).read().split()
n = int(t[1]); i = 2 + n; nv = int(t[i + 1]); ref = [float(x) for x in t[i + 2:i + 2 + nv]]
got = [float(x) for x in open(sys.argv[2]).read().split()]
assert len(got) == nv, "nflash printed %d logits, llama.cpp %d" % (len(got), nv)
print("%.3g" % max(abs(a - b) for a, b in zip(ref, got)))
PY
}
echo "| recipe | GGUF | store at the minimum budget |"
echo "| --- | --- | --- |"
for R in Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K Q4_0 Q8_0; do
	F=$W/tiny-$R.gguf S=$W/tiny-$R.nfl
	"$PEER/build/bin/llama-quantize" --allow-requantize "$SRC" "$F" "$R" >"$W/quantize-$R.log" 2>&1
	"$NF" import "$F" "$S" --force >/dev/null
	wg=0 ws=0 min=
	for s in 1 2 3; do
		n=$((13 * s + 2))
		ids=$(python3 -c "import random;R=random.Random($s*1000+$n);print(' '.join(['1']+[str(R.randint(3,319)) for _ in range($n-1)]))")
		"$LOGITS" "$F" $ids >"$W/peer.txt" 2>/dev/null
		"$NF" eval -m "$F" --ids "${ids// /,}" -c 64 --kv-type f32 >"$W/gguf.txt" 2>/dev/null
		ev=("$NF" eval -m "$S" --ids "${ids// /,}" -c 64 --kv-type f32)
		"${ev[@]}" --memory-budget 4M >/dev/null 2>"$W/err.txt" || true
		min=$(grep -oE 'at least [0-9.]+ MiB' "$W/err.txt" | grep -oE '[0-9.]+')
		"${ev[@]}" --memory-budget "$(python3 -c "print(int(($min + 0.1) * 1048576))")" >"$W/store.txt" 2>/dev/null
		wg=$(python3 -c "print(max($wg, $(maxdiff "$W/peer.txt" "$W/gguf.txt")))")
		ws=$(python3 -c "print(max($ws, $(maxdiff "$W/peer.txt" "$W/store.txt")))")
	done
	echo "| $R | $wg | $ws ($min MiB) |"
done
