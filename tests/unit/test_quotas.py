"""Per-client quotas (`broker.quotas`): each refusal is RESOURCE_EXHAUSTED's domain error and
names the limit and the flag that sets it."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.errors import ResourceExhausted
from broker.quotas import (
    ClientLimits,
    Quotas,
    Slots,
    StagedBytes,
    check_deployments,
    check_model_bytes,
    check_model_bytes_while_staging,
    within_idle_timeout,
)
from broker.server import config_from_args
from edge_client.cli import build_parser


def test_deployments_up_to_the_limit() -> None:
    quotas = Quotas(deployments=3)
    check_deployments(quotas, "alice", 2)
    with pytest.raises(ResourceExhausted, match=r"alice has 3 deployments, its limit "
                       r"\(--max-deployments-per-client 3\)"):  # fmt: skip
        check_deployments(quotas, "alice", 3)


def test_model_bytes_up_to_the_limit() -> None:
    quotas = Quotas(model_bytes=1000)
    check_model_bytes(quotas, "alice", 600, 400)
    with pytest.raises(ResourceExhausted, match=r"to 1001 bytes, over its limit "
                       r"\(--max-model-bytes-per-client 1000\)"):  # fmt: skip
        check_model_bytes(quotas, "alice", 600, 401)


def test_model_bytes_while_staging_count_the_uploads_under_way() -> None:
    quotas = Quotas(model_bytes=1000)
    check_model_bytes_while_staging(quotas, "alice", 600, 300, 100)
    with pytest.raises(ResourceExhausted, match=r"--max-model-bytes-per-client 1000\) with this"):
        check_model_bytes_while_staging(quotas, "alice", 600, 300, 101)


def test_staged_bytes_are_capped_per_client_and_broker_wide_and_given_back() -> None:
    staged = StagedBytes(total_cap=100, per_client_cap=60)
    staged.take("alice", 60)
    with pytest.raises(
        ResourceExhausted, match=r"alice's .*--max-staged-upload-bytes-per-client 60"
    ):
        staged.take("alice", 1)
    staged.take("bob", 40)
    with pytest.raises(ResourceExhausted, match=r"broker's .*\(--max-staged-upload-bytes 100\)"):
        staged.take("carol", 1)
    assert (staged.total, staged.of("alice"), staged.of("carol")) == (100, 60, 0)
    staged.give_back("alice", 60)
    staged.take("carol", 1)
    with pytest.raises(ValueError, match="more staged bytes than it holds"):
        staged.give_back("bob", 41)
    staged.give_back("bob", 40)
    staged.give_back("carol", 1)
    assert staged.total == 0


def test_slots_are_per_client_and_released_whatever_ends_the_block() -> None:
    slots = Slots(2, "uploads", "--max-uploads-per-client")
    full = r"alice has 2 uploads open, its limit \(--max-uploads-per-client 2\)"
    with (
        slots.hold("alice"),
        slots.hold("alice"),
        slots.hold("bob"),
        pytest.raises(ResourceExhausted, match=full),
        slots.hold("alice"),
    ):
        pass
    with pytest.raises(RuntimeError), slots.hold("alice"), slots.hold("alice"):
        raise RuntimeError("the upload failed")
    with slots.hold("alice"), slots.hold("alice"):
        pass


def test_client_limits_use_their_quotas() -> None:
    limits = ClientLimits(Quotas(uploads=1, watch_streams=1))
    with (
        limits.uploads.hold("alice"),
        pytest.raises(ResourceExhausted, match="--max-uploads-per-client 1"),
        limits.uploads.hold("alice"),
    ):
        pass
    with (
        limits.watch_streams.hold("alice"),
        pytest.raises(ResourceExhausted, match="--max-watch-streams-per-client 1"),
        limits.watch_streams.hold("alice"),
    ):
        pass


@pytest.mark.parametrize(
    "fields",
    [{"deployments": 0}, {"model_bytes": -1}, {"uploads": 0}, {"watch_streams": 0},
     {"upload_idle_timeout_s": 0}, {"upload_idle_timeout_s": float("inf")},
     {"upload_idle_timeout_s": float("nan")}, {"staged_bytes": 0}],
)  # fmt: skip
def test_quotas_that_would_refuse_everything_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        Quotas(**fields)  # type: ignore[arg-type]


async def test_a_stream_that_stalls_is_cut_off() -> None:
    resume = asyncio.Event()

    async def chunks() -> AsyncIterator[int]:
        yield 1
        yield 2
        await resume.wait()
        yield 3

    seen = []
    with pytest.raises(ResourceExhausted, match=r"no chunk for 0.05 s \(--upload-idle-timeout\)"):
        async for item in within_idle_timeout(chunks(), 0.05):
            seen.append(item)
    assert seen == [1, 2]


async def test_a_stream_that_keeps_sending_goes_through() -> None:
    async def chunks() -> AsyncIterator[int]:
        for item in range(5):
            await asyncio.sleep(0)
            yield item

    assert [item async for item in within_idle_timeout(chunks(), 5.0)] == [0, 1, 2, 3, 4]


def _broker_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    (tmp_path / "join-token").write_text("join-token-for-tests-0123456789")
    return build_parser().parse_args(
        [
            "broker", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path), "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(tmp_path / "join-token"), *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-staged-upload-bytes", "0"], "--max-staged-upload-bytes 0 must be a positive"),
        (["--max-staged-upload-bytes-per-client", "-1"], "per-client -1 must be a positive"),
        (["--max-model-bytes", "0"], "--max-model-bytes 0 must be a positive"),
        (
            ["--max-model-bytes", "2000", "--max-staged-upload-bytes", "1000"],
            "--max-staged-upload-bytes 1000 is below --max-model-bytes 2000",
        ),
        (
            ["--max-model-bytes", "2000", "--max-staged-upload-bytes-per-client", "1999"],
            "per-client 1999 is below --max-model-bytes 2000: a model that large could never",
        ),
    ],
)
def test_upload_caps_are_checked(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_broker_args(tmp_path, *argv))


def test_a_bad_upload_cap_exits_2_with_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _broker_args(tmp_path, "--max-staged-upload-bytes", "0")
    assert args.func(args) == 2
    assert "offload broker: --max-staged-upload-bytes 0 must be" in capsys.readouterr().err
