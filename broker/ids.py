"""The broker's ids, typed: a deployment id is not a node id, though both are strings.

`NewType`s cost nothing at run time; mypy keeps them apart. Ids from outside (a request, the
store) become typed where they are parsed or read."""

from __future__ import annotations

from typing import NewType

DeploymentId = NewType("DeploymentId", str)
"""`d-` and 10 hex digits, made by `Deployments.deploy`."""
NodeId = NewType("NodeId", str)
"""What a node registered as (`broker.nodes.NODE_ID`)."""
ReplicaId = NewType("ReplicaId", str)
"""`<deployment id>-<epoch>`: the replica of one epoch of a deployment (`replica_id`)."""
MigrationId = NewType("MigrationId", str)
ClientId = NewType("ClientId", str)
"""The client an API key belongs to."""


def replica_id(deployment_id: str, epoch: int) -> ReplicaId:
    """The id of a deployment's replica at `epoch`: the name nodes know it by."""
    return ReplicaId(f"{deployment_id}-{epoch}")
