"""The release enclave: its signing key and HE secret sealed to its own measurement
(:mod:`.enclave`), and the HE key holder that decrypts, bounds and steps the final
aggregate (:mod:`.keyholder`). Every module here and everything it imports is measured into
the release enclave's PCR 16: editing one means re-provisioning the enclave."""
