"""`runtime.clients`: the clients file's format (its generation line too), its bounds, the
rate limit, the tokens a replica takes from it, and the watch that follows the file as it
changes and when it is told; how the node reads the generation the runtime reports."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from node_daemon.agent import next_generation
from node_daemon.telemetry import clients_generation_of
from runtime.batching import PriorityClass
from runtime.clients import (
    MAX_CLIENTS,
    MAX_GENERATION,
    MAX_RPS_LIMIT,
    RATE_WAIT_S,
    Caller,
    ClientEntry,
    ClientsFile,
    ClientTable,
    RateLimit,
    format_clients,
    parse_clients,
    parse_generation,
    read_clients,
    read_clients_file,
    watch_clients_file,
)
from runtime.metrics import CLIENTS_GENERATION, RuntimeMetrics
from runtime.rpc.auth import INVALID_TOKEN, CallerTokens


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


HASH = sha("client-one-token")


def test_good_lines_give_their_clients() -> None:
    text = (
        "# a comment\n"
        "\n"
        f"c1 critical {HASH} 50\n"
        f"   c_2 best-effort {sha('two')}   \n"
        f"C-3 standard {sha('three')} 0\n"
        f"  # indented comment {sha('four')}\n"
    )
    assert parse_clients(text, "f") == (
        ClientEntry("c1", PriorityClass.CRITICAL, HASH, 50.0),
        ClientEntry("c_2", PriorityClass.BEST_EFFORT, sha("two"), 0.0),
        ClientEntry("C-3", PriorityClass.STANDARD, sha("three"), 0.0),
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param(f"c1 critical {HASH} 5 extra", "write 'CLIENT_ID CLASS", id="words"),
        pytest.param("c1 critical", "(2 words)", id="too-few"),
        pytest.param(f"c.1 critical {HASH}", "client id 'c.1' must be 1 to 64", id="dot"),
        pytest.param(f"{'c' * 65} critical {HASH}", "must be 1 to 64", id="long-id"),
        pytest.param(f"c1 urgent {HASH}", "class 'urgent' must be one of", id="class"),
        pytest.param(f"c1 critical {HASH.upper()}", "64 lowercase hex", id="upper-hash"),
        pytest.param(f"c1 critical {HASH[:-1]}", "64 lowercase hex", id="short-hash"),
        pytest.param(f"c1 critical {HASH} fast", "MAX_RPS 'fast' is not a number", id="rps"),
        pytest.param(f"c1 critical {HASH} nan", "within 0..", id="nan"),
        pytest.param(f"c1 critical {HASH} -1", "within 0..", id="negative"),
        pytest.param(f"c1 critical {HASH} inf", "within 0..", id="inf"),
        pytest.param(f"c1 critical {HASH} {MAX_RPS_LIMIT * 2:g}", "within 0..", id="huge"),
    ],
)
def test_each_bad_line_is_named_without_its_hash(line: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_clients(f"# clients\nc0 standard {sha('zero')}\n{line}\n", "clients file F")
    text = str(caught.value)
    assert text.startswith("clients file F line 3: ") and message in text, text
    assert HASH not in text and HASH.upper() not in text and HASH[:-1] not in text


def test_a_client_or_a_token_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="f line 2: client 'c1' is listed at f line 1 too"):
        parse_clients(f"c1 standard {HASH}\nc1 critical {sha('other')}\n", "f")
    with pytest.raises(ValueError, match="f line 2: the same token hash as f line 1") as caught:
        parse_clients(f"c1 standard {HASH}\nc2 critical {HASH}\n", "f")
    assert HASH not in str(caught.value)


def test_at_most_max_clients_lines() -> None:
    lines = [f"c{i} standard {sha(str(i))}" for i in range(MAX_CLIENTS)]
    assert len(parse_clients("\n".join(lines), "f")) == MAX_CLIENTS
    lines.append(f"one-more standard {sha('more')}")
    with pytest.raises(ValueError, match=f"line {MAX_CLIENTS + 1}: more than {MAX_CLIENTS}"):
        parse_clients("\n".join(lines), "f")


entries = st.lists(
    st.builds(
        ClientEntry,
        client_id=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
        priority_class=st.sampled_from(PriorityClass),
        token_sha256=st.binary(min_size=32, max_size=32).map(bytes.hex),
        max_rps=st.floats(min_value=0, max_value=MAX_RPS_LIMIT),
    ),
    max_size=20,
    unique_by=(lambda e: e.client_id, lambda e: e.token_sha256),
)


@given(entries)
def test_what_the_node_writes_reads_back_as_it_was(listed: list[ClientEntry]) -> None:
    assert parse_clients(format_clients(listed), "f") == tuple(listed)


@given(st.text(max_size=300))
def test_any_text_parses_or_is_refused_with_a_line_number(text: str) -> None:
    try:
        parse_clients(text, "f")
    except ValueError as err:
        assert str(err).startswith("f line ")


def test_a_missing_file_lists_no_clients_and_an_unreadable_one_is_refused(
    tmp_path: Path,
) -> None:
    assert read_clients_file(tmp_path / "absent") == ()
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_clients_file(tmp_path / "binary")
    with pytest.raises(ValueError, match="cannot be read"):
        read_clients_file(tmp_path)  # a folder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_limit_allows_a_second_of_burst_then_paces_then_refuses() -> None:
    clock = Clock()
    limit = RateLimit(4.0, clock)
    # A second's burst at once; the next wait a quarter second each for their token, up to
    # RATE_WAIT_S; past that refused, nothing counted.
    waits = [limit.reserve() for _ in range(4)]
    assert waits == [0.0] * 4
    assert limit.reserve() == pytest.approx(0.25)
    assert limit.reserve() is None and limit.reserve() is None
    clock.now += 0.5  # two calls' worth: the one that waited, and one more now
    assert limit.reserve() == 0.0
    assert limit.reserve() == pytest.approx(0.25)
    clock.now += 60  # never more than the burst
    assert [limit.reserve() for _ in range(5)] == [0.0] * 4 + [pytest.approx(0.25)]
    slow = RateLimit(0.5, clock)  # below one per second: a burst of one
    assert slow.reserve() == 0.0 and slow.reserve() is None  # the next token 2 s off
    clock.now += 2
    assert slow.reserve() == 0.0


def test_a_fast_limit_paces_a_flood_to_its_rate() -> None:
    clock = Clock()
    limit = RateLimit(200.0, clock)
    for _ in range(200):  # the burst
        assert limit.reserve() == 0.0
    # Then calls sent far faster than 200/s (all at one instant): the next 50 wait a
    # growing share of RATE_WAIT_S, the rest are refused.
    waits = [limit.reserve() for _ in range(100)]
    held = [w for w in waits if w is not None]
    assert len(held) == round(RATE_WAIT_S * 200)
    assert held == sorted(held) and max(held) <= RATE_WAIT_S
    clock.now += 1.0  # a second later they have all gone, at 200/s
    assert sum(limit.reserve() == 0.0 for _ in range(200)) == 200 - len(held)


def test_a_client_keeps_its_bucket_while_its_rate_stays() -> None:
    first = ClientTable([ClientEntry("c1", PriorityClass.STANDARD, HASH, 5.0)])
    again = ClientTable([ClientEntry("c1", PriorityClass.CRITICAL, HASH, 5.0)], first)
    faster = ClientTable([ClientEntry("c1", PriorityClass.CRITICAL, HASH, 9.0)], again)
    assert again.callers_by_id["c1"].limit is first.callers_by_id["c1"].limit
    assert faster.callers_by_id["c1"].limit is not first.callers_by_id["c1"].limit
    assert again.callers_by_id["c1"].priority_class is PriorityClass.CRITICAL


def test_the_replica_takes_the_clients_of_the_table_it_was_given_last() -> None:
    tokens = CallerTokens({"deployment-token": PriorityClass.STANDARD})
    bearer = [("authorization", "Bearer client-one-token")]
    assert tokens.caller(bearer) == (None, INVALID_TOKEN)
    tokens.use_clients(ClientTable([ClientEntry("c1", PriorityClass.CRITICAL, HASH)]))
    assert tokens.caller(bearer) == (Caller("c1", PriorityClass.CRITICAL), None)
    assert tokens.caller([("authorization", "Bearer deployment-token")])[0] == Caller(
        "", PriorityClass.STANDARD
    )
    assert tokens.caller([("authorization", f"Bearer {HASH}")]) == (None, INVALID_TOKEN)
    assert tokens.caller([("authorization", "client-one-token")]) == (None, INVALID_TOKEN)
    tokens.use_clients(ClientTable())
    assert tokens.caller(bearer) == (None, INVALID_TOKEN)


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def write(path: Path, text: str) -> None:
    """As the node does: a new file renamed over the old."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


async def test_the_watch_follows_the_file_and_keeps_the_last_good_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "clients"
    tables: list[ClientTable] = []
    watch = asyncio.create_task(watch_clients_file(path, ClientTable(), tables.append, 0.01))
    try:
        write(path, f"c1 standard {HASH}\n")
        await wait_for(lambda: bool(tables) and tables[-1].ids == {"c1"}, "c1 never taken")
        write(path, f"c1 standard {HASH}\nc2 critical {sha('two')} 10\n")
        await wait_for(lambda: tables[-1].ids == {"c1", "c2"}, "c2 never taken")
        seen = len(tables)
        write(path, f"c1 standard {HASH}\nc3 critical {HASH}\n")
        await wait_for(lambda: "line 2" in caplog.text, "the broken file was not reported")
        assert len(tables) == seen and "keeping the 2 clients read before" in caplog.text
        assert HASH not in caplog.text
        path.unlink()
        await wait_for(lambda: tables[-1].ids == frozenset(), "a missing file kept clients")
    finally:
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch


def test_the_generation_is_the_first_line_and_a_comment_to_other_readers(tmp_path: Path) -> None:
    entries = (ClientEntry("c1", PriorityClass.CRITICAL, HASH, 2.5),)
    text = format_clients(entries, 42)
    assert text.splitlines()[0] == "# generation 42"
    assert parse_generation(text) == 42
    assert parse_clients(text, "f") == entries  # a comment to the entries' parser
    path = tmp_path / "clients"
    path.write_text(text)
    assert read_clients(path) == ClientsFile(entries, 42)
    assert read_clients(tmp_path / "missing") == ClientsFile((), 0)
    assert parse_generation(format_clients(entries)) == 0
    assert parse_generation(format_clients(entries, MAX_GENERATION)) == MAX_GENERATION
    with pytest.raises(ValueError, match="a generation must be within"):
        format_clients(entries, MAX_GENERATION + 1)
    # Anything else is a comment like any other: no generation.
    for other in (
        f"# CLIENT_ID ...\n# generation 7\nc1 critical {HASH}\n",
        "# generation seven\n",
        "# generation -7\n",
        f"# generation {MAX_GENERATION + 1}\n",
        "# generation 12345678901234567\n",
        "#generation 7\n",
    ):
        assert parse_generation(other) == 0, other
    assert parse_generation("  # generation 7  \r\n") == 7


def test_the_node_reads_the_generation_the_runtime_reports() -> None:
    metrics = RuntimeMetrics()
    page = generate_latest(metrics.registry.restricted_registry([CLIENTS_GENERATION])).decode()
    assert clients_generation_of(page) == 0  # before any file with one
    for generation in (1, 1_764_913_994_123_456, MAX_GENERATION):
        metrics.clients_generation.set(generation)
        page = generate_latest(metrics.registry).decode()
        assert clients_generation_of(page) == generation
    # A runtime older than the gauge, or a value no node wrote: none.
    assert clients_generation_of("offload_runtime_requests_total 3.0\n") is None
    assert clients_generation_of(f"{CLIENTS_GENERATION} 1.5\n") is None
    assert clients_generation_of(f"{CLIENTS_GENERATION} NaN\n") is None


def test_each_generation_the_node_writes_is_above_the_one_before() -> None:
    generations = [next_generation(0)]
    for _ in range(1000):
        generations.append(next_generation(generations[-1]))
    assert generations == sorted(set(generations))
    assert next_generation(MAX_GENERATION - 5) == MAX_GENERATION - 4  # a clock behind
    assert next_generation(MAX_GENERATION) == MAX_GENERATION


async def test_the_watch_reads_the_file_when_told_and_reports_its_generation(
    tmp_path: Path,
) -> None:
    path = tmp_path / "clients"
    entries = (ClientEntry("c1", PriorityClass.STANDARD, HASH),)
    tables: list[ClientTable] = []
    reload = asyncio.Event()
    # A poll an hour apart: after its first reading, only `reload` has it read the file.
    watch = asyncio.create_task(
        watch_clients_file(path, ClientTable(), tables.append, 3600, reload)
    )
    try:
        for generation in (5, 6, 7):
            # The same entries each time: the new generation alone is a new table.
            write(path, format_clients(entries, generation))
            reload.set()
            await wait_for(generation_taken(tables, generation), f"{generation} never taken")
            assert tables[-1].entries == entries
        # A file without one (an older node's) takes generation 0.
        write(path, format_clients(()))
        reload.set()
        await wait_for(generation_taken(tables, 0), "generation 0 never taken")
        assert tables[-1].entries == ()
    finally:
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch


def generation_taken(tables: list[ClientTable], generation: int) -> Callable[[], bool]:
    return lambda: bool(tables) and tables[-1].generation == generation
