"""Test-only pause points: make "interrupt at stage X" deterministic.

A long command passes named stages (below). When the environment variable
``SEALFL_PAUSE_AT`` names a stage, the first process to reach it writes the event file
``$SEALFL_PAUSE_DIR/<stage>.reached`` (JSON ``{"stage", "round", "pid"}``, published
complete with ``link(2)``, so exactly one process writes it) and then blocks until it is
killed. A test waits for that file (never for a time), sends its signal, and checks the
outcome. With the variable unset -- always, outside tests -- :func:`testpoint` returns
at once.

``SEALFL_PAUSE_AT`` is ``<stage>`` or ``<stage>@<round>`` (pause only in that training
round). With ``SEALFL_PAUSE_FOR=<seconds>`` the pause is a delay instead: every arrival
waits that long and goes on (a partner made late on purpose). The environment reaches every process of a run: the CLI, the campaign worker,
Ray's raylet and the Ray workers that run the partners' handlers.

Stages (where they sit):

============== ==================================================================
before-ray     campaign / evaluation worker, before Ray starts or is attached
train          a partner's train handler (a Ray worker process), before training
aggregate      the aggregator's ``aggregate_train``, before ciphertexts are added
checkpoint     writing the round's checkpoint: temp file written, not yet renamed
gate-query     a partner's handler of the release gate's query round (Ray worker)
slot-written   device update: new slot's files written and fsynced, not yet renamed
slot-renamed   device update: slot renamed into place, ``state.json`` not yet replaced
state-written  device update: ``state.json`` replaced, old slots not yet removed
slots-pruned   device update: old slots removed, the TEE floor not yet raised
serve-boot     ``device serve``, HTTP up, before the release is verified and loaded
serve-stream   ``device serve``, a request's first streamed piece was queued; the
               generation waits until that request is cancelled (client gone)
============== ==================================================================

The idea is the failpoint of etcd's ``gofail`` / TiKV's ``fail-rs``, reduced to "pause".
"""

from __future__ import annotations

import json
import logging
import os
import threading

from sealfl.common.errors import SealflError

log = logging.getLogger(__name__)

ENV_STAGE = "SEALFL_PAUSE_AT"
ENV_DIR = "SEALFL_PAUSE_DIR"
ENV_FOR = "SEALFL_PAUSE_FOR"
STAGES = ("before-ray", "train", "aggregate", "checkpoint", "gate-query", "slot-written", "slot-renamed",
          "state-written", "slots-pruned", "serve-boot", "serve-stream")

__all__ = ["ENV_STAGE", "ENV_DIR", "ENV_FOR", "STAGES", "parse_spec", "check_environment", "testpoint", "event_path"]


class TestpointError(SealflError):
    """``SEALFL_PAUSE_AT`` / ``SEALFL_PAUSE_DIR`` are set wrongly (a test harness bug)."""

    __test__ = False  # not a pytest test class


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``"train@2"`` -> ``("train", 2)``; ``"before-ray"`` -> ``("before-ray", None)``.

    Raises:
        TestpointError: unknown stage or a round that is not a positive integer.
    """
    stage, sep, rnd = spec.strip().partition("@")
    if stage not in STAGES:
        raise TestpointError(f"{ENV_STAGE}={spec!r}: unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    if not sep:
        return stage, None
    if not rnd.isdigit() or int(rnd) < 1:
        raise TestpointError(f"{ENV_STAGE}={spec!r}: the round after '@' must be a positive integer")
    return stage, int(rnd)


def check_environment(environ: dict | None = None) -> tuple[str, int | None] | None:
    """Validate the pause-point variables (call once at start-up so a typo fails loudly
    instead of never pausing). Returns the parsed spec, or None when unset.

    Raises:
        TestpointError: bad stage, or ``SEALFL_PAUSE_DIR`` unset / not a directory.
    """
    env = os.environ if environ is None else environ
    spec = env.get(ENV_STAGE)
    if not spec:
        return None
    parsed = parse_spec(spec)
    delay = env.get(ENV_FOR)
    if delay is not None and not _is_delay(delay):
        raise TestpointError(f"{ENV_FOR}={delay!r}: expected a number of seconds in (0, 86400]")
    d = env.get(ENV_DIR)
    if not d or not os.path.isdir(d):
        raise TestpointError(f"{ENV_STAGE} is set but {ENV_DIR}={d!r} is not an existing directory")
    return parsed


def _is_delay(text: str) -> bool:
    try:
        return 0 < float(text) <= 86400
    except ValueError:
        return False


def event_path(stage: str, directory: str | os.PathLike | None = None) -> str:
    """The event file a process writes when it pauses at ``stage``."""
    return os.path.join(os.fspath(directory if directory is not None else os.environ[ENV_DIR]), f"{stage}.reached")


def testpoint(stage: str, round: int | None = None,  # noqa: A002 - "round" is the domain word
              until: threading.Event | None = None) -> None:
    """Pause here if the environment asks for ``stage`` (and ``round``); else return.

    Pausing writes the event file (first process only) and blocks this thread forever;
    the test's signal to the supervisor ends the process tree. With ``until``, only the
    first arrival pauses (later ones find the event file and pass), and only until
    ``until`` is set. With ``SEALFL_PAUSE_FOR`` every arrival waits that many seconds.
    """
    spec = os.environ.get(ENV_STAGE)
    if not spec:
        return
    want, want_round = parse_spec(spec)
    if want != stage or (want_round is not None and want_round != round):
        return
    path = event_path(stage)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as fh:  # complete before it becomes visible under its name
        fh.write(json.dumps({"stage": stage, "round": round, "pid": os.getpid()}))
    delay = os.environ.get(ENV_FOR)
    try:
        os.link(tmp, path)  # exactly one process publishes the event
    except FileExistsError:
        if until is not None and delay is None:
            return  # paused once already
        # another partner got here first; pause as well
    finally:
        os.unlink(tmp)
    if delay is not None and _is_delay(delay):
        log.warning("test pause point %r reached (round %s, pid %d): waiting %s s", stage, round, os.getpid(), delay)
        (until or threading.Event()).wait(float(delay))
        return
    log.warning("test pause point %r reached (round %s, pid %d): blocking until %s", stage, round, os.getpid(),
                "released" if until is not None else "killed")
    (until or threading.Event()).wait()
