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
