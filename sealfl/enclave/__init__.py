"""sealfl.enclave -- the trusted side: everything here is measured into some party's PCR.

Subpackages, by who runs them:

* :mod:`.tee` -- the TEE interface and its backends (``tpm`` on TPM 2.0 / swtpm; ``sim``,
  an insecure simulation for tests and demos); devices and the release enclave.
* :mod:`.device` -- a device: boot (the one "boot, else keep the last good release"
  policy), slots, provisioning, doctor, evidence, the key-broker client, input checks and
  ``device serve``. Measured into the device's PCR 16.
* :mod:`.sandbox` -- the sandboxed onnxruntime / LLM child, its pipe and stage protocol and
  the KV-cache decoder; devices (measured) and partners scoring release candidates.
* :mod:`.release` -- the release enclave (release signing key sealed to its measurement)
  and the HE key holder. Measured into the release enclave's PCR 16.
* :mod:`.keybroker` -- the key broker: model keys released only to attested devices.

What each role measures is derived from these packages and every import they make
(:mod:`.measurement`), never a hand-kept list. Kept import-free: a device imports only the
submodules it needs, never torch, tenseal or flwr.
"""
