"""gc-moe-ab's probe of the original deep_ep's low-latency mode (gc_moe_compat.ab.deep_ep_probe): a child killed at
its timeout, its exit code and output turned into a verdict, the verdict cached per process, the ranks' agreement,
the composed operator's meta line and ``--check``'s line. Fake children only: no GPU, no DeepEP."""

from __future__ import annotations

import sys
import time
import types

import pytest

from gc_moe_compat.ab import cli, deep_ep_probe, operators

WHERE = "<outside the checkout>/deep_ep/__init__.py"


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    deep_ep_probe.clear_cache()
    yield
    deep_ep_probe.clear_cache()


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_sleeps_past_the_timeout_is_killed_and_reported_as_not_started() -> None:
    start = time.monotonic()
    result = deep_ep_probe.run_child(_python("import sys, time; print('nvshmem init...', file=sys.stderr, "
                                             "flush=True); time.sleep(60)"), 1.0)
    assert time.monotonic() - start < 20
    assert result.returncode is None and result.tail == "nvshmem init..."
    verdict = deep_ep_probe.verdict_of(result, WHERE, 1.0)
    assert not verdict.ok
    assert verdict.reason == f"the original deep_ep at {WHERE} did not start its low-latency mode within 1 s: " \
                             "nvshmem init..."


def test_a_child_that_exits_1_is_reported_with_its_last_stderr_lines() -> None:
    code = "import sys\nfor i in range(8): print(f'line {i}', file=sys.stderr)\nsys.exit(1)"
    result = deep_ep_probe.run_child(_python(code), 30.0)
    assert result.returncode == 1
    verdict = deep_ep_probe.verdict_of(result, WHERE, 30.0)
    assert not verdict.ok
    assert verdict.reason == (f"the original deep_ep at {WHERE} failed its low-latency probe (exit code 1): "
                              "line 3 | line 4 | line 5 | line 6 | line 7")


def test_a_child_that_exits_0_is_a_start() -> None:
    result = deep_ep_probe.run_child(_python("print('started')"), 30.0)
    assert result.returncode == 0
    verdict = deep_ep_probe.verdict_of(result, WHERE, 30.0)
    assert verdict.ok and verdict.reason == ""


def test_a_long_tail_is_cut_from_the_front() -> None:
    result = deep_ep_probe.ChildResult(1, deep_ep_probe._tail("x" * 5000), 0.1)
    assert len(result.tail) == deep_ep_probe.TAIL_CHARS + 3 and result.tail.startswith("...")
    assert deep_ep_probe.verdict_of(deep_ep_probe.ChildResult(2, "", 0.1), WHERE, 5).reason.endswith(
        "(exit code 2): no output")


def test_the_verdict_is_cached_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(command: list[str], timeout: float, env: dict[str, str]) -> deep_ep_probe.ChildResult:
        calls.append((command, timeout))
        return deep_ep_probe.ChildResult(1, "boom", 0.2)

    monkeypatch.setattr(deep_ep_probe, "run_child", fake)
    monkeypatch.setenv(deep_ep_probe.SETTING, "7")
    first = deep_ep_probe.probe(WHERE, 0)
    assert deep_ep_probe.probe(WHERE, 0) is first and len(calls) == 1
    assert calls[0] == ([sys.executable, "-m", "gc_moe_compat.ab.deep_ep_probe", "--device", "0"], 7.0)
    deep_ep_probe.probe(WHERE, 1)
    assert len(calls) == 2


def test_the_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert deep_ep_probe.probe_timeout({}) == deep_ep_probe.DEFAULT_TIMEOUT_S == 60.0
    assert deep_ep_probe.probe_timeout({deep_ep_probe.SETTING: " 2.5 "}) == 2.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match=deep_ep_probe.SETTING):
            deep_ep_probe.probe_timeout({deep_ep_probe.SETTING: bad})


def test_the_child_is_no_rank_of_the_parent_group_and_finds_the_parents_build() -> None:
    env = deep_ep_probe.child_env("/builds/deep_ep_v121", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500",
                                                           "LOCAL_RANK": "1", "PYTHONPATH": "/a", "NVSHMEM_X": "1"})
    assert env == {"PYTHONPATH": f"/builds/deep_ep_v121{':' if sys.platform != 'win32' else ';'}/a",
                   "NVSHMEM_X": "1"}
    assert deep_ep_probe.child_env(None, {"PATH": "/bin"}) == {"PATH": "/bin"}


def test_the_group_agrees_on_the_first_failure() -> None:
    ok, bad = deep_ep_probe.Verdict(True, "", 3.0), deep_ep_probe.Verdict(False, "it hung", 60.0)
    assert deep_ep_probe.agree([ok, ok]) == deep_ep_probe.Verdict(True, "", 3.0)
    assert deep_ep_probe.agree([ok, bad, deep_ep_probe.Verdict(False, "later", 1.0)]) == \
        deep_ep_probe.Verdict(False, "rank 1: it hung", 60.0)
    assert deep_ep_probe.agree([bad]) == bad
    assert not deep_ep_probe.agree([]).ok


def _original(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    from gc_moe_compat import originals

    real = types.ModuleType("deep_ep")
    real.__file__ = "/site/deep_ep/__init__.py"
    monkeypatch.setattr(originals, "load", lambda name: real)
    return real


def _gather_as(monkeypatch: pytest.MonkeyPatch, others: list[object]) -> None:
    """``all_gather_object`` of a two-rank group where this process is rank 0 and rank 1 says ``others[0]``."""
    def fake(out: list[object], obj: object, group: object = None) -> None:
        out[:] = [obj, *others]

    monkeypatch.setattr(operators.dist, "all_gather_object", fake)


def test_ranks_use_the_facade_when_another_ranks_probe_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import deep_ep

    _original(monkeypatch)
    monkeypatch.setattr(deep_ep_probe, "probe", lambda where, device, **kw: deep_ep_probe.Verdict(True, "", 1.0))
    _gather_as(monkeypatch, [deep_ep_probe.Verdict(False, "the original deep_ep at X did not start", 60.0)])
    ep, source = operators._deep_ep(None, 2, 0)
    assert ep is deep_ep
    assert source == "gc_moe_compat.deep_ep facade (rank 1: the original deep_ep at X did not start)"


def test_ranks_use_the_original_only_where_every_rank_started_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _original(monkeypatch)
    monkeypatch.setattr(deep_ep_probe, "probe", lambda where, device, **kw: deep_ep_probe.Verdict(True, "", 1.0))
    _gather_as(monkeypatch, [deep_ep_probe.Verdict(True, "", 4.0)])
    assert operators._deep_ep(None, 2, 0) == (real, f"original deep_ep at {WHERE} (its low-latency mode started in "
                                                    "a probe child, 4.0 s)")


def test_a_rank_that_cannot_import_the_original_still_takes_part(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import deep_ep, originals

    def missing(name: str) -> None:
        raise ImportError("no original deep_ep package is installed on sys.path")

    monkeypatch.setattr(originals, "load", missing)
    _gather_as(monkeypatch, [deep_ep_probe.Verdict(True, "", 1.0)])
    ep, source = operators._deep_ep(None, 2, 0)
    assert ep is deep_ep and source == ("gc_moe_compat.deep_ep facade (rank 0: the original deep_ep is not "
                                        "importable: no original deep_ep package is installed on sys.path)")


def test_a_bad_setting_puts_the_rank_on_the_facade_and_it_still_takes_part(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import deep_ep

    _original(monkeypatch)
    monkeypatch.setenv(deep_ep_probe.SETTING, "soon")
    monkeypatch.setattr(deep_ep_probe, "run_child", lambda *a, **k: pytest.fail("no child with a bad setting"))
    _gather_as(monkeypatch, [deep_ep_probe.Verdict(True, "", 1.0)])
    ep, source = operators._deep_ep(None, 2, 0)
    assert ep is deep_ep
    assert source.startswith(f"gc_moe_compat.deep_ep facade (rank 0: the probe of the original deep_ep at {WHERE} "
                             "did not run: ValueError: GC_MOE_AB_DEEP_EP_PROBE_S='soon'")


def test_check_says_the_original_imports_and_is_probed_at_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _original(monkeypatch)
    monkeypatch.setattr(deep_ep_probe, "run_child", lambda *a, **k: pytest.fail("--check must not run the probe"))
    monkeypatch.setenv(deep_ep_probe.SETTING, "45")
    line = cli.deep_ep_line()
    assert f"the original at {WHERE} imports" in line
    assert "probed at the run in a child process killed after 45 s (GC_MOE_AB_DEEP_EP_PROBE_S)" in line


def test_check_says_the_facade_runs_without_an_original(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import originals

    def missing(name: str) -> None:
        raise ImportError("no original deep_ep package is installed on sys.path")

    monkeypatch.setattr(originals, "load", missing)
    assert cli.deep_ep_line() == ("deep_ep (composed_deepep_deepgemm): the gc_moe_compat.deep_ep facade (the "
                                  "original deep_ep is not importable: no original deep_ep package is installed "
                                  "on sys.path)")


def test_the_real_child_without_an_original_exits_1_and_says_why(tmp_path: object) -> None:
    """The entry point itself, in a directory without DeepEP: it fails fast (no hang) and names the missing
    package (or, on a machine where an original is installed, runs: only the failure form is asserted here)."""
    from gc_moe_compat import originals

    if originals.location("deep_ep") is not None:
        pytest.skip("an original deep_ep is installed here: the child would try it")
    result = deep_ep_probe.run_child(deep_ep_probe.child_command(0), 300.0, deep_ep_probe.child_env(None))
    assert result.returncode == 1, result
    assert "deep_ep" in result.tail
