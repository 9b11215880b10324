#!/usr/bin/env bash
# Set up, then run the smoke campaign twice (two rounds, each its own sweep at its own time) on the embedded
# default (local Ray, MLflow in ./mlflow.db, CPU if no GPU), and decide with the single-node promotion policy.
# The report is printed and written under reports/; --write (not run here) would edit search_spaces/defaults.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for round in 1 2; do
  echo "== smoke round ${round} of 2 =="
  .venv/bin/ablate sweep search_spaces/smoke.yaml "$@"
done
.venv/bin/ablate promote --sweep smoke --policy search_spaces/policies/single_node.yaml
