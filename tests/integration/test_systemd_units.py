"""The systemd units under deploy/systemd/: `systemd-analyze verify` accepts them (and does
complain about a broken unit, so that its silence means something), they keep the layout the
docs describe (user, directories, secrets as files, restart and stop behaviour, hardening),
and the flags they and the example env files give are real flags with valid values for the
CLI's own parsers and validation (no server is started).

`systemd-analyze` (Debian's `systemd` package, which .ci/run installs) is required: without
it these tests fail, they never skip."""

from __future__ import annotations

import re
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from broker.network import load_cluster_network
from broker.server import config_from_args
from broker.state.api_keys import new_api_key
from common.certs import issue, make_ca, write_new
from edge_client.cli import build_parser
from node_daemon.server import settings_from_args

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_DIR = REPO / "deploy" / "systemd"
ETC_DIR = SYSTEMD_DIR / "etc" / "edge-offload"
UNITS = {
    "broker": SYSTEMD_DIR / "edge-offload-broker.service",
    "node": SYSTEMD_DIR / "edge-offload-node.service",
}
INSTALLED_OFFLOAD = "/opt/edge-offload/venv/bin/offload"
OFFLOAD = Path(sys.executable).parent / "offload"
"""This environment's `offload`: verify checks that ExecStart's binary exists."""
CONFIG_DIR = "/etc/edge-offload"
SECRET_FLAGS = ("--join-token-file", "--api-keys-file", "--ops-token-file", "--agent-token-file")


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail(
            "systemd-analyze is not installed: install systemd (Debian: apt-get install "
            "systemd) to check the units under deploy/systemd/"
        )
    return path


def _entries(unit: Path) -> dict[str, list[tuple[str, str]]]:
    """The unit's settings by section, in order (a key may repeat); a line ending in a
    backslash continues on the next one, as in systemd."""
    sections: dict[str, list[tuple[str, str]]] = {}
    section = ""
    pending = ""
    for raw in unit.read_text().splitlines():
        raw = raw.strip()
        if not raw or raw.startswith(("#", ";")):
            continue
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        line, pending = pending + raw, ""
        if line.startswith("["):
            section = line.strip("[]")
            sections.setdefault(section, [])
            continue
        key, _, value = line.partition("=")
        sections[section].append((key.strip(), value.strip()))
    return sections


def _service(name: str) -> dict[str, list[str]]:
    service: dict[str, list[str]] = {}
    for key, value in _entries(UNITS[name])["Service"]:
        service.setdefault(key, []).append(value)
    return service


def _one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key, [])
    assert len(values) == 1, f"{key}= should be set once, is {values}"
    return values[0]


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd reads these simple files (a value may be wrapped in double
    quotes; the examples use no escapes or continuation lines)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, eq, value = line.partition("=")
        assert eq and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path}: bad line {line!r}"
        assert not value.endswith("\\"), f"{path}: keep {key} on one line"
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        assert '"' not in value and "'" not in value and "\\" not in value, (
            f"{path}: {key}: systemd splits $VAR at whitespace without shell quoting; "
            "keep quotes and backslashes out of the value"
        )
        env[key] = value
    return env


def _words(value: str) -> list[str]:
    """What systemd makes of an unquoted `$VAR` in ExecStart=: the value split at
    whitespace. For these values (no quotes, no escapes) shlex agrees."""
    words = shlex.split(value)
    assert words == value.split()
    return words


def _verifiable(name: str, directory: Path) -> Path:
    """A copy of the unit that verify can check here: ExecStart runs this environment's
    `offload` and EnvironmentFile is the example."""
    text = UNITS[name].read_text()
    assert INSTALLED_OFFLOAD in text
    text = text.replace(f"ExecStart={INSTALLED_OFFLOAD} ", f"ExecStart={OFFLOAD} ")
    text = re.sub(r"(?m)^EnvironmentFile=.*$", f"EnvironmentFile={ETC_DIR / f'{name}.env'}", text)
    copy = directory / UNITS[name].name
    copy.write_text(text)
    return copy


def _verify(*units: Path) -> tuple[int, list[str]]:
    """Run `systemd-analyze verify` on the units; its exit status and the output lines that
    name one of them (it may also warn about the host's own units)."""
    result = subprocess.run(
        [_systemd_analyze(), "verify", *map(str, units)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (result.stdout + result.stderr).splitlines()
    names = [unit.name for unit in units]
    return result.returncode, [line for line in lines if any(n in line for n in names)]


def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    assert OFFLOAD.is_file(), f"{OFFLOAD} missing: install the project into this venv"
    units = [_verifiable(name, tmp_path) for name in UNITS]
    status, ours = _verify(*units)
    assert status == 0 and not ours, f"systemd-analyze verify (exit {status}):\n" + "\n".join(ours)


@pytest.mark.parametrize(
    ("pattern", "replacement", "complaint"),
    [
        (r"\[Service\]\n", "[Service]\nNoSuchOption=yes\n", "NoSuchOption"),
        (r"\nRestart=on-failure\n", "\nRestart=sometimes\n", "sometimes"),
        (r"\nExecStart=\S+", "\nExecStart=/nonexistent/offload", "/nonexistent/offload"),
    ],
    ids=["unknown-key", "bad-restart", "missing-binary"],
)
def test_systemd_analyze_verify_complains_about_a_broken_unit(
    tmp_path: Path, pattern: str, replacement: str, complaint: str
) -> None:
    """systemd 252 exits 0 for unknown keys and bad values (it ignores them, with a line
    naming the file) and 1 for a missing binary: either way the line names the unit, which
    is what the test above relies on."""
    unit = _verifiable("broker", tmp_path)
    text, count = re.subn(pattern, replacement, unit.read_text(), count=1)
    assert count == 1
    broken = unit.with_name("edge-offload-broken.service")
    broken.write_text(text)
    status, ours = _verify(broken)
    assert any(complaint in line for line in ours), f"exit {status}, output: {ours}"


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_layout(name: str) -> None:
    service = _service(name)
    unit = _entries(UNITS[name])
    assert _one(service, "User") == _one(service, "Group") == "edge-offload"
    assert _one(service, "ConfigurationDirectory") == "edge-offload"
    assert _one(service, "StateDirectory") == f"edge-offload/{name}"
    assert _one(service, "EnvironmentFile") == f"{CONFIG_DIR}/{name}.env"
    assert _one(service, "Restart") == "on-failure"
    assert _one(service, "RestartSec") == "2"
    assert _one(service, "TimeoutStopSec") == "30"
    assert ("WantedBy", "multi-user.target") in unit["Install"]
    after = " ".join(v for k, v in unit["Unit"] if k == "After").split()
    wants = " ".join(v for k, v in unit["Unit"] if k == "Wants").split()
    assert "network-online.target" in after and "network-online.target" in wants

    exec_start = _one(service, "ExecStart").split()
    assert exec_start[:2] == [INSTALLED_OFFLOAD, name]
    args = exec_start[2:]
    assert args[args.index("--state-dir") + 1] == f"/var/lib/edge-offload/{name}"
    var = f"$OFFLOAD_{name.upper()}_ARGS"
    assert var in args, f"ExecStart= should end with the unbraced {var} (split into words)"
    assert var[1:] in _env_file(ETC_DIR / f"{name}.env")

    # Every %d/NAME (the credentials directory) is loaded from /etc/edge-offload.
    credentials = dict(v.split(":", 1) for v in service.get("LoadCredential", []))
    for arg in args:
        if arg.startswith("%d/"):
            source = credentials.get(arg.removeprefix("%d/"))
            assert source is not None, f"{arg}: no LoadCredential= for it"
            assert source.startswith(f"{CONFIG_DIR}/")

    for setting in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp"):
        assert setting in service
    assert _one(service, "ProtectSystem") == "strict"
    assert _one(service, "RestrictAddressFamilies").split() == ["AF_INET", "AF_INET6", "AF_UNIX"]
    for setting in (
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "RestrictNamespaces",
        "LockPersonality",
        "RestrictRealtime",
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
    ):
        assert _one(service, setting) == "yes", setting
    assert _one(service, "SystemCallArchitectures") == "native"
    assert "MemoryDenyWriteExecute" not in service  # see the units' comments

    if name == "broker":
        assert _one(service, "CapabilityBoundingSet") == ""
        assert _one(service, "PrivateDevices") == "yes"
        assert _one(service, "ProtectControlGroups") == "yes"
        assert _one(service, "KillMode") == "mixed"
    else:
        # The node: GPUs (/dev/nvidia*), cgroups for process replicas, the Docker socket,
        # SCHED_IDLE and back, and replicas that outlive the daemon.
        assert "PrivateDevices" not in service
        assert "ProtectControlGroups" not in service
        assert _one(service, "SupplementaryGroups") == "docker"
        assert _one(service, "AmbientCapabilities") == "CAP_SYS_NICE"
        assert _one(service, "CapabilityBoundingSet") == "CAP_SYS_NICE"
        assert _one(service, "KillMode") == "process"
        assert _one(service, "Delegate") == "yes"
        assert "docker.service" in after and "docker.service" in wants
        # The Docker runtime's token folders are bind-mounted by the engine: not in /tmp.
        tmpdir = _one(service, "Environment").removeprefix("TMPDIR=")
        assert tmpdir == f"/run/{_one(service, 'RuntimeDirectory')}"


@pytest.mark.parametrize("name", sorted(UNITS))
def test_env_files_carry_no_secrets(name: str) -> None:
    for value in _env_file(ETC_DIR / f"{name}.env").values():
        words = _words(value)
        assert not set(words) & set(SECRET_FLAGS), (
            f"{name}.env: the unit passes the secrets' paths, not the env file"
        )


def _cli_args(name: str, tmp_path: Path) -> list[str]:
    """The unit's ExecStart arguments as the service would get them, with the env file's
    value split like systemd splits it, the credentials directory (%d) and the secret files
    made here, and /etc/edge-offload/* read from the examples."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    secret_files = tmp_path / "etc"
    secret_files.mkdir()
    env = _env_file(ETC_DIR / f"{name}.env")
    args: list[str] = []
    for word in _one(_service(name), "ExecStart").split()[1:]:
        if word.startswith("$"):
            args += _words(env[word[1:]])
        else:
            args.append(word)
    resolved: list[str] = []
    for arg in args:
        if arg.startswith("%d/"):
            path = credentials / arg.removeprefix("%d/")
            path.write_text(secrets.token_hex(32) + "\n")
            path.chmod(0o400)
            arg = str(path)
        elif arg.startswith(f"{CONFIG_DIR}/tls/"):
            arg = str(_tls_file(secret_files / "tls", arg.removeprefix(f"{CONFIG_DIR}/tls/")))
        elif arg.startswith(f"{CONFIG_DIR}/"):
            example = ETC_DIR / arg.removeprefix(f"{CONFIG_DIR}/")
            if example.exists():
                arg = str(example)
            else:  # a secret, not shipped: the docs say how to make it
                assert example.name == "api-keys", f"{arg}: neither an example nor known"
                path = secret_files / example.name
                path.write_text(new_api_key("example-client") + "\n")
                path.chmod(0o640)
                arg = str(path)
        resolved.append(arg)
    return resolved


def _tls_file(folder: Path, name: str) -> Path:
    """`name` (ca.pem, HOST.pem or HOST-key.pem) as `offload certs` makes it, in `folder`."""
    folder.mkdir(mode=0o700, exist_ok=True)
    if not (folder / "ca.pem").exists():
        ca, ca_key = make_ca("test CA")
        write_new(folder / "ca.pem", ca, 0o644)
        write_new(folder / "ca-key.pem", ca_key)
    host = name.removesuffix(".pem").removesuffix("-key")
    if not (folder / f"{host}.pem").exists():
        cert, key = issue(
            (folder / "ca.pem").read_bytes(), (folder / "ca-key.pem").read_bytes(), host,
            ips=["192.0.2.1"], role="broker" if host == "broker" else "node",
        )  # fmt: skip
        write_new(folder / f"{host}.pem", cert, 0o644)
        write_new(folder / f"{host}-key.pem", key)
    return folder / name


def test_broker_flags_are_accepted(tmp_path: Path) -> None:
    args = _cli_args("broker", tmp_path)
    assert args[0] == "broker"
    config = config_from_args(build_parser().parse_args(args))
    assert config.state_dir == Path("/var/lib/edge-offload/broker")
    assert len(config.api_keys) == 1 and config.join_token
    assert config.ops_token is None  # made by the broker in its state dir
    assert config.cluster == ETC_DIR / "cluster.yaml"
    assert config.tls is not None and config.node_listen  # TLS beyond loopback
    load_cluster_network(config.cluster)


def test_node_flags_are_accepted(tmp_path: Path) -> None:
    args = _cli_args("node", tmp_path)
    assert args[0] == "node"
    settings = settings_from_args(build_parser().parse_args(args))
    assert settings.state_dir == Path("/var/lib/edge-offload/node")
    assert settings.broker and settings.join_token
    assert settings.tls is not None  # TLS beyond loopback
    # NodeAgent takes the broker's certificate (TLS) and the node secret, not the join token.
    assert not settings.agent_token
    assert not settings.stop_replicas_on_exit  # replicas outlive the daemon (KillMode=process)
    assert load_cluster_network(ETC_DIR / "cluster.yaml").has_site(settings.site)
