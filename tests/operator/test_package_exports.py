"""``gc_moe_compat`` re-exports the native API, and importing the package alone stays cheap (the swap's ``.pth``
imports it at every interpreter start): the names resolve on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gc_moe_compat
from gc_moe_compat.operator import api


@pytest.mark.parametrize("name", gc_moe_compat.__all__)
def test_the_package_exports_the_native_api(name: str) -> None:
    assert getattr(gc_moe_compat, name) is getattr(api, name)
    assert name in dir(gc_moe_compat)


def test_from_import_works_and_unknown_names_raise() -> None:
    from gc_moe_compat import fp8_fp4_gc_moe, get_symm_buffer_for_gc_moe

    assert fp8_fp4_gc_moe is api.fp8_fp4_gc_moe and get_symm_buffer_for_gc_moe is api.get_symm_buffer_for_gc_moe
    with pytest.raises(AttributeError, match="no attribute 'fp8_gc_moe'"):
        _ = gc_moe_compat.fp8_gc_moe


def test_importing_the_package_imports_neither_torch_nor_the_operator() -> None:
    code = ("import sys, gc_moe_compat; "
            "print(sorted(m for m in ('torch', 'gc_moe_compat.operator.api') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.strip()
    assert out == "[]", out
