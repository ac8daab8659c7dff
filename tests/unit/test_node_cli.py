"""`offload node` refuses inconsistent flags before it starts anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.certs import issue, make_ca, write_new
from edge_client.cli import build_parser
from node_daemon.server import format_cpuset, parse_cpuset, settings_from_args, split_cpus


def settings(*argv: str) -> object:
    return settings_from_args(build_parser().parse_args(["node", *argv]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "127.0.0.1:0", "--site", "a", "--topology-file", "x"], "needs --gpu-spec"),
        (["--listen", "127.0.0.1:0", "--site", "a", "--gpu-spec", "A:1"], "only goes with"),
        (["--listen", "127.0.0.1", "--site", "a"], "is not host:port"),
        (["--listen", "0.0.0.0:7000", "--site", "a"], "give --agent-token-file"),
        (["--listen", "127.0.0.1:0", "--site", "a", "--max-model-bytes", "0"], "positive"),
        (["--listen", "127.0.0.1:0", "--site", "a", "--topology-file", "x", "--gpu-spec", "A"],
         "expected NAME:MIB"),
        (["--listen", "127.0.0.1:0", "--site", "a", "--broker", "b1:7000,b2",
          "--join-token-file", "t"], "--broker: 'b2' is not host:port"),
    ],
)  # fmt: skip
def test_bad_flags_say_what_is_wrong(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(*argv)


def test_defaults(tmp_path: Path) -> None:
    s = settings("--listen", "127.0.0.1:0", "--site", "a", "--node-id", "n1")
    assert s.replica_host == "127.0.0.1"
    assert s.state_dir.parts[-2:] == ("edge-offload", "n1")
    assert (s.runtime, s.network, s.stop_replicas_on_exit) == ("auto", "bridge", False)


def test_a_cpuset_is_a_list_of_cpus_this_process_may_use() -> None:
    base = ("--listen", "127.0.0.1:0", "--site", "a")
    first = min(os.sched_getaffinity(0))
    assert settings(*base, "--cpuset", str(first)).cpuset == frozenset({first})
    assert settings(*base).cpuset == frozenset()
    for bad in ("x", "3-1", "-1", "0,,1"):
        with pytest.raises(ValueError, match=f"--cpuset '{re.escape(bad)}' is not a CPU list"):
            settings(*base, "--cpuset", bad)
    with pytest.raises(ValueError, match="names CPUs this process may not use: \\[4096\\]"):
        settings(*base, "--cpuset", "4096")


def test_a_formatted_cpuset_parses_back_to_the_same_cpus() -> None:
    first = min(os.sched_getaffinity(0))
    assert format_cpuset({first}) == str(first)
    assert format_cpuset([2, 0, 1]) == "0,1,2"
    assert parse_cpuset(format_cpuset(os.sched_getaffinity(0))) == os.sched_getaffinity(0)


def test_cpus_split_in_runs_of_consecutive_cpus_the_first_ones_larger() -> None:
    assert split_cpus([3, 1, 2, 0], 2) == [frozenset({0, 1}), frozenset({2, 3})]
    assert split_cpus(range(8), 3) == [
        frozenset({0, 1, 2}),
        frozenset({3, 4, 5}),
        frozenset({6, 7}),
    ]
    assert split_cpus([4, 9, 6], 3) == [frozenset({4}), frozenset({6}), frozenset({9})]
    with pytest.raises(ValueError, match="2 CPU\\(s\\) cannot be split in 3"):
        split_cpus([0, 1], 3)
    with pytest.raises(ValueError, match="cannot be split in 0"):
        split_cpus([0, 1], 0)


def test_a_resize_policy_needs_a_broker(tmp_path: Path) -> None:
    base = ("--listen", "127.0.0.1:0", "--site", "a")
    assert settings(*base).resize_policy == "static"
    with pytest.raises(ValueError, match="--resize-policy usage needs --broker"):
        settings(*base, "--resize-policy", "usage")
    token = tmp_path / "join-token"
    token.write_text("join-token-0123456789")
    joined = ("--broker", "127.0.0.1:1", "--join-token-file", str(token))
    assert settings(*base, *joined, "--resize-policy", "gain").resize_policy == "gain"
    with pytest.raises(SystemExit):
        settings(*base, *joined, "--resize-policy", "fastest")


def test_bad_flags_exit_2_with_the_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "node", "--listen", "0.0.0.0:7000",
         "--site", "a"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "offload node: --listen 0.0.0.0:7000 is reachable from other hosts" in done.stderr


def test_unreadable_capture_exits_1_naming_the_line(tmp_path: Path) -> None:
    capture = tmp_path / "topo.txt"
    capture.write_text("        GPU0    GPU1\nGPU0     X      NV2\nGPU1    NV2     QQQ\n")
    done = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "node", "--listen", "127.0.0.1:0",
         "--site", "a", "--runtime", "process", "--state-dir", str(tmp_path / "s"),
         "--topology-file", str(capture), "--gpu-spec", "A100:81920"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "line 3" in done.stderr and "Traceback" not in done.stderr


def test_a_plaintext_listener_beyond_loopback_needs_insecure(tmp_path: Path) -> None:
    token = tmp_path / "agent-token"
    token.write_text("agent-token-0123456789")
    base = ("--listen", "0.0.0.0:7000", "--site", "a", "--agent-token-file", str(token))
    with pytest.raises(ValueError, match="reachable from other hosts and no TLS certificate"):
        settings(*base)
    assert settings(*base, "--insecure").tls is None
    ca, ca_key = make_ca("test CA")
    cert, key = issue(ca, ca_key, "n1", ips=["10.0.0.2"])
    for name, data in (("ca.pem", ca), ("n1.pem", cert), ("n1-key.pem", key)):
        write_new(tmp_path / name, data)
    tls = ["--tls-cert", str(tmp_path / "n1.pem"), "--tls-key", str(tmp_path / "n1-key.pem")]
    with pytest.raises(ValueError, match="--tls-cert, --tls-key and --tls-ca go together"):
        settings(*base, *tls)
    configured = settings(*base, *tls, "--tls-ca", str(tmp_path / "ca.pem"))
    assert configured.tls is not None and configured.tls.cert == cert


def test_a_node_with_a_broker_takes_no_agent_token_file(tmp_path: Path) -> None:
    """NodeAgent of a node that joins a broker takes the node secret the broker shows: the
    join token no longer guards it, and an agent token the broker never sends is refused."""
    token = tmp_path / "token"
    token.write_text("join-token-0123456789")
    token.chmod(0o600)
    joined = ("--listen", "127.0.0.1:0", "--site", "a", "--broker", "127.0.0.1:7000")
    joined += ("--join-token-file", str(token))
    assert settings_from_args(build_parser().parse_args(["node", *joined])).agent_token == ""
    with pytest.raises(ValueError, match="--agent-token-file is for a node without --broker"):
        settings(*joined, "--agent-token-file", str(token))
