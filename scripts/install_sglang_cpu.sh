#!/usr/bin/env bash
# Install one SGLang release, importable on a CPU-only machine, into a directory of its own
# (never into the venv's site-packages), for the tests that run SGLang's own code: ServerArgs,
# io_struct, MultiprocessingSerializer / SafeUnpickler, FlattenedTensorBucket, http_server.
#
#   bash scripts/install_sglang_cpu.sh 0.5.23 /work/sgl-0.5.23
#   bash scripts/install_sglang_cpu.sh 0.5.15.post1 /work/sgl-0.5.15.post1   # slime's pin
#   AGENTRL_SGLANG_PATH=/work/sgl-0.5.23 python -m pytest -q tests/engine/sglang_real \
#     tests/engine/sglang_client/test_sglang_real_classes.py   (scripts/ci_sglang.sh runs all of it)
#
# SGLang's wheel pins CUDA torch and GPU kernels; it goes in with --no-deps, and so does each
# module its imports need (pinned below). The venv's torch (CPU), fastapi, pydantic, starlette
# and transformers are used as they are: nothing here upgrades them. Set SGLANG_WHEEL to a wheel
# file to install it instead of downloading the release.
set -euo pipefail

version="${1:?usage: install_sglang_cpu.sh VERSION TARGET_DIR}"
target="${2:?usage: install_sglang_cpu.sh VERSION TARGET_DIR}"
python="${PYTHON:-python}"

# What SGLang's entrypoints, io_struct and utils import at module level, besides what agentrl's
# own install brings (torch, fastapi, pydantic, transformers, numpy, psutil, requests, ...).
deps=(
  orjson==3.13.0 pybase64==1.5.1 msgspec==0.22.0 pyzmq==27.3.0 uvloop==0.23.0
  setproctitle==1.3.8 python-multipart==0.0.34 dill==0.4.1 einops==0.8.2 loguru==0.7.3
  partial_json_parser==0.2.1.1.post7 sentencepiece==0.2.3 compressed-tensors==0.20.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.11 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
  ipython==9.18.1 traitlets==5.16.1
  aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1
  aiosignal==1.4.0 frozenlist==1.8.0
  # sglang.srt.utils.common imports triton unconditionally (no kernel runs on CPU)
  triton==3.9.0
)

mkdir -p "$target"
wheel="${SGLANG_WHEEL:-}"
if [[ -z "$wheel" ]]; then
  download="$(mktemp -d)"
  "$python" -m pip download -q --no-deps -d "$download" "sglang==$version"
  wheel="$(ls "$download"/sglang-*.whl)"
fi
"$python" -m pip install -q --no-deps --upgrade --target "$target" "$wheel" "${deps[@]}"

# Each release registers its own model configs with transformers and breaks on a transformers
# that already has them: the transformers it pins goes into the target too, and wins over the
# venv's only where the target comes first on the path (the SGLang tests, in a process of their own).
pinned="$(unzip -p "$wheel" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: transformers==\([^ ;]*\).*/\1/p')"
have="$("$python" -c 'import transformers; print(transformers.__version__)')"
if [[ -n "$pinned" && "$pinned" != "$have" ]]; then
  "$python" -m pip install -q --no-deps --upgrade --target "$target" "transformers==$pinned"
  # and the tokenizers / huggingface-hub that transformers release checks for at import
  meta="$(ls -d "$target"/transformers-*.dist-info)/METADATA"
  mapfile -t needs < <(sed -n 's/^Requires-Dist: \(\(tokenizers\|huggingface-hub\)[^;]*\)$/\1/p' "$meta" | tr -d ' ')
  "$python" -m pip install -q --no-deps --upgrade --target "$target" "${needs[@]}"
fi

# torchvision (SGLang's multimodal configs import its transforms) must match the venv's torch.
# PyPI has only CUDA builds, whose C ops cannot load next to a CPU torch; torchvision then still
# imports, except two fake-op registrations that do not check whether the ops loaded: guard them
# the way every other registration in that file is guarded.
torch_minor="$("$python" -c 'import torch; print(torch.__version__.split(".")[1])')"
"$python" -m pip install -q --no-deps --upgrade --target "$target" "torchvision==0.$((torch_minor + 15)).*"
sed -i \
  -e 's/^@torch.library.register_fake("torchvision::nms")/@register_meta("nms")/' \
  -e 's/^@torch.library.register_fake("torchvision::qnms")/@register_meta("qnms")/' \
  "$target/torchvision/_meta_registrations.py"

PYTHONPATH="$target" "$python" - "$version" <<'EOF'
import sys

import sglang
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.io_struct  # noqa: F401
import sglang.srt.server_args  # noqa: F401
import sglang.srt.weight_sync.tensor_bucket  # noqa: F401

assert sglang.__version__ == sys.argv[1], (sglang.__version__, sys.argv[1])
print(f"sglang {sglang.__version__} importable from {sglang.__file__}")
EOF
