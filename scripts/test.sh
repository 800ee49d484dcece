#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs tandem's whole test suite. This is the command CI runs
# (.ci/run calls it). Tests that need the model, Python's reference or (later) etcd/NATS start
# or find them through the environment set here; they fail, never skip, when something is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$(date +%s)
TANDEM_SETUP_PHOENIX=1 TANDEM_SETUP_MODEL=0 scripts/setup.sh
export TANDEM_PYTHON="$root/.tandem/venv/bin/python"
export TANDEM_PHOENIX="$root/.tandem/phoenix/bin/phoenix"
# NVRTC from the wheel setup.sh installed (kernels-cuda compiles its kernels in the tests; cudarc
# finds libnvrtc.so.13 only through the dynamic loader's path).
nvrtc_lib="$("$TANDEM_PYTHON" -c '
import nvidia, os, sys
libs = [os.path.join(p, "cu13", "lib") for p in nvidia.__path__]
found = [d for d in libs if os.path.exists(os.path.join(d, "libnvrtc.so.13"))]
print(found[0] if found else sys.exit("test.sh: libnvrtc.so.13 not in %s (scripts/setup.sh installs it)" % libs))
')"
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# One build of every test target, with the workspace's features unified as nextest (and a plain
# `cargo test --workspace`) builds them: the test binaries, decode-node's scenario binary and the
# `tandem` binary the tests start. Building one target or `cargo run -p tandem-cli` on its own
# would resolve other features (dev-dependencies enable some) and compile the workspace again.
artifacts="$(mktemp)"
trap 'rm -f "$artifacts"' EXIT
cargo test --workspace --no-run --message-format=json-render-diagnostics >"$artifacts"
artifact() { # the executable of target $1 of kind $2 in package $3 (a bin: the binary itself,
              # not the harness of its unit tests that cargo test also builds)
  "$TANDEM_PYTHON" - "$artifacts" "$@" <<'PY'
import json, sys
path, name, kind, package = sys.argv[1:5]
for line in open(path):
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["target"]["name"] == name and kind in m["target"]["kind"]
            and f"/{package}#" in m["package_id"]
            and (kind != "bin" or not m["profile"]["test"])):
        print(m["executable"])
        break
PY
}
tandem_bin="$(artifact tandem bin cli)"
scenarios_bin="$(artifact disaggregated test decode-node)"
[[ -x "$tandem_bin" ]] || { echo "test.sh: the tandem binary was not built" >&2; exit 1; }
[[ -x "$scenarios_bin" ]] || { echo "test.sh: decode-node's scenario binary was not built" >&2; exit 1; }
"$tandem_bin" model fetch >/dev/null
export TANDEM_MODEL="$("$tandem_bin" model path)"
status=0
if cargo nextest --version >/dev/null 2>&1; then
  # cargo-nextest: every test in its own process and the binaries side by side
  # (.config/nextest.toml: how many at once, the tests that start clusters at most two at a
  # time). It runs libtest binaries only, so decode-node's scenarios (harness = false: one
  # shared cluster) run beside it, and the doctests after it.
  if (($#)); then
    cargo nextest run --workspace "$@" || status=$?
  else
    # The scenarios run from their package's directory, as cargo runs a test.
    scenarios_log="$(mktemp)"
    (cd decode-node && "$scenarios_bin") >"$scenarios_log" 2>&1 &
    scenarios=$!
    rm -f target/nextest/default/junit.xml # a report from an earlier run is not this run's
    cargo nextest run --workspace || status=$?
    wait "$scenarios" || status=$?
    echo "--- decode-node scenarios (tests/disaggregated.rs) ---" >&2
    cat "$scenarios_log" >&2
    cargo test --workspace --doc || status=$?
    # Last, so that CI's excerpt (the head and the tail of this output) shows it: why each
    # failed test failed, a few lines each.
    if ((status)); then
      "$TANDEM_PYTHON" scripts/failures.py target/nextest/default/junit.xml "$scenarios_log" >&2 || true
    fi
    rm -f "$scenarios_log"
  fi
else
  echo "test.sh: cargo-nextest not found: cargo test runs the test binaries one after another (slower)" >&2
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
echo "test.sh: done in $(( $(date +%s) - start ))s" >&2
exit "$status"
