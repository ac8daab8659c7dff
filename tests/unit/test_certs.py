"""`common.certs`, `offload certs init|issue` and `runtime.tls`'s rules: certificates made
right, files private, bad PEMs refused with a message naming the file and never the key."""

from __future__ import annotations

import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import modelzoo
from common import certs
from common.certs import (
    CertError,
    certificate_roles,
    issue,
    load_ca,
    load_identity,
    make_ca,
    write_new,
)
from edge_client.cli import main
from runtime import pem, tls
from runtime.server import settings_from_args as runtime_settings


def _write(folder: Path, name: str, cert: bytes, key: bytes) -> tuple[Path, Path]:
    write_new(folder / f"{name}.pem", cert, 0o644)
    write_new(folder / f"{name}-key.pem", key)
    return folder / f"{name}.pem", folder / f"{name}-key.pem"


@pytest.fixture
def ca(tmp_path: Path) -> tuple[bytes, bytes, Path]:
    cert, key = make_ca("test CA")
    (tmp_path / "ca.pem").write_bytes(cert)
    return cert, key, tmp_path / "ca.pem"


def test_an_issued_certificate_names_its_host_and_serves_both_ends(
    ca: tuple[bytes, bytes, Path], tmp_path: Path
) -> None:
    ca_cert, ca_key, ca_path = ca
    cert_pem, key_pem = issue(ca_cert, ca_key, "node-a", ["node-a.example"], ["10.0.0.2"], 30)
    cert = x509.load_pem_x509_certificate(cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-a"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["node-a.example"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.2")]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=30) <= lifetime <= datetime.timedelta(days=31)
    cert_path, key_path = _write(tmp_path, "node-a", cert_pem, key_pem)
    loaded = load_identity(cert_path, key_path, ca_path)
    assert (loaded.ca, loaded.cert, loaded.key) == (ca_cert, cert_pem, key_pem)
    assert key_pem.decode() not in repr(loaded)


def test_certs_init_and_issue_write_private_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca_dir, out = tmp_path / "ca", tmp_path / "out"
    assert main(["certs", "init", "--dir", str(ca_dir)]) == 0
    argv = ["certs", "issue", "broker", "--role", "broker", "--ca-dir", str(ca_dir)]
    argv += ["--out-dir", str(out)]
    assert main([*argv, "--dns", "broker.example", "--ip", "127.0.0.1"]) == 0
    for key in (ca_dir / "ca-key.pem", out / "broker-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "broker.pem").stat().st_mode) == 0o644
    identity = load_identity(out / "broker.pem", out / "broker-key.pem", ca_dir / "ca.pem")
    printed = capsys.readouterr().out
    assert f"--tls-cert {out / 'broker.pem'}" in printed
    assert identity.key.decode() not in printed
    # Nothing is overwritten, and the message says why.
    assert main([*argv, "--ip", "127.0.0.1"]) == 2
    assert "broker.pem exists" in capsys.readouterr().err
    assert main(["certs", "init", "--dir", str(ca_dir)]) == 2
    assert "has a CA already" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ip", "10.0.0.300"], "--ip '10.0.0.300' is not an IP address"),
        (["--dns", "bad name!"], "--dns 'bad name!' is not a DNS name"),
        ([], "give at least one --dns NAME or --ip ADDRESS"),
        (["--ip", "10.0.0.1", "--days", "0"], "validity 0 days"),
        (["--ip", "10.0.0.1", "--days", "4000"], "the CA expires on"),
    ],
)
def test_certs_issue_refuses_bad_names_and_validity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["certs", "init", "--dir", str(tmp_path), "--days", "365"]) == 0
    assert main(["certs", "issue", "n1", "--role", "node", "--ca-dir", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "n1-key.pem").exists()


def test_certs_issue_refuses_a_name_that_is_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "init", "--dir", str(tmp_path)]) == 0
    argv = ["certs", "issue", "../n1", "--role", "node", "--ca-dir", str(tmp_path)]
    assert main([*argv, "--ip", "::1"]) == 2
    assert "name '../n1': use letters" in capsys.readouterr().err


def test_certs_issue_marks_the_role_in_the_certificate(tmp_path: Path) -> None:
    assert main(["certs", "init", "--dir", str(tmp_path)]) == 0
    for name, role in (("broker", "broker"), ("node-a", "node"), ("dev-1", "client")):
        argv = ["certs", "issue", name, "--role", role, "--ca-dir", str(tmp_path)]
        assert main([*argv, "--ip", "127.0.0.1"]) == 0
        assert certificate_roles((tmp_path / f"{name}.pem").read_bytes()) == {role}
    # The role is asked for: a certificate's use is never guessed from its name.
    with pytest.raises(SystemExit):
        main(["certs", "issue", "other", "--ca-dir", str(tmp_path), "--ip", "127.0.0.1"])
    ca, ca_key = (tmp_path / "ca.pem").read_bytes(), (tmp_path / "ca-key.pem").read_bytes()
    assert certificate_roles(issue(ca, ca_key, "plain", ips=["127.0.0.1"])[0]) == frozenset()
    with pytest.raises(CertError, match="role 'root'"):
        issue(ca, ca_key, "x", ips=["127.0.0.1"], role="root")


def test_bring_your_own_pems_are_checked(
    ca: tuple[bytes, bytes, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_cert, ca_key, ca_path = ca
    cert_pem, key_pem = issue(ca_cert, ca_key, "b", ips=["127.0.0.1"])
    cert_path, key_path = _write(tmp_path, "b", cert_pem, key_pem)
    other_cert, other_key = issue(ca_cert, ca_key, "c", ips=["127.0.0.1"])
    other_cert_path, other_key_path = _write(tmp_path, "c", other_cert, other_key)

    with pytest.raises(CertError, match=r"--tls-cert .*b-key.pem is not a PEM certificate"):
        load_identity(key_path, key_path, ca_path)
    # A key's text is never quoted, whatever the file holds.
    write_new(tmp_path / "cert-as-key.pem", cert_pem)
    with pytest.raises(CertError, match="is not an unencrypted PEM private key") as caught:
        load_identity(cert_path, tmp_path / "cert-as-key.pem", ca_path)
    assert "BEGIN" not in str(caught.value)
    with pytest.raises(CertError, match=r"--tls-key .*c-key.pem does not match"):
        load_identity(cert_path, other_key_path, ca_path)
    with pytest.raises(CertError, match=r"--tls-ca .* is not a PEM certificate: it starts 'junk'"):
        (tmp_path / "junk.pem").write_text("junk")
        load_identity(cert_path, key_path, tmp_path / "junk.pem")
    with pytest.raises(CertError, match=r"--tls-ca .*nope.pem: No such file"):
        load_identity(cert_path, key_path, tmp_path / "nope.pem")

    key_path.chmod(0o640)
    with pytest.raises(CertError, match=r"is readable by other users \(mode 0640\): chmod 600"):
        load_identity(cert_path, key_path, ca_path)
    key_path.chmod(0o600)

    foreign_ca, _ = make_ca("another CA")
    (tmp_path / "foreign.pem").write_bytes(foreign_ca)
    with pytest.raises(CertError, match=r"is not signed by --tls-ca .*foreign.pem"):
        load_identity(cert_path, key_path, tmp_path / "foreign.pem")
    assert load_identity(other_cert_path, other_key_path, ca_path).cert == other_cert

    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    monkeypatch.setattr(certs, "_now", lambda: past)
    old_cert, old_key = issue(ca_cert, ca_key, "old", ips=["127.0.0.1"], days=2)
    monkeypatch.undo()
    old_cert_path, old_key_path = _write(tmp_path, "old", old_cert, old_key)
    with pytest.raises(CertError, match=r"\(CN=old\) expired on .*: issue a new one"):
        load_identity(old_cert_path, old_key_path, ca_path)


def test_load_ca_reads_a_bundle(ca: tuple[bytes, bytes, Path], tmp_path: Path) -> None:
    ca_cert, _, _ = ca
    other, _ = make_ca("second CA")
    (tmp_path / "bundle.pem").write_bytes(ca_cert + other)
    assert load_ca(tmp_path / "bundle.pem") == ca_cert + other


def test_write_new_never_overwrites(tmp_path: Path) -> None:
    write_new(tmp_path / "k.pem", b"first")
    with pytest.raises(CertError, match=r"k\.pem exists"):
        write_new(tmp_path / "k.pem", b"second")
    assert (tmp_path / "k.pem").read_bytes() == b"first"


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("127.0.0.1:7000", True),
        ("[::1]:7000", True),
        ("localhost:0", True),
        ("0.0.0.0:7000", False),
        ("10.0.0.1:7000", False),
        ("[::]:7000", False),
        (":7000", False),
    ],
)
def test_a_plaintext_listener_other_hosts_reach_needs_insecure(
    address: str, allowed: bool
) -> None:
    tls.check_listener("--listen", address, tls=True, insecure=False)
    tls.check_listener("--listen", address, tls=False, insecure=True)
    if allowed:
        tls.check_listener("--listen", address, tls=False, insecure=False)
    else:
        with pytest.raises(ValueError, match="reachable from other hosts and no TLS"):
            tls.check_listener("--listen", address, tls=False, insecure=False)


def test_read_pem_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "x.pem").write_text("not pem")
    with pytest.raises(ValueError, match=r"--tls-cert-file .*x.pem holds no PEM block"):
        pem.read_pem(tmp_path / "x.pem", "--tls-cert-file")
    with pytest.raises(ValueError, match=r"--tls-key-file .*y.pem: No such file"):
        pem.read_pem(tmp_path / "y.pem", "--tls-key-file")


def test_the_runtime_serves_tls_or_stays_on_loopback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ca: tuple[bytes, bytes, Path]
) -> None:
    (tmp_path / "token").write_text("deployment-token-0123456789")
    base = ["--model", str(modelzoo.model_path("mlp")), "--token-file", str(tmp_path / "token")]
    with pytest.raises(SystemExit) as exited:
        runtime_settings(base)  # --host 0.0.0.0 by default
    assert exited.value.code == 2
    assert "--host '0.0.0.0:8001' is reachable from other hosts" in capsys.readouterr().err
    assert runtime_settings([*base, "--insecure"]).tls is None
    assert runtime_settings([*base, "--host", "127.0.0.1"]).tls is None
    cert, key = issue(ca[0], ca[1], "node-a", ips=["10.0.0.2"])
    cert_path, key_path = _write(tmp_path, "node-a", cert, key)
    served = runtime_settings([*base, "--tls-cert", str(cert_path), "--tls-key", str(key_path)])
    assert served.tls is not None and (served.tls.cert, served.tls.key) == (cert, key)
    with pytest.raises(SystemExit):
        runtime_settings([*base, "--tls-cert", str(cert_path)])
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
