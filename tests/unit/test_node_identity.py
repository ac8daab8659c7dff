"""The node secret: made once, private from its creation whatever the umask, kept across
restarts; and the broker's check of it (`common.node_identity`, `StateStore` bindings)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.state.opener import open_store
from common.node_identity import (
    SECRET_FILE,
    load_or_create_secret,
    new_secret,
    proves,
    secret_sha256,
    well_formed,
)


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_the_secret_is_made_0600_under_umask_022_and_kept(tmp_path: Path, umask_022: None) -> None:
    secret = load_or_create_secret(tmp_path)
    path = tmp_path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert well_formed(secret) and len(secret) >= 43
    assert load_or_create_secret(tmp_path) == secret  # a restart shows the same one
    assert [p.name for p in tmp_path.iterdir()] == [SECRET_FILE]  # no staging file left


def test_a_secret_file_others_may_read_is_tightened(
    tmp_path: Path, umask_022: None, caplog: pytest.LogCaptureFixture
) -> None:
    secret = load_or_create_secret(tmp_path)
    path = tmp_path / SECRET_FILE
    path.chmod(0o644)
    assert load_or_create_secret(tmp_path) == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "was readable by others (mode 644)" in caplog.text


def test_a_file_that_is_no_secret_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / SECRET_FILE).write_text("short\n")
    (tmp_path / SECRET_FILE).chmod(0o600)
    with pytest.raises(ValueError, match=f"{SECRET_FILE} does not hold a node secret"):
        load_or_create_secret(tmp_path)


def test_only_the_bound_secret_proves_an_id() -> None:
    secret = new_secret()
    bound = secret_sha256(secret)
    assert proves(secret, bound)
    assert not proves(new_secret(), bound)
    assert not proves(secret, None)  # an unbound id: nothing to prove
    assert not proves(None, bound) and not proves("", bound)
    assert not well_formed("a" * 31) and not well_formed("a" * 40 + "/")


def test_a_binding_survives_a_broker_restart(tmp_path: Path) -> None:
    bound = secret_sha256(new_secret())
    with open_store("", tmp_path) as store:
        assert store.bind_node_secret("n2", None, bound, 4.0)
    with open_store("", tmp_path) as store:
        assert store.node_secrets() == {"n2": bound}
