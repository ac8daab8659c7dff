"""Each owner of the broker's state writes it alone (broker/service.py's docstring lists them).

Two rules, checked on the source of every broker module (and `migration/`, which drives the
moves):
- no module touches another object's private attribute (`x._name`, x not `self`/`cls`):
  an owner's state (`NodeRegistry._nodes`, `StandbyPool._standbys`, the applier's holds ...)
  is private, so only its own methods change it. Within a sub-package (`broker.placement`,
  `broker.state`, ...) its modules share their private helpers; the standard library's
  `os._exit` and argparse's subparser type are the only outside ones used.
- the mutable records an owner hands out (`NodeEntry`, `Standby`, `ClientUpload`) have their
  fields assigned only in the owner's module: others read them.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from broker.nodes import NodeEntry
from broker.uploads import ClientUpload
from broker.values import Standby

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("broker", "migration")
OUTSIDE_PRIVATES = {"os._exit", "argparse._SubParsersAction"}
"""Private names of the standard library the broker uses (not another owner's state)."""

OWNED_RECORDS = {
    "broker.nodes": NodeEntry,
    "broker.standbys": Standby,
    "broker.uploads": ClientUpload,
}
"""Owner module -> the mutable record it hands out, whose fields only it assigns."""


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _package(module: str) -> str:
    """What shares private helpers with `module`: a sub-package's modules share theirs; a
    top-level broker module shares them with nobody."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def private_reaches(module: str, source: str, defined_in: dict[str, set[str]]) -> list[str]:
    """`x._name` in `source` (x not self/cls), as "line: expression": in a top-level broker
    module, every one; in a sub-package's, those whose `_name` no class of the sub-package
    defines (`defined_in`: private name -> the packages whose classes define it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        text = ast.unparse(node)
        if text in OUTSIDE_PRIVATES:
            continue
        if _package(module) != module and _package(module) in defined_in.get(name, set()):
            continue
        found.append(f"{node.lineno}: {text}")
    return found


def record_writes(module: str, source: str) -> list[str]:
    """Assignments in `source` to a field of an owned record (`OWNED_RECORDS`) on any
    object but `self`, outside the record's owner module, as "line: target"."""
    fields: dict[str, set[str]] = {}
    for owner, record in OWNED_RECORDS.items():
        for field in dataclasses.fields(record):
            fields.setdefault(field.name, set()).add(owner)
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            while isinstance(target, ast.Subscript):  # x.field[...] = ... changes x.field
                target = target.value
            if not isinstance(target, ast.Attribute):
                continue
            if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                continue
            owners = fields.get(target.attr)
            if owners is not None and module not in owners:
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def _sources() -> dict[str, str]:
    return {
        _module(path): path.read_text()
        for top in SCANNED
        for path in sorted((ROOT / top).rglob("*.py"))
    }


def _private_definitions(sources: dict[str, str]) -> dict[str, set[str]]:
    """Private name -> the packages where a class defines it (`self._x = ...`, or a
    method or class attribute `_x`)."""
    defined: dict[str, set[str]] = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            names: list[str] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "self" and isinstance(node.ctx, ast.Store):
                    names = [node.attr]
            elif isinstance(node, ast.ClassDef):
                names = [
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                ]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    defined.setdefault(name, set()).add(_package(module))
    return defined


def test_no_module_reaches_into_another_owners_private_state() -> None:
    sources = _sources()
    defined = _private_definitions(sources)
    found = {
        module: reaches
        for module, source in sources.items()
        if (reaches := private_reaches(module, source, defined))
    }
    assert found == {}


def test_owned_records_are_written_by_their_owner_alone() -> None:
    found = {
        module: writes
        for module, source in _sources().items()
        if (writes := record_writes(module, source))
    }
    assert found == {}


def test_the_checks_catch_a_module_that_writes_another_owners_state() -> None:
    """The rules fail on what they are for: a move that drops a standby behind the pool's
    back, and a reconciler that marks a node alive itself."""
    intruder = (
        "def move(broker, entry, standby):\n"
        "    del broker.standbys._standbys[standby.deployment_id]\n"
        "    entry.last_heartbeat = 0.0\n"
        "    standby.task = None\n"
        "    entry.replicas[0] = 'r'\n"
    )
    defined = _private_definitions(_sources())
    assert private_reaches("broker.moves", intruder, defined) == ["2: broker.standbys._standbys"]
    assert record_writes("broker.reconciler", intruder) == [
        "3: entry.last_heartbeat",
        "4: standby.task",
        "5: entry.replicas",
    ]
    assert record_writes("broker.nodes", "def f(entry):\n    entry.load = 1.0\n") == []
