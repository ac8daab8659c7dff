"""Dynamic batching through a real `python -m runtime.server` process over gRPC: every
request's outputs equal its own unbatched run, with shapes, output selections and bad
requests interleaved (hypothesis), and batches really form."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.batching_support import (
    BAD_KINDS,
    MIXER_OUTPUTS,
    MixedRequest,
    build_mixer,
    send_mixed,
)
from tests.runtime_support import AUTH, spawn_runtime

mixed_requests = st.lists(
    st.builds(
        MixedRequest,
        rows=st.integers(1, 3),
        width=st.sampled_from([2, 5]),
        outputs=st.sampled_from([(), ("y",), ("e", "s"), ("s", "y", "e")]),
        bad=st.sampled_from(["", "", "", *BAD_KINDS]),
        seed=st.integers(0, 1000),
    ),
    min_size=1,
    max_size=24,
)


@pytest.fixture(scope="module")
def mixer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mixer(tmp_path_factory.mktemp("models") / "mixer.onnx")


@pytest.fixture
async def batching_runtime(mixer: Path, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """A runtime process that batches up to 8 rows and holds a batch 20 ms for more, so that
    requests sent together share batches; (its endpoint, its metrics URL)."""
    process, endpoint = await spawn_runtime(
        tmp_path, mixer, "--max-batch-size", "8", "--max-queue-delay-us", "20000"
    )
    try:
        log = (tmp_path / "runtime.log").read_text()
        metrics = re.search(r"metrics served at (\S+)", log)
        assert metrics is not None, log
        assert "batches: up to 8 rows" in log, log
        yield endpoint, metrics.group(1)
    finally:
        process.terminate()
        await process.wait()


def batches_run(metrics_url: str) -> tuple[float, float]:
    """(batches run, rows computed) as the runtime's metrics say."""
    page = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    count = re.search(r'^offload_runtime_batch_size_count\{model="mixer"\} (\S+)$', page, re.M)
    rows = re.search(r'^offload_runtime_batch_size_sum\{model="mixer"\} (\S+)$', page, re.M)
    assert count and rows, page
    return float(count.group(1)), float(rows.group(1))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(requests=mixed_requests)
async def test_each_answer_is_its_own_requests_and_bad_ones_fail_alone(
    batching_runtime: tuple[str, str], mixer: Path, requests: list[MixedRequest]
) -> None:
    endpoint, _ = batching_runtime
    async with grpc.aio.insecure_channel(endpoint) as channel:
        outcome = await send_mixed(
            pb_grpc.GRPCInferenceServiceStub(channel), mixer, requests, AUTH
        )
    assert outcome.mismatches == []
    assert outcome.answered == sum(not r.bad for r in requests)
    assert outcome.refused == sum(bool(r.bad) for r in requests)


async def test_requests_sent_together_share_batches(
    batching_runtime: tuple[str, str], mixer: Path
) -> None:
    endpoint, metrics_url = batching_runtime
    before, rows_before = await asyncio.to_thread(batches_run, metrics_url)
    requests = [MixedRequest(rows=1, width=3, outputs=MIXER_OUTPUTS, seed=i) for i in range(16)]
    async with grpc.aio.insecure_channel(endpoint) as channel:
        outcome = await send_mixed(
            pb_grpc.GRPCInferenceServiceStub(channel), mixer, requests, AUTH
        )
    assert outcome.mismatches == [] and outcome.answered == 16
    after, rows_after = await asyncio.to_thread(batches_run, metrics_url)
    assert rows_after - rows_before == 16
    # 16 one-row requests at once, 8 rows a batch: fewer runs than requests.
    assert after - before < 16
