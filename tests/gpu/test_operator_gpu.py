"""The FP8xFP8 operator (role1 -> role2 -> role3 graph, native ``fp8_fp8_gc_moe``) on one H200: the accuracy suite of
BENCH_PROTOCOL.md against the quantization-faithful reference, eager vs graph bit-identity, 1000 replays with fresh
inputs, partition on and off. Every checked call starts from poisoned ring payloads, combine buffer and ``y``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from operator_kit import (
    CAPACITY,
    ROUTINGS,
    SWEEP,
    RankWeights,
    assert_bits_equal,
    check_accuracy,
    make_inputs,
    make_weights,
    poison,
    poisoned_y,
    preset_dims,
    reference_ys,
    stage,
)

from gc_moe_compat import native
from gc_moe_compat.sm90 import layer

pytestmark = pytest.mark.gpu

PRESETS = ("tiny", "dsv41-flash", "glm52")
REPLAYS, FRESH_EVERY = 10_000, 1000


@pytest.fixture(scope="module")
def weights() -> dict[str, RankWeights]:
    return {p: make_weights(p, 0) for p in PRESETS}


_buffers: dict[tuple[str, str], native.GcMoeBuffer] = {}


def _buffer(group: dist.ProcessGroup, preset: str, partition: str = "on") -> native.GcMoeBuffer:
    """One buffer per (preset, partition) for the module: calls on it also exercise the per-replay state."""
    key = (preset, partition)
    if key not in _buffers:
        e, k, h, inter = preset_dims(preset)
        _buffers[key] = native.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, "fp8xfp8",
                                                          partition=partition)
    return _buffers[key]


def _checked_call(buf: native.GcMoeBuffer, w: RankWeights, preset: str, kind: str, tokens: int,
                  seed: int) -> torch.Tensor:
    """Stage seeded inputs, poison, run eagerly, compare with the reference; returns y."""
    e, k, h, _ = preset_dims_of(buf)
    inputs = make_inputs(kind, tokens, e, k, h, seed)
    stage(buf, inputs)
    poison(buf)
    y = poisoned_y(tokens, h)
    native.fp8_fp8_gc_moe(y, w.w1, w.w2, buf)
    torch.cuda.synchronize()
    if tokens:
        check_accuracy(y, reference_ys([inputs], [w])[0], f"{kind} T={tokens}", preset)
    return y


def preset_dims_of(buf: native.GcMoeBuffer) -> tuple[int, int, int, int]:
    s = buf.shape
    return s.num_local_experts, s.topk, s.hidden, s.intermediate


@pytest.mark.parametrize("tokens", (0, *SWEEP))
@pytest.mark.parametrize("preset", PRESETS)
def test_accuracy_t_sweep(group: dist.ProcessGroup, weights: dict[str, RankWeights], preset: str,
                          tokens: int) -> None:
    """The 9 default points (uniform routing) and T = 0 (role3 still publishes and resets; y is empty)."""
    _checked_call(_buffer(group, preset), weights[preset], preset, "uniform", tokens, seed=tokens)


@pytest.mark.parametrize("tokens", (1, 37, CAPACITY))
@pytest.mark.parametrize("kind", ROUTINGS[1:])
@pytest.mark.parametrize("preset", PRESETS)
def test_accuracy_boundary_routings(group: dist.ProcessGroup, weights: dict[str, RankWeights], preset: str,
                                    kind: str, tokens: int) -> None:
    """Zipf-skewed routing, every token's slot 0 on one expert (many ring blocks of one expert, ring refills),
    -1 slots (and a token with none)."""
    _checked_call(_buffer(group, preset), weights[preset], preset, kind, tokens, seed=1000 + tokens)


def test_experts_with_exactly_one_block_and_many(group: dist.ProcessGroup, weights: dict[str, RankWeights]) -> None:
    """Block boundaries: T such that experts get exactly BM rows, BM + 1 rows, one row."""
    buf, w = _buffer(group, "tiny"), weights["tiny"]
    for tokens in (4, 8, 16, 17, 33, 64, 65, 255):
        _checked_call(buf, w, "tiny", "one_expert", tokens, seed=2000 + tokens)


@pytest.mark.parametrize("preset", PRESETS)
def test_eager_and_graph_bit_identical(group: dist.ProcessGroup, weights: dict[str, RankWeights], preset: str) -> None:
    """The same inputs eagerly and through a torch.cuda.graph capture of the call: bit-identical y (and both twice)."""
    buf, w = _buffer(group, preset), weights[preset]
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", 64, e, k, h, seed=7)
    stage(buf, inputs)
    y = poisoned_y(64, h)
    native.fp8_fp8_gc_moe(y, w.w1, w.w2, buf)
    eager = y.clone()
    native.fp8_fp8_gc_moe(y, w.w1, w.w2, buf)
    assert_bits_equal(y, eager, "second eager call")
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        native.fp8_fp8_gc_moe(y, w.w1, w.w2, buf)
    for i in range(2):
        poison(buf)
        y.fill_(float("nan"))
        outer.replay()
        torch.cuda.synchronize()
        layer.raise_for_layer_status(buf, f"graph replay {i}")
        assert_bits_equal(y, eager, f"graph replay {i}")
    check_accuracy(eager, reference_ys([inputs], [w])[0], "eager", preset)


def test_1000_replays_with_fresh_inputs(group: dist.ProcessGroup, weights: dict[str, RankWeights]) -> None:
    """One captured call replayed 1000 times without host reset; every 100 replays fresh inputs (new routing and
    tokens, same T) are staged, and the last replay of each block (y poisoned first) is checked."""
    buf, w = _buffer(group, "dsv41-flash"), weights["dsv41-flash"]
    e, k, h, _ = preset_dims("dsv41-flash")
    tokens = 32
    stage(buf, make_inputs("uniform", tokens, e, k, h, seed=0))
    y = poisoned_y(tokens, h)
    native.fp8_fp8_gc_moe(y, w.w1, w.w2, buf)  # builds and warms the graph before capture
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        native.fp8_fp8_gc_moe(y, w.w1, w.w2, buf, check_values=False)
    for block in range(REPLAYS // FRESH_EVERY):
        kind = ROUTINGS[block % len(ROUTINGS)]
        inputs = make_inputs(kind, tokens, e, k, h, seed=5000 + block)
        stage(buf, inputs)
        for _ in range(FRESH_EVERY - 1):
            outer.replay()
        y.fill_(float("nan"))
        outer.replay()
        torch.cuda.synchronize()
        layer.raise_for_layer_status(buf, f"replay block {block}")
        check_accuracy(y, reference_ys([inputs], [w])[0], f"replay block {block} ({kind})", "dsv41-flash")


@pytest.mark.parametrize("tokens", (1, 37, CAPACITY))
def test_partition_off_matches_partition_on(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                            tokens: int) -> None:
    """GC_MOE_PARTITION=off (the same kernels in sequence on the whole device, ring holding the whole pool): the
    same y bit for bit as the partitioned graph (every output element's arithmetic is the same)."""
    w = weights["dsv41-flash"]
    on = _checked_call(_buffer(group, "dsv41-flash", "on"), w, "dsv41-flash", "zipf", tokens, seed=3000 + tokens)
    off = _checked_call(_buffer(group, "dsv41-flash", "off"), w, "dsv41-flash", "zipf", tokens, seed=3000 + tokens)
    assert_bits_equal(off, on, f"partition off vs on, T={tokens}")
