#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs tandem's main job: for now, one streamed chat completion on
# the real model with the local engine (the local disaggregated cluster replaces this as it lands).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
cargo run -q --release -p tandem-cli -- generate --chat --max-tokens 96 \
  --prompt "${1:-Explain in two sentences why prefill and decode are served on separate GPUs.}"
