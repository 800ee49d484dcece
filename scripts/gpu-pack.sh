#!/usr/bin/env bash
# Builds, HERE (a CPU machine with cargo), everything scripts/gpu-check.sh runs on the GPU machine
# (which has no cargo), into the ignored folder .gpu/, to be carried there (`carry: [".gpu"]`,
# 64 MiB at most):
#   (each binary stripped and gzipped: .gpu/NAME.gz; gpu-check.sh unpacks them there)
#   .gpu/tandem             the CLI, stripped (release profile; GPU_PACK_PROFILE=dev for the
#                           optimised dev profile, which builds faster here)
#   .gpu/kernels-cuda-gpu   kernels-cuda's GPU test (tests/gpu.rs), stripped
#   .gpu/engine-cuda        the engine's CUDA-vs-CPU test (engine/tests/cuda.rs), stripped
#   .gpu/anchor.py          the PyTorch baseline (../shared/gpu/anchor.py)
#   .gpu/small.gguf         2 layers of the served GGUF with its tokenizer (scripts/gpu/small_gguf.py):
#                           the real model (94 MB) does not fit the carry limit; serving needs a tokenizer
#   .gpu/bin/{etcd,nats-server}  the control plane for `bench-serve --device cuda` (not installed there)
#   .gpu/lib/               the UCX and libnuma libraries `tandem` links (the GPU machine may lack them)
# Every step names itself and stops the script when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE="${GPU_PACK_PROFILE:-release}"
DEST=.gpu
LIMIT_MIB=64

step() { echo "gpu-pack: $*" >&2; }
fail() { echo "gpu-pack: FAILED at step: $*" >&2; exit 1; }

# The test binary cargo built for `cargo test -p PKG --test NAME --no-run` (its path, from
# cargo's JSON messages).
test_binary() {
    local pkg=$1 name=$2
    cargo test -p "$pkg" --test "$name" --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name and m["profile"]["test"]:
        print(m["executable"])
' "$name" | tail -n 1
}

command -v cargo >/dev/null || fail "find cargo (run this on the build machine, not the GPU machine)"
command -v strip >/dev/null || fail "find strip (binutils)"
[ -f ../shared/gpu/anchor.py ] || fail "find ../shared/gpu/anchor.py"

rm -rf "$DEST"
mkdir -p "$DEST"

step "building tandem ($PROFILE profile)"
if [ "$PROFILE" = release ]; then
    cargo build --release -p tandem-cli || fail "cargo build --release -p tandem-cli"
    cp target/release/tandem "$DEST/tandem" || fail "copy target/release/tandem"
else
    cargo build -p tandem-cli || fail "cargo build -p tandem-cli"
    cp target/debug/tandem "$DEST/tandem" || fail "copy target/debug/tandem"
fi

step "building the kernels-cuda GPU test binary"
cargo test -p tandem-kernels-cuda --test gpu --no-run || fail "cargo test -p tandem-kernels-cuda --test gpu --no-run"
bin=$(test_binary tandem-kernels-cuda gpu)
[ -n "$bin" ] && [ -x "$bin" ] || fail "find the kernels-cuda gpu test binary"
cp "$bin" "$DEST/kernels-cuda-gpu"

step "building the engine's CUDA test binary"
cargo test -p tandem-engine --test cuda --no-run || fail "cargo test -p tandem-engine --test cuda --no-run"
bin=$(test_binary tandem-engine cuda)
[ -n "$bin" ] && [ -x "$bin" ] || fail "find the engine cuda test binary"
cp "$bin" "$DEST/engine-cuda"

step "the small GGUF (2 layers of the served model, its tokenizer kept)"
PY="${TANDEM_PYTHON:-.tandem/venv/bin/python}"
MODEL="${TANDEM_MODEL:-$HOME/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$MODEL" ] || fail "find the served model at $MODEL (scripts/setup.sh fetches it)"
"$PY" scripts/gpu/small_gguf.py "$MODEL" "$DEST/small.gguf" --layers 2 || fail "write $DEST/small.gguf with $PY"

step "etcd, nats-server and the shared libraries tandem links beyond glibc"
mkdir -p "$DEST/bin" "$DEST/lib"
for b in etcd nats-server; do
    cp "$(command -v "$b")" "$DEST/bin/$b" || fail "copy $b (scripts/setup.sh installs it)"
done
libs=$(ldd "$DEST/tandem" | awk '/libuc[mpst]|libnuma/ { print $3 }')
[ -n "$libs" ] || fail "find the UCX libraries in ldd $DEST/tandem"
for l in $libs; do cp -L "$l" "$DEST/lib/" || fail "copy $l"; done

step "stripping and compressing"
strip "$DEST/tandem" "$DEST/kernels-cuda-gpu" "$DEST/engine-cuda" || fail "strip the binaries"
# Stripped, the three binaries come near the 64 MiB carry limit (the CLI alone was 38 MB on
# 2026-12-06); gzip takes them to about a third. gpu-check.sh unpacks every .gz on the GPU machine.
gzip -9 -f "$DEST/tandem" "$DEST/kernels-cuda-gpu" "$DEST/engine-cuda" "$DEST/small.gguf" \
    "$DEST"/bin/* "$DEST"/lib/* || fail "gzip the binaries"
cp ../shared/gpu/anchor.py "$DEST/anchor.py" || fail "copy anchor.py"
git rev-parse HEAD > "$DEST/COMMIT" 2>/dev/null || echo unknown > "$DEST/COMMIT"
git status --porcelain --untracked-files=no | grep -q . && echo "dirty" >> "$DEST/COMMIT" || true

total_kib=$(du -sk "$DEST" | cut -f1)
ls -l "$DEST" >&2
step "$DEST holds $((total_kib / 1024)) MiB (carry limit $LIMIT_MIB MiB with the ignored paths named)"
[ "$total_kib" -le $((LIMIT_MIB * 1024)) ] || fail "fit $DEST in $LIMIT_MIB MiB (try GPU_PACK_PROFILE=release)"
step "done: run scripts/gpu-check.sh on the GPU machine with carry [\".gpu\"]"
