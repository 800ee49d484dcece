#!/usr/bin/env python3
"""tandem's engine vs llama.cpp on this machine, in one run (driven by bench/peer.sh).

Each round runs, for every dtype, `tandem bench-engine --runs 1` and llama.cpp's `llama-bench`
(prefill, pp512) and `llama-batched-bench` (decode with 32-token prompts, 64 generated tokens, 1/4/
16/32 sequences: the same shape bench-engine times), alternating which engine goes first. Reported:
each engine's median and min-max per figure, and the median of the per-round ratios tandem/peer
(a ratio from one round compares runs seconds apart, so machine drift mostly cancels).

Also per round, the machine's bounds: bench-engine's read-bandwidth probe (-> the single-sequence
decode bound) and an f32 GEMM (numpy's OpenBLAS, 2048^2, all cores) divided by the FLOPs per token
(-> the compute bound of batched decode and prefill); the summary gives tandem's fraction of each.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

BATCHES = [1, 4, 16, 32]


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


QUANTIZED = ("q8_0", "q4_1", "q4_0")


def gguf_for(args, dtype):
    """The file both engines read for `dtype`: the served model itself for q4_1 (Q4_1 layers, a
    Q8_0 embedding), llama-quantize's conversion of it otherwise."""
    if dtype == "q4_1":
        return args.model
    return os.path.join(args.peer_models, f"smollm2-{dtype.upper()}.gguf")


def ours(args, dtype):
    # Quantized files run as stored (`--dtype auto` keeps their blocks); f32 / f16 convert the
    # served model at load, which gives the values llama-quantize wrote into those files.
    model, flag = (gguf_for(args, dtype), "auto") if dtype in QUANTIZED else (args.model, dtype)
    rep = json.loads(run([args.tandem, "bench-engine", "--dtype", flag, "--runs", "1",
                          "--format", "json", "--model", model, "--prompt-len", "512",
                          "--decode-prompt-len", "32", "--decode-tokens", "64",
                          "--batch", ",".join(map(str, BATCHES))]))
    figs = {"prefill_512": rep["prefill_tok_s"]}
    for b in BATCHES:
        figs[f"decode_b{b}"] = rep["decode_tok_s"][str(b)]
    bounds = {"bandwidth_bound_tok_s": rep["bandwidth_bound_tok_s"],
              "flops_per_token": rep["flops_per_token"]}
    return figs, bounds


def gemm_gflops():
    """Median of 7 f32 2048^2 GEMMs through numpy (OpenBLAS, all cores)."""
    a = np.random.rand(2048, 2048).astype(np.float32)
    b = np.random.rand(2048, 2048).astype(np.float32)
    a @ b
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * 2048**3 / statistics.median(ts) / 1e9


def peer(args, dtype):
    gguf = gguf_for(args, dtype)
    threads = str(os.cpu_count())
    pp = json.loads(run([os.path.join(args.peer_bin, "llama-bench"), "-m", gguf, "-t", threads,
                         "-p", "512", "-n", "0", "-r", "1", "-o", "json"]))
    figs = {"prefill_512": pp[0]["avg_ts"]}
    out = run([os.path.join(args.peer_bin, "llama-batched-bench"), "-m", gguf, "-t", threads,
               "-c", "8192", "-b", "2048", "-ub", "512", "-npp", "32", "-ntg", "64",
               "-npl", ",".join(map(str, BATCHES)), "--output-format", "jsonl"])
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            figs[f"decode_b{r['pl']}"] = r["speed_tg"]
    return figs


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--peer-bin", required=True)
    ap.add_argument("--peer-models", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="f32,f16,q8_0,q4_1")
    ap.add_argument("--json", help="also write the full results here")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    rounds = {d: [] for d in dtypes}
    for r in range(args.rounds):
        for d in dtypes:
            if r % 2 == 0:
                (t, bounds), p = ours(args, d), peer(args, d)
            else:
                p, (t, bounds) = peer(args, d), ours(args, d)
            bounds["gemm_gflop_s"] = gemm_gflops()
            rounds[d].append({"tandem": t, "llama.cpp": p, "bounds": bounds})
            print(f"peer: round {r + 1}/{args.rounds} {d}: " + ", ".join(
                f"{k} {t[k]:.1f} vs {p[k]:.1f}" for k in t), file=sys.stderr)
    summary = {}
    print(f"tandem vs llama.cpp, {args.rounds} rounds, tokens/s: median (min-max); "
          "ratio = median of per-round tandem/llama.cpp")
    print(f"{'dtype':5} {'figure':12} {'tandem':>24} {'llama.cpp':>24} {'ratio':>6}")
    for d in dtypes:
        summary[d] = {}
        for fig in rounds[d][0]["tandem"]:
            row = {}
            for eng in ("tandem", "llama.cpp"):
                v = [x[eng][fig] for x in rounds[d]]
                row[eng] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
            row["ratio"] = statistics.median(x["tandem"][fig] / x["llama.cpp"][fig] for x in rounds[d])
            summary[d][fig] = row
            cell = lambda s: f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
            print(f"{d:5} {fig:12} {cell(row['tandem']):>24} {cell(row['llama.cpp']):>24} "
                  f"{row['ratio']:6.2f}")
    print("tandem against the machine's bounds measured in each round (median of per-round fractions):")
    for d in dtypes:
        rs = rounds[d]
        bw = statistics.median(x["tandem"]["decode_b1"] / x["bounds"]["bandwidth_bound_tok_s"] for x in rs)
        gemm = statistics.median(x["bounds"]["gemm_gflop_s"] for x in rs)
        compute = lambda fig: statistics.median(
            x["tandem"][fig] * x["bounds"]["flops_per_token"] / (x["bounds"]["gemm_gflop_s"] * 1e9) for x in rs)
        summary[d]["bounds"] = {"decode_b1_of_bandwidth_bound": bw, "gemm_gflop_s": gemm,
                                "decode_b32_of_compute_bound": compute("decode_b32"),
                                "prefill_of_compute_bound": compute("prefill_512")}
        print(f"{d:5} decode b1 {bw:.2f} of the bandwidth bound; with GEMM at {gemm:.0f} GFLOP/s: "
              f"decode b32 {compute('decode_b32'):.2f}, prefill {compute('prefill_512'):.2f} of the compute bound")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
