# Call 2, after `. .whl2/setup_device.sh`:  bash .whl2/bench_sync.sh [more bench flags]
# Weight sync bench, random-init 1.7B shape with SmolLM2's tokenizer, both layouts (Ray: trainer
# and engine actors). Writes $OUT/weight_sync.json, .png and bench_sync.log (and Ray's logs,
# ray_logs.tgz, if it fails). Flags after the script's name override the defaults below;
# BENCH_TIMEOUT_S (default 540) bounds the run.
set -uo pipefail
R=${S14_ROOT:-/tmp}
out=${OUT:-$R/out}
mkdir -p "$out"
[ -f "$R/tree/.commit" ] && [ -n "${AGENTRL_CACHE:-}" ] || {
  echo "bench_sync: source setup_device.sh first (. .whl2/setup_device.sh)" >&2
  exit 1
}
cd "$R/tree" || exit 1
echo "bench_sync: commit $(cat .commit), $(nvidia-smi -L 2>/dev/null | wc -l) GPUs"
timeout "${BENCH_TIMEOUT_S:-540}" python3 scripts/bench_weight_sync.py --shape smollm2-1.7b \
  --tokenizer "$R/tree/.gpu/smollm2_tok" --layouts colocated,disaggregated \
  --out "$out/weight_sync.json" "$@" 2>&1 | tee "$out/bench_sync.log"
rc=$?
if [ "$rc" -ne 0 ] && [ -d /tmp/ray/session_latest/logs ]; then
  tar czf "$out/ray_logs.tgz" -C /tmp/ray/session_latest logs 2>/dev/null
fi
echo "bench_sync: exit $rc"
exit "$rc"
