#!/usr/bin/env bash
# Example 3: example 1 (examples/hf_task.py) on two islands of two ranks each, launched by torchrun:
# island A with DDP, island B with FSDP2. They train one model and end with the same checkpoint.
#   bash examples/torchrun_hf.sh [RUNS_DIR]      (STEPS=200 by default; PYTHON=.venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-runs/torchrun}
py=${PYTHON:-python}
mkdir -p "$runs"
rm -f "$runs/a.maddr"
common=(--task examples.hf_task:build --steps "${STEPS:-200}" --window 10 --fragments 2 --wait-islands 2
        --run-id hf-torchrun --progress lines --torch-threads 1)
torchrun() { "$py" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$1" -m islands.node "${@:2}"; }

torchrun "${PORT_A:-29611}" "${common[@]}" --parallel ddp --run-dir "$runs/a" --maddr-file "$runs/a.maddr" &
a=$!
trap 'kill $a 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$runs/a.maddr" ] && break; sleep 0.1; done
torchrun "${PORT_B:-29612}" "${common[@]}" --parallel fsdp --run-dir "$runs/b" --join "$(head -1 "$runs/a.maddr")"
wait $a
trap - EXIT
echo "both islands done: $runs/a/checkpoint and $runs/b/checkpoint"
