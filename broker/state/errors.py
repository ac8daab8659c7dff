"""Errors of the broker's state store; messages are meant for operators and callers.

Hierarchy::

    StateError            base class
    ├── ConstraintError   a write would break a rule of the schema: a duplicate id, a reference
    │                     to a row that does not exist, a malformed value; nothing was written
    ├── LeaseLost         a write fenced by a leader lease (`check_lease`) found the lease
    │                     expired or taken by a newer term; nothing was written
    ├── SchemaError       the state cannot be used by this broker: its schema is newer than
    │                     this broker knows, a migration failed, or the database (SQLite,
    │                     the PostgreSQL server) lacks a feature
    └── StorageError      the database itself failed (an I/O error, a full disk, a locked
                          file, a lost connection, a server that cannot be reached)

An unknown id given to a method that changes a row raises the built-in `KeyError` instead,
so callers can tell "no such thing" (NOT_FOUND) from "that would break the rules".
"""


class StateError(Exception):
    """Base class of the state store's errors."""


class ConstraintError(StateError):
    pass


class LeaseLost(StateError):
    pass


class SchemaError(StateError):
    pass


class StorageError(StateError):
    pass
