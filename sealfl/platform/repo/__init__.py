"""The coordinator's TUF repository of releases (``sealfl repo ...``).

:mod:`.repository` (init, publish, refresh, rotate on python-tuf's Metadata API),
:mod:`.keys` (offline root keys, online role keys), :mod:`.server` (plain HTTP on loopback).
"""
