"""Where a run's trainer and engines live (`plan.py`: the `Deployment`, computed once), how they
start (`launch.py`), the engine groups the runtime drives (`engines.py`), and Ray's part: the
placement group, the trainer-rank and engine-server actors (`ray_cluster.py`, `servers.py`)."""
