"""A real third-party client: tritonclient.grpc against one of our replicas.

Runs in its own process (tritonclient's generated `inference.*` protobuf symbols collide
with ours in one process). Prints a JSON report and writes the outputs to an .npz file::

    TRITON_PROBE_TOKEN=T python tests/triton_probe.py --url HOST:PORT --model NAME \
        --inputs in.npz --outputs out.npz [--ca CA.pem]

With `--ca`, over TLS (`ssl=True`) with that CA as the root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import np_to_triton_dtype


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--outputs", required=True)
    parser.add_argument("--ca", help="the CA (PEM) of a replica serving TLS")
    args = parser.parse_args()
    # The token comes in the environment: a secret on a command line is readable by
    # every user of the machine, and one that starts with "-" would read as an option.
    headers = {"authorization": f"Bearer {os.environ['TRITON_PROBE_TOKEN']}"}
    client = triton.InferenceServerClient(
        url=args.url, ssl=args.ca is not None, root_certificates=args.ca
    )
    try:
        metadata = client.get_model_metadata(args.model, headers=headers, as_json=True)
        inputs = []
        with np.load(args.inputs) as arrays:
            for name in arrays.files:
                array = arrays[name]
                tensor = triton.InferInput(
                    name, list(array.shape), np_to_triton_dtype(array.dtype)
                )
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
        result = client.infer(args.model, inputs, headers=headers)
        outputs = {out["name"]: result.as_numpy(out["name"]) for out in metadata["outputs"]}
        np.savez(args.outputs, **outputs)
        report = {
            "live": client.is_server_live(),
            "server_ready": client.is_server_ready(headers=headers),
            "model_ready": client.is_model_ready(args.model, headers=headers),
            "metadata": metadata,
        }
    finally:
        client.close()
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
