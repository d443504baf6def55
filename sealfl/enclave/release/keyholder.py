"""The release enclave as HE key holder: unseal the campaign's secret context and
decrypt the encrypted global model.

The HE secret context is stored in the release enclave only sealed by the TEE
(``seal_secret("ckks-secret-context", ...)``), so it unseals only while the enclave
runs the measured code. TenSEAL is imported lazily: devices never load this module.

Nothing decrypted leaves the enclave unchecked or at full precision: :meth:`KeyHolder.open_model`
and :meth:`KeyHolder.open_stats` bound-check and round (:mod:`sealfl.he.decrypted`)
-- a checkpoint holding the aggregator's own encryption of ``[1e9]*14`` with weight 1 is
refused, and the parameters and mean/std written into a release carry no decryption noise.
"""

from __future__ import annotations

import numpy as np

from sealfl.enclave.errors import EnclaveError
from sealfl.enclave.release.enclave import ReleaseEnclave

CKKS_SECRET = "ckks-secret-context"


class KeyHolder:
    """Decrypts aggregates for the coordinator's release pipeline.

    Args:
        enclave: an opened :class:`ReleaseEnclave` (its measurement already extended).
        ckks_params: the campaign's HE parameters (:mod:`sealfl.he.codecs`: CKKS or BFV; name kept).
        context_id: 32-byte id of the campaign's HE context.
    Raises:
        EnclaveError: the enclave holds no HE secret (it was never provisioned).
        UnsealError: the enclave's measurement changed since the secret was sealed.
    """

    def __init__(self, enclave: ReleaseEnclave, ckks_params, context_id: bytes):
        from sealfl.he import codecs
        from sealfl.he.plain import is_plain

        if is_plain(ckks_params):
            raise EnclaveError("the release enclave does not open plaintext-benchmark campaigns")
        if CKKS_SECRET not in enclave.list_secrets():
            raise EnclaveError("the release enclave holds no HE secret context; provision it with the consortium")
        self._codec = codecs.from_bytes(enclave.unseal_secret(CKKS_SECRET), ckks_params, context_id)

    @staticmethod
    def provision(enclave: ReleaseEnclave, secret_context: bytes) -> None:
        """Seal the HE secret context (bytes) into ``enclave``."""
        enclave.seal_secret(CKKS_SECRET, secret_context)

    def decrypt(self, blob: bytes, length: int | None = None, layout=None) -> np.ndarray:
        """Decrypt a framed ciphertext into float64 (length,) at FULL precision.

        Only for checks inside the enclave: never publish the result unrounded (with CKKS, decryption
        noise leaks the secret key, see :mod:`sealfl.he.decrypted`); use
        :meth:`open_model` / :meth:`open_stats` for anything that leaves.
        """
        from sealfl.he.framed import PACKED

        return self._codec.decrypt(blob, length, layout or PACKED)

    def open_model(self, blob: bytes, total_weight, length: int, bounds, *, declared_total: int, opt=None,
                   dp=None) -> np.ndarray:
        """Weighted FedAvg's last step, checked and rounded: ``E(Σ (n_i / N) w_i)`` (N =
        ``declared_total``, the statistics round's total, also the weight's bound), Σ n_i ->
        float64 (length,) on the parameter grid (:func:`sealfl.he.decrypted.open_model`).

        With a server optimizer ``opt`` (:class:`sealfl.he.server_opt.ServerOpt`),
        ``length`` is the model's, the ciphertext holds ``opt.wire_length(length)`` values
        (the model and the optimizer's state) and the result is the optimizer's step, bound
        checked again; the state never leaves the enclave. With DP (``dp``, a
        :class:`sealfl.he.dp.DPConfig`) the ciphertext carries the partner count after the
        model and an aggregate of fewer than ``dp.min_partners`` is refused
        (:func:`sealfl.he.dp.open_counted`).

        Raises:
            CiphertextError: ``blob`` is not a frame of the expected values of this context.
            DecryptedValueError: the weight is not a whole number in ``[1, max_total]``, a
                parameter is out of ``bounds`` or the optimizer's state is impossible;
                TooLittleNoiseError (a DecryptedValueError) below k partners.
        """
        from sealfl.he.decrypted import check_params, check_weight, open_model, share_to_sum, upload_clip
        from sealfl.he.server_opt import ServerOpt

        opt = opt or ServerOpt()
        wire = opt.wire_length(length)
        check_weight(total_weight, declared_total)
        if dp is None:
            decrypted = self._codec.decrypt(blob, wire)
        else:
            from sealfl.he.dp import open_counted

            decrypted, _count = open_counted(self._codec.decrypt(blob, wire + 1), dp.min_partners)
        opened = open_model(share_to_sum(decrypted, declared_total, self._codec.WEIGHTING), total_weight, bounds,
                            declared_total)
        clip = upload_clip(self._codec.WEIGHTING, self._codec.params.update_layout)
        x, _state = opt.step(opened, length, bounds.param_grid_bits, clip=clip, abs_max=bounds.param_abs_max)
        return check_params(x, bounds)

    def open_stats(self, blob: bytes, length: int, declared_total: int, bounds) -> tuple[np.ndarray, np.ndarray]:
        """Global (mean, std) from ``E([n, Σx, Σx²])``, checked against the declared total
        and ``bounds`` and rounded (:func:`sealfl.he.decrypted.open_stats`).

        Raises:
            CiphertextError: ``blob`` is not a frame of ``length`` values of this context.
            DecryptedValueError: the count differs from ``declared_total`` or a statistic
                is out of ``bounds``.
        """
        from sealfl.he.decrypted import open_stats
        from sealfl.he.framed import WIDE

        return open_stats(self._codec.decrypt(blob, length, WIDE), declared_total, bounds)
