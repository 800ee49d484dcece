#!/usr/bin/env bash
# The kernel pool's sharing policy on a machine that is shared: decode at batch 1 (tandem
# bench-engine, the served model, 256-token prompts, 64 steps) with TANDEM_POOL_SHARING=always
# and =adaptive, each on an idle machine and beside busy loops on all but one core (what a
# co-located client or sidecar does to the pool's workers), alternating rounds. Prints the
# median decode tok/s of each cell and the ratios adaptive / always.
#
#   bench/pool-sharing.sh               # 3 rounds
#   bench/pool-sharing.sh --rounds 5 --json bench/pool-sharing.json
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rounds=3 json=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --json) json="$2"; shift 2 ;;
    -h|--help) sed -n 2,9p "$0"; exit 0 ;;
    *) echo "pool-sharing: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
fail() { echo "pool-sharing: FAILED: $1" >&2; exit 1; }
cargo build -q --release -p tandem-cli || fail "building tandem (cargo build --release -p tandem-cli)"
tandem="$root/target/release/tandem"
out="$(mktemp -d)"
busy_pids=()
stop_busy() { for p in "${busy_pids[@]}"; do kill "$p" 2>/dev/null || true; done; busy_pids=(); }
trap 'stop_busy; rm -rf "$out"' EXIT
start_busy() {
  local n=$(( $(nproc) - 1 )); (( n >= 1 )) || n=1
  for _ in $(seq "$n"); do sh -c 'while :; do :; done' & busy_pids+=($!); done
}
for r in $(seq "$rounds"); do
  for load in idle busy; do
    for mode in always adaptive; do
      [[ $load == busy ]] && start_busy
      TANDEM_POOL_SHARING=$mode "$tandem" bench-engine --batch 1 --prompt-len 256 \
        --decode-prompt-len 256 --decode-tokens 64 --runs 3 --format json \
        >"$out/$r-$load-$mode.json" 2>"$out/$r-$load-$mode.log" ||
        { stop_busy; fail "bench-engine ($mode, $load); log: $(tail -3 "$out/$r-$load-$mode.log")"; }
      stop_busy
      echo "pool-sharing: round $r $load $mode done" >&2
    done
  done
done
python3 - "$out" "$rounds" "$json" <<'PY'
import json, statistics, sys
out, rounds, dest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cells = {}
for r in range(1, rounds + 1):
    for load in ("idle", "busy"):
        for mode in ("always", "adaptive"):
            rep = json.load(open(f"{out}/{r}-{load}-{mode}.json"))
            cells.setdefault((load, mode), []).append(rep["decode_tok_s"]["1"])
print(f"decode tok/s at batch 1, medians of {rounds} rounds (each the median of 3 runs)")
print(f"{'machine':<8} {'always':>9} {'adaptive':>9} {'adaptive/always':>16}")
result = {}
for load in ("idle", "busy"):
    a = statistics.median(cells[(load, "always")])
    b = statistics.median(cells[(load, "adaptive")])
    print(f"{load:<8} {a:>9.1f} {b:>9.1f} {b / a:>15.2f}x")
    result[load] = {"always": a, "adaptive": b, "ratio": b / a, "rounds": {m: cells[(load, m)] for m in ("always", "adaptive")}}
if dest:
    json.dump(result, open(dest, "w"), indent=2)
PY
