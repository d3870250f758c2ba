#!/bin/sh
# run.sh BUILD_DIR - `make test-server`: nflash serve with real clients.
# Starts BUILD_DIR/nflash serve on a free 127.0.0.1 port, runs the curl SSE
# check and the official OpenAI Node SDK tests (the SDK is installed from
# npm into BUILD_DIR/openai-sdk, never into the repository), then stops the
# server and checks that it exited cleanly. Skips the SDK part, saying why,
# only where node or npm is missing.
set -eu
B=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
model=../shared/testdata/real/stories260K.gguf
key=test-key-$$
[ -r "$model" ] || { echo "test-server: skipped: $model is absent"; exit 0; }
log=$(mktemp)
"$B/nflash" serve -m "$model" --port 0 --parallel 2 -c 256 -t 1 --chat-template chatml \
	--api-key "$key" 2>"$log" &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; rm -f "$log"; }
trap cleanup EXIT
port=""
for _ in $(seq 1 100); do
	port=$(sed -n 's/.*listening on http:\/\/127\.0\.0\.1:\([0-9]*\).*/\1/p' "$log")
	[ -n "$port" ] && break
	kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "test-server: the server did not start" >&2; exit 1; }
	sleep 0.1
done
[ -n "$port" ] || { cat "$log" >&2; echo "test-server: no port after 10 s" >&2; exit 1; }
base=http://127.0.0.1:$port
passed=0 failed=0 skipped=0
if sh "$here/sse_curl.sh" "$base" "$key"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
	sdk=$B/openai-sdk
	if [ ! -d "$sdk/node_modules/openai" ]; then
		mkdir -p "$sdk"
		(cd "$sdk" && npm install --no-audit --no-fund --loglevel=error openai@4 >/dev/null) ||
			{ echo "test-server: npm install openai failed" >&2; exit 1; }
	fi
	if node "$here/openai_sdk.mjs" "$base" "$key" "$(cd "$sdk" && pwd)"; then
		passed=$((passed + 1))
	else
		failed=$((failed + 1))
	fi
else
	echo "test-server: skipped the OpenAI Node SDK tests: node or npm is not installed"
	skipped=$((skipped + 1))
fi
kill -TERM "$pid"
wait "$pid" || { echo "test-server: the server exited with $?" >&2; failed=$((failed + 1)); }
grep -q 'SIGTERM, stopping' "$log" || { cat "$log" >&2; failed=$((failed + 1)); }
echo "test-server: $passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ]
