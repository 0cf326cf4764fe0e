#!/usr/bin/env bash
# Usage: scripts/venv.sh py312|py311-floor|mcore-0.17|mcore-0.18|bridge|verl|lint
# Prints the path of a virtual environment with requirements/<name>.txt installed, creating
# it on first use. Environments are cached under ${MEGATRON_OFFLOAD_CACHE:-~/.cache/megatron-offload}
# and keyed by the requirements file's hash, so a fresh clone reuses them and a changed
# requirements file gets a new one.
#
# mcore-* are the other megatron-core lines on Python 3.12. Each holds only its own
# megatron-core (and what that line needs beyond the main environment); everything else
# (torch, numpy, pytest, ...) is the main environment's own install, linked in (only pip and megatron left out), so every line
# runs the same torch and costs seconds and megabytes instead of a second multi-GB torch.
#
# bridge is Megatron-Bridge on the main environment (its megatron-core included, seen through
# a .pth file): requirements/bridge-no-deps.txt without the dependencies it declares (most
# are GPU-only or for model conversion), then requirements/bridge.txt, what its training
# modules import on a CPU, with their own dependencies (megatron_offload_testing/bridge_imports.py).
# verl is verl the same way: requirements/verl-no-deps.txt, then requirements/verl.txt.
#
# uv (requirements/uv.txt, installed once into the cache with pip) installs them, in a third
# to a half of pip's time (docs/testing.md has the figures): its downloads and unpacking run in
# parallel, and its files are hard links into its cache, kept under the same cache directory.
# Where uv cannot be installed, or fails, pip installs the environment as it always did. The
# mcore-* overlays (seconds) stay with pip.
#
# Neither installs with byte-compiling (pip: --no-compile): compiling every installed module (some
# 33,000 files over the environments; Bridge's 9,600 alone took 35 s of a core) costs more
# than compiling, once, the modules that are imported, at their first import. That needs
# Python to keep what it compiled, so each environment has a .pth file that lets it write its
# .pyc files even where PYTHONDONTWRITEBYTECODE is set (it then writes them beside the
# sources it imports, a checkout's included): without it, every process would compile torch
# anew at every import.
set -euo pipefail
name=$1
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/requirements/$name.txt"
[ -f "$req" ] || { echo "no requirements file $req" >&2; exit 2; }
case "$name" in
  py312) want=3.12 ;;
  py311-floor) want=3.11 ;;
  lint) want=3.12 ;;
  mcore-*) want=3.12; base=py312 ;;
  bridge|verl) want=3.12; base=py312 ;;
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

cache=${MEGATRON_OFFLOAD_CACHE:-$HOME/.cache/megatron-offload}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache/uv}  # beside the environments: hard links, not copies
uv_tool() {  # python: prints the path of uv
  local tool
  tool="$cache/tool-uv-$(sha256sum < "$root/requirements/uv.txt" | cut -c1-12)"
  mkdir -p "$cache"
  (
    flock 9  # the floor's and the main environment build at the same time
    if [ ! -f "$tool/.complete" ]; then
      rm -rf "$tool"
      "$1" -m venv "$tool" >&2 &&
        "$tool/bin/python" -m pip install -qq --disable-pip-version-check --no-compile \
          -r "$root/requirements/uv.txt" >&2 &&
        touch "$tool/.complete"
    fi
  ) 9> "$cache/.tool-uv.lock"
  [ -f "$tool/.complete" ] && echo "$tool/bin/uv"
}
# uv reads neither pip's configuration files nor its PIP_* variables: the indexes, local
# wheels and constraints pip would use (`pip config list`) are passed on as options.
pip_sources() {  # python
  local line key value flag item index=
  while IFS= read -r line; do
    key=${line%%=*}; key=${key##*.}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    case "$key" in
      index-url) [ -z "$index" ] || continue; index=1; flag=--index-url ;;  # the first: the variable's
      extra-index-url) flag=--extra-index-url ;;
      find-links) flag=--find-links ;;
      constraint) flag=--constraint ;;
      *) continue ;;
    esac
    for item in $value; do printf '%s\n%s\n' "$flag" "$item"; done
  done < <("$1" -m pip config list 2>/dev/null)
}
install_standalone() {  # venv requirements
  local uv sources
  if uv=$(uv_tool "$1/bin/python"); then
    mapfile -t sources < <(pip_sources "$1/bin/python")
    # Several indexes are one to pip: the best match among them all, as pip chooses.
    if "$uv" pip install --quiet --python "$1/bin/python" --index-strategy unsafe-best-match \
        "${sources[@]}" -r "$2" >&2; then
      return 0
    fi
    echo "$name: uv could not install $2; pip installs it" >&2
  fi
  "$1/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -r "$2" >&2
}
# Bridge and verl by uv: the no-deps file as it is, then the other one resolved preferring
# the versions the base environment has (uv does not see its packages through the .pth file,
# pip does; a version uv is given as a previous resolution is the one it keeps where it
# fits, as pip keeps an installed one), and only the packages the base does not have in the
# resolved version installed, without their dependencies (resolved already).
install_overlay() {  # venv base no-deps-requirements requirements
  local uv sources work rc
  uv=$(uv_tool "$1/bin/python") || return 1
  mapfile -t sources < <(pip_sources "$1/bin/python")
  sources+=(--index-strategy unsafe-best-match)
  work=$(mktemp -d)
  names() { awk -F'==' '/==/ { n = tolower($1); gsub(/[-_.]+/, "-", n); print n "==" $2 }' "$1" | sort; }
  "$uv" pip freeze --quiet --python "$2/bin/python" > "$work/base.txt" &&
    cp "$work/base.txt" "$work/resolved.txt" &&
    "$uv" pip install --quiet --python "$1/bin/python" "${sources[@]}" --no-deps -r "$3" >&2 &&
    "$uv" pip compile --quiet --python "$1/bin/python" "${sources[@]}" --no-header \
      --no-annotate -o "$work/resolved.txt" "$4" >&2 &&
    names "$work/resolved.txt" | comm -23 - <(names "$work/base.txt") > "$work/missing.txt" &&
    "$uv" pip install --quiet --python "$1/bin/python" "${sources[@]}" --no-deps \
      -r "$work/missing.txt" >&2
  rc=$?
  rm -rf "$work"
  return $rc
}

base_venv=
if [ -n "${base:-}" ]; then
  base_venv=$("$0" "$base") || exit 1
fi
# An overlay is also keyed by its base and by this recipe.
extra="$root/requirements/$name-no-deps.txt"
hash=$( { cat "$req"; [ ! -f "$extra" ] || cat "$extra"; [ -z "$base_venv" ] || { echo "$base_venv"; cat "$0"; }; } | sha256sum | cut -c1-12)
venv="$cache/venv-$name-$hash"
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$cache"
  # Overlays are small and cheap to rebuild: drop this line's stale ones, those whose base
  # environment is gone. One whose base still exists may be another checkout's, in use
  # (the cache is shared by every checkout of the machine): it stays.
  if [ -n "$base_venv" ]; then
    for old in "$cache/venv-$name-"*; do
      [ -d "$old" ] || continue
      link=$(find "$old/shared" -maxdepth 1 -type l -print -quit 2>/dev/null || true)
      # Bridge's and verl's name their base in a .pth file instead.
      [ -n "$link" ] || link=$(cat "$old"/lib/python*/site-packages/zz-main-environment.pth \
        2>/dev/null || true)
      if [ -z "$link" ] || [ ! -e "$link" ]; then rm -rf "$old"; fi
    done
  fi
  if [ "$name" = bridge ] || [ "$name" = verl ]; then
    python=$(readlink -f "$base_venv/bin/python")
    "$python" -m venv "$venv" >&2
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    base_site=$("$base_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # megatron is a namespace package: megatron/bridge here and megatron/core there merge.
    echo "$base_site" > "$site/zz-main-environment.pth"
    if ! install_overlay "$venv" "$base_venv" "$extra" "$req"; then
      echo "$name: uv could not install it; pip does" >&2
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps -r "$extra" >&2
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -r "$req" >&2
    fi
  elif [ -n "$base_venv" ]; then
    # A venv of the base interpreter whose site-packages sees the base environment's packages
    # through a directory of links that leaves out megatron (a namespace package: a second
    # copy on sys.path would merge into this line's) and pip.
    "$base_venv/bin/python" -c "import sys; print(sys._base_executable)" >/dev/null
    python=$(readlink -f "$base_venv/bin/python")
    "$python" -m venv "$venv" >&2
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    base_site=$("$base_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$venv/shared"
    for entry in "$base_site"/*; do
      case "$(basename "$entry")" in
        megatron|megatron_core-*|pip|pip-*|*.pth|__pycache__) ;;
        *) ln -s "$entry" "$venv/shared/" ;;
      esac
    done
    echo "$venv/shared" > "$site/zz-shared-with-$base.pth"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps -r "$req" >&2
    # What this megatron-core declares must be met by the shared packages plus its own.
    "$venv/bin/python" -m pip check >&2 || { echo "$name: unmet requirements (above)" >&2; exit 1; }
  else
    python=$(find_python "$want") || { echo "Python $want is needed for $name (install it, or set MEGATRON_OFFLOAD_PYTHON)" >&2; exit 2; }
    "$python" -m venv "$venv" >&2
    install_standalone "$venv" "$req"
  fi
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import sys; sys.dont_write_bytecode = False" > "$site/write-bytecode.pth"
  touch "$venv/.complete"
fi
echo "$venv"
