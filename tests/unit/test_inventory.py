"""Inventory sources: every real capture, damaged and bad input, the NVML seam, GPU specs."""

from __future__ import annotations

import ctypes.util
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_daemon.inventory import (
    GpuSpec,
    Inventory,
    InventorySource,
    InventoryUnavailable,
    Link,
    LinkKind,
    NvmlInventory,
    NvmlReader,
    RawDevice,
    RawNvLink,
    RawSystem,
    TopologyFileInventory,
    TopologyParseError,
    build_inventory,
    cpu_only_inventory,
    inventory_from_capture,
    inventory_from_nvml,
    parse_topology,
)
from node_daemon.inventory.assembly import GpuAffinity, GpuDetails, ParsedTopology
from tests import nvml_record
from tests.data import NVML_RECORDS, TOPOLOGIES

SPEC = GpuSpec(name="A100-SXM4-80GB", memory_mib=81920)
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def capture(name: str) -> Path:
    return TOPOLOGIES / name


@dataclass(frozen=True)
class Expect:
    """What a capture says, read off the file by hand."""

    gpus: int
    kinds: set[str]
    """The GPU-GPU link kinds, as printed (NV12, SYS ...)."""
    nics: tuple[str, ...] = ()
    pairs: dict[tuple[int, int], str] = field(default_factory=dict)
    nic_links: dict[str, dict[int, str]] = field(default_factory=dict)
    numa: tuple[int | None, ...] | None = None
    cpu: dict[int, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    """A phrase each warning must contain, in order; () means no warnings."""


MLX5_0_TO_9 = tuple(f"mlx5_{i}" for i in range(10))
EXPECTED: dict[str, Expect] = {
    "12_dgx-a100-8gpu-nv12-10nic-nps4.txt": Expect(
        gpus=8,
        kinds={"NV12"},
        nics=MLX5_0_TO_9,
        pairs={(0, 7): "NV12"},
        nic_links={
            "mlx5_0": {0: "PXB", 1: "PXB", 2: "SYS", 7: "SYS"},
            "mlx5_6": {5: "SYS", 6: "PXB", 7: "PXB"},
            "mlx5_9": dict.fromkeys(range(8), "SYS"),
        },
        numa=(3, 3, 1, 1, 7, 7, 5, 5),
        cpu={0: "48-63,176-191", 4: "112-127,240-255", 5: "112-127,240-255"},
    ),
    "15_a800-8gpu-nv8-4nic-driver525.txt": Expect(
        gpus=8,
        kinds={"NV8"},
        nics=("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"),
        nic_links={
            "mlx5_0": {0: "NODE", 1: "PIX", 4: "SYS"},
            "mlx5_2": {3: "SYS", 4: "NODE", 7: "PIX"},
            "mlx5_3": {7: "PIX"},
        },
        numa=(0, 0, 0, 0, 1, 1, 1, 1),
        cpu={0: "0-31,64-95", 7: "32-63,96-127"},
    ),
    "16_a800-8gpu-nv8-TRUNCATED-terminal-crop.txt": Expect(
        gpus=8,
        kinds={"NV8"},
        nics=("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"),
        nic_links={name: {} for name in ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")},
        numa=(0, 0, 0, 0, 1, 1, 1, 1),
        cpu=dict.fromkeys(range(8), ""),
        warnings=("looks cropped; those NICs' links are not recorded", "'-31,64-95'"),
    ),
    "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt": Expect(
        gpus=8,
        kinds={"NV1", "NV2", "SYS"},
        nics=("mlx5_0",),
        pairs={(0, 1): "NV1", (0, 3): "NV2", (0, 4): "NV2", (0, 5): "SYS", (6, 7): "NV2"},
        nic_links={"mlx5_0": {0: "NODE", 1: "NODE", 2: "PIX", 3: "PIX", 4: "SYS"}},
        numa=(None,) * 8,
        cpu={0: "0-11,24-35", 7: "12-23,36-47"},
    ),
    "22_gh200-quad-nv6-gpu-numa-id.txt": Expect(
        gpus=4, kinds={"NV6"}, numa=(None,) * 4, cpu={0: "0-71", 3: "216-287"}
    ),
    "24_asus-esc8000a-e12-4xRTX6000Ada-2socket-4nic.txt": Expect(
        gpus=4,
        kinds={"NODE", "SYS"},
        nics=("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"),
        pairs={(0, 1): "NODE", (0, 2): "SYS", (1, 3): "SYS", (2, 3): "NODE"},
        nic_links={"mlx5_0": {0: "NODE", 2: "SYS"}, "mlx5_3": {1: "SYS", 3: "NODE"}},
        numa=(0, 0, 1, 1),
        cpu={0: "0-31", 2: "32-63"},
    ),
    "25_puget-wrx90-2xRTX6000Ada-phb-2nic.txt": Expect(
        gpus=2,
        kinds={"PHB"},
        nics=("mlx5_0", "mlx5_1"),
        nic_links={"mlx5_1": {0: "NODE", 1: "NODE"}},
        numa=(0, 0),
        cpu={1: "0-23"},
    ),
    "26_2gpu-workstation-nv2-bridge-numa-na.txt": Expect(
        gpus=2, kinds={"NV2"}, numa=(None, None), cpu={0: "0-23"}
    ),
    "27_2gpu-workstation-phb-no-nvlink.txt": Expect(
        gpus=2, kinds={"PHB"}, numa=(None, None), cpu={1: "0-11"}
    ),
    "28_dgx-a100-compact-2space-columns.txt": Expect(
        gpus=8, kinds={"NV12"}, numa=(0, 0, 0, 0, 1, 1, 1, 1), cpu={3: "0-23", 4: "24-47"}
    ),
    "29_hgx-h100-compact-2space-columns.txt": Expect(
        gpus=8, kinds={"NV18"}, numa=(0, 0, 0, 0, 1, 1, 1, 1), cpu={0: "0-51", 7: "52-103"}
    ),
    "30_5gpu-mixed-2x5090-3x4090-numa-split.txt": Expect(
        gpus=5,
        kinds={"NODE", "PHB", "SYS"},
        pairs={(0, 1): "SYS", (0, 4): "SYS", (1, 2): "PHB", (3, 4): "PHB", (1, 3): "NODE"},
        numa=(1, 0, 0, 0, 0),
        cpu={0: "8-15,24-31", 1: "0-7,16-23"},
    ),
    "31_2x-rtx5090-threadripper-phb-tabs.txt": Expect(
        gpus=2, kinds={"PHB"}, numa=(0, 0), cpu={0: "0-63"}
    ),
    "32_2gpu-node-INDENTED-rewrapped-paste.txt": Expect(
        gpus=2, kinds={"NODE"}, numa=(0, 0), cpu={0: "0-15"}
    ),
    "34_2x-rtx3090-sys-numa-NA-on-one-gpu.txt": Expect(
        gpus=2, kinds={"SYS"}, numa=(None, 1), cpu={0: "0-7,16-23", 1: "8-15,24-31"}
    ),
    "35_7gforce-7gpu-gtx10x0-pix-phb-oldlegend.txt": Expect(
        gpus=7,
        kinds={"PIX", "PHB"},
        pairs={(0, 1): "PIX", (1, 2): "PIX", (2, 3): "PHB", (0, 6): "PHB", (3, 6): "PIX"},
        numa=(None,) * 7,
        cpu={6: "0-19"},
    ),
    "36_azure-nv12-2xM60-soc-unindented-header.txt": Expect(
        gpus=2, kinds={"SYS"}, numa=(None, None), cpu={0: "0-11"}
    ),
    "39_hpe-dl380a-2xH100pcie-nvlink-bridge-nv12-indented.txt": Expect(
        gpus=2, kinds={"NV12"}, numa=(1, 1), cpu={1: "32-63,96-127"}
    ),
    # Its header underlined with terminal escapes, as nvidia-smi printed it to a pipe.
    "40_h200-1gpu-vm-escape-underlined-header.txt": Expect(
        gpus=1, kinds=set(), numa=(0,), cpu={0: "0-15"}
    ),
}


def test_every_capture_has_expected_facts() -> None:
    assert sorted(p.name for p in TOPOLOGIES.glob("*.txt")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_capture(name: str) -> None:
    expect = EXPECTED[name]
    inventory = inventory_from_capture(capture(name), SPEC)

    assert len(inventory.gpus) == expect.gpus
    assert [gpu.index for gpu in inventory.gpus] == list(range(expect.gpus))
    assert {str(link) for link in inventory.links.values()} == expect.kinds
    for (a, b), code in expect.pairs.items():
        assert str(inventory.link(a, b)) == code, (a, b)
        assert inventory.link(b, a) == inventory.link(a, b)
    assert tuple(nic.name for nic in inventory.nics) == expect.nics
    nics = {nic.name: nic for nic in inventory.nics}
    for nic_name, links in expect.nic_links.items():
        got = {gpu: str(link) for gpu, link in nics[nic_name].links.items()}
        if links:
            assert set(got) == set(range(expect.gpus))
        assert {gpu: got[gpu] for gpu in links} == links, nic_name
        if not links:
            assert got == {}
    if expect.numa is not None:
        assert tuple(gpu.numa_node for gpu in inventory.gpus) == expect.numa
    for index, affinity in expect.cpu.items():
        assert inventory.gpus[index].cpu_affinity == affinity
    assert len(inventory.warnings) == len(expect.warnings), inventory.warnings
    for warning, phrase in zip(inventory.warnings, expect.warnings, strict=True):
        assert phrase in warning


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_capture_invariants(name: str) -> None:
    path = capture(name)
    inventory = inventory_from_capture(path, SPEC)
    count = len(inventory.gpus)
    assert set(inventory.links) == {(i, j) for i in range(count) for j in range(i + 1, count)}
    assert all(UUID.fullmatch(gpu.uuid) for gpu in inventory.gpus)
    assert len({gpu.uuid for gpu in inventory.gpus}) == count
    assert {(gpu.name, gpu.memory_total_mib) for gpu in inventory.gpus} == {
        (SPEC.name, SPEC.memory_mib)
    }
    assert TopologyFileInventory(path, SPEC).read() == inventory  # stable across reads
    for nic in inventory.nics:
        assert set(nic.links) <= set(range(count))


def test_uuids_differ_between_captures() -> None:
    first = inventory_from_capture(capture("28_dgx-a100-compact-2space-columns.txt"), SPEC)
    second = inventory_from_capture(capture("29_hgx-h100-compact-2space-columns.txt"), SPEC)
    assert not {g.uuid for g in first.gpus} & {g.uuid for g in second.gpus}


def test_cropped_capture_warns_what_is_lost() -> None:
    inventory = inventory_from_capture(
        capture("16_a800-8gpu-nv8-TRUNCATED-terminal-crop.txt"), SPEC
    )
    crop, affinity = inventory.warnings
    assert crop.startswith("line 5: ") and "NIC0, NIC1, NIC2, NIC3" in crop
    assert "CPU Affinity is not trusted" in affinity
    assert "'2-63,96-127'" in affinity and "NUMA Affinity kept" in affinity


def test_crop_into_the_gpu_columns_is_refused() -> None:
    text = capture("16_a800-8gpu-nv8-TRUNCATED-terminal-crop.txt").read_text()
    cropped = text.replace("GPU7  CPU Affinity", "CPU Affinity")
    with pytest.raises(TopologyParseError) as caught:
        parse_topology(cropped, source="16")
    assert str(caught.value) == (
        "16, line 13: row GPU7 has no column in the header (which has GPU0..GPU6); expected "
        "one row per GPU column (is the capture cropped?)"
    )


# -- damaged pastes built from the real captures, the way the real artifacts look ---------

LINK_NAME = re.compile(r"GPU[0-9]+|NIC[0-9]+|mlx[45]_\S+")


def text_of(name: str) -> str:
    """The capture as read by `inventory_from_capture` (CRLF kept)."""
    return capture(name).read_bytes().decode("utf-8-sig")


def matrix_block(lines: list[str]) -> range:
    """Indices of the header and the rows under it, up to a blank or `...:` line."""
    start = next(
        i
        for i, line in enumerate(lines)
        if line.split()[:1] == ["GPU0"] and line.split()[1:2] != ["X"]
    )
    end = next(
        (i for i in range(start + 1, len(lines)) if not lines[i].strip() or ":" in lines[i]),
        len(lines),
    )
    return range(start, end)


def glue(line: str, first: int) -> str:
    """`line` without the whitespace between its tokens `first` and `first + 1`."""
    spans = [m.span() for m in re.finditer(r"\S+", line)]
    return line[: spans[first][1]] + line[spans[first + 1][0] :]


def glue_last_link_columns(text: str) -> str:
    """The separator lost between the last two link columns, in the header and every row,
    as nvidia-smi prints it with many NIC columns (`NIC7NIC8`, `SYSSYS`, `XPIX`)."""
    lines = text.split("\n")
    block = matrix_block(lines)
    links = sum(1 for token in lines[block[0]].split() if LINK_NAME.fullmatch(token))
    lines[block[0]] = glue(lines[block[0]], links - 2)
    for i in block[1:]:
        lines[i] = glue(lines[i], links - 1)
    return "\n".join(lines)


def glue_header(text: str) -> str:
    """Every link column name of the header run together (`GPU0GPU1...mlx5_0`), its tabs lost."""
    lines = text.split("\n")
    header = lines[matrix_block(lines)[0]]
    names = [token for token in header.split() if LINK_NAME.fullmatch(token)]
    start = header.index(names[0])
    end = header.index(names[-1], start) + len(names[-1])
    lines[matrix_block(lines)[0]] = header[:start] + "".join(names) + header[end:]
    return "\n".join(lines)


def same_matrix(damaged: ParsedTopology, clean: ParsedTopology) -> None:
    assert damaged.links == clean.links
    assert damaged.gpus == clean.gpus  # every GPU, its CPU and NUMA affinity
    assert damaged.nics == clean.nics


SEVERAL_COLUMNS = sorted(name for name, e in EXPECTED.items() if e.gpus + len(e.nics) > 1)
"""The captures with two link columns or more: the ones a lost separator can glue."""


@pytest.mark.parametrize("name", SEVERAL_COLUMNS)
def test_glued_cells_parse_to_the_clean_matrix(name: str) -> None:
    text = text_of(name)
    glued = glue_last_link_columns(text)
    assert glued != text
    topology = parse_topology(glued)
    same_matrix(topology, parse_topology(text))
    assert "header names ran together" in topology.warnings[0]
    assert any("split on the known codes" in warning for warning in topology.warnings)


@pytest.mark.parametrize("name", SEVERAL_COLUMNS)
def test_glued_header_parses_to_the_clean_matrix(name: str) -> None:
    text = text_of(name)
    glued = glue_header(text)
    assert "GPU0GPU1" in glued
    topology = parse_topology(glued)
    same_matrix(topology, parse_topology(text))
    assert "header names ran together ('GPU0GPU1" in topology.warnings[0]


@pytest.mark.parametrize("prefix", ["# ", "#", "//"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_comment_prefixed_capture_parses_as_the_clean_one(name: str, prefix: str) -> None:
    text = text_of(name)
    prefixed = "\n".join(prefix + line for line in text.split("\n"))
    assert parse_topology(prefixed) == parse_topology(text)  # warnings (and their lines) too


def test_glued_dgx_a100_header_and_cells_as_reported() -> None:
    text = glue_last_link_columns(text_of("12_dgx-a100-8gpu-nv12-10nic-nps4.txt"))
    assert "NIC8NIC9" in text and "PIXX" in text and "SYSSYS" in text
    topology = parse_topology(text)
    assert {nic.name: str(nic.links[0]) for nic in topology.nics}["mlx5_9"] == "SYS"
    assert topology.warnings == (
        "line 5: header names ran together ('NIC8NIC9'); split on the known names",
        "lines 6-23: 18 cell(s) held link codes with no space between them ('PIXX', "
        "'SYSSYS', 'XPIX'); split on the known codes",
    )


def crop(text: str, width: int) -> str:
    """Every line cut at `width` characters, as a terminal that narrow shows it."""
    return "\n".join(line[:width] for line in text.split("\n"))


def test_value_cut_at_the_right_edge_is_dropped_with_a_warning() -> None:
    text = text_of("12_dgx-a100-8gpu-nv12-10nic-nps4.txt")
    header = text.split("\n")[4]
    # 13 characters of CPU Affinity: "48-63,176-191" fits, "112-127,240-255" becomes
    # "112-127,240-2" (a range running backwards), and NUMA Affinity is gone.
    edge = header.index("CPU Affinity") + 13
    topology = parse_topology(crop(text, edge))
    clean = parse_topology(text)
    assert (topology.links, topology.nics) == (clean.links, clean.nics)
    assert topology.gpus == (GpuAffinity(),) * 8
    (warning,) = topology.warnings
    assert warning.startswith(f"line 5: the capture looks cropped at column {edge} ")
    assert "GPU4 CPU Affinity '112-127,240-2'" in warning
    assert "GPU0 CPU Affinity '48-63,176-191'" in warning  # at the edge: may be cut too


def test_cut_header_name_alone_keeps_the_whole_values() -> None:
    text = text_of("29_hgx-h100-compact-2space-columns.txt")
    header = text.split("\n")[5]
    edge = header.index("NUMA Affinity") + len("NUMA Aff")
    topology = parse_topology(crop(text, edge))
    assert topology == dataclasses.replace(
        parse_topology(text),
        warnings=(
            f"line 6: the capture looks cropped at column {edge} (its right edge); no GPU "
            "value reaches it",
        ),
    )


def test_values_past_the_edge_are_unknown_and_the_one_at_it_dropped() -> None:
    text = (
        "      GPU0  GPU1  CPU Affinity    NUMA Affinity\n"
        "GPU0   X    SYS   0-31            0\n"
        "GPU1  SYS    X    32-63,96-127,160-191,224-255 1\n"
    )
    # The header ends in "NUMA" (cut); GPU1's value reaches the edge, so it may be cut even
    # though "32-63,96-127,160-191" reads as a whole list; GPU0's row ends before it.
    topology = parse_topology(crop(text, text.index("NUMA") + 4))
    assert topology.gpus == (GpuAffinity("0-31", "0"), GpuAffinity())
    assert topology.warnings == (
        "line 1: the capture looks cropped at column 38 (its right edge); dropped as possibly "
        "cut: GPU1 CPU Affinity '32-63,96-127,160-191'; unknown: GPU1 NUMA Affinity",
    )


def test_crop_inside_the_link_cells_is_refused() -> None:
    text = text_of("28_dgx-a100-compact-2space-columns.txt")
    header = text.split("\n")[matrix_block(text.split("\n"))[0]]
    with pytest.raises(TopologyParseError) as caught:
        parse_topology(crop(text, header.index("GPU7") + 2), source="28")
    assert str(caught.value) == (
        "28, line 14: row GPU7 has no column in the header (which has GPU0..GPU6); expected "
        "one row per GPU column (is the capture cropped?)"
    )


# -- synthetic captures: formats the real ones do not all show ---------------------------


def test_raw_and_aliased_nic_columns_in_any_order_with_legend() -> None:
    text = (
        "\tGPU0\tGPU1\tNIC1\tNIC0\tmlx5_bond_0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\t\n"
        "GPU0\t X \tNV4\tPIX\tSYS\tNODE\t0-3\t0\t\tN/A\t\n"
        "GPU1\tNV4\t X \tPXB\tSYS\tNODE\t0-3\t0\t\tN/A\t\n"
        "NIC1\tPIX\tPXB\t X \tSYS\tNODE\n"
        "NIC0\tSYS\tSYS\tSYS\t X \tSYS\n"
        "mlx5_bond_0\tNODE\tNODE\tNODE\tSYS\t X \n"
        "\n"
        "NIC Legend:\n"
        "\n"
        "  NIC0: mlx5_4\n"
        "  NIC1: mlx5_0\n"
    )
    topology = parse_topology(text)
    assert [nic.name for nic in topology.nics] == ["mlx5_0", "mlx5_4", "mlx5_bond_0"]
    assert {n.name: {g: str(link) for g, link in n.links.items()} for n in topology.nics} == {
        "mlx5_0": {0: "PIX", 1: "PXB"},
        "mlx5_4": {0: "SYS", 1: "SYS"},
        "mlx5_bond_0": {0: "NODE", 1: "NODE"},
    }
    assert topology.links == {(0, 1): Link(LinkKind.NV, 4)}


def test_crlf_comments_and_high_nvlink_counts() -> None:
    text = "# provenance\r\n\r\n  GPU0  GPU1\r\n  GPU0  X  NV36  \r\n  GPU1  NV36  X\r\n"
    topology = parse_topology(text)
    assert topology.links == {(0, 1): Link(LinkKind.NV, 36)}
    assert topology.gpus == (GpuAffinity(), GpuAffinity())


def test_single_gpu() -> None:
    topology = parse_topology("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\t0\n")
    assert topology.links == {}
    assert topology.gpus == (GpuAffinity(cpu_affinity="0-7", numa_affinity="0"),)


def test_malformed_affinity_is_unknown_with_a_warning() -> None:
    text = (
        "  GPU0  GPU1  CPU Affinity  NUMA Affinity\nGPU0  X  PHB  0-7  0\nGPU1  PHB  X  0-  x1\n"
    )
    topology = parse_topology(text)
    assert topology.gpus[1] == GpuAffinity()
    assert topology.warnings == (
        "line 3: GPU1 CPU Affinity '0-' is not a list of ids (ranges ascending); recorded "
        "as unknown",
        "line 3: GPU1 NUMA Affinity 'x1' is not a list of ids (ranges ascending); recorded "
        "as unknown",
    )


def test_nic_columns_without_rows_are_read_from_the_gpu_rows() -> None:
    text = "  GPU0  GPU1  NIC0\nGPU0  X  PHB  PIX\nGPU1  PHB  X  SYS\n"
    topology = parse_topology(text)
    assert topology.nics[0].links == {0: Link(LinkKind.PIX), 1: Link(LinkKind.SYS)}
    assert topology.warnings == (
        "line 1: no rows for NIC columns NIC0 (cut short?); their links are read from the "
        "GPU rows only",
    )


HEADER = "\tGPU0\tGPU1\tCPU Affinity\n"
BAD_INPUTS = [
    pytest.param("not a topology\njust prose\n", None, "no GPUs", id="no-matrix"),
    pytest.param("", None, "no GPUs", id="empty"),
    pytest.param("  NIC0  CPU Affinity\nNIC0  X\n", None, "no GPUs", id="nics-only"),
    pytest.param(HEADER + "hello world\n", 2, "expected row GPU0, found 'hello'", id="prose"),
    pytest.param(
        "GPU0  X  PHB\nGPU1  PHB  X\n", 1, "expected the header line", id="rows-without-header"
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\n", 3, "expected row GPU1, found the end", id="short"
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\nGPU1\tPHB\t0-3\n",
        3,
        "row GPU1 has 2 cells; expected 2 link cells (GPU0..GPU1) then 1 values (CPU Affinity)",
        id="ragged-row",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\t0\nGPU1\tPHB\tX\t0-3\n", 2, "has 4 cells", id="extra-cell"
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\nGPU1\tFOO\tX\t0-3\n",
        3,
        "unknown link code 'FOO' in row GPU1, column GPU0; expected one of X, PIX",
        id="unknown-code",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tNV0\t0-3\nGPU1\tNV0\tX\t0-3\n", 2, "unknown link code 'NV0'", id="nv0"
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPIX\t0-3\nGPU1\tPHB\tX\t0-3\n",
        3,
        "row GPU1 has PHB in column GPU0 but row GPU0 (line 2) has PIX in column GPU1; "
        "expected a symmetric matrix",
        id="asymmetric",
    ),
    pytest.param(
        HEADER + "GPU0\tPHB\tPHB\t0-3\nGPU1\tPHB\tX\t0-3\n",
        2,
        "row GPU0 has 'PHB' in its own column; expected X on the diagonal",
        id="missing-x",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tX\t0-3\nGPU1\tX\tX\t0-3\n",
        2,
        "row GPU0 has X in column GPU1; expected X only on the diagonal (column GPU0)",
        id="x-off-diagonal",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\nGPU0\tX\tPHB\t0-3\n",
        3,
        "duplicate row GPU0 (first on line 2); expected row GPU1",
        id="duplicate-gpu-row",
    ),
    pytest.param(
        HEADER + "GPU1\tPHB\tX\t0-3\nGPU0\tX\tPHB\t0-3\n",
        2,
        "row GPU1 is out of order; expected row GPU0",
        id="gpu-rows-out-of-order",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\nGPU1\tPHB\tX\t0-3\nGPU2\tPHB\tPHB\t0-3\n",
        4,
        "row GPU2 has no column in the header (which has GPU0..GPU1)",
        id="gpu-columns-cropped",
    ),
    pytest.param(
        "\tGPU0\tGPU2\n", 1, "header column 'GPU2' is out of place or repeated", id="header-gap"
    ),
    pytest.param(
        "\tGPU0\tCPU Affinity\tNIC0\n",
        1,
        "header column 'NIC0' is out of place",
        id="nic-after-affinity",
    ),
    pytest.param(
        "\tGPU0\tNIC0\tNIC0\n", 1, "header column 'NIC0' is out of place or repeated", id="dup-nic"
    ),
    pytest.param(
        "\tGPU0\tNIC0\nGPU0\tX\tPIX\nNIC1\tPIX\tX\n",
        3,
        "row NIC1 has no column in the header; expected rows only for the header's columns",
        id="unknown-nic-row",
    ),
    pytest.param(
        "\tGPU0\tNIC0\nGPU0\tX\tPIX\nNIC0\tPXB\tX\n",
        3,
        "row NIC0 has PXB in column GPU0 but row GPU0 (line 2) has PIX in column NIC0",
        id="asymmetric-nic",
    ),
    pytest.param(
        "\tGPU0\tGPU1\nGPU0\tX\tPIX\nGPU1\tPIX\tX\nNIC0\tPIX\tX\n",
        4,
        "row NIC0 has X in column GPU1; expected link codes only, its own column being missing",
        id="cropped-nic-row-with-x",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\nGPU1\tPHBX\tPHB\t0-3\n",
        3,
        "row GPU1 has 4 cells; expected 2 link cells (GPU0..GPU1) then 1 values",
        id="glued-cells-split-to-too-many",
    ),
    pytest.param(
        HEADER + "GPU0\tX\tPHB\t0-3\nGPU1\tPHBFOO\tX\t0-3\n",
        3,
        "unknown link code 'PHBFOO' in row GPU1, column GPU0",
        id="glued-unknown-code",
    ),
    pytest.param(
        "GPU0GPU1eth0\tCPU Affinity\nGPU0\tX\tPHB\t0-3\nGPU1\tPHB\tX\t0-3\n",
        1,
        "header 'GPU0GPU1eth0' runs names together that are not all known ones",
        id="glued-header-unknown-name",
    ),
    pytest.param(
        "      GPU0  GPU1  CPU\nGPU0   X         NV18\nGPU1  NV18   X   0-3\n",
        2,
        "row GPU0 ends at the cropped right edge (column 21) in its link cells; expected 2 link "
        "cells (GPU0..GPU1) then 1 values (CPU Affinity)",
        id="crop-in-link-cells",
    ),
    pytest.param(
        "# one\r\n# two\r\n"
        + HEADER.replace("\n", "\r\n")
        + "GPU0\tX\tPHB\t0-3\r\nGPU1\t?\tX\r\n",
        5,
        "row GPU1 has 2 cells",
        id="line-numbers-count-comments-and-crlf",
    ),
]


@pytest.mark.parametrize(("text", "line", "phrase"), BAD_INPUTS)
def test_bad_input_is_refused_with_line_and_expectation(
    text: str, line: int | None, phrase: str
) -> None:
    with pytest.raises(TopologyParseError) as caught:
        parse_topology(text, source="capture.txt")
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.line == line
    prefix = "capture.txt" if line is None else f"capture.txt, line {line}: "
    assert str(error).startswith(prefix)
    assert phrase in str(error)


def test_capture_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "topo.txt"
    path.write_bytes(b"\tGPU0\nGPU0\t X \xff\n")
    with pytest.raises(TopologyParseError, match=r"line 2: not UTF-8 text"):
        inventory_from_capture(path, SPEC)


def test_capture_with_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "topo.txt"
    path.write_bytes(b"\xef\xbb\xbfGPU0\tGPU1\r\nGPU0\t X \tSYS\r\nGPU1\tSYS\t X \r\n")
    assert inventory_from_capture(path, SPEC).links == {(0, 1): Link(LinkKind.SYS)}


# -- any well-formed matrix in any layout parses to what was rendered ---------------------

GPU_CODES = ["PIX", "PXB", "PHB", "NODE", "SYS", "SOC", "NV1", "NV2", "NV12", "NV18", "NV24"]
PCIE_CODES = ["PIX", "PXB", "PHB", "NODE", "SYS"]


def expected_link(code: str) -> Link:
    if code.startswith("NV"):
        return Link(LinkKind.NV, int(code[2:]))
    return Link(LinkKind.SYS if code == "SOC" else LinkKind(code))


@st.composite
def matrices(draw: st.DrawFn) -> tuple[str, dict[tuple[int, int], Link], dict[str, dict]]:
    gpus = draw(st.integers(1, 6))
    nic_names = draw(
        st.lists(st.sampled_from(["NIC0", "NIC1", "NIC7", "mlx5_0", "mlx4_1"]), unique=True)
    )
    size = gpus + len(nic_names)
    codes: dict[tuple[int, int], str] = {}
    for i in range(size):
        for j in range(i + 1, size):
            pool = GPU_CODES if j < gpus else PCIE_CODES
            codes[i, j] = codes[j, i] = draw(st.sampled_from(pool))
    values = draw(st.sampled_from([[], ["CPU Affinity"], ["CPU Affinity", "NUMA Affinity"]]))
    values = values + (["GPU NUMA ID"] if len(values) == 2 and draw(st.booleans()) else [])
    style = draw(st.sampled_from(["tabs", "8-col", "2-space"]))
    indent = draw(st.sampled_from(["", "    "]))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    trailing = draw(st.sampled_from(["", " ", "\t"]))

    def line(cells: list[str]) -> str:
        if style == "tabs":
            text = "\t".join(cells)
        elif style == "8-col":
            text = "".join(cell.ljust(8) if len(cell) < 8 else cell + " " for cell in cells)
        else:
            text = "  ".join(cells)
        return indent + text + trailing

    names = [f"GPU{i}" for i in range(gpus)] + nic_names
    affinity = {"CPU Affinity": "0-7,16-23", "NUMA Affinity": "0", "GPU NUMA ID": "N/A"}
    lines = [line(["", *names, *values])]
    for i, name in enumerate(names):
        cells = [" X " if i == j else codes[i, j] for j in range(size)]
        lines.append(line([name, *cells, *(affinity[v] for v in values if i < gpus)]))
    links = {(i, j): expected_link(codes[i, j]) for i in range(gpus) for j in range(i + 1, gpus)}
    nics = {
        name: {g: expected_link(codes[g, gpus + k]) for g in range(gpus)}
        for k, name in enumerate(nic_names)
    }
    return newline.join(lines) + newline, links, nics


@settings(max_examples=200, deadline=None)
@given(matrices())
def test_any_layout_parses_to_the_rendered_matrix(
    case: tuple[str, dict[tuple[int, int], Link], dict[str, dict]],
) -> None:
    text, links, nics = case
    topology = parse_topology(text)
    assert topology.links == links
    assert {nic.name: dict(nic.links) for nic in topology.nics} == nics
    assert topology.warnings == ()


# -- the NVML path: a fake at the seam, then the same code as a capture --------------------


class FakeNvml:
    """Stands in for `NvmlReader`: returns what NVML would on the machine described."""

    def __init__(self, raw: RawSystem) -> None:
        self.raw = raw

    def read(self) -> RawSystem:
        return self.raw


def mask(*ranges: range) -> tuple[int, ...]:
    """A 64-bit-word mask with the bits of `ranges` set."""
    bits = sorted({b for r in ranges for b in r})
    words = [0] * (bits[-1] // 64 + 1)
    for bit in bits:
        words[bit // 64] |= 1 << (bit % 64)
    return tuple(words)


def bus(index: int) -> str:
    return f"00000000:{0x10 * (index + 1):02X}:00.0"


def raw_system(
    count: int,
    ancestor: dict[tuple[int, int], int],
    cpus: list[tuple[int, ...]],
    nodes: list[tuple[int, ...]],
    nvlinks: dict[int, list[RawNvLink]] | None = None,
) -> RawSystem:
    devices = tuple(
        RawDevice(
            uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
            name="NVIDIA Test",
            memory_total_bytes=80 << 30,
            memory_used_bytes=1 << 30,
            pci_bus_id=bus(index),
            cpu_mask=cpus[index],
            numa_mask=nodes[index],
            nvlinks=tuple((nvlinks or {}).get(index, [])),
        )
        for index in range(count)
    )
    return RawSystem(devices=devices, common_ancestors=ancestor)


def pairs(count: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(count) for j in range(i + 1, count)]


def dgx1_v100() -> RawSystem:
    """File 21's machine: hybrid cube-mesh NVLinks wired GPU to GPU, two sockets."""
    wiring = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2}
    wiring |= {(2, 3): 2, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2}
    wiring |= {(5, 6): 2, (5, 7): 1, (6, 7): 2}
    nvlinks: dict[int, list[RawNvLink]] = {i: [] for i in range(8)}
    for (a, b), count in wiring.items():
        nvlinks[a] += [RawNvLink(bus(b), pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)] * count
        # an older driver that cannot tell the remote type: matched by bus id alone
        nvlinks[b] += [RawNvLink(bus(a).replace("00000000:", "0000:"))] * count
    same_socket = pynvml.NVML_TOPOLOGY_NODE
    ancestor = {
        (i, j): same_socket if i // 4 == j // 4 else pynvml.NVML_TOPOLOGY_SYSTEM
        for i, j in pairs(8)
    }
    socket_cpus = [mask(range(0, 12), range(24, 36)), mask(range(12, 24), range(36, 48))]
    return raw_system(8, ancestor, [socket_cpus[i // 4] for i in range(8)], [()] * 8, nvlinks)


def dgx_a100() -> RawSystem:
    """File 28's machine: every GPU has 12 NVLinks to NVSwitches, none to another GPU."""
    switch = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    nvlinks = {
        i: [RawNvLink(f"00000000:{0xC0 + s:02X}:00.0", switch) for s in range(6)] * 2
        for i in range(8)
    }
    ancestor = {
        (i, j): pynvml.NVML_TOPOLOGY_NODE if i // 4 == j // 4 else pynvml.NVML_TOPOLOGY_SYSTEM
        for i, j in pairs(8)
    }
    cpus = [mask(range(0, 24))] * 4 + [mask(range(24, 48))] * 4
    return raw_system(8, ancestor, cpus, [mask(range(1))] * 4 + [mask(range(1, 2))] * 4, nvlinks)


def five_consumer_gpus() -> RawSystem:
    """File 30's machine: PCIe only; GPU0 alone on NUMA 1; PHB pairs (1,2) and (3,4)."""
    ancestor = {pair: pynvml.NVML_TOPOLOGY_NODE for pair in pairs(5)}
    ancestor |= {(0, j): pynvml.NVML_TOPOLOGY_SYSTEM for j in range(1, 5)}
    ancestor |= {(1, 2): pynvml.NVML_TOPOLOGY_HOSTBRIDGE, (3, 4): pynvml.NVML_TOPOLOGY_HOSTBRIDGE}
    cpus = [mask(range(8, 16), range(24, 32))] + [mask(range(0, 8), range(16, 24))] * 4
    return raw_system(5, ancestor, cpus, [mask(range(1, 2))] + [mask(range(1))] * 4)


@pytest.mark.parametrize(
    ("name", "machine"),
    [
        ("21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt", dgx1_v100),
        ("28_dgx-a100-compact-2space-columns.txt", dgx_a100),
        ("30_5gpu-mixed-2x5090-3x4090-numa-split.txt", five_consumer_gpus),
    ],
)
def test_nvml_and_capture_agree_on_the_same_machine(
    name: str, machine: Callable[[], RawSystem]
) -> None:
    sources: list[InventorySource] = [
        NvmlInventory(FakeNvml(machine())),
        TopologyFileInventory(capture(name), SPEC),
    ]
    from_nvml, from_capture = (source.read() for source in sources)
    assert from_nvml.links == from_capture.links
    assert [(g.numa_node, g.cpu_affinity) for g in from_nvml.gpus] == [
        (g.numa_node, g.cpu_affinity) for g in from_capture.gpus
    ]
    assert from_nvml.warnings == from_capture.warnings == ()


def test_a_real_nvml_read_gives_what_the_same_machines_capture_gives() -> None:
    """NVML's answers on a real H200, recorded there (`python -m tests.nvml_record`), beside
    that machine's `nvidia-smi topo -m`: both paths give the same GPU, and NVML the rest."""
    raw = nvml_record.load(NVML_RECORDS / "40_h200-1gpu-vm.json")
    spec = GpuSpec(name="NVIDIA H200", memory_mib=143771)
    from_nvml = NvmlInventory(FakeNvml(raw)).read()
    from_capture = inventory_from_capture(
        capture("40_h200-1gpu-vm-escape-underlined-header.txt"), spec
    )
    assert from_nvml.links == from_capture.links == {}
    assert (
        [(g.numa_node, g.cpu_affinity) for g in from_nvml.gpus]
        == [(g.numa_node, g.cpu_affinity) for g in from_capture.gpus]
        == [(0, "0-15")]
    )
    (gpu,) = from_nvml.gpus
    assert (gpu.name, gpu.memory_total_mib) == (spec.name, spec.memory_mib)
    assert (gpu.uuid, gpu.pci_bus_id) == (raw.devices[0].uuid, "00000000:00:06.0")
    assert gpu.compute_capability == "9.0" and gpu.memory_used_mib == 615
    assert (from_nvml.driver_version, from_nvml.cuda_version) == ("580.159.04", "13.0")
    assert from_nvml.warnings == from_capture.warnings == ()


def test_terminal_escapes_in_a_capture_are_dropped() -> None:
    """Any CSI sequence, anywhere: the parse equals the one of the text without them."""
    plain = text_of("27_2gpu-workstation-phb-no-nvlink.txt")
    lines = plain.split("\n")
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("GPU0"))
    lines[header] = "\t\x1b[4m" + lines[header].strip() + "\x1b[0m"
    lines[header + 1] = "\x1b[1;32m" + lines[header + 1] + "\x1b[K"
    assert parse_topology("\n".join(lines)) == parse_topology(plain)


@pytest.mark.parametrize(
    ("level", "code"),
    [
        (pynvml.NVML_TOPOLOGY_INTERNAL, "PIX"),
        (pynvml.NVML_TOPOLOGY_SINGLE, "PIX"),
        (pynvml.NVML_TOPOLOGY_MULTIPLE, "PXB"),
        (pynvml.NVML_TOPOLOGY_HOSTBRIDGE, "PHB"),
        (pynvml.NVML_TOPOLOGY_NODE, "NODE"),
        (pynvml.NVML_TOPOLOGY_CPU, "NODE"),
        (pynvml.NVML_TOPOLOGY_SYSTEM, "SYS"),
    ],
)
def test_nvml_path_levels_map_to_topo_codes(level: int, code: str) -> None:
    raw = raw_system(2, {(0, 1): level}, [()] * 2, [()] * 2)
    assert str(inventory_from_nvml(raw).link(0, 1)) == code


def test_nvml_level_missing_or_unknown_is_sys_with_a_warning() -> None:
    raw = raw_system(3, {(0, 1): 60, (1, 2): pynvml.NVML_TOPOLOGY_SINGLE}, [()] * 3, [()] * 3)
    inventory = inventory_from_nvml(raw)
    assert [str(inventory.link(*pair)) for pair in pairs(3)] == ["SYS", "SYS", "PIX"]
    assert inventory.warnings == (
        "GPU0-GPU1: NVML gave unknown topology level 60; taken as SYS",
        "GPU0-GPU2: NVML gave no PCIe path; taken as SYS",
    )


def test_nvlinks_need_both_ends() -> None:
    one_way = {0: [RawNvLink(bus(1), pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)] * 4}
    raw = raw_system(2, {(0, 1): pynvml.NVML_TOPOLOGY_SYSTEM}, [()] * 2, [()] * 2, one_way)
    assert inventory_from_nvml(raw).link(0, 1) == Link(LinkKind.SYS)


def test_nvml_refused_p2p_is_a_warning() -> None:
    raw = raw_system(
        3, dict.fromkeys(pairs(3), pynvml.NVML_TOPOLOGY_HOSTBRIDGE), [()] * 3, [()] * 3
    )
    gns = pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED
    raw = dataclasses.replace(
        raw,
        p2p_read={(0, 1): gns, (0, 2): gns, (1, 2): pynvml.NVML_P2P_STATUS_OK},
    )
    assert inventory_from_nvml(raw).warnings == (
        "peer-to-peer reads refused by the driver (GPU not supported): GPU0-GPU1, GPU0-GPU2",
    )


def test_nvml_details_and_versions() -> None:
    device = RawDevice(
        uuid="GPU-12345678-1234-1234-1234-123456789abc",
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=85_520_809_984,
        memory_used_bytes=(3 << 20) + 5,
        pci_bus_id="00000000:18:00.0",
        utilization_pct=42,
        compute_capability=(9, 0),
        cpu_mask=mask(range(0, 4), range(6, 7), range(64, 66)),
        numa_mask=mask(range(0, 1), range(5, 12)),
    )
    raw = RawSystem(
        devices=(device,),
        common_ancestors={},
        driver_version="550.54.15",
        cuda_driver_version=12040,
    )
    inventory = NvmlInventory(FakeNvml(raw)).read()
    (gpu,) = inventory.gpus
    assert (gpu.uuid, gpu.name, gpu.pci_bus_id) == (device.uuid, device.name, "00000000:18:00.0")
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.utilization_pct) == (81559, 3, 42)
    assert (gpu.compute_capability, gpu.cpu_affinity) == ("9.0", "0-3,6,64-65")
    assert gpu.numa_node is None  # "0,5-11": several nodes
    assert (inventory.driver_version, inventory.cuda_version) == ("550.54.15", "12.4")


def test_nvml_unknown_details_stay_unknown() -> None:
    raw = raw_system(1, {}, [()], [mask(range(3, 4))])
    (gpu,) = inventory_from_nvml(raw).gpus
    assert (gpu.compute_capability, gpu.cpu_affinity, gpu.utilization_pct) == ("", "", 0)
    assert gpu.numa_node == 3
    assert inventory_from_nvml(raw).cuda_version == ""


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this host has an NVIDIA driver"
)
def test_nvml_without_a_driver_says_what_to_use_instead() -> None:
    with pytest.raises(InventoryUnavailable, match=r"--topology-file FILE .* or --no-gpu"):
        NvmlReader().read()


def test_build_inventory_checks_its_inputs() -> None:
    topology = ParsedTopology(gpus=(GpuAffinity(), GpuAffinity()), links={})
    details = [GpuDetails(uuid="GPU-a", name="n", memory_total_mib=1)] * 2
    with pytest.raises(ValueError, match="expected every pair"):
        build_inventory(topology, details)
    with pytest.raises(ValueError, match="1 GPU details for a topology of 2 GPUs"):
        build_inventory(topology, details[:1])


def test_cpu_only_inventory() -> None:
    assert cpu_only_inventory() == Inventory(gpus=(), links={})


# -- GPU specs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("A100-SXM4-80GB:81920", GpuSpec("A100-SXM4-80GB", 81920)),
        ("NVIDIA H100 80GB HBM3 : 81559", GpuSpec("NVIDIA H100 80GB HBM3", 81559)),
        ("odd:name:1024", GpuSpec("odd:name", 1024)),
    ],
)
def test_gpu_spec_parses(text: str, spec: GpuSpec) -> None:
    assert GpuSpec.parse(text) == spec


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("A100", "expected NAME:MIB"),
        (":81920", "model name is empty"),
        ("A100:", "is not a whole number of MiB"),
        ("A100:80GB", "'80GB' is not a whole number of MiB"),
        ("A100:-5", "is not a whole number of MiB"),
        ("A100:0", "memory must be a positive MiB count, not 0"),
        ("A100:\uff18\uff10", "is not a whole number of MiB"),
    ],
)
def test_gpu_spec_refuses(text: str, phrase: str) -> None:
    with pytest.raises(ValueError, match=re.escape(phrase)):
        GpuSpec.parse(text)
