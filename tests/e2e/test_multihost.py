"""The README's multi-host quickstart, on three hosts made of network namespaces.

A broker "host" (10.77.N.1), two GPU "hosts" at two sites (10.77.N.2 factory, 10.77.N.3
depot) and a device (10.77.N.4), joined by a bridge. Each step runs the
commands the README gives, with two substitutions it names itself: GPUs from a topology
capture instead of NVML (no GPU here), and the process runtime (a Docker engine publishes
ports in its own namespace, not in the node's). Every channel is TLS, with certificates
`offload certs` makes, as the README does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from edge_client.demo.cluster import CAPTURES

PYTHON = [sys.executable, "-m", "edge_client.cli"]
CLUSTER_YAML = """\
sites: [factory, depot]
links:
  - {a: factory, b: depot, latency_ms: 12}
"""


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=60)


def netns_available() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns)"
    probe = f"eo-probe-{secrets.token_hex(2)}"
    done = sh("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"ip netns add failed: {done.stderr.strip()}"
    sh("ip", "netns", "delete", probe)
    return None


@contextlib.contextmanager
def hosts(count: int) -> Iterator[tuple[list[str], list[str]]]:
    """`count` namespaces joined by a bridge that lives in a namespace of its own (the host's
    firewall, Docker's FORWARD DROP included, never sees the traffic); yields (namespaces,
    their addresses)."""
    tag = secrets.token_hex(2)
    subnet = 10 + int(tag, 16) % 200
    switch = f"eo-{tag}-switch"
    names = [f"eo-{tag}-{i}" for i in range(count)]
    addresses = [f"10.77.{subnet}.{i + 1}" for i in range(count)]
    try:
        sh("ip", "netns", "add", switch)
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(names, addresses, strict=True)):
            sh("ip", "netns", "add", name)
            sh("ip", "-n", switch, "link", "add", f"port{i}", "type", "veth",
               "peer", "name", "eth0", "netns", name)  # fmt: skip
            sh("ip", "-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
            sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
        yield names, addresses
    finally:
        for name in (*names, switch):
            sh("ip", "netns", "delete", name, check=False)


def start(namespace: str, args: list[str], log: Path, ready: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *PYTHON, *args],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if re.search(ready, log.read_text(errors="replace")):
            return process
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise AssertionError(f"no {ready!r} in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def on_device(namespace: str, *args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, *PYTHON, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, f"offload {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def test_the_readme_quickstart_on_three_hosts(tmp_path: Path) -> None:
    if reason := netns_available():
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host test cannot run: {reason}")
        pytest.skip(reason)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for line in (
        "offload certs init --dir ca",
        "offload certs issue broker --role broker --ca-dir ca --out-dir tls --ip 10.0.0.1",
        "offload certs issue gpu-factory --role node --ca-dir ca --out-dir tls --ip 10.0.0.2",
        "--listen 0.0.0.0:7000 --node-listen 0.0.0.0:7001 --ops-listen 0.0.0.0:8080",
        "--tls-cert tls/broker.pem --tls-key tls/broker-key.pem --tls-ca ca/ca.pem",
        "--api-keys-file api.keys --ops-token-file ops.token",
        "--listen 0.0.0.0:7070 --advertise-host 10.0.0.2 --site factory",
        "--broker 10.0.0.1:7001",
        "--tls-cert gpu-factory.pem --tls-key gpu-factory-key.pem --tls-ca ca.pem",
        "OFFLOAD_TLS_CA=ca.pem",
        "offload deploy model.onnx --site factory --gpus 1",
        "offload move robot-1 --site depot",
    ):
        assert line in readme, f"the README no longer says {line!r}: update this test"

    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model, seed=3)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    for secret in ("join.token", "ops.token"):
        (tmp_path / secret).write_text(secrets.token_hex(24) + "\n")
        (tmp_path / secret).chmod(0o600)
    key = subprocess.run(
        [*PYTHON, "keygen", "robot-1"], capture_output=True, text=True, check=True
    ).stdout
    (tmp_path / "api.keys").write_text(key)
    (tmp_path / "robot.key").write_text(key)
    processes: list[subprocess.Popen[bytes]] = []
    with hosts(4) as (names, addresses):
        broker_ns, factory_ns, depot_ns, device_ns = names
        broker_ip, factory_ip, depot_ip, _ = addresses

        def device(*args: str, env: dict[str, str]) -> str:
            return on_device(device_ns, *args, env=env)

        ca, tls = tmp_path / "ca", tmp_path / "tls"
        subprocess.run([*PYTHON, "certs", "init", "--dir", str(ca)], check=True)
        for name, ip, role in (
            ("broker", broker_ip, "broker"),
            ("gpu-factory", factory_ip, "node"),
            ("gpu-depot", depot_ip, "node"),
        ):
            subprocess.run([*PYTHON, "certs", "issue", name, "--role", role,
                            "--ca-dir", str(ca), "--out-dir", str(tls), "--ip", ip],
                           check=True)  # fmt: skip

        def tls_flags(name: str) -> list[str]:
            return [
                "--tls-cert", str(tls / f"{name}.pem"),
                "--tls-key", str(tls / f"{name}-key.pem"),
                "--tls-ca", str(ca / "ca.pem"),
            ]  # fmt: skip

        try:
            processes.append(start(broker_ns, [
                "broker", "--listen", "0.0.0.0:7000", "--node-listen", "0.0.0.0:7001",
                "--ops-listen", "0.0.0.0:8080", *tls_flags("broker"),
                "--state-dir", str(tmp_path / "broker-state"),
                "--cluster", str(tmp_path / "cluster.yaml"),
                "--join-token-file", str(tmp_path / "join.token"),
                "--api-keys-file", str(tmp_path / "api.keys"),
                "--ops-token-file", str(tmp_path / "ops.token"),
                "--cooldown", "0",
            ], tmp_path / "broker.log", r"broker listening on"))  # fmt: skip
            for ns, ip, site in (
                (factory_ns, factory_ip, "factory"),
                (depot_ns, depot_ip, "depot"),
            ):
                processes.append(start(ns, [
                    "node", "--listen", "0.0.0.0:7070", "--advertise-host", ip, "--site", site,
                    "--node-id", f"gpu-{site}",
                    "--topology-file", str(CAPTURES / "12_dgx-a100-8gpu-nv12-10nic-nps4.txt"),
                    "--gpu-spec", "A100-SXM4-40GB:40960", "--runtime", "process",
                    "--state-dir", str(tmp_path / f"{site}-state"),
                    "--broker", f"{broker_ip}:7001",
                    "--join-token-file", str(tmp_path / "join.token"),
                    "--stop-replicas-on-exit", *tls_flags(f"gpu-{site}"),
                ], tmp_path / f"{site}.log", r"registered with broker"))  # fmt: skip

            env = {
                "OFFLOAD_BROKER": f"{broker_ip}:7000",
                "OFFLOAD_API_KEY_FILE": str(tmp_path / "robot.key"),
                "OFFLOAD_OPS": f"https://{broker_ip}:8080",
                "OFFLOAD_OPS_TOKEN_FILE": str(tmp_path / "ops.token"),
                "OFFLOAD_TLS_CA": str(ca / "ca.pem"),
            }
            nodes = json.loads(device("nodes", "--json", env=env))
            assert {(n["node_id"], n["site"], n["state"]) for n in nodes} == {
                ("gpu-factory", "factory", "ready"), ("gpu-depot", "depot", "ready"),
            }  # fmt: skip
            assert all(n["address"].startswith(("10.77.",)) for n in nodes), nodes

            deployed = json.loads(
                device("deploy", str(model), "--site", "factory", "--gpus", "1", "--json", env=env)
            )
            assert deployed["node_id"] == "gpu-factory"
            assert deployed["endpoint"].startswith(f"{factory_ip}:"), deployed
            # The replica serves TLS with its node's certificate, which chains to this CA.
            assert deployed["endpoint_ca"] == (ca / "ca.pem").read_text()

            for name, array in inputs.items():
                np.save(tmp_path / f"{name}.npy", array)
            flags = [f"--input={n}={tmp_path / n}.npy" for n in inputs]
            device("infer", deployed["deployment_id"], *flags, "--output-dir",
                   str(tmp_path / "out"), env=env)  # fmt: skip
            session = ort.InferenceSession(str(model))
            expected = dict(
                zip(
                    [o.name for o in session.get_outputs()], session.run(None, inputs), strict=True
                )
            )

            def assert_answers() -> None:
                for name, array in expected.items():
                    got = np.load(tmp_path / "out" / f"{name}.npy")
                    assert np.allclose(got, array, rtol=1e-4, atol=1e-5), name

            assert_answers()

            moved = device("move", "robot-1", "--site", "depot", env=env)
            assert "migration m-" in moved, moved
            # No client follows the deployment here, so the old replica waits out the drain
            # timeout for an ack before it stops.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                migrations = json.loads(device("migrations", "--json", env=env))
                if migrations[0]["outcome"]:
                    break
                time.sleep(0.5)
            assert [(m["source"], m["target"], m["outcome"]) for m in migrations] == [
                ("gpu-factory", "gpu-depot", "succeeded")
            ]
            listed = json.loads(device("deployments", "--json", env=env))
            assert listed[0]["endpoint"].startswith(f"{depot_ip}:"), listed
            shutil.rmtree(tmp_path / "out")
            device("infer", deployed["deployment_id"], *flags, "--output-dir",
                   str(tmp_path / "out"), env=env)  # fmt: skip
            assert_answers()  # from the replica on the depot host now
            status = device("status", env=env)
            assert "nodes        2 ready" in status, status
            assert "deployments  1 running" in status, status
            assert re.search(r"migrations   1; last m-\w+ succeeded", status), status
        finally:
            for process in reversed(processes):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in processes:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
