"""DeepEP's ``EventHandle`` / ``EventOverlap``: a CUDA event on the current stream and the overlap helper around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """A CUDA event recorded on torch's current stream when created (what DeepEP's ``_C.EventHandle()`` does)."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make torch's current stream wait for the event."""
        torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's overlap helper: ``current_stream_wait()``, an optional hook after the wait, and ``with`` use (the
    current stream waits for the event when the block exits).

    As in DeepEP, the event marks the end of a call's kernels, which run on the communication stream
    (``Buffer.get_comm_stream()``: the communication partition's green stream, or the caller's stream with the
    partition off); waiting on it orders the caller's stream after them.
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Callable[[], Any] | None = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event, then the registered hook (if any) runs once."""
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait: there is no event (the call was not async_finish)")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Register a hook that :meth:`current_stream_wait` runs after the wait (one at a time)."""
        if self.hook_after_wait is not None:
            raise ValueError("EventOverlap.register_hook_after_wait: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """Sets whether the coming ``with`` block releases the event when it exits."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
