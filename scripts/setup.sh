#!/usr/bin/env bash
# Create .venv (once) and install the project with its test and benchmark tools and the
# Hugging Face extra (examples/hf_task.py). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    python -m pip install -q --upgrade pip
    # the CPU build first: an unpinned torch pulls a CUDA build of several GB
    python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.4"
    python -m pip install -q -e '.[dev,bench,hf]'
    touch .venv/.installed
fi
