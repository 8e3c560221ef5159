"""Trainer speed: one GRPO train step of each trainer backend against plain transformers
forward + backward + AdamW step, on the same packed batch of a random-init model of a real
shape. Reports tokens/s, the ratio to plain transformers and, on a GPU, MFU.

    python scripts/bench_trainer.py --shape smollm2-1.7b --tokenizer .gpu/smollm2_tok   # GPU
    python scripts/bench_trainer.py --shape tiny --num-rows 1 --row-tokens 256           # CPU

FLOPs of a step (printed): 6 x matmul params x tokens (forward 2, backward 4; matmul params =
the decoder's linear layers + the LM head, not the embedding lookup) + attention, 6 x layers x
hidden x sum over sequences of len^2 (causal QK^T and AV, forward and backward). MFU = FLOPs /
time / the GPU's dense bf16 peak. Every backend trains on the same sequences, packed into rows
of --row-tokens tokens. The baseline is what a plain loop gets: transformers' default attention
over each whole row (causal, sequences not separated -- it builds no block mask from
position_ids), so its attention does more work than the FLOPs counted for all. Writes JSON and
a PNG bar chart. For the agentrl backends it also times one weight export as a sync sends it
(the engines' dtype; under LoRA the merged weights, and the adapter alone) and, on a GPU, the
step's peak memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agentrl.types import Trajectory

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}
BACKENDS = ("transformers", "torch", "torch_lora", "megatron")
"""torch_lora: the torch backend with `--lora-rank` adapters on all linear layers (issue 41)."""


def log(message: str) -> None:
    print(f"[bench_trainer {time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_model(args: argparse.Namespace, use_gpu: bool) -> str:
    from tests.support.models import make_tiny_model
    from tests.support.random_models import SHAPES, save_random_llama

    if args.model:
        return args.model
    out = tempfile.mkdtemp(prefix=f"agentrl-bench-trainer-{args.shape}-")
    if args.shape == "tiny":
        return make_tiny_model(out, args.tokenizer, num_layers=2, hidden_size=64)
    shape = dict(SHAPES[args.shape])
    if args.num_layers:
        shape["num_hidden_layers"] = args.num_layers
    dtype = "bfloat16" if use_gpu else "float32"
    return save_random_llama(out, args.tokenizer, shape, dtype=dtype,
                             device="cuda" if use_gpu else "cpu")  # fmt: skip


def make_groups(vocab_size: int, args: argparse.Namespace) -> list[list[Trajectory]]:
    """Groups of 4 trajectories of --seq-tokens tokens (a quarter prompt), rewards 0/1 so every
    advantage is non-zero; enough to fill --num-rows rows of --row-tokens."""
    from agentrl.types import EpisodeStatus, StatusReason, Trajectory

    g = torch.Generator().manual_seed(0)
    per_row = max(1, args.row_tokens // args.seq_tokens)
    num_seqs = 4 * -(-per_row * args.num_rows // 4)
    prompt = args.seq_tokens // 4
    trajs = [
        Trajectory(
            token_ids=torch.randint(3, vocab_size, (args.seq_tokens,), generator=g).tolist(),
            loss_mask=[0] * prompt + [1] * (args.seq_tokens - prompt),
            logprobs=[-1.0] * (args.seq_tokens - prompt),
            prompt_len=prompt,
            reward=float(k % 2),
            status=EpisodeStatus.COMPLETED,
            status_reason=StatusReason.DONE,
            episode_id=f"e{k}",
        )
        for k in range(num_seqs)
    ]
    return [trajs[i : i + 4] for i in range(0, num_seqs, 4)]


def step_flops(hf_config, batch) -> float:
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    kv = hf_config.num_key_value_heads * (h // hf_config.num_attention_heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * hf_config.intermediate_size
    matmul_params = layers * per_layer + hf_config.vocab_size * h  # + the LM head
    tokens, sq_lengths = 0, 0
    for mb in batch.micro_batches():
        tokens += mb.num_tokens
        starts = (mb.position_ids.reshape(-1) == 0).nonzero()[:, 0].tolist()
        bounds = [*starts, mb.num_tokens]
        sq_lengths += sum((b - a) ** 2 for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return 6.0 * matmul_params * tokens + 6.0 * layers * h * sq_lengths


def _sync(use_gpu: bool) -> None:
    if use_gpu:
        torch.cuda.synchronize()


def time_steps(name: str, step, args: argparse.Namespace, use_gpu: bool) -> list[float]:
    times = []
    for k in range(args.warmup + args.repeats):
        _sync(use_gpu)
        t0 = time.perf_counter()
        step()
        _sync(use_gpu)
        elapsed = time.perf_counter() - t0
        kind = "warmup" if k < args.warmup else "timed"
        log(f"{name}: step {k + 1}/{args.warmup + args.repeats} ({kind}) {elapsed:.3f} s")
        if k >= args.warmup:
            times.append(elapsed)
    if args.profile:
        print_profile(name, step, use_gpu)
    return times


def print_profile(name: str, step, use_gpu: bool, top: int = 15) -> None:
    """One more step under torch.profiler: the operators that took the most device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_gpu else [])
    with profile(activities=activities) as prof:
        step()
        _sync(use_gpu)
    sort_by = "self_cuda_time_total" if use_gpu else "self_cpu_time_total"
    log(f"{name}: profile of one step, top {top} by {sort_by}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=60))


def plain_transformers(model_path: str, batch, args, use_gpu: bool, dtype: torch.dtype):
    """forward + backward + AdamW step over the micro-batches, loss = mean NLL on the loss
    mask: what a plain training loop on transformers does (no logprob chunking, no per-sequence
    attention)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if use_gpu else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=use_gpu)
    mbs = [mb.to(device) for mb in batch.micro_batches()]
    num_loss_tokens = sum(float(mb.loss_mask.sum()) for mb in mbs)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            nll = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), mb.target_ids.flatten(), reduction="none"
            )
            ((nll * mb.loss_mask.flatten()).sum() / num_loss_tokens).backward()
        optimizer.step()

    return time_steps("transformers", step, args, use_gpu)  # the model is freed on return


def agentrl_backend(
    name: str, model_path: str, batch, args, use_gpu: bool, dtype_name: str
) -> tuple[list[float], dict]:
    """The step times and what one sync would cost: export seconds and bytes (merged weights
    under LoRA, and the adapter alone), the step's peak GPU memory."""
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.trainer.backend import make_trainer_backend

    lora_rank = args.lora_rank if name == "torch_lora" else 0
    train_cfg = TrainConfig(
        backend="torch" if name == "torch_lora" else name,
        lr=1e-6,
        max_tokens_per_micro_batch=args.row_tokens,
        lora_rank=lora_rank,
        lora_alpha=2 * lora_rank or 16,
    )
    backend = make_trainer_backend(
        model_path,
        train_cfg,
        AlgoConfig(),
        device="cuda" if use_gpu else "cpu",
        dtype=dtype_name,
        temperature=1.0,
        num_optimizer_steps=1000,
    )
    metrics: dict = {}

    def step() -> None:
        metrics.update(backend.train_step(batch))

    times = time_steps(name, step, args, use_gpu)
    sync: dict = {"max_memory_allocated_gb": metrics.get("max_memory_allocated_gb")}
    dtype = getattr(torch, dtype_name)
    _sync(use_gpu)
    t0 = time.perf_counter()
    sync["export_bytes"] = sum(
        t.numel() * t.element_size()
        for bucket in backend.export_weights(dtype=dtype)
        for _, t in bucket
    )
    _sync(use_gpu)
    sync["export_s"] = time.perf_counter() - t0
    if lora_rank:
        t0 = time.perf_counter()
        sync["adapter_bytes"] = backend.export_adapter(dtype=dtype).num_bytes  # type: ignore[attr-defined]
        _sync(use_gpu)
        sync["adapter_export_s"] = time.perf_counter() - t0
    log(f"{name}: one export {sync}")
    return times, sync


def megatron_unavailable(use_gpu: bool) -> str | None:
    from agentrl.config import TrainConfig
    from agentrl.trainer.megatron import MegatronUnavailable, check_megatron_usable

    try:
        check_megatron_usable(TrainConfig(backend="megatron"), 1)
    except MegatronUnavailable as e:
        return str(e)
    return None


def peak_tflops(args: argparse.Namespace, use_gpu: bool) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    if not use_gpu:
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in results["backends"].items() if "tokens_per_s" in v}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(list(ran), [v["tokens_per_s"] for v in ran.values()], color="#4c72b0")
    for bar, v in zip(bars, ran.values(), strict=True):
        label = f"{v['ratio_to_transformers']:.2f}x" + (
            f"\nMFU {v['mfu']:.0%}" if v.get("mfu") is not None else ""
        )
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens / s (one GRPO train step)")
    ax.set_title(f"{results['shape']} on {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-1.7b", help="tiny | smollm2-135m | -360m | -1.7b")
    p.add_argument("--num-layers", type=int, help="override the shape's layer count")
    p.add_argument("--model", help="an existing checkpoint instead of a random one")
    p.add_argument("--tokenizer", default="smollm2-135m-instruct", help="tokenizer source")
    p.add_argument("--row-tokens", type=int, default=4096, help="tokens per packed row")
    p.add_argument("--num-rows", type=int, default=4, help="packed rows in the batch")
    p.add_argument("--seq-tokens", type=int, default=1024, help="tokens per trajectory")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--lora-rank", type=int, default=16, help="torch_lora's adapter rank")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="print each backend's top operators")
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak (default: from GPU name)")
    p.add_argument("--out", default="benchmarks/bench_trainer.json")
    args = p.parse_args(argv)

    from transformers import AutoConfig

    from agentrl.config import AlgoConfig
    from agentrl.trainer.batch import build_train_batches, pad_id_for

    use_gpu = torch.cuda.is_available()
    dtype_name = "bfloat16" if use_gpu else "float32"
    log(f"building a random {args.shape} model ({dtype_name})")
    model_path = build_model(args, use_gpu)
    hf_config = AutoConfig.from_pretrained(model_path)
    (batch,) = build_train_batches(make_groups(hf_config.vocab_size, args), AlgoConfig(),
                                   max_tokens_per_micro_batch=args.row_tokens,
                                   pad_id=pad_id_for(hf_config))  # fmt: skip
    tokens = sum(mb.num_tokens for mb in batch.micro_batches())
    flops = step_flops(hf_config, batch)
    peak = peak_tflops(args, use_gpu)
    device = torch.cuda.get_device_name() if use_gpu else "cpu"
    log(f"batch: {tokens} tokens in {len(list(batch.micro_batches()))} packed micro-batches; "
        f"{flops / 1e12:.2f} TFLOP per step = 6 x matmul params x tokens + 6 x layers x hidden "
        "x sum(len^2)")  # fmt: skip
    results: dict = {"shape": args.shape, "device": device, "dtype": dtype_name,
                     "num_tokens": tokens, "flops_per_step": flops, "peak_tflops": peak,
                     "flops_formula": "6*matmul_params*tokens + 6*layers*hidden*sum(len^2)",
                     "backends": {}}  # fmt: skip
    for name in args.backends.split(","):
        if name == "megatron" and (reason := megatron_unavailable(use_gpu)):
            log(f"megatron: skipped ({reason})")
            results["backends"][name] = {"skipped": reason}
            continue
        log(f"{name}: starting")
        sync = {}
        if name == "transformers":
            dtype = torch.bfloat16 if use_gpu else torch.float32
            times = plain_transformers(model_path, batch, args, use_gpu, dtype)
        else:
            times, sync = agentrl_backend(name, model_path, batch, args, use_gpu, dtype_name)
        gc.collect()
        if use_gpu:
            torch.cuda.empty_cache()
        step_s = sorted(times)[len(times) // 2]  # median
        row = {"step_s": step_s, "step_s_all": times, "tokens_per_s": tokens / step_s, **sync}
        row["mfu"] = flops / step_s / (peak * 1e12) if peak else None
        results["backends"][name] = row
    base = results["backends"].get("transformers", {}).get("tokens_per_s")
    for row in results["backends"].values():
        if "tokens_per_s" in row:
            row["ratio_to_transformers"] = row["tokens_per_s"] / base if base else None
    print(f"\n{'backend':<14}{'step s':>10}{'tokens/s':>12}{'vs transformers':>17}{'MFU':>8}")
    for name, row in results["backends"].items():
        if "skipped" in row:
            print(f"{name:<14}{'skipped':>10}")
            continue
        ratio, mfu = row.get("ratio_to_transformers"), row.get("mfu")
        print(f"{name:<14}{row['step_s']:>10.3f}{row['tokens_per_s']:>12.0f}"
              f"{(f'{ratio:.2f}x' if ratio else '-'):>17}{(f'{mfu:.1%}' if mfu else '-'):>8}")  # fmt: skip
    print(
        f"\n{'backend':<14}{'export s':>10}{'export MB':>11}{'adapter s':>11}{'adapter MB':>12}"
        f"{'peak GB':>9}"
    )
    for name, row in results["backends"].items():
        if "export_s" in row:
            cells = [
                f"{row['export_s']:>10.3f}",
                f"{row['export_bytes'] / 1e6:>11.1f}",
                f"{row.get('adapter_export_s', float('nan')):>11.3f}",
                f"{row.get('adapter_bytes', float('nan')) / 1e6:>12.2f}",
                f"{row['max_memory_allocated_gb'] or float('nan'):>9.2f}",
            ]
            print(f"{name:<14}{''.join(cells)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
