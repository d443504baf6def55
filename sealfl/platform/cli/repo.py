"""``sealfl repo``: the coordinator's TUF repository of releases (:mod:`sealfl.platform.repo`)."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from sealfl.attestation.repo_index import TUF_ROOT_FILE
from sealfl.common.errors import SealflError
from sealfl.platform.cli.options import TrustDir
from sealfl.platform.cli.output import command_group, console, error_text, fail

__all__ = ["app"]

app = command_group("repo")

_Repo = typer.Argument(..., help="Repository directory.")
_Offline = typer.Option(..., "--offline-keys", help="Directory of the offline root keys (root-*.pem, mode 0600; "
                        "never commit it, keep it off the repository host).")


def _expiry(values: Optional[list[str]]) -> dict[str, int]:
    out = {}
    for v in values or []:
        role, sep, days = v.partition("=")
        if not sep or not days.isdigit():
            fail(f"--expiry takes ROLE=DAYS (e.g. timestamp=1), got {v[:60]!r}")
        out[role] = int(days)
    return out


@app.command("init")
def init(
    repo: Path = _Repo,
    offline_keys: Optional[Path] = typer.Option(None, "--offline-keys", help="New directory for the three offline "
                                                "root keys (root-*.pem, mode 0600; never commit it, keep it off the "
                                                "repository host). Not with --consortium."),
    consortium: Optional[Path] = typer.Option(None, "--consortium", "-c", help="Use the root keys 'consortium "
                                              "create' made in CONSORTIUM/authority/tuf-root (instead of "
                                              "--offline-keys)."),
    expiry: Optional[list[str]] = typer.Option(None, "--expiry", help="ROLE=DAYS (repeat): how long each role's "
                                               "metadata stays valid (default root=365 targets=90 snapshot=7 "
                                               "timestamp=1)."),
    trust: Optional[Path] = typer.Option(None, "--trust", "-t", help="Also copy the TUF root into this trust "
                                         f"directory as {TUF_ROOT_FILE} (what devices are provisioned with)."),
) -> None:
    """Create a TUF repository: three root keys (threshold 2) -- made into --offline-keys, or
    those 'consortium create' made (--consortium) -- online timestamp, snapshot and targets
    keys in REPO/keys, version 1 of every role."""
    from sealfl.platform.repo.keys import authority_root_keys_dir
    from sealfl.platform.repo.repository import Repository

    if (offline_keys is None) == (consortium is None):
        fail("give --offline-keys DIR (new root keys are made there) or --consortium DIR (its "
             "authority/tuf-root keys are used), not both")
    if consortium is not None:
        offline_keys = authority_root_keys_dir(consortium)
        if not offline_keys.is_dir() or not any(offline_keys.glob("root-*.pem")):
            fail(f"{consortium} holds no TUF root keys ({offline_keys}); it was created before 'consortium create' "
                 "made them: give --offline-keys DIR to make new ones")
    try:
        r = Repository.init(repo, offline_keys, _expiry(expiry), use_existing_keys=consortium is not None)
        if trust is not None:
            trust.mkdir(parents=True, exist_ok=True)
            (trust / TUF_ROOT_FILE).write_bytes(r.root_bytes(1))
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    console.print(f"repository in {repo}; root keys in {offline_keys} (move them offline); device trust root "
                  f"{r.metadata_dir / '1.root.json'}" + (f" (copied to {trust / TUF_ROOT_FILE})" if trust else ""))


def _check_repo_arg(repo: Path, release_dir: Path) -> None:
    """Name the mistake when REPO is not a repository (e.g. the two arguments swapped)."""
    from sealfl.platform.repo.repository import REPO_FILE

    if (repo / REPO_FILE).is_file():
        return
    if (release_dir / REPO_FILE).is_file():
        fail(f"the arguments are swapped: {release_dir} is the repository and {repo} is not; REPO comes first, "
             f"RELEASE_DIR second: sealfl repo publish {release_dir} {repo} --trust TRUST")
    fail(f"{repo} is not a sealfl repository (no {REPO_FILE}); the first argument is the repository ('sealfl repo "
         "init' creates one), the second the release directory")


@app.command("publish")
def publish(
    repo: Path = _Repo,
    release_dir: Path = typer.Argument(..., help="Release directory (verified first)."),
    trust: TrustDir = ...,
    delta: Optional[list[Path]] = typer.Option(None, "--delta", help="A signed delta to this release ('sealfl "
                                               "release delta' output; repeatable): published beside it, devices "
                                               "running its base fetch the patch instead."),
    encrypt_at_rest: bool = typer.Option(False, "--encrypt-at-rest", help="Publish the release re-signed by the "
                                         "release enclave (--consortium) with its model encrypted at rest, and "
                                         "register its key at the key broker (--kbs-keys, --kbs-policy)."),
    consortium: Optional[Path] = typer.Option(None, "--consortium", "-c", help="--encrypt-at-rest: the consortium "
                                              "directory whose release enclave signs the encrypted release."),
    kbs_keys: Optional[Path] = typer.Option(None, "--kbs-keys", help="--encrypt-at-rest: the key broker's keys "
                                            "file ('sealfl kbs serve --keys'; created 0600 if absent)."),
    kbs_policy: Optional[Path] = typer.Option(None, "--kbs-policy", help="--encrypt-at-rest: the key broker's "
                                              "policy ('sealfl kbs serve --policy'): the release's root is added."),
) -> None:
    """Verify a release against the trust directory devices pin, then publish its files as
    TUF targets (releases/NAME/VERSION/FILE) and re-sign targets, snapshot and timestamp.
    With --delta, each delta (its statement verified too, its result this release) is
    published as targets deltas/NAME/VERSION/BASE_ROOT_DIGEST/FILE."""
    from sealfl.enclave.device.delta import delta_files, read_delta_statement
    from sealfl.enclave.device.verify import verify_dir
    from sealfl.platform.repo.repository import Repository

    _check_repo_arg(repo, release_dir)
    if encrypt_at_rest:
        if delta:
            fail("--delta cannot be combined with --encrypt-at-rest (a delta is made between published releases)")
        if consortium is None or kbs_keys is None:
            fail("--encrypt-at-rest needs --consortium DIR (its release enclave signs the encrypted release) and "
                 "--kbs-keys FILE (the key broker's keys file)")
        _publish_at_rest(repo, release_dir, trust, consortium, kbs_keys, kbs_policy)
        return
    if consortium is not None or kbs_keys is not None or kbs_policy is not None:
        fail("--consortium, --kbs-keys and --kbs-policy go with --encrypt-at-rest")
    try:
        v = verify_dir(trust, release_dir)
        deltas = []
        for d in delta or ():
            st = read_delta_statement(trust, d)
            if (st.name, st.version, st.root_digest) != (v.name, v.version, v.root_digest):
                fail(f"{d}: the delta produces {st.name} v{st.version} ({st.root_digest}), not this release")
            deltas.append((d, st, delta_files(d, st)))
        r = Repository(repo)
        if not any(x.name == v.name and x.version == v.version for x in r.releases()) or not deltas:
            pub = r.publish(v.files(), v.name, v.version, v.root_digest)
            console.print(f"published {v.name} v{v.version} ({len(pub.targets)} files; root digest {v.root_digest}) "
                          f"as targets v{pub.targets_version}")
        for d, st, files in deltas:
            pub = r.publish_delta(files, v.name, v.version, v.root_digest, st.base_root_digest)
            console.print(f"published the delta from v{st.base_version} ({sum(map(len, files.values()))} bytes) as "
                          f"targets v{pub.targets_version}")
    except (SealflError, OSError) as exc:
        fail(error_text(exc))


def _publish_at_rest(repo: Path, release_dir: Path, trust: Path, consortium: Path, kbs_keys: Path,
                     kbs_policy: Optional[Path]) -> None:
    import shutil
    import tempfile

    from sealfl.enclave.release.enclave import ReleaseEnclave
    from sealfl.platform.consortium import Consortium
    from sealfl.platform.release import enclave_dir
    from sealfl.platform.repo.at_rest import encrypt_release, register_key
    from sealfl.platform.repo.repository import Repository

    r = Repository(repo)
    staging = Path(tempfile.mkdtemp(prefix=".at-rest-", dir=repo))
    try:
        enclave = ReleaseEnclave.open(enclave_dir(Consortium.load(consortium)))
        v, key = encrypt_release(enclave, trust, release_dir, staging / "release")
        if any(x.name == v.name and x.version == v.version for x in r.releases()):
            fail(f"{v.name} v{v.version} is published already; a release version is published once")
        register_key(kbs_keys, v.root_digest, key, kbs_policy)
        pub = r.publish(v.files(), v.name, v.version, v.root_digest)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    console.print(f"published {v.name} v{v.version} encrypted at rest ({len(pub.targets)} files; root digest "
                  f"{v.root_digest}) as targets v{pub.targets_version}; its key is registered in {kbs_keys}"
                  + (f" and its root in {kbs_policy}" if kbs_policy else ""))


@app.command("refresh")
def refresh(repo: Path = _Repo) -> None:
    """Re-sign snapshot and timestamp with a fresh expiry (run it more often than the
    timestamp expires, e.g. from a timer: devices refuse an expired timestamp)."""
    from sealfl.platform.repo.repository import Repository

    try:
        version = Repository(repo).refresh()
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    console.print(f"timestamp v{version}")


@app.command("rotate")
def rotate(
    role: str = typer.Argument(..., help="timestamp, snapshot, targets or root."),
    repo: Path = typer.Option(..., "--repo", help="Repository directory."),
    offline_keys: Path = _Offline,
    new_offline_keys: Optional[Path] = typer.Option(None, "--new-offline-keys", help="root only: new, empty "
                                                    "directory for the three new root keys."),
) -> None:
    """Replace a role's key: the new root (signed by 2 of the offline root keys; for root,
    also by 2 of the new ones) lists the new key and the role is re-signed."""
    from sealfl.platform.repo.repository import Repository

    try:
        version = Repository(repo).rotate(role, offline_keys, new_offline_keys)
    except (SealflError, OSError) as exc:
        fail(error_text(exc))
    console.print(f"rotated {role}: root v{version}")


@app.command("serve")
def serve(
    repo: Path = _Repo,
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback unless you mean otherwise)."),
    port: int = typer.Option(8080, min=0, max=65535, help="TCP port (0: a free one)."),
    port_file: Optional[Path] = typer.Option(None, help="Write the bound port here once listening."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"url\": ...} as one JSON line."),
) -> None:
    """Serve REPO/www (metadata/ and targets/) over plain HTTP until SIGINT/SIGTERM; prints
    the URL devices take as --repo."""
    from sealfl.platform.repo.server import RepoServer

    www = repo / "www"
    if not (www / "metadata" / "timestamp.json").is_file():
        fail(f"{repo} is not an initialised repository (no www/metadata/timestamp.json); run 'sealfl repo init'")
    try:
        server = RepoServer(www, host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        if port_file is not None:
            port_file.write_text(f"{server.port}\n")
        sys.stdout.write(json.dumps({"url": server.url}) + "\n" if as_json else f"serving {repo} at {server.url}\n")
        sys.stdout.flush()
        stop.wait()

