# The CPU recipe's learning, predicted on one GPU: candidate step counts, batch shapes and
# learning rates of README's first command, each a process of its own on GPU 0, greedy
# evaluations of the 240 dev questions at the start and the end (after setup_device.sh).
dev=/tmp/site/agentrl_envs/search_r1/data/natural_dev.jsonl
common="--set eval.num_eval_tasks=240 --set env.eval_data=$dev --set engine.mem_fraction_static=0.15 \
  --set log.progress=false --set checkpoint.save_interval=1000"
run() {  # name flags...
  local name=$1; shift
  (cd /tmp && CUDA_VISIBLE_DEVICES=0 python3 -m agentrl.cli train --env search_r1 $common "$@" \
     --save /tmp/cpu_runs/$name > $OUT/$name.log 2>&1) &
}
mkdir -p /tmp/cpu_runs
run c1_6x4x5_lr2e-5
run c2_12x4x5_lr2e-5 --num-rollout 12
run c3_12x4x5_lr4e-5 --num-rollout 12 --lr 4e-5
run c4_12x8x4_lr2e-5 --num-rollout 12 --rollout-batch-size 8 --n-samples-per-prompt 4
run c5_10x8x4_lr3e-5 --num-rollout 10 --rollout-batch-size 8 --n-samples-per-prompt 4 --lr 3e-5
wait
cd /tmp/cpu_runs && tar czf $OUT/cpu_recipe.tgz --exclude=checkpoints --exclude=tensorboard --exclude=rollouts .
