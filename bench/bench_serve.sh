#!/bin/sh
# bench_serve.sh BUILD_DIR - `make bench-serve`: `nflash serve` on the
# 7B-shaped synth store (the one `make bench-decode` builds) under a memory
# budget, with 1, 2, 4 and 8 concurrent clients: aggregate decode tokens/s
# and p50/p99 time to first token, with batched decode steps (each layer
# reads the union of the slots' active neurons once) against the same
# server serving one slot per step (--no-batch).
#
# Two servers run side by side, the same store, flags and budget, one with
# --no-batch; the loads alternate between them (batched first in odd
# rounds, one-at-a-time first in even ones), so both see the same machine.
# Every client sends BENCH_REQS streamed /v1/completions requests of
# BENCH_N greedy tokens one after the other, each its own token-id prompt
# of 10 tokens. Per load: wall-clock tokens/s over all clients, the
# engine's decode tokens/s and mean slots per decode step (from /metrics
# deltas), MiB read from the store per generated token, TTFT percentiles
# (nearest rank over the load's requests: with few requests p99 is the
# largest). Medians over BENCH_ROUNDS rounds, then ratios batched / one at
# a time. The servers' peak resident sets are printed at the end.
#
# Environment: NFLASH_BENCH_DIR (where `make bench-decode` keeps its files,
# default BUILD_DIR/bench-data), BENCH_SERVE_STORE (the store; default
# synth-7b-planned.nfl there, else synth-7b-a512.nfl), BENCH_BUDGET
# (default 2G), BENCH_CLIENTS (default "1 2 4 8"; --parallel is the
# largest), BENCH_N (tokens per request, default 16), BENCH_REQS (requests
# per client, default 1), BENCH_ROUNDS (default 1), BENCH_THREADS (default
# 2), BENCH_CTX (context per slot, default 64: 10 prompt tokens and N
# generated fit, and 8 slots' KV caches stay small beside the budget).
set -eu
B=${1:-build}
NF=$B/nflash
DIR=${NFLASH_BENCH_DIR:-$B/bench-data}
BUDGET=${BENCH_BUDGET:-2G}
CLIENTS=${BENCH_CLIENTS:-"1 2 4 8"}
N=${BENCH_N:-16}
REQS=${BENCH_REQS:-1}
ROUNDS=${BENCH_ROUNDS:-1}
T=${BENCH_THREADS:-2}
CTX=${BENCH_CTX:-64}
STORE=${BENCH_SERVE_STORE:-}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/nflash-bench-serve.XXXXXX")
PIDS=""

say() { echo "bench-serve: $*" >&2; }
cleanup() {
	for p in $PIDS; do
		kill -TERM "$p" 2>/dev/null || true
	done
	for p in $PIDS; do
		wait "$p" 2>/dev/null || true
	done
	rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -x "$NF" ] || { say "$NF is not built (run make)"; exit 1; }
if [ -z "$STORE" ]; then
	for f in "$DIR/synth-7b-planned.nfl" "$DIR/synth-7b-a512.nfl"; do
		if [ -s "$f" ]; then
			STORE=$f
			break
		fi
	done
fi
if [ -z "$STORE" ] || [ ! -s "$STORE" ]; then
	say "no 7B store in $DIR (run \`make bench-decode\` once to build it, or set BENCH_SERVE_STORE)"
	exit 1
fi
PAR=$(echo $CLIENTS | tr ' ' '\n' | sort -n | tail -1)

# start a server; its stderr goes to $TMP/$1.log, its pid to $TMP/$1.pid
start() {
	name=$1
	shift
	"$NF" serve -m "$STORE" --memory-budget "$BUDGET" --parallel "$PAR" -c "$CTX" -t "$T" --port 0 \
		--chat-template none --queue 64 "$@" 2>"$TMP/$name.log" &
	echo $! >"$TMP/$name.pid"
	PIDS="$PIDS $!"
}
# the port a server listens on, once it does (waits for the model to load)
port_of() {
	while :; do
		p=$(sed -n 's|.*listening on http://[^:]*:\([0-9]*\).*|\1|p' "$TMP/$1.log")
		[ -n "$p" ] && { echo "$p"; return 0; }
		kill -0 "$(cat "$TMP/$1.pid")" 2>/dev/null || { say "the $1 server exited:"; cat "$TMP/$1.log" >&2; return 1; }
		sleep 1
	done
}

say "store $STORE, budget $BUDGET, --parallel $PAR -c $CTX -t $T; clients $CLIENTS; $REQS request(s) of $N tokens each; $ROUNDS round(s)"
start batched
start single --no-batch
PB=$(port_of batched)
PS=$(port_of single)
grep -h "nflash: memory:\|nflash: serve: .*slot" "$TMP/batched.log" >&2 || true

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "# bench-serve $(date -u +%Y-%m-%dT%H:%MZ) $(uname -sr), $cpu, $(nproc) CPUs, load average at start $(cut -d' ' -f1-3 /proc/loadavg) (a shared, loaded machine: figures are loaded ones)"
echo "# store $(basename "$STORE"), --memory-budget $BUDGET, --parallel $PAR, -c $CTX, -t $T, $N tokens per request, $REQS per client, $ROUNDS round(s)"

python3 - "$PB" "$PS" "$N" "$REQS" "$ROUNDS" $CLIENTS <<'EOF'
import json, statistics, sys, threading, time, urllib.request

pb, ps, n_tok, reqs, rounds = (int(a) for a in sys.argv[1:6])
clients = [int(a) for a in sys.argv[6:]]
modes = {"batched": pb, "one-at-a-time": ps}

def metrics(port):
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                k, v = line.split()
                out[k] = float(v)
    return out

def request(port, ids):
    body = json.dumps({"prompt": ids, "max_tokens": n_tok, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    rq = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft, toks = None, 0
    with urllib.request.urlopen(rq, timeout=1800) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                break
            j = json.loads(line[6:])
            if j.get("choices") and ttft is None:
                ttft = time.monotonic() - t0
            if j.get("usage"):
                toks = j["usage"]["completion_tokens"]
    return ttft, toks

def load(port, nc):
    ttfts, toks, errs = [], [], []
    def client(c):
        for i in range(reqs):
            k = c * reqs + i
            ids = [1] + [(37 * k + 11 * j) % 250 + 259 for j in range(9)]
            try:
                t, n = request(port, ids)
                ttfts.append(t)
                toks.append(n)
            except Exception as e:
                errs.append(str(e))
    m0 = metrics(port)
    t0 = time.monotonic()
    th = [threading.Thread(target=client, args=(c,)) for c in range(nc)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.monotonic() - t0
    m1 = metrics(port)
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    if errs:
        print(f"# {len(errs)} request(s) failed: {errs[0]}", file=sys.stderr)
    gen = sum(toks)
    ttfts.sort()
    rank = lambda q: ttfts[max(0, -(-len(ttfts) * q // 100) - 1)] if ttfts else float("nan")
    return {
        "req": len(ttfts), "tok": gen, "wall": wall,
        "agg": gen / wall if wall > 0 else 0.0,
        "eng": d["nflash_generated_tokens_total"] / d["nflash_decode_seconds_total"]
               if d.get("nflash_decode_seconds_total", 0) > 0 else 0.0,
        "batch": d["nflash_decode_batch_size_sum"] / d["nflash_decode_batch_size_count"]
                 if d.get("nflash_decode_batch_size_count", 0) > 0 else 0.0,
        "mib": d.get("nflash_read_bytes_total", 0) / 1048576.0 / gen if gen else 0.0,
        "p50": rank(50), "p99": rank(99),
    }

res = {(m, c): [] for m in modes for c in clients}
for rd in range(rounds):
    order = list(modes) if rd % 2 == 0 else list(reversed(list(modes)))
    for c in clients:
        for m in order:
            r = load(modes[m], c)
            res[(m, c)].append(r)
            print(f"# round {rd + 1}, {c} client(s), {m}: {r['tok']} tokens in {r['wall']:.1f} s", file=sys.stderr)

med = lambda m, c, k: statistics.median(r[k] for r in res[(m, c)])
print("clients\tmode\trequests\ttokens\twall_s\tagg_tok_s\tengine_decode_tok_s\tslots_per_step\tread_MiB_per_tok\tttft_p50_s\tttft_p99_s")
for c in clients:
    for m in modes:
        print(f"{c}\t{m}\t{med(m, c, 'req'):.0f}\t{med(m, c, 'tok'):.0f}\t{med(m, c, 'wall'):.1f}\t{med(m, c, 'agg'):.2f}\t"
              f"{med(m, c, 'eng'):.2f}\t{med(m, c, 'batch'):.2f}\t{med(m, c, 'mib'):.1f}\t{med(m, c, 'p50'):.2f}\t{med(m, c, 'p99'):.2f}")
print()
print("clients\tbatched/one-at-a-time: agg_tok_s\tengine_decode_tok_s\tread_MiB_per_tok\tttft_p50")
for c in clients:
    ratio = lambda k: med("batched", c, k) / med("one-at-a-time", c, k) if med("one-at-a-time", c, k) else float("nan")
    print(f"{c}\t{ratio('agg'):.2f}x\t{ratio('eng'):.2f}x\t{ratio('mib'):.2f}x\t{ratio('p50'):.2f}x")
EOF
for s in batched single; do
	pid=$(cat "$TMP/$s.pid")
	echo "# $s server: peak resident set $(sed -n 's/^VmHWM:[[:space:]]*//p' /proc/"$pid"/status)"
done
