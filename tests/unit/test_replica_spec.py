"""What every runtime passes a replica from its spec: the deployment's priority class, by the
runtime's own names."""

from __future__ import annotations

from pathlib import Path

from node_daemon.runtimes.base import PRIORITY_CLASSES, ReplicaSpec, priority_args
from runtime.batching import PriorityClass


def test_each_broker_priority_class_is_a_runtime_class_and_unspecified_is_standard() -> None:
    assert set(PRIORITY_CLASSES.values()) == {str(c) for c in PriorityClass}

    def flag(priority: int) -> list[str]:
        spec = ReplicaSpec("r-1", Path("m.onnx"), "m", "t" * 16, priority=priority)
        return priority_args(spec)

    assert flag(3) == ["--priority-class", "critical"]
    assert flag(1) == ["--priority-class", "best-effort"]
    assert flag(2) == flag(0) == ["--priority-class", "standard"]
