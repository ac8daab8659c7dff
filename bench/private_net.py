"""A bench's own network namespace, whose loopback has an Ethernet MTU.

Everything a bench runs on one machine talks over loopback, whose MTU is 65536. Under BBR
congestion control (this Firecracker guest's default), a 602 KB request over that loopback
stalls now and then for up to 170 ms with both CPUs idle, its bytes waiting on ACKs. Ad hoc,
two grpc.aio loops sending 602 KB to a server that waits 40 ms and answers 4 KB: 26 calls
over 70 ms in 22,590 over this machine's loopback (up to 208 ms), none in 8,470 under
CUBIC, none in 5,670 over a veth pair (MTU 1500, BBR), and none in 16,982 in a namespace of
its own with the loopback at MTU 1500 (BBR), against 8 in 11,298 (up to 92 ms) in such a
namespace left at 65536 (docs/BENCHMARKS.md, "The CNN's hiccups"). An edge device reaches
a node over a real link, MTU 1500 (9000 at most), so a bench that models sites and nodes
runs in a network namespace of its own (`unshare --net`) with its loopback at
`ETHERNET_MTU`; the host's own network is not touched. Only for benches whose processes all
run on this machine outside containers: a Docker replica's published port lives in the
host's namespace.

    private_network_argv(command) -> the command wrapped (RuntimeError when it cannot be)
    run_in_private_network(command) -> its exit status, signals handled
    network_description() -> the loopback this process talks over (MTU, congestion control)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

ETHERNET_MTU = 1500
INSIDE_ENV = "OFFLOAD_BENCH_PRIVATE_NETWORK"
"""Set (to the MTU) in the environment of a command run through `private_network_argv`."""


def unavailable_reason() -> str | None:
    """Why a private network namespace cannot be had here (None when it can): it needs root
    and util-linux's `unshare` and iproute2's `ip`."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} on PATH"
    return None


def private_network_argv(command: Sequence[str]) -> list[str]:
    """`command` wrapped to run in a new network namespace whose loopback is up with MTU
    `ETHERNET_MTU` (its environment says so: `INSIDE_ENV`). RuntimeError where
    `unavailable_reason` says it cannot be."""
    cannot = unavailable_reason()
    if cannot is not None:
        raise RuntimeError(f"no private network namespace: {cannot}")
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    assert unshare is not None and ip is not None
    script = f'{ip} link set lo mtu {ETHERNET_MTU} up && {INSIDE_ENV}={ETHERNET_MTU} exec "$@"'
    return [unshare, "--net", "--", "sh", "-c", script, "sh", *command]


def run_in_private_network(command: Sequence[str]) -> int:
    """Run `command` as `private_network_argv` wraps it (RuntimeError when it cannot be)
    and wait for it; its exit status. A SIGTERM to this process is
    passed on to it; a SIGINT is not, since Ctrl-C reaches the whole process group, the
    command too, and the command stops itself: this process waits for that rather than
    leave what the command started behind."""
    wrapped = private_network_argv(command)
    # `unshare` and `sh` exec the command, so the child is the command itself.
    child = subprocess.Popen(wrapped)
    # Only now: an ignored SIGINT would be inherited across exec.
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


def inside() -> bool:
    """Whether this process runs in a namespace `private_network_argv` made."""
    return os.environ.get(INSIDE_ENV) == str(ETHERNET_MTU)


_SIOCGIFMTU = 0x8921


def loopback_mtu() -> int:
    """The MTU of `lo` in this process's network namespace (asked of the kernel: /sys shows
    the namespace it was mounted in)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16si", b"lo", 0)
        return int(struct.unpack("16si", fcntl.ioctl(probe, _SIOCGIFMTU, request))[1])


def network_description() -> dict[str, object]:
    """The loopback this process talks over: its MTU, the TCP congestion control of this
    network namespace, and whether it is a bench's private namespace."""
    return {
        "private_namespace": inside(),
        "loopback_mtu": loopback_mtu(),
        "tcp_congestion_control": Path("/proc/sys/net/ipv4/tcp_congestion_control")
        .read_text()
        .strip(),
    }
