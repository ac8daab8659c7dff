"""Private files (`common.private_files`) under a real umask, and the warnings for the
operator's secret files that other users can read, from the broker's and the node's flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.server import config_from_args
from broker.state.api_keys import new_api_key
from common.private_files import open_private, private_dir
from edge_client.cli import build_parser
from node_daemon.server import settings_from_args


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask most hosts give: new files 0644, new folders 0755 unless asked otherwise."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def secret_file(path: Path, text: str, file_mode: int) -> Path:
    path.write_text(text)
    path.chmod(file_mode)
    return path


def broker_args(tmp_path: Path, join_token: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(
        [
            "broker", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path / "state"), "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(join_token), *extra,
        ]
    )  # fmt: skip


@pytest.mark.usefixtures("umask_022")
def test_private_files_and_folders_are_the_owners_only_whatever_the_umask(
    tmp_path: Path,
) -> None:
    private_dir(tmp_path / "state" / "models")
    assert mode(tmp_path / "state" / "models") == 0o700
    new = tmp_path / "state" / "replica.log"
    with open_private(new) as out:
        out.write(b"runtime listening")
    assert mode(new) == 0o600
    old = tmp_path / "state" / "replica.json"
    old.write_text("{}")
    assert mode(old) == 0o644
    with open_private(old) as out:
        out.write(b"{}")
    assert mode(old) == 0o600


def test_the_broker_names_an_api_keys_file_others_can_read_with_its_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    join_token = secret_file(tmp_path / "join-token", "join-token-0123456789", 0o600)
    keys = secret_file(tmp_path / "api-keys", new_api_key("device-a") + "\n", 0o644)
    config = config_from_args(broker_args(tmp_path, join_token, "--api-keys-file", str(keys)))
    assert len(config.api_keys) == 1
    assert f"--api-keys-file {keys} is readable by other users (mode 0644)" in caplog.text
    assert mode(keys) == 0o644  # the operator's file: named, not changed
    caplog.clear()
    keys.chmod(0o640)  # the systemd recipe: root:edge-offload 0640, for the service's group
    config_from_args(broker_args(tmp_path, join_token, "--api-keys-file", str(keys)))
    assert "readable by other users" not in caplog.text


def test_the_broker_names_its_token_files_others_can_read_with_their_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    join_token = secret_file(tmp_path / "join-token", "join-token-0123456789", 0o640)
    config_from_args(broker_args(tmp_path, join_token))
    assert f"--join-token-file {join_token} is readable by other users (mode 0640)" in (
        caplog.text
    )


@pytest.mark.parametrize("flag", ["--join-token-file", "--agent-token-file"])
def test_the_node_names_a_token_file_others_can_read_with_its_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, flag: str
) -> None:
    token = secret_file(tmp_path / "token", "node-token-0123456789", 0o644)
    broker = ["--broker", "127.0.0.1:7000"] if flag == "--join-token-file" else []
    argv = ["node", "--listen", "127.0.0.1:0", "--site", "a", *broker, flag, str(token)]
    settings = settings_from_args(build_parser().parse_args(argv))
    # A node with a broker takes the node secret the broker shows, not the join token.
    assert settings.agent_token == ("" if broker else "node-token-0123456789")
    assert f"{flag} {token} is readable by other users (mode 0644)" in caplog.text
    caplog.clear()
    token.chmod(0o600)
    settings_from_args(build_parser().parse_args(argv))
    assert "readable by other users" not in caplog.text
