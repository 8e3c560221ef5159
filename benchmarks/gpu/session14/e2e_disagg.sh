#!/usr/bin/env bash
# Issue 40's end-to-end check on nvidia-h200-x2 (after setup_device.sh has converted the model):
# README's one-GPU search_r1 command made disaggregated (trainer on GPU 0, engine on GPU 1,
# weights by NCCL through Ray), STEPS steps with each trainer backend, in sync and in fully
# async mode. The four runs share the two GPUs at once (one call's time): each engine takes 20%
# of GPU 1, so steps/hour compare modes under the same sharing, not a machine of their own.
# Usage: bash .whl3/e2e_disagg.sh [STEPS]
steps=${1:-5}
common="--num-rollout $steps --rollout-batch-size 16 --n-samples-per-prompt 8 --lr 1e-5 \
  --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --eval-interval 1000 \
  --set eval.num_eval_tasks=16 --set engine.max_batch_size=128 \
  --set engine.mem_fraction_static=0.2 --set train.max_tokens_per_micro_batch=8192 \
  --set rollout.dynamic_sampling=true --set rollout.max_sampling_rounds=2 \
  --set log.progress=false --set checkpoint.save_interval=1000"
run() {  # name flags...
  local name=$1; shift
  local t0=$SECONDS
  (cd /tmp && timeout ${E2E_TIMEOUT_S:-500} python3 -m agentrl.cli train --env search_r1 $common "$@" \
     --save /tmp/runs/$name > $OUT/$name.log 2>&1)
  echo "$name rc=$? wall_s=$((SECONDS - t0))" | tee -a $OUT/e2e_runs.txt
  cp /tmp/runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
}
run torch_sync &
sleep 5; run torch_async --async --async-mode full &
sleep 5; run megatron_sync --train-backend megatron &
sleep 5; run megatron_async --train-backend megatron --async --async-mode full &
wait
