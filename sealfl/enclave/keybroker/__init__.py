"""The key broker (``sealfl kbs serve``): releases a model's key only to a device attested in
an approved state. :mod:`.broker` is the pure decision, :mod:`.server` the HTTP front. The
device's side is :mod:`sealfl.enclave.device.kbs_client`; the wrapping and at-rest formats
are :mod:`sealfl.attestation.hpke_wrap` and :mod:`sealfl.attestation.encrypted_files`."""
