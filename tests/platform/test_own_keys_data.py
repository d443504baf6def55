"""Partners bring their own keys and data (issue 19, item 4).

Oracles independent of the code under test: the private key bytes ``partner keygen`` wrote
(searched for in every coordinator file), ``cryptography``'s loaders for "is this a private
key", the bundled CSV's own rows (counted with the csv module) for "what it trains on".
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from Crypto.PublicKey import ECC
from cryptography.hazmat.primitives import serialization

from sealfl.clients.app import local_data
from sealfl.clients.causal_lm.corpus import CorpusError, load_own_text
from sealfl.clients.errors import DataError, KitError
from sealfl.clients.heart import own_data
from sealfl.clients.heart.data import csv_path, n_test_for
from sealfl.clients.kit import kit_dir, load_kit, unwrap_supernode_key
from sealfl.clients.plugins import get_task
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import ConsortiumError

OWN = ["Hôpital Nord", "Clinic 7"]


def _cli(*args, cwd=None):
    out = subprocess.run([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], capture_output=True,
                         text=True, timeout=300, cwd=cwd)
    return out.returncode, " ".join((out.stdout + out.stderr).split())


def _private_key_in(data: bytes) -> bool:
    for load in (lambda b: serialization.load_pem_private_key(b, None), lambda b: serialization.load_ssh_private_key(b, None),
                 lambda b: serialization.load_der_private_key(b, None)):
        try:
            load(data)
            return True
        except Exception:  # noqa: BLE001 - any refusal means "not this form"
            pass
    return b"PRIVATE KEY" in data


def _bundled_rows(hospital: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(io.StringIO(csv_path().read_text(encoding="utf-8-sig"), newline="")))
    col = rows[0].index("dataset")
    return rows[0], [r for r in rows[1:] if r[col] == hospital]


def _write_csv(path: Path, header, rows) -> Path:
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *rows])
    path.write_text(buf.getvalue(), encoding="utf-8")
    return path


def _complete_count(header, rows) -> tuple[int, int]:
    """(complete rows with num = 0, with num > 0), counted here from the raw cells."""
    keep = [i for i, h in enumerate(header) if h not in ("slope", "ca", "thal")]
    done = [r for r in rows if all(r[i].strip().lower() not in ("", "?", "na") for i in keep)]
    num = header.index("num")
    return sum(r[num] == "0" for r in done), sum(r[num] != "0" for r in done)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two partners make their keys on 'their machines' (CLI), the coordinator creates the
    consortium from the public halves plus one demo partner (-p)."""
    root = tmp_path_factory.mktemp("byo")
    homes = {p: root / f"home-{i}" for i, p in enumerate(OWN)}
    for p, home in homes.items():
        code, msg = _cli("partner", "keygen", home / "keys")
        assert code == 0, msg
        assert (home / "keys" / "partner_key.pem").stat().st_mode & 0o077 == 0
    cons = root / "coordinator" / "cons"
    (root / "coordinator").mkdir()
    args = ["consortium", "create", cons, "-p", "Cleveland"]
    for p, home in homes.items():
        args += ["--partner-key", f"{p}={home / 'keys' / 'partner_key.pub.pem'}"]
    code, msg = _cli(*args)
    assert code == 0, msg
    return root, cons, homes


def test_coordinator_directory_holds_no_private_key_of_a_partner_with_its_own_key(world):
    root, cons, homes = world
    privs = {p: (h / "keys" / "partner_key.pem").read_bytes() for p, h in homes.items()}
    files = {f: f.read_bytes() for f in cons.rglob("*") if f.is_file()}
    for p, priv in privs.items():
        pem_body = b"".join(priv.split(b"\n")[1:-2])  # the base64 body, whatever the framing
        assert not any(priv in b or pem_body in b for b in files.values()), p
        kd = kit_dir(cons, p)
        private = sorted(f.name for f in kd.iterdir() if _private_key_in(f.read_bytes()))
        assert private == [], (p, private)
        assert {"partner_key.pub.pem", "he_secret.wrapped", "supernode_auth_key.wrapped"} <= {f.name for f in kd.iterdir()}
        assert "--key YOUR/partner_key.pem" in (kd / "README.md").read_text()
        # the public key in the kit is the partner's own
        assert (ECC.import_key((kd / "partner_key.pub.pem").read_bytes())
                == ECC.import_key(privs[p]).public_key())
    # the demo partner still gets a coordinator-made key, as before
    assert (kit_dir(cons, "Cleveland") / "partner_key.pem").exists()
    assert (kit_dir(cons, "Cleveland") / "supernode_auth_key").exists()
    names = json.loads((cons / "consortium.json").read_text())["partners"]
    assert names == ["Cleveland", *OWN]


def test_a_kit_from_a_public_half_opens_only_with_that_partners_own_private_key(world, tmp_path):
    root, cons, homes = world
    a, b = OWN
    mine = tmp_path / "partner-machine" / kit_dir(cons, a).name  # the kit as copied to the partner
    shutil.copytree(kit_dir(cons, a), mine)
    with pytest.raises(KitError, match="--key"):
        load_kit(str(mine))
    with pytest.raises(KitError, match="own private key"):
        load_kit(str(mine), str(homes[b] / "keys" / "partner_key.pem"))
    with pytest.raises(KitError, match="public key only"):
        load_kit(str(mine), str(homes[a] / "keys" / "partner_key.pub.pem"))
    with pytest.raises(KitError, match="own private key"):  # the demo partner's key does not open it either
        load_kit(str(mine), str(kit_dir(cons, "Cleveland") / "partner_key.pem"))
    k = load_kit(str(mine), str(homes[a] / "keys" / "partner_key.pem"))
    assert k.partner == a and k.codec.has_secret_key
    probe = np.array([0.5, -1.0])
    assert np.allclose(k.codec.decrypt(k.codec.encrypt(probe))[:2], probe, atol=1e-3)
    # the SuperNode key unwraps (with a's key only) into the key the SuperLink registers
    with pytest.raises(KitError):
        unwrap_supernode_key(mine, ECC.import_key((homes[b] / "keys" / "partner_key.pem").read_bytes()))
    assert not (mine / "supernode_auth_key").exists()
    written = unwrap_supernode_key(mine, k.signing_key)
    assert written is not None and written.stat().st_mode & 0o077 == 0
    pub = serialization.load_ssh_private_key(written.read_bytes(), None).public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    reg = {r["name"]: r["public_key"] for r in json.loads((cons / "superlink" / "supernodes.json").read_text())["partners"]}
    assert reg[a] == pub


def test_partner_check_with_its_key_and_its_own_csv(world, tmp_path):
    root, cons, homes = world
    header, rows = _bundled_rows("Hungary")
    rows = rows[::2]
    own = _write_csv(tmp_path / "mine.csv", header, rows)
    mine = tmp_path / "m" / kit_dir(cons, OWN[0]).name
    shutil.copytree(kit_dir(cons, OWN[0]), mine)
    code, msg = _cli("partner", "check", mine, "--key", homes[OWN[0]] / "keys" / "partner_key.pem", "--data", own)
    neg, pos = _complete_count(header, rows)
    n_train = neg + pos - n_test_for(neg) - n_test_for(pos)
    assert code == 0, msg
    assert f"{n_train} training examples" in msg and OWN[0] in msg
    bad = _write_csv(tmp_path / "bad.csv", header, [r[:] for r in rows[:40]])
    lines = bad.read_text().splitlines()
    lines[5] = lines[5].replace(lines[5].split(",")[header.index("age")], "nan", 1)
    bad.write_text("\n".join(lines) + "\n")
    code, msg = _cli("partner", "check", mine, "--key", homes[OWN[0]] / "keys" / "partner_key.pem", "--data", bad)
    assert code == 1 and "row 6" in msg and "'age'" in msg and "not a finite number" in msg


def test_a_partner_with_its_own_key_and_no_data_is_told_to_give_data(world, tmp_path):
    root, cons, homes = world
    mine = tmp_path / "m" / kit_dir(cons, OWN[1]).name
    shutil.copytree(kit_dir(cons, OWN[1]), mine)
    for cmd in (["check"], ["start", "--superlink", "127.0.0.1:9"]):
        code, msg = _cli("partner", *cmd, mine, "--key", homes[OWN[1]] / "keys" / "partner_key.pem", cwd=tmp_path)
        assert code == 1 and f"partner '{OWN[1]}' has no bundled demo data" in msg and "--data PATH" in msg, msg
        assert "unknown hospital" not in msg and "SuperNode of" not in msg


@pytest.mark.parametrize("name, why", [
    ("bell\x07name", "printable"), ("x" * 65, "1 to 64"), (" Padded", "leading/trailing"), ("---", "letter or digit"),
])
def test_bad_partner_names_are_refused_before_anything_is_written(tmp_path, name, why):
    pub = ECC.generate(curve="P-256").public_key().export_key(format="PEM").encode()
    with pytest.raises(ConsortiumError, match=why):
        create_consortium(tmp_path / "c", "t", ["Cleveland", name], public_keys={name: pub})
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name, why", [("", "1 to 256"), ("n" * 257, "1 to 256"), ("two\nlines", "printable")])
def test_bad_consortium_names_are_refused_before_anything_is_written(tmp_path, name, why):
    # a name Consortium.load would refuse to read back must not get as far as the key ceremony
    with pytest.raises(ConsortiumError, match=why):
        create_consortium(tmp_path / "c", name, ["Cleveland", "Hungary"])
    assert not (tmp_path / "c").exists()


def test_partner_names_in_any_script_get_their_own_kit_directory(tmp_path):
    # docs/partner.md: any printable name; one without a-z, 0-9 gets a stable hashed directory
    names = ["東京病院", "Αθήνα", "Clinic 7"]
    keys = {n: ECC.generate(curve="P-256").public_key().export_key(format="PEM").encode() for n in names}
    cons, _ = create_consortium(tmp_path / "c", "t", names, public_keys=keys)
    dirs = [kit_dir(cons.dir, n) for n in names]
    assert len(set(dirs)) == 3 and all(d.is_dir() for d in dirs), dirs
    assert dirs[0].name.startswith("p-") and dirs[0].name.isascii() and dirs[2].name == "clinic-7"
    assert [json.loads((d / "kit.json").read_text())["partner"] for d in dirs] == names


def test_keys_that_are_not_a_partners_public_half_are_refused(tmp_path):
    priv = ECC.generate(curve="P-256")
    with pytest.raises(ConsortiumError, match="PRIVATE key"):
        create_consortium(tmp_path / "a", "t", ["A", "B"], public_keys={"A": priv.export_key(format="PEM").encode(),
                                                                          "B": priv.public_key().export_key(format="PEM").encode()})
    p384 = ECC.generate(curve="P-384").public_key().export_key(format="PEM").encode()
    with pytest.raises(ConsortiumError, match="P-256"):
        create_consortium(tmp_path / "b", "t", ["A", "B"], public_keys={"A": p384, "B": p384})
    with pytest.raises(ConsortiumError, match="not a PEM public key"):
        create_consortium(tmp_path / "c", "t", ["A", "B"], public_keys={"A": b"hello", "B": b"x"})
    pub = priv.public_key().export_key(format="PEM").encode()
    with pytest.raises(ConsortiumError, match="distinct directory names"):
        create_consortium(tmp_path / "d", "t", ["Site A", "site-a"], public_keys={"Site A": pub, "site-a": pub})
    with pytest.raises(ConsortiumError, match="'A' and 'B' were given the same public key"):
        create_consortium(tmp_path / "f", "t", ["A", "B"], public_keys={"A": pub, "B": pub})
    assert not (tmp_path / "f").exists()
    with pytest.raises(ConsortiumError, match="unknown partner"):  # a -p partner without data, as before
        create_consortium(tmp_path / "e", "t", ["Nowhere", "Cleveland"])


def test_a_partners_own_csv_is_what_it_trains_on(tmp_path):
    task = get_task("heart")
    header, rows = _bundled_rows("Cleveland")
    subset = _write_csv(tmp_path / "cleveland-part.csv", header, rows[:100])
    neg, pos = _complete_count(header, rows[:100])
    bundled = task.load_data("Cleveland", task.train_defaults())
    own = task.load_data("Cleveland", {**task.train_defaults(), "data-path": str(subset)})
    assert task.n_train(own) == neg + pos - n_test_for(neg) - n_test_for(pos)
    assert task.n_train(own) < task.n_train(bundled)
    assert own.x_train.shape[1] == bundled.x_train.shape[1] == 13
    p0 = task.init_params()
    stats = [task.local_stats(d) for d in (own, bundled)]
    mean = stats[1][1:14] / stats[1][0]
    std = np.ones(13)
    w_own, _ = task.train_round(p0, own, mean, std, task.train_defaults(), 0)
    w_bundled, _ = task.train_round(p0, bundled, mean, std, task.train_defaults(), 0)
    assert not np.allclose(w_own, w_bundled)
    assert stats[0][0] == task.n_train(own)
    # a data-path in the aggregator's round config is not the partner's: it is dropped
    via_round = local_data(task, "Cleveland", {**task.train_defaults(), "data-path": str(subset)}, {})
    assert task.n_train(via_round) == task.n_train(bundled)
    via_node = local_data(task, "Cleveland", task.train_defaults(), {"data-path": str(subset)})
    assert task.n_train(via_node) == task.n_train(own)
    # any partner name trains on its own CSV (no bundled data needed)
    assert task.n_train(task.load_data("Clinic 7", {"data-path": str(subset)})) == task.n_train(own)


@pytest.mark.parametrize("name", ["2", "0", "cleveland", "Cleveland ", "Clinic 7"])
def test_local_data_refuses_a_partner_without_data_or_bundled_data(name):
    """In the ClientApp itself, not only at the CLI: a partner named "2" without --data used
    to train silently on hospital 2's bundled split (load_partition takes an index)."""
    task = get_task("heart")
    with pytest.raises(DataError, match="no bundled demo data.*--data PATH"):
        local_data(task, name, task.train_defaults(), {})
    with pytest.raises(DataError, match="no bundled demo data"):
        local_data(task, name, task.train_defaults(), None)
    assert task.n_train(local_data(task, "Cleveland", task.train_defaults(), {})) > 0


def _hostile(tmp_path, header, rows, kind):
    h, r = list(header), [x[:] for x in rows]
    p = tmp_path / f"{kind}.csv"
    if kind == "wrong-columns":
        h[h.index("chol")] = "cholesterol"
    elif kind == "unknown-column":
        h.append("ssn")
        r = [x + ["123"] for x in r]
    elif kind == "nan":
        r[3][h.index("oldpeak")] = "NaN"
    elif kind == "inf":
        r[3][h.index("trestbps")] = "inf"
    elif kind == "out-of-range":
        r[7][h.index("age")] = "500"
    elif kind == "bad-level":
        r[2][h.index("cp")] = "sometimes"
    elif kind == "bad-label":
        r[2][h.index("num")] = "7"
    elif kind == "superscript-label":
        r[2][h.index("num")] = "\u00b2"
    elif kind == "other-digits":
        r[2][h.index("age")] = "\u0666\u0663"
    elif kind == "underscore-number":
        r[2][h.index("age")] = "6_3"
    elif kind == "float32-overflow":
        r[7][h.index("chol")] = "1e308"
    elif kind == "long-cell":
        r[2][h.index("cp")] = "x" * 100_000
    elif kind == "long-column":
        h.append("y" * 100_000)
        r = [x + ["1"] for x in r]
    elif kind == "ragged":
        r[4] = r[4][:-2]
    elif kind == "one-label":
        r = [x for x in r if x[h.index("num")] == "0"]
        for x in r:
            x[h.index("num")] = "0"
    elif kind == "few-rows":
        r = r[:5]
    elif kind == "not-utf8":
        _write_csv(p, h, r)
        p.write_bytes(p.read_bytes().replace(b"Male", b"M\xe4le", 1))
        return p
    elif kind == "huge":
        _write_csv(p, h, r)
        with open(p, "r+b") as fh:
            fh.truncate(own_data.MAX_BYTES + 1)
        return p
    elif kind == "empty":
        p.write_bytes(b"")
        return p
    elif kind == "duplicate-column":
        h[h.index("id")] = "age"
    return _write_csv(p, h, r)


@pytest.mark.parametrize("kind, match", [
    ("wrong-columns", r"missing column\(s\) \['chol'\]"),
    ("unknown-column", r"unknown column\(s\) \['ssn'\]"),
    ("duplicate-column", "more than once"),
    ("nan", r"row 5 .*'oldpeak': 'NaN' is not a finite number"),
    ("inf", r"row 5 .*'trestbps': 'inf' is not a finite number"),
    ("out-of-range", r"row 9, column 'age': 500 is outside \[1, 120\]"),
    ("bad-level", r"row 4 .*'cp': unknown level 'sometimes'"),
    ("bad-label", r"row 4 .*'num': '7' is not a diagnosis 0-4"),
    ("superscript-label", r"row 4 .*'num': '\u00b2' is not a diagnosis 0-4"),
    ("other-digits", r"row 4 .*'age': .* is not a finite number"),
    ("underscore-number", r"row 4 .*'age': '6_3' is not a finite number"),
    ("float32-overflow", r"row 9, column 'chol': 1e\+308 is outside \[50, 1000\]"),
    ("long-cell", r"^[^\n]{0,400}'cp': unknown level 'x{40}'… \(100000 characters\); expected"),
    ("long-column", r"^[^\n]{0,400}unknown column\(s\) \['y{40}…'\]"),
    ("ragged", "row 6 has"),
    ("one-label", "same label"),
    ("few-rows", "complete rows; at least 10"),
    ("not-utf8", "is not UTF-8 text"),
    ("huge", "larger than 64 MiB"),
    ("empty", "is empty"),
])
def test_hostile_csvs_are_refused_naming_what_is_wrong(tmp_path, kind, match):
    header, rows = _bundled_rows("Cleveland")
    rows = [r for r in rows if "" not in r[:12] and "NA" not in r[:12]][:60]  # complete rows: line numbers stay put
    task = get_task("heart")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused in one message, not with a NumPy warning beside it
        with pytest.raises(DataError, match=match):
            task.load_data("Clinic 7", {"data-path": str(_hostile(tmp_path, header, rows, kind))})


def test_own_text_directory_for_the_causal_lm_task(tmp_path):
    d = tmp_path / "notes"
    (d / "sub").mkdir(parents=True)
    paras = ["\n\n".join(f"Paragraph {i}.{j}: " + "word " * 60 for j in range(6)) for i in range(4)]
    for i, text in enumerate(paras):
        (d / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (d / "ignored.bin").write_bytes(b"\x00\xff")
    pt = load_own_text("Clinic 7", d, seed=1)
    assert pt.files == ("notes/doc0.txt", "notes/doc2.txt", "notes/sub/doc1.txt", "notes/sub/doc3.txt")
    assert sum(map(len, pt.train + pt.heldout)) > 0 and pt.heldout and pt.train
    assert 0.1 <= pt.heldout_fraction < 0.5
    (d / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(CorpusError, match="bad.txt is not UTF-8"):
        load_own_text("Clinic 7", d)
    (d / "bad.txt").unlink()
    (d / "link.txt").symlink_to(d / "doc0.txt")
    with pytest.raises(CorpusError, match="link.txt"):
        load_own_text("Clinic 7", d)
    with pytest.raises(CorpusError, match="not a directory"):
        load_own_text("Clinic 7", d / "doc0.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match=r"\*\.txt"):
        load_own_text("Clinic 7", empty)
    assert math.isfinite(pt.heldout_fraction)


def test_own_text_refusals_name_the_data_directory_and_say_to_fix_the_file(tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    with pytest.raises(CorpusError, match=r"--data .*notes has no \*\.txt") as info:
        load_own_text("Clinic 7", d)
    assert "manual" not in str(info.value)
    (d / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(CorpusError, match="bad.txt is not UTF-8 text .*your --data directory") as info:
        load_own_text("Clinic 7", d)
    assert "reinstall" not in str(info.value) and "documentation" not in str(info.value)


def test_names_and_messages_with_console_markup_are_printed_as_they_are(tmp_path):
    # '[/]' in a partner's name once ended a successful 'consortium create' with rich's
    # MarkupError (exit 1, the consortium written), and main()'s last line of defence with a traceback
    names = ["a[/]b", "[bold red]Clinic"]
    args = ["consortium", "create", tmp_path / "c"]
    for i, n in enumerate(names):
        code, msg = _cli("partner", "keygen", tmp_path / f"k{i}")
        assert code == 0, msg
        args += ["--partner-key", f"{n}={tmp_path / f'k{i}' / 'partner_key.pub.pem'}"]
    code, msg = _cli(*args)
    assert code == 0 and "partners a[/]b, [bold red]Clinic;" in msg and "MarkupError" not in msg, msg
    header, rows = _bundled_rows("Hungary")
    code, msg = _cli("partner", "check", kit_dir(tmp_path / "c", names[0]), "--key",
                     tmp_path / "k0" / "partner_key.pem", "--data", _write_csv(tmp_path / "mine.csv", header, rows))
    assert code == 0 and "partner a[/]b of consortium" in msg, msg
    out = subprocess.run([sys.executable, "-c", "import sealfl.platform.cli as c\n"
                          "def boom(**kw): raise RuntimeError('bad [/] thing')\n"
                          "c.app = boom\nc.main()"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "RuntimeError: bad [/] thing" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_partner_public_key_is_named_without_errno(tmp_path):
    from sealfl.platform.partner_keys import partner_public_keys

    cons, _ = create_consortium(tmp_path / "c", "t", ["Cleveland", "Hungary"])
    (kit_dir(cons.dir, "Hungary") / "partner_key.pub.pem").unlink()
    with pytest.raises(ConsortiumError, match=r"partner 'Hungary' .*: No such file or directory; ask the partner") as info:
        partner_public_keys(cons)
    assert "Errno" not in str(info.value)


def test_kind_a_fifo_or_device_where_a_key_or_data_file_belongs_is_refused_at_once(world, tmp_path):
    """A FIFO would block a plain open() until a writer came (forever): every key and data
    path is opened without blocking and must be a regular file."""
    import os

    root, cons, homes = world
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, msg = _cli("consortium", "create", tmp_path / "c2", "--partner-key", f"Nord={fifo}")
    assert code == 1 and "not a regular file" in msg and "Nord" in msg and not (tmp_path / "c2").exists(), msg
    mine = tmp_path / "m" / kit_dir(cons, OWN[0]).name
    shutil.copytree(kit_dir(cons, OWN[0]), mine)
    key = homes[OWN[0]] / "keys" / "partner_key.pem"
    for args in (["--key", fifo], ["--key", "/dev/zero"], ["--key", key, "--data", fifo]):
        code, msg = _cli("partner", "check", mine, *args)
        assert code == 1 and "not a regular file" in msg, (args, msg)


def test_read_capped_refuses_what_is_not_a_regular_file_unless_asked_to_read_a_pipe(tmp_path):
    import os

    from sealfl.common.fsutil import read_capped

    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read_capped(tmp_path / "f", 4) == b"xxxxx"
    os.symlink(tmp_path / "f", tmp_path / "link")
    assert read_capped(tmp_path / "link", 100) == b"x" * 10  # a link to a file is that file
    with pytest.raises(IsADirectoryError):
        read_capped(tmp_path, 4)
    os.mkfifo(tmp_path / "p")
    with pytest.raises(OSError, match="not a regular file"):
        read_capped(tmp_path / "p", 4)
    r, w = os.pipe()
    os.write(w, b"abc")
    os.close(w)
    assert read_capped(f"/dev/fd/{r}", 10, regular_only=False) == b"abc"  # --input <(...)
    os.close(r)
