#!/usr/bin/env bash
# The demo: a 2-rank GPT trained without and with optimizer-state offloading, side by side
# (GPUs with NCCL where they exist, CPU ranks with gloo otherwise). Sets up the environment
# on a fresh machine first. Extra arguments go to the example (e.g. --bf16 --steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(scripts/venv.sh py312)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$venv/bin/torchrun" --nproc-per-node 2 --master-port "${MASTER_PORT:-29511}" \
  examples/train_gpt_offload.py "$@"
