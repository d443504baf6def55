"""The release enclave as CKKS key holder: unseal the campaign's secret context and
decrypt the encrypted global model.

The CKKS secret context is stored in the release enclave only sealed by the TEE
(``seal_secret("ckks-secret-context", ...)``), so it unseals only while the enclave
runs the measured code. TenSEAL is imported lazily: devices never load this module.
"""

from __future__ import annotations

import numpy as np

from .errors import EnclaveError
from .release_enclave import ReleaseEnclave

CKKS_SECRET = "ckks-secret-context"


class KeyHolder:
    """Decrypts aggregates for the coordinator's release pipeline.

    Args:
        enclave: an opened :class:`ReleaseEnclave` (its measurement already extended).
        ckks_params: :class:`sealfl.common.he.CKKSParams` of the campaign.
        context_id: 32-byte id of the campaign's CKKS context.
    Raises:
        EnclaveError: the enclave holds no CKKS secret (it was never provisioned).
        UnsealError: the enclave's measurement changed since the secret was sealed.
    """

    def __init__(self, enclave: ReleaseEnclave, ckks_params, context_id: bytes):
        from sealfl.common.he import CKKSCodec

        if CKKS_SECRET not in enclave.list_secrets():
            raise EnclaveError("the release enclave holds no CKKS secret context; provision it with the consortium")
        self._codec = CKKSCodec.from_bytes(enclave.unseal_secret(CKKS_SECRET), ckks_params, context_id)

    @staticmethod
    def provision(enclave: ReleaseEnclave, secret_context: bytes) -> None:
        """Seal the CKKS secret context (bytes) into ``enclave``."""
        enclave.seal_secret(CKKS_SECRET, secret_context)

    def decrypt(self, blob: bytes, length: int | None = None) -> np.ndarray:
        """Decrypt a framed ciphertext into float64 (length,)."""
        return self._codec.decrypt(blob, length)

    def decrypt_average(self, blob: bytes, total_weight: float, length: int) -> np.ndarray:
        """Weighted FedAvg's last step: ``decrypt(E(Σ n_i w_i)) / Σ n_i`` -> float64 (length,).

        Raises ValueError if ``total_weight`` is not positive.
        """
        if total_weight <= 0:
            raise ValueError("total weight must be positive")
        return self.decrypt(blob, length) / total_weight
