"""The clients of a shared replica: who may call it, with which class and rate limit.

A replica started with `--clients-file PATH` takes, beside the deployment's own token, the
bearer tokens of the clients listed in that file, one per line::

    CLIENT_ID CLASS TOKEN_SHA256 [MAX_RPS]

- ``CLIENT_ID``: the broker's client id (`check_client_id`: 1 to 64 characters of
  ``A-Z a-z 0-9 _ -``), unique in the file;
- ``CLASS``: the priority class of the client's calls (critical, standard, best-effort);
- ``TOKEN_SHA256``: the lowercase hex SHA-256 of the client's bearer token (the text after
  ``Bearer``), unique in the file: the file holds no secret;
- ``MAX_RPS``: optional, the client's inference calls per second (a token bucket holding
  ``max(1, MAX_RPS)`` calls, full at first: a client may burst one second's worth; a call
  past it waits for its token up to `RATE_WAIT_S`, and is refused RESOURCE_EXHAUSTED beyond
  that); 0 or absent for no limit.

Blank lines and lines starting ``#`` are skipped; at most `MAX_CLIENTS` clients and
`MAX_FILE_BYTES` bytes. An error names the line, never its token hash.

The node writes a first line ``# generation N`` (a comment to any other reader): N, a
decimal integer within 1..`MAX_GENERATION`, grows with each file the node writes for the
replica, and the replica reports the generation of the table it has in effect as the gauge
``offload_runtime_clients_generation`` (`runtime.metrics`; 0 before any file with one), so
that the node can tell when a file it wrote is in effect. Only the first line carries it.

The replica reads the file again whenever it receives SIGHUP (`RELOAD_SIGNAL`, which the
node sends right after it writes the file), and, as a fallback (a node that sends no
signal), whenever the file's status changes, which it polls every `POLL_INTERVAL_S`
(`watch_clients_file`); each reading swaps its table whole: a client added is taken from
its next call, one removed refused (UNAUTHENTICATED) from its next call. A file that does
not parse keeps the table (and the generation) read before (logged with the line); a
missing file means no clients, generation 0.

Plain Python (no gRPC): the node daemon writes these files with `format_clients`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from runtime.batching import PriorityClass
from runtime.errors import quote

logger = logging.getLogger(__name__)

MAX_CLIENTS = 10_000
"""The most clients one replica's file may list."""
MAX_FILE_BYTES = 4 * 1024 * 1024
"""The largest clients file read (10,000 lines of about 160 bytes fit well within)."""
MAX_RPS_LIMIT = 1_000_000.0
"""The largest per-client rate limit (calls per second)."""
RATE_WAIT_S = 0.25
"""The longest a call over its client's rate waits for its token (`RateLimit.reserve`):
beyond it the call is refused. A quarter second paces a client that sends a little too fast
without refusals, and bounds what a paced call adds to its latency."""
POLL_INTERVAL_S = 0.5
"""How often the replica looks at the clients file's status (one `stat` call)."""

MAX_GENERATION = 2**53
"""The largest generation: exact in the float a Prometheus gauge carries."""
RELOAD_SIGNAL = signal.SIGHUP
"""The signal that has a replica read its clients file again at once."""

_GENERATION = re.compile(r"# generation ([0-9]{1,16})")
_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_client_id(client_id: str) -> str:
    """`client_id` if it is a valid client id; ValueError saying the rule otherwise. The
    broker's API keys carry the same ids (``<client_id>.<secret>``)."""
    if not _CLIENT_ID.fullmatch(client_id):
        raise ValueError(
            f"client id {quote(client_id)} must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'"
        )
    return client_id


def check_token_sha256(token_sha256: str) -> str:
    """`token_sha256` if it is 64 lowercase hex digits; ValueError otherwise (never quoting
    it: a wrong value may be the token itself)."""
    if not _SHA256.fullmatch(token_sha256):
        raise ValueError("a token's SHA-256 must be 64 lowercase hex digits")
    return token_sha256


def check_max_rps(max_rps: float) -> float:
    """`max_rps` if it is a finite number within 0..`MAX_RPS_LIMIT`; ValueError otherwise."""
    if not (math.isfinite(max_rps) and 0 <= max_rps <= MAX_RPS_LIMIT):
        raise ValueError(f"a rate limit must be a number within 0..{MAX_RPS_LIMIT:g}")
    return max_rps


@dataclass(frozen=True, slots=True)
class ClientEntry:
    """One line of a clients file."""

    client_id: str
    priority_class: PriorityClass
    token_sha256: str
    """Lowercase hex SHA-256 of the client's bearer token."""
    max_rps: float = 0.0
    """Inference calls per second; 0: no limit."""


class RateLimit:
    """A token bucket: `rate` calls per second, holding `max(1, rate)` (full at first). A
    call over it waits for its token when that comes within `RATE_WAIT_S` (so a client that
    sends faster than its rate is paced to it, its calls held rather than each refused at
    once and sent again: a flood costs the replica its rate, not a storm of refusals), and
    is refused otherwise. Event loop only."""

    __slots__ = ("_clock", "_level", "_then", "burst", "rate")

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = max(1.0, rate)
        self._clock = clock
        self._level = self.burst
        self._then = clock()

    def reserve(self) -> float | None:
        """Seconds the next call must wait for its token (0: it fits now), that token
        counted; None, nothing counted, when the wait would pass `RATE_WAIT_S`. A call
        cancelled while it waits keeps its token spent: its client was over its rate."""
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._then) * self.rate)
        self._then = now
        wait = (1.0 - self._level) / self.rate if self._level < 1.0 else 0.0
        if wait > RATE_WAIT_S:
            return None
        self._level -= 1.0
        return wait


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a call comes from, as its token says (`runtime.rpc.auth.CALLER`)."""

    client_id: str
    """A client of the clients file; `runtime.batching.DEPLOYMENT` ("") for the
    deployment's own token (and those of `--class-tokens`)."""
    priority_class: PriorityClass
    limit: RateLimit | None = None
    """The client's rate limit; None: none."""


@dataclass(frozen=True, slots=True)
class ClientsFile:
    """One reading of a clients file."""

    entries: tuple[ClientEntry, ...] = ()
    generation: int = 0
    """Its first line's ``# generation N``; 0 when it has none."""


class ClientTable:
    """The clients of one reading of the file, by their token's SHA-256 digest (bytes)."""

    def __init__(
        self,
        entries: Iterable[ClientEntry] = (),
        previous: ClientTable | None = None,
        generation: int = 0,
    ) -> None:
        """A client listed in `previous` with the same rate keeps its bucket: reading the
        file again does not refill it. `generation`: that of the file read."""
        kept = previous.callers_by_id if previous is not None else {}
        self.entries = tuple(entries)
        self.generation = generation
        self.callers: dict[bytes, Caller] = {}
        self.callers_by_id: dict[str, Caller] = {}
        for entry in self.entries:
            before = kept.get(entry.client_id)
            old = before.limit if before is not None else None
            limit = None
            if entry.max_rps > 0:
                same = old is not None and old.rate == entry.max_rps
                limit = old if same else RateLimit(entry.max_rps)
            caller = Caller(entry.client_id, entry.priority_class, limit)
            self.callers[bytes.fromhex(entry.token_sha256)] = caller
            self.callers_by_id[entry.client_id] = caller

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(self.callers_by_id)


def client_entry(
    client_id: str, priority_class: str, token_sha256: str, max_rps: float = 0.0
) -> ClientEntry:
    """One client, each field checked: ValueError naming the first that is wrong (quoting
    at most a short prefix of it, never a token hash)."""
    check_client_id(client_id)
    if priority_class not in set(PriorityClass):
        raise ValueError(
            f"class {quote(priority_class)} must be one of {', '.join(PriorityClass)}"
        )
    check_token_sha256(token_sha256)
    check_max_rps(max_rps)
    return ClientEntry(client_id, PriorityClass(priority_class), token_sha256, max_rps)


def check_unique(entries: Sequence[ClientEntry], where: Callable[[int], str]) -> None:
    """ValueError when two of `entries` have the same client id or token hash, naming both
    by `where` (entry index -> its place: a line, a field) and never quoting the hash."""
    ids: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for index, entry in enumerate(entries):
        if (first := ids.setdefault(entry.client_id, index)) != index:
            raise ValueError(
                f"{where(index)}: client {entry.client_id!r} is listed at {where(first)} too"
            )
        if (first := hashes.setdefault(entry.token_sha256, index)) != index:
            raise ValueError(f"{where(index)}: the same token hash as {where(first)}")


def parse_clients(text: str, source: str) -> tuple[ClientEntry, ...]:
    """The entries of a clients file's `text` (see the module docstring). ValueError naming
    `source` and the first line that does not parse, never quoting a token hash."""
    entries: list[ClientEntry] = []
    numbers: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{source} line {number}"
        if len(entries) == MAX_CLIENTS:
            raise ValueError(f"{where}: more than {MAX_CLIENTS} clients; split the service")
        if len(words) not in (3, 4):
            raise ValueError(
                f"{where}: write 'CLIENT_ID CLASS TOKEN_SHA256 [MAX_RPS]' ({len(words)} words)"
            )
        max_rps = 0.0
        if len(words) == 4:
            try:
                max_rps = float(words[3])
            except ValueError:
                raise ValueError(f"{where}: MAX_RPS {quote(words[3])} is not a number") from None
        try:
            entries.append(client_entry(words[0], words[1], words[2], max_rps))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        numbers.append(number)
    check_unique(entries, lambda index: f"{source} line {numbers[index]}")
    return tuple(entries)


def parse_generation(text: str) -> int:
    """The generation `text`'s first line carries (``# generation N``); 0 when it carries
    none (or one out of 1..`MAX_GENERATION`: a comment like any other)."""
    first = text.split("\n", 1)[0].strip()
    match = _GENERATION.fullmatch(first)
    if match is None:
        return 0
    generation = int(match.group(1))
    return generation if generation <= MAX_GENERATION else 0


def format_clients(entries: Iterable[ClientEntry], generation: int = 0) -> str:
    """A clients file listing `entries` (which `parse_clients` reads back as they are),
    its first line ``# generation N`` when `generation` (1..`MAX_GENERATION`) is given."""
    lines = ["# CLIENT_ID CLASS TOKEN_SHA256 MAX_RPS (written by the node daemon)"]
    if generation:
        if not 0 < generation <= MAX_GENERATION:
            raise ValueError(f"a generation must be within 1..{MAX_GENERATION}")
        lines.insert(0, f"# generation {generation}")
    for e in entries:
        lines.append(f"{e.client_id} {e.priority_class} {e.token_sha256} {e.max_rps!r}")
    return "\n".join(lines) + "\n"


def read_clients_file(path: Path) -> tuple[ClientEntry, ...]:
    """The entries of the clients file at `path` (`read_clients`). Blocking."""
    return read_clients(path).entries


def read_clients(path: Path) -> ClientsFile:
    """The clients file at `path`: no entries, generation 0, when it does not exist.
    ValueError naming the path (and the line) when it cannot be read or does not parse.
    Blocking."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return ClientsFile()
    except OSError as err:
        raise ValueError(f"clients file {path}: cannot be read ({err.strerror})") from err
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"clients file {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        raise ValueError(f"clients file {path}: not UTF-8 text") from err
    return ClientsFile(parse_clients(text, f"clients file {path}"), parse_generation(text))


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What changes whenever the file is written or replaced; None when it is missing."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size


async def watch_clients_file(
    path: Path,
    table: ClientTable,
    apply: Callable[[ClientTable], None],
    interval_s: float = POLL_INTERVAL_S,
    reload: asyncio.Event | None = None,
) -> NoReturn:
    """Read `path` again whenever `reload` is set (the replica's `RELOAD_SIGNAL` handler
    sets it) and whenever its status changes (polled every `interval_s`; and once at first,
    in case it changed since `table` was read), and `apply` each new table: new entries or
    a new generation. A reading that fails keeps the table before it (logged with the
    reason and the line). Runs until cancelled."""
    if reload is None:
        reload = asyncio.Event()
    seen: object = object()
    while True:
        # Cleared before the reading: a signal that arrives during it reads once more.
        told = reload.is_set()
        reload.clear()
        stamp = _stamp(path)
        if told or stamp != seen:
            seen = stamp
            try:
                read = await asyncio.to_thread(read_clients, path)
            except ValueError as err:
                logger.error("%s; keeping the %d clients read before", err, len(table.entries))
            else:
                if (read.entries, read.generation) != (table.entries, table.generation):
                    table = ClientTable(read.entries, table, read.generation)
                    apply(table)
                    logger.info(
                        "clients file %s: %d clients, generation %d%s",
                        path,
                        len(read.entries),
                        read.generation,
                        " (signalled)" if told else "",
                    )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reload.wait(), interval_s)
