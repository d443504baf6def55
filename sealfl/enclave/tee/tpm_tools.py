"""Running tpm2-tools commands for :mod:`sealfl.enclave.tee.tpm`: TCTI choice, timeouts, errors
that say what the TPM's response code means (:mod:`sealfl.enclave.tee.tpm_rc`), retries of
transient failures, and flushing of what *we* loaded.

**Flushing what is ours.** Without a resource manager (a direct ``/dev/tpm0`` or an swtpm
socket) every client sees every transient object and session, and tpm2-tools leaves the
objects it loads from context files behind; a TPM holds only a few (swtpm: 3), so they must
be flushed. ``tpm2_flushcontext -t`` would flush *everyone's*, breaking other software that
shares the TPM. So each compound operation that leaves objects behind runs in
:meth:`Tools.scope`, which lists the loaded transient objects (and, where it opens policy
sessions, the sessions) at its start (``tpm2_getcap handles-transient``,
``handles-loaded-session``); :meth:`Tools.flush` flushes, by handle, only those that appeared
since -- or, when nothing was loaded at the start (the usual case), all with one
``tpm2_flushcontext -t``. (Without a resource manager another client that loads an object
during the same scope is indistinguishable from us: run ``/dev/tpmrm0`` or ``tpm2-abrmd``
when the TPM is shared.)

**Retries.** A response code of kind ``resources`` (``TPM_RC_OBJECT_MEMORY`` 0x902, session
memory, ...) is retried after flushing ours (:data:`RESOURCE_PAUSES_S`: if other software
still fills the TPM, waiting longer rarely helps); ``busy`` (``TPM_RC_RETRY``, ``TESTING``,
``NV_RATE``, ...) after growing pauses (:data:`BUSY_PAUSES_S`). Both are TPM *warnings*: the
command was not executed (Part 2 §6.6.3), so running it again is safe. What still fails is a
:class:`~sealfl.enclave.errors.TPMError` naming the command, the TPM, the code and the advice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator

from sealfl.common.errors import plain_text
from sealfl.enclave.errors import TEEError, TPMError
from sealfl.enclave.tee.tpm_rc import TpmRc, from_stderr

__all__ = ["TCTI_ENV", "DEFAULT_TCTI", "RESOURCE_PAUSES_S", "BUSY_PAUSES_S", "Tools", "tcti_of", "parse_pcr_banks", "parse_handles"]

log = logging.getLogger(__name__)

#: Environment variable naming the TCTI (tpm2-tools' ``TPM2TOOLS_TCTI`` syntax).
TCTI_ENV = "SEALFL_TPM_TCTI"
DEFAULT_TCTI = "device:/dev/tpmrm0"
_TIMEOUT_S = 60
#: pauses before the retries of a ``resources`` failure (after flushing ours), seconds
RESOURCE_PAUSES_S = (0.05, 0.25)
#: pauses before the retries of a ``busy`` failure (self-test, NV rate limit), seconds
BUSY_PAUSES_S = (0.1, 0.5, 1.0, 2.0)
_HANDLE = re.compile(r"^\s*-\s*(0x[0-9a-fA-F]+)\s*$", re.M)


def tcti_of(recorded: str | None) -> str:
    """The TCTI: :data:`TCTI_ENV` if set, else ``recorded`` (from ``tee.json``), else :data:`DEFAULT_TCTI`."""
    return os.environ.get(TCTI_ENV) or recorded or DEFAULT_TCTI


def parse_pcr_banks(getcap_output: str) -> dict[str, list[int]]:
    """Parse ``tpm2_getcap pcrs`` (YAML lines ``  - sha256: [ 0, 1, ... ]``) to
    ``{bank: [allocated PCR indices]}`` (an unallocated bank maps to ``[]``). Pure."""
    banks = {}
    for m in re.finditer(r"-\s*(\w+)\s*:\s*\[([^\]]*)\]", getcap_output):
        banks[m.group(1)] = [int(x) for x in m.group(2).replace(",", " ").split()]
    return banks


def parse_handles(getcap_output: str) -> list[int]:
    """Parse ``tpm2_getcap handles-*`` (YAML lines ``- 0x81010010``) to handles. Pure."""
    return [int(h, 16) for h in _HANDLE.findall(getcap_output)]


def _tail(stderr: bytes) -> str:
    lines = plain_text(stderr.decode("utf-8", "replace"), 1 << 16).split(" | ")
    useful = [ln for ln in lines if ln.startswith("ERROR: ")] or lines
    return " | ".join(useful[-2:])[:400]


class Tools:
    """Runs tpm2-tools commands against one TCTI (module docstring).

    Raises:
        TEEError: tpm2-tools is not installed.
    """

    def __init__(self, tcti: str) -> None:
        if shutil.which("tpm2_pcrread") is None:
            raise TEEError("tpm2-tools is not installed (tpm2_pcrread not on PATH); run scripts/install-tpm.sh "
                           "or apt-get install tpm2-tools")
        self.tcti = tcti
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TPM2TOOLS_TCTI": tcti}
        self._baseline: set[int] | None = None
        self._sessions: set[int] | None = None

    def _once(self, args: tuple[str, ...]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(list(args), env=self.env, capture_output=True, timeout=_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TPMError(f"{args[0]} did not answer within {_TIMEOUT_S} s on TPM {self.tcti}; check that the TPM "
                           "(or swtpm) is responsive", command=args[0]) from exc

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run one command; retry transient failures (module docstring).

        Returns:
            the finished process (``returncode`` may be non-zero only with ``check=False``;
            its ``rc`` attribute is the decoded response code or None).

        Raises:
            TPMError: (``check``) the command failed; the message names the command, the
                TPM, the response code, what it means and what to do.
        """
        pauses = {"resources": list(RESOURCE_PAUSES_S), "busy": list(BUSY_PAUSES_S)}
        while True:
            proc = self._once(args)
            proc.rc = None if proc.returncode == 0 else from_stderr(proc.stderr.decode("utf-8", "replace"))
            if proc.returncode == 0 or proc.rc is None or not pauses.get(proc.rc.kind):
                break
            log.info("%s on TPM %s: %s (%s); retrying", args[0], self.tcti, proc.rc.meaning, proc.rc.label())
            if proc.rc.kind == "resources":
                self.flush()
            time.sleep(pauses[proc.rc.kind].pop(0))
        if check and proc.returncode != 0:
            raise self.error(args[0], proc)
        return proc

    def error(self, command: str, proc: subprocess.CompletedProcess, what: str = "") -> TPMError:
        """The :class:`TPMError` for a failed ``proc`` (``what``: the operation, for the message)."""
        rc: TpmRc | None = getattr(proc, "rc", None)
        doing = f"{what} ({command})" if what else command
        if rc is None:
            return TPMError(f"{doing} failed (rc {proc.returncode}) on TPM {self.tcti}: {_tail(proc.stderr)}",
                            command=command)
        return TPMError(f"{doing} failed on TPM {self.tcti}: {rc.meaning} ({rc.label()}); {rc.advice}",
                        command=command, rc=rc)

    # -- handles ----------------------------------------------------------------------

    def handles(self, kind: str) -> list[int]:
        """The handles ``tpm2_getcap handles-<kind>`` lists (``transient``, ``persistent``,
        ``nv-index``, ``loaded-session``).

        Raises:
            TPMError: the TPM did not answer.
        """
        proc = self._once(("tpm2_getcap", f"handles-{kind}"))
        if proc.returncode != 0:
            proc.rc = from_stderr(proc.stderr.decode("utf-8", "replace"))
            raise self.error("tpm2_getcap", proc, f"listing the TPM's {kind} handles")
        return parse_handles(proc.stdout.decode("ascii", "replace"))

    @contextlib.contextmanager
    def scope(self, sessions: bool = False) -> Iterator["Tools"]:
        """A compound operation that leaves objects loaded (``sessions``: and policy
        sessions): what it loads is flushed by :meth:`flush` and on leaving; what was loaded
        before (other clients' objects) is never flushed. Nested scopes share the outermost
        baseline."""
        if self._baseline is not None:
            yield self
            return
        self._baseline = set(self.handles("transient"))
        self._sessions = set(self.handles("loaded-session")) if sessions else None
        try:
            yield self
        finally:
            try:
                self.flush()
            finally:
                self._baseline = self._sessions = None

    def flush(self) -> None:
        """Flush the transient objects (and, if the scope tracks them, sessions) loaded since
        the current :meth:`scope` began; outside a scope, nothing. When nothing else was
        loaded at the start, one ``tpm2_flushcontext -t`` / ``-s`` does it; else each new
        handle is flushed by number. Never raises: a failed flush is logged."""
        for baseline, kind, flag in ((self._baseline, "transient", "-t"), (self._sessions, "loaded-session", "-s")):
            if baseline is None:
                continue
            if not baseline:
                self._once(("tpm2_flushcontext", flag))
                continue
            try:
                ours = sorted(set(self.handles(kind)) - baseline)
            except TEEError as exc:
                log.warning("cannot list the TPM's loaded %s handles to flush ours: %s", kind, exc)
                continue
            for handle in ours:
                proc = self._once(("tpm2_flushcontext", f"{handle:#x}"))
                if proc.returncode != 0:
                    log.warning("cannot flush handle %#x on TPM %s: %s", handle, self.tcti, _tail(proc.stderr))
