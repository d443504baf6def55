"""Startup kits for Flower's deployment engine: a consortium CA, the SuperLink's TLS
certificate, one SuperNode authentication key per partner, and a README per kit.

Written by :func:`write_startup_kits` into a consortium directory that
:func:`sealfl.platform.consortium.create_consortium` has just made (every file atomically)::

    authority/ca.key                  the consortium CA's EC P-384 private key (0600): the coordinator
                                      keeps it to re-issue certificates; it is in NO kit
    superlink/                        the SuperLink's kit (the coordinator's SuperLink host)
        ca.crt                        the consortium CA certificate (PEM, X.509 v3, CA:TRUE)
        superlink.crt superlink.key   TLS server certificate (SAN: --superlink-host values) and key (0600)
        supernodes.json               {"partners": [{"name", "public_key": OpenSSH ECDSA line}]}:
                                      the SuperNode keys `sealfl superlink start` registers
        README.md
    aggregator/                       the aggregator's (campaign coordinator's) kit
        public.he                     the public HE context (no secret key; sealfl.platform.consortium)
        ca.crt                        to check the SuperLink when submitting a campaign
        README.md
    partners/<slug>/                  a partner's kit (sealfl.clients.kit) plus
        ca.crt                        to check the SuperLink's certificate
        supernode_auth_key            its SuperNode authentication key, ECDSA P-384, OpenSSH PEM (0600)
        supernode_auth_key.pub        its public half (one OpenSSH line)
        README.md

Formats: Flower 1.42's node authentication loads the SuperNode key with
``cryptography``'s ``load_ssh_private_key`` and registers public keys given as
OpenSSH lines (``flwr supernode register KEY.pub``); ``ssh-keygen -t ecdsa -b 384`` writes
the same forms. Certificates are PEM X.509 v3 (RFC 5280) made with ``cryptography``.

Who needs what: a partner's kit holds only its own keys (HE secret wrapped to its own P-256
key, its own SuperNode key) and public material; the aggregator's kit holds no private key
at all (tests/platform/test_startup_kits.py opens every kit and checks it).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sealfl.clients.kit import SUPERNODE_KEY_LABEL, SUPERNODE_WRAPPED_FILE, kit_dir
from sealfl.common.fsutil import atomic_write
from sealfl.he.kit_wrap import wrap
from sealfl.platform.errors import ConsortiumError

__all__ = ["DEFAULT_SUPERLINK_HOSTS", "KitPaths", "write_startup_kits", "supernode_key_pair", "san_entries",
           "superlink_kit", "CA_FILE", "SUPERNODE_KEY_FILE", "SUPERNODES_FILE"]

#: SAN entries of the SuperLink certificate when --superlink-host is not given
DEFAULT_SUPERLINK_HOSTS = ("127.0.0.1", "localhost")
CA_FILE = "ca.crt"
CA_KEY_FILE = "authority/ca.key"
SUPERLINK_DIR = "superlink"
SUPERLINK_CERT = "superlink.crt"
SUPERLINK_KEY = "superlink.key"
SUPERNODES_FILE = "supernodes.json"
SUPERNODE_KEY_FILE = "supernode_auth_key"
#: validity of the CA and SuperLink certificates (days)
VALID_DAYS = 825


@dataclass(frozen=True)
class KitPaths:
    """Where :func:`write_startup_kits` put the kits (absolute directories)."""

    superlink: Path
    aggregator: Path
    partners: dict


def superlink_kit(consortium_dir: str | Path) -> Path:
    """The SuperLink kit directory of a consortium."""
    return Path(consortium_dir) / SUPERLINK_DIR


def san_entries(hosts: list[str] | tuple[str, ...]) -> list[x509.GeneralName]:
    """SubjectAlternativeName entries for ``hosts``: an IP address literal becomes an
    ``iPAddress`` entry, anything else a ``dNSName`` (checked: letters, digits, ``-`` and
    ``.``, at most 253 characters). Raises ConsortiumError naming a bad host."""
    out: list[x509.GeneralName] = []
    for h in hosts:
        h = h.strip()
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
            continue
        except ValueError:
            pass
        labels = h.rstrip(".").split(".")
        if not h or len(h) > 253 or not all(lab and len(lab) <= 63 and all(c.isalnum() or c == "-" for c in lab)
                                             and lab.isascii() for lab in labels):
            raise ConsortiumError(f"--superlink-host {h!r} is neither an IP address nor a DNS name; give the name or "
                                  "address partners use to reach the SuperLink")
        out.append(x509.DNSName(h.rstrip(".").lower()))
    if not out:
        raise ConsortiumError("--superlink-host: give at least one name or address")
    return out


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _make_ca(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name[:64] or "sealfl"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "sealfl consortium CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA384()))
    return key, cert


def _make_server_cert(ca_key, ca_cert: x509.Certificate, hosts) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    sans = san_entries(hosts)
    cn = str(sans[0].value)
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return key, cert


def supernode_key_pair() -> tuple[bytes, bytes]:
    """A fresh SuperNode authentication key: (OpenSSH private key PEM, OpenSSH public line
    ``ecdsa-sha2-nistp384 AAAA...``), the forms Flower's node authentication reads."""
    key = ec.generate_private_key(ec.SECP384R1())
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return priv, pub + b"\n"


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _readme(title: str, who: str, command: str, holds: list[str]) -> bytes:
    lines = [f"# {title}", "", f"Who gets it: {who}", "", "The one command:", "", "    " + command, "",
             "What it holds:", ""]
    lines += [f"- {h}" for h in holds]
    lines += ["", "Keep files marked 0600 private; nothing in this kit is needed by any other party.", ""]
    return "\n".join(lines).encode()


def write_startup_kits(consortium_dir: str | Path, name: str, partners: list[str],
                       superlink_hosts: list[str] | tuple[str, ...] = DEFAULT_SUPERLINK_HOSTS,
                       wrap_to: dict | None = None) -> KitPaths:
    """Write the CA, the SuperLink kit and the deployment parts of the aggregator's and
    every partner's kit (layout in the module docstring). The partner kit directories must
    exist already (:func:`sealfl.platform.consortium.create_consortium` makes them).
    ``wrap_to`` maps partner names to their own P-256 public keys (``ECC.EccKey``): such a
    partner's SuperNode key is written only wrapped to it (``supernode_auth_key.wrapped``).

    Raises ConsortiumError for a bad ``superlink_hosts`` entry (before anything is written).
    """
    d = Path(consortium_dir)
    san_entries(superlink_hosts)  # refuse bad names before writing anything
    ca_key, ca_cert = _make_ca(name)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    (d / "authority").mkdir(parents=True, exist_ok=True)
    atomic_write(d / CA_KEY_FILE, _pem_key(ca_key), 0o600)
    sl = superlink_kit(d)
    sl.mkdir(parents=True, exist_ok=True)
    sl_key, sl_cert = _make_server_cert(ca_key, ca_cert, superlink_hosts)
    atomic_write(sl / CA_FILE, ca_pem, 0o644)
    atomic_write(sl / SUPERLINK_CERT, sl_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    atomic_write(sl / SUPERLINK_KEY, _pem_key(sl_key), 0o600)
    registered = []
    kits = {}
    for p in partners:
        kd = kit_dir(d, p)
        priv, pub = supernode_key_pair()
        atomic_write(kd / CA_FILE, ca_pem, 0o644)
        if p in (wrap_to or {}):
            atomic_write(kd / SUPERNODE_WRAPPED_FILE, wrap(priv, wrap_to[p], SUPERNODE_KEY_LABEL), 0o600)
        else:
            atomic_write(kd / SUPERNODE_KEY_FILE, priv, 0o600)
        atomic_write(kd / (SUPERNODE_KEY_FILE + ".pub"), pub, 0o644)
        own = p in (wrap_to or {})
        atomic_write(kd / "README.md", _readme(
            f"Partner kit of {p} (consortium {name})", f"the partner {p} only, on its own machine.",
            f"sealfl partner start {kd.name} --superlink HOST:PORT"
            + (" --key YOUR/partner_key.pem --data YOUR_DATA" if own else ""),
            ["kit.json: who you are in the consortium, the HE parameters",
             ("partner_key.pub.pem: the public half of the key you made ('sealfl partner keygen'); "
              "your private partner_key.pem is not in this kit, give it with --key" if own else
              "partner_key.pem (0600): your P-256 key; it signs your replies and unwraps your HE secret"),
             "he_secret.wrapped: the HE secret context, wrapped to your key",
             ("supernode_auth_key.wrapped: your SuperNode's authentication key (Flower node auth), wrapped to "
              "your key; 'partner check' / 'partner start' unwrap it into supernode_auth_key (0600)" if own else
              "supernode_auth_key (0600) / .pub: your SuperNode's authentication key (Flower node auth)"),
             "ca.crt: the consortium CA, to check the SuperLink's TLS certificate"]), 0o644)
        registered.append({"name": p, "public_key": pub.decode().strip()})
        kits[p] = kd.resolve()
    atomic_write(sl / SUPERNODES_FILE, json.dumps({"partners": registered}, indent=2).encode(), 0o644)
    hosts = ", ".join(superlink_hosts)
    atomic_write(sl / "README.md", _readme(
        f"SuperLink kit (consortium {name})", f"the coordinator's SuperLink host (certificate for {hosts}).",
        "sealfl superlink start superlink --port 9092",
        ["superlink.crt / superlink.key (0600): the SuperLink's TLS certificate and key",
         "ca.crt: the consortium CA", f"{SUPERNODES_FILE}: the partners' SuperNode public keys it registers"]), 0o644)
    agg = d / "aggregator"
    agg.mkdir(parents=True, exist_ok=True)
    atomic_write(agg / CA_FILE, ca_pem, 0o644)
    atomic_write(agg / "README.md", _readme(
        f"Aggregator kit (consortium {name})", "the coordinator who launches campaigns; it holds no secret key.",
        "sealfl campaign run -c CONSORTIUM --superlink HOST:PORT --out CAMPAIGN",
        ["public.he: the public HE context (no secret key)", "ca.crt: the consortium CA, to check the SuperLink"]),
        0o644)
    return KitPaths(sl.resolve(), agg.resolve(), kits)
