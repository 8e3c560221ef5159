"""Smoke check of a (slimmed) Ray as agentrl.deploy uses it: a local one-node Ray without
dashboard, runtime_env env_vars, tasks, an actor, a placement group and an actor in one of its
bundles; then the session's agent logs are read for errors and the node must still be alive.

    python check_ray.py [--expect-slim] [--num-cpus 2] [--wait 8]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect-slim", action="store_true", help="fail unless ray/SLIMMED.txt")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--wait", type=float, default=8.0, help="seconds the node must stay up")
    args = parser.parse_args()
    t0 = time.time()
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    here = os.path.dirname(ray.__file__)
    slim = os.path.exists(os.path.join(here, "SLIMMED.txt"))
    print(f"ray {ray.__version__} from {here} (slimmed: {slim})", flush=True)
    if args.expect_slim and not slim:
        sys.exit("FAIL: this ray is not the slimmed one")
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        runtime_env={"env_vars": {"AGENTRL_RAY_CHECK": "on"}},
        configure_logging=False,
    )

    @ray.remote(num_cpus=0.5)
    def probe() -> tuple[str, str | None, list]:
        import ray as worker_ray

        return worker_ray.__file__, os.environ.get("AGENTRL_RAY_CHECK"), worker_ray.get_gpu_ids()

    @ray.remote(num_cpus=0.5)
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def add(self, k: int) -> int:
            self.n += k
            return self.n

    worker_file, env, gpus = ray.get(probe.remote())
    assert os.path.dirname(worker_file) == here, f"worker imported ray from {worker_file}"
    assert env == "on", f"runtime_env env_vars did not reach the worker ({env!r})"
    counter = Counter.remote()
    assert ray.get([counter.add.remote(k) for k in (1, 2, 3)])[-1] == 6
    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    in_pg = Counter.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
    ).remote()
    assert ray.get(in_pg.add.remote(5)) == 5
    ray.kill(in_pg)
    remove_placement_group(pg)
    time.sleep(args.wait)  # a dying agent takes the raylet down within seconds
    alive = [n["Alive"] for n in ray.nodes()]
    assert alive == [True], f"nodes: {alive}"
    assert ray.get(counter.add.remote(4)) == 10
    session = ray._private.worker.global_worker.node.get_session_dir_path()
    ray.shutdown()
    problems = []
    for path in sorted(glob.glob(os.path.join(session, "logs", "*"))):
        name = os.path.basename(path)
        if not name.startswith(
            (
                "dashboard_agent",
                "runtime_env_agent",
                "raylet",
                "gcs_server",
                "monitor",
                "log_monitor",
            )
        ):
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        for marker in ("Traceback", "ModuleNotFoundError", "ImportError", "No such file"):
            if marker in text:
                problems.append(f"{name}: {marker}")
    print(f"gpus seen by a task: {gpus}; logs: {session}/logs")
    if problems:
        print("log problems:\n  " + "\n  ".join(problems))
        sys.exit("FAIL: errors in Ray's agent logs")
    print(f"ray check ok ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
