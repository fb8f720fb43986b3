"""The coherent single-owner cache, from inside a key (docs/cache.md).

Entries are partitioned like keys: an entry named after this key lives on
this node, others on their owners. An entry is dropped whenever its partition
changes owner, so treat every read as "maybe empty". Versions make
read-modify-write safe::

    from fief_guest import cache

    while True:
        entry = cache.get("visits", "total")
        count = int(entry.value) + 1 if entry else 1
        try:
            cache.put("visits", "total", str(count),
                      expected_version=entry.version if entry else 0)
            break
        except cache.CacheError as error:
            if error.kind != "conflict":
                raise  # someone else won a conflict: read again
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from componentize_py_types import Err
from wit_world.imports import host as _wit

from fief_guest.host import Bytes, _bytes, _HostError


@dataclass(frozen=True)
class Entry:
    """A cache entry: its value, and the version a compare-and-set names."""

    value: bytes
    version: int


class CacheError(_HostError):
    """A cache operation failed. `kind` is `invalid`, `conflict` (a
    compare-and-set did not match; nothing was written) or `unavailable`
    (retry later). For a conflict, `current_version` is the entry's version
    (`None`: there is no entry)."""

    def __init__(self, variant: object) -> None:
        super().__init__(variant)
        self.current_version: Optional[int] = getattr(variant, "value", None) if self.kind == "conflict" else None


def get(namespace: str, key: str) -> Optional[Entry]:
    """The entry, or `None` if there is none."""
    try:
        entry = _wit.cache_get(namespace, key)
    except Err as e:
        raise CacheError(e.value) from None
    return None if entry is None else Entry(entry.value, entry.version)


def put(
    namespace: str,
    key: str,
    value: Bytes,
    ttl_ms: Optional[int] = None,
    expected_version: Optional[int] = None,
) -> int:
    """Write an entry and return its new version. `ttl_ms` drops it after
    that long; `expected_version` makes it a compare-and-set (0: only if
    there is no entry)."""
    try:
        return _wit.cache_put(namespace, key, _bytes(value), ttl_ms, expected_version)
    except Err as e:
        raise CacheError(e.value) from None


def delete(namespace: str, key: str, expected_version: Optional[int] = None) -> bool:
    """Delete an entry (if `expected_version` matches, as for `put`);
    returns whether there was one."""
    try:
        return _wit.cache_delete(namespace, key, expected_version)
    except Err as e:
        raise CacheError(e.value) from None
