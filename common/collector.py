"""The garbage collector's settings for a long-lived server process with a large heap.

CPython collects its youngest generation every 700 net container allocations. A broker with
thousands of nodes allocates a few objects per heartbeat and keeps hundreds of thousands
alive (the nodes, their load history, the deployments); at 2,000 nodes its collector ran
about four times a second, about 7 % of the wall time, with full passes of 0.3-0.4 s (a probe
on `gc.callbacks` in the broker while `bench.control_plane` ran; docs/benchmarks-history.md).
`settle` raises the first threshold, so the young generation is collected far less often
(each pass takes longer; all together about a tenth of the time in that probe), and freezes
what startup allocated (modules, settings, the state as loaded), which the full collections
then skip, as `runtime.server` does once its model is loaded.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
"""Net container allocations between collections of the youngest generation (CPython: 700)."""


def settle() -> None:
    """Collect once, freeze what is alive (it lives as long as the process), and collect the
    youngest generation every `YOUNG_THRESHOLD` allocations; the older generations' ratios
    stay CPython's."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
