"""What the node offers a key process: the `fief:key/host` imports, wrapped.

Byte arguments also take `str` (sent as UTF-8). Refusals raise `CallError`
or `EffectError` instead of returning WIT `result`s. Every import with an
effect checks the key's fence first: after a kill, or once the node has
fenced, the key process traps instead (contract §1).
"""

from __future__ import annotations

from typing import Optional, Union

from componentize_py_types import Err
from wit_world.imports import host as _wit
from wit_world.imports import types as _types

Bytes = Union[bytes, bytearray, str]

#: Default timeout of `call`, in milliseconds.
CALL_TIMEOUT_MS = 5000


def _bytes(value: Bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _kind(variant: object) -> str:
    # `CallError_UnknownModule` -> `unknown-module`
    name = type(variant).__name__.split("_", 1)[1]
    return "".join("-" + c.lower() if c.isupper() else c for c in name).lstrip("-")


class _HostError(Exception):
    def __init__(self, variant: object) -> None:
        self.kind: str = _kind(variant)
        self.detail: Optional[str] = getattr(variant, "value", None)
        super().__init__(self.kind if self.detail is None else f"{self.kind}: {self.detail}")


class CallError(_HostError):
    """A `call` failed. `kind` is the WIT case (`unknown-module`, `invalid`,
    `fenced`, `unavailable`, `overloaded`, `deadlock`, `rejected`,
    `crashed`); `detail` its text, if it has one."""


class EffectError(_HostError):
    """A timer, publish, subscribe or cast was refused. `kind` is `limit`,
    `invalid`, `unknown-module` or `overloaded`; `detail` its text, if any."""


def self_key() -> str:
    """The key this process serves."""
    return _wit.self_key()


def self_module() -> str:
    """The module this process runs."""
    return _wit.self_module()


def ownership_token() -> int:
    """The ownership token of this key's partition on this node (strictly
    increases with every new owner): attach it to external writes."""
    return _wit.ownership_token()


def send_after(delay_ms: int, tag: Bytes = b"") -> int:
    """Arm a one-shot timer; `handle_timer(id, tag)` runs after `delay_ms`.
    Returns the timer's id."""
    try:
        return _wit.send_after(delay_ms, _bytes(tag))
    except Err as e:
        raise EffectError(e.value) from None


def cancel_timer(timer_id: int) -> bool:
    """Cancel a timer; true if it had not fired yet."""
    return _wit.cancel_timer(timer_id)


def subscribe(topic: str) -> None:
    """Subscribe to `topic`; publications arrive at `handle_publication`."""
    try:
        _wit.subscribe(topic)
    except Err as e:
        raise EffectError(e.value) from None


def unsubscribe(topic: str) -> None:
    """Unsubscribe from `topic` (a no-op if not subscribed)."""
    _wit.unsubscribe(topic)


def publish(topic: str, payload: Bytes) -> int:
    """Publish to every subscriber of `topic`; returns how many got it."""
    try:
        return _wit.publish(topic, _bytes(payload))
    except Err as e:
        raise EffectError(e.value) from None


def call(module: str, key: str, message: Bytes, timeout_ms: int = CALL_TIMEOUT_MS) -> bytes:
    """Call another key and wait (at most `timeout_ms`) for its reply."""
    try:
        return _wit.call(module, key, _bytes(message), timeout_ms)
    except Err as e:
        raise CallError(e.value) from None


def cast(module: str, key: str, message: Bytes) -> None:
    """Send another key a message without waiting for it to be processed."""
    try:
        _wit.cast(module, key, _bytes(message))
    except Err as e:
        raise EffectError(e.value) from None


def log(level: str, message: str) -> None:
    """Write a line to the node's log (`trace`, `debug`, `info`, `warn`,
    `error`), tagged with this key's module and name."""
    _wit.log(_types.LogLevel[level.upper()], message)


def trace(message: str) -> None:
    """`log("trace", message)`."""
    _wit.log(_types.LogLevel.TRACE, message)


def debug(message: str) -> None:
    """`log("debug", message)`."""
    _wit.log(_types.LogLevel.DEBUG, message)


def info(message: str) -> None:
    """`log("info", message)`."""
    _wit.log(_types.LogLevel.INFO, message)


def warn(message: str) -> None:
    """`log("warn", message)`."""
    _wit.log(_types.LogLevel.WARN, message)


def error(message: str) -> None:
    """`log("error", message)`."""
    _wit.log(_types.LogLevel.ERROR, message)
