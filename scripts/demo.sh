#!/usr/bin/env bash
# The main job: a local swarm of islands on loopback, training on the embedded default data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/islands-node swarm --islands 3 "$@"
