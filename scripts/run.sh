#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs tandem's main job: a local disaggregated cluster (etcd,
# NATS, one decode node, one prefill node and the router, all serving the real SmolLM2 model),
# a chat answer streamed through it, then an orderly shutdown. Logs land in .tandem/run/<time>/.
# To keep the cluster serving, run `target/release/tandem up` yourself (Ctrl-C stops it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
cargo build -q --release -p tandem-cli
args=(up --exit-after-sample)
[[ $# -gt 0 ]] && args+=(--prompt "$1")
exec target/release/tandem "${args[@]}"
