#!/usr/bin/env python3
"""tandem's cluster against llama.cpp's llama-server, measured as a user measures a server: by
NVIDIA's aiperf, a client neither project wrote, streaming completions on the same weights.

Each round starts one server, runs aiperf at every concurrency (and request rate) against it,
stops it, then does the same for the other server; the order alternates between rounds
(shared, noisy machines: trust the per-round ratios and their medians). Run by
bench/serve-peer.sh, which builds and installs everything this needs.

Prints a Markdown table (medians over rounds, and tandem / llama-server ratios) and writes every
round's numbers to --json.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def log(msg):
    print(f"serve-peer: {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


class Server:
    """A server child process: started, waited for, stopped; its log kept in `log_path`."""

    def __init__(self, name, argv, env, log_path, ready):
        self.name, self.log_path, self.ready = name, log_path, ready
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, within_s):
        deadline = time.time() + within_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve-peer: {self.name} exited ({self.proc.returncode}) while "
                                 f"starting; see {self.log_path}")
            try:
                if self.ready():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"serve-peer: {self.name} not ready within {within_s} s; see {self.log_path}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def start_tandem(args, work):
    http = free_port()
    run_dir = os.path.join(work, f"tandem-up-{time.time_ns()}")
    env = dict(os.environ, TANDEM_MODEL=args.tandem_model)
    argv = [args.tandem, "up", "--prefill", "1", "--decode", "1", "--no-sample",
            "--grpc", f"127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{http}",
            "--run-dir", run_dir] + args.tandem_flag
    if args.weights == "f32":
        # The served file converted to f32 at load: the values llama-quantize wrote to the F32 GGUF.
        argv += ["--", "--dtype", "f32"]
    base = f"http://127.0.0.1:{http}"
    s = Server("tandem up", argv, env, os.path.join(work, "tandem.log"),
               lambda: bool(get_json(base + "/v1/models")["data"]))
    s.wait_ready(300)
    return s, base, get_json(base + "/v1/models")["data"][0]["id"]


def start_llama(args, work):
    port = free_port()
    model = args.tandem_model if args.weights == "shipped" else args.f32_model
    argv = [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.llama_threads), "-np", str(args.llama_slots),
            "-c", str(args.llama_slots * (args.isl + args.osl + 64))]
    base = f"http://127.0.0.1:{port}"

    def ready():
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200

    s = Server("llama-server", argv, dict(os.environ), os.path.join(work, "llama-server.log"), ready)
    s.wait_ready(300)
    return s, base, "smollm2"


def aiperf(args, base, model, work, tag, load):
    """One aiperf profile; `load` is ("concurrency", n) or ("request-rate", r)."""
    out = os.path.join(work, tag)
    kind, value = load
    n = int(args.requests_per_stream * (value if kind == "concurrency" else 4))
    warm = min(4, n)
    # One distinct prompt per request, warm-up included: a prompt seen before would be a
    # prefix-cache hit on either server and measure the cache, not the serving path.
    argv = [args.aiperf, "profile", "-m", model, "--url", base, "--endpoint-type", "completions",
            "--num-dataset-entries", str(n + warm), "--conversation-num", str(n + warm),
            "--streaming", "--tokenizer", args.tokenizer,
            "--isl", str(args.isl), "--isl-stddev", "0",
            "--osl", str(args.osl), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--random-seed", "7",
            f"--{kind}", str(value), "--request-count", str(n),
            "--warmup-request-count", str(warm), "--artifact-dir", out,
            "--ui-type", "none"]
    if kind == "request-rate":
        argv += ["--concurrency", str(max(16, int(value * 8)))]
    with open(os.path.join(work, f"{tag}.log"), "w") as logf:
        rc = subprocess.call(argv, stdout=logf, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"serve-peer: aiperf failed ({rc}) for {tag}; see {work}/{tag}.log")
    path = os.path.join(out, "profile_export_aiperf.json")
    with open(path) as f:
        return summarize(json.load(f))


def engine_step_ms(args):
    """tandem's own decode step at one sequence, this run: bench-engine on the same weights, a
    256-token context and 64 generated tokens (the serving runs' shape), no RPC, no client."""
    argv = [args.tandem, "bench-engine", "--model", args.tandem_model, "--runs", "1",
            "--format", "json", "--batch", "1", "--prompt-len", str(args.isl),
            "--decode-prompt-len", str(args.isl), "--decode-tokens", str(args.osl),
            "--dtype", "f32" if args.weights == "f32" else "auto"]
    rep = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return 1000.0 / rep["decode_tok_s"]["1"]


def metric(export, name, stat):
    m = export.get(name)
    if isinstance(m, dict):
        v = m.get(stat)
        return None if v is None else float(v)
    return None


def summarize(export):
    """The figures the table shows, from aiperf's JSON export (milliseconds and tokens/s)."""
    errors = export.get("error_summary") or []
    return {
        "ttft_p50_ms": metric(export, "time_to_first_token", "p50"),
        "ttft_p90_ms": metric(export, "time_to_first_token", "p90"),
        "itl_p50_ms": metric(export, "inter_token_latency", "p50"),
        "out_tok_s": metric(export, "output_token_throughput", "avg"),
        "requests": metric(export, "request_count", "avg"),
        "errors": sum(int(e.get("count", 0)) for e in errors) if isinstance(errors, list) else 0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--tandem-model", required=True)
    ap.add_argument("--tandem-flag", action="append", default=[],
                    help="an extra flag for `tandem up` (repeatable)")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--f32-model", required=True,
                    help="the served model as an F32 GGUF (llama-quantize), for --weights f32")
    ap.add_argument("--weights", choices=["shipped", "f32"], default="shipped",
                    help="shipped: both servers run the served Q4_1 file as it is (tandem's "
                         "--dtype auto); f32: llama-server the F32 GGUF, tandem --dtype f32")
    ap.add_argument("--llama-threads", type=int, default=1)
    ap.add_argument("--llama-slots", type=int, default=16)
    ap.add_argument("--aiperf", required=True)
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="tandem,llama-server",
                    help="which servers to run (one alone: its figures, no ratios)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rates", default="", help="request rates (req/s) to sweep, e.g. 0.5,1,2")
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()

    loads = [("concurrency", int(c)) for c in args.concurrency.split(",") if c]
    loads += [("request-rate", float(r)) for r in args.rates.split(",") if r]
    work = tempfile.mkdtemp(prefix="tandem-serve-peer-")
    log(f"work directory {work}")
    rounds = []
    for r in range(args.rounds):
        order = [(n, f) for n, f in [("tandem", start_tandem), ("llama-server", start_llama)]
                 if n in args.servers.split(",")]
        if r % 2 == 1:
            order.reverse()
        this = {}
        for name, start in order:
            log(f"round {r + 1}: starting {name}")
            server, base, model = start(args, work)
            try:
                for load in loads:
                    tag = f"r{r}-{name}-{load[0]}-{load[1]}"
                    log(f"round {r + 1}: {name}, {load[0]} {load[1]}")
                    this[f"{name}/{load[0]}={load[1]}"] = aiperf(args, base, model, work, tag, load)
            finally:
                server.stop()
        if "tandem" in args.servers.split(","):
            this["engine_step_ms"] = engine_step_ms(args)
            log(f"round {r + 1}: engine decode step {this['engine_step_ms']:.1f} ms")
        rounds.append(this)
    table = report(rounds, loads)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isl": args.isl, "osl": args.osl, "weights": args.weights, "rounds": rounds,
                       "llama_server": {"threads": args.llama_threads, "slots": args.llama_slots},
                       "tandem_flags": args.tandem_flag}, f, indent=1)


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, digits=1):
    return "–" if v is None else f"{v:.{digits}f}"


def report(rounds, loads):
    lines = ["| load | tandem out tok/s | llama-server out tok/s | ratio | tandem TTFT p50 / p90 ms | "
             "llama-server TTFT p50 / p90 ms | TTFT p50 ratio | tandem ITL p50 ms | "
             "llama-server ITL p50 ms | errors (t / l) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, value in loads:
        key = f"{kind}={value}"
        none = {f: None for f in ("out_tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms")} | {"errors": 0}
        t = [r.get(f"tandem/{key}", none) for r in rounds]
        l = [r.get(f"llama-server/{key}", none) for r in rounds]

        def m(rows, field):
            return med([x[field] for x in rows])

        def ratio(field):
            per_round = [a[field] / b[field] for a, b in zip(t, l) if a[field] and b[field]]
            return med(per_round)

        lines.append(
            f"| {kind} {value} | {fmt(m(t, 'out_tok_s'))} | {fmt(m(l, 'out_tok_s'))} | "
            f"{fmt(ratio('out_tok_s'), 2)}× | {fmt(m(t, 'ttft_p50_ms'), 0)} / {fmt(m(t, 'ttft_p90_ms'), 0)} | "
            f"{fmt(m(l, 'ttft_p50_ms'), 0)} / {fmt(m(l, 'ttft_p90_ms'), 0)} | {fmt(ratio('ttft_p50_ms'), 2)}× | "
            f"{fmt(m(t, 'itl_p50_ms'))} | {fmt(m(l, 'itl_p50_ms'))} | "
            f"{sum(x['errors'] for x in t)} / {sum(x['errors'] for x in l)} |")
    steps = [r["engine_step_ms"] for r in rounds if "engine_step_ms" in r]
    if steps and ("concurrency", 1) in loads:
        itl = [r["tandem/concurrency=1"]["itl_p50_ms"] for r in rounds if "engine_step_ms" in r]
        lines.append("")
        lines.append(f"tandem's engine decode step at one sequence, same run (bench-engine): "
                     f"{fmt(med(steps))} ms; ITL p50 at concurrency 1 over it: "
                     f"{fmt(med([i / st for i, st in zip(itl, steps) if i]), 2)}× (median of rounds)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
