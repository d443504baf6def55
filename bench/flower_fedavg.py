"""The scale benchmark's plaintext baseline: Flower's own stock ``FedAvg``
(``flwr.serverapp.strategy.FedAvg``, the Message API strategy of flwr 1.42) on a sealfl
task's partners and model, in Flower's simulation on a local Ray.

``python bench/flower_fedavg.py TASK ROUNDS OUT.json`` (run by bench/scale.py in a process of
its own, like sealfl's campaign worker, so the RSS figures are of the process that hosts the
ServerApp and Flower's simulation driver).

Same work per partner as a sealfl campaign round: the task plug-in's ``train_round`` on the
partner's own rows (same settings, ``task.train_defaults()``, same seeds) and
``evaluate_round`` on its test rows; the strategy sends the global arrays, averages the
replies weighted by ``num-examples`` (train) and the metrics (evaluate) -- no encryption, no
reply signatures, no statistics round. The feature scaling is the pooled mean/std,
computed here once in the clear and sent in the train/evaluate config (sealfl computes it
under encryption in its statistics round, which is not in its round times either).

Round time: Flower calls ``evaluate_fn`` before round 1 and after every round (its
``Strategy.start``); the differences of those instants are the rounds (train + evaluate),
as sealfl's ``round_seconds`` span its train and evaluate phases. Client resources: 1 CPU per
ClientApp actor, as sealfl's default (:func:`sealfl.platform.simulate.actor_options`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

TASK = os.environ.get("SEALFL_BENCH_TASK", "heart")
_data: dict = {}


def _partner_data(task, pid: int):
    partner = task.partners[pid]
    if partner not in _data:
        _data[partner] = task.load_data(partner, task.train_defaults())
    return _data[partner]


def make_client_app():
    """A ClientApp that trains and evaluates the task's model on partition ``partition-id``."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from sealfl.clients.plugins import get_task

    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        task = get_task(TASK)
        pid = int(context.node_config["partition-id"])
        data = _partner_data(task, pid)
        cfg = msg.content["config"]
        params = msg.content["arrays"].to_numpy_ndarrays()[0]
        mean, std = np.asarray(cfg["mean"]), np.asarray(cfg["std"])
        new, metrics = task.train_round(params, data, mean, std, task.train_defaults(),
                                        1000 * int(cfg["server-round"]) + pid)
        return Message(RecordDict({"arrays": ArrayRecord([np.asarray(new, np.float64)]),
                                   "metrics": MetricRecord({"num-examples": task.n_train(data),
                                                            "train-loss": float(metrics.get("loss", 0.0))})}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context) -> Message:
        task = get_task(TASK)
        data = _partner_data(task, int(context.node_config["partition-id"]))
        cfg = msg.content["config"]
        params = msg.content["arrays"].to_numpy_ndarrays()[0]
        m = task.evaluate_round(params, data, np.asarray(cfg["mean"]), np.asarray(cfg["std"]))
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": int(m["n"]),
                                                            "accuracy": float(m["accuracy"])})}), reply_to=msg)

    return app


def make_server_app(rounds: int, marks: list[float]):
    """A ServerApp running stock FedAvg over every node; ``marks`` receives the instants of
    Flower's ``evaluate_fn`` calls (before round 1, after each round)."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    from sealfl.clients.plugins import get_task

    task = get_task(TASK)
    # not through _partner_data: the ClientApp's functions live in __main__, so Ray pickles them
    # by value with every message, and with them the globals they use -- a _data filled here with
    # every partner's rows went along with each message (261 KB and ~0.2 s per message at 1,024)
    rows = np.concatenate([task.load_data(p, task.train_defaults()).x_train for p in task.partners])
    mean, std = rows.mean(0), rows.std(0) + 1e-8
    n = len(task.partners)
    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n, min_evaluate_nodes=n,
                          min_available_nodes=n)
        cfg = ConfigRecord({"mean": [float(v) for v in mean], "std": [float(v) for v in std]})
        strategy.start(grid=grid, initial_arrays=ArrayRecord([np.asarray(task.init_params(), np.float64)]),
                       num_rounds=rounds, train_config=cfg, evaluate_config=cfg,
                       evaluate_fn=lambda rnd, arrays: marks.append(time.perf_counter()))

    return app


def main(argv: list[str]) -> int:
    global TASK
    TASK, rounds, out = argv[0], int(argv[1]), Path(argv[2])
    os.environ["SEALFL_BENCH_TASK"] = TASK  # the ClientApp actors read it
    import ray

    from sealfl.clients.plugins import get_task
    from sealfl.common.procs import memory_status, reset_peak_rss
    from sealfl.platform.simulate import run_flower

    n = len(get_task(TASK).partners)
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             _temp_dir=str(out.resolve().parent / f"ray-{os.getpid()}"))
    marks: list[float] = []
    server_app, client_app = make_server_app(rounds, marks), make_client_app()
    reset = reset_peak_rss()  # from here: the Flower run itself, as sealfl's worker measures it
    start = memory_status().get("VmRSS")
    t0 = time.perf_counter()
    failure = run_flower(server_app, client_app, n)
    wall = time.perf_counter() - t0
    if failure is not None:
        raise SystemExit(f"Flower FedAvg run failed: {failure!r}")
    out.write_text(json.dumps({
        "task": TASK, "partners": n, "rounds": rounds, "strategy": "flwr.serverapp.strategy.FedAvg",
        "round_seconds": [b - a for a, b in zip(marks, marks[1:])], "wall_seconds": wall,
        "run_rss": {"start_bytes": start, "peak_bytes": memory_status().get("VmHWM"),
                    "method": "VmHWM after clear_refs 5 at the run's start" if reset else "VmHWM (lifetime)"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
