"""Rollout correction against a planted train-rollout mismatch, on a real model (issue 42).

The embedded engine samples multi-turn episodes (top-k/top-p, so sampling-mask replay is on).
Their rollout logprobs are then recomputed by a bf16 copy of the model whose logit of one token
is off by --bias (the planted error, beside bf16's own precision gap); the trainer scores them in
float32. Each correction mode should mask exactly the sampled tokens of that id (token levels), or
exactly the sequences that sampled it (sequence levels, the veto), and nothing else. Prints one
line per mode (planted, masked, precision, recall) and the mismatch metrics; writes JSON.

    python scripts/check_planted_mismatch.py --device cuda --out /tmp/planted.json   # GPU
    python scripts/check_planted_mismatch.py --model PATH --num-episodes 8          # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = {  # name -> (algo fields, bias sign, level judged)
    "token": (dict(rollout_rs="token", rollout_rs_threshold=2.0), -1, "token"),
    "icepop": (dict(rollout_correction="icepop"), -1, "token"),
    "sequence": (dict(rollout_rs="sequence", rollout_rs_threshold=3.0), -1, "sequence"),
    "geometric": (dict(rollout_rs="geometric", rollout_rs_threshold=1.1), -1, "sequence"),
    "veto": (dict(rollout_token_veto_threshold=0.05), 1, "sequence"),
}


async def sample(path: str, device: str, args: argparse.Namespace) -> list:
    """Episodes of two sampled turns with a masked reply between them."""
    from agentrl.engine.base import SamplingParams
    from agentrl.engine.local import LocalEngine
    from agentrl.rollout.episode import EpisodeRecord
    from agentrl.types import EpisodeStatus, StatusReason, Task

    engine = LocalEngine.load(path, device=device)
    tok = engine.tokenizer
    out = []
    try:
        for i in range(args.num_episodes):
            rec = EpisodeRecord(Task(f"t{i}", {}), f"g{i // 4}", f"e{i}")
            question = f"Write a short story about the number {i}, in plain words."
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            rec.add_prompt(tok.encode(prompt, add_special_tokens=False))
            for turn in range(2):
                sampling = SamplingParams(
                    temperature=1.0,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens,
                    seed=100 * i + turn,
                )
                completion = await engine.generate(list(rec.token_ids), sampling)
                rec.add_sampled(completion, "", sampling)
                if turn == 0:
                    rec.add_observation(tok.encode(" Tool says: go on.", add_special_tokens=False))
            rec.reward = float(i % 2)
            out.append(rec.finish((EpisodeStatus.COMPLETED, StatusReason.DONE)))
    finally:
        await engine.close()
    return out


def planted_id(trajectories: list) -> int:
    """A sampled token id found in about half the episodes, and rarely within them: planted in
    some sequences, not all, and seldom likely where it was not sampled."""
    episodes: dict[int, int] = {}
    occurrences: dict[int, int] = {}
    for t in trajectories:
        sampled = [tid for tid, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
        for tid in sampled:
            occurrences[tid] = occurrences.get(tid, 0) + 1
        for tid in set(sampled):
            episodes[tid] = episodes.get(tid, 0) + 1
    half = len(trajectories) / 2
    return min(episodes, key=lambda tid: (abs(episodes[tid] - half), occurrences[tid], tid))


@torch.no_grad()
def replant(trajectories: list, path: str, device: str, token: int, bias: float) -> list:
    """The same episodes with rollout logprobs of a bf16 copy whose logit of `token` is off by
    `bias`, under each turn's own top-k/top-p (as the engine reports them)."""
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.sampling_mask import truncate_logits

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device)  # type: ignore[arg-type]  # transformers' overloads miss a str
    out = []
    for t in trajectories:
        ids = torch.tensor([t.token_ids], device=device)
        logits = model(ids).logits[0].float()  # [T, V]
        logits[:, token] += bias
        logprobs = []
        for turn in t.turns:
            positions = torch.arange(
                turn.start - 1, turn.start - 1 + turn.num_sampled, device=device
            )
            targets = ids[0, positions + 1]
            n = len(positions)
            k = torch.full((n,), turn.top_k, device=device)
            p = torch.full((n,), turn.top_p, device=device)
            scaled = truncate_logits(logits[positions] / turn.temperature, targets, k, p)
            lp = torch.log_softmax(scaled, dim=-1).gather(1, targets[:, None])[:, 0]
            logprobs += lp.tolist()
        out.append(dataclasses.replace(t, logprobs=logprobs))
    return out


def check_mode(name: str, trajectories: list, path: str, device: str, token: int) -> dict:
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.config_correction import settings_from_config
    from agentrl.trainer.batch import build_train_batches
    from agentrl.trainer.losses import Segments
    from agentrl.trainer.rollout_correction import build_correction
    from agentrl.trainer.torch_backend import TorchBackend

    fields, _, level = MODES[name]
    algo = AlgoConfig(**fields)
    batch = build_train_batches([trajectories], algo, max_tokens_per_micro_batch=8192, pad_id=0)[0]
    backend = TorchBackend(path, TrainConfig(lr=0.0), algo, device=device, dtype="float32")
    backend.setup()
    backend.compute_logprobs(batch)
    correction = build_correction(settings_from_config(algo))
    assert correction is not None
    planted = masked = both = 0.0
    for mb in batch.micro_batches():
        mb = mb.to(device)
        assert mb.old_logprobs is not None
        seg = Segments(mb.loss_mask, mb.seq_index, mb.seq_num_tokens, 1.0, 1.0)
        keep = correction(mb.old_logprobs, mb.rollout_logprobs, seg).keep
        is_loss = mb.loss_mask > 0
        is_planted = (mb.target_ids == token) & is_loss
        if level == "sequence":
            is_planted = (seg.seq_sum(is_planted.float()) > 0)[mb.seq_index] & is_loss
        is_masked = (keep == 0) & is_loss
        planted += float(is_planted.sum())
        masked += float(is_masked.sum())
        both += float((is_planted & is_masked).sum())
    metrics = backend.train_step(batch)
    keys = [k for k in metrics if k.startswith(("mismatch_", "rs_", "tis_"))]
    return {
        "mode": name,
        "planted_tokens": planted,
        "masked_tokens": masked,
        "precision": both / masked if masked else 1.0,
        "recall": both / planted if planted else 1.0,
        **{k: metrics[k] for k in sorted(keys)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Rollout correction against a planted mismatch.")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-episodes", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--bias", type=float, default=6.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from agentrl.model_store import resolve_model_path

    path = resolve_model_path(args.model)
    trajectories = asyncio.run(sample(path, args.device, args))
    token = planted_id(trajectories)
    rows = []
    for name, (_, sign, _) in MODES.items():
        planted = replant(trajectories, path, args.device, token, sign * args.bias)
        rows.append(check_mode(name, planted, path, args.device, token))
        r = rows[-1]
        print(
            f"{name:10s} planted {r['planted_tokens']:6.0f}  masked {r['masked_tokens']:6.0f}  "
            f"precision {r['precision']:.3f}  recall {r['recall']:.3f}  "
            f"kl_k1 {r['mismatch_kl_k1']:+.4f}  kl_k3 {r['mismatch_kl_k3']:.4f}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"planted_id": token, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
