#!/usr/bin/env bash
# Issue 42's GPU acceptance: README's one-GPU search_r1 command in fully async mode with
# --max-staleness 2, once without a rollout correction (TIS off) and once with one
# (algo.rollout_correction=$CORRECTION), STEPS steps each; held-out EM at the start and the end
# (the natural test split, greedy), and the mismatch metrics of every step in one JSON per run.
#
# Two GPUs, disaggregated (trainer on GPU 0, engine on GPU 1, weights over NCCL through Ray):
# `--async` on one GPU is refused (deploy/plan.py) because the engine gives its memory to the
# trainer while it steps, and async generates while the trainer steps. Letting the embedded
# engine keep its memory beside the trainer in one process is untested on a GPU (its KV arena
# sized beside the trainer's peak, two threads on one device), so this runs on nvidia-h200-x2 as
# issue 40's end-to-end runs do. Both runs share the two GPUs at once (engines at 20% of GPU 1).
#
# Usage (after the session's setup: agentrl importable, the model converted):
#   bash benchmarks/gpu/session15/issue42_async_correction.sh [STEPS]
#   bash benchmarks/gpu/session15/issue42_async_correction.sh planted   # a call of its own:
#       the planted mismatch (bf16 rollout with one logit off, fp32 trainer) on the GPU, each
#       correction mode's masked precision/recall to $OUT/planted.json
#   DRY_RUN=1 ...: parse both commands' flags (`train --show-config`) and check the configs as
#                  a run does (`check_run`), on any machine: no model load, no GPU.
# Env: CORRECTION (icepop), EVAL_TASKS (350), OUT (./issue42_out), RUN_TIMEOUT_S (560).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ "${1:-}" = planted ]; then
  mkdir -p "${OUT:-$PWD/issue42_out}"
  exec python3 "$here/../../../scripts/check_planted_mismatch.py" --device cuda \
    --out "${OUT:-$PWD/issue42_out}/planted.json"
fi
steps=${1:-8}
correction=${CORRECTION:-icepop}
out=${OUT:-$PWD/issue42_out}
mkdir -p "$out"
common=(--env search_r1 --num-rollout "$steps" --rollout-batch-size 16 --n-samples-per-prompt 8
  --lr 1e-5 --eval-interval 1000 --async --async-mode full --max-staleness 2
  --actor-num-gpus-per-node 1 --rollout-num-gpus 1
  --set eval.num_eval_tasks="${EVAL_TASKS:-350}" --set eval.eval_at_start=true
  --set engine.max_batch_size=128 --set engine.mem_fraction_static=0.2
  --set train.max_tokens_per_micro_batch=8192 --set rollout.dynamic_sampling=true
  --set rollout.max_sampling_rounds=2 --set log.progress=false
  --set checkpoint.save_interval=1000)
declare -A extra=(
  [uncorrected]="--set algo.use_tis=false"
  [corrected]="--set algo.rollout_correction=$correction"
)

run() {  # name
  local name=$1 t0=$SECONDS rc
  # shellcheck disable=SC2086  # the extra flags split into words on purpose
  timeout "${RUN_TIMEOUT_S:-560}" python3 -m agentrl.cli train "${common[@]}" ${extra[$name]} \
    --save "$out/runs/$name" --overwrite >"$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc wall_s=$((SECONDS - t0))" | tee -a "$out/runs.txt"
  summarize "$name"
}

summarize() {  # name: per-step mismatch metrics and the held-out EM, one JSON
  python3 - "$out/runs/$1" "$out/$1.summary.json" <<'PY'
import json, pathlib, sys
run, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
keep = ("train/mismatch", "train/rs_", "train/tis_", "train/is_", "rollout/staleness",
        "rollout/num_stale_dropped", "offpolicy/", "time/step_s", "reward")
steps = []
if (run / "metrics.jsonl").exists():
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row:
            steps.append({k: v for k, v in row.items() if k == "step" or k.startswith(keep)})
evals = json.loads((run / "eval_history.json").read_text()) if (run / "eval_history.json").exists() else []
em = {e["step"]: e.get("em_mean") for e in evals}
dest.write_text(json.dumps({"steps": steps, "heldout_em_by_step": em}, indent=1))
print(dest.name, "steps:", len(steps), "held-out EM by step:", em)
PY
}

if [ -n "${DRY_RUN:-}" ]; then  # every flag parsed, the config checked as a run is; no load
  for name in uncorrected corrected; do
    # shellcheck disable=SC2086
    python3 -m agentrl.cli train "${common[@]}" ${extra[$name]} --save "$out/runs/$name" \
      --overwrite --show-config >"$out/$name.config.json" || exit 1
    python3 - "$out/$name.config.json" <<'PY' || exit 1
import json, sys
from agentrl.config import RunConfig
from agentrl.config_checks import check_run, resolved
from agentrl.config_correction import settings_from_config
cfg = RunConfig.from_dict(json.load(open(sys.argv[1])))
check_run(cfg)
t, algo = cfg.train, resolved(cfg).algo
print(sys.argv[1].rsplit("/", 1)[-1], "ok:", t.async_mode, "staleness", t.max_staleness,
      "steps", t.num_rollout, "correction", settings_from_config(algo))
PY
  done
  python3 "$here/../../../scripts/check_planted_mismatch.py" --help >/dev/null || exit 1
  exit 0
fi
run uncorrected &
sleep 5
run corrected &
wait
