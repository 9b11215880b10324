#!/usr/bin/env bash
# Set up, then run the smoke campaign on the embedded default: local Ray, MLflow in ./mlflow.db, CPU if no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ablate sweep search_spaces/smoke.yaml "$@"
.venv/bin/ablate promote --sweep smoke --policy search_spaces/policies/single_node.yaml
