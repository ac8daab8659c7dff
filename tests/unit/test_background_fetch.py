"""A background start's model is fetched at the node's background rate (`Pace`,
`BrokerLink.fetch_model`), and the rate's flag is checked."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from edge_client.cli import build_parser
from node_daemon import broker_link
from node_daemon.broker_link import BrokerLink, Pace
from node_daemon.model_cache import ModelCache
from node_daemon.server import settings_from_args
from protos.offload.v1 import broker_pb2 as bpb
from protos.offload.v1 import broker_pb2_grpc as bpb_grpc
from protos.offload.v1 import node_pb2 as npb
from tests.unit.test_broker_link import null_node, serve

CHUNK = 256 * 1024


def test_pace_waits_until_the_bytes_so_far_fit_the_rate() -> None:
    pace = Pace(1_000_000, start=100.0)
    assert pace.wait_s(250_000, now=100.05) == pytest.approx(0.20)  # due at 100.25
    assert pace.wait_s(250_000, now=100.25) == pytest.approx(0.25)  # due at 100.5
    # Behind the rate (a slow chunk): no wait until the bytes are back within it.
    assert pace.wait_s(250_000, now=101.0) == 0.0
    assert pace.wait_s(500_000, now=101.0) == pytest.approx(0.25)  # 1.25 MB due at 101.25


class Models(bpb_grpc.NodeRegistryServicer):
    """A broker's FetchModel over one model, in CHUNK-sized pieces."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.sha256 = hashlib.sha256(data).hexdigest()

    async def FetchModel(
        self, request: bpb.FetchModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[npb.ModelChunk]:
        if request.sha256 != self.sha256:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        for at in range(0, len(self.data), CHUNK):
            yield npb.ModelChunk(data=self.data[at : at + CHUNK])


async def fetch(
    tmp_path: Path, models: Models, rate: float, background: bool, max_bytes: int = 2**30
) -> ModelCache:
    """`models`' one model fetched by a node's link at background rate `rate` (bytes/s)."""
    server, port = await serve(models)
    cache = ModelCache(tmp_path / "models", max_bytes)
    link = BrokerLink(
        f"127.0.0.1:{port}",
        "join-token",
        null_node(cache),
        "127.0.0.1:2",
        background_fetch_bytes_per_s=rate,
    )
    try:
        await link.fetch_model(models.sha256, background)
    finally:
        await link.close()
        await server.stop(None)
    return cache


@pytest.mark.parametrize(
    ("background", "rate", "paced"), [(True, 20e6, True), (False, 20e6, False), (True, 0.0, False)]
)
async def test_a_fetched_model_is_whole_and_the_log_says_when_it_was_paced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, background: bool, rate: float, paced: bool
) -> None:
    """Paced: a background fetch on a link with a rate; at rate 0 it comes as fast as it can."""
    models = Models(bytes(range(256)) * (5 * CHUNK // 256 + 7))
    with caplog.at_level(logging.INFO, logger="node_daemon.broker_link"):
        cache = await fetch(tmp_path, models, rate, background)
    assert cache.path(models.sha256).read_bytes() == models.data
    fetched = [r.getMessage() for r in caplog.records if "fetched from broker" in r.getMessage()]
    assert len(fetched) == 1
    assert fetched[0].endswith(" MB/s (background)") == paced, fetched[0]
    assert fetched[0].endswith(" at 20 MB/s (background)") == paced


async def test_a_paced_fetch_has_the_time_its_rate_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch's deadline grows by the largest model's time at the rate: 1.3 MB at 2 MB/s
    takes 0.65 s, past a 0.3 s base deadline, within 0.3 s + 4 MB / 2 MB/s."""
    monkeypatch.setattr(broker_link, "FETCH_TIMEOUT_S", 0.3)
    models = Models(bytes(range(256)) * (5 * CHUNK // 256))
    cache = await fetch(tmp_path, models, 2e6, background=True, max_bytes=4_000_000)
    assert cache.path(models.sha256).read_bytes() == models.data


def test_a_negative_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="negative fetch rate"):
        BrokerLink("127.0.0.1:1", "t", None, "127.0.0.1:2", background_fetch_bytes_per_s=-1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "accepted"), [("25", 25.0), ("0", 0.0), ("-3", None), ("nan", None)]
)
def test_the_background_fetch_rate_flag(
    tmp_path: Path, value: str, accepted: float | None
) -> None:
    flags = [
        "node", "--listen", "127.0.0.1:0", "--site", "site-a",
        "--state-dir", str(tmp_path), "--background-fetch-rate", value,
    ]  # fmt: skip
    args = build_parser().parse_args(flags)
    if accepted is None:
        with pytest.raises(ValueError, match=f"--background-fetch-rate {value}"):
            settings_from_args(args)
    else:
        assert settings_from_args(args).background_fetch_mb_s == accepted
