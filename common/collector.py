"""The garbage collector's settings for a long-lived server process with a large heap.

CPython collects its youngest generation every 700 net container allocations. A broker with
thousands of nodes allocates a few objects per heartbeat and keeps hundreds of thousands
alive (the nodes, their load history, the deployments); at 2,000 nodes its collector ran
four times a second and took about 7 % of the event loop's time, and each pass moved
survivors toward the full collections that walk the whole heap (measured with `gc.callbacks`
in `bench.control_plane`; docs/BENCHMARKS.md). `settle` raises the first threshold, so the
young generation is collected less often (each pass is no longer: most young objects are
already gone by then), and freezes what startup allocated (modules, settings, the state as
loaded), which the full collections then skip, as `runtime.server` does once its model is
loaded.
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
