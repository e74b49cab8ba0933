"""quant.py and reference.py compute the same numbers on CUDA tensors as on CPU tensors (they are device-agnostic)."""

from __future__ import annotations

import pytest
import torch

from gc_moe_compat import quant
from gc_moe_compat.references.reference import ExpertWeights, accuracy_metrics, quantization_faithful_reference

pytestmark = pytest.mark.gpu


def _same_on_cuda(fn, *args, **kwargs) -> None:
    cpu = fn(*args, **kwargs)
    gpu = fn(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
    cpu, gpu = (cpu, gpu) if isinstance(cpu, tuple) else ((cpu,), (gpu,))
    for c, g in zip(cpu, gpu, strict=True):
        assert g.device.type == "cuda"
        c, g = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (c, g.cpu()))
        torch.testing.assert_close(g, c, rtol=0, atol=0, equal_nan=True, msg=fn.__name__)  # bitwise, NaN == NaN


def test_quantizers_bit_identical_on_cuda() -> None:
    torch.manual_seed(11)
    x = torch.randn(67, 512) * torch.logspace(-6, 3, 512)
    _same_on_cuda(quant.quantize_fp8_groups, x, 128, "fp32")
    _same_on_cuda(quant.quantize_fp8_groups, x, 32, "ue8m0")
    _same_on_cuda(quant.quantize_fp8_blocks, x.reshape(1, 67, 512))
    _same_on_cuda(quant.quantize_mxfp4, x)
    _same_on_cuda(quant.e4m3_decode, torch.arange(256, dtype=torch.uint8))
    _same_on_cuda(quant.e2m1_decode, torch.arange(16, dtype=torch.uint8))
    _same_on_cuda(quant.pack_ue8m0_k32, torch.randint(0, 255, (9, 16), dtype=torch.uint8))


def test_reference_matches_cpu_on_cuda() -> None:
    torch.manual_seed(12)
    e, h, i, t, k = 4, 256, 128, 19, 2
    x = quant.quantize_fp8_groups(torch.randn(t, h), 128, "fp32")
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    idx[3, 1] = -1
    weights = torch.softmax(torch.randn(t, k), dim=-1)
    l1 = ExpertWeights.quantize(torch.randn(e, 2 * i, h) / h**0.5, "mxfp4")
    l2 = ExpertWeights.quantize(torch.randn(e, h, i) / i**0.5, "mxfp4")
    cpu = quantization_faithful_reference(x, idx, weights, l1, l2, activation_clamp=10.0)
    l1c, l2c = (ExpertWeights(w.fmt, w.payload.cuda(), w.scales.cuda()) for w in (l1, l2))
    gpu = quantization_faithful_reference(
        tuple(a.cuda() for a in x), idx.cuda(), weights.cuda(), l1c, l2c, activation_clamp=10.0
    )
    assert gpu.y.device.type == "cuda"
    metrics = accuracy_metrics(gpu.y_fp32.cpu(), cpu.y_fp32)
    assert metrics["nonfinite"] == 0 and metrics["cosine"] >= 0.999999, metrics
