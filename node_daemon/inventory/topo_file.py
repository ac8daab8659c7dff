"""Inventory from a `nvidia-smi topo -m` capture plus a GPU spec, for hosts without GPUs.

The capture gives the topology (links, affinities, NICs); the spec gives what `topo -m` does
not show (model name, memory). GPU UUIDs are synthetic: derived from the capture's bytes and
the GPU index, so the same file always yields the same UUIDs.

The reader splits on whitespace runs, never on fixed columns, and checks the matrix (square,
X on the diagonal, symmetric, known link codes) rather than trusting it: a damaged capture
either parses with `ParsedTopology.warnings` saying what was lost (a terminal crop that lost
the NIC columns) or fails with `TopologyParseError` naming the line. The legends are never
needed; the `NIC Legend:` block only names NICs.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from node_daemon.inventory.assembly import (
    GpuAffinity,
    GpuDetails,
    ParsedTopology,
    build_inventory,
)
from node_daemon.inventory.errors import TopologyParseError
from node_daemon.inventory.model import Inventory, Link, LinkKind, Nic

logger = logging.getLogger(__name__)

CPU_AFFINITY = "CPU Affinity"
NUMA_AFFINITY = "NUMA Affinity"
GPU_NUMA_ID = "GPU NUMA ID"
_VALUE_COLUMNS = (CPU_AFFINITY, NUMA_AFFINITY, GPU_NUMA_ID)

_SELF = "X"
_NOT_AVAILABLE = "N/A"
_GPU_NAME = re.compile(r"GPU([0-9]+)")
_NV_CODE = re.compile(r"NV([1-9][0-9]*)")
_PCIE_CODES = {
    "PIX": LinkKind.PIX,
    "PXB": LinkKind.PXB,
    "PHB": LinkKind.PHB,
    "NODE": LinkKind.NODE,
    "SYS": LinkKind.SYS,
    "SOC": LinkKind.SYS,  # drivers before ~384 printed SOC for what is now SYS
}
_EXPECTED_CODES = "X, PIX, PXB, PHB, NODE, SYS, SOC or NV<n>"
_ID_LIST = re.compile(r"[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*")
_NIC_LEGEND_ENTRY = re.compile(r"(NIC[0-9]+):\s*(\S+)")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """What a capture does not say about its GPUs; applies to every GPU in it."""

    name: str
    memory_mib: int
    """Total memory per GPU in MiB."""

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("GPU spec: the model name is empty")
        if self.memory_mib <= 0:
            raise ValueError(
                f"GPU spec: memory must be a positive MiB count, not {self.memory_mib}"
            )

    @classmethod
    def parse(cls, text: str) -> GpuSpec:
        """`NAME:MIB` as given to `--gpu-spec`, e.g. "A100-SXM4-80GB:81920".

        The memory is after the last colon, so a name may hold colons. Raises ValueError
        saying what is wrong.
        """
        name, colon, memory = text.rpartition(":")
        if not colon:
            raise ValueError(f"GPU spec {text!r}: expected NAME:MIB, e.g. A100-SXM4-80GB:81920")
        if not memory.strip().isascii() or not memory.strip().isdigit():
            raise ValueError(f"GPU spec {text!r}: memory {memory!r} is not a whole number of MiB")
        return cls(name=name.strip(), memory_mib=int(memory))


def synthetic_uuid(content: bytes, index: int) -> str:
    """A stable UUID for GPU `index` of the capture `content`, formatted as NVML's are."""
    digest = hashlib.sha256(content + b"\0" + str(index).encode()).digest()
    return f"GPU-{uuid.UUID(bytes=digest[:16])}"


def inventory_from_capture(path: Path, spec: GpuSpec) -> Inventory:
    """The inventory a capture file describes, every GPU being `spec`.

    Blocking (reads the file). Raises OSError when the file cannot be read and
    TopologyParseError when it is not a readable topology (or not UTF-8 text).
    """
    content = path.read_bytes()
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = content[: err.start].count(b"\n") + 1
        raise TopologyParseError(str(path), line, f"not UTF-8 text ({err.reason})") from err
    topology = parse_topology(text, source=str(path))
    for warning in topology.warnings:
        logger.warning("capture=%s %s", path, warning)
    details = [
        GpuDetails(
            uuid=synthetic_uuid(content, index), name=spec.name, memory_total_mib=spec.memory_mib
        )
        for index in range(len(topology.gpus))
    ]
    logger.info(
        "capture=%s gpus=%d nics=%d warnings=%d",
        path,
        len(details),
        len(topology.nics),
        len(topology.warnings),
    )
    return build_inventory(topology, details)


@dataclass(frozen=True, slots=True)
class TopologyFileInventory:
    """An `InventorySource` reading a capture file (re-read on every `read`)."""

    path: Path
    spec: GpuSpec

    def read(self) -> Inventory:
        """See `inventory_from_capture`."""
        return inventory_from_capture(self.path, self.spec)


def parse_topology(text: str, source: str = "<text>") -> ParsedTopology:
    """The topology in `nvidia-smi topo -m` output `text`.

    Lines before the header (provenance `#` lines, prompts) are skipped. The header is the
    first line whose first token is GPU0 and whose next token is not X; the matrix is the
    rows under it up to a blank line or a `...:` line (Legend). Raises TopologyParseError,
    with `source` and the 1-based line, for anything that is not a whole GPU-by-GPU matrix.
    """
    return _Capture(text, source).parse()


@dataclass(frozen=True, slots=True)
class _Header:
    line: int
    gpu_count: int
    nics: tuple[str, ...]
    """NIC column names in header order (NIC0.. aliases or device names such as mlx5_0)."""
    values: tuple[str, ...]
    """The affinity columns present, in header order."""

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f"GPU{i}" for i in range(self.gpu_count)) + self.nics


@dataclass(frozen=True, slots=True)
class _Row:
    line: int
    label: str
    tokens: tuple[str, ...]
    """Everything after the label."""


class _Capture:
    """One parse of one text; `error` ties every failure to the source."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.lines = text.split("\n")
        self.warnings: list[str] = []

    def error(self, line: int | None, reason: str) -> TopologyParseError:
        return TopologyParseError(self.source, line, reason)

    def parse(self) -> ParsedTopology:
        header = self._header()
        gpu_rows, nic_rows, end = self._rows(header)
        cropped = not header.nics and bool(nic_rows)
        matrix = self._matrix(header, gpu_rows, [] if cropped else nic_rows)
        n = header.gpu_count
        links = {(i, j): matrix[i][j] for i in range(n) for j in range(i + 1, n)}
        legend = self._nic_legend(end)
        if cropped:
            nics = self._cropped_nics(header, nic_rows, legend)
        else:
            nics = self._nics(header, matrix, nic_rows, legend)
        gpus = tuple(self._affinity(header, row, cropped) for row in gpu_rows)
        if cropped and CPU_AFFINITY in header.values:
            cut = sorted({self._values(header, row)[CPU_AFFINITY] for row in gpu_rows})
            self.warnings.append(
                f"line {header.line}: CPU Affinity is not trusted in a cropped capture "
                f"(values {', '.join(map(repr, cut))}); recorded as unknown, NUMA Affinity kept"
            )
        return ParsedTopology(
            gpus=gpus, links=links, nics=tuple(nics), warnings=tuple(self.warnings)
        )

    def _header(self) -> _Header:
        for number, line in enumerate(self.lines, start=1):
            tokens = line.split()
            if not tokens or tokens[0] != "GPU0":
                continue
            if len(tokens) > 1 and tokens[1] == _SELF:
                raise self.error(
                    number,
                    "matrix row GPU0 comes before any header; expected the header line "
                    "(GPU0 GPU1 ... CPU Affinity) above the rows",
                )
            return self._parse_header(number, tokens)
        raise self.error(
            None,
            f"no GPUs: no topology matrix in {len(self.lines)} lines; expected a header line "
            "starting with GPU0 (e.g. 'GPU0  GPU1  CPU Affinity  NUMA Affinity')",
        )

    def _parse_header(self, number: int, tokens: list[str]) -> _Header:
        gpu_count = 0
        while gpu_count < len(tokens) and tokens[gpu_count] == f"GPU{gpu_count}":
            gpu_count += 1
        nics: list[str] = []
        values: list[str] = []
        position = gpu_count
        while position < len(tokens):
            token = tokens[position]
            value = next(
                (
                    name
                    for name in _VALUE_COLUMNS
                    if tokens[position : position + len(name.split())] == name.split()
                ),
                None,
            )
            if value is not None and value not in values:
                values.append(value)
                position += len(value.split())
                continue
            if values or value is not None or _GPU_NAME.fullmatch(token) or token in nics:
                raise self.error(
                    number,
                    f"header column {token!r} is out of place or repeated; expected "
                    f"GPU0..GPUn in order, then NIC columns, then any of "
                    f"{', '.join(_VALUE_COLUMNS)} once each",
                )
            nics.append(token)
            position += 1
        return _Header(number, gpu_count, tuple(nics), tuple(values))

    def _rows(self, header: _Header) -> tuple[list[_Row], list[_Row], int]:
        """The GPU rows and NIC rows under the header, and the line where the matrix ends."""
        gpu_rows: list[_Row] = []
        nic_rows: list[_Row] = []
        first_seen: dict[str, int] = {}
        end = len(self.lines) + 1
        n = header.gpu_count
        for number in range(header.line + 1, len(self.lines) + 1):
            line = self.lines[number - 1].strip()
            if line.startswith("#"):
                continue
            if not line or line.endswith(":"):
                end = number
                break
            label, *rest = line.split()
            row = _Row(number, label, tuple(rest))
            expected = f"row GPU{len(gpu_rows)}" if len(gpu_rows) < n else "a NIC row"
            if label in first_seen:
                raise self.error(
                    number,
                    f"duplicate row {label} (first on line {first_seen[label]}); "
                    f"expected {expected}",
                )
            first_seen[label] = number
            match = _GPU_NAME.fullmatch(label)
            if match is None:
                if len(gpu_rows) < n:
                    raise self.error(number, f"expected {expected}, found {label!r}")
                nic_rows.append(row)
            elif int(match[1]) >= n:
                raise self.error(
                    number,
                    f"row {label} has no column in the header (which has GPU0..GPU{n - 1}); "
                    "expected one row per GPU column (is the capture cropped?)",
                )
            elif nic_rows or int(match[1]) != len(gpu_rows):
                raise self.error(number, f"row {label} is out of order; expected {expected}")
            else:
                gpu_rows.append(row)
        if len(gpu_rows) < n:
            raise self.error(end, f"expected row GPU{len(gpu_rows)}, found the end of the matrix")
        return gpu_rows, nic_rows, end

    def _matrix(
        self, header: _Header, gpu_rows: list[_Row], nic_rows: list[_Row]
    ) -> dict[int, dict[int, Link]]:
        """Each row's links (column index -> link, its own column left out), checked."""
        columns = header.columns
        matrix: dict[int, dict[int, Link]] = {}
        seen: dict[int, _Row] = {}
        for row in [*gpu_rows, *nic_rows]:
            if row.label not in columns:
                raise self.error(
                    row.line,
                    f"row {row.label} has no column in the header; expected rows only for "
                    f"the header's columns ({', '.join(columns)})",
                )
            own = columns.index(row.label)
            value_count = len(header.values) if own < header.gpu_count else 0
            if len(row.tokens) != len(columns) + value_count:
                raise self.error(
                    row.line,
                    f"row {row.label} has {len(row.tokens)} cells; expected "
                    f"{_describe_cells(columns, header.values[:value_count])}",
                )
            matrix[own] = self._links(row, columns, row.tokens[: len(columns)], own)
            for other, other_row in seen.items():
                mine, theirs = matrix[own][other], matrix[other][own]
                if mine != theirs:
                    raise self.error(
                        row.line,
                        f"row {row.label} has {mine} in column {columns[other]} but row "
                        f"{other_row.label} (line {other_row.line}) has {theirs} in column "
                        f"{row.label}; expected a symmetric matrix",
                    )
            seen[own] = row
        return matrix

    def _links(
        self, row: _Row, columns: tuple[str, ...], cells: tuple[str, ...], own: int | None
    ) -> dict[int, Link]:
        """Column index -> link for `cells`, which must hold X exactly at column `own`."""
        links: dict[int, Link] = {}
        for position, code in enumerate(cells):
            column = columns[position]
            if position == own:
                if code != _SELF:
                    raise self.error(
                        row.line,
                        f"row {row.label} has {code!r} in its own column; expected X on the "
                        "diagonal",
                    )
            elif code == _SELF:
                expected = (
                    f"X only on the diagonal (column {columns[own]})"
                    if own is not None
                    else "link codes only, its own column being missing from the header"
                )
                raise self.error(
                    row.line, f"row {row.label} has X in column {column}; expected {expected}"
                )
            else:
                link = _link(code)
                if link is None:
                    raise self.error(
                        row.line,
                        f"unknown link code {code!r} in row {row.label}, column {column}; "
                        f"expected one of {_EXPECTED_CODES}",
                    )
                links[position] = link
        return links

    def _nics(
        self,
        header: _Header,
        matrix: dict[int, dict[int, Link]],
        nic_rows: list[_Row],
        legend: dict[str, str],
    ) -> list[Nic]:
        nics = []
        for position, column in enumerate(header.nics, start=header.gpu_count):
            links = {gpu: matrix[gpu][position] for gpu in range(header.gpu_count)}
            nics.append(Nic(name=legend.get(column, column), links=links))
        missing = [name for name in header.nics if name not in {r.label for r in nic_rows}]
        if missing:
            self.warnings.append(
                f"line {header.line}: no rows for NIC columns {', '.join(missing)} (cut "
                "short?); their links are read from the GPU rows only"
            )
        return nics

    def _cropped_nics(
        self, header: _Header, nic_rows: list[_Row], legend: dict[str, str]
    ) -> list[Nic]:
        """NICs whose columns the header lost: named, their links not recorded.

        Their rows still hold cells under the GPU columns, but nothing proves those cells
        line up with them once a crop has removed part of every line; so they are only
        checked to be link codes, never used.
        """
        columns = header.columns
        for row in nic_rows:
            if len(row.tokens) > len(columns):
                raise self.error(
                    row.line,
                    f"row {row.label} has {len(row.tokens)} cells; expected at most "
                    f"{len(columns)} under the header's columns",
                )
            self._links(row, columns, row.tokens, own=None)
        labels = [row.label for row in nic_rows]
        self.warnings.append(
            f"line {header.line}: the header has no NIC columns but rows {', '.join(labels)} "
            "follow, so the capture looks cropped; those NICs' links are not recorded"
        )
        return [Nic(name=legend.get(label, label)) for label in labels]

    def _values(self, header: _Header, row: _Row) -> dict[str, str]:
        """A GPU row's affinity values by column name (its cell count is checked)."""
        cells = row.tokens[len(header.columns) :]
        return dict(zip(header.values, cells, strict=True))

    def _affinity(self, header: _Header, row: _Row, cropped: bool) -> GpuAffinity:
        values = self._values(header, row)
        return GpuAffinity(
            cpu_affinity="" if cropped else self._id_list(row, values, CPU_AFFINITY),
            numa_affinity=self._id_list(row, values, NUMA_AFFINITY),
        )

    def _id_list(self, row: _Row, values: dict[str, str], column: str) -> str:
        """The value as printed; "" when absent or N/A, and (with a warning) when malformed."""
        value = values.get(column, _NOT_AVAILABLE)
        if value == _NOT_AVAILABLE:
            return ""
        if _ID_LIST.fullmatch(value):
            return value
        self.warnings.append(
            f"line {row.line}: {row.label} {column} {value!r} is not a list of ids; "
            "recorded as unknown"
        )
        return ""

    def _nic_legend(self, start: int) -> dict[str, str]:
        """NIC<n> -> device name from the `NIC Legend:` block after line `start`, if any."""
        names: dict[str, str] = {}
        in_legend = False
        for line in self.lines[start - 1 :]:
            stripped = line.strip()
            if stripped == "NIC Legend:":
                in_legend = True
            elif in_legend and stripped:
                entry = _NIC_LEGEND_ENTRY.fullmatch(stripped)
                if entry is None:
                    break
                names.setdefault(entry[1], entry[2])
        return names


def _link(code: str) -> Link | None:
    """The link a matrix cell names; None for an unknown code (X is the caller's)."""
    if code in _PCIE_CODES:
        return Link(_PCIE_CODES[code])
    nv = _NV_CODE.fullmatch(code)
    return Link(LinkKind.NV, int(nv[1])) if nv else None


def _describe_cells(columns: tuple[str, ...], values: tuple[str, ...]) -> str:
    span = columns[0] if len(columns) == 1 else f"{columns[0]}..{columns[-1]}"
    described = f"{len(columns)} link cells ({span})"
    if values:
        described += f" then {len(values)} values ({', '.join(values)})"
    return described
