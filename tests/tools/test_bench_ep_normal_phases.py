"""bench/_ep_normal_phases.py, the phase-timed normal-mode kernels that ``bench/deep_ep_ab.py --phases`` reads: the
summary of the marks (host), the point's per-rank phases, ``--phases``' bound, the variant compiling beside the
production kernels without spills and without changing them; on an H200, every CTA of a dispatch and a combine marks
its six phases in order, the outputs equal the production kernels', and the production kernels are back after the
block."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from nvcc_mark import needs_nvcc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _ep_normal_phases as phases  # noqa: E402 - bench/ is a script folder, put on the path above
import deep_ep_ab as ab  # noqa: E402

from gc_moe_compat.comm import ep_normal  # noqa: E402
from gc_moe_compat.deep_ep import Buffer, Config, _normal  # noqa: E402
from gc_moe_compat.runtime import jit  # noqa: E402


def test_summary_takes_each_marks_median_and_latest_cta_after_the_first_entry() -> None:
    first = np.array([[1000, 2000, 5000, 6000, 9000, 9500],
                      [1200, 2200, 7000, 7000, 9200, 9700],
                      [1100, 2100, 6000, 6500, 9100, 9600]], dtype=np.int64)
    second = first + 10_000
    second[:, 2] += 3000  # a slower send half in the second call
    got = phases.summary([first, second])
    assert got["ctas"] == 3 and got["first_entry_ns"] == [1000, 11000]
    assert got["median_us"]["send_rows"] == pytest.approx((5.0 + 8.0) / 2)  # medians of 5 and 8 us
    assert got["latest_us"]["send_rows"] == pytest.approx((6.0 + 9.0) / 2)
    assert got["median_us"]["entry"] == pytest.approx(0.1) and got["latest_us"]["exit"] == pytest.approx(8.7)
    assert list(got["median_us"]) == list(phases.MARKS)


def test_a_point_keeps_every_ranks_phases() -> None:
    records = [{"latency_us": {"facade/combine": 10.0}, "host_us": {"facade/combine": 5.0}, "phases": {"combine": r}}
               for r in ("rank 0's", "rank 1's")]
    point = ab.assemble_point({"mode": "normal"}, records, {}, ab.NORMAL_OPS, "measured")
    assert point["phases"] == [{"combine": "rank 0's"}, {"combine": "rank 1's"}]
    assert "phases" not in ab.assemble_point({"mode": "normal"}, [{"latency_us": {}, "host_us": {}}], {},
                                             ab.NORMAL_OPS, "measured")


def test_phases_must_not_be_negative() -> None:
    with pytest.raises(SystemExit):
        ab.parse_args(["--phases", "-1"])
    assert ab.parse_args([]).phases == 0 and ab.parse_args(["--phases", "4"]).phases == 4


@needs_nvcc
def test_the_variant_compiles_beside_the_production_kernels_without_spills(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The marks cost the direction kernels at most a few registers and no spill; the production build (no define)
    has no global for them; the variant's global has its plain name (outside any namespace)."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    production = jit.compile_cubin(ep_normal.SOURCE).resources
    variant = jit.compile_cubin(ep_normal.SOURCE, phases.DEFINES).resources
    assert set(variant) == set(production) == set(ep_normal.ENTRY_NAMES.values())
    for name, res in variant.items():
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, name
        assert res.registers <= production[name].registers + 8, name
    symbol = b"\0" + phases.GLOBAL + b"\0"  # the plain name in the string table: what cuLibraryGetGlobal finds
    assert phases.GLOBAL not in jit.compile_cubin(ep_normal.SOURCE).path.read_bytes()
    assert symbol in jit.compile_cubin(ep_normal.SOURCE, phases.DEFINES).path.read_bytes()


@pytest.mark.gpu
def test_every_cta_marks_its_phases_in_order_and_the_outputs_stay(group: dist.ProcessGroup) -> None:
    tokens, hidden, topk, experts = 300, 1024, 4, 16
    device = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(group, 1 << 26, 0, explicitly_destroy=True)
    try:
        _every_cta_marks(buf, device, tokens, hidden, topk, experts)
    finally:
        buf.destroy()


def _every_cta_marks(buf: Buffer, device: torch.device, tokens: int, hidden: int, topk: int, experts: int) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(device)
    w = torch.rand(tokens, topk, generator=g).to(device)
    config = Config(24, 8, 256)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w, config=config)
    want_x, _, want_w, _, handle, _ = buf.dispatch(x, **kwargs)
    want_out, _, _ = buf.combine(want_x, handle, topk_weights=want_w, config=config)
    torch.cuda.synchronize()
    got = {}
    with phases.variant(device) as times:
        assert _normal.kernel_of is not ep_normal.kernel_of
        marks = {"dispatch": times.timed(lambda: got.update(dispatch=buf.dispatch(x, **kwargs)), "dispatch")}
        marks["combine"] = times.timed(lambda: got.update(combine=buf.combine(
            got["dispatch"][0], got["dispatch"][4], topk_weights=got["dispatch"][2], config=config)), "combine")
    assert _normal.kernel_of is ep_normal.kernel_of
    assert torch.equal(got["dispatch"][0], want_x) and torch.equal(got["combine"][0], want_out)
    for direction, m in marks.items():
        assert m.shape == (config.num_sms, len(phases.MARKS)), direction  # one row per CTA of the grid
        assert (np.diff(m, axis=1) >= 0).all(), direction
