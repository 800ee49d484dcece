#!/usr/bin/env bash
# What an idle cluster costs: `tandem up` (1 prefill + 1 decode node, the served model, release
# build) started with no sample request, then, once it serves, the CPU each process used over
# 10 s with no requests (utime + stime from /proc/<pid>/stat), as a percentage of one core.
# The goal (issue 32): each node under 1 %.
#
#   bench/idle-cpu.sh [--seconds 10]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
secs=10
[[ "${1:-}" == "--seconds" ]] && secs="$2"
[[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && { sed -n 2,7p "$0"; exit 0; }
cargo build -q --release -p tandem-cli || { echo "idle-cpu: FAILED: cargo build --release -p tandem-cli" >&2; exit 1; }
run="$(mktemp -d)"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
log="$(mktemp)"
target/release/tandem up --no-sample --run-dir "$run" --grpc "127.0.0.1:$(port)" \
  --http "127.0.0.1:$(port)" >"$log" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null; rm -rf "$run" "$log"' EXIT
for _ in $(seq 300); do
  grep -q "Ctrl-C or SIGTERM stops the cluster" "$log" && break
  kill -0 $up 2>/dev/null || { echo "idle-cpu: FAILED: tandem up exited (log: $(tail -3 "$log"))" >&2; exit 1; }
  sleep 1
done
grep -q "Ctrl-C or SIGTERM stops the cluster" "$log" || { echo "idle-cpu: FAILED: the cluster did not come up in 300 s" >&2; exit 1; }
sleep 3 # let start-up's last work (warm-up, first load reports) pass
python3 - "$up" "$secs" <<'PY'
import os, sys, time
root, secs = int(sys.argv[1]), float(sys.argv[2])
hz = os.sysconf("SC_CLK_TCK")
def children(pid):
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
        except OSError:
            pass
    return out
pids = [root] + children(root)
def name(pid):
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        words = [a.decode() for a in args if a]
        prog = os.path.basename(words[0])
        return prog + (" " + words[1] if prog == "tandem" and len(words) > 1 else "")
    except OSError:
        return "?"
def ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
def task_ticks(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[(t, comm)] = int(f[11]) + int(f[12])
        except OSError:
            pass
    return out
before = {p: ticks(p) for p in pids}
tasks_before = {p: task_ticks(p) for p in pids}
time.sleep(secs)
print(f"CPU over {secs:.0f} s with no requests (% of one core)")
for p in pids:
    try:
        used = (ticks(p) - before[p]) / hz
    except OSError:
        continue
    print(f"{name(p):<28} pid {p:<8} {100 * used / secs:6.2f} %")
    after = task_ticks(p)
    busy = sorted(((after[k] - tasks_before[p].get(k, 0), k[1]) for k in after), reverse=True)
    top = ", ".join(f"{comm} {100 * t / hz / secs:.1f} %" for t, comm in busy[:3] if t > 0)
    if top:
        print(f"{'':<30}busiest threads: {top}")
PY
