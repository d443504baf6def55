"""A real, shared, imperfect TPM (swtpm): what each failure is reported as, and what is
never advised.

Kinds: a response code is decoded as TPM 2.0 Part 2 defines it (expected values written from
the spec's tables, not computed by the decoder); exhausted object memory is reported as
such -- never as a missing key, never with ``--force`` -- and transient failures of our own
making are retried after flushing only what we loaded; unseal failures say why (policy,
foreign object, resources); a TPM without the SHA-256 bank is refused at provisioning and at
boot; a second provisioning (another state, another role) is refused without ``--force``; a
provisioning without a TPM says so in one line and leaves nothing behind.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sealfl.enclave.device.boot import boot
from sealfl.enclave.device.evidence import attest_device
from sealfl.enclave.device.policy import boot_or_last_good, exit_code_of
from sealfl.enclave.device.provision import provision
from sealfl.enclave.errors import BootError, TEEError, TEEStateError, TPMError, UnsealError
from sealfl.enclave.tee.backends import create_tee, load_tee
from sealfl.enclave.tee.tpm_rc import decode, from_stderr
from sealfl.enclave.tee.tpm_tools import Tools
from tests.support.swtpm import SwTPM

M1 = bytes(range(32))


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def _fill_with_foreign_objects(tpm: SwTPM, tmp_path, n: int = 3) -> None:
    """Another program loads ``n`` transient objects and leaves them (swtpm holds 3)."""
    for i in range(n):
        tpm.tools("tpm2_createprimary", "-C", "o", "-c", str(tmp_path / f"foreign{i}.ctx"))


def _transient(tpm: SwTPM) -> list[str]:
    return [ln.strip("- ").strip() for ln in tpm.tools("tpm2_getcap", "handles-transient").stdout.splitlines()
            if ln.strip()]


# -- response codes (pure) ------------------------------------------------------------------

@pytest.mark.parametrize("code, name, kind, where, transient", [
    # TPM 2.0 Part 2 Table 16: warnings (0x900 + n) are format-zero
    (0x902, "OBJECT_MEMORY", "resources", "", True),
    (0x903, "SESSION_MEMORY", "resources", "", True),
    (0x922, "RETRY", "busy", "", True),
    (0x921, "LOCKOUT", "lockout", "", False),
    # format-one: 0x080 + E, bit 11 = session, bits 8-10 its number; bit 6 = parameter
    (0x99D, "POLICY_FAIL", "policy", "session 1", False),
    (0x98E, "AUTH_FAIL", "auth", "session 1", False),
    (0x18B, "HANDLE", "handle", "handle 1", False),
    (0x1DF, "INTEGRITY", "foreign-object", "parameter 1", False),
    (0x14C, "NV_DEFINED", "nv-defined", "", False),
    (0x14A, "NV_UNINITIALIZED", "nv-uninitialized", "", False),
    (0x101, "FAILURE", "failure", "", False),
    (0x100, "INITIALIZE", "initialize", "", False),
    (0x0C0902, "OBJECT_MEMORY", "resources", "", True),  # a TPM code passed on by a resource manager
    (0xA000A, "", "tcti", "", False),  # TSS2_TCTI_RC_IO_ERROR: the TPM was not reached
])
def test_kind_response_codes_decode_as_part_2_defines_them(code, name, kind, where, transient):
    rc = decode(code)
    assert (rc.name, rc.kind, rc.where, rc.transient) == (name, kind, where, transient)
    assert "provision" not in rc.advice.replace("do not re-provision", "")  # whether a key is gone is not the code's
    # to say: sealfl decides that from the TPM's handle lists


def test_kind_tools_stderr_yields_its_response_code():
    # lines as tpm2-tools 5.4 prints them here (including its own "Eys_Load" spelling)
    load = ("WARNING:esys:src/tss2-esys/api/Esys_Load.c:324:Esys_Load_Finish() Received TPM Error \n"
            "ERROR:esys:src/tss2-esys/api/Esys_Load.c:112:Esys_Load() Esys Finish ErrorCode (0x00000902) \n"
            "ERROR: Eys_Load(0x902) - tpm:warn(2.0): out of memory for object contexts\nERROR: Unable to run tpm2_load")
    assert from_stderr(load).name == "OBJECT_MEMORY"
    assert from_stderr("ERROR: Esys_TR_FromTPMPublic(0x18B) - tpm:handle(1):the handle is not correct").name == \
        "HANDLE"
    assert from_stderr('ERROR:tcti:...Failed to instantiate TCTI \nERROR: Could not load tcti, got: "x"').kind == \
        "tcti"
    assert from_stderr("ERROR: something without a code") is None


# -- resources ----------------------------------------------------------------------------

def test_kind_object_memory_full_is_reported_as_such_and_never_advises_force(swtpm, trust_dir, release_dir,
                                                                              tmp_path):
    state = tmp_path / "device"
    provision(state, "tpm")
    boot(trust_dir, release_dir, state).close()
    _fill_with_foreign_objects(swtpm, tmp_path)
    with pytest.raises(TPMError) as info:
        load_tee("tpm", state / "tee")
    msg = str(info.value)
    assert info.value.kind == "resources" and "TPM_RC_OBJECT_MEMORY 0x902" in msg
    assert "do not re-provision" in msg and "--force" not in msg and "has no attestation key" not in msg
    with pytest.raises(TPMError, match="0x902.*do not re-provision"):
        attest_device(state, b"\x01" * 32)
    r = _cli("device", "boot", "-t", trust_dir, "-r", release_dir, "-s", state)
    assert r.returncode == 2, r.stderr  # nothing runs -- not 4, which tells the operator to re-provision
    assert "0x902" in r.stderr and "do not re-provision" in r.stderr and "--force" not in r.stderr
    assert "ERROR:esys" not in r.stderr and len(r.stderr.strip().splitlines()) == 1  # the meaning, in one line
    assert len(_transient(swtpm)) == 3  # the other program's objects were not flushed by us
    swtpm.tools("tpm2_flushcontext", "-t")  # the other program finishes
    boot(trust_dir, release_dir, state).close()  # the attestation key was intact all along


def test_kind_our_own_leftovers_are_flushed_and_the_command_retried(swtpm, tmp_path):
    tools = Tools(swtpm.tcti)
    swtpm.tools("tpm2_createprimary", "-C", "o", "-c", str(tmp_path / "foreign.ctx"))
    foreign = _transient(swtpm)
    with tools.scope():
        for i in range(2):  # ours, left loaded: the TPM is now full
            tools.run("tpm2_createprimary", "-C", "o", "-c", str(tmp_path / f"ours{i}.ctx"))
        assert len(_transient(swtpm)) == 3
        proc = tools.run("tpm2_createprimary", "-C", "o", "-c", str(tmp_path / "more.ctx"))  # 0x902, then retried
        assert proc.returncode == 0
    assert _transient(swtpm) == foreign  # leaving the scope flushed ours, kept theirs


def test_kind_unseal_failures_say_why(swtpm, tmp_path, monkeypatch):
    tee = create_tee("tpm", tmp_path / "tee")
    tee.extend(16, M1)
    blob = tee.seal(b"secret", tee.read([16]))
    swtpm.tools("tpm2_createprimary", "-C", "o", "-c", str(tmp_path / "foreign.ctx"))
    assert tee.unseal(blob) == b"secret"  # one foreign object loaded: still room, and it stays loaded
    assert len(_transient(swtpm)) == 1
    _fill_with_foreign_objects(swtpm, tmp_path, 2)
    with pytest.raises(TPMError) as info:  # no room: a resource problem, not "another TPM"
        tee.unseal(blob)
    assert info.value.kind == "resources" and not isinstance(info.value, UnsealError)
    swtpm.tools("tpm2_flushcontext", "-t")
    tee.extend(16, M1)
    with pytest.raises(UnsealError, match=r"PCR policy not satisfied \(TPM_RC_POLICY_FAIL 0x99d, session 1\)"):
        tee.unseal(blob)
    other = SwTPM(tmp_path / "other-tpm")
    try:
        monkeypatch.setenv("SEALFL_TPM_TCTI", other.tcti)
        foreign_tee = create_tee("tpm", tmp_path / "tee-other")
        with pytest.raises(UnsealError, match="another TPM") as info:
            foreign_tee.unseal(blob)
        assert "PCR policy" not in str(info.value)
    finally:
        other.stop()


def test_kind_a_key_that_is_really_gone_is_told_apart_from_a_busy_tpm(swtpm, tmp_path):
    tee = create_tee("tpm", tmp_path / "tee")
    swtpm.tools("tpm2_evictcontrol", "-C", "o", "-c", "0x81010010")  # the TPM was cleared / the key removed
    with pytest.raises(TEEStateError, match=r"has no attestation key at 0x81010010.*--force"):
        load_tee("tpm", tmp_path / "tee")
    swtpm.tools("tpm2_nvundefine", "0x01500010", "-C", "o")
    with pytest.raises(TEEStateError, match="holds no rollback floor.*--force"):
        tee.read_floor()


# -- banks ----------------------------------------------------------------------------------

def test_kind_tpm_without_the_sha256_bank_is_refused_at_provisioning_and_boot(swtpm, trust_dir, release_dir,
                                                                              tmp_path):
    state = tmp_path / "device"
    provision(state, "tpm")
    boot(trust_dir, release_dir, state).close()
    swtpm.tools("tpm2_pcrallocate", "sha1:all+sha256:none")
    swtpm.restart()  # the allocation takes effect at the next TPM start: only SHA-1 for 16 and 23 now
    with pytest.raises(BootError) as info:
        boot_or_last_good(trust_dir, release_dir, state)
    assert info.value.reason == "tee" and exit_code_of(info.value) == 2  # nothing runs; no fallback was tried
    assert "SHA256 PCR bank is not allocated for PCR(s) [16, 23]" in str(info.value)
    assert "sha1 (24 PCRs)" in str(info.value) and "tpm2_pcrallocate" in str(info.value)
    with pytest.raises(TEEError, match="SHA256 PCR bank is not allocated"):
        provision(tmp_path / "fresh", "tpm")
    assert not (tmp_path / "fresh").exists()


# -- one role, one state per TPM ------------------------------------------------------------

def test_kind_a_second_provisioning_never_takes_over_the_first(swtpm, trust_dir, release_dir, tmp_path):
    from sealfl.enclave.release.enclave import ReleaseEnclave

    a, b = tmp_path / "A", tmp_path / "B"
    provision(a, "tpm")
    boot(trust_dir, release_dir, a).close()
    with pytest.raises(TEEStateError, match=r"already holds a sealfl device attestation key at 0x81010010 \(keyid "
                                            r"[0-9a-f]{16}….*--force"):
        provision(b, "tpm")
    assert not b.exists()
    with pytest.raises(TEEStateError, match="already serves a sealfl device"):
        ReleaseEnclave.create(tmp_path / "enclave-on-tpm", "tpm")
    assert not (tmp_path / "enclave-on-tpm").exists()
    boot(trust_dir, release_dir, a).close()  # A untouched
    provision(b, "tpm", force=True)  # on purpose
    with pytest.raises(BootError) as info:
        boot_or_last_good(trust_dir, release_dir, a)
    assert info.value.reason == "tee-state" and exit_code_of(info.value) == 4


def test_kind_roles_use_their_own_handles_and_refuse_each_other(swtpm, tmp_path):
    from sealfl.enclave.release.enclave import ReleaseEnclave

    enclave = ReleaseEnclave.create(tmp_path / "enclave", "tpm")
    persistent = swtpm.tools("tpm2_getcap", "handles-persistent").stdout
    nv = swtpm.tools("tpm2_getcap", "handles-nv-index").stdout
    assert "0x81010020" in persistent and "0x81010010" not in persistent
    assert "0x1500020" in nv and "0x1500010" not in nv
    with pytest.raises(TEEStateError, match="already serves a sealfl release enclave.*0x81010020"):
        provision(tmp_path / "device", "tpm", force=True)  # not even on purpose: both would reset PCR 16
    assert not (tmp_path / "device").exists()
    assert ReleaseEnclave.open(tmp_path / "enclave").release_public_key == enclave.release_public_key


# -- no TPM ---------------------------------------------------------------------------------

def test_kind_provisioning_without_a_tpm_says_so_and_leaves_nothing(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    state = tmp_path / "device"
    r = _cli("device", "provision", "-s", state, "--tee", "tpm", env={"SEALFL_TPM_TCTI": f"swtpm:host=127.0.0.1,"
                                                                                        f"port={port}"})
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"no TPM answers at swtpm:host=127.0.0.1,port={port}" in lines[0], r.stderr
    assert "ERROR:tcti" not in r.stderr and "SEALFL_TPM_TCTI" in r.stderr
    assert not state.exists()
