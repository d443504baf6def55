"""Key broker (``sealfl kbs serve``): releases a model's key only to an attested device.

Modules: :mod:`.errors`, :mod:`.atrest` (AES-256-GCM release-at-rest), :mod:`.wrap`
(HPKE key wrapping to a device's per-request key), :mod:`.broker` (the pure decision),
:mod:`.server` (FastAPI on loopback) and :mod:`.client` (the device side).
"""
