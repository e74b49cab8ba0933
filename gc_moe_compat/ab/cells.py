"""One cell of the compatibility matrix: a combination and its result (shared by :mod:`.matrix` and
:mod:`.matrix_gpu`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RESULTS", "Cell"]

RESULTS = ("pass", "fail", "not supported", "not run")


@dataclass
class Cell:
    """One combination and its result."""

    kind: str
    entry: str
    case: str
    result: str
    detail: str = ""
    axes: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"result: must be one of {RESULTS}, got {self.result!r}")
