"""The coordinator: consortium set-up, campaigns on Ray, the release pipeline, reports
and the ``sealfl`` CLI. Trust decisions live in :mod:`sealfl.attestation`."""
