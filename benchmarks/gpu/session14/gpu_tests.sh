# Call 3, after `. .whl3/setup_device.sh` (all GGUF parts there, the model converted):
#   bash .whl3/gpu_tests.sh tests/trainer tests/engine/serve tests/deploy
# pytest -m gpu over the given test paths of the committed tree (/tmp/tree), log and JUnit XML
# to $OUT (pytest_gpu.log, pytest_gpu.xml). GPU_TESTS_TIMEOUT_S (default 480) bounds the run;
# PYTEST_EXTRA adds flags (e.g. "-x" or "-k megatron").
set -uo pipefail
R=${S14_ROOT:-/tmp}
out=${OUT:-$R/out}
mkdir -p "$out"
[ $# -gt 0 ] || { echo "usage: bash gpu_tests.sh TEST_PATH..." >&2; exit 2; }
[ -f "$R/tree/.commit" ] && [ -n "${AGENTRL_CACHE:-}" ] || {
  echo "gpu_tests: source setup_device.sh first" >&2
  exit 1
}
[ -f "$AGENTRL_CACHE/smollm2-135m-instruct/model.safetensors" ] || {
  echo "gpu_tests: the SmolLM2 model is not converted yet (all GGUF parts: call 3's setup)" >&2
  exit 1
}
cd "$R/tree" || exit 1
echo "gpu_tests: commit $(cat .commit), $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, paths: $*"
# shellcheck disable=SC2086
timeout "${GPU_TESTS_TIMEOUT_S:-480}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  --durations=20 --junitxml="$out/pytest_gpu.xml" ${PYTEST_EXTRA:-} "$@" 2>&1 | tee "$out/pytest_gpu.log"
rc=$?
echo "gpu_tests: exit $rc"
exit "$rc"
