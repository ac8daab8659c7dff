"""A real PostgreSQL server for the tests that need one, and a fresh database for each test.

`postgresql_server` (session) runs one server from the PostgreSQL binaries of this machine
(`/usr/lib/postgresql/<version>/bin`, Debian's `postgresql` package, or `initdb` on PATH):
a throwaway cluster in a private temp folder, listening only on a Unix socket there, trust
authentication (nobody else can reach the socket: its folder is 0700). PostgreSQL refuses to
run as root: as root, the server runs as the `postgres` user through `runuser`.
`postgresql_url` (function) creates an empty database of a unique name on it and drops it
after the test.

Without the binaries (or, as root, without the `postgres` user) a test that asks for them is
skipped, or failed under CI=true, where PostgreSQL is part of the test environment.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import quote

import psycopg
import pytest

_USER = "postgres"  # the server's user and superuser role, as Debian's package makes it


@dataclass(frozen=True, slots=True)
class PostgresServer:
    socket_dir: Path
    """The folder of the server's Unix socket (and its data, in `data/`)."""

    def url(self, database: str = "postgres") -> str:
        """A URL of `database` on this server, as the superuser."""
        return f"postgresql://{_USER}@/{database}?host={quote(str(self.socket_dir), safe='')}"


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"PostgreSQL is needed under CI=true: {reason}")
    pytest.skip(reason)


def _bin_dir() -> Path | None:
    """The newest installed server's binaries."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@pytest.fixture(scope="session")
def postgresql_server() -> Iterator[PostgresServer]:
    bin_dir = _bin_dir()
    if bin_dir is None:
        _unavailable("no PostgreSQL server binaries (initdb): apt-get install postgresql")
    as_user: list[str] = []
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(_USER)
        except KeyError:
            _unavailable(f"running as root and there is no {_USER!r} user to run PostgreSQL")
        as_user = ["runuser", "-u", _USER, "--"]
    # Not under this run's temp folder (0700, root's): the server's user must reach it. A
    # short path: a Unix socket's path is limited to about 100 bytes.
    root = Path(tempfile.mkdtemp(prefix="pg-", dir=os.environ.get("PYTEST_DEBUG_TEMPROOT")))
    if as_user:
        shutil.chown(root, user=_USER)
    data = root / "data"

    def run(*command: str) -> None:
        result = subprocess.run(
            [*as_user, *command], capture_output=True, text=True, timeout=120, check=False
        )
        if result.returncode != 0:
            pytest.fail(f"{' '.join(command[:2])} failed: {result.stdout}{result.stderr}")

    run(str(bin_dir / "initdb"), "-D", str(data), "-U", _USER, "-A", "trust", "-E", "UTF8",
        "--locale=C.UTF-8", "--no-sync")  # fmt: skip
    try:
        # fsync off: the server's own crash safety is not what these tests check, and the
        # tests' commits would otherwise wait for the disk.
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w",
            "-o", f"-k {root} -c listen_addresses='' -c fsync=off", "start")  # fmt: skip
        yield PostgresServer(root)
    finally:
        if (data / "postmaster.pid").exists():
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgresql_url(postgresql_server: PostgresServer) -> Iterator[str]:
    """The URL of an empty database of its own, dropped after the test (with whatever
    connections the test left open)."""
    name = f"test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgresql_server.url(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    yield postgresql_server.url(name)
    with psycopg.connect(postgresql_server.url(), autocommit=True) as admin:
        admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgresql"])
def broker_state(request: pytest.FixtureRequest) -> str:
    """Where a broker under test keeps its state (`--state`), once per backend: "" (SQLite in
    its state dir) and an empty PostgreSQL database of its own."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgresql_url"))
    return ""
