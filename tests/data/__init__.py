"""Data files the tests and benchmarks read, kept in the repository so a clone stands alone.

`topologies/`: real `nvidia-smi topo -m` captures, each with its provenance lines (see its
README). `nvml/`: NVML's answers recorded on a real machine (`python -m tests.nvml_record`),
named as that machine's capture. `p2p_bandwidth/`: `p2pBandwidthLatencyTest` outputs from
some of the same kinds of machine, the evidence behind the link order in
`common.topology`.
"""

from pathlib import Path

TOPOLOGIES = Path(__file__).resolve().parent / "topologies"
"""The directory of captures: `NN_description.txt` files and their README."""

NVML_RECORDS = Path(__file__).resolve().parent / "nvml"
"""Recorded NVML reads: `NN_description.json`, as `tests.nvml_record` writes them."""
