#!/usr/bin/env bash
# The test suite, as CI runs it: sets up the environments on a fresh machine, then runs
#  1. the unit and integration tests on megatron-core 0.19.2 (Python 3.12) under coverage,
#     every rank and isolated process included, and prints the line coverage of
#     megatron_offload/;
#  2. the smoke set marked `floor` on megatron-core 0.16.1 (Python 3.11);
#  3. the functional tests (the example pretrain script on 2 and 4 ranks) in the main
#     environment, without coverage (their launches would cost a quarter more under it);
#  4. the smoke set and the tests marked `line` (the example pretrain script through the
#     launcher, bitwise on vs. off and against the line's golden file; the line's source
#     patches) on megatron-core 0.18.2, and the smoke set on 0.17.1 (Python 3.12, the main
#     environment's torch);
#  5. the tests marked `bridge` (Megatron-Bridge 0.6.2's own optimizer setup, train step and
#     checkpointing with the offload callback) in the Bridge environment, built on the main one;
#  6. the tests marked `verl` (verl 0.9.1's own optimizer moves through the adapter) in the
#     verl environment, built on the main one the same way;
# and, before all of them, `ruff check` and `ruff format --check` (pyproject.toml).
# 1 runs in the foreground; 3 to 6 go one after the other beside it (1 leaves a core idle
# much of the time: process starts, waits for rank processes); 2 runs at the end of whichever
# of the two streams ends first. Their output is printed after 1's. The environments of 2, 5
# and 6 build in the background from the start (below).
# Two modules of 1, Megatron-FSDP's (about 2 minutes of a session on their own), run first in
# the second stream, under coverage too: with the functional tests' ranks forked, the first
# stream is the longer one by minutes (docs/testing.md). Extra arguments go to 1, and then
# all of 1 runs there.
# It ends with one line per stage (passed or failed, with pytest's FAILED/ERROR lines), so the
# last lines of a log say what failed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Environments that take a minute or more to build (downloads, mostly waiting) build in the
# background, beside what runs first: the floor's (its own Python and torch) beside the main
# one, Bridge's and verl's (on the main one) beside the second stream's first tests.
# `built NAME` waits for NAME's build and prints its path, or its output and fails.
build() {
  ( scripts/venv.sh "$1" > "$work/venv-$1" 2> "$work/venv-$1.log"; echo $? > "$work/venv-$1.rc" ) &
}
built() {
  while [ ! -e "$work/venv-$1.rc" ]; do sleep 1; done
  [ "$(cat "$work/venv-$1.rc")" = 0 ] && cat "$work/venv-$1" && return 0
  cat "$work/venv-$1.log" >&2; return 1
}
build py311-floor
main=$(scripts/venv.sh py312) || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1

outcome() {  # stage rc: one line for the summary at the end, with when the stage ended
  local at
  at="(ended at $((SECONDS / 60))m$(printf %02d $((SECONDS % 60)))s)"
  if [ "$2" -eq 0 ]; then echo "passed: $1 $at"; else echo "FAILED: $1 (exit $2) $at"; fi
}

# Lint and formatting (pyproject.toml), first: they take a second.
lint_status=0
if lint=$(scripts/venv.sh lint); then
  echo "== ruff $("$lint/bin/ruff" --version | cut -d' ' -f2): check and format --check"
  "$lint/bin/ruff" check . || lint_status=1
  "$lint/bin/ruff" format --check . || lint_status=1
else
  echo "== ruff: its environment could not be built (above)" >&2; lint_status=2
fi
outcome "ruff check and format --check" $lint_status >> "$work/summary"

banner() {  # name python (the installed distribution's version: importing megatron.core
  # to ask it costs 8 s of a core)
  echo "== $1: $("$2" -c 'import sys; from importlib.metadata import version; print("megatron-core", version("megatron-core"), "python", sys.version.split()[0])')"
}
no_tests() {  # pytest's "no tests ran" (exit 5) is a failure too
  [ "$1" -eq 5 ] && echo "== $2: no tests were collected: failing" >&2
  return 0
}

# The floor's smoke set (2) runs at the end of whichever stream ends first (the first to
# claim it), beside the other's last tests: both streams hold minutes of work, and which one
# ends first moves with the machine. Its output and its summary line are printed after both.
floor_if_first() {
  mkdir "$work/floor-claimed" 2>/dev/null || return 0
  local rc floor
  if floor=$(built py311-floor); then
    {
      banner "compatibility floor" "$floor/bin/python"
      "$floor/bin/python" -m pytest -p no:cacheprovider tests -q -m floor
      rc=$?; no_tests $rc "compatibility floor"
    } > "$work/floor.log" 2>&1
  else
    echo "== compatibility floor: its environment could not be built (above)" >&2; rc=1
  fi
  outcome "py311-floor: -m floor" $rc > "$work/floor-summary"
}

# Coverage data of every process of 1, the modules run beside it included (.coveragerc:
# parallel), combined after both.
"$main/bin/python" -m coverage erase
beside=(tests/integration/offloader/test_megatron_fsdp.py
        tests/integration/offloader/test_megatron_fsdp_checkpoints.py)
[ $# -eq 0 ] || beside=()

# The functional tests, the other lines, Bridge and verl, in the background: their status is
# the file's last line.
(
  status=0
  build bridge; build verl
  if [ ${#beside[@]} -gt 0 ]; then
    banner "unit and integration tests: Megatron-FSDP's modules, under coverage" "$main/bin/python"
    COVERAGE_PROCESS_START="$root/.coveragerc" \
      "$main/bin/python" -m coverage run -m pytest -p no:cacheprovider "${beside[@]}" -q
    rc=$?; no_tests $rc "Megatron-FSDP's modules"; [ $rc -eq 0 ] || status=1
    outcome "unit and integration tests: Megatron-FSDP's modules" $rc >> "$work/lines-summary"
  fi
  touch "$work/beside-done"
  banner "functional tests (no coverage)" "$main/bin/python"
  "$main/bin/python" -m pytest -p no:cacheprovider tests/functional -q
  rc=$?; no_tests $rc "functional tests"; [ $rc -eq 0 ] || status=1
  outcome "functional tests" $rc >> "$work/lines-summary"
  # 0.18 (a patch set of its own) runs the line tests too; 0.17, like the floor, the smoke set.
  for line in mcore-0.18:"floor or line" mcore-0.17:floor; do
    marks=${line#*:}; line=${line%%:*}
    if ! venv=$(scripts/venv.sh "$line"); then
      echo "== $line: its environment could not be built (above)" >&2; status=1
      outcome "$line: its environment" 1 >> "$work/lines-summary"; continue
    fi
    banner "megatron-core line" "$venv/bin/python"
    "$venv/bin/python" -m pytest -p no:cacheprovider tests -q -m "$marks"
    rc=$?; no_tests $rc "megatron-core line"; [ $rc -eq 0 ] || status=1
    outcome "$line: -m \"$marks\"" $rc >> "$work/lines-summary"
  done
  if bridge=$(built bridge); then
    banner "Megatron-Bridge $("$bridge/bin/python" -c 'from importlib.metadata import version; print(version("megatron-bridge"))')" "$bridge/bin/python"
    "$bridge/bin/python" -m pytest -p no:cacheprovider tests -q -m bridge
    rc=$?; no_tests $rc "Megatron-Bridge"; [ $rc -eq 0 ] || status=1
  else
    echo "== Megatron-Bridge: its environment could not be built (above)" >&2; status=1; rc=1
  fi
  outcome "Megatron-Bridge: -m bridge" $rc >> "$work/lines-summary"
  if verl_env=$(built verl); then
    banner "verl $("$verl_env/bin/python" -c 'from importlib.metadata import version; print(version("verl"))')" "$verl_env/bin/python"
    "$verl_env/bin/python" -m pytest -p no:cacheprovider tests -q -m verl
    rc=$?; no_tests $rc "verl"; [ $rc -eq 0 ] || status=1
  else
    echo "== verl: its environment could not be built (above)" >&2; status=1; rc=1
  fi
  outcome "verl: -m verl" $rc >> "$work/lines-summary"
  echo "$status" > "$work/lines-status"
  floor_if_first
) > "$work/lines.log" 2>&1 &
lines_job=$!

status=$lint_status
banner "unit and integration tests" "$main/bin/python"
COVERAGE_PROCESS_START="$root/.coveragerc" \
  "$main/bin/python" -m coverage run -m pytest -p no:cacheprovider tests/unit tests/integration \
  "${beside[@]/#/--ignore=}" -q "$@" 2>&1 | tee "$work/main.log"
rc=${PIPESTATUS[0]}; no_tests $rc "unit and integration tests"; [ $rc -eq 0 ] || status=1
outcome "unit and integration tests" $rc >> "$work/summary"
# The modules run beside them must be done before their coverage data is combined.
while [ ! -e "$work/beside-done" ] && kill -0 "$lines_job" 2>/dev/null; do sleep 1; done
echo "== line coverage of megatron_offload/ (all processes)"
"$main/bin/python" -m coverage combine -q && "$main/bin/python" -m coverage report
rc=$?; [ $rc -eq 0 ] || status=1
outcome "coverage report" $rc >> "$work/summary"
floor_if_first
wait "$lines_job"
cat "$work/lines.log" "$work/floor.log" 2>/dev/null
[ "$(cat "$work/lines-status" 2>/dev/null)" = 0 ] || status=1
grep -q '^passed' "$work/floor-summary" 2>/dev/null || status=1
echo "== summary"
cat "$work/summary" "$work/lines-summary" "$work/floor-summary" 2>/dev/null
# pytest's own lines for what failed, from every stage's output
cat "$work/main.log" "$work/floor.log" "$work/lines.log" 2>/dev/null | grep -E '^(FAILED|ERROR) ' \
  | cut -c1-300
[ -s "$work/lines-summary" ] || {
  echo "FAILED: the functional tests, lines, Bridge and verl did not report"; status=1; }
exit $status
