"""Checks of the values requests carry, before they reach the domain.

Numbers must be finite and within documented bounds, generous enough for any real request;
ids must be short strings of a known character set. A value that fails is refused with
`InvalidRequest` (INVALID_ARGUMENT), naming the field and its allowed range or form and
quoting at most a short prefix of the value (`broker.errors.quote`). Empty strings, where a
field is optional, are the caller's to skip.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sized

from broker.errors import InvalidRequest, quote
from broker.nodes import NODE_ID
from broker.placement import PriorityClass

MAX_CPUS = 1024.0
"""CPUs a deployment may ask for (the largest hosts have a few hundred)."""
MAX_MEMORY_MIB = 16 * 1024 * 1024
"""Host memory a deployment may ask for: 16 TiB, in MiB."""
MAX_GPU_MEMORY_MIB = 1024 * 1024
"""Memory of one GPU, asked for or reported: 1 TiB, in MiB (today's largest have under
200 GiB)."""
MAX_LATENCY_SLO_MS = 60_000.0
"""A latency objective above a minute is no objective."""
MAX_GAP_MS = 3_600_000.0
"""The longest gap a client may report around a migration: an hour."""
MAX_REQUESTS = 2**31
"""Request counts a client may report."""
MAX_EPOCH = 2**53
"""Epochs count placements from 1; 2^53 is exact in every JSON reader."""
MAX_NUMA_NODE = 1023
MAX_REPLICAS = 1024
"""Replicas one node may report."""
MAX_LIST = 64
"""Entries in a node's list of runtimes or NICs."""
MAX_ESTIMATE_MS = 3_600_000.0
"""A client's latency estimate of either side of adaptive offload: an hour at most."""

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""Deployment, migration and client ids: 1-64 letters, digits, '_', '.', '-'."""
_ID_RULE = "1-64 of letters, digits, '_', '.', '-' (starting with a letter or digit)"
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")
NAME = re.compile(r"[^\x00-\x1f\x7f]{1,128}")
"""Free-form names (sites, GPU names and UUIDs, versions, file names): printable text."""
_NAME_RULE = "1-128 characters without control characters"
SITE = re.compile(r"[^\x00-\x1f\x7f]{1,64}")
FILE_NAME = re.compile(r"[^\x00-\x1f\x7f/]{1,255}")
"""A file's name without its directory, as a client reports it (its local model's)."""


def number(field: str, value: float, low: float, high: float) -> float:
    """`value` if it is finite and within low..high; InvalidRequest otherwise."""
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequest(
            f"{field} must be a finite number within {low:g}..{high:g}, not {value:g}"
        )
    return value


def integer(field: str, value: int, low: int, high: int) -> int:
    """`value` if it is within low..high; InvalidRequest otherwise."""
    if not low <= value <= high:
        raise InvalidRequest(f"{field} must be within {low}..{high}, not {value}")
    return value


def matching(field: str, value: str, pattern: re.Pattern[str], rule: str) -> str:
    """`value` if `pattern` matches all of it; InvalidRequest naming `rule` otherwise."""
    if not pattern.fullmatch(value):
        raise InvalidRequest(f"{field} {quote(value)} must be {rule}")
    return value


def identifier(field: str, value: str) -> str:
    """A deployment, migration or client id."""
    return matching(field, value, ID, _ID_RULE)


def node_id(field: str, value: str) -> str:
    return matching(field, value, NODE_ID, "1-63 of a-z, 0-9, '.', '-'")


def replica_id(field: str, value: str) -> str:
    return matching(field, value, REPLICA_ID, "1-128 of letters, digits, '_', '.', '-'")


def sha256(field: str, value: str) -> str:
    return matching(field, value, SHA256, "64 lowercase hex digits")


def site(field: str, value: str) -> str:
    return matching(field, value, SITE, "1-64 characters without control characters")


def name(field: str, value: str) -> str:
    return matching(field, value, NAME, _NAME_RULE)


def file_name(field: str, value: str) -> str:
    return matching(field, value, FILE_NAME, "1-255 characters without '/' or control characters")


def word(field: str, value: str, allowed: Collection[str]) -> str:
    """`value` if it is one of `allowed`; InvalidRequest listing them otherwise."""
    if value not in allowed:
        raise InvalidRequest(f"{field} {quote(value)} is not one of: {', '.join(sorted(allowed))}")
    return value


def estimate(field: str, value: float) -> float | None:
    """A latency estimate in ms: finite and within 0..MAX_ESTIMATE_MS; 0 means none yet
    (None)."""
    return number(field, value, 0, MAX_ESTIMATE_MS) or None


def epoch(field: str, value: int) -> int:
    """An epoch that names a replica: 1 or more."""
    return integer(field, value, 1, MAX_EPOCH)


def priority(value: int) -> PriorityClass:
    """A priority class; unspecified (0) is standard (so no client can ask for standby)."""
    try:
        return PriorityClass(value or PriorityClass.STANDARD)
    except ValueError:
        known = ", ".join(
            f"{int(p)} ({p.name.lower()})" for p in PriorityClass if p is not PriorityClass.STANDBY
        )
        raise InvalidRequest(f"priority {value} is not a priority class: {known}") from None


def span_gap(value: float, switch_gap_ms: float) -> float:
    """A migration's span gap: a gap like `longest_gap_ms`, and no shorter than it (the span
    window holds the switch window). A client's rounding may put it a hair below: within
    1 µs it is taken as the switch gap."""
    number("span_gap_ms", value, 0, MAX_GAP_MS)
    if value < switch_gap_ms - 1e-3:
        raise InvalidRequest(
            f"span_gap_ms must be at least longest_gap_ms ({switch_gap_ms:g}), not {value:g}"
        )
    return max(value, switch_gap_ms)


def count(field: str, items: Sized, most: int) -> None:
    """A repeated field has at most `most` entries."""
    if (size := len(items)) > most:
        raise InvalidRequest(f"{field} has {size} entries; at most {most} are allowed")
