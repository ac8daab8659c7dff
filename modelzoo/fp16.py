"""FP16 copies of ONNX models, for the runtime's ``--precision fp16``::

    python -m modelzoo.fp16 resnet18.onnx resnet18.fp16.onnx
    python -m runtime.server --model resnet18.onnx --precision fp16 \\
        --fp16-model resnet18.fp16.onnx ...

The conversion is onnxconverter-common's ``float16.convert_float_to_float16``: weights and
computation in FP16, inputs and outputs kept FP32 (``keep_io_types``), so clients send and get
what the FP32 model takes and gives; the converter's own list of ops it leaves in FP32 stays.
It runs here, where the model is prepared (the ``server`` extra has onnx and the converter),
not in the runtime: the runtime image carries onnxruntime alone, and the runtime checks the
copy against the FP32 model at load (``runtime.precision``), refusing one that deviates.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnxconverter_common import float16

from modelzoo.cache import atomic_write

logger = logging.getLogger(__name__)


def convert_to_fp16(source: Path, target: Path) -> Path:
    """Write `source`'s FP16 copy (FP32 inputs and outputs) to `target`, atomically; return
    `target`. Blocking. DecodeError when `source` is not an ONNX model; models over 2 GB
    (external data) are not handled (ValueError from protobuf). Weights outside FP16's
    range are clipped by the converter: counted and logged, not warned about."""
    model = onnx.load(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = float16.convert_float_to_float16(model, keep_io_types=True)
    truncated = [w for w in caught if "truncated" in str(w.message)]
    if truncated:
        logger.info("%s: %d weight value(s) clipped to FP16's range", source, len(truncated))
    for other in (w for w in caught if w not in truncated):
        logger.warning("%s: %s", source, other.message)
    atomic_write(target, converted.SerializeToString())
    logger.info("%s: FP16 copy written to %s", source, target)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m modelzoo.fp16",
        description="Convert an ONNX model to FP16 (FP32 inputs and outputs kept) for the "
        "runtime's --precision fp16 --fp16-model.",
    )
    parser.add_argument("source", type=Path, help="the FP32 .onnx model")
    parser.add_argument("target", type=Path, help="where to write the FP16 copy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if not args.source.is_file():
        parser.error(f"{args.source}: no such file")
    try:
        convert_to_fp16(args.source, args.target)
    except (OSError, ValueError, DecodeError) as err:
        logger.error("cannot convert %s: %s", args.source, err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
