"""Errors the runtime raises, mapped to gRPC status codes in one table (`runtime.rpc.status`).

Hierarchy::

    RuntimeServerError
    ├── InvalidInput          a tensor or request field does not match the model
    ├── ModelNotFound         the request names a model or version this server does not serve
    ├── NotReady              the model is loading, warming up, or the server is draining
    ├── InferenceFailed       ONNX Runtime failed while running valid inputs
    └── ModelLoadError        the model file cannot be loaded or warmed up (start-up only)
"""


class RuntimeServerError(Exception):
    """Base class of the runtime's own errors; the message is meant for the caller."""


class InvalidInput(RuntimeServerError):
    """The request does not match the model's inputs or outputs."""


class ModelNotFound(RuntimeServerError):
    """No model of that name (or version) is served here."""


class NotReady(RuntimeServerError):
    """The server cannot take this request now; retrying elsewhere or later may succeed."""


class InferenceFailed(RuntimeServerError):
    """ONNX Runtime failed on inputs that passed every check."""


class ModelLoadError(RuntimeServerError):
    """The model could not be loaded, or its warm-up inference failed."""
