# Calls 2 and 3 on the GPU machine, after call 1 (bash .whl/stage1.sh), each right after the
# last (the machine goes back 30 s after a call). Source it; idempotent:
#   call 2 (carry .whl2):  . .whl2/setup_device.sh && bash .whl2/bench_sync.sh
#   call 3 (carry .whl3):  . .whl3/setup_device.sh && bash .whl3/gpu_tests.sh tests/trainer ...
# Lays the committed tree at /tmp/tree (tests and the bench run there; the tokenizer at
# /tmp/tree/.gpu/smollm2_tok), installs the agentrl wheel (entry points) into /tmp/site, keeps
# the GGUF parts in /tmp/carry and, once all three are there, converts the model into
# /tmp/arcache as agentrl.model_store does. Exports PYTHONPATH, AGENTRL_CACHE and the rest.
# S14_ROOT (default /tmp) moves carry/, site/, tree/, arcache/ elsewhere (local dry runs).
_s14_setup() {
  local D R f
  D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  R=${S14_ROOT:-/tmp}
  mkdir -p "$R/carry"
  if [ ! -f "$R/site/.carry_wheels_ok" ]; then
    if ! ls "$R"/carry/*.whl >/dev/null 2>&1; then
      echo "setup_device: call 1 (bash .whl/stage1.sh) did not run on this machine (it was given" \
        "back?): start again from call 1" >&2
      return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$R/site" "$R"/carry/*.whl || return 1
    touch "$R/site/.carry_wheels_ok"
  fi
  for f in "$D"/gguf.part* "$D"/gguf.info; do [ -f "$f" ] && cp "$f" "$R/carry/"; done
  if [ -f "$D/tree.tgz" ] && [ "$(cat "$R/tree/.commit" 2>/dev/null)" != "$(cat "$D/COMMIT")" ]; then
    rm -rf "$R/tree" && mkdir -p "$R/tree/.gpu" || return 1
    tar xzf "$D/tree.tgz" -C "$R/tree" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$R/site" "$D"/agentrl-*.whl || return 1
    cp -r "$D/smollm2_tok" "$R/tree/.gpu/smollm2_tok" || return 1
    cp "$D/COMMIT" "$R/tree/.commit"
  fi
  if [ ! -f "$R/tree/.commit" ]; then
    echo "setup_device: no sources at $R/tree: call 2 (. .whl2/setup_device.sh) did not run" \
      "on this machine: start again from call 1" >&2
    return 1
  fi
  export S14_ROOT=$R PYTHONPATH=$R/tree:$R/site AGENTRL_CACHE=$R/arcache PYTHONUNBUFFERED=1 \
    RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  local model=$R/arcache/smollm2-135m-instruct
  if [ ! -f "$model/model.safetensors" ]; then
    local parts have name sum
    parts=$(sed -n 's/^parts=//p' "$R/carry/gguf.info" 2>/dev/null)
    have=$(ls "$R"/carry/gguf.part* 2>/dev/null | wc -l)
    if [ -z "$parts" ] || [ "$have" -lt "$parts" ]; then
      echo "setup_device: GGUF parts here: $have of ${parts:-?} (the model is converted once all" \
        "are here: call 3)"
    else
      name=$(sed -n 's/^name=//p' "$R/carry/gguf.info")
      sum=$(sed -n 's/^sha256=//p' "$R/carry/gguf.info")
      mkdir -p "$R/gguf"
      for f in $(seq 1 "$parts"); do cat "$R/carry/gguf.part$f"; done >"$R/gguf/$name" || return 1
      if [ "$(sha256sum "$R/gguf/$name" | cut -d' ' -f1)" != "$sum" ]; then
        echo "setup_device: the reassembled GGUF's sha256 differs from gguf.info" >&2
        return 1
      fi
      (cd /tmp && GGUF_FILE="$R/gguf/$name" TQDM_DISABLE=1 python3 -) <<'PY' || return 1
import os
import time
from pathlib import Path

from agentrl import model_store as ms

t0 = time.time()
target = Path(os.environ["AGENTRL_CACHE"]) / ms.DEFAULT_MODEL
model, tokenizer = ms._load_gguf(Path(os.environ["GGUF_FILE"]))
model.save_pretrained(target, safe_serialization=True)
tokenizer.save_pretrained(target)
print(f"setup_device: converted the GGUF into {target} in {time.time() - t0:.0f} s")
PY
    fi
  fi
  echo "setup_device: tree $(cut -c1-12 "$R/tree/.commit") at $R/tree, wheels in $R/site," \
    "model: $([ -f "$model/model.safetensors" ] && echo "$model" || echo 'not yet')"
}
_s14_setup
_s14_rc=$?
unset -f _s14_setup
return $_s14_rc 2>/dev/null || exit $_s14_rc
