"""What a file given to a trace command holds, told from its content (never its name).

The trace commands read three kinds of file: the mobility trace JSON (`traces`), SUMO
floating-car data (`fcd`: XML or CSV, either of them gzip-compressed or not) and the sites
YAML (`sites`). Each refuses the others by naming what it was given and what it wants;
`sniff` says what it was given. It reads at most the first `HEAD_BYTES` (decompressed);
blocking.
"""

from __future__ import annotations

import enum
import re
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass
from pathlib import Path

HEAD_BYTES = 64 * 1024
"""SUMO's files open with a comment of its whole configuration: a few KiB."""
GZIP_MAGIC = b"\x1f\x8b"
FCD_ROOT = "fcd-export"
FCD_COLUMNS = ("timestep_time", "vehicle_id", "vehicle_x", "vehicle_y")
"""The columns of SUMO's FCD CSV (`--fcd-output FILE.csv`, or `xml2csv.py` of the XML) that
an import needs."""
_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,99}")


class Form(enum.StrEnum):
    EMPTY = "empty"
    TRACE_JSON = "trace JSON"
    JSON = "JSON"
    FCD_XML = "SUMO FCD XML"
    XML = "XML"
    FCD_CSV = "SUMO FCD CSV"
    CSV = "CSV"
    TEXT = "text"
    BINARY = "binary"


@dataclass(frozen=True, slots=True)
class FileKind:
    form: Form
    compressed: bool = False
    """gzip-compressed (the form is that of its content)."""
    root: str = ""
    """XML: the root element's tag ("" when the head holds none)."""
    columns: tuple[str, ...] = ()
    """CSV: the header's columns."""
    delimiter: str = ""
    """CSV: `;` (SUMO's) or `,`."""

    @property
    def is_fcd(self) -> bool:
        return self.form in (Form.FCD_XML, Form.FCD_CSV)

    def describe(self) -> str:
        """A few words for an error: "a gzip-compressed SUMO FCD CSV file"."""
        if self.form is Form.BINARY:
            return "a gzip-compressed file" if self.compressed else "a binary file"
        what = f"{self.form} file"
        if self.form is Form.XML and self.root:
            what += f" (root <{self.root[:40]}>)"
        if self.compressed:
            return f"a gzip-compressed {what}"
        return f"{'an' if what[0] in 'eX' else 'a'} {what}"  # empty, XML


def sniff(path: Path) -> FileKind:
    """What `path` holds (see the module docstring). OSError when it cannot be read."""
    with path.open("rb") as file:
        head = file.read(HEAD_BYTES)
    compressed = head.startswith(GZIP_MAGIC)
    if compressed:
        try:
            head = _gunzip_head(head)
        except zlib.error:
            return FileKind(Form.BINARY, compressed)
    return _kind(head, compressed)


def _gunzip_head(data: bytes) -> bytes:
    """Up to HEAD_BYTES of what gzip `data` holds, across members (SUMO writes several); a
    stream cut short still shows what it holds (its reader says it is cut)."""
    out = b""
    while data and len(out) < HEAD_BYTES:
        member = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out += member.decompress(data, HEAD_BYTES - len(out))
        data = member.unused_data
    return out


def _kind(head: bytes, compressed: bool) -> FileKind:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 4:  # not a character cut at the end of the head
            return FileKind(Form.BINARY, compressed)
        text = head[: err.start].decode("utf-8")
    text = text.lstrip("\ufeff \t\r\n")
    if not text:
        return FileKind(Form.EMPTY, compressed)
    if text[0] in "{[":
        trace = '"edge-offload-mobility-trace"' in text
        return FileKind(Form.TRACE_JSON if trace else Form.JSON, compressed)
    if text[0] == "<":
        root = _xml_root(text)
        return FileKind(Form.FCD_XML if root == FCD_ROOT else Form.XML, compressed, root=root)
    header = text.splitlines()[0]
    delimiter = ";" if ";" in header else "," if "," in header else ""
    columns = tuple(c.strip() for c in header.split(delimiter)) if delimiter else ()
    if len(columns) < 2 or not all(_COLUMN.fullmatch(c) for c in columns):  # YAML, prose
        return FileKind(Form.TEXT, compressed)
    form = Form.FCD_CSV if set(FCD_COLUMNS) <= set(columns) else Form.CSV
    return FileKind(form, compressed, columns=columns, delimiter=delimiter)


def _xml_root(text: str) -> str:
    parser: ET.XMLPullParser = ET.XMLPullParser(events=("start",))
    try:
        parser.feed(text)
        for event in parser.read_events():
            element = event[-1]  # (event, element)
            if isinstance(element, ET.Element):
                return str(element.tag)
    except ET.ParseError:
        pass
    return ""
