#!/usr/bin/env bash
# Usage: scripts/venv.sh py312|py311-floor
# Prints the path of a virtual environment with requirements/<name>.txt installed, creating
# it on first use. Environments are cached under ${MEGATRON_OFFLOAD_CACHE:-~/.cache/megatron-offload}
# and keyed by the requirements file's hash, so a fresh clone reuses them and a changed
# requirements file gets a new one.
set -euo pipefail
name=$1
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/requirements/$name.txt"
[ -f "$req" ] || { echo "no requirements file $req" >&2; exit 2; }
case "$name" in
  py312) want=3.12 ;;
  py311-floor) want=3.11 ;;
  *) echo "unknown environment $name" >&2; exit 2 ;;
esac

find_python() {
  local v=$1 candidate
  for candidate in "${MEGATRON_OFFLOAD_PYTHON:-}" \
      "$(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V | tail -n 1)" \
      "$(command -v python"$v" 2>/dev/null)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))" 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

hash=$(sha256sum "$req" | cut -c1-12)
cache=${MEGATRON_OFFLOAD_CACHE:-$HOME/.cache/megatron-offload}
venv="$cache/venv-$name-$hash"
if [ ! -f "$venv/.complete" ]; then
  python=$(find_python "$want") || { echo "Python $want is needed for $name (install it, or set MEGATRON_OFFLOAD_PYTHON)" >&2; exit 2; }
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
  touch "$venv/.complete"
fi
echo "$venv"
