"""The TEE backends by name: ``sim`` (:mod:`.sim`, an insecure simulation) and ``tpm``
(:mod:`.tpm`, TPM 2.0).

:func:`backend_class` imports a backend lazily by a plain ``import`` statement, so the
measured code of a device or the release enclave -- derived from its imports -- covers every
backend it can load; adding a backend means a new module and one branch here, not a change
to :class:`~sealfl.enclave.tee.interface.TEE`.
"""

from __future__ import annotations

import os

from sealfl.enclave.errors import TEEError
from sealfl.enclave.tee.interface import TEE

__all__ = ["BACKENDS", "backend_class", "create_tee", "load_tee"]

#: the backends :func:`backend_class` knows.
BACKENDS: tuple[str, ...] = ("sim", "tpm")


def backend_class(backend: str) -> type[TEE]:
    """Return the :class:`TEE` subclass for ``backend``.

    Raises:
        TEEError: unknown backend.
    """
    if backend == "sim":
        from sealfl.enclave.tee import sim as module
    elif backend == "tpm":
        from sealfl.enclave.tee import tpm as module
    else:
        raise TEEError(f"unknown TEE backend {backend!r:.40}; choose one of {list(BACKENDS)}")
    return module.TEE_CLASS


def create_tee(backend: str, state_dir: str | os.PathLike, *, role: str = "device", replace: bool = False) -> TEE:
    """Provision a fresh TEE of ``backend`` in ``state_dir`` for ``role`` (see :meth:`TEE.create`)."""
    return backend_class(backend).create(state_dir, role=role, replace=replace)


def load_tee(backend: str, state_dir: str | os.PathLike, *, reset_pcrs: bool = True) -> TEE:
    """Open the TEE of ``backend`` in ``state_dir`` (see :meth:`TEE.load`)."""
    return backend_class(backend).load(state_dir, reset_pcrs=reset_pcrs)
