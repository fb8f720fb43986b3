"""This key's WebSocket connections, from inside the key (docs/realtime.md).

A client connects with `GET /v1/keys/{module}/{key}/connect` on any node;
the key hears of it through `Key.handle_connection` (an `Opened` event, then
each frame as `Text` or `Binary`, then `Closed`) and answers with
`send_text`, `send_binary` and `close`. A connection belongs to the key, not
to one process: it survives the key's eviction and a graceful move (the next
process gets it `Opened` again, with `resumed` true), and `list` names the
open ones::

    from fief_guest import Key, connections

    class Echo(Key):
        def handle_connection(self, event):
            if isinstance(event, connections.Text):
                connections.send_text(event.id, event.text)

Refusals raise `EffectError`. This module forwards to the
`fief:key/connections` imports; it decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Union

from componentize_py_types import Err
from wit_world.imports import connections as _wit

from fief_guest.host import Bytes, EffectError, _bytes

__all__ = [
    "Binary",
    "Closed",
    "Event",
    "Opened",
    "Text",
    "close",
    "list",
    "send_binary",
    "send_text",
]


@dataclass(frozen=True)
class Opened:
    """Connection `id` is attached to this key: a client connected
    (`resumed` false), or a connection opened earlier is handed to this
    process (after an eviction, a graceful move or an owner's failure)."""

    id: int
    resumed: bool


@dataclass(frozen=True)
class Text:
    """A text frame from connection `id`'s client."""

    id: int
    text: str


@dataclass(frozen=True)
class Binary:
    """A binary frame from connection `id`'s client."""

    id: int
    data: bytes


@dataclass(frozen=True)
class Closed:
    """Connection `id` closed (by its client, by this key, or at a limit)
    with `code` and `reason`."""

    id: int
    code: int
    reason: str


#: What `Key.handle_connection` receives.
Event = Union[Opened, Text, Binary, Closed]


def send_text(conn_id: int, text: str) -> None:
    """Send a text frame to connection `conn_id`. Raises `EffectError`:
    `invalid` for a connection this key does not have, `limit` past the
    module's `max_message_size`, `overloaded` if its queue is full."""
    try:
        _wit.send_text(conn_id, text)
    except Err as e:
        raise EffectError(e.value) from None


def send_binary(conn_id: int, data: Bytes) -> None:
    """Send a binary frame (bytes, or a str sent as UTF-8) to connection
    `conn_id`; refusals as for `send_text`."""
    try:
        _wit.send_binary(conn_id, _bytes(data))
    except Err as e:
        raise EffectError(e.value) from None


def close(conn_id: int, code: int = 1000, reason: str = "") -> None:
    """Close connection `conn_id` with `code` (1000, or 3000 to 4999; any
    other is sent as 1000) and `reason` (cut to 123 bytes). No effect on a
    connection this key does not have."""
    _wit.close(conn_id, code, reason)


def list() -> List[int]:  # noqa: A001 (the module's name for it, as in Rust)
    """The ids of this key's open connections, in the order they opened."""
    return [*_wit.list_connections()]
