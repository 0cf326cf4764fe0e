#!/usr/bin/env bash
# The GPU kit, in two commands:
#
#   scripts/gpu.sh prepare      # here, with the package registries: the wheels the GPU run needs
#                               # besides PyTorch (megatron-core of the main environment, pyyaml,
#                               # pytest-timeout) into .gpu-kit/ (ignored by git), under 64 MiB
#   scripts/gpu.sh run [OUT]    # on a machine with one NVIDIA GPU, PyTorch and pytest, no network:
#                               # installs .gpu-kit/ offline, runs the GPU tests, the GPU report and
#                               # the kit's figures; writes OUT (default benchmarks/results/gpu-<UTC time>)
#
# run writes OUT/results.md (one table: every figure, measured, and whether it met its goal),
# OUT/results.json (the raw figures), OUT/run.log (everything printed) and OUT/logs/ (the
# pretrain runs' logs). Exit status: 0 when every test passed and every figure met its goal,
# 1 otherwise, 2 on a machine without a CUDA GPU (nothing is measured there).
set -uo pipefail
cd "$(dirname "$0")/.."
kit=.gpu-kit
limit=$((64 << 20))

prepare() {
  local py mcore
  py=$(scripts/venv.sh py312)/bin/python || exit 1
  mcore=$(grep -E '^megatron-core==' requirements/py312.txt) || { echo "no megatron-core pin in requirements/py312.txt" >&2; exit 1; }
  rm -rf "$kit" && mkdir -p "$kit"
  # The GPU machine runs CPython 3.12 on x86-64 Linux; PyTorch, numpy, packaging, pytest,
  # psutil and cuda-bindings are there already.
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$kit" "$mcore" pyyaml pytest-timeout || exit 1
  local size
  size=$(du -sb "$kit" | cut -f1)
  ls -l "$kit"
  echo "gpu kit: $(ls "$kit" | wc -l) wheel(s), $size bytes in $kit/ (limit $limit)"
  [ "$size" -le "$limit" ] || { echo "gpu kit: over the 64 MiB a GPU run can take" >&2; exit 1; }
}

require_gpu() {
  if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)' 2>/dev/null; then
    echo "scripts/gpu.sh run: no CUDA GPU here (python3 cannot import torch, or torch.cuda.is_available()" \
         "is False): nothing was measured. Run it on a machine with an NVIDIA GPU." >&2
    exit 2
  fi
}

run() {
  local out=$1
  ls "$kit"/*.whl >/dev/null 2>&1 || {
    echo "scripts/gpu.sh run: no wheels in $kit/: run 'scripts/gpu.sh prepare' where the package" \
         "registries are reachable, and bring $kit/ along" >&2; exit 1; }
  local work site status=0
  work=$(mktemp -d) site=$(mktemp -d)
  python3 -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$site" "$kit"/*.whl || exit 1
  export PYTHONPATH="$PWD:$site" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
  mkdir -p "$out"
  {
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi -L 2>/dev/null || true
    python3 -c 'import sys, torch, megatron.core as m; print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| megatron-core", m.__version__)'
    echo "megatron-offload $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
  } > "$work/machine.txt" 2>&1
  cat "$work/machine.txt"
  # Every part has its own time limit, so the whole run ends within ten minutes.
  echo "== GPU tests"
  timeout 120 python3 -m pytest -p no:cacheprovider -q -m "gpu or te_gpu" tests/unit
  echo $? > "$work/tests.rc"
  echo "== benchmarks.gpu_report"
  timeout 240 python3 -m benchmarks.gpu_report --iters 10 --timeout 110 --json "$work/gpu_report.json" \
    --save-logs "$out/logs" || status=1
  echo "== benchmarks.gpu_report under Megatron-FSDP (optim_grads_params)"
  timeout 240 python3 -m benchmarks.gpu_report --iters 10 --timeout 110 --json "$out/gpu_report_fsdp.json" \
    --megatron-args="--use-megatron-fsdp --ckpt-format fsdp_dtensor" --save-logs "$out/logs-fsdp" || status=1
  echo "== benchmarks.gpu_kit"
  timeout 200 python3 -m benchmarks.gpu_kit measure --json "$work/kit.json" || status=1
  python3 -m benchmarks.gpu_kit table "$work" "$out" || status=1
  [ "$(cat "$work/tests.rc")" = 0 ] || status=1
  rm -rf "$work" "$site"
  echo "gpu kit: results in $out (exit status $status)"
  return $status
}

case "${1:-}" in
  prepare) prepare ;;
  run)
    shift
    require_gpu
    out=${1:-benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M)}
    mkdir -p "$out" || exit 1
    run "$out" 2>&1 | tee "$out/run.log"
    exit "${PIPESTATUS[0]}" ;;
  *) echo "usage: scripts/gpu.sh prepare | run [OUT]" >&2; exit 2 ;;
esac
