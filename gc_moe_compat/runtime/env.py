"""Reads of the library's environment variables at every call.

The facades read their settings (``GC_MOE_DEEP_EP_HOST_PATH``, ``GC_MOE_DEEP_EP_PARTITION``,
``GC_MOE_SPIN_TIMEOUT_MS``, ``GC_MOE_PARTITION``, ...) at every call, so that a change takes effect at the next call,
and such a variable is usually unset. ``os.environ.get`` of an unset name costs ~0.7 us (``Mapping.get`` catches the
``KeyError`` that ``os.environ[name]`` raises), three reads per eager ``deep_ep`` call. On POSIX CPython
``os.environ`` keeps the variables in a dict of bytes (its ``_data``, which every assignment to or deletion from
``os.environ`` updates, as ``monkeypatch.setenv`` makes them), where one lookup costs ~0.04 us: :func:`env_get` reads
there, and through ``os.environ.get`` where ``os.environ`` has no such dict or is no longer the mapping this
module read it from (a test harness that rebinds ``os.environ``).
"""

from __future__ import annotations

import os

__all__ = ["env_get"]

_environ = os.environ
_data = getattr(_environ, "_data", None)
_encode = getattr(_environ, "encodekey", None)
_decode = getattr(_environ, "decodevalue", None)
_FAST = isinstance(_data, dict) and callable(_encode) and callable(_decode)
_keys: dict[str, object] = {}


def env_get(name: str) -> str | None:
    """``os.environ.get(name)``: the variable's value as set now, or None where it is unset."""
    if not _FAST or os.environ is not _environ:
        return os.environ.get(name)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encode(name)
    value = _data.get(key)
    return None if value is None else _decode(value)
