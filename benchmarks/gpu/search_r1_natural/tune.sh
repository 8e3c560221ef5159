# Dev-split tuning runs, two per GPU on nvidia-h200-x2, all at once (after setup_device.sh).
# Each: the recipe scaled as README's GPU command, STEPS steps, greedy evaluations of the 240
# dev questions at the start, halfway and the end. Usage: bash .whl2/tune.sh STEPS
steps=${1:-24}
dev=/tmp/site/agentrl_envs/search_r1/data/natural_dev.jsonl
common="--num-rollout $steps --rollout-batch-size 16 --n-samples-per-prompt 8 --eval-interval $((steps / 2)) \
  --set eval.num_eval_tasks=240 --set env.eval_data=$dev --set engine.max_batch_size=128 \
  --set engine.mem_fraction_static=0.3 --set train.max_tokens_per_micro_batch=8192 \
  --set rollout.dynamic_sampling=true --set rollout.max_sampling_rounds=2 --set log.progress=false \
  --set checkpoint.save_interval=1000"
run() {  # name gpu flags...
  local name=$1 gpu=$2; shift 2
  (cd /tmp && CUDA_VISIBLE_DEVICES=$gpu python3 -m agentrl.cli train --env search_r1 $common "$@" \
     --save /tmp/runs/$name > $OUT/$name.log 2>&1) &
}
run A_k3_lr1e-5_t0.7 0 --lr 1e-5
run B_k1_lr1e-5_t0.7 0 --lr 1e-5 --set env.kwargs.topk=1
run C_k3_lr2e-5_t0.7 1 --lr 2e-5
run D_k3_lr1e-5_t1.0 1 --lr 1e-5 --set rollout.rollout_temperature=1.0
wait
cd /tmp/runs && tar czf $OUT/tune.tgz --exclude=checkpoints --exclude=tensorboard --exclude='*.jsonl.gz' .
