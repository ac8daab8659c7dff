"""Errors of the node daemon's domain, mapped to gRPC status codes in `node_daemon.rpc.status`.

Hierarchy::

    NodeError
    ├── InvalidRequest        a field is malformed or inconsistent (INVALID_ARGUMENT)
    ├── NotFound              (NOT_FOUND)
    │   ├── ModelNotCached    no model of that sha256 in the node's cache
    │   └── ReplicaNotFound   no replica of that id on this node
    ├── ResourceExhausted     (RESOURCE_EXHAUSTED)
    │   ├── GpusExhausted     not enough free GPUs (or GPU memory) for the request
    │   └── ModelTooLarge     an upload over the cache's size limit
    ├── AlreadyExists         a replica of that id runs already (ALREADY_EXISTS)
    ├── Unsupported           this node's runtime cannot do that (FAILED_PRECONDITION); a
    │                         memory_mib it cannot enforce here, refused before anything
    │                         starts (the message starts `MEMORY_LIMIT_UNAVAILABLE`); a
    │                         replica whose runtime cannot confirm its clients (it reports
    │                         no clients generation: older than the node)
    ├── GpuShareTooSmall      a GPU memory share below the model's need, refused before
    │                         anything starts, or its arena ran out as it loaded
    │                         (FAILED_PRECONDITION; the message starts `SHARE_TOO_SMALL`)
    ├── StartFailed           the replica could not start or become ready
    │                         (FAILED_PRECONDITION; the message has its exit code and log)
    ├── StopFailed            the runtime could not stop the replica; it stays listed,
    │                         holding its GPUs, until a later stop succeeds (UNAVAILABLE)
    └── ClientsNotConfirmed   a replica did not confirm, within the bound, the clients file
                              just written (UNAVAILABLE); the file stays written, and the
                              replica takes it when it next reads it

`SHARE_TOO_SMALL` and `MEMORY_LIMIT_UNAVAILABLE` are `common.replica_memory`'s: the broker
tells a refused spec from a replica that failed by itself by them.

Messages name the field and quote at most a short prefix of an offending value
(`runtime.errors.quote`); the status table passes them through `runtime.errors.client_text`.
"""


class NodeError(Exception):
    """Base class of the node daemon's errors; the message is meant for the caller."""


class InvalidRequest(NodeError):
    pass


class NotFound(NodeError):
    pass


class ModelNotCached(NotFound):
    pass


class ReplicaNotFound(NotFound):
    pass


class ResourceExhausted(NodeError):
    pass


class GpusExhausted(ResourceExhausted):
    pass


class ModelTooLarge(ResourceExhausted):
    pass


class AlreadyExists(NodeError):
    pass


class Unsupported(NodeError):
    pass


class GpuShareTooSmall(NodeError):
    pass


class StartFailed(NodeError):
    pass


class StopFailed(NodeError):
    pass


class ClientsNotConfirmed(NodeError):
    pass
