#!/usr/bin/env bash
# The KV pool's unsafe views under Miri: the kernels' KV write/read tests (through
# KvCacheMut/KvCacheRef slab views, on their scalar paths: Miri reports no AVX) and the engine's
# KvPool slab tests. Miri interprets every instruction (~1000x slower), so this is its own script,
# not part of scripts/test.sh. Needs the network once, for the nightly toolchain and its miri
# component. Extra arguments go to the kernels' run (e.g. a test name).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rustup toolchain install nightly --profile minimal --component miri,rust-src
cargo +nightly miri setup
# Strict provenance: every pointer the views make comes from the pool's base pointer.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-strict-provenance}"
cargo +nightly miri test -p tandem-kernels --lib "$@"
# The integration tests are one binary (tests/main.rs); its kv module is tests/kv.rs.
cargo +nightly miri test -p tandem-kernels --test it -- "${@:-kv::}"
cargo +nightly miri test -p tandem-engine --lib kv::pool
