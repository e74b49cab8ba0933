"""The fuzz suite runs every test under the caller's default dtype float32 and bfloat16 (``dtype`` parameter): the
library names the dtype of everything it allocates, so the verdicts must not change."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def default_dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(before)
