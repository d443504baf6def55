"""A real multi-node Ray cluster on this host, for tests and the benchmark.

Ray 2.55's ``ray start --address`` cannot join a second node on loopback (NOTES.md "Ray
clusters"); Ray's own multi-node harness, :class:`ray.cluster_utils.Cluster`, can: each
``add_node`` starts a real raylet (own object store, own workers) joined to one GCS. With
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` every node binds 127.0.0.1, and with
``RAY_AUTH_MODE=token`` + ``RAY_AUTH_TOKEN`` (set in this process's environment before the
first node starts: the nodes inherit it) every Ray gRPC call needs the token.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterator

_TOKEN = secrets.token_hex(32)
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")


@contextlib.contextmanager
def token_cluster(nodes: int = 2, cpus_per_node: int = 2) -> Iterator:
    """Start a ``nodes``-node token-protected loopback cluster; yield the
    :class:`ray.cluster_utils.Cluster` (``.address`` is the GCS ``127.0.0.1:port``). The
    token is only in this process's environment while the cluster lives; on exit the
    cluster's processes are stopped (``Cluster.shutdown``) and the environment restored."""
    saved = {k: os.environ.get(k) for k in AUTH_ENV}
    # one token per process: Ray reads the token once and keeps it for later clusters
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": _TOKEN,
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    for k in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        os.environ.pop(k, None)
    cluster = None
    try:
        cluster = _start(nodes, cpus_per_node)
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: start-up attempts: Ray 2.55 gives a raylet a fixed 30 s to register with the GCS
#: (``ray/_private/node.py``, not configurable), which a heavily loaded host can miss
START_ATTEMPTS = 5


def _start(nodes: int, cpus_per_node: int):
    """The cluster, started anew (its processes stopped first) when a node missed Ray's
    start-up deadline; the last attempt's error is raised."""
    import psutil
    from ray.cluster_utils import Cluster

    me = psutil.Process()
    for attempt in range(1, START_ATTEMPTS + 1):
        cluster, before = None, {c.pid for c in me.children(recursive=True)}
        try:
            cluster = Cluster(initialize_head=True,
                              head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False})
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=cpus_per_node)
            cluster.wait_for_nodes()
            return cluster
        except Exception as exc:  # Ray raises a bare Exception for the missed deadline
            if cluster is not None:
                cluster.shutdown()
            # a node that missed the deadline inside Cluster() is not in ``cluster``: stop
            # the processes this attempt started (children of this process) by their pids
            left = [c for c in me.children(recursive=True) if c.pid not in before]
            for c in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    c.kill()
            psutil.wait_procs(left, timeout=10)
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")
