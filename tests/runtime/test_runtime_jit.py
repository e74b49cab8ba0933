"""JIT cache keys, option whitelist, resource report, and nvcc compiling the runtime's kernels for sm_90a."""

import threading
from pathlib import Path

import pytest
from nvcc_mark import needs_nvcc

from gc_moe_compat.runtime import jit

IDENTITY = jit.CompilerIdentity("/opt/nvcc", "release 13.0", "a" * 64, "/opt/ptxas", "b" * 64)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.cuh").write_text('#pragma once\n#include "common/b.cuh"\nint a();\n')
    (tmp_path / "common" / "b.cuh").write_text("#pragma once\nint b();\n")
    (tmp_path / "k.cu").write_text('#include "common/a.cuh"\n#include <cstdint>\nextern "C" __global__ void k() {}\n')
    return tmp_path


def key(tree: Path, defines=None, options=(), identity=IDENTITY) -> str:
    return jit.cache_key(tree / "k.cu", defines or {}, options, identity, tree)


def test_cache_key_is_deterministic(tree):
    assert key(tree) == key(tree)
    assert key(tree, {"A": 1, "B": 2}) == key(tree, {"B": 2, "A": 1})


def test_cache_key_follows_nested_header_change(tree):
    before = key(tree)
    (tree / "common" / "b.cuh").write_text("#pragma once\nint b(int);\n")
    assert key(tree) != before


def test_cache_key_follows_defines_options_and_compiler(tree):
    base = key(tree)
    assert key(tree, {"GC_MOE_SPIN_SLEEP_NS": 128}) != base
    assert key(tree, options=["-lineinfo"]) != base
    other = jit.CompilerIdentity("/opt/nvcc", "release 13.1", "a" * 64, "/opt/ptxas", "b" * 64)
    assert key(tree, identity=other) != base


def test_included_sources_resolves_recursively(tree):
    found = jit.included_sources(tree / "k.cu", tree)
    assert [p.relative_to(tree.resolve()).as_posix() for p in found] == ["common/a.cuh", "common/b.cuh", "k.cu"]


def test_missing_include_is_an_error(tree):
    (tree / "k.cu").write_text('#include "common/nope.cuh"\n')
    with pytest.raises(jit.JitError, match="nope.cuh"):
        jit.included_sources(tree / "k.cu", tree)


@pytest.mark.parametrize("option", ["-rdc=true", "-G", "-arch=sm_80", "--ptxas-options=-v", "-lineinfo -G", "-O0"])
def test_option_whitelist_rejects(option):
    with pytest.raises(ValueError, match="not allowed"):
        jit.validate_options([option])


def test_option_whitelist_accepts():
    opts = ["-lineinfo", "--use_fast_math", "-maxrregcount=128", "-Xptxas=-O3"]
    assert jit.validate_options(opts) == tuple(opts)


@pytest.mark.parametrize("defines", [{"A B": 1}, {"A": "1; rm"}, {"1A": 2}])
def test_define_validation(defines):
    with pytest.raises(ValueError, match="define"):
        jit.define_flags(defines)


def test_define_flags_sorted_and_bools():
    assert jit.define_flags({"B": True, "A": 3}) == ("-DA=3", "-DB=1")


PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k2' for 'sm_90a'
ptxas info    : Function properties for k2
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers
"""


def test_parse_ptxas_report():
    report = jit.parse_ptxas_report(PTXAS)
    assert report["k2"] == jit.KernelResources(40, 1024, 8, 4, 12)
    assert report["k1"] == jit.KernelResources(4, 0, 0, 0, 0)


RUNTIME_TEST_KERNELS = {
    "rt_noop",
    "rt_record_smid",
    "rt_set_flag",
    "rt_spin_on_flag",
    "rt_open_then_spin",
    "rt_open_then_store",
    "rt_wait_then_copy",
    "rt_counter_a",
    "rt_counter_b",
    "rt_counter_c",
    "rt_peer_signal",
    "rt_peer_wait",
}


@needs_nvcc
def test_nvcc_compiles_runtime_kernels_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    cubin = jit.compile_cubin("testing/runtime_test.cu")
    assert not cubin.from_cache
    assert cubin.path.read_bytes()[:4] == b"\x7fELF"
    assert set(cubin.resources) == RUNTIME_TEST_KERNELS
    for name, res in cubin.resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_bytes == 0, name
        assert 0 < res.registers <= 64, name
    again = jit.compile_cubin("testing/runtime_test.cu")
    assert again.from_cache and again.key == cubin.key and again.resources == cubin.resources
    tuned = jit.compile_cubin("testing/runtime_test.cu", {"GC_MOE_SPIN_SLEEP_NS": 128})
    assert tuned.key != cubin.key


@needs_nvcc
def test_concurrent_compiles_share_one_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    results: list[jit.Cubin] = []
    threads = [
        threading.Thread(target=lambda: results.append(jit.compile_cubin("testing/runtime_test.cu")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len({r.key for r in results}) == 1
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert not list(tmp_path.glob(".*"))  # no temporary files or build folders left behind
