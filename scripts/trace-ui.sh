#!/usr/bin/env bash
# One request's trace in a real tracing UI. Starts Arize Phoenix (deploy/trace-ui/, installed
# into .tandem/phoenix by setup), a local cluster whose every process exports its spans to it
# over OTLP/HTTP (forced disaggregation, so each request crosses router -> prefill -> KV push ->
# decode), sends a few requests under trace ids of its own, waits until Phoenix has the last
# one's spans, and takes a headless-Chromium screenshot of that trace's page.
#
#   scripts/trace-ui.sh [OUT.png]    # default docs/trace-ui.png
#   TANDEM_TRACE_UI_KEEP=1 ...       # leave Phoenix and the cluster running (Ctrl-C stops both)
#
# Chromium (Debian's `chromium`) is installed here if missing; it is needed for the screenshot
# only, so scripts/setup.sh leaves it out. Logs and Phoenix's database: .tandem/trace-ui/<time>/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-docs/trace-ui.png}"
TANDEM_SETUP_PHOENIX=1 TANDEM_PROFILE=dev scripts/setup.sh
if ! command -v chromium >/dev/null; then
  echo "trace-ui: installing chromium (for the screenshot)" >&2
  sudo=(); [[ $(id -u) == 0 ]] || sudo=(sudo)
  "${sudo[@]}" apt-get install -y -q --no-install-recommends chromium >&2
fi
# The dev profile is optimised (Cargo.toml) and is the one the tests build: no second build.
cargo build -q -p tandem-cli
tandem="$root/target/debug/tandem"

run="$root/.tandem/trace-ui/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$run/phoenix"
read -r ui_port otlp_grpc_port http_port grpc_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
ui="http://127.0.0.1:$ui_port"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

PHOENIX_WORKING_DIR="$run/phoenix" PHOENIX_HOST=127.0.0.1 PHOENIX_PORT="$ui_port" \
  PHOENIX_GRPC_PORT="$otlp_grpc_port" PHOENIX_TELEMETRY_ENABLED=false \
  .tandem/phoenix/bin/phoenix serve >"$run/phoenix.log" 2>&1 &
pids+=($!)
echo "trace-ui: Phoenix starting on $ui (log $run/phoenix.log)" >&2
for _ in $(seq 240); do
  curl -fs "$ui/healthz" >/dev/null 2>&1 && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$run/phoenix.log" >&2; exit 1; }
  sleep 0.5
done
curl -fs "$ui/healthz" >/dev/null || { echo "trace-ui: Phoenix did not come up" >&2; exit 1; }

"$tandem" up --no-sample --disaggregation always \
  --grpc "127.0.0.1:$grpc_port" --http "127.0.0.1:$http_port" \
  --otlp-endpoint "$ui" --otlp-protocol http/protobuf >"$run/up.log" 2>&1 &
pids+=($!)
echo "trace-ui: cluster starting (log $run/up.log)" >&2
for _ in $(seq 360); do
  grep -q "is serving" "$run/up.log" && break
  kill -0 "${pids[1]}" 2>/dev/null || { tail -30 "$run/up.log" >&2; exit 1; }
  sleep 0.5
done
grep -q "is serving" "$run/up.log" || { echo "trace-ui: the cluster did not come up" >&2; exit 1; }

prompts=("The history of the printing press" "Why is the sky blue?" "Write a haiku about rivers.")
for i in "${!prompts[@]}"; do
  tid="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
  body="$(python3 -c 'import json, sys; print(json.dumps({"messages": [{"role": "user", "content": sys.argv[1]}], "max_tokens": 16}))' "${prompts[$i]}")"
  curl -fsS "http://127.0.0.1:$http_port/v1/chat/completions" -H 'content-type: application/json' \
    -H "traceparent: 00-$tid-$(python3 -c 'import secrets; print(secrets.token_hex(8))')-01" \
    -d "$body" >"$run/answer-$i.json"
  echo "trace-ui: request $((i + 1)) answered, trace $tid" >&2
done

# Wait until Phoenix holds the last trace whole (the prefill and decode nodes' spans included).
spans=0
for _ in $(seq 60); do
  spans="$(curl -fs "$ui/v1/projects/default/spans?trace_id=$tid&limit=1000" |
    python3 -c 'import json, sys; d = json.load(sys.stdin)["data"]; print(len(d))' 2>/dev/null || echo 0)"
  services="$(curl -fs "$ui/v1/projects/default/spans?trace_id=$tid&limit=1000" |
    python3 -c 'import json, sys; print(" ".join(sorted({s["attributes"].get("tandem.service", "?") for s in json.load(sys.stdin)["data"]})))' 2>/dev/null || true)"
  [[ "$services" == "tandem-decode tandem-prefill tandem-router" && $spans -ge 12 ]] && break
  sleep 0.5
done
echo "trace-ui: Phoenix has $spans spans of trace $tid from: ${services:-none}" >&2

mkdir -p "$(dirname "$out")"
# Phoenix's /redirects/traces/ID opens the trace's page in its project; the virtual time budget
# lets the page fetch and draw the span tree before the capture.
chromium --headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --disable-background-networking --no-first-run --hide-scrollbars \
  --window-size=1600,1000 --virtual-time-budget=20000 \
  --screenshot="$root/$out" "$ui/redirects/traces/$tid" >"$run/chromium.log" 2>&1 ||
  { cat "$run/chromium.log" >&2; exit 1; }
echo "trace-ui: screenshot of trace $tid in $out ($ui/redirects/traces/$tid)" >&2

if [[ "${TANDEM_TRACE_UI_KEEP:-0}" == 1 ]]; then
  echo "trace-ui: Phoenix at $ui, the cluster at http://127.0.0.1:$http_port; Ctrl-C stops both" >&2
  wait
fi
