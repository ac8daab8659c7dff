"""Data files the tests and benchmarks read, kept in the repository so a clone stands alone.

`topologies/`: real `nvidia-smi topo -m` captures, each with its provenance lines (see its
README). `p2p_bandwidth/`: `p2pBandwidthLatencyTest` outputs from some of the same kinds of
machine, the evidence behind the link order in `common.topology`.
"""

from pathlib import Path

TOPOLOGIES = Path(__file__).resolve().parent / "topologies"
"""The directory of captures: `NN_description.txt` files and their README."""
