#!/bin/sh
# sse_curl.sh BASE_URL API_KEY - the raw server-sent-event framing as curl
# sees it: "data: {...}" events separated by blank lines, the final chunk
# with finish_reason and usage, then "data: [DONE]" and nothing after.
set -eu
base=$1 key=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() { echo "sse_curl: $*" >&2; cat "$out" >&2; exit 1; }
curl -sSN --fail-with-body -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
	-d '{"prompt":"Once upon a time","max_tokens":8,"temperature":0,"stream":true}' \
	-D "$out.h" "$base/v1/completions" > "$out" || fail "curl failed"
grep -qi '^content-type: text/event-stream' "$out.h" || fail "not text/event-stream"
rm -f "$out.h"
# every non-empty line is an event; events alternate with blank lines
awk 'NR % 2 == 1 && !/^data: / { exit 1 } NR % 2 == 0 && $0 != "" { exit 1 }' "$out" || fail "bad framing"
[ "$(tail -n 2 "$out" | head -n 1)" = "data: [DONE]" ] || fail "last event is not [DONE]"
[ "$(grep -c '^data: \[DONE\]' "$out")" = 1 ] || fail "[DONE] more than once"
grep '"finish_reason":"length"' "$out" | grep -q '"usage":{"prompt_tokens":5,"completion_tokens":8' ||
	fail "no final chunk with finish_reason and usage"
n=$(grep -c '^data: {' "$out")
[ "$n" -ge 2 ] || fail "$n JSON events"
echo "sse_curl: $n events, framing ok"
