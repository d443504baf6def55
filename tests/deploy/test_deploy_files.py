"""deploy/: each file checked by the real tool for its kind (systemd-analyze verify, the
Compose specification's JSON schema, the Kubernetes schemas, Ray's cluster-launcher schema),
each check shown to refuse a broken copy, and every ``sealfl`` command, flag and port in
deploy/ checked against the CLI itself."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import typer
import yaml

from sealfl.platform.cli import app

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
UNITS = sorted((DEPLOY / "systemd").glob("*.service")) + sorted((DEPLOY / "systemd").glob("*.timer"))
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = sorted((DEPLOY / "compose").glob("compose*.yaml"))


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(BIN))
    assert path, f"{name} is missing: make installs it (pyproject's dev extra / scripts/install-deploy-tools.sh)"
    return path


def _systemd_verify(units: list[Path], tmp: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify on copies whose ExecStart names this venv's sealfl (the units
    name /usr/local/bin/sealfl, which verify requires to exist)."""
    for u in units:
        (tmp / u.name).write_text(u.read_text().replace("/usr/local/bin/sealfl", str(BIN / "sealfl")))
    return subprocess.run([_tool("systemd-analyze"), "verify", "--man=no", *[f"./{u.name}" for u in units]],
                          cwd=tmp, capture_output=True, text=True, timeout=120)


def test_kind_the_device_units_pass_systemd_analyze_and_a_broken_one_does_not(tmp_path):
    assert len(UNITS) == 5
    ok = _systemd_verify(UNITS, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    bad = broken / "sealfl-device-boot.service"
    bad.write_text((DEPLOY / "systemd" / bad.name).read_text().replace("ExecStart=", "ExecStrat="))
    out = _systemd_verify([bad], broken)
    assert out.returncode != 0 and "ExecStrat" in out.stdout + out.stderr


def test_kind_the_device_units_are_sandboxed_ordered_and_offline_at_boot():
    text = {u.name: u.read_text() for u in UNITS}
    for name, unit in text.items():
        if name.endswith(".service"):
            for line in ("ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes", "DevicePolicy=closed",
                         "StateDirectory=sealfl"):
                assert line in unit.splitlines(), (name, line)
    boot, serve = text["sealfl-device-boot.service"], text["sealfl-device-serve.service"]
    assert "PrivateNetwork=yes" in boot.splitlines() and "After=dev-tpmrm0.device" in boot
    assert "Requires=sealfl-device-boot.service" in serve and "Restart=on-failure" in serve.splitlines()
    assert "ConditionPathExists=!/var/lib/sealfl/state/tee" in text["sealfl-device-provision.service"]


def _validate_k8s(files) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("kubernetes-validate"), "--strict", "--quiet", *map(str, files)],
                          capture_output=True, text=True, timeout=300)


def test_kind_the_kubernetes_manifests_pass_the_schemas_and_a_broken_one_does_not(tmp_path):
    assert len(K8S) == 4
    ok = _validate_k8s(K8S)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "kbs.yaml"
    bad.write_text((DEPLOY / "k8s" / "kbs.yaml").read_text().replace("containerPort:", "containerPrt:"))
    assert _validate_k8s([bad]).returncode != 0


def _jsonschema(args) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("check-jsonschema"), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_kind_compose_and_ray_files_pass_their_schemas_and_broken_ones_do_not(tmp_path):
    import ray

    ok = _jsonschema(["--builtin-schema", "vendor.compose-spec", *COMPOSE])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ray_schema = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    ok = _jsonschema(["--schemafile", ray_schema, DEPLOY / "ray" / "cluster.yaml"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "compose.yaml"
    bad.write_text((DEPLOY / "compose" / "compose.yaml").read_text().replace("restart: on-failure",
                                                                          "restart: [on-failure]", 1))
    assert _jsonschema(["--builtin-schema", "vendor.compose-spec", bad]).returncode != 0
    bad_ray = tmp_path / "cluster.yaml"
    bad_ray.write_text((DEPLOY / "ray" / "cluster.yaml").read_text().replace("max_workers: 2", "max_workers: two"))
    assert _jsonschema(["--schemafile", ray_schema, bad_ray]).returncode != 0
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):  # token authentication on every node
        starts = [c for c in cluster[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key


def _command_lines() -> list[tuple[str, list[str]]]:
    """Every sealfl command line in deploy/: (where, argv after 'sealfl')."""
    found = []
    for f in COMPOSE:
        for name, svc in yaml.safe_load(f.read_text())["services"].items():
            found.append((f"{f.name}:{name}", list(svc["command"])))  # the image's entrypoint is sealfl
    for f in K8S:
        for doc in yaml.safe_load_all(f.read_text()):
            for c in (doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
                found.append((f"{f.name}:{c['name']}", list(c["args"])))
    for u in UNITS:
        for line in u.read_text().splitlines():
            if line.startswith("ExecStart=/usr/local/bin/sealfl "):
                found.append((u.name, shlex.split(line.split(" ", 1)[1])))
    readme = (DEPLOY / "README.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", readme, flags=re.S):
        for line in block.splitlines():
            line = re.sub(r"^[A-Z_]+=\S+ ", "", line.split("#")[0].strip())
            if line.startswith("sealfl "):
                found.append(("README.md", shlex.split(line)[1:]))
    return found


def _resolve(argv: list[str]) -> tuple[click.Command, list[str]]:
    root = typer.main.get_command(app)
    cmd, ctx, rest = root, click.Context(root), list(argv)
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        sub = cmd.get_command(ctx, rest[0])
        assert sub is not None, f"no command {rest[0]!r} under {cmd.name!r}"
        cmd, ctx, rest = sub, click.Context(sub, parent=ctx), rest[1:]
    assert not isinstance(cmd, click.Group), f"{' '.join(argv)} names a group, not a command"
    return cmd, rest


def test_kind_every_sealfl_command_flag_and_port_in_deploy_exists_in_the_cli():
    lines = _command_lines()
    assert len(lines) >= 14, lines
    seen = set()
    for where, argv in lines:
        cmd, rest = _resolve(argv)
        opts = {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
        for i, tok in enumerate(rest):
            if tok.startswith("--"):
                assert tok in opts, f"{where}: {' '.join(argv[:2])} has no option {tok}"
                if tok == "--port":
                    default = opts[tok].default
                    assert int(rest[i + 1]) == default, f"{where}: --port {rest[i + 1]}, the CLI's default is {default}"
        seen.add(" ".join(argv[:2]))
    for needed in ("superlink start", "partner start", "repo serve", "kbs serve", "device provision", "device boot",
                   "device serve", "device update", "campaign run"):
        assert needed in seen, f"deploy/ does not show '{needed}'"


def test_kind_deploy_holds_no_secret_and_mounts_kits_read_only():
    for f in DEPLOY.rglob("*"):
        if f.is_file():
            text = f.read_text()
            assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text, f
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    assert all(v.endswith(":ro") for v in compose["services"]["superlink"]["volumes"] if "/kit" in v)
    assert "COPY" not in (DEPLOY / "compose" / "Dockerfile").read_text()  # nothing of a kit is baked in
    assert os.access(_tool("systemd-analyze"), os.X_OK)
