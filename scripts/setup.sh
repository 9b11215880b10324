#!/usr/bin/env bash
# Create .venv (once) and install ablate with its test extras. On a machine without an NVIDIA GPU the torch
# pin in constraints/cpu.txt keeps pip on the CPU wheel; with a GPU, pip is free to take a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
constraint=()
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  constraint=(-c constraints/cpu.txt)
  export PIP_CONSTRAINT="$PWD/constraints/cpu.txt"  # also applies inside sdist build environments
fi
stamp=.venv/.ablate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "${constraint[@]}" -e ".[dev]"
  touch "$stamp"
fi
# tests/tracking/test_mlflow_ui_browser.py opens the MLflow UI in Debian's chromium through its chromedriver
# (nothing downloads a browser at test time). Installed only where missing and only where apt can (root); anywhere
# else setup goes on and that test fails with the reason.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver >/dev/null; } \
      || echo "setup: apt-get could not install chromium chromium-driver; the MLflow UI browser test will fail" >&2
  else
    echo "setup: chromium/chromedriver missing and no apt-get as root here; install them for the MLflow UI" \
         "browser test (tests/tracking/test_mlflow_ui_browser.py), which fails without them" >&2
  fi
fi
