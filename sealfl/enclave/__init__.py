"""sealfl.enclave -- TEE abstraction (sim/tpm), release enclave, sandboxed runtime, device boot.

Kept import-free on purpose: the sandboxed runtime child and small devices import only the
submodules they need (e.g. ``from sealfl.enclave.device import boot``). The device side
never imports torch, tenseal or flwr.
"""
