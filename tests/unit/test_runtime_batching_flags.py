"""The runtime's batching and priority flags: nonsense refused at start naming the flag,
the class tokens file read without ever quoting a token, and each token's class."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.batching import DEPLOYMENT, PriorityClass
from runtime.clients import Caller, ClientEntry
from runtime.rpc.auth import MISSING_TOKEN, CallerTokens
from runtime.server import settings_from_args


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not read by the flag checks")
    token = tmp_path / "token"
    token.write_text("deployment-token")
    return ["--model", str(model), "--token-file", str(token), "--host", "127.0.0.1"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-batch-size", "0"),
        ("--max-batch-size", "-4"),
        ("--max-batch-size", "nan"),
        ("--max-batch-size", "100000000"),
        ("--max-queue-delay-us", "-1"),
        ("--max-queue-delay-us", "nan"),
        ("--max-queue-delay-us", "inf"),
        ("--max-queue-delay-us", "1e12"),
        ("--instances", "0"),
        ("--instances", "1000"),
        ("--max-queued-per-class", "0"),
        ("--max-queued-per-class", "1e9"),
        ("--max-class-wait-ms", "-5"),
        ("--max-class-wait-ms", "NaN"),
        ("--priority-class", "urgent"),
    ],
)
def test_nonsense_is_refused_at_start_naming_the_flag(
    base: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        settings_from_args([*base, flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_the_flags_reach_the_settings(base: list[str], tmp_path: Path) -> None:
    tokens = tmp_path / "class-tokens"
    tokens.write_text("# clients sharing the replica\ncritical tok-a\n\nbest-effort tok-b\n")
    settings = settings_from_args(
        [*base, "--max-batch-size", "16", "--max-queue-delay-us", "500", "--instances", "2",
         "--max-queued-per-class", "9", "--max-class-wait-ms", "40", "--priority-class",
         "critical", "--class-tokens", str(tokens), "--io-binding"]
    )  # fmt: skip
    assert settings.max_batch_size == 16
    assert settings.batching.max_queue_delay_s == pytest.approx(0.0005)
    assert settings.batching.instances == 2
    assert settings.batching.max_queued_per_class == 9
    assert settings.batching.max_class_wait_s == pytest.approx(0.04)
    assert settings.priority_class is PriorityClass.CRITICAL
    assert settings.io_binding
    assert settings.class_tokens == {
        "tok-a": PriorityClass.CRITICAL,
        "tok-b": PriorityClass.BEST_EFFORT,
    }
    assert settings_from_args(base).max_batch_size is None  # auto


def test_a_bad_class_tokens_line_is_named_without_its_token(
    base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "class-tokens"
    tokens.write_text("critical tok-a\nurgent s3cret-value\n")
    with pytest.raises(SystemExit):
        settings_from_args([*base, "--class-tokens", str(tokens)])
    err = capsys.readouterr().err
    assert "line 2" in err and "s3cret-value" not in err


def test_each_token_says_its_callers_class() -> None:
    tokens = CallerTokens({"dep": PriorityClass.STANDARD, "crit": PriorityClass.CRITICAL})
    critical = Caller(DEPLOYMENT, PriorityClass.CRITICAL)
    assert tokens.caller([("authorization", "Bearer crit")]) == (critical, None)
    standard = Caller(DEPLOYMENT, PriorityClass.STANDARD)
    assert tokens.caller([("authorization", b"Bearer dep")]) == (standard, None)
    assert tokens.caller([("authorization", "Bearer critical")])[1] == (
        "invalid token for this deployment"
    )
    assert tokens.caller([]) == (None, MISSING_TOKEN)
    with pytest.raises(ValueError, match="must not be empty"):
        CallerTokens({"": PriorityClass.STANDARD})


def test_help_explains_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        settings_from_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-batch-size N" in text and "10 % quicker at load" in text
    assert "--class-tokens FILE" in text and "--max-queued-per-class N" in text


def test_the_clients_file_is_read_at_start_and_a_bad_line_stops_it(
    base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clients = tmp_path / "clients"
    digest = "ab" * 32
    clients.write_text(f"c1 critical {digest} 5\n")
    settings = settings_from_args([*base, "--clients-file", str(clients)])
    assert settings.clients_file == clients
    assert settings.clients == (ClientEntry("c1", PriorityClass.CRITICAL, digest, 5.0),)
    # Missing at start: no clients yet (the node writes the file before it starts a replica).
    missing = settings_from_args([*base, "--clients-file", str(tmp_path / "none")])
    assert missing.clients == ()
    clients.write_text(f"c1 critical {digest}\nc2 urgent {digest[::-1]}\n")
    with pytest.raises(SystemExit):
        settings_from_args([*base, "--clients-file", str(clients)])
    err = capsys.readouterr().err
    assert "line 2: class 'urgent' must be one of" in err and digest[::-1] not in err
    with pytest.raises(SystemExit):
        settings_from_args(["--help"])
    assert "--clients-file PATH" in capsys.readouterr().out
