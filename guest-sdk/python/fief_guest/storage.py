"""This key's durable state, from inside the key (docs/storage.md).

Each key process sees only its own key's state: a sorted map of names to
bytes, kept by the node's storage backend. The writes of one callback are
committed together when the callback returns; its reply (and the casts,
publications and timers it issued after its first write) leave only after
the commit succeeded. A process whose ownership has ended cannot commit::

    from fief_guest import storage

    count = int(storage.get("count") or b"0") + 1
    storage.put("count", str(count))

Reads after the first are served from the process's memory. Refusals raise
`StorageError` (`kind` is `invalid`, `limit` or `unavailable`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from componentize_py_types import Err
from wit_world.imports import storage as _wit

from fief_guest.host import Bytes, _bytes, _HostError


class StorageError(_HostError):
    """A storage operation was refused; nothing changed. `kind` is `invalid`
    (a bad name, value or range), `limit` (bytes per key or tenant, writes
    per callback) or `unavailable` (the state could not be loaded, or this
    process may no longer write it); `detail` says which."""


def _call(f, *args):
    try:
        return f(*args)
    except Err as e:
        raise StorageError(e.value) from None


def get(name: str) -> Optional[bytes]:
    """The value stored under `name`, or `None`."""
    return _call(_wit.get, name)


def put(name: str, value: Bytes) -> None:
    """Store `value` (bytes, or a str sent as UTF-8) under `name`."""
    _call(_wit.put, name, _bytes(value))


def delete(name: str) -> bool:
    """Remove `name`; returns whether it was there."""
    return _call(_wit.delete, name)


def list_range(start: str = "", end: Optional[str] = None, limit: int = 1000) -> List[Tuple[str, bytes]]:
    """Up to `limit` `(name, value)` pairs with `start <= name < end`
    (`end` None: to the last), sorted by name."""
    return list(_call(_wit.list, start, end, limit))


def delete_range(start: str, end: Optional[str] = None) -> int:
    """Remove every entry with `start <= name < end`; returns how many."""
    return _call(_wit.delete_range, start, end)
