"""Running tpm2-tools commands for :mod:`sealfl.enclave.tee.tpm`: TCTI choice, timeouts, errors
that name the command and the TPM, and flushing of transient objects and sessions (without a
resource manager a TPM runs out of object slots, ``0x902``)."""

from __future__ import annotations

import os
import shutil
import subprocess

from sealfl.enclave.errors import TEEError

__all__ = ["TCTI_ENV", "DEFAULT_TCTI", "Tools", "tcti_of"]

#: Environment variable naming the TCTI (tpm2-tools' ``TPM2TOOLS_TCTI`` syntax).
TCTI_ENV = "SEALFL_TPM_TCTI"
DEFAULT_TCTI = "device:/dev/tpmrm0"
_TIMEOUT_S = 60


def tcti_of(recorded: str | None) -> str:
    """The TCTI: :data:`TCTI_ENV` if set, else ``recorded`` (from ``tee.json``), else :data:`DEFAULT_TCTI`."""
    return os.environ.get(TCTI_ENV) or recorded or DEFAULT_TCTI


class Tools:
    """Runs tpm2-tools commands against one TCTI (``run``: with a timeout, raising
    :class:`TEEError` with the stderr tail; ``flush``: transient objects and sessions).

    Raises:
        TEEError: tpm2-tools is not installed.
    """

    def __init__(self, tcti: str) -> None:
        if shutil.which("tpm2_pcrread") is None:
            raise TEEError("tpm2-tools is not installed (tpm2_pcrread not on PATH); run scripts/install-tpm.sh "
                           "or apt-get install tpm2-tools")
        self.tcti = tcti
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TPM2TOOLS_TCTI": tcti}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run(list(args), env=self.env, capture_output=True, timeout=_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TEEError(f"{args[0]} did not answer within {_TIMEOUT_S} s on TPM {self.tcti}") from exc
        if check and proc.returncode != 0:
            tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise TEEError(f"{args[0]} failed (rc {proc.returncode}) on TPM {self.tcti}: {' | '.join(tail)}")
        return proc

    def flush(self) -> None:
        for kind in ("-t", "-s"):
            self.run("tpm2_flushcontext", kind, check=False)
