"""SUMO floating-car data (FCD): every vehicle's position at each timestep, streamed.

Two forms, either of them gzip-compressed or not (told by content, never by the name):

- XML, as `sumo --fcd-output FILE.xml` writes it: `<fcd-export>` of `<timestep time=T>`
  elements, each holding `<vehicle id=ID x=X y=Y .../>` (persons and containers are skipped);
- CSV, as `sumo --fcd-output FILE.csv` (or SUMO's `tools/xml/xml2csv.py` of the XML) writes
  it: a header naming at least `timestep_time`, `vehicle_id`, `vehicle_x` and `vehicle_y`,
  separated by `;` (SUMO's) or `,`; a row with no `vehicle_id` (a person, an empty timestep)
  is skipped.

Timesteps come in time order (SUMO writes them so). `x` and `y` are metres in the network's
coordinates: the sites' must be in the same ones. Any other file, a value that is not a
finite number, a time that goes back, is refused with `FcdError` (a ValueError) naming the
file and where, quoting at most a short prefix of the bad value. Blocking.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from edge_client.mobility import formats

Timestep = tuple[float, list[str], np.ndarray, np.ndarray]
"""(t in seconds, vehicle ids, their x, their y in metres)."""

WANTED = (
    "SUMO FCD, gzip-compressed or not: XML (<fcd-export>, `sumo --fcd-output FILE.xml`) or "
    f"CSV with the columns {', '.join(formats.FCD_COLUMNS)} (`sumo --fcd-output FILE.csv`)"
)


class FcdError(ValueError):
    """Not an FCD file, or a bad value in one; the message names the file and where."""


def timesteps(path: Path) -> Iterator[Timestep]:
    """Each timestep with a vehicle in it, in time order (see the module docstring).
    FcdError for a file of another format or a bad value, OSError when it cannot be read."""
    kind = formats.sniff(path)
    if kind.form is formats.Form.CSV:
        missing = [c for c in formats.FCD_COLUMNS if c not in kind.columns]
        header = kind.delimiter.join(kind.columns)
        raise FcdError(
            f"{path}: {kind.describe()} without the column(s) {', '.join(missing)} (its header "
            f"is {header[:60]!r}); `offload trace import` reads {WANTED}"
        )
    if not kind.is_fcd:
        hint = ""
        if kind.form is formats.Form.TRACE_JSON:
            hint = " (a mobility trace already: `offload simulate --trace` reads it)"
        raise FcdError(f"{path}: {kind.describe()}{hint}; `offload trace import` reads {WANTED}")
    with gzip.open(path, "rb") if kind.compressed else path.open("rb") as raw:
        try:
            if kind.form is formats.Form.FCD_XML:
                yield from _ordered(path, _xml(path, raw))
            else:
                with io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
                    yield from _ordered(path, _csv(path, text, kind.delimiter))
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise FcdError(f"{path}: the gzip stream is damaged or cut short: {err}") from err
        except UnicodeDecodeError as err:
            raise FcdError(f"{path}: not UTF-8 text past the header: {err}") from err


def _ordered(path: Path, steps: Iterator[Timestep]) -> Iterator[Timestep]:
    last = -math.inf
    for step in steps:
        t = step[0]
        if t < 0:
            raise FcdError(f"{path}: time {t:g} is negative: a trace starts at 0")
        if t <= last:
            raise FcdError(
                f"{path}: time {t:g} comes after {last:g}: timesteps must be in time order "
                "(as SUMO writes them)"
            )
        last = t
        if step[1]:
            yield step


def _xml(path: Path, raw: gzip.GzipFile | io.BufferedReader) -> Iterator[Timestep]:
    t = 0.0
    ids: list[str] = []
    xs: list[float] = []
    ys: list[float] = []
    root = None
    try:
        for event, element in ET.iterparse(raw, events=("start", "end")):
            if root is None:
                root = element
            if event == "start":
                if element.tag == "timestep":
                    t = _number(path, element.get("time"), "a timestep's time")
                    ids, xs, ys = [], [], []
                continue
            if element.tag == "vehicle":
                vehicle_id = element.get("id") or ""
                if not vehicle_id:
                    raise FcdError(f"{path}: at time {t:g}: a <vehicle> without an id")
                where = f"vehicle {vehicle_id[:40]!r} at time {t:g}"
                xs.append(_number(path, element.get("x"), f"{where}: x"))
                ys.append(_number(path, element.get("y"), f"{where}: y"))
                ids.append(vehicle_id)
            elif element.tag == "timestep":
                yield t, ids, np.array(xs), np.array(ys)
                root.clear()  # the file of a large trace does not fit in memory as elements
    except ET.ParseError as err:
        raise FcdError(f"{path}: not well-formed XML: {err}") from err


def _csv(path: Path, text: IO[str], delimiter: str) -> Iterator[Timestep]:
    rows = csv.reader(text, delimiter=delimiter)
    header = [c.strip() for c in next(rows)]
    t_col, id_col, x_col, y_col = (header.index(c) for c in formats.FCD_COLUMNS)
    width = max(t_col, id_col, x_col, y_col) + 1
    t: float | None = None
    ids: list[str] = []
    xs: list[float] = []
    ys: list[float] = []
    for number, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) < width:
            raise FcdError(f"{path}: line {number}: {len(row)} fields, fewer than the header's")
        row_t = _number(path, row[t_col], f"line {number}: timestep_time")
        if t is not None and row_t != t:
            yield t, ids, np.array(xs), np.array(ys)
            ids, xs, ys = [], [], []
        t = row_t
        vehicle_id = row[id_col].strip()
        if not vehicle_id:
            continue
        xs.append(_number(path, row[x_col], f"line {number}: vehicle_x"))
        ys.append(_number(path, row[y_col], f"line {number}: vehicle_y"))
        ids.append(vehicle_id)
    if t is not None:
        yield t, ids, np.array(xs), np.array(ys)


def _number(path: Path, value: str | None, what: str) -> float:
    try:
        number = float(value) if value is not None else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise FcdError(f"{path}: {what}: {str(value)[:20]!r} is not a finite number")
    return number
