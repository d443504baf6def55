"""The coordinator's own Control API client: the run-status look of a deployed campaign,
in this process.

Why: ``flwr ls --run-id N`` is a whole Python process (import Flower, read FLWR_HOME,
open TLS, one request): ~1 CPU-second each. Polled every 3 s through a LoRA campaign,
those processes took ~38 of the 210 CPU-seconds of a 105-s round on a 2-core coordinator
that also hosts partners -- as much as a partner's own training (``bench/deploy_bench.py``,
measured with every process's /proc CPU time; the SuperLink took 8.4). Here the same
client ``flwr ls`` builds (Flower's ``init_http_client_from_connection`` over the
connection in ``$FLWR_HOME/config.toml``: TLS against the consortium CA, Flower's
version and account-auth interceptors) is made once per campaign and asked
``ListRuns(run_id)`` per look: one HTTPS request.

The answer is read as ``flwr ls`` reads it (status and sub-status joined by ``:``, e.g.
``finished:completed``; the details text), so :func:`run_status` matches
:func:`sealfl.platform.deployed.run_state` over ``flwr ls --format json``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from pathlib import Path

from sealfl.common.errors import plain_text
from sealfl.platform.errors import DeploymentError

log = logging.getLogger(__name__)

__all__ = ["RunWatcher", "status_text"]

#: FLWR_HOME is read from the environment by Flower's CLI helpers: one client built at a time
_ENV_LOCK = threading.Lock()


def status_text(status: str, sub_status: str) -> str:
    """``flwr ls``'s status column: ``status`` alone, or ``status:sub_status``. Pure."""
    return f"{status}:{sub_status}" if sub_status else status


class RunWatcher:
    """One Control API client to the SuperLink of ``$FLWR_HOME/config.toml``'s connection
    ``connection`` (written by :func:`sealfl.platform.flwr_cli.write_flwr_home`), kept for
    a campaign's looks. Close it (or use it as a context manager).

    Raises:
        DeploymentError: the connection cannot be read or the client cannot be made (the
            message is Flower's).
    """

    def __init__(self, flwr_home: Path, connection: str) -> None:
        from flwr.cli.flower_config import read_superlink_connection
        from flwr.cli.utils import init_http_client_from_connection

        with _ENV_LOCK:
            before = os.environ.get("FLWR_HOME")
            os.environ["FLWR_HOME"] = str(flwr_home)
            said = io.StringIO()
            try:
                # Flower's helper prints "Using SuperLink: ..." to stdout, into the middle of our CLI's output
                with contextlib.redirect_stdout(said):
                    self._client = init_http_client_from_connection(read_superlink_connection(connection))
            except Exception as exc:  # click.ClickException, ValueError, OSError: Flower's own text
                raise DeploymentError(f"cannot make a Control API client for connection {connection!r} of "
                                      f"{flwr_home}: {plain_text(str(exc))}") from exc
            finally:
                if said.getvalue().strip():
                    log.debug("flwr: %s", said.getvalue().strip())
                if before is None:
                    os.environ.pop("FLWR_HOME", None)
                else:
                    os.environ["FLWR_HOME"] = before

    def run_status(self, run_id: int) -> tuple[str, str]:
        """(status, details) of run ``run_id`` as ``flwr ls`` shows them, e.g.
        ``("running", "")`` or ``("finished:failed", "ServerApp raised ...")``.

        Raises:
            DeploymentError: the request failed (unreachable, TLS, refused) or the SuperLink
                does not list the run.
        """
        from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=no-name-in-module

        try:
            res = self._client.ListRuns(ListRunsRequest(run_id=int(run_id)))
        except Exception as exc:  # transport and RPC errors of Flower's HTTP client
            raise DeploymentError(f"no answer about run {run_id}: {plain_text(str(exc))}") from exc
        run = res.run_dict.get(int(run_id)) if res is not None else None
        if run is None:
            raise DeploymentError(f"the SuperLink does not list run {run_id}")
        return status_text(run.status.status, run.status.sub_status), run.status.details or ""

    def close(self) -> None:
        """Close the client's connections (idempotent)."""
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing never fails a campaign
                log.debug("closing the Control API client failed", exc_info=True)

    def __enter__(self) -> "RunWatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
