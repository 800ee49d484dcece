#!/usr/bin/env bash
# Measures tandem's engine against its peer, llama.cpp's CPU engine on the same weights, on this
# machine, in one run: it builds llama.cpp (the revision bundled in llama-cpp-python 0.3.36)
# under .tandem/peer/, makes F32, F16, Q8_0 and Q4_0 GGUFs from the served Q4_1 model
# with llama-quantize (so both engines run the same weights; q4_1 is the served file itself, run
# as stored by both), then alternates rounds of
# `tandem bench-engine` and llama.cpp's llama-bench / llama-batched-bench and prints medians,
# min–max and per-round ratios (bench/peer.py). Shared, noisy machines: trust the ratios.
#
#   bench/peer.sh                # 5 rounds, F32, F16, Q8_0 and Q4_1 (Q4_0 with --dtypes)
#   bench/peer.sh --rounds 3 --dtypes f16 --json out.json
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
cargo build -q --release -p tandem-cli

peer="$root/.tandem/peer"
venv="$root/.tandem/venv"
src="$peer/llama_cpp_python-0.3.36/vendor/llama.cpp"
bin="$src/build/bin"
mkdir -p "$peer"
if [[ ! -x "$bin/llama-batched-bench" || ! -x "$bin/llama-bench" || ! -x "$bin/llama-quantize" ]]; then
  echo "peer: fetching llama-cpp-python 0.3.36 (sdist) and building llama.cpp's benchmarks" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check scikit-build-core cmake >&2
  [[ -f "$peer/llama_cpp_python-0.3.36.tar.gz" ]] ||
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --no-build-isolation --no-binary :all: -d "$peer" llama-cpp-python==0.3.36 >&2
  # Unpacked once: unpacking again would touch every source and rebuild all of llama.cpp.
  [[ -d "$src" ]] || tar -xzf "$peer/llama_cpp_python-0.3.36.tar.gz" -C "$peer"
  cmake="$venv/bin/cmake"
  "$cmake" -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >"$peer/cmake.log" 2>&1
  "$cmake" --build "$src/build" -j"$(nproc)" \
    --target llama-bench llama-batched-bench llama-quantize >"$peer/build.log" 2>&1
fi

model="$(target/release/tandem model path)"
# A CPU can advertise AMX while its OS (a VM's, here) has not enabled the tile state: ggml's
# native build then dies with SIGILL at its first tile instruction. Smoke-run llama-bench and,
# if it fails, rebuild without AMX (said here; tandem has no AMX path either).
smoke() { ( "$bin/llama-bench" -m "$model" -t 1 -p 8 -n 0 -r 1 >/dev/null 2>"$peer/smoke.log" ) 2>/dev/null; }
rc=0
smoke || rc=$?
if ((rc != 0)); then
  why="exit status $rc"
  ((rc == 132)) && why="SIGILL: an instruction this machine refuses"
  echo "peer: llama-bench failed a smoke run ($why); rebuilding llama.cpp without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)" >&2
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "$venv/bin/cmake" -S "$src" -B "$src/build" -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" >>"$peer/cmake.log" 2>&1
  "$venv/bin/cmake" --build "$src/build" -j"$(nproc)" \
    --target llama-bench llama-batched-bench llama-quantize >>"$peer/build.log" 2>&1
  smoke || { echo "peer: FAILED at step: llama-bench smoke run after the rebuild without AMX: $(cat "$peer/smoke.log")" >&2; exit 1; }
fi
for t in F32 F16 Q8_0 Q4_0; do
  # --pure for Q4_0: every matrix Q4_0, or llama-quantize would make the tied embedding Q6_K
  # (a type tandem dequantises), and the two engines would not run the same kernels.
  pure=()
  [[ $t == Q4_0 ]] && pure=(--pure)
  [[ -f "$peer/smollm2-$t.gguf" ]] ||
    "$bin/llama-quantize" --allow-requantize "${pure[@]}" "$model" "$peer/smollm2-$t.gguf" "$t" >"$peer/quantize-$t.log" 2>&1
done
exec "$venv/bin/python" bench/peer.py --tandem target/release/tandem --model "$model" \
  --peer-bin "$bin" --peer-models "$peer" "$@"
