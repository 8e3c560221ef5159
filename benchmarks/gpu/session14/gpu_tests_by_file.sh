# After `. .whl3/setup_device.sh`:  bash .whl3/gpu_tests_by_file.sh PATH[:SECONDS]...
# `pytest -m gpu` over each test path of the committed tree in turn, each under its own time
# limit (default 120 s), so that one slow file (Megatron's, LoRA's) cannot eat the call; one log
# per path and a summary in $OUT/pytest_gpu_by_file.txt.
set -uo pipefail
R=${S14_ROOT:-/tmp}
out=${OUT:-$R/out}
mkdir -p "$out"
[ -f "$R/tree/.commit" ] && [ -f "${AGENTRL_CACHE:-/nonexistent}/smollm2-135m-instruct/model.safetensors" ] || {
  echo "gpu_tests_by_file: source setup_device.sh first, in the call that brings the last GGUF part" >&2
  exit 1
}
cd "$R/tree" || exit 1
summary=$out/pytest_gpu_by_file.txt
echo "commit $(cat .commit), $(nvidia-smi -L 2>/dev/null | wc -l) GPUs" | tee "$summary"
for spec in "$@"; do
  path=${spec%%:*}
  limit=${spec#*:}
  [ "$limit" = "$spec" ] && limit=120
  log=$out/pytest_gpu_$(echo "$path" | tr '/.' '__').log
  t0=$SECONDS
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider -rs -v --durations=10 \
    ${PYTEST_EXTRA:-} "$path" >"$log" 2>&1
  rc=$?
  echo "== $path rc=$rc wall_s=$((SECONDS - t0)) limit_s=$limit $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)" | tee -a "$summary"
done
