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
export TANDEM_MODEL="$(cargo run -q -p tandem-cli -- model path)"
cargo test --workspace --no-fail-fast "$@"
echo "test.sh: done in $(( $(date +%s) - start ))s" >&2
