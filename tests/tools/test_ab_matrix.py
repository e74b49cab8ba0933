"""The compatibility matrix's CPU cells (signatures, argument validation, pre-dispatch staging, swap on/off) as CI
runs them, the files it writes, and the cells that need a GPU or a checkout reported as not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gc_moe_compat.ab import matrix, matrix_gpu


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("matrix")
    assert matrix.main(["--cpu-only", "--out-dir", str(out)]) == 0  # exit 0: no failing cell
    data = json.loads((out / "compat_matrix.json").read_text())
    data["md"] = (out / "compat_matrix.md").read_text()
    return data


def test_every_cpu_cell_passes_or_names_why_it_is_not_supported(written: dict[str, object]) -> None:
    cells = written["cells"]
    kinds = {c["kind"] for c in cells}
    assert kinds == {"signature", "validation", "pre-dispatch", "swap"}
    assert not [c for c in cells if c["result"] == "fail"]
    unsupported = [c for c in cells if c["result"] == "not supported"]
    assert unsupported and all(len(c["detail"]) > 20 for c in unsupported)
    # the facade's own NotImplementedError texts are the reasons
    assert any("GC-MoE has no NVFP4 path" in c["detail"] for c in unsupported)
    cases = {(c["entry"], c["case"]): c for c in cells}
    dev = cases[("deep_gemm.mega_moe_pre_dispatch", "sgl-deep-gemm dev branch (sgl-project/DeepGEMM)")]
    assert dev["result"] in ("pass", "not supported") and "use_fp4_acts" in dev["detail"]
    staged = [c for c in cells if c["kind"] == "pre-dispatch"]
    assert {c["axes"]["tokens"] for c in staged} == {0, 1, 7, 64} and all(c["result"] == "pass" for c in staged)
    swaps = {(c["entry"], c["case"]): c["result"] for c in cells if c["kind"] == "swap"}
    assert swaps[("import deep_gemm", "GC_MOE_SWAP=1")] == "pass" and len(swaps) == 12


def test_the_files_record_versions_and_checked_signatures(written: dict[str, object]) -> None:
    meta = written["meta"]
    assert meta["command"].startswith("gc-moe-matrix --cpu-only") and "torch" in meta["versions"]
    checked = written["checked_versions"]
    assert checked["deep_gemm.fp8_mega_moe"]["versions"] == ["deepinfer-gemm==2.8.2", "sgl-deep-gemm==0.2.3.post2"]
    assert checked["deep_ep.Buffer.low_latency_dispatch"]["versions"] == ["sgl-deep-ep==0.1.2.post1"]
    assert any("use_fp4_acts" in d for d in checked["deep_gemm.mega_moe_pre_dispatch"]["divergences"])
    md = written["md"]
    assert md.startswith("# GC-MoE compatibility matrix") and "## validation" in md and "| torch |" in md


def test_a_planted_signature_divergence_fails_its_cell(tmp_path: Path) -> None:
    for module, name in matrix.SIGNATURE_FILES.items():
        data = json.loads((matrix.DATA_DIR / name).read_text())
        if module == "deep_gemm":
            entry = data["names"]["fp8_mega_moe"]["sgl-deep-gemm==0.2.3.post2"]
            entry["params"][4]["default"] = "'nonsense'"  # cumulative_local_expert_recv_stats default changed
        (tmp_path / name).write_text(json.dumps(data))
    cells = [c for c in matrix.signature_cells(tmp_path) if c.entry == "deep_gemm.fp8_mega_moe"]
    bad = [c for c in cells if c.result == "fail"]
    assert len(bad) == 1 and "cumulative_local_expert_recv_stats='nonsense'" in bad[0].detail


@pytest.mark.parametrize("shared_gpu", [False, True])
def test_gpu_and_suite_cells_say_why_they_did_not_run(shared_gpu: bool) -> None:
    cells = matrix_gpu.layer_cells(shared_gpu=shared_gpu)  # no GPU here
    assert cells and all(c.result == "not run" for c in cells)
    one = [c for c in cells if c.axes["world_size"] == 1]
    two = [c for c in cells if c.axes["world_size"] == 2]
    assert len(one) == len(two) == len(cells) // 2  # one cell per entry point and world size
    assert all(c.detail == "needs a CUDA GPU" for c in one)
    assert all(c.case.endswith("T=all, world 2") for c in two)
    assert all("needs 2 GPUs on one host" in c.detail and "--shared-gpu" in c.detail and "no CUDA GPU here" in c.detail
               for c in two)
    entries = {c.entry for c in cells}
    assert "deep_gemm.mega_moe_pre_dispatch_sm90 + fp8_mega_moe" in entries and "gc_moe.fp8_fp4_gc_moe" in entries
    suites = matrix_gpu.suite_cells(None, None, None, 10)
    assert [c.result for c in suites] == ["not run"] * 3 and "--deepep-src" in suites[0].detail


def test_a_cell_result_is_one_of_four() -> None:
    with pytest.raises(ValueError, match="result: must be one of"):
        matrix.Cell("layer", "x", "y", "ok")


def test_a_checkouts_signatures_are_compared_without_importing_it(tmp_path: Path) -> None:
    """A source tree (never imported: read with scripts/gen_signatures.py's readers) with the dev branch's
    ``use_fp4_acts`` spelling: that entry point is ``not supported`` with the difference, the rest bind."""
    import inspect

    from gc_moe_compat import deep_gemm

    facade_sig = str(inspect.signature(deep_gemm.get_num_sms))
    (tmp_path / "deep_gemm" / "mega").mkdir(parents=True)
    (tmp_path / "deep_gemm" / "__init__.py").write_text("from .mega import get_num_sms, mega_moe_pre_dispatch\n")
    (tmp_path / "deep_gemm" / "mega" / "__init__.py").write_text(
        "def mega_moe_pre_dispatch(x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights,\n"
        "                          num_tokens, group_size=32, use_fp4_acts=False):\n    pass\n"
        f"def get_num_sms{facade_sig}:\n    pass\n")
    cells = {c.entry: c for c in matrix.checkout_signature_cells("deep_gemm", tmp_path, "sgl dev")}
    pre = cells["deep_gemm.mega_moe_pre_dispatch"]
    assert pre.result == "not supported" and pre.case.startswith("sgl dev checkout ")
    assert "use_fp4_acts=False [POSITIONAL_OR_KEYWORD] vs facade mma_type='fp8xfp4'" in pre.detail
    assert cells["deep_gemm.get_num_sms"].result == "pass"
    assert cells["deep_gemm.fp8_mega_moe"].detail == "absent in this version (the facade adds it)"
    assert matrix.checkout_signature_cells("deep_gemm", tmp_path / "nope", "x")[0].result == "fail"


DEEPEP = Path(__file__).resolve().parents[2] / ".carry" / "DeepEP"


@pytest.mark.skipif(not (DEEPEP / "deep_ep" / "buffers" / "legacy.py").is_file(),
                    reason="no DeepEP checkout in .carry/DeepEP (scripts/fetch_device_deps.sh puts one there)")
def test_deepep_legacy_checkout_signatures() -> None:
    cells = {c.entry: c for c in matrix.checkout_signature_cells("deep_ep", DEEPEP, "DeepEP")}
    assert cells["deep_ep.Buffer.low_latency_combine"].result == "pass"
    assert all(c.result in ("pass", "not supported") for c in cells.values())
