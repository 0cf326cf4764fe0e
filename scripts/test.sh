#!/usr/bin/env bash
# The test suite, as CI runs it: sets up both environments on a fresh machine, then runs the
# main suite on megatron-core 0.19.2 (Python 3.12) and the smoke set marked `floor` on
# megatron-core 0.16.1 (Python 3.11). Extra arguments go to the main pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
main=$(scripts/venv.sh py312) || exit 1
floor=$(scripts/venv.sh py311-floor) || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1

run_pytest() {  # name python args...: pytest's "no tests ran" (exit 5) is a failure too
  local name=$1 python=$2; shift 2
  echo "== $name: $("$python" -c 'import megatron.core, sys; print("megatron-core", megatron.core.__version__, "python", sys.version.split()[0])')"
  "$python" -m pytest -p no:cacheprovider "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then echo "== $name: no tests were collected: failing" >&2; fi
  return "$rc"
}

status=0
run_pytest "main suite" "$main/bin/python" tests -q "$@" || status=1
run_pytest "compatibility floor" "$floor/bin/python" tests -q -m floor || status=1
exit $status
