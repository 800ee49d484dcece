#!/usr/bin/env python3
"""The scaling figures of bench/RESULTS.md, measured and drawn.

  bench/autoscale.py local   a load step on `tandem up --autoscale` (1 → 8 → 1 clients sending
                             long prompts): the prefill pool's target and serving nodes and the
                             TTFT p90 over time → bench/autoscale-local.{csv,png}
  bench/autoscale.py sim     `tandem sim --planner --arrivals bursty --format json` for 1,000
                             H200s: GPUs per pool and TTFT p90 over a simulated hour
                             → bench/autoscale-sim.{json,png}

Run from the repository root after `cargo build --release -p tandem-cli` (or pass --tandem).
Plots need matplotlib: installed into .tandem/venv on first use (pinned below).
"""

import argparse
import csv
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

MATPLOTLIB = "matplotlib==3.10.8"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pyplot():
    try:
        import matplotlib
    except ImportError:
        venv_python = os.path.join(ROOT, ".tandem", "venv", "bin", "python")
        if sys.executable != venv_python and os.path.exists(venv_python):
            os.execv(venv_python, [venv_python] + sys.argv)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", MATPLOTLIB])
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def p90(xs):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def ttft_of(port, prompt, max_tokens):
    """One streamed completion; seconds to the first token (None when it failed)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        return None
    first = None
    ok = False
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data:") and first is None:
            first = time.monotonic() - t0
        if line.strip() == b"data: [DONE]":
            ok = True
    conn.close()
    return first if ok else None


def local(args):
    slo_ms = args.ttft_slo_ms
    slo = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    slo.write(
        f"ttft_p90_slo_ms = {slo_ms}\ninterval_ms = 1000\nprefill_util_low = 0.4\n"
        f"[prefill]\nmin = 1\nmax = {args.max_prefill}\nscale_up_cooldown_secs = 5\nscale_down_cooldown_secs = 20\n"
        "[decode]\nmin = 1\nmax = 1\n"
    )
    slo.close()
    http_port, grpc_port = free_port(), free_port()
    run_dir = tempfile.mkdtemp(prefix="tandem-autoscale-")
    up = subprocess.Popen(
        [args.tandem, "up", "--autoscale", "--slo-file", slo.name, "--no-sample",
         "--max-prefill", str(args.max_prefill), "--max-decode", "1",
         "--http", f"127.0.0.1:{http_port}", "--grpc", f"127.0.0.1:{grpc_port}", "--run-dir", run_dir],
        stderr=subprocess.PIPE, text=True)
    etcd = None
    for line in up.stderr:
        m = re.match(r"\s+etcd\s+(\S+)", line)
        if m:
            etcd = m.group(1)
        if "stops the cluster" in line:
            break
    threading.Thread(target=lambda: [None for _ in up.stderr], daemon=True).start()
    assert etcd, "tandem up did not print its etcd address"

    t0 = time.monotonic()
    done = []  # (finish time, ttft or None)
    clients = {"n": 1}
    stop = threading.Event()
    text = "The harbour at dawn was quiet except for the gulls and the slow knock of hulls. " * 45

    def client(k):
        i = 0
        while not stop.is_set():
            if k >= clients["n"]:
                time.sleep(0.2)
                continue
            i += 1
            ttft = ttft_of(http_port, f"{k}-{i}: {text}", 4)
            done.append((time.monotonic() - t0, ttft))

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    rows = []
    phases = [(args.before, 1), (args.step, 8), (args.after, 1)]
    end_of = []
    acc = 0
    for secs, n in phases:
        acc += secs
        end_of.append((acc, n))
    while True:
        t = time.monotonic() - t0
        n = next((n for e, n in end_of if t < e), 0)
        if n == 0:
            break
        clients["n"] = n
        out = subprocess.run([args.tandem, "scale", "--etcd-endpoints", etcd], capture_output=True, text=True).stdout
        row = next(l for l in out.splitlines() if l.startswith("prefill")).split()
        recent = [x for (f, x) in done if f > t - 10 and x is not None]
        rows.append({"t_s": round(t, 1), "clients": n, "prefill_target": int(row[1]),
                     "prefill_serving": int(row[2]), "ttft_p90_ms": round(p90(recent) * 1e3, 1) if recent else ""})
        print(rows[-1], flush=True)
        time.sleep(1.0)
    stop.set()
    failed = sum(1 for _, x in done if x is None)
    up.terminate()
    up.wait(timeout=180)
    out = os.path.join(ROOT, "bench", "autoscale-local")
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    print(f"requests: {len(done)}, failed: {failed}")
    with open(out + ".csv", "a") as f:
        f.write(f"# requests {len(done)}, failed {failed}, TTFT SLO {slo_ms} ms\n")
    plt = pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ts = [r["t_s"] for r in rows]
    a.step(ts, [r["prefill_target"] for r in rows], where="post", label="prefill target")
    a.step(ts, [r["prefill_serving"] for r in rows], where="post", label="prefill serving")
    a.step(ts, [r["clients"] for r in rows], where="post", label="clients", linestyle=":")
    a.set_ylabel("nodes / clients")
    a.legend(loc="upper right")
    a.set_title("tandem up --autoscale: a load step of long prompts (2-core CPU machine)")
    pts = [(r["t_s"], r["ttft_p90_ms"]) for r in rows if r["ttft_p90_ms"] != ""]
    b.plot([p[0] for p in pts], [p[1] for p in pts], label="TTFT p90 (10 s window)")
    b.axhline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms} ms")
    b.set_ylabel("ms")
    b.set_xlabel("seconds")
    b.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    print(f"wrote {out}.csv and {out}.png")


def sim(args):
    out = os.path.join(ROOT, "bench", "autoscale-sim")
    cmd = [args.tandem, "sim", "--planner", "--arrivals", "bursty", "--format", "json",
           "--load", "0.5", "--burst-period-secs", "1200", "--burst-high", "2.0", "--burst-duty", "0.3"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    with open(out + ".json", "w") as f:
        json.dump({"command": " ".join(cmd[1:]), **data}, f, indent=1)
    d, c = data["disaggregated"], data["colocated"]
    plt = pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    tl = d["timeline"]
    ts = [s["t_s"] / 60 for s in tl]
    a.stackplot(ts, [s["prefill_gpus"] for s in tl], [s["decode_gpus"] for s in tl],
                [s["warming_gpus"] for s in tl], labels=["prefill", "decode", "warming"])
    a2 = a.twinx()
    a2.plot(ts, [s["arrival_rate"] for s in tl], color="black", linewidth=1, label="arrivals/s")
    a2.set_ylabel("requests/s")
    a.set_ylabel("GPUs")
    a.legend(loc="upper left")
    a.set_title(f"tandem sim: {d['gpus']} H200s, 70B TP{d['tp']}, bursty arrivals, planner on")
    b.plot(ts, [s["ttft_p90_s"] * 1e3 for s in tl], label="disaggregated")
    b.plot([s["t_s"] / 60 for s in c["timeline"]], [s["ttft_p90_s"] * 1e3 for s in c["timeline"]], label="colocated")
    b.axhline(data["ttft_slo_s"] * 1e3, color="red", linestyle="--", label="TTFT SLO")
    b.set_yscale("log")
    b.set_ylabel("TTFT p90 (ms)")
    b.set_xlabel("minutes")
    b.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    print(f"wrote {out}.json and {out}.png; wall {d['wall_s']:.1f} s + {c['wall_s']:.1f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["local", "sim"])
    p.add_argument("--tandem", default=os.path.join(ROOT, "target", "release", "tandem"))
    p.add_argument("--ttft-slo-ms", type=int, default=3000)
    p.add_argument("--max-prefill", type=int, default=3)
    p.add_argument("--before", type=float, default=20)
    p.add_argument("--step", type=float, default=90)
    p.add_argument("--after", type=float, default=80)
    args = p.parse_args()
    pyplot()  # install first: it may re-exec under the venv
    local(args) if args.what == "local" else sim(args)


if __name__ == "__main__":
    main()
