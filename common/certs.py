"""Certificates for TLS on every channel: a small CA for users without a PKI, and checks of
the PEM files an operator brings.

`make_ca` and `issue` create them with `cryptography` (ECDSA P-256 keys; every certificate
is usable for both server and client authentication, so one node certificate serves the
node's listener and its mutual-TLS link to the broker). `load_identity` and `load_ca` read
and check PEM files given on a command line: a file that is not a certificate, a key that
does not match its certificate, an expired or not-yet-valid certificate, or a key that other
users may read is a `CertError` saying which flag and file, never quoting a key. Private keys
are written with `write_new` (created 0600, never world-readable for a moment).

No gRPC here: grpc credentials are built from the PEM bytes by `runtime.tls`, which the
runtime (where `cryptography` is not installed) shares. Blocking (file system calls).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from runtime.errors import quote
from runtime.pem import TlsIdentity as TlsIdentity  # re-exported for this module's callers

CA_DAYS = 3650
"""Validity of a CA `offload certs init` makes: ten years."""
LEAF_DAYS = 397
"""Validity of a certificate `offload certs issue` makes: what browsers accept at most."""
MAX_DAYS = 36500
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""Certificates are valid from a little before now, so a peer whose clock is behind
accepts them at once."""
ROLES = ("broker", "node", "client")
"""What a certificate `offload certs issue --role` makes is for, carried as the SAN URI
`offload:role=<role>`: a node's NodeAgent takes calls only from a `broker` certificate."""
ROLE_URI_PREFIX = "offload:role="
CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
PRIVATE_FILE = 0o600


class CertError(ValueError):
    """A certificate or key cannot be made, read or used; the message names the file (and
    flag) and what to do, and quotes at most a short prefix of a certificate (never a key)."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _check_days(days: int) -> None:
    if not 1 <= days <= MAX_DAYS:
        raise CertError(f"validity {days} days: use 1..{MAX_DAYS}")


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates; a leaf signs handshakes and agrees keys (ECDHE)."""
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        key_agreement=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(common_name: str, days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A self-signed CA certificate and its key, both PEM. CertError for a bad name or
    validity."""
    _check_days(days)
    if not common_name.strip():
        raise CertError("the CA's name is empty")
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def subject_names(dns_names: Sequence[str], ips: Sequence[str]) -> list[x509.GeneralName]:
    """The subject alternative names for `dns_names` and `ips`; CertError quoting a bad one,
    or when both are empty (a peer checks the name it dialled against these)."""
    names: list[x509.GeneralName] = []
    for dns in dns_names:
        label = dns.removeprefix("*.")
        if (
            not label
            or len(dns) > 253
            or not all(
                part and len(part) <= 63 and part.replace("-", "").isalnum() and part.isascii()
                for part in label.split(".")
            )
        ):
            raise CertError(f"--dns {quote(dns)} is not a DNS name")
        names.append(x509.DNSName(dns))
    for ip in ips:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError:
            raise CertError(f"--ip {quote(ip)} is not an IP address") from None
    if not names:
        raise CertError(
            "give at least one --dns NAME or --ip ADDRESS: the names peers dial this host by"
        )
    return names


def issue(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    common_name: str,
    dns_names: Sequence[str] = (),
    ips: Sequence[str] = (),
    days: int = LEAF_DAYS,
    role: str | None = None,
) -> tuple[bytes, bytes]:
    """A certificate for `common_name` (a node's certificate carries its node id, which
    the broker checks) with the given subject alternative names, signed by the CA, and its
    new key; both PEM. Usable for server and client authentication. `role` (one of `ROLES`)
    adds the SAN URI `offload:role=<role>` (`certificate_roles`); None: no role, which no
    NodeAgent takes calls from. CertError for bad names, a bad validity, an unknown role, a
    CA key that does not match, or a CA that expires first."""
    _check_days(days)
    if not common_name.strip():
        raise CertError("the certificate's name is empty")
    if role is not None and role not in ROLES:
        raise CertError(f"role {quote(role)}: use one of {', '.join(ROLES)}")
    ca_cert = parse_certificate(ca_cert_pem, "the CA certificate")
    ca_key = _parse_key(ca_key_pem, "the CA key")
    _check_pair(ca_cert, ca_key, "the CA key")
    sans: list[x509.GeneralName] = subject_names(dns_names, ips)
    if role is not None:
        sans.append(x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role))
    now = _now()
    not_after = now + datetime.timedelta(days=days)
    if not_after > ca_cert.not_valid_after_utc:
        raise CertError(
            f"the CA expires on {ca_cert.not_valid_after_utc:%Y-%m-%d}, before a {days}-day "
            "certificate would: give fewer --days, or make a new CA"
        )
    key = _new_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def certificate_roles(cert_pem: bytes) -> frozenset[str]:
    """The roles (`ROLES`) the first certificate of `cert_pem` carries as SAN URIs
    `offload:role=<role>`; empty for one with none, or that does not parse."""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return frozenset()
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return frozenset(
        uri.removeprefix(ROLE_URI_PREFIX) for uri in uris if uri.startswith(ROLE_URI_PREFIX)
    )


def _pem_prefix(data: bytes) -> str:
    return quote(data.decode("utf-8", "replace").strip())


def parse_certificate(data: bytes, what: str) -> x509.Certificate:
    """The first certificate of PEM `data`; CertError quoting its start when it has none."""
    try:
        return x509.load_pem_x509_certificates(data)[0]
    except ValueError:
        raise CertError(
            f"{what} is not a PEM certificate: it starts {_pem_prefix(data)}"
        ) from None


def _parse_key(data: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        # Never quote it: it may be a key in a form we do not read.
        raise CertError(f"{what} is not an unencrypted PEM private key") from None
    return key  # type: ignore[return-value]


def _check_pair(cert: x509.Certificate, key: object, what: str) -> None:
    public = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*public) != key.public_key().public_bytes(*public):  # type: ignore[attr-defined]
        raise CertError(f"{what} does not match its certificate ({cert.subject.rfc4514_string()})")


def check_validity(cert: x509.Certificate, what: str) -> None:
    """CertError when `cert` has expired or is not valid yet."""
    now = _now()
    if now > cert.not_valid_after_utc:
        raise CertError(
            f"{what} ({cert.subject.rfc4514_string()}) expired on "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: issue a new one"
        )
    if now < cert.not_valid_before_utc:
        raise CertError(
            f"{what} ({cert.subject.rfc4514_string()}) is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: check this host's clock"
        )


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CertError(f"{flag} {path}: {err.strerror}") from None


def load_ca(path: Path, flag: str = "--tls-ca") -> bytes:
    """The CA bundle in `path`, checked: every certificate in it parses and is valid now."""
    data = _read(path, flag)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise CertError(
            f"{flag} {path} is not a PEM certificate: it starts {_pem_prefix(data)}"
        ) from None
    for cert in certs:
        check_validity(cert, f"{flag} {path}")
    return data


def load_identity(
    cert_path: Path, key_path: Path, ca_path: Path, flags: tuple[str, str, str] | None = None
) -> TlsIdentity:
    """A certificate, its key and the CA, read and checked: the certificate parses and is
    valid now, the key is private to this user (no group or other permission bits), parses
    and matches it, and the CA parses. `flags` name the three files in errors (default
    `--tls-cert`, `--tls-key`, `--tls-ca`)."""
    cert_flag, key_flag, ca_flag = flags or ("--tls-cert", "--tls-key", "--tls-ca")
    cert_pem = _read(cert_path, cert_flag)
    cert = parse_certificate(cert_pem, f"{cert_flag} {cert_path}")
    check_validity(cert, f"{cert_flag} {cert_path}")
    try:
        mode = stat.S_IMODE(key_path.stat().st_mode)
    except OSError as err:
        raise CertError(f"{key_flag} {key_path}: {err.strerror}") from None
    if mode & 0o077:
        raise CertError(
            f"{key_flag} {key_path} is readable by other users (mode {mode:04o}): "
            f"chmod 600 {key_path}"
        )
    key_pem = _read(key_path, key_flag)
    _check_pair(cert, _parse_key(key_pem, f"{key_flag} {key_path}"), f"{key_flag} {key_path}")
    ca_pem = load_ca(ca_path, ca_flag)
    issuers = [
        *x509.load_pem_x509_certificates(cert_pem)[1:],
        *x509.load_pem_x509_certificates(ca_pem),
    ]
    if not any(_issued_by(cert, issuer) for issuer in issuers):
        raise CertError(
            f"{cert_flag} {cert_path} ({cert.subject.rfc4514_string()}, issued by "
            f"{cert.issuer.rfc4514_string()}) is not signed by {ca_flag} {ca_path}: peers "
            "that trust that CA would refuse it"
        )
    return TlsIdentity(ca=ca_pem, cert=cert_pem, key=key_pem)


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def write_new(path: Path, data: bytes, mode: int = PRIVATE_FILE) -> None:
    """Write a new file with `mode` from its creation (0600, the default, for a key: it is
    never world-readable, not even for a moment; 0644 for a certificate, which is not
    secret). CertError when it exists: nothing is ever overwritten."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise CertError(f"{path} exists: remove it first, or write elsewhere") from None
    except OSError as err:
        raise CertError(f"cannot create {path}: {err.strerror}") from None
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def identity_from_args(args: argparse.Namespace) -> TlsIdentity | None:
    """The checked `--tls-cert/--tls-key/--tls-ca` files (all three or none); None without
    them. CertError saying which is wrong."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise CertError("--tls-cert, --tls-key and --tls-ca go together")
    return load_identity(args.tls_cert, args.tls_key, args.tls_ca)


def add_tls_arguments(p: argparse.ArgumentParser, peers: str) -> None:
    """`--tls-cert/--tls-key/--tls-ca` and `--insecure`, as the broker and the node take
    them; `peers` says whose certificates the CA checks."""
    p.add_argument("--tls-cert", type=Path, help="this host's certificate (PEM): serve TLS")
    p.add_argument("--tls-key", type=Path, help="its private key (PEM, unencrypted, mode 0600)")
    p.add_argument("--tls-ca", type=Path, help=f"the CA (PEM) {peers}")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a plaintext listener on an address other hosts can reach (tokens and "
        "data in the clear); without TLS only loopback addresses are allowed",
    )
