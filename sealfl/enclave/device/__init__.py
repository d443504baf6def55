"""The device: verify, measure, boot and serve a release, and keep the last good one.

Every module here (and everything it imports) is part of the device runtime's measurement
(PCR 16, :func:`sealfl.enclave.measurement.measure_device_runtime`): editing one changes
every device's quote. :mod:`.boot` boots one release; :mod:`.policy` is the one "boot, else
keep the last good release" decision the CLI and ``device serve`` share.
"""
