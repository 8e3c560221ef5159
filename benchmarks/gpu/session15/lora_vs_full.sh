# Issue 41's learning check on one GPU (after setup_device.sh has converted the model): README's
# GPU command, STEPS steps, full fine-tuning beside LoRA rank 16 on the same GPU (each engine
# 30% of it), greedy EM on the 350 natural test questions at 0, STEPS/2 and STEPS. LoRA's one
# setting was fixed before the run (the field's rule of thumb: lr 10x full fine-tuning,
# alpha = 2 x rank); nothing was tuned on the test split.
# Usage: GPU=0 bash .whl3/lora_vs_full.sh [STEPS]   (runs in the background when BG=1)
steps=${1:-20}
gpu=${GPU:-0}
common="--num-rollout $steps --rollout-batch-size 16 --n-samples-per-prompt 8 \
  --eval-interval $((steps / 2)) --set eval.num_eval_tasks=350 --set engine.max_batch_size=128 \
  --set engine.mem_fraction_static=0.3 --set train.max_tokens_per_micro_batch=8192 \
  --set rollout.dynamic_sampling=true --set rollout.max_sampling_rounds=2 --set log.progress=false \
  --set checkpoint.save_interval=1000"
run() {  # name flags...
  local name=$1; shift
  local t0=$SECONDS
  (cd /tmp && CUDA_VISIBLE_DEVICES=$gpu timeout ${RUN_TIMEOUT_S:-560} python3 -m agentrl.cli train \
     --env search_r1 $common "$@" --save /tmp/runs/$name > $OUT/$name.log 2>&1)
  echo "$name rc=$? wall_s=$((SECONDS - t0))" | tee -a $OUT/runs.txt
  for f in metrics.jsonl eval_history.json eval_history.png run_config.json; do
    cp /tmp/runs/$name/$f $OUT/$name.$f 2>/dev/null
  done
}
run full_ft --lr 1e-5 &
sleep 5
run lora_r16 --lr 1e-4 --lora-rank 16 --lora-alpha 32 &
wait
