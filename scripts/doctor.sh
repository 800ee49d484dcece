#!/usr/bin/env bash
# Checks that every system dependency of tandem is really there (not just that a package is
# installed: the file or command it provides), and names the Debian package for each one that is
# missing. The list and the checks are deploy/local/packages.txt. scripts/setup.sh runs it before
# and after installing.
#
#   scripts/doctor.sh           # a line per missing part; exit 1 if any
#   scripts/doctor.sh -v        # a line per part, present or not
#   scripts/doctor.sh --missing # only the missing packages' names, one per line (for install.sh)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
list="$root/deploy/local/packages.txt"
mode="${1:-}"

check() {  # check KIND:ARG -> 0 when present
  local kind="${1%%:*}" arg="${1#*:}"
  case "$kind" in
    cmd) command -v "$arg" >/dev/null 2>&1 ;;
    file) [[ -e "$arg" ]] ;;
    glob) compgen -G "$arg" >/dev/null ;;
    pkgconfig) command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "$arg" ;;
    py) command -v python3 >/dev/null 2>&1 && python3 -c "import $arg" >/dev/null 2>&1 ;;
    *) echo "doctor: unknown check kind '$kind' in $list" >&2; return 2 ;;
  esac
}

missing=0
while IFS= read -r raw; do
  line="${raw%%#*}"
  [[ -z "${line//[[:space:]]/}" ]] && continue
  read -r pkg what _ <<<"$line"
  why=""; [[ "$raw" == *"#"* ]] && why="$(sed -e 's/^[^#]*#[[:space:]]*//' <<<"$raw")"
  if check "$what"; then
    [[ "$mode" == -v ]] && printf 'ok       %-18s %-55s %s\n' "$pkg" "$what" "$why"
  else
    missing=$((missing + 1))
    if [[ "$mode" == --missing ]]; then
      echo "$pkg"
    else
      printf 'MISSING  %-18s %-55s %s\n' "$pkg" "$what" "$why"
    fi
  fi
done <"$list"

# Not Debian packages: the Rust toolchain comes from rustup.
if ! command -v cargo >/dev/null 2>&1; then
  missing=$((missing + 1))
  [[ "$mode" == --missing ]] || echo "MISSING  cargo (the Rust toolchain: https://rustup.rs; not a Debian package here)"
fi

if ((missing)) && [[ "$mode" != --missing ]]; then
  echo "doctor: $missing missing; install with: sudo apt-get install --no-install-recommends \$(scripts/doctor.sh --missing)" >&2
  echo "        (or run scripts/setup.sh, which does this)" >&2
fi
((missing == 0))
