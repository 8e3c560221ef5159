"""Where a LocalEngine decode step goes on CPU, beside a transformers forward with its DynamicCache
(what eager `generate()` runs per step): ms per step, then torch.profiler's top operators for each.
The engine's worker is stopped and its steps run in this thread, so the profile sees them.

    nice -n 5 python benchmarks/engine_cpu/profile_decode.py --batch 8 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.support

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.local.batching import Sequence
from agentrl.model_store import resolve_model_path
from tests.support.random_models import make_shaped_model  # noqa: E402


def engine_decode(engine: Any, prompts: list[list[int]], new_tokens: int, prof: Any = None):
    """Prefill the batch, then time (and profile) its decode steps; ms per step."""
    loop = asyncio.new_event_loop()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    for p in prompts:
        engine._scheduler.add(Sequence(list(p), sampling, loop.create_future(), loop, seed=1))
    engine._step()  # the prefill
    if prof is not None:
        prof.start()
    start = time.perf_counter()
    while engine._scheduler.has_work():
        engine._step()
    elapsed = time.perf_counter() - start
    if prof is not None:
        prof.stop()
    loop.close()
    return 1000 * elapsed / (new_tokens - 1)


@torch.no_grad()
def hf_decode(model: Any, prompts: list[list[int]], new_tokens: int, prof: Any = None) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1)[:, None]
    if prof is not None:
        prof.start()
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1)[:, None]
    elapsed = time.perf_counter() - start
    if prof is not None:
        prof.stop()
    return 1000 * elapsed / (new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-pack", action="store_true", help="engine with F.linear (as before)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = resolve_model_path("smollm2-135m-instruct")
        path = make_shaped_model(tmp, tokenizer, args.shape, dtype="float32")
        engine = LocalEngine.load(path, device="cpu", dtype="float32", max_batch_size=args.batch,
                                  max_context_len=args.prompt_len + args.new_tokens + 8,
                                  pack_cpu_linears=not args.no_pack)  # fmt: skip
    engine._stop_checker.eos_token_ids = set()
    asyncio.run(engine.close())  # the worker thread ends; its steps now run here
    engine._is_closed = False
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 49000, (args.batch, args.prompt_len), generator=g).tolist()
    runs = {"engine": lambda p=None: engine_decode(engine, prompts, args.new_tokens, p),
            "transformers": lambda p=None: hf_decode(engine.model, prompts, args.new_tokens, p)}  # fmt: skip
    for run in runs.values():
        run()  # warm-up
    for _ in range(3):
        print("  ".join(f"{name} {run():.1f} ms/step" for name, run in runs.items()))
    for name, run in runs.items():
        prof = profile()
        run(prof)
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
