# On the GPU machine, second call (carry .whl2), within 30 s of the first (carry .whl, which
# installs the wheels into /tmp/site): sources laid over the wheel, the model converted as
# model_store does. Source it:  . .whl2/setup_device.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || return 1
tar xzf .whl2/src.tgz -C /tmp/site || return 1
mkdir -p /tmp/tree && tar xzf .whl2/tests.tgz -C /tmp/tree || return 1
export PYTHONPATH=/tmp/site AGENTRL_CACHE=/tmp/arcache PYTHONUNBUFFERED=1
if [ ! -f /tmp/arcache/smollm2-135m-instruct/model.safetensors ]; then
  mkdir -p /tmp/gguf && cat .whl/gguf.part1 .whl2/gguf.part2 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null \
    || cat /tmp/gguf.part1 .whl2/gguf.part2 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  (cd /tmp && python3 -) <<'PY' || return 1
import os
from pathlib import Path
from agentrl import model_store as ms
target = Path(os.environ["AGENTRL_CACHE"]) / ms.DEFAULT_MODEL
model, tokenizer = ms._load_gguf(Path("/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"))
model.save_pretrained(target, safe_serialization=True)
tokenizer.save_pretrained(target)
PY
fi
