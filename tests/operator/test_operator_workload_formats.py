"""The operator GPU tests' workload in both compute paths' weight formats, on the host (no GPU).

``make_weights(..., mma_type="fp8xfp4")`` gives MXFP4 weights of the same BF16 draws as the FP8xFP8 ones, expressed
after the window repack (what the FP8xFP4 kernel computes with) and transformed by the native API; ``reference_ys``
requantizes the intermediate as each path's W1 epilogue does and, with BF16 pairs, is the BF16 model; the FP8xFP4
faithful reference is within the paper's model threshold on the tiny preset.
"""

from __future__ import annotations

import pytest
import torch

from gc_moe_compat.operator import api
from gc_moe_compat.references import operator_workload as ow
from gc_moe_compat.references.reference import ExpertWeights, accuracy_metrics, expert_parallel_reference

PRESET, E, K, H = "tiny", 4, 2, 512


def test_fp4_weights_are_the_window_repacked_mxfp4_of_the_same_draws() -> None:
    bf16 = ow.make_expert_weights(PRESET, 1, "cpu", fmt="bf16")
    fp8 = ow.make_weights(PRESET, 1, "cpu")
    fp4 = ow.make_weights(PRESET, 1, "cpu", mma_type="fp8xfp4")
    assert (bf16[0].fmt, fp8.l1.fmt, fp4.l1.fmt, fp4.w1.mma_type) == ("bf16", "fp8_block128", "mxfp4", "fp8xfp4")
    for gemm, (model, quantized) in enumerate(zip(bf16, (fp4.l1, fp4.l2), strict=True)):
        plain = ExpertWeights.quantize(model.payload, "mxfp4")  # random weights: every group inside its window
        assert torch.equal(quantized.payload, plain.payload) and torch.equal(quantized.scales, plain.scales), gemm
        fp8_again = ExpertWeights.quantize(model.payload, "fp8_block128")
        assert torch.equal((fp8.l1, fp8.l2)[gemm].scales, fp8_again.scales)
    w1, w2 = api.transform_weights_for_gc_moe((fp4.l1.payload, fp4.l1.scales), (fp4.l2.payload, fp4.l2.scales),
                                                 "fp8xfp4")
    assert torch.equal(fp4.w1.payload, w1.payload) and torch.equal(fp4.w2.factor, w2.factor)


def test_fp4_weights_clip_like_the_kernel() -> None:
    """A group below its expert's 11-exponent window comes back as the kernel computes it (shifted codes at the
    window base), not as quantized."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1, 64, 128, generator=g)
    w[0, 0, :32] *= 2.0**-14
    q = ExpertWeights.quantize(w, "mxfp4")
    windowed = ow._window(q)
    assert not torch.equal(windowed.scales, q.scales) and int(windowed.scales.min()) == int(q.scales.max()) - 10
    assert torch.equal(windowed.scales[0, 1:], q.scales[0, 1:])


@pytest.mark.parametrize("mma_type", ["fp8xfp8", "fp8xfp4"])
def test_reference_requantizes_as_the_path_does(mma_type: str) -> None:
    w = ow.make_weights(PRESET, 0, "cpu", mma_type=mma_type)
    inputs = [ow.make_inputs("uniform", 16, E, K, H, seed=3, device="cpu")]
    got = ow.reference_ys(inputs, [w])[0]
    want = expert_parallel_reference([(inputs[0].x, inputs[0].x_sf)], [inputs[0].topk_idx], [inputs[0].topk_weights],
                                     [w.l1], [w.l2], activation_clamp=ow.CLAMP,
                                     intermediate_quant={"fp8xfp8": "fp32_128", "fp8xfp4": "ue8m0_128"}[mma_type])
    assert torch.equal(got, want[0].y)


@pytest.mark.parametrize(("mma_type", "cosine_min"), [("fp8xfp8", 0.99), ("fp8xfp4", 0.97)])
def test_faithful_reference_meets_the_model_threshold(mma_type: str, cosine_min: float) -> None:
    """What test_operator_gpu.py::test_model_reference asks of the kernels holds for their faithful references:
    the BF16 model (``fmt="bf16"`` pairs, no requantization) within the paper's cosine."""
    faithful = ow.make_weights(PRESET, 0, "cpu", mma_type=mma_type)
    model = ow.make_expert_weights(PRESET, 0, "cpu", fmt="bf16")
    for tokens in (1, 32):
        inputs = [ow.make_inputs("uniform", tokens, E, K, H, seed=tokens, device="cpu")]
        y, y_model = ow.reference_ys(inputs, [faithful])[0], ow.reference_ys(inputs, [model])[0]
        m = accuracy_metrics(y.float(), y_model.float())
        assert m["cosine"] >= cosine_min, (tokens, m)


def test_bad_format_and_path_raise() -> None:
    with pytest.raises(ValueError, match="fmt: must be one of"):
        ow.make_expert_weights(PRESET, 0, "cpu", fmt="nvfp4")
    with pytest.raises(ValueError, match="mma_type: must be one of"):
        ow.make_weights(PRESET, 0, "cpu", mma_type="fp8xbf16")
