"""KServe's Python ModelServer serving one ONNX file: the peer `python -m bench.peers` measures
our runtime against.

Run by the Python of the kserve virtualenv that `bench.peers` creates, never by ours: it
imports only kserve, onnxruntime and numpy (the standard library aside), so it stands alone::

    <venv>/bin/python -I bench/peers_kserve.py --model_path M.onnx --model_name mlp \
        --grpc_port 8081 --http_port 8080

It is written the way KServe's custom-model guide writes a predictor: a `kserve.Model`
subclass whose `load` opens the session and whose synchronous `predict` takes the v2
`InferRequest` (raw FP32 over gRPC, as tritonclient sends it) and returns an `InferResponse`;
KServe calls a synchronous `predict` on its event loop. The session runs on the CPU provider
with the options in `--session_options` (JSON: `bench.peers` passes those our runtime's
session was opened with, read back from it, so both run the same inference code the same
way; `{}`, the default, is ONNX Runtime's defaults). Every flag of `kserve.model_server` is
accepted too (`--workers`, `--max_threads` ...).

Per-request log lines are off (`--enable_latency_logging` defaults to false here and
KSERVE_LOGLEVEL to WARNING, which silences the gRPC interceptor's line per call), as our
runtime writes none: the comparison is of serving, not of logging.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# Before kserve is imported: it reads the level once, at import.
os.environ.setdefault("KSERVE_LOGLEVEL", "WARNING")

import numpy as np
import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve import model_server as kserve_model_server
from kserve.utils.numpy_codec import from_np_dtype


def session_options(settings: dict[str, Any]) -> ort.SessionOptions:
    """SessionOptions from {"attributes": {name: value}, "config": {key: value}} (the same
    helper as in bench/peers_client.py: this file imports nothing of ours)."""
    options = ort.SessionOptions()
    for name, value in settings.get("attributes", {}).items():
        if name == "execution_mode":
            value = ort.ExecutionMode(value)
        elif name == "graph_optimization_level":
            value = ort.GraphOptimizationLevel(value)
        setattr(options, name, value)
    for key, value in settings.get("config", {}).items():
        options.add_session_config_entry(key, value)
    return options


class OnnxModel(Model):
    """One ONNX Runtime session behind KServe's Open Inference Protocol data plane."""

    def __init__(self, name: str, path: str, settings: dict[str, Any]) -> None:
        super().__init__(name)
        self._path = path
        self._settings = settings
        self._session: ort.InferenceSession | None = None
        self._output_names: list[str] = []

    def load(self) -> bool:
        self._session = ort.InferenceSession(
            self._path, session_options(self._settings), providers=["CPUExecutionProvider"]
        )
        self._output_names = [o.name for o in self._session.get_outputs()]
        self.ready = True
        return self.ready

    def predict(
        self, payload: InferRequest, headers: dict[str, str] | None = None
    ) -> InferResponse:
        assert self._session is not None, "predict before load"
        feeds = {tensor.name: tensor.as_numpy() for tensor in payload.inputs}
        names = [o.name for o in payload.request_outputs or ()] or self._output_names
        results = self._session.run(names, feeds)
        outputs = []
        for name, array in zip(names, results, strict=True):
            array = np.asarray(array)
            output = InferOutput(name, list(array.shape), from_np_dtype(array.dtype))
            output.set_data_from_numpy(array, binary_data=True)
            outputs.append(output)
        return InferResponse(
            response_id=payload.id or "",
            model_name=self.name,
            infer_outputs=outputs,
            use_binary_outputs=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[kserve_model_server.parser],
        conflict_handler="resolve",
    )
    parser.add_argument("--model_path", required=True, help="the .onnx file to serve")
    parser.add_argument(
        "--session_options",
        type=json.loads,
        default={},
        help='ONNX Runtime session options, JSON: {"attributes": {...}, "config": {...}}',
    )
    parser.add_argument(
        "--enable_latency_logging",
        type=lambda text: text.lower() in ("1", "true", "yes"),
        default=False,
        help="a log line per request (KServe's default is true; false here, see above)",
    )
    args = parser.parse_args()
    model = OnnxModel(args.model_name, args.model_path, args.session_options)
    model.load()
    ModelServer(
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        workers=args.workers,
        enable_latency_logging=args.enable_latency_logging,
    ).start([model])


if __name__ == "__main__":
    main()
