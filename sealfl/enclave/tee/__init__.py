"""The TEE a device or the release enclave runs on: the interface (:mod:`.interface`), the
backends by name (:mod:`.backends`), the ``tpm`` backend (:mod:`.tpm` over :mod:`.tpm_tools`, its
response codes :mod:`.tpm_rc`, per-role allocation :mod:`.tpm_alloc` and sealing :mod:`.tpm_seal`), the insecure ``sim`` backend
(:mod:`.sim`) and their shared sealed-blob framing (:mod:`.sealed_blob`). Measured by
devices and by the release enclave."""

from sealfl.enclave.tee.backends import BACKENDS, backend_class, create_tee, load_tee
from sealfl.enclave.tee.interface import TEE

__all__ = ["BACKENDS", "TEE", "backend_class", "create_tee", "load_tee"]
