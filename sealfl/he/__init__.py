"""Homomorphic encryption of partners' updates, and what key holders do with a decryption.

Run by partners (encrypt, decrypt the global model), the aggregator (add ciphertexts; its
context holds no key) and the release enclave (decrypt the final aggregate). Modules: the
codecs (:mod:`.bfv`, the default; :mod:`.ckks`; :mod:`.plain`, benchmark only) over shared
frames (:mod:`.framed`, :mod:`.sealchunks`, :mod:`.sealio`), :mod:`.codecs` (which codec a
consortium names), bounded and rounded decryption (:mod:`.decrypted`), the server optimizers
key holders run (:mod:`.server_opt`), and the wrapping of an HE secret into a partner's kit
(:mod:`.kit_wrap`). Editing :mod:`.decrypted`, :mod:`.server_opt` or a codec changes the
release enclave's measurement (it imports them). Devices never import this package.
"""
