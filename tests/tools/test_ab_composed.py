"""gc-moe-ab's composed DeepEP low-latency + DeepGEMM masked baseline (SGLang's deepep path): the masked GEMM's
names across the originals, the expected_m hint, where deep_ep comes from, the probe; and on the GPU (with an
original DeepGEMM importable) the layer against the quantization-faithful reference."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from gc_moe_compat.ab import deep_ep_probe, inputs, masked_gemm, model_config, operators


@pytest.mark.parametrize("name", masked_gemm.MASKED_GEMM_NAMES)
def test_the_masked_gemm_is_found_under_each_originals_name(name: str) -> None:
    def fn() -> None:
        return None

    dg = types.ModuleType("deep_gemm")
    setattr(dg, name, fn)
    assert masked_gemm.masked_gemm_of(dg) is fn


def test_a_deep_gemm_without_a_masked_gemm_is_named_with_the_spellings_looked_for() -> None:
    dg = types.ModuleType("deep_gemm")
    dg.__file__ = "/somewhere/deep_gemm/__init__.py"
    with pytest.raises(AttributeError, match="/somewhere/deep_gemm.*m_grouped_fp8_gemm_nt_masked, "
                                             "m_grouped_fp8_fp4_gemm_nt_masked, fp8_m_grouped_gemm_nt_masked"):
        masked_gemm.masked_gemm_of(dg)


def test_the_probe_reports_an_original_without_the_masked_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(operators, "_original_deep_gemm", lambda: types.ModuleType("deep_gemm"))
    reason = operators._probe_composed()
    assert "exports no masked FP8 grouped GEMM" in reason and "build_sgl_deep_gemm.sh" in reason


def test_the_probe_passes_with_an_original_masked_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    dg = types.ModuleType("deep_gemm")
    dg.fp8_m_grouped_gemm_nt_masked = lambda *a, **k: None
    monkeypatch.setattr(operators, "_original_deep_gemm", lambda: dg)
    assert operators._probe_composed() is None


@pytest.mark.parametrize(("tokens", "world", "topk", "experts", "want"),
                         [(1, 1, 8, 32, 1), (8, 1, 8, 32, 2), (256, 1, 8, 32, 64), (256, 2, 6, 96, 32),
                          (7, 1, 6, 48, 1), (9, 1, 6, 48, 2)])
def test_expected_m_is_the_mean_rows_per_expert_rounded_up(tokens: int, world: int, topk: int, experts: int,
                                                           want: int) -> None:
    assert operators.composed_expected_m(tokens, world, topk, experts) == want


def test_deep_ep_falls_back_to_the_facade_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import deep_ep, originals

    def missing(name: str) -> None:
        raise ImportError(f"no original {name} package is installed on sys.path")

    monkeypatch.setattr(originals, "load", missing)
    ep, source = operators._deep_ep()
    assert ep is deep_ep
    assert source.startswith("gc_moe_compat.deep_ep facade") and "no original deep_ep package" in source


def test_deep_ep_prefers_the_original(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import originals

    real = types.ModuleType("deep_ep")
    real.__file__ = "/site/deep_ep/__init__.py"
    monkeypatch.setattr(originals, "load", lambda name: real)
    seen = {}

    def started(where: str, device: object, **kwargs: object) -> deep_ep_probe.Verdict:
        seen.update(where=where, device=device, **kwargs)
        return deep_ep_probe.Verdict(True, "", 2.5)

    monkeypatch.setattr(deep_ep_probe, "probe", started)
    # the line lands in the result file's meta: no absolute path of the machine
    assert operators._deep_ep(device=3) == (real, "original deep_ep at <outside the checkout>/deep_ep/__init__.py "
                                                  "(its low-latency mode started in a probe child, 2.5 s)")
    assert seen == {"where": "<outside the checkout>/deep_ep/__init__.py", "device": 3, "original_dir": "/site"}


def test_deep_ep_falls_back_to_the_facade_when_its_low_latency_mode_does_not_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import deep_ep, originals

    real = types.ModuleType("deep_ep")
    real.__file__ = "/site/deep_ep/__init__.py"
    monkeypatch.setattr(originals, "load", lambda name: real)
    timed_out = deep_ep_probe.ChildResult(None, "WARN: IBGDA: no NIC found", 60.0)
    monkeypatch.setattr(deep_ep_probe, "probe",
                        lambda where, device, **kw: deep_ep_probe.verdict_of(timed_out, where, 60.0))
    ep, source = operators._deep_ep()
    assert ep is deep_ep
    assert source == ("gc_moe_compat.deep_ep facade (the original deep_ep at <outside the checkout>/deep_ep/"
                      "__init__.py did not start its low-latency mode within 60 s: WARN: IBGDA: no NIC found)")


def _original_masked_gemm_or_skip() -> None:
    try:
        masked_gemm.masked_gemm_of(operators._original_deep_gemm())
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"no original DeepGEMM masked GEMM importable here: {exc}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_the_composed_layer_matches_the_quantization_faithful_reference(group: object, tokens: int) -> None:
    """One rank, glm52's per-rank shape: dispatch (FP8 by DeepEP's rule) -> masked W1 -> activation -> W2 ->
    combine against the FP32 reference of the FP8 block-scaled experts; eager and graph replay bit-identical."""
    from gc_moe_compat.ab import protocol
    from gc_moe_compat.ab.run import _references
    from gc_moe_compat.testing.reference import accuracy_metrics

    _original_masked_gemm_or_skip()
    w = model_config.preset("glm52", None, 256)
    device = torch.device("cuda", torch.cuda.current_device())
    shape = w.shape(1, "fp8xfp8")
    weights = inputs.make_weights(w.local_experts, w.hidden, w.intermediate, 0, ("fp8_block128",), device)
    op = operators.ComposedDeepEpDeepGemm(operators.Context(group, w, 1, 0, weights, device))
    toks = inputs.make_tokens(tokens, shape.num_experts, w.topk, w.hidden, 0, 1, w.routed_scaling_factor, device)
    op.stage(toks)
    eager = op.run().clone()
    torch.cuda.synchronize()
    ref = _references([toks], [weights], {"fp8_block128"}, w.activation_clamp, 0)["fp8_block128"]
    metrics = accuracy_metrics(eager.float(), ref["faithful"].float())
    assert metrics["cosine"] >= 0.999, metrics
    assert accuracy_metrics(eager.float(), ref["bf16_model"].float())["cosine"] >= 0.99
    graph = protocol.capture_graph(op.run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(op.y.view(torch.int16), eager.view(torch.int16))


HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (its CPU interpreter runs the kernel)")
def test_the_activation_without_routing_weights_in_the_triton_interpreter() -> None:
    """The composed path's activation (routing weights applied later, in DeepEP's combine), with and without a
    SwiGLU clamp, against test_bench_operator's oracle with unit weights (TRITON_INTERPRET=1 in a subprocess: the
    flag is read at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = """
import torch, test_bench_operator as t
from gc_moe_compat.ab import masked_gemm
t._numpy2_scalar_index()
gen = torch.Generator().manual_seed(0)
e, max_m, inter = 3, 8, 384
d1 = (torch.randn(e, max_m, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
masked_m = torch.tensor([5, 0, 8], dtype=torch.int32)
for clamp in (3.0, None):
    a2, sf_t = torch.full((e, max_m, inter), -7.0), torch.full((e, inter // 128, max_m), -7.0)
    masked_gemm.swiglu_quant_masked(d1, None, masked_m, a2, sf_t, clamp=clamp, alpha=1.5, row_programs=3)
    q, scale = t._act_oracle(d1, torch.ones(e, max_m), float("inf") if clamp is None else clamp, 1.5)
    for ex, n in enumerate(masked_m.tolist()):
        torch.testing.assert_close(sf_t[ex, :, :n].T, scale[ex, :n], rtol=1e-6, atol=0)
        torch.testing.assert_close(a2[ex, :n], q[ex, :n], rtol=1e-5, atol=1e-4)
        assert (a2[ex, n:] == -7.0).all() and (sf_t[ex, :, n:] == -7.0).all()
print("interpreter ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), str(here.parents[1] / "bench"),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout + proc.stderr
