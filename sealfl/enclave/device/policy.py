"""The device's one "boot, else keep the last good release" decision, and its exit codes.

Every command that starts a release -- ``device boot``, ``device generate``, ``device
serve`` -- goes through :func:`boot_or_last_good`:

1. the state directory must lie apart from the release and the trust directories (a
   release or trust directory inside the device's state would let the thing being checked
   rewrite the checker's record; :func:`check_state_apart`);
2. :func:`~sealfl.enclave.device.boot.boot` the new release;
3. refused with reason ``tee-state`` (the TEE state is missing -- a device not provisioned,
   or one with history -- or belongs to another key): stop -- (re-)provisioning is an
   operator's decision, never a fallback; refused with reason ``tee`` (the TEE cannot be
   opened or measured: the TPM's answer and what to do are in the message): stop -- the last
   good release would need the same TEE;
4. refused otherwise: :func:`~sealfl.enclave.device.boot.boot_last_good` from the device's
   own slot, verified from scratch; if that fails too, :class:`NothingRuns`.

Exit codes the CLI maps outcomes to (README "Devices"):

====  ===================================================================================
0     the new release runs
1     a command error before anything was booted (bad option, unreadable file)
2     nothing runs: the release was refused and no last good release could be booted, or
      the TEE cannot be used (what the TPM reported and what to do is in the message)
3     the new release was refused; the last good release runs
4     the TEE state is missing or of another key: provision / re-provision on purpose
5     ``device boot --input``: the release runs (and is recorded), but the input rows do
      not fit it (the message names row and column); nothing was scored
====  ===================================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sealfl.common.errors import SealflError
from sealfl.enclave.device.at_rest import KeySource
from sealfl.enclave.device.boot import BootedDevice, boot, boot_last_good
from sealfl.enclave.device.provision import EXIT_TEE_STATE
from sealfl.enclave.errors import BootError

__all__ = ["EXIT_BOOTED", "EXIT_FAILED", "EXIT_NOTHING_RUNS", "EXIT_KEPT_LAST_GOOD", "EXIT_TEE_STATE",
           "EXIT_INPUT_REFUSED", "STOP_REASONS", "NothingRuns", "BootOutcome", "check_state_apart",
           "boot_or_last_good", "exit_code_of"]

EXIT_BOOTED = 0
EXIT_FAILED = 1
EXIT_NOTHING_RUNS = 2
EXIT_KEPT_LAST_GOOD = 3
EXIT_INPUT_REFUSED = 5
#: refusal reasons after which the last good release is not tried (step 3)
STOP_REASONS = frozenset({"tee-state", "tee"})


class NothingRuns(BootError):
    """The new release was refused and no last good release could be booted.

    Attributes:
        refused: the new release's refusal.
        fallback: why the last good release did not boot.
    """

    def __init__(self, refused: BootError, fallback: BaseException) -> None:
        super().__init__(f"{refused}; no last good release to fall back to: {fallback}", reason=refused.reason,
                         file=refused.file, check=refused.check)
        self.refused = refused
        self.fallback = fallback


@dataclass
class BootOutcome:
    """What runs after :func:`boot_or_last_good`.

    Attributes:
        device: the running release (close it when done).
        refused: the new release's refusal when the last good release was kept, else None.
    """

    device: BootedDevice
    refused: BootError | None = None

    @property
    def kept_last_good(self) -> bool:
        """True when the new release was refused and the last good one runs."""
        return self.refused is not None

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_KEPT_LAST_GOOD` or :data:`EXIT_BOOTED`."""
        return EXIT_KEPT_LAST_GOOD if self.refused is not None else EXIT_BOOTED


def exit_code_of(exc: BootError) -> int:
    """The exit code of a boot that ended in ``exc`` (table above): 4 for ``tee-state``; 2 for
    :class:`NothingRuns` and for ``tee`` (the TEE cannot be used); 1 for a refusal before
    anything was tried (e.g. the state directory overlaps the release)."""
    if exc.reason == "tee-state":
        return EXIT_TEE_STATE
    if isinstance(exc, NothingRuns) or exc.reason == "tee":
        return EXIT_NOTHING_RUNS
    return EXIT_FAILED


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_state_apart(state_dir: str | os.PathLike, **others: str | os.PathLike | None) -> None:
    """Refuse a state directory that is, contains or lies inside one of ``others``.

    Args:
        state_dir: the device state directory.
        others: named directories (``release=...``, ``trust=...``); None values are skipped.

    Raises:
        BootError: reason ``"state"``, naming both directories.
    """
    state = Path(state_dir).resolve()
    for what, other in others.items():
        if other is None:
            continue
        other_path = Path(other).resolve()
        if _overlap(state, other_path):
            label = what.replace("_", " ")
            raise BootError(f"the state directory {state_dir} overlaps the {label} directory {other}; keep device "
                            "state apart", reason="state")


def boot_or_last_good(trust_dir: str | os.PathLike, release_dir: str | os.PathLike | None,
                      state_dir: str | os.PathLike,
                      *, backend: str | None = None, key_source: KeySource | None = None,
                      variant: str | None = None, runtime_options: Mapping[str, Any] | None = None,
                      require_llm: bool = False,
                      on_refused: Callable[[BootError], None] | None = None) -> BootOutcome:
    """Boot ``release_dir``, else the last good release (module docstring).

    Args:
        trust_dir, release_dir, state_dir: as for :func:`~sealfl.enclave.device.boot.boot`.
        backend: the TEE backend the caller asked for (``--tee``), or None for the
            provisioned one (:func:`~sealfl.enclave.device.boot.boot`).
        key_source: key source for a release encrypted at rest (both attempts).
        variant: causal-LM model variant (both attempts).
        runtime_options: :class:`~sealfl.enclave.sandbox.runtime.SandboxedRuntime` options.
        require_llm: only causal language models may run (``device serve``/``generate``).
        release_dir: the new release, or None to boot the last good one (no fallback then).
        on_refused: called with the new release's refusal before the fallback is tried.

    Returns:
        a :class:`BootOutcome`.

    Raises:
        BootError: reason ``"state"`` (directories overlap), ``"tee-state"`` ((re-)provision
            on purpose) or ``"tee"`` (the TEE cannot be used) -- nothing was tried after
            them; :class:`NothingRuns` when neither boots.
    """
    check_state_apart(state_dir, release=release_dir, trust_anchors=trust_dir)
    common = {"backend": backend, "key_source": key_source, "variant": variant, "runtime_options": runtime_options,
              "require_llm": require_llm}
    if release_dir is None:  # no new release offered: the last good one (e.g. installed by 'device update')
        if not (Path(state_dir) / "state.json").exists() and not (Path(state_dir) / "slots").is_dir():
            raise BootError(f"no release was given and the device state {state_dir} holds no release yet; give "
                            "--release DIR or install one with 'sealfl device update'", reason="state")
        return BootOutcome(boot_last_good(trust_dir, state_dir, **common))
    try:
        return BootOutcome(boot(trust_dir, release_dir, state_dir, **common))
    except BootError as exc:
        if exc.reason in STOP_REASONS:
            raise
        refused = exc
    if on_refused is not None:
        on_refused(refused)
    try:
        device = boot_last_good(trust_dir, state_dir, **common)
    except (SealflError, OSError) as exc:
        raise NothingRuns(refused, exc) from refused
    return BootOutcome(device, refused)
