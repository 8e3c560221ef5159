# One call on nvidia-h200-x2 (after `. .whl3/setup_device.sh` has converted the model): issue 42's
# fully async runs with and without a rollout correction (disaggregated: trainers on GPU 0,
# engines on GPU 1) beside issue 41's full fine-tuning vs LoRA rank 16 (both in process on GPU 0),
# all four at once. Logs, summaries and eval histories to $OUT (checkpoints stay in /tmp).
# Usage: bash .whl3/learning_runs.sh [ASYNC_STEPS] [LORA_STEPS]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out/issue42" "$out/issue41"
(cd /tmp && OUT=/tmp/i42 RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-540} bash "$here/issue42_async_correction.sh" "${1:-8}"
 cp /tmp/i42/*.log /tmp/i42/*.json /tmp/i42/runs.txt "$out/issue42/" 2>/dev/null
 for r in uncorrected corrected; do
   cp /tmp/i42/runs/$r/metrics.jsonl "$out/issue42/$r.metrics.jsonl" 2>/dev/null
   cp /tmp/i42/runs/$r/eval_history.json "$out/issue42/$r.eval_history.json" 2>/dev/null
 done) &
sleep 10
OUT=$out/issue41 GPU=0 RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-540} bash "$here/lora_vs_full.sh" "${2:-20}" &
wait
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv >"$out/nvidia_smi_end.csv" 2>/dev/null
