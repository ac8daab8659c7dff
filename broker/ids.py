"""The ids the broker's domain makes, typed: a node id (of a node the registry found lost)
and a replica id are not each other, though both are strings. `NewType`s cost nothing at run
time; mypy keeps them apart. The store's records keep plain strings."""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)
"""What a node registered as (`broker.nodes.NODE_ID`)."""
ReplicaId = NewType("ReplicaId", str)
"""`<deployment id>-<epoch>`: the replica of one epoch of a deployment (`replica_id`)."""


def replica_id(deployment_id: str, epoch: int) -> ReplicaId:
    """The id of a deployment's replica at `epoch`: the name nodes know it by."""
    return ReplicaId(f"{deployment_id}-{epoch}")
