"""Reloading `--api-keys-file` (SIGHUP) with 1,000 keys: how soon a removed or replaced key is
refused, and how long the whole reload takes, beside the reload as it was (every key checked
again with scrypt before any was dropped), measured in the same run.

An in-process broker (`broker.server.start_broker` on loopback, a SQLite state in a temporary
dir) starts with `--keys` keys (default 1,000; its start hashes each once, ~35 ms apiece: the
set-up, not measured). Then `--reloads` times (default 5) the file changes, one key removed
and another replaced (alternately two files, so every reload changes two keys), and
`reload_api_keys`, what SIGHUP runs, is awaited:

    revoked_ms   from the reload's start until the removed and replaced keys are refused
                 (`Broker.use_keys` returned: the file read and parsed, no hash);
    reload_ms    until the reload returns (the state brought in line: one key hashed);
    baseline_ms  the reload as it was: every key of the file checked against its stored
                 hash (`replace_client_keys` on a store that has not seen the keys, as the
                 old reload did every time), before it dropped the cache; measured once.

After each reload the removed and the replaced keys are asked for (`Broker.client_for`):
both must be refused, the replacement accepted.

    python -m bench.key_reload [--quick] [--keys N] [--reloads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker.server import BrokerConfig, reload_api_keys, start_broker
from broker.state import new_api_key, parse_api_keys_file
from broker.state.opener import open_store
from edge_client.demo.cluster import CLUSTER_FILE

PEER = "ipv4:127.0.0.1:1"


async def run(keys_count: int, reloads: int) -> dict[str, Any]:
    keys = [new_api_key(f"client{n:05}") for n in range(keys_count)]
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
        root = Path(tmp)
        config = BrokerConfig(
            listen="127.0.0.1:0",
            ops_listen="127.0.0.1:0",
            state_dir=root / "state",
            cluster=CLUSTER_FILE,
            join_token="bench-join-token",
            api_keys=tuple(keys),
        )
        started = time.perf_counter()
        running = await start_broker(config)
        start_s = time.perf_counter() - started
        keys_file = root / "api-keys"
        revoked_ms: list[float] = []
        reload_ms: list[float] = []
        try:
            broker = running.broker
            current = list(keys)
            for n in range(reloads):
                removed, replaced = current[2 * n], current[2 * n + 1]
                replacement = new_api_key(replaced.partition(".")[0])
                for api_key in (removed, replaced):  # verified and cached before the reload
                    assert await broker.client_for(f"Bearer {api_key}", PEER) is not None
                previous = current
                current = [replacement if k == replaced else k for k in current if k != removed]
                keys_file.write_text("\n".join(current) + "\n")
                # What `reload_api_keys` does first, timed alone: read, parse, use the keys.
                begin = time.perf_counter()
                text = await asyncio.to_thread(keys_file.read_text)
                broker.use_keys(parse_api_keys_file(text, str(keys_file)))
                revoked_ms.append(1000 * (time.perf_counter() - begin))
                # Back to the old keys, then the reload itself, timed whole.
                broker.use_keys(previous)
                begin = time.perf_counter()
                await reload_api_keys(running, keys_file)
                reload_ms.append(1000 * (time.perf_counter() - begin))
                for api_key, expected in ((removed, None), (replaced, None)):
                    client = await broker.client_for(f"Bearer {api_key}", PEER)
                    if client is not expected:
                        raise AssertionError(f"a key dropped by the reload still works: {client}")
                if await broker.client_for(f"Bearer {replacement}", PEER) is None:
                    raise AssertionError("the replacement key does not work after the reload")
        finally:
            await running.stop()
        baseline_store = open_store("", root / "state")
        try:
            begin = time.perf_counter()
            await asyncio.to_thread(baseline_store.replace_client_keys, current)
            baseline_ms = 1000 * (time.perf_counter() - begin)
        finally:
            baseline_store.close()
    return {
        "keys": keys_count,
        "reloads": reloads,
        "start_s": round(start_s, 1),
        "revoked_ms": {"p50": statistics.median(revoked_ms), "max": max(revoked_ms)},
        "reload_ms": {"p50": statistics.median(reload_ms), "max": max(reload_ms)},
        "baseline_ms": baseline_ms,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.key_reload", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 keys, 3 reloads")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.reloads = min(args.keys, 50), min(args.reloads, 3)
    if args.keys < 2 * args.reloads or args.reloads < 1:
        parser.error("--keys must be at least twice --reloads, and --reloads at least 1")
    result = asyncio.run(run(args.keys, args.reloads))
    print(
        f"reload of {args.keys} API keys (one removed, one replaced; {args.reloads} times): "
        f"refused after {result['revoked_ms']['p50']:.1f} ms p50 "
        f"({result['revoked_ms']['max']:.1f} max), reload done in "
        f"{result['reload_ms']['p50']:.0f} ms p50 ({result['reload_ms']['max']:.0f} max); "
        f"baseline (every key checked again, as before): {result['baseline_ms']:.0f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
