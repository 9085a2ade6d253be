#!/usr/bin/env bash
# The test suite: unit, in-process and real multi-process tests on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=12 "$@"
