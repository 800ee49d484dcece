#!/usr/bin/env bash
# tandem's cluster (`tandem up`, 1 prefill + 1 decode node) against llama.cpp's llama-server, as a
# user measures servers: NVIDIA's aiperf (PyPI, in its own venv) streaming completions of 256
# prompt tokens and 64 output tokens at concurrency 1, 4 and 16 (and request rates with --rates),
# every prompt distinct (no prefix-cache hits), both servers on the same weights: the served
# Q4_1 file as shipped (default), or with --weights f32 that model dequantised to F32 (llama-
# quantize's file for llama-server, --dtype f32 for tandem), alternating rounds. llama.cpp is the revision
# bench/peer.sh builds (llama-cpp-python 0.3.36's). Each step says what failed, with its log.
#
#   bench/serve-peer.sh                                # 2 rounds, concurrency 1,4,16
#   bench/serve-peer.sh --rounds 3 --rates 0.5,1,2 --json bench/serve-peer.json
#   bench/serve-peer.sh --weights f32
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
peer="$root/.tandem/peer"
venv="$root/.tandem/venv"
aiperf_venv="$root/.tandem/aiperf"
src="$peer/llama_cpp_python-0.3.36/vendor/llama.cpp"
bin="$src/build/bin"
mkdir -p "$peer"
fail() { echo "serve-peer: FAILED: $1${2:+ (log: $2)}" >&2; exit 1; }

scripts/setup.sh || fail "scripts/setup.sh"
cargo build -q --release -p tandem-cli || fail "building tandem (cargo build --release -p tandem-cli)"

if [[ ! -x "$bin/llama-server" || ! -x "$bin/llama-quantize" ]]; then
  echo "serve-peer: building llama.cpp's llama-server (llama-cpp-python 0.3.36's llama.cpp)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check scikit-build-core cmake >&2 ||
    fail "installing cmake into $venv"
  [[ -f "$peer/llama_cpp_python-0.3.36.tar.gz" ]] ||
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --no-build-isolation --no-binary :all: -d "$peer" llama-cpp-python==0.3.36 >&2 ||
    fail "downloading llama-cpp-python 0.3.36 (the llama.cpp sources)"
  # Unpacked once: unpacking again would touch every source and rebuild all of llama.cpp.
  [[ -d "$src" ]] || tar -xzf "$peer/llama_cpp_python-0.3.36.tar.gz" -C "$peer" || fail "unpacking llama.cpp"
  "$venv/bin/cmake" -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >"$peer/cmake.log" 2>&1 ||
    fail "configuring llama.cpp" "$peer/cmake.log"
  "$venv/bin/cmake" --build "$src/build" -j"$(nproc)" --target llama-server llama-quantize \
    >"$peer/build-server.log" 2>&1 || fail "building llama-server" "$peer/build-server.log"
fi

if [[ ! -x "$aiperf_venv/bin/aiperf" ]]; then
  echo "serve-peer: installing aiperf into $aiperf_venv" >&2
  python3 -m venv "$aiperf_venv" || fail "creating $aiperf_venv (python3 -m venv)"
  "$aiperf_venv/bin/pip" install -q --disable-pip-version-check aiperf >"$peer/aiperf-install.log" 2>&1 ||
    fail "pip install aiperf" "$peer/aiperf-install.log"
fi

model="$(target/release/tandem model path)"
[[ -f "$peer/smollm2-F32.gguf" ]] ||
  "$bin/llama-quantize" --allow-requantize "$model" "$peer/smollm2-F32.gguf" F32 >"$peer/quantize-F32.log" 2>&1 ||
  fail "making the F32 GGUF with llama-quantize" "$peer/quantize-F32.log"

# aiperf counts tokens with a Hugging Face tokenizer: the model's own, built from the GGUF by the
# test reference's independent converter (no network needed).
tok="$peer/smollm2-tokenizer"
if [[ ! -f "$tok/tokenizer.json" ]]; then
  mkdir -p "$tok"
  "$venv/bin/python" - "$model" "$tok" <<'PY' || fail "writing the aiperf tokenizer"
import json, os, sys
sys.path.insert(0, "tests/reference")
from hf_tokenize import build_tokenizer
model, out = sys.argv[1], sys.argv[2]
build_tokenizer(model).save(os.path.join(out, "tokenizer.json"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
           "eos_token": "<|im_end|>", "model_max_length": 8192}, open(os.path.join(out, "tokenizer_config.json"), "w"))
PY
fi

exec "$venv/bin/python" bench/serve_peer.py --tandem target/release/tandem --tandem-model "$model" \
  --llama-server "$bin/llama-server" --f32-model "$peer/smollm2-F32.gguf" \
  --aiperf "$aiperf_venv/bin/aiperf" --tokenizer "$tok" "$@"
