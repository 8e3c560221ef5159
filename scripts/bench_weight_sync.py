"""Weight sync speed: seconds per GB from "optimizer step done" to "every engine serves the new
version", per placement layout, next to the raw floors measured in the same run (a broadcast of
the same bytes between two processes -- NCCL on GPU, gloo on CPU -- and a same-device copy).

    python scripts/bench_weight_sync.py --shape smollm2-1.7b          # GPU: 1.7B shape, bf16
    python scripts/bench_weight_sync.py --shape tiny --layouts colocated,disaggregated   # CPU
    python scripts/bench_weight_sync.py --trainer-gpus 2 --engines 2 --layouts disaggregated  # 4 GPUs
    python scripts/bench_weight_sync.py --shape tiny --layouts colocated --lora-rank 4  # + LoRA, CPU

Each repeat runs a real GRPO train step first (`--train-tokens` of synthetic trajectories; colocated,
the engines release their memory for it, as in `agentrl train`), then times from "optimizer step
done" on. Colocated: trainer rank i and engine i share GPU i (`--trainer-gpus` of each); the
timed span covers resume {weights} -> CUDA IPC buckets -> resume {kv_cache}, after the trainer's
step has used (and handed back) the memory the engines gave up. Disaggregated: trainer on the first `--trainer-gpus` GPUs,
`--engines` engines on the next ones, an NCCL broadcast per bucket from trainer rank 0 to all of
them; its floor is a broadcast of the same bytes from GPU 0 to the engines' GPUs. Writes JSON and
a PNG bar chart; prints a table. With `--lora-rank R` each layout also runs as a LoRA run of rank R
(all-linear, the tensor transport: the adapter alone is sent) and a table compares its bytes and
seconds per sync with full fine-tuning's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = ("colocated", "disaggregated")


def layout_flags(name: str, trainer_gpus: int, engines: int) -> dict:
    """The placement flags of a layout: one GPU per engine; colocated has an engine per trainer
    GPU."""
    if name == "colocated":
        return dict(actor_num_gpus_per_node=trainer_gpus, colocate=True)
    return dict(actor_num_gpus_per_node=trainer_gpus, rollout_num_gpus=engines)


def build_model(shape: str, tokenizer: str, out: str, use_gpu: bool) -> str:
    from tests.support.models import make_tiny_model
    from tests.support.random_models import make_shaped_model

    if shape == "tiny":
        return make_tiny_model(out, tokenizer, num_layers=2, hidden_size=64)
    dtype = "bfloat16" if use_gpu else "float32"
    return make_shaped_model(
        out, tokenizer, shape, dtype=dtype, device="cuda" if use_gpu else "cpu"
    )


def train_batches(vocab_size: int, num_tokens: int, pad_id: int, dp_size: int) -> list:
    """GRPO batches (one per DP rank) of about `num_tokens` tokens: groups of 4 random
    256-token trajectories, rewards 0/1 so every advantage is non-zero."""
    from agentrl.config import AlgoConfig
    from agentrl.trainer.batch import build_train_batches
    from agentrl.types import EpisodeStatus, StatusReason, Trajectory

    g = torch.Generator().manual_seed(0)
    length, prompt = 256, 64
    trajs = [
        Trajectory(
            token_ids=torch.randint(3, vocab_size, (length,), generator=g).tolist(),
            loss_mask=[0] * prompt + [1] * (length - prompt),
            logprobs=[-1.0] * (length - prompt),
            prompt_len=prompt,
            reward=float(k % 2),
            status=EpisodeStatus.COMPLETED,
            status_reason=StatusReason.DONE,
        )
        for k in range(4 * max(1, num_tokens // (4 * length)))
    ]
    groups = [trajs[i : i + 4] for i in range(0, len(trajs), 4)]
    return build_train_batches(
        groups, AlgoConfig(), max_tokens_per_micro_batch=4096, pad_id=pad_id, dp_size=dp_size
    )


async def time_layout(
    name: str,
    model_path: str,
    repeats: int,
    use_gpu: bool,
    bucket_bytes: int,
    flags: dict,
    train_tokens: int,
    lora_rank: int = 0,
) -> dict:
    from transformers import AutoConfig

    from agentrl.config import RunConfig
    from agentrl.deploy.launch import start_on_ray

    cfg = RunConfig()
    cfg.model.path = model_path
    cfg.model.dtype = "bfloat16" if use_gpu else "float32"
    cfg.checkpoint.save = tempfile.mkdtemp(prefix=f"agentrl-bench-{name}-")
    cfg.cluster.check_weight_sync = False  # time the sync alone
    cfg.cluster.update_weight_buffer_size = bucket_bytes
    for key, value in flags.items():
        setattr(cfg.cluster, key, value)
    if lora_rank:  # the adapter alone goes, as tensors, whatever the layout
        cfg.train.lora_rank, cfg.train.lora_alpha = lora_rank, 2 * lora_rank
        cfg.cluster.update_weight_transport = "tensor"
    runtime = await start_on_ray(cfg, model_path, num_optimizer_steps=1000)
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    batches = train_batches(vocab, train_tokens, runtime.pad_id, runtime.dp_size)
    try:
        await runtime.train_step(batches)  # warm-up: kernels, optimizer state, allocator
        await runtime.sync_weights(0)  # the warm-up version
        info = await runtime.engine.clients[0].get_server_info()
        state = (info.get("internal_states") or [{}])[0]
        pausable = bool(state.get("pausable_memory", False))
        kv_cache_gb = state.get("kv_cache_bytes", 0) / 1e9
        times, phases, train_s, num_bytes = [], [], [], 0.0
        for i in range(repeats):
            t_train = time.perf_counter()
            # Colocated, this releases the engines' memory first, as `agentrl train` does.
            trained = await runtime.train_step(batches)
            train_s.append(time.perf_counter() - t_train)
            assert not trained.get("skipped_no_signal"), "the bench's train step did no work"
            version = i + 1  # a policy version: an int
            t0 = time.perf_counter()
            out = await runtime.sync_weights(version)
            served = {await c.get_weight_version() for c in runtime.engine.clients}
            times.append(time.perf_counter() - t0)
            assert served == {version}, f"engines serve {served}, expected {version}"
            num_bytes = out["weight_sync/bytes"]
            info = await runtime.engine.clients[0].get_server_info()
            state = (info.get("internal_states") or [{}])[0]
            phases.append(
                {k: round(v, 4) for k, v in out.items() if k.startswith("time/")}
                # the engine's own share of each resume and of the update (receive: unpickle or
                # broadcast; load: into the model): the rest is HTTP and the actor hop
                | {
                    f"engine/resume_{k}_s": round(v, 4)
                    for k, v in state.get("last_resume_s", {}).items()
                }
                | {
                    f"engine/{k}": round(v, 4)
                    for k, v in state.get("last_weight_update_s", {}).items()
                }
            )
    finally:
        await runtime.close()
    best = min(times)
    return {
        "layout": name,
        "lora_rank": lora_rank,
        "placement": flags,
        "num_engines": len(runtime.engine.clients),
        "bucket_mib": bucket_bytes // 2**20,
        "bytes": num_bytes,
        "seconds": times,
        "phases_s": phases[times.index(best)],
        "train_step_s": train_s,
        "s_per_gb": best / (num_bytes / 1e9),
        "pausable_memory": pausable,
        "kv_cache_gb": kv_cache_gb,
    }


# The rows of the per-phase table: (label, key in a layout's phases). The sender's phases are
# rank 0's; "send" holds the engine's receive and load (the server reports them itself).
PHASES = (
    ("resume weights", "time/resume_weights_s"),
    ("export (not overlapped)", "time/weight_export_s"),
    ("flatten", "time/weight_sender_flatten_s"),
    ("send (HTTP + transfer)", "time/weight_sender_send_s"),
    ("  engine receive", "engine/receive_s"),
    ("  engine load", "engine/load_s"),
    ("end session + flush", "time/weight_sender_end_s"),
    ("update under the gate", "time/update_weights_s"),
    ("resume KV cache", "time/resume_kv_cache_s"),
)


def print_phases(results: list[dict]) -> None:
    """Seconds per phase of each layout's best repeat ("-": the layout has no such phase)."""
    print(f"\n{'phase (s, best repeat)':<28}" + "".join(f"{_label(r):>30}" for r in results))
    for label, key in PHASES:
        cells = [r["phases_s"].get(key) for r in results]
        print(f"{label:<28}" + "".join(f"{'-' if c is None else f'{c:.4f}':>30}" for c in cells))
    totals = [f"{r['s_per_gb'] * r['bytes'] / 1e9:.4f}" for r in results]
    print(f"{'total (resume -> served)':<28}" + "".join(f"{t:>30}" for t in totals))


def copy_floor(num_bytes: int, use_gpu: bool, repeats: int) -> float:
    device = "cuda:0" if use_gpu else "cpu"
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        if use_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if use_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / (num_bytes / 1e9)


def _broadcast_worker(
    rank: int, gpu: int, world: int, port: int, num_bytes: int, bucket: int, use_gpu: bool, q
) -> None:
    import torch.distributed as dist

    backend = "nccl" if use_gpu else "gloo"
    if use_gpu:
        torch.cuda.set_device(gpu)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = f"cuda:{gpu}" if use_gpu else "cpu"
    buckets = [
        torch.empty(min(bucket, num_bytes - i), dtype=torch.uint8, device=device)
        for i in range(0, num_bytes, bucket)
    ]
    best = float("inf")
    for _ in range(4):
        dist.barrier()
        if use_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in buckets:
            dist.broadcast(b, 0)
        if use_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    if rank == 0:
        q.put(best / (num_bytes / 1e9))
    dist.barrier()


def broadcast_floor(
    num_bytes: int, bucket: int, use_gpu: bool, receivers: list[int]
) -> float | None:
    """Seconds per GB of broadcasting `num_bytes` from GPU 0 to the GPUs `receivers`."""
    if use_gpu and torch.cuda.device_count() <= max(receivers):
        return None
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    gpus = [0, *receivers]
    procs = [
        ctx.Process(
            target=_broadcast_worker,
            args=(rank, gpu, len(gpus), port, num_bytes, bucket, use_gpu, q),
        )
        for rank, gpu in enumerate(gpus)
    ]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def _label(r: dict) -> str:
    lora = f" LoRA r{r['lora_rank']}" if r.get("lora_rank") else ""
    return f"{r['layout']}{lora} x{r['num_engines']} ({r['bucket_mib']} MiB)"


def print_lora(results: list[dict]) -> None:
    """Each LoRA row against the full fine-tuning row of its layout (same bucket size)."""
    full = {(r["layout"], r["bucket_mib"]): r for r in results if not r.get("lora_rank")}
    rows = [(r, full.get((r["layout"], r["bucket_mib"]))) for r in results if r.get("lora_rank")]
    if not rows:
        return
    print(
        f"\n{'adapter-only sync vs full':<34}{'MB':>10}{'% of full':>11}{'s/sync':>10}{'full s':>10}"
    )
    for lora, whole in rows:
        if whole is None:
            continue
        share = 100 * lora["bytes"] / whole["bytes"]
        line = f"{_label(lora):<34}{lora['bytes'] / 1e6:>10.2f}{share:>10.2f}%"
        print(line + f"{min(lora['seconds']):>10.4f}{min(whole['seconds']):>10.4f}")


def plot(results: list[dict], floors: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [_label(r) for r in results] + [f"floor: {k}" for k, v in floors.items() if v]
    values = [r["s_per_gb"] for r in results] + [v for v in floors.values() if v]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(
        names,
        values,
        color=["tab:blue"] * len(results) + ["tab:gray"] * (len(names) - len(results)),
    )
    ax.set_xlabel("seconds per GB (lower is better)")
    ax.set_title("weight sync: optimizer step done -> engine serves new version")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shape", default="smollm2-1.7b", help="tiny | smollm2-135m | smollm2-360m | smollm2-1.7b"
    )
    parser.add_argument(
        "--tokenizer",
        default="smollm2-135m-instruct",
        help="dir (or bundled name) with the tokenizer",
    )
    parser.add_argument("--layouts", default="colocated,disaggregated")
    parser.add_argument(
        "--trainer-gpus", type=int, default=1, help="trainer ranks (--actor-num-gpus-per-node)"
    )
    parser.add_argument(
        "--engines", type=int, default=1, help="engines of the disaggregated layout, 1 GPU each"
    )
    parser.add_argument(
        "--train-tokens", type=int, default=8192, help="tokens of the train step before each sync"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bucket-mib",
        default="512,2048",
        help="comma list of update_weight_buffer_size values in MiB (slime's default: 512)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="also run each layout as LoRA of this rank (0: no)"
    )
    parser.add_argument("--out", default="benchmarks/weight_sync.json")
    args = parser.parse_args()
    use_gpu = torch.cuda.is_available()
    layouts = [name for name in args.layouts.split(",") if name]
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts {args.layouts}: unknown {sorted(unknown)}; use {list(LAYOUTS)}")
    needed = {"colocated": args.trainer_gpus, "disaggregated": args.trainer_gpus + args.engines}
    for name in list(layouts):
        if use_gpu and torch.cuda.device_count() < needed[name]:
            print(
                f"{name} needs {needed[name]} GPUs, this machine has {torch.cuda.device_count()}; "
                "skipping it",
                file=sys.stderr,
            )
            layouts.remove(name)
    if not layouts:
        sys.exit("no layout fits this machine: lower --trainer-gpus or --engines")
    model_dir = build_model(
        args.shape, args.tokenizer, tempfile.mkdtemp(prefix="agentrl-shape-"), use_gpu
    )
    buckets = [int(mib) * 2**20 for mib in args.bucket_mib.split(",") if mib]
    results = [
        asyncio.run(
            time_layout(
                name,
                model_dir,
                args.repeats,
                use_gpu,
                bucket,
                layout_flags(name, args.trainer_gpus, args.engines),
                args.train_tokens,
            )
        )
        for name in layouts
        for bucket in buckets
    ]
    results += [  # the adapter is one small bucket: one bucket size says it all
        asyncio.run(
            time_layout(
                name,
                model_dir,
                args.repeats,
                use_gpu,
                buckets[0],
                layout_flags(name, args.trainer_gpus, args.engines),
                args.train_tokens,
                lora_rank=args.lora_rank,
            )
        )
        for name in (layouts if args.lora_rank else [])
    ]
    num_bytes = int(results[0]["bytes"])
    bucket = 512 * 2**20
    receivers = [args.trainer_gpus + i for i in range(args.engines)]
    floors = {
        "copy (same device)": copy_floor(num_bytes, use_gpu, args.repeats),
        f"broadcast to {args.engines} ({'NCCL' if use_gpu else 'gloo'})": broadcast_floor(
            num_bytes, bucket, use_gpu, receivers
        ),
    }
    device = torch.cuda.get_device_name(0) if use_gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"\nweight sync, {args.shape} ({num_bytes / 1e9:.2f} GB), {device}")
    print(f"{'what':<34}{'s/GB':>10}{'x floor':>10}")
    floor = (
        floors[next(k for k in floors if k.startswith("broadcast"))] or floors["copy (same device)"]
    )
    for r in results:
        what = _label(r)
        paused = " pausable memory" if r.get("pausable_memory") else ""
        paused += f", KV cache {r['kv_cache_gb']:.1f} GB"
        step = min(r["train_step_s"])
        print(
            f"{what:<34}{r['s_per_gb']:>10.4f}{r['s_per_gb'] / floor:>10.1f}  {r['phases_s']}"
            f"{paused}, train step before it {step:.3f} s"
        )
    for name, value in floors.items():
        if value is not None:
            print(f"{'floor: ' + name:<34}{value:>10.4f}")
    print_phases(results)
    print_lora(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "shape": args.shape,
        "bytes": num_bytes,
        "device": device,
        "layouts": results,
        "floors_s_per_gb": floors,
    }
    out.write_text(json.dumps(record, indent=2))
    plot(results, floors, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
