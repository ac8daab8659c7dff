"""Adaptive offload: a weak device running the model itself against offloading it.

How it is emulated. The device is a container of the runtime image limited with a CFS quota
of N CPUs (`docker run --cpu-quota N*P --cpu-period P`; `bench.offload_device` runs in it).
The period P is 4 ms, not Docker's default 100 ms (`--cpus`): a request's time moves in
steps of a period (the quota runs out and its compute waits for the next one), so a short
period lets a device N times slower compute steadily at that speed. Under 100 ms,
ResNet-18's 38 ms of compute on a quarter CPU took about 110 or about 190 ms, never between;
under 10 ms, MobileNetV2 on a quarter CPU still took about 30 or about 40 ms, in runs of one
or the other, so two samples of the same contender's p50 lay 15 % apart. 4 ms is the
shortest period that gives a quarter CPU the kernel's smallest quota (1 ms); shorter ones
are not steadier but slower (1 ms for the 1-CPU device made ResNet-18 take 55 ms against 35:
CFS hands out quota in slices of 5 ms, `sched_cfs_bandwidth_slice_us`). `--cfs-period-ms
100` gives Docker's default back. The link is our own delaying HTTP CONNECT proxy
(`bench.link`, in this process), which gRPC in the device goes through (`grpc_proxy`): `lan`
adds nothing (the device to node path on loopback, plus the proxy's relay, under a
millisecond per 602 KB request), `slow` adds delay each way and a bandwidth limit. Not `tc
netem`: it does not work on this machine. One process runs the broker and a CPU node daemon
on loopback (process runtime: the replica runs unconstrained, as on a normal node). Models:
the ResNet-18-shaped CNN, the MobileNetV2-shaped CNN, PP-OCRv4 recognition (pretrained).

Contenders, in one device container per size and model (full mode: 10 rounds of 5
requests each; --quick: 6 rounds of 4), requests one after another. The contenders compared
on a link take turns request by request (ours, remote and fastest on `lan`; ours, remote
and fastest again on `slow`; the order within a turn varied from turn to turn, balanced
for who follows whom), so that
machine noise falls on them alike; the local baselines of the speedup run in rows of their
own, back to back, as a device computing alone does (`plan`):

  - ORT default: plain `onnxruntime.InferenceSession(path)`, no session options (ORT's
    default threads, one per core the container sees, and its default spinning): what a
    device user runs without us;
  - ours (local): `OffloadClient(policy="local")`, as tuned: one intra-op thread per whole
    CPU of the device (at least one), no spinning (`runtime.model.OnnxModel`);
  - remote: `OffloadClient(policy="remote")`, on `lan` and on `slow`;
  - fastest: `OffloadClient(policy="fastest")`, one client per link keeping its state
    across its turns (its probes of the losing side included), warmed up until it has
    measured and compared both sides;
  - ours and remote again, in the same turns: the better side's second sample over its
    first is printed beside each fastest ratio, the noise that ratio is read against;
    beside it too, the p50 of `fastest`'s own requests that ran on the better side, over
    that side's: what its choices cost apart from the requests it sent elsewhere.

speedup = local p50 (in a row) / remote p50 on `lan`, against each local baseline.
fastest/best = fastest p50 / min(ours p50, remote p50), each timed in that link's turns
(target <= 1.10). Then `switch`: a fresh `fastest` client through lan -> slow -> lan,
counting the requests it took to move to local and back. Published anchors: AVEC (offloading
to a remote accelerator) up to 7x faster than on the device; Neurosurgeon (partitioned DNNs,
mobile + server) 3.1x faster on average, up to 40.7x, than cloud-only. The target (issue 16)
is >= 6x for the CNN on the 0.25-CPU device.

    python -m bench.offload [--quick] [--cfs-period-ms MS] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import modelzoo
from bench.link import Conditions, DelayLink
from bench.migration import JOIN_TOKEN, join_node
from bench.timing import percentiles
from broker.server import BrokerConfig, RunningBroker, start_broker
from edge_client.client import OffloadClient
from images.build import ImageBuildError, build_image
from node_daemon.inventory import GpuSpec

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet18", "mobilenetv2", "ppocr_rec")
CPUS = (0.25, 0.5, 1.0)
LINKS = {
    "lan": Conditions(),
    "slow": Conditions(delay_ms=100.0, rate_mbit=10.0),
}
CLUSTER_YAML = "sites: [site-a]\nlinks: []\n"
CLIENT_ID = "bench-offload"
API_KEY = f"{CLIENT_ID}.bench-offload-secret-0123456789"
CFS_PERIOD_MS = 4.0
"""The device's CFS period (Docker's default is 100 ms; module docstring)."""
CFS_MIN_US = 1000
"""The kernel's smallest CFS period and quota (`cpu.cfs_period_us`, `cpu.cfs_quota_us`)."""
CFS_MAX_PERIOD_US = 1_000_000
"""The kernel's largest CFS period."""
CAPTURE = "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"
TARGET_SPEEDUP = 6.0
TARGET_FASTEST = 1.10
AVEC_SPEEDUP = 7.0
NEUROSURGEON = "3.1x avg, up to 40.7x (vs cloud-only)"
DEVICE_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class Mode:
    cpus: tuple[float, ...]
    models: tuple[str, ...]
    warmup: int
    """Requests per baseline before the rounds; each `fastest` client warms up until it has
    compared its two sides (`bench.offload_device.until_compared`)."""
    rounds: int
    per_round: int
    """Requests per contender per round (the turns of its unit, `plan`)."""
    per_round_slow: int
    """Requests per round of remote on the slow link (each takes most of a second)."""
    n_switch: int
    """Requests per phase of the switch run."""
    switch_cpus: tuple[float, ...]


# Contenders judged against each other take turns request by request: noise lasting a few
# requests (a burst of slow round trips, a quota spent early in its period) then falls on
# all of them, not on one contender's block.
FULL = Mode(CPUS, MODELS, warmup=3, rounds=10, per_round=5, per_round_slow=2, n_switch=40,
            switch_cpus=CPUS)  # fmt: skip
QUICK = Mode((0.25, 1.0), ("resnet18", "mobilenetv2"), warmup=2, rounds=6, per_round=4,
             per_round_slow=1, n_switch=30, switch_cpus=(0.25,))  # fmt: skip


@contextlib.asynccontextmanager
async def cluster(tmp: Path) -> AsyncIterator[RunningBroker]:
    """A broker and one CPU node (process runtime) joined to it, on loopback."""
    (tmp / "cluster.yaml").write_text(CLUSTER_YAML)
    broker = await start_broker(
        BrokerConfig(
            listen="127.0.0.1:0",
            ops_listen="127.0.0.1:0",
            state_dir=tmp / "broker",
            cluster=tmp / "cluster.yaml",
            join_token=JOIN_TOKEN,
            api_keys=(API_KEY,),
        )
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(broker.stop)
        node_id = f"bench-offload-{secrets.token_hex(3)}"
        gpus = GpuSpec("Tesla V100-SXM2-16GB", 16384)
        await join_node(stack, broker, "process", tmp, node_id, "site-a", CAPTURE, gpus)
        yield broker


def plan(mode: Mode, switch: bool) -> dict[str, Any]:
    """The device's plan (`bench.offload_device`): its units, rounds and switch phases.

    A unit runs under one link's conditions; its members take turns one request at a time
    (`steps` turns, a member with its own `steps` only in the first ones; the order within
    a turn changes from turn to turn, `bench.offload_device.turn`). The contenders judged
    against each other on a link share its unit: `local/lan` and `local/slow` are the local
    model again, timed in those turns. The local baselines of the speedup run their
    requests back to back, each in a unit of its own, as a device computing alone does
    (in the turns, the local model runs on a quota refilled while the replica answered the
    request before). ORT's default session is never in the turns: its spinning threads
    would spend the quota of whoever follows it. The members marked `#2` time a side again
    in the same turns: how far two samples of one side lie apart (`same_side_*`) is the
    noise a `fastest` ratio is read against."""
    lan, slow = (list(vars_of(LINKS[k])) for k in ("lan", "slow"))

    def member(
        label: str, contender: str | None = None, steps: int | None = None
    ) -> dict[str, Any]:
        m: dict[str, Any] = {"label": label, "contender": contender or label}
        if steps is not None:
            m["steps"] = steps
        return m

    units = [
        {"conditions": lan, "steps": mode.per_round, "members": [member("ort-default")]},
        {"conditions": lan, "steps": mode.per_round, "members": [member("local")]},
        {"conditions": lan, "steps": mode.per_round, "members": [
            member("local/lan", "local"), member("remote/lan", "remote"),
            member("fastest/lan"), member("local/lan#2", "local"),
            member("remote/lan#2", "remote")]},
        {"conditions": slow, "steps": mode.per_round, "members": [
            member("local/slow", "local"), member("remote/slow", "remote", mode.per_round_slow),
            member("fastest/slow"), member("local/slow#2", "local")]},
    ]  # fmt: skip
    phases = [{"conditions": c, "n": mode.n_switch} for c in (lan, slow, lan)]
    return {
        "warmup": mode.warmup,
        "rounds": mode.rounds,
        "units": units,
        "switch": phases if switch else [],
    }


def vars_of(conditions: Conditions) -> tuple[float, float]:
    return (conditions.delay_ms, conditions.rate_mbit)


def cpu_limit(cpus: float, period_ms: float) -> list[str]:
    """`docker run` options for a CFS quota of `cpus` CPUs per `period_ms`. ValueError for
    a period or quota the kernel refuses."""
    if not CFS_MIN_US <= period_ms * 1000 <= CFS_MAX_PERIOD_US:  # NaN fails too
        raise ValueError(
            f"a CFS period of {period_ms:g} ms is outside the kernel's "
            f"{CFS_MIN_US // 1000}..{CFS_MAX_PERIOD_US // 1000} ms"
        )
    period_us = round(period_ms * 1000)
    quota_us = round(cpus * period_us)
    if quota_us < CFS_MIN_US:
        raise ValueError(
            f"a CFS period of {period_ms:g} ms gives {cpus:g} CPU a quota of {quota_us} us; "
            f"the kernel takes at least {CFS_MIN_US} us"
        )
    return ["--cpu-period", str(period_us), "--cpu-quota", str(quota_us)]


async def run_device(
    image: str,
    cpus: float,
    period_ms: float,
    workdir: Path,
    model: str,
    broker_port: int,
    deployment_id: str,
    link: DelayLink,
    device_plan: dict[str, Any],
) -> dict[str, Any]:
    """One device container through `device_plan`; its JSON line."""
    plan_file = workdir / f"plan-{model}-{cpus}.json"
    plan_file.write_text(json.dumps(device_plan))
    plan_file.chmod(0o644)
    command = [
        "docker", "run", "--rm", *cpu_limit(cpus, period_ms), "--network", "host",
        "--label", "offload.bench=offload",
        "-v", f"{ROOT}:/src:ro", "-v", f"{workdir}:/work:ro",
        "-e", "PYTHONPATH=/src", "-e", f"grpc_proxy=http://127.0.0.1:{link.port}",
        "--entrypoint", "/opt/venv/bin/python", image, "-m", "bench.offload_device",
        "--broker", f"127.0.0.1:{broker_port}", "--api-key", API_KEY,
        "--deployment", deployment_id, "--model", f"/work/{model}.onnx",
        "--inputs", f"/work/{model}.npz", "--control", f"127.0.0.1:{link.control_port}",
        "--threads", str(max(1, int(cpus))), "--plan", f"/work/{plan_file.name}",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(DEVICE_TIMEOUT_S):
        stdout, stderr = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(
            f"device {model} at {cpus:g} CPU exited {process.returncode}: "
            + stderr.decode(errors="replace")[-2000:]
        )
    result: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


def summarize(device: dict[str, Any]) -> dict[str, Any]:
    contenders = device["contenders"]

    def figure(label: str) -> dict[str, Any]:
        c = contenders[label]
        stats = percentiles(c["latencies_ms"])
        stats["local_share"] = c["targets"].count("local") / len(c["targets"])
        return stats

    def same_side(
        local: dict[str, Any], remote: dict[str, Any], local_again: str, remote_again: str | None
    ) -> float | None:
        """The better side's p50 timed again in the same turns, over its first figure."""
        first, again = (
            (local, local_again) if local["p50"] <= remote["p50"] else (remote, remote_again)
        )
        if again is None:
            return None
        return float(figure(again)["p50"] / first["p50"])

    def on_best_side(
        fastest: str, local: dict[str, Any], remote: dict[str, Any]
    ) -> dict[str, Any] | None:
        """`fastest`'s requests that ran on the better side: how many, and their p50 over
        that side's own; None when it sent none there."""
        side, best = ("local", local) if local["p50"] <= remote["p50"] else ("remote", remote)
        c = contenders[fastest]
        there = [ms for ms, t in zip(c["latencies_ms"], c["targets"], strict=True) if t == side]
        if not there:
            return None
        return {
            "side": side,
            "requests": len(there),
            "of": len(c["targets"]),
            "p50_ratio": statistics.median(there) / best["p50"],
        }

    ort_default, local = figure("ort-default"), figure("local")
    local_lan, local_slow = figure("local/lan"), figure("local/slow")
    remote, remote_slow = figure("remote/lan"), figure("remote/slow")
    fast_lan, fast_slow = figure("fastest/lan"), figure("fastest/slow")
    out: dict[str, Any] = {
        "ort_default": ort_default,
        "local": local,
        "local_lan": local_lan,
        "local_slow": local_slow,
        "remote_lan": remote,
        "remote_slow": remote_slow,
        "fastest_lan": fast_lan,
        "fastest_slow": fast_slow,
        "speedup_vs_ort_default": ort_default["p50"] / remote["p50"],
        "speedup_vs_ours": local["p50"] / remote["p50"],
        "fastest_vs_best_lan": fast_lan["p50"] / min(local_lan["p50"], remote["p50"]),
        "fastest_vs_best_slow": fast_slow["p50"] / min(local_slow["p50"], remote_slow["p50"]),
        "same_side_lan": same_side(local_lan, remote, "local/lan#2", "remote/lan#2"),
        "same_side_slow": same_side(local_slow, remote_slow, "local/slow#2", None),
        "fastest_on_best_lan": on_best_side("fastest/lan", local_lan, remote),
        "fastest_on_best_slow": on_best_side("fastest/slow", local_slow, remote_slow),
        "failures": device["failures"],
    }
    if phases := device["switch"]:

        def settled(targets: list[str], side: str) -> int | None:
            """Requests until every later one (probes aside) ran on `side`."""
            for i in range(len(targets)):
                rest = targets[i:]
                if rest and rest.count(side) >= 0.85 * len(rest) and rest[0] == side:
                    return i + 1
            return None

        out["switch"] = {
            "to_local_after": settled(phases[1]["targets"], "local"),
            "back_to_remote_after": settled(phases[2]["targets"], "remote"),
            "phase_p50_ms": [statistics.median(p["latencies_ms"]) for p in phases],
            "phase_local_share": [p["targets"].count("local") / len(p["targets"]) for p in phases],
        }
    return out


def prepare_models(workdir: Path, models: Sequence[str]) -> None:
    """Each model and its inputs, readable by the container's user."""
    workdir.chmod(0o755)
    for name in models:
        path = modelzoo.model_path(name)
        shutil.copyfile(path, workdir / f"{name}.onnx")
        np.savez(workdir / f"{name}.npz", **modelzoo.sample_inputs(path))  # type: ignore[arg-type]
        for suffix in (".onnx", ".npz"):
            (workdir / f"{name}{suffix}").chmod(0o644)


async def bench(mode: Mode, image: str, period_ms: float) -> dict[str, Any]:
    results: dict[str, Any] = {
        "link": {k: c.describe() for k, c in LINKS.items()},
        "emulation": EMULATION,
        "cfs_period_ms": period_ms,
        "devices": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        prepare_models(workdir, mode.models)
        link = DelayLink()
        await link.start()
        try:
            async with cluster(Path(tmp)) as running:
                async with OffloadClient(f"127.0.0.1:{running.port}", API_KEY) as owner:
                    deployments = {}
                    for name in mode.models:
                        sha = await owner.upload_model(workdir / f"{name}.onnx")
                        deployment = await owner.deploy(sha, name, site="site-a")
                        deployments[name] = deployment.deployment_id
                        print(f"deployed {name} at {deployment.endpoint}", file=sys.stderr)
                for cpus in mode.cpus:
                    for name in mode.models:
                        print(f"device {cpus:g} CPU {name} ...", file=sys.stderr, flush=True)
                        switch = name == "resnet18" and cpus in mode.switch_cpus
                        device = await run_device(
                            image,
                            cpus,
                            period_ms,
                            workdir,
                            name,
                            running.port,
                            deployments[name],
                            link,
                            plan(mode, switch),
                        )
                        summary = summarize(device)
                        results["devices"].append(
                            {"cpus": cpus, "model": name, **summary, "raw": device}
                        )
                        print(row(cpus, name, summary), flush=True)
        finally:
            await link.close()
    return results


EMULATION = (
    "device: a container of the runtime image under a CFS quota of N CPUs "
    "(`docker run --cpu-quota N*P --cpu-period P`); "
    "link: bench.link, our delaying HTTP CONNECT proxy that gRPC goes through (grpc_proxy), "
    "not tc netem"
)
BASELINES = (
    "local baselines: ORT default = plain onnxruntime.InferenceSession(path), no options "
    "(default threads and spinning); ours = OffloadClient(policy='local'), 1 intra-op "
    "thread per whole CPU (at least 1), no spinning"
)
HEADER = (
    f"{'device':>8} {'model':<12} {'ORT default p50/p99':>20} {'ours p50/p99':>14} "
    f"{'remote p50/p99':>15} {'speedup vs ORT/ours':>20} {'fastest lan':>12} "
    f"{'slow: remote':>13} {'fastest slow':>13}"
)


def row(cpus: float, model: str, s: dict[str, Any]) -> str:
    def pair(f: dict[str, float]) -> str:
        return f"{f['p50']:.1f}/{f['p99']:.1f}"

    speedups = f"{s['speedup_vs_ort_default']:.1f}x / {s['speedup_vs_ours']:.1f}x"
    return (
        f"{cpus:>4g} CPU {model:<12} {pair(s['ort_default']):>20} {pair(s['local']):>14} "
        f"{pair(s['remote_lan']):>15} {speedups:>20} "
        f"{s['fastest_lan']['p50']:>5.1f} ({s['fastest_vs_best_lan']:.2f}) "
        f"{s['remote_slow']['p50']:>13.1f} {s['fastest_slow']['p50']:>6.1f} "
        f"({s['fastest_vs_best_slow']:.2f})"
    )


def preamble(mode: Mode, period_ms: float) -> None:
    print(f"emulation: {EMULATION}; CFS period P = {period_ms:g} ms")
    print(f"link lan: {LINKS['lan'].describe()}; slow: {LINKS['slow'].describe()}")
    print(BASELINES)
    print(
        f"timed in {mode.rounds} rounds of {mode.per_round} requests per contender "
        f"({mode.per_round_slow} for remote on slow), turn by turn; times in ms"
    )
    print(HEADER, flush=True)


def report(results: dict[str, Any]) -> None:
    print()
    print(HEADER)
    for d in results["devices"]:
        print(row(d["cpus"], d["model"], d))
    print(
        "fastest: p50 (fastest p50 / better of ours and remote on that link; target <= "
        f"{TARGET_FASTEST:.2f}); published: AVEC {AVEC_SPEEDUP:g}x, Neurosurgeon {NEUROSURGEON}"
    )
    for d in results["devices"]:
        for link in ("lan", "slow"):
            ratio = d[f"fastest_vs_best_{link}"]
            verdict = "within" if ratio <= TARGET_FASTEST else "OVER"
            again = d[f"same_side_{link}"]
            notes = [] if again is None else [f"the better side timed again: {again:.3f}"]
            if on_best := d.get(f"fastest_on_best_{link}"):
                notes.append(
                    f"fastest's {on_best['requests']} of {on_best['of']} on it "
                    f"({on_best['side']}): {on_best['p50_ratio']:.3f}"
                )
            noise = f" ({'; '.join(notes)})" if notes else ""
            print(
                f"fastest {d['cpus']:>4g} CPU {d['model']:<12} {link:<4}: {ratio:.3f} of the "
                f"better side, {verdict} {TARGET_FASTEST:.2f}{noise}"
            )
    for d in results["devices"]:
        if "switch" in d:
            s = d["switch"]
            p50 = ", ".join(f"{x:.1f}" for x in s["phase_p50_ms"])
            print(
                f"switch ({d['cpus']:g} CPU, {d['model']}): lan -> slow: local after "
                f"{s['to_local_after']} request(s); slow -> lan: remote after "
                f"{s['back_to_remote_after']}; phase p50 {p50} ms"
            )
    for d in results["devices"]:
        if d["model"] == "resnet18" and d["cpus"] == 0.25:
            verdicts = []
            for key, what, local in (
                ("speedup_vs_ort_default", "ORT default", d["ort_default"]),
                ("speedup_vs_ours", "ours (tuned)", d["local"]),
            ):
                verdict = "MEETS" if d[key] >= TARGET_SPEEDUP else "MISSES"
                verdicts.append(
                    f"vs {what} local ({local['p50']:.1f} ms p50): {d[key]:.1f}x, {verdict}"
                )
            print(
                f"target >= {TARGET_SPEEDUP:g}x, resnet18 on 0.25 CPU, remote "
                f"{d['remote_lan']['p50']:.1f} ms p50 on lan: " + "; ".join(verdicts)
            )
    failures = sum(d["failures"] for d in results["devices"])
    print(f"failed requests: {failures}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes, models, requests")
    parser.add_argument(
        "--cfs-period-ms",
        type=float,
        default=CFS_PERIOD_MS,
        metavar="MS",
        help=f"the device's CFS period (default {CFS_PERIOD_MS:g}; Docker's --cpus uses 100)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    try:
        for cpus in mode.cpus:
            cpu_limit(cpus, args.cfs_period_ms)
    except ValueError as err:
        parser.error(str(err))
    if shutil.which("docker") is None:
        print("bench.offload needs Docker: the device is a CPU-limited container", file=sys.stderr)
        return 2
    try:
        image = build_image("cpu", progress=lambda line: print(line, file=sys.stderr))
    except ImageBuildError as err:
        print(f"cannot build the runtime image: {err}", file=sys.stderr)
        return 2
    preamble(mode, args.cfs_period_ms)
    results = asyncio.run(bench(mode, image, args.cfs_period_ms))
    results["mode"] = "quick" if args.quick else "full"
    results["cpu_count"] = os.cpu_count()
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
