#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs tandem's whole test suite. This is the command CI runs
# (.ci/run calls it). Tests that need the model, Python's reference or (later) etcd/NATS start
# or find them through the environment set here; they fail, never skip, when something is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$(date +%s)
# The dev profile is optimised (Cargo.toml), and it is the one `cargo test` builds: one build, not two.
export TANDEM_PROFILE=dev
scripts/setup.sh
export TANDEM_PYTHON="$root/.tandem/venv/bin/python"
# NVRTC from the wheel setup.sh installed (kernels-cuda compiles its kernels in the tests; cudarc
# finds libnvrtc.so.13 only through the dynamic loader's path).
nvrtc_lib="$("$TANDEM_PYTHON" -c '
import nvidia, os, sys
libs = [os.path.join(p, "cu13", "lib") for p in nvidia.__path__]
found = [d for d in libs if os.path.exists(os.path.join(d, "libnvrtc.so.13"))]
print(found[0] if found else sys.exit("test.sh: libnvrtc.so.13 not in %s (scripts/setup.sh installs it)" % libs))
')"
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TANDEM_MODEL="$(cargo run -q -p tandem-cli -- model path)"
cargo test --workspace --no-fail-fast "$@"
echo "test.sh: done in $(( $(date +%s) - start ))s" >&2
