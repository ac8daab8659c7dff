"""Inventory from a `nvidia-smi topo -m` capture plus a GPU spec, for hosts without GPUs.

The capture gives the topology (links, affinities, NICs); the spec gives what `topo -m` does
not show (model name, memory). GPU UUIDs are synthetic: derived from the capture's bytes and
the GPU index, so the same file always yields the same UUIDs.

The reader splits on whitespace runs, never on fixed columns, and checks the matrix (square,
X on the diagonal, symmetric, known link codes) rather than trusting it: a damaged capture
either parses with `ParsedTopology.warnings` saying what was lost or fails with
`TopologyParseError` naming the line and what was expected there. The legends are never
needed; the `NIC Legend:` block only names NICs.

What it recovers, as real pastes show it:

- Terminal escape sequences are removed first: nvidia-smi underlined the header
  (`ESC[4m` ... `ESC[0m`) with its output going to a pipe, not a terminal (driver 580 on an
  H200, `tests/data/topologies/40_*`), so a capture a script saves keeps them.
- A uniform comment prefix (`#` or `//` before every non-blank line, as scripts print it) is
  removed; indentation never matters. Our captures' own `# source:` lines, which only
  some lines have, are skipped as any line before the header is.
- Glued header names (`GPU0GPU1`, `NIC7NIC8`, `mlx5_0CPU`: a lost tab) are split on the
  names a header holds: GPU<n>, NIC<n>, mlx4_<n>, mlx5_<n>, mlx5_bond_<n> and the words of
  CPU Affinity, NUMA Affinity and GPU NUMA ID.
- Glued cells (`SYSSYS`, `PXBSYS`, `XSYS`: nvidia-smi drops a separator when it prints many
  NIC columns) are split on the link codes. Nothing is ever shifted: after splitting, a row
  must still have exactly the cells its header asks for, or it is refused.
- A crop at the terminal's right edge. Evidence of one: the header's last name is cut
  (`NUMA Aff`), a GPU row has its link cells but fewer values than the header names, or the
  last cell of a GPU row that ends at the widest line's edge is not a valid id list (a
  range running backwards, `64-127,192-2`, or a dangling `-` or `,`). With that evidence,
  every GPU row ending at that edge (the crop column W: the widest of the header and the GPU
  rows) loses its last value, which may be cut, and values past the edge are unknown; both
  with a warning. A crop inside the link cells is refused. Without such evidence a crop that
  falls exactly between two columns cannot be told from a capture without them, and the
  values are kept.
- A crop that lost the NIC columns from the header while their rows remain (the terminal
  dropped part of every line): the NICs are named, their links and every CPU Affinity are
  not trusted, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from common.inventory import Inventory, Link, LinkKind, Nic
from node_daemon.inventory.assembly import (
    GpuAffinity,
    GpuDetails,
    ParsedTopology,
    build_inventory,
)
from node_daemon.inventory.errors import TopologyParseError

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
_COMMENT_PREFIXES = ("//", "#")
_CELL_CODE = re.compile(r"X|PIX|PXB|PHB|NODE|SYS|SOC|NV[1-9][0-9]*")
_HEADER_NAME = re.compile(r"GPU[0-9]+|NIC[0-9]+|mlx[45]_(?:bond_)?[0-9]+|CPU|NUMA|Affinity|GPU|ID")
_TAB_STOP = 8


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

    A comment prefix on every line is removed first, and lines before the header
    (provenance `#` lines, prompts) are skipped. The header is the first line whose first
    name (glued names split) is GPU0 and whose next is not X; the matrix is the rows under it
    up to a blank line or a `...:` line (Legend). What was recovered or lost (glued names or
    cells, a crop) is in `warnings` (see the module docstring). Raises TopologyParseError,
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
    """The affinity columns present, in header order (the last one possibly cut)."""
    cut: bool = False
    """The last name is cut short (`NUMA Aff`): the capture was cropped at its right edge."""

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
        self.lines = _strip_comment_prefix(_ESCAPE.sub("", text).split("\n"))
        self.warnings: list[str] = []

    def error(self, line: int | None, reason: str) -> TopologyParseError:
        return TopologyParseError(self.source, line, reason)

    def parse(self) -> ParsedTopology:
        header = self._header()
        gpu_rows, nic_rows, end = self._rows(header)
        cropped = not header.nics and bool(nic_rows)
        edge = self._right_edge(header, gpu_rows)
        matrix = self._matrix(header, gpu_rows, [] if cropped else nic_rows, edge)
        n = header.gpu_count
        links = {(i, j): matrix[i][j] for i in range(n) for j in range(i + 1, n)}
        legend = self._nic_legend(end)
        if cropped:
            nics = self._cropped_nics(header, nic_rows, legend)
        else:
            nics = self._nics(header, matrix, nic_rows, legend)
        gpus = tuple(self._affinity(header, row, cropped, edge) for row in gpu_rows)
        if edge is not None:
            self._warn_right_edge(header, gpu_rows, edge)
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
            tokens = [name for token in line.split() for name in _split_names(token)]
            if not tokens or tokens[0] != "GPU0":
                continue
            if len(tokens) > 1 and tokens[1] == _SELF:
                raise self._no_header(number)
            glued = [token for token in line.split() if len(_split_names(token)) > 1]
            if glued:
                self.warnings.append(
                    f"line {number}: header names ran together "
                    f"({', '.join(map(repr, glued))}); split on the known names"
                )
            return self._parse_header(number, tokens)
        raise self.error(
            None,
            f"no GPUs: no topology matrix in {len(self.lines)} lines; expected a header line "
            "starting with GPU0 (e.g. 'GPU0  GPU1  CPU Affinity  NUMA Affinity')",
        )

    def _no_header(self, row: int) -> TopologyParseError:
        """The error for matrix row GPU0 on line `row` with no header above it."""
        above = [n for n in range(row - 1, 0, -1) if self.lines[n - 1].strip()]
        first = self.lines[above[0] - 1].split()[0] if above else ""
        if first.startswith("GPU0") and first != "GPU0":
            return self.error(
                above[0],
                f"header {first[:40]!r} runs names together that are not all known ones "
                "(GPU<n>, NIC<n>, mlx4_<n>, mlx5_<n>, mlx5_bond_<n>, CPU Affinity, NUMA "
                "Affinity, GPU NUMA ID); expected names separated by spaces or tabs",
            )
        return self.error(
            row,
            "matrix row GPU0 comes before any header; expected the header line "
            "(GPU0 GPU1 ... CPU Affinity) above the rows",
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
            cut = _cut_name(tokens[position:], values)
            if cut is not None:
                values.append(cut)
                return _Header(number, gpu_count, tuple(nics), tuple(values), cut=True)
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
        glued: list[tuple[int, str]] = []
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
            cells = []
            for token in rest:
                codes = _split_codes(token)
                if len(codes) > 1:
                    glued.append((number, token))
                cells.extend(codes)
            row = _Row(number, label, tuple(cells))
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
        if glued:
            lines = sorted({number for number, _ in glued})
            where = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}"
            examples = ", ".join(repr(token) for token in sorted({t for _, t in glued})[:3])
            self.warnings.append(
                f"{where}: {len(glued)} cell(s) held link codes with no space between them "
                f"({examples}); split on the known codes"
            )
        return gpu_rows, nic_rows, end

    def _width(self, line: int) -> int:
        """Display width of a line (tabs to 8-column stops), trailing blanks left out."""
        return len(self.lines[line - 1].expandtabs(_TAB_STOP).rstrip())

    def _right_edge(self, header: _Header, gpu_rows: list[_Row]) -> int | None:
        """The crop column W when the capture shows a right-edge crop, else None.

        See the module docstring for the evidence; W is the widest of the header and GPU
        rows, so every line that was cut ends there.
        """
        edge = max(self._width(line) for line in [header.line, *(r.line for r in gpu_rows)])
        links = len(header.columns)
        evidence = header.cut or any(
            self._width(row.line) == edge
            and (
                links <= len(row.tokens) < links + len(header.values)
                or (len(row.tokens) > links and not _whole_value(row.tokens[-1]))
            )
            for row in gpu_rows
        )
        return edge if evidence else None

    def _warn_right_edge(self, header: _Header, gpu_rows: list[_Row], edge: int) -> None:
        links = len(header.columns)
        cut = [
            f"{row.label} {header.values[len(row.tokens) - links - 1]} {row.tokens[-1]!r}"
            for row in gpu_rows
            if self._width(row.line) == edge and len(row.tokens) > links
        ]
        missing = [
            f"{row.label} {', '.join(header.values[len(row.tokens) - links :])}"
            for row in gpu_rows
            if len(row.tokens) < links + len(header.values)
        ]
        lost = [f"dropped as possibly cut: {', '.join(cut)}"] if cut else []
        lost += [f"unknown: {', '.join(missing)}"] if missing else []
        self.warnings.append(
            f"line {header.line}: the capture looks cropped at column {edge} (its right edge); "
            + ("; ".join(lost) or "no GPU value reaches it")
        )

    def _matrix(
        self, header: _Header, gpu_rows: list[_Row], nic_rows: list[_Row], edge: int | None
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
            gpu_under_crop = edge is not None and own < header.gpu_count
            at_edge = gpu_under_crop and self._width(row.line) == edge
            if at_edge and value_count and len(row.tokens) == len(columns):
                raise self.error(
                    row.line,
                    f"row {row.label} ends at the cropped right edge (column {edge}) in "
                    f"its link cells; expected {_describe_cells(columns, header.values)}",
                )
            # Under a crop a row may lack its last values (unknown, see `_values`); a lost
            # link cell instead puts a value under a link column, which `_links` refuses.
            short_ok = (
                gpu_under_crop and len(columns) <= len(row.tokens) < len(columns) + value_count
            )
            if len(row.tokens) != len(columns) + value_count and not short_ok:
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

    def _values(self, header: _Header, row: _Row, edge: int | None = None) -> dict[str, str]:
        """A GPU row's affinity values by column name (its cell count is checked); with a
        crop `edge`, a row ending there has its last value left out (it may be cut)."""
        cells = row.tokens[len(header.columns) :]
        if edge is not None and self._width(row.line) == edge:
            cells = cells[:-1]
        return dict(zip(header.values, cells, strict=False))

    def _affinity(
        self, header: _Header, row: _Row, cropped: bool, edge: int | None
    ) -> GpuAffinity:
        values = self._values(header, row, edge)
        return GpuAffinity(
            cpu_affinity="" if cropped else self._id_list(row, values, CPU_AFFINITY),
            numa_affinity=self._id_list(row, values, NUMA_AFFINITY),
        )

    def _id_list(self, row: _Row, values: dict[str, str], column: str) -> str:
        """The value as printed; "" when absent or N/A, and (with a warning) when malformed."""
        value = values.get(column, _NOT_AVAILABLE)
        if value == _NOT_AVAILABLE:
            return ""
        if _whole_value(value):
            return value
        self.warnings.append(
            f"line {row.line}: {row.label} {column} {value!r} is not a list of ids "
            "(ranges ascending); "
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


_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
"""A terminal control sequence (ECMA-48 CSI: SGR underline and reset among them)."""


def _strip_comment_prefix(lines: list[str]) -> list[str]:
    """`lines` without the comment prefix that every non-blank line has, if one does."""
    content = [line.lstrip() for line in lines if line.strip()]
    for prefix in _COMMENT_PREFIXES:
        if content and all(line.startswith(prefix) for line in content):
            return [line.lstrip()[len(prefix) :] for line in lines]
    return lines


def _split_names(token: str) -> list[str]:
    """A header token made only of known header names, split into them; else [token]."""
    names = _HEADER_NAME.findall(token)
    return names if "".join(names) == token and names else [token]


def _split_codes(token: str) -> list[str]:
    """A cell made only of link codes (`SYSSYS`, `XNV12`), split into them; else [token]."""
    codes = _CELL_CODE.findall(token)
    return codes if "".join(codes) == token and codes else [token]


def _cut_name(rest: list[str], seen: list[str]) -> str | None:
    """The value column whose name `rest` (the header's last tokens) is a cut prefix of."""
    text = " ".join(rest)
    return next(
        (name for name in _VALUE_COLUMNS if name not in seen and name.startswith(text)),
        None,
    )


def _whole_value(value: str) -> bool:
    """N/A or an id list whose ranges run upwards: what no crop has cut short."""
    if value == _NOT_AVAILABLE:
        return True
    if not _ID_LIST.fullmatch(value):
        return False
    ranges = [part.split("-") for part in value.split(",")]
    return all(int(bounds[0]) <= int(bounds[-1]) for bounds in ranges)
