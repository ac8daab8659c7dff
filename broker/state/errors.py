"""Errors of the broker's state store; messages are meant for operators and callers.

Hierarchy::

    StateError            base class
    ├── ConstraintError   a write would break a rule of the schema: a duplicate id, a reference
    │                     to a row that does not exist, a malformed value; nothing was written
    ├── SchemaError       the state file cannot be used by this broker: its schema is newer
    │                     than this broker knows, a migration failed, or SQLite lacks a feature
    └── StorageError      SQLite itself failed (an I/O error, a full disk, a locked file)

An unknown id given to a method that changes a row raises the built-in `KeyError` instead,
so callers can tell "no such thing" (NOT_FOUND) from "that would break the rules".
"""


class StateError(Exception):
    """Base class of the state store's errors."""


class ConstraintError(StateError):
    pass


class SchemaError(StateError):
    pass


class StorageError(StateError):
    pass
