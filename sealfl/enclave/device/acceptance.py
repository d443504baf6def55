"""Acceptance of a verified release by running it: the signed canary and the input spec.

:func:`run_canary` is the I/O half of the canary decision (it feeds the canary rows to the
sandboxed runtime, as one batch and row by row); the decision itself is the pure
:func:`sealfl.attestation.canary.check_canary`.
"""

from __future__ import annotations

from collections.abc import Mapping

from sealfl.attestation.canary import check_canary, parse_canary
from sealfl.attestation.errors import CanaryError
from sealfl.enclave.device.inputs import InputSpec, parse_input_spec
from sealfl.enclave.sandbox.runtime import SandboxedRuntime

__all__ = ["run_canary", "input_spec_of"]


def run_canary(runtime: SandboxedRuntime, metadata: Mapping) -> bool:
    """Check the release's signed canary on this device; True if it had one.

    Raises:
        CanaryError: the canary is malformed, names an input/output the model lacks, or the
            model's answers on this device differ from it (see
            :func:`~sealfl.attestation.canary.check_canary`).
        RuntimeSandboxError: inference failed in the sandbox.
    """
    doc = metadata.get("canary")
    if doc is None:
        return False
    canary = parse_canary(doc)
    if canary.input not in runtime.input_names or canary.output not in runtime.output_names:
        raise CanaryError(f"canary names input {canary.input!r} / output {canary.output!r}; the model has "
                          f"inputs {runtime.input_names} and outputs {runtime.output_names}")
    k = runtime.output_names.index(canary.output)
    batch = runtime.run({canary.input: canary.inputs})[k]
    rows = [runtime.run({canary.input: canary.inputs[i:i + 1]})[k] for i in range(len(canary.inputs))]
    check_canary(canary, batch, rows)
    return True


def input_spec_of(metadata: Mapping) -> InputSpec | None:
    """The release's parsed input spec (None if it states no feature ranges).

    Raises:
        InputSpecError: the signed ``input`` object is malformed.
    """
    return parse_input_spec(metadata.get("input"))
