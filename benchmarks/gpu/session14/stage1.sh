# Call 1 on the GPU machine (carry .whl):  bash .whl/stage1.sh
# Keeps this call's files in /tmp/carry for the next calls (the machine goes back 30 s after a
# call: make calls 2 and 3 right after), installs the wheels into /tmp/site and checks the
# slimmed Ray (local node, no dashboard, actors, a placement group, runtime_env env_vars).
# S14_ROOT (default /tmp) moves carry/, site/, tree/, arcache/ elsewhere (local dry runs).
set -uo pipefail
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R=${S14_ROOT:-/tmp}
out=${OUT:-$R/out}
mkdir -p "$R/carry" "$out"
cp "$D"/* "$R/carry/" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$R/site" "$D"/*.whl || exit 1
touch "$R/site/.carry_wheels_ok"
export PYTHONPATH=$R/site PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
{
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
  python3 -W ignore -c "
import importlib
for m in ('ray', 'megatron.core', 'torch_memory_saver', 'fastapi', 'uvicorn', 'pydantic', 'gguf', 'bm25s', 'jsonschema', 'pytest_asyncio'):
    mod = importlib.import_module(m)
    print(f'{m:20s}', getattr(mod, '__version__', ''), mod.__file__)
" && (cd /tmp && timeout 180 python3 "$R/carry/check_ray.py" --expect-slim --num-cpus 4)
} 2>&1 | tee "$out/stage1.log"
