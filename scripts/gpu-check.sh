#!/usr/bin/env bash
# The one prepared GPU check (issue 16), run ON THE GPU MACHINE from the repository root, with
# the binaries scripts/gpu-pack.sh built here carried along in .gpu/ (there is no cargo there).
#
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=540)
#
# Steps (each prints its name; a failing step is named in the log and in RESULTS-gpu.md, and the
# script goes on to the next step unless nothing after it can work):
#   1. nvidia-smi
#   2. LD_LIBRARY_PATH for libcuda / libnvrtc / libcublas (/usr/local/cuda/lib64 and the PyTorch
#      venv's nvidia/cu13/lib)
#   3. kernels-cuda's GPU test (every kernel against the CPU kernels; sampling against the CPU's
#      sampler, token for token, with its time beside argmax's; GEMM with the residual in its
#      epilogue; XXH3 on the device; a second process copying into a pool by CUDA IPC)
#   4. the engine's CUDA test (engine on cuda:0 against the CPU engine, dummy weights; staged
#      split; three tensor-parallel ranks against the unsharded engine; sampled requests picked
#      on the device against the same requests sampled by the host)
#   5. exactness: `tandem generate` on --device cuda vs --device cpu, f32, SmolLM2-135M shape,
#      8 prompts x 64 greedy tokens: identical, or the first divergence; then bf16 on cuda vs f32
#   6. PyTorch anchor (../shared/gpu/anchor.py smollm2-135m), in the same call
#   7. `tandem bench-engine --device cuda` on the SmolLM2-135M shape (prefill 512; decode batch
#      1 / 32 / 256 around ctx 96), JSON
#   7b. the same with TANDEM_CUDA_GRAPHS=0 (decode kernel by kernel: what the graphs are worth)
#   7c. the same sampled (temperature 0.8, top-p 0.95; tokens picked on the device)
#   8. optional (GPU_CHECK_70B=1): bench-engine on the 70B shape (8 layers built)
#   9. serving: `bench-serve --device cuda` on the small GGUF, 1 prefill + 1 decode node on the
#      GPU (KV device to device by CUDA IPC) beside one colocated GPU engine, concurrency
#      1 / 16 / 64; the nodes' KV counters say how many bytes went by IPC
#   9b. the disaggregated side again with --no-cuda-ipc (KV staged through pinned host memory:
#      the cross-machine path), concurrency 16 / 64
# Everything goes to $OUT (the run tool returns it): gpu-check.log, one file per step, and
# RESULTS-gpu.md, a draft for bench/RESULTS-gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
RESULTS="$OUT/RESULTS-gpu.md"
exec > >(tee -a "$LOG") 2>&1

G=.gpu
TANDEM="$G/tandem"
SMOL=scripts/gpu/smollm2-135m.json
BIG=scripts/gpu/llama70b-8l.json
FAILED=()

# The whole check must end (and write RESULTS-gpu.md) inside the run tool's limit: every step's
# timeout is cut to what is left of GPU_CHECK_BUDGET_S (default 510 s, for timeout_s=540), and a
# step that starts with under 20 s left is cut to 1 s (it fails, named, and the rest still report).
BUDGET="${GPU_CHECK_BUDGET_S:-510}"
tmo() { local left=$((BUDGET - SECONDS - 15)); local t=$(( $1 < left ? $1 : left )); (( t < 5 )) && t=1; echo "$t"; }
step() { echo; echo "=== gpu-check: $* ($(date -u +%H:%M:%S), ${SECONDS}s of ${BUDGET}s used)"; }
failed() { echo "gpu-check: FAILED at step: $*"; FAILED+=("$*"); }
die() { failed "$*"; finish; exit 1; }
md() { printf '%s\n' "$*" >> "$RESULTS"; }

finish() {
    md ""
    if [ ${#FAILED[@]} -eq 0 ]; then md "All steps ran."; else
        md "## Failed steps"; for f in "${FAILED[@]}"; do md "- $f"; done; fi
    echo "gpu-check: results in $RESULTS; failed steps: ${#FAILED[@]}"
}

: > "$RESULTS"
md "# tandem on the GPU: draft results ($(date -u +%Y-%m-%d))"
md ""
md "Written by scripts/gpu-check.sh; binaries from $(tr '\n' ' ' < "$G/COMMIT" 2>/dev/null || echo 'an unknown commit')."

# ------------------------------------------------------------------------------------------------
step "1. nvidia-smi"
# gpu-pack.sh gzips everything to fit the carry limit: unpack it here (binaries stay executable).
for z in "$G"/*.gz "$G"/bin/*.gz "$G"/lib/*.gz; do
    [ -e "$z" ] || continue
    f=${z%.gz}
    if [ ! -e "$f" ]; then
        gunzip -c "$z" > "$f" && chmod +x "$f" || die "unpack $z"
    fi
done
for f in "$TANDEM" "$G/kernels-cuda-gpu" "$G/engine-cuda" "$G/anchor.py" "$G/small.gguf" "$G/bin/etcd" "$G/bin/nats-server"; do
    [ -e "$f" ] || die "find $f (run scripts/gpu-pack.sh on the build machine and carry .gpu)"
done
# tandem links UCX (and libnuma); use the carried copies only where this machine lacks them.
if ldd "$TANDEM" | grep -q "not found"; then
    echo "gpu-check: this machine lacks $(ldd "$TANDEM" | awk '/not found/ { print $1 }' | tr '\n' ' '); using .gpu/lib"
    export LD_LIBRARY_PATH="$PWD/$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
ldd "$TANDEM" | grep -q "not found" && die "load tandem's shared libraries: $(ldd "$TANDEM" | grep 'not found')"
export PATH="$PWD/$G/bin:$PATH"
nvidia-smi | tee "$OUT/nvidia-smi.txt" || failed "nvidia-smi"
GPU_NAME=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
md ""
md "Device: ${GPU_NAME:-unknown} (nvidia-smi: name, memory, driver)."

# ------------------------------------------------------------------------------------------------
step "2. LD_LIBRARY_PATH for libcuda, libnvrtc, libcublas"
PY="${PYTHON:-python3}"
NV_DIR=$("$PY" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
LIBS=/usr/local/cuda/lib64
[ -n "$NV_DIR" ] && [ -d "$NV_DIR/cu13/lib" ] && LIBS="$LIBS:$NV_DIR/cu13/lib"
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TANDEM_PTX_CACHE="$OUT/ptx-cache"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13; do
    if "$PY" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$lib" 2>/dev/null; then
        echo "  $lib: loadable"
    else
        failed "load $lib through the dynamic loader (LD_LIBRARY_PATH above)"
    fi
done

# ------------------------------------------------------------------------------------------------
step "3. kernels-cuda GPU test (every kernel against tandem-kernels)"
if timeout "$(tmo 180)" "$G/kernels-cuda-gpu" --nocapture --test-threads=1 > "$OUT/kernels-cuda-gpu.txt" 2>&1; then
    KSTATUS=passed
else
    KSTATUS="FAILED (exit $?)"; failed "kernels-cuda GPU test"
fi
tail -n 30 "$OUT/kernels-cuda-gpu.txt"
md ""
md "## Kernels (kernels-cuda tests/gpu.rs): $KSTATUS"
md '```'
grep -E "kernels-cuda:|µs|us |ms|GB/s|test result" "$OUT/kernels-cuda-gpu.txt" | head -n 60 >> "$RESULTS"
md '```'

# ------------------------------------------------------------------------------------------------
step "4. engine CUDA test (engine on cuda:0 against the CPU engine, dummy weights)"
if timeout "$(tmo 240)" "$G/engine-cuda" --nocapture --test-threads=1 > "$OUT/engine-cuda.txt" 2>&1; then
    ESTATUS=passed
else
    ESTATUS="FAILED (exit $?)"; failed "engine CUDA test"
fi
tail -n 30 "$OUT/engine-cuda.txt"
md ""
md "## Engine test (engine/tests/cuda.rs): $ESTATUS"
md '```'
grep -E "engine cuda tests|panicked|test result|^test " "$OUT/engine-cuda.txt" | head -n 30 >> "$RESULTS"
md '```'

# ------------------------------------------------------------------------------------------------
step "5. exactness: generate on cuda vs cpu (f32, SmolLM2-135M shape, 8 prompts x 64 tokens)"
# Prompt i: 16 + 24 i token ids from a fixed recurrence (no tokenizer: dummy weights).
prompt_ids() {
    "$PY" -c 'import sys
i = int(sys.argv[1]); n = 16 + 24 * i
print(",".join(str(256 + (j * 7919 + i * 104729) % 48000) for j in range(n)))' "$1"
}
gen() { # device dtype prompt -> the token_ids line
    timeout "$(tmo 120)" "$TANDEM" generate --device "$1" --dtype "$2" --dummy-weights "$SMOL" --prompt-ids "$3" \
        --max-tokens 64 --print-token-ids --kv-dtype f32 --kv-blocks 256 2>&1 >/dev/null | grep '^token_ids:'
}
SAME=0; BF_AGREE=0; BF_TOTAL=0; EXACT_LINES=()
for i in 0 1 2 3 4 5 6 7; do
    p=$(prompt_ids "$i")
    cpu=$(gen cpu f32 "$p") || { failed "generate --device cpu (prompt $i)"; continue; }
    gpu=$(gen cuda f32 "$p") || { failed "generate --device cuda --dtype f32 (prompt $i)"; continue; }
    bf=$(gen cuda bf16 "$p") || { failed "generate --device cuda --dtype bf16 (prompt $i)"; bf=""; }
    echo "prompt $i cpu  f32: $cpu" >> "$OUT/exactness.txt"
    echo "prompt $i cuda f32: $gpu" >> "$OUT/exactness.txt"
    echo "prompt $i cuda bf16: $bf" >> "$OUT/exactness.txt"
    line=$("$PY" - "$cpu" "$gpu" "$bf" <<'EOF'
import ast, sys
parse = lambda s: ast.literal_eval(s.split(":", 1)[1].strip()) if s else []
c, g, b = (parse(s) for s in sys.argv[1:4])
div = next((k for k, (x, y) in enumerate(zip(c, g)) if x != y), None)
if div is not None:
    verdict = f"first divergence at token {div}: cpu {c[div]} cuda {g[div]}"
elif len(c) != len(g):
    verdict = f"lengths differ: cpu {len(c)} cuda {len(g)}"
else:
    verdict = "identical"
agree = next((k for k, (x, y) in enumerate(zip(c, b)) if x != y), min(len(c), len(b)))
print(f"{verdict}|{agree}|{len(c)}")
EOF
)
    verdict=${line%%|*}; rest=${line#*|}
    [ "$verdict" = identical ] && SAME=$((SAME + 1))
    BF_AGREE=$((BF_AGREE + ${rest%%|*})); BF_TOTAL=$((BF_TOTAL + ${rest##*|}))
    EXACT_LINES+=("- prompt $i ($((16 + 24 * i)) tokens): f32 cuda vs cpu: $verdict")
    echo "prompt $i: $verdict; bf16 agrees for ${rest%%|*} tokens"
done
md ""
md "## Exactness (SmolLM2-135M shape, dummy weights seed 0, f32 KV, 64 greedy tokens)"
md ""
md "f32 on cuda:0 against f32 on the CPU: $SAME of 8 prompts identical."
for l in "${EXACT_LINES[@]}"; do md "$l"; done
md ""
md "bf16 weights on cuda:0 against f32 on the CPU: $BF_AGREE of $BF_TOTAL tokens agree before each prompt's first divergence."
[ "$SAME" -eq 8 ] || failed "exactness: $SAME of 8 prompts identical (see exactness.txt)"

# ------------------------------------------------------------------------------------------------
step "6. PyTorch anchor (anchor.py smollm2-135m)"
if timeout "$(tmo 240)" "$PY" "$G/anchor.py" smollm2-135m > "$OUT/anchor-smollm2.jsonl" 2> "$OUT/anchor-smollm2.err"; then
    cat "$OUT/anchor-smollm2.jsonl"
else
    failed "PyTorch anchor (see anchor-smollm2.err)"; tail -n 20 "$OUT/anchor-smollm2.err"
fi
md ""
md "## PyTorch anchor, same call (anchor.py smollm2-135m)"
md '```'
cat "$OUT/anchor-smollm2.jsonl" >> "$RESULTS" 2>/dev/null
md '```'

# ------------------------------------------------------------------------------------------------
bench() { # name config extra-args...
    local name=$1 cfg=$2; shift 2
    if timeout "$(tmo 300)" "$TANDEM" bench-engine --device cuda --dummy-weights "$cfg" --kv-dtype bf16 "$@" --format json \
        > "$OUT/bench-$name.json" 2> "$OUT/bench-$name.err"; then
        cat "$OUT/bench-$name.json"; echo
        md ""; md "## tandem bench-engine --device cuda: $name"; md ""
        "$PY" - "$OUT/bench-$name.json" >> "$RESULTS" <<'EOF' || failed "render bench-$name.json"
import json, sys
r = json.load(open(sys.argv[1]))
sampled = f"sampled T {r['temperature']} top-p {r['top_p']}" if r.get("temperature") else "greedy"
print(f"{r['model']} · {r['device']} · weights {r['dtype']} · KV {r['kv_dtype']} · medians of {r['runs']} runs · {sampled} · "
      f"tokens picked on the device: {r.get('tokens_picked_on_device')} · "
      f"decode steps from CUDA graphs: {r.get('cuda_graph_replays')} (failed captures: {r.get('cuda_graph_fallbacks')})")
print()
print("| figure | tandem | min–max |")
print("|---|---|---|")
p = r["prefill_spread"]
print(f"| prefill {r['prompt_len']} | {p['median']:,.0f} tok/s | {p['min']:,.0f}–{p['max']:,.0f} |")
for b, s in sorted(r["decode_spread"].items(), key=lambda kv: int(kv[0])):
    ms = 1e3 * int(b) / s["median"]
    print(f"| decode batch {b} | {ms:.2f} ms/step ({s['median']:,.0f} tok/s) | {s['min']:,.0f}–{s['max']:,.0f} tok/s |")
EOF
    else
        failed "bench-engine $name (see bench-$name.err)"; tail -n 20 "$OUT/bench-$name.err"
    fi
}

step "7. bench-engine --device cuda, SmolLM2-135M shape (bf16 weights and KV)"
bench smollm2-135m "$SMOL" --prompt-len 512 --batch 1,32,256 --decode-prompt-len 64 --decode-tokens 64 \
    --runs 3 --kv-cache-gb 8 --max-model-len 2048

step "7b. the same without CUDA graphs (TANDEM_CUDA_GRAPHS=0): what the graphs are worth"
TANDEM_CUDA_GRAPHS=0 bench smollm2-135m-no-graphs "$SMOL" --prompt-len 512 --batch 1,32,256 --decode-prompt-len 64 \
    --decode-tokens 64 --runs 3 --kv-cache-gb 8 --max-model-len 2048

step "7c. the same sampled (temperature 0.8, top-p 0.95: picked on the device by sample.cu)"
bench smollm2-135m-sampled "$SMOL" --prompt-len 64 --batch 1,256 --decode-prompt-len 64 --decode-tokens 64 \
    --runs 1 --kv-cache-gb 8 --max-model-len 2048 --temperature 0.8 --top-p 0.95

if [ "${GPU_CHECK_70B:-0}" = 1 ]; then
    step "8. bench-engine --device cuda, 70B shape (8 layers built)"
    bench llama70b-8l "$BIG" --prompt-len 2048 --batch 1,16 --decode-prompt-len 2048 --decode-tokens 16 \
        --runs 1 --kv-cache-gb 40 --max-model-len 8192
fi

# ------------------------------------------------------------------------------------------------
step "9. serving: bench-serve --device cuda (1 prefill + 1 decode node on the GPU, KV by CUDA IPC) beside one colocated GPU engine"
# The small GGUF (2 layers, the real tokenizer): the router and the nodes need a tokenizer, and
# the real model does not fit the carry limit. Both sides run the same weights on the same GPU.
if timeout "$(tmo 420)" "$TANDEM" bench-serve --device cuda --model "$G/small.gguf" --concurrency 1,16,64 --requests 64 \
    --prompt-len 256 --max-tokens 64 --json > "$OUT/bench-serve.json" 2> "$OUT/bench-serve.err"; then
    cat "$OUT/bench-serve.json"; echo
    md ""; md "## Serving on the GPU: bench-serve --device cuda (small GGUF: 2 layers, real tokenizer; KV by CUDA IPC)"; md ""
    "$PY" - "$OUT/bench-serve.json" >> "$RESULTS" <<'EOF' || failed "render bench-serve.json"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"prompt {r['prompt_len']} tokens, {r['max_tokens']} output tokens, {r['requests_per_level']} requests a level")
print()
print("| side | concurrency | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s |")
print("|---|---|---|---|---|")
for side in ("disaggregated", "colocated"):
    for l in r[side]:
        print(f"| {side} | {l.get('concurrency')} | {l['ttft_p50_ms']:.1f} / {l['ttft_p99_ms']:.1f} "
              f"| {l['itl_p50_ms']:.2f} / {l['itl_p99_ms']:.2f} | {l['output_tok_s']:,.0f} |")
kv = r.get("kv") or {}
if kv:
    share = 100 * kv["ipc_bytes_sent"] / max(kv["bytes_sent"], 1)
    per = 1e3 * kv["transfer_seconds"] / max(kv["transfers_received"], 1)
    print()
    print(f"KV: {kv['bytes_sent']/1e6:.1f} MB pushed in {kv['transfers_received']} transfers, {share:.0f}% by CUDA IPC; "
          f"mean push, start to confirmation: {per:.2f} ms")
EOF
else
    failed "bench-serve --device cuda (see bench-serve.err)"; tail -n 30 "$OUT/bench-serve.err"
fi

step "9b. the disaggregated side with --no-cuda-ipc (KV staged through pinned host memory)"
if timeout "$(tmo 200)" "$TANDEM" bench-serve --device cuda --no-cuda-ipc --mode disaggregated --model "$G/small.gguf" \
    --concurrency 16,64 --requests 64 --prompt-len 256 --max-tokens 64 --json > "$OUT/bench-serve-staged.json" \
    2> "$OUT/bench-serve-staged.err"; then
    md ""; md "### The same cluster with --no-cuda-ipc (staged through host memory)"; md ""
    "$PY" - "$OUT/bench-serve-staged.json" >> "$RESULTS" <<'EOF' || failed "render bench-serve-staged.json"
import json, sys
r = json.load(open(sys.argv[1]))
print("| concurrency | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s |")
print("|---|---|---|---|")
for l in r["disaggregated"]:
    print(f"| {l.get('concurrency')} | {l['ttft_p50_ms']:.1f} / {l['ttft_p99_ms']:.1f} "
          f"| {l['itl_p50_ms']:.2f} / {l['itl_p99_ms']:.2f} | {l['output_tok_s']:,.0f} |")
kv = r.get("kv") or {}
if kv:
    per = 1e3 * kv["transfer_seconds"] / max(kv["transfers_received"], 1)
    print()
    print(f"KV: {kv['bytes_sent']/1e6:.1f} MB pushed in {kv['transfers_received']} transfers, "
          f"{kv['ipc_bytes_sent']} bytes by CUDA IPC; mean push, start to confirmation: {per:.2f} ms")
EOF
else
    failed "bench-serve --device cuda --no-cuda-ipc (see bench-serve-staged.err)"; tail -n 30 "$OUT/bench-serve-staged.err"
fi

finish
[ ${#FAILED[@]} -eq 0 ]
