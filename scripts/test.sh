#!/usr/bin/env bash
# Set up, then run the whole test suite. pytest's exit code 5 (no tests collected) is a failure here: a
# suite that ran nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
