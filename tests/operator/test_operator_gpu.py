"""The operator (role1 -> role2 -> role3 graph) on one H200, for both compute paths: native ``fp8_fp8_gc_moe``
(FP8xFP8) and ``fp8_fp4_gc_moe`` (FP8xFP4, the register-decoding role2 kernel). The accuracy suite of
docs/bench_protocol.md against the quantization-faithful reference of each path (FP32 1x128 / UE8M0 1x128
intermediate requant), the BF16 model reference on one case, eager vs graph bit-identity, 10 000 replays with fresh
inputs, partition on and off.
Every checked call starts from poisoned ring payloads, combine buffer and ``y``.

Tests are parametrized by ``mma_type`` (ids ``fp8xfp8`` / ``fp8xfp4``): ``-k fp8xfp4`` runs the FP4 path alone."""

from __future__ import annotations

from collections.abc import Callable

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
    make_expert_weights,
    make_inputs,
    make_weights,
    poison,
    poisoned_y,
    preset_dims,
    reference_ys,
    stage,
)

from gc_moe_compat.operator import api
from gc_moe_compat.operator.sm90 import layer
from gc_moe_compat.testing.reference import accuracy_metrics

pytestmark = pytest.mark.gpu

PRESETS = ("tiny", "dsv41-flash", "glm52")
MMA_TYPES = ("fp8xfp8", "fp8xfp4")
CALLS: dict[str, Callable[..., None]] = {"fp8xfp8": api.fp8_fp8_gc_moe, "fp8xfp4": api.fp8_fp4_gc_moe}
MODEL_COSINE_MIN = {"fp8xfp8": 0.99, "fp8xfp4": 0.97}
"""docs/bench_protocol.md reference 2 (BF16 model): the paper's thresholds for FP8 and FP4 routed weights."""
REPLAYS, FRESH_EVERY = 10_000, 1000


@pytest.fixture(scope="module", params=MMA_TYPES)
def mma_type(request: pytest.FixtureRequest) -> str:
    """The compute path (module scope: pytest runs one path's tests, then the other's)."""
    return request.param


@pytest.fixture(scope="module")
def weights(mma_type: str) -> dict[str, RankWeights]:
    return {p: make_weights(p, 0, mma_type=mma_type) for p in PRESETS}


_buffers: dict[tuple[str, str, str], api.GcMoeBuffer] = {}


def _buffer(group: dist.ProcessGroup, preset: str, mma_type: str, partition: str = "on") -> api.GcMoeBuffer:
    """One buffer per (preset, path, partition) for the module: calls on it also exercise the per-replay state."""
    key = (preset, mma_type, partition)
    if key not in _buffers:
        e, k, h, inter = preset_dims(preset)
        _buffers[key] = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, mma_type,
                                                          partition=partition)
    return _buffers[key]


def _run(buf: api.GcMoeBuffer, w: RankWeights, y: torch.Tensor, **kw: object) -> None:
    """The native call of the buffer's compute path."""
    CALLS[buf.shape.mma_type](y, w.w1, w.w2, buf, **kw)


def _checked_call(buf: api.GcMoeBuffer, w: RankWeights, preset: str, kind: str, tokens: int,
                  seed: int) -> torch.Tensor:
    """Stage seeded inputs, poison, run eagerly, compare with the reference; returns y."""
    e, k, h, _ = preset_dims_of(buf)
    inputs = make_inputs(kind, tokens, e, k, h, seed)
    stage(buf, inputs)
    poison(buf)
    y = poisoned_y(tokens, h)
    _run(buf, w, y)
    torch.cuda.synchronize()
    if tokens:
        check_accuracy(y, reference_ys([inputs], [w])[0], f"{buf.shape.mma_type} {kind} T={tokens}", preset)
    return y


def preset_dims_of(buf: api.GcMoeBuffer) -> tuple[int, int, int, int]:
    s = buf.shape
    return s.num_local_experts, s.topk, s.hidden, s.intermediate


@pytest.mark.parametrize("tokens", (0, *SWEEP))
@pytest.mark.parametrize("preset", PRESETS)
def test_accuracy_t_sweep(group: dist.ProcessGroup, weights: dict[str, RankWeights], mma_type: str, preset: str,
                          tokens: int) -> None:
    """The 9 default points (uniform routing) and T = 0 (role3 still publishes and resets; y is empty)."""
    _checked_call(_buffer(group, preset, mma_type), weights[preset], preset, "uniform", tokens, seed=tokens)


@pytest.mark.parametrize("tokens", (1, 37, CAPACITY))
@pytest.mark.parametrize("kind", ROUTINGS[1:])
@pytest.mark.parametrize("preset", PRESETS)
def test_accuracy_boundary_routings(group: dist.ProcessGroup, weights: dict[str, RankWeights], mma_type: str,
                                    preset: str, kind: str, tokens: int) -> None:
    """Zipf-skewed routing, every token's slot 0 on one expert (many ring blocks of one expert, ring refills),
    -1 slots (and a token with none)."""
    _checked_call(_buffer(group, preset, mma_type), weights[preset], preset, kind, tokens, seed=1000 + tokens)


def test_experts_with_exactly_one_block_and_many(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                                 mma_type: str) -> None:
    """Block boundaries: T such that experts get exactly BM rows, BM + 1 rows, one row."""
    buf, w = _buffer(group, "tiny", mma_type), weights["tiny"]
    for tokens in (4, 8, 16, 17, 33, 64, 65, 255):
        _checked_call(buf, w, "tiny", "one_expert", tokens, seed=2000 + tokens)


_max_i_weights: dict[tuple[str, str], RankWeights] = {}


@pytest.mark.parametrize(("kind", "tokens"), [("uniform", 1), ("uniform", 37), ("holes", 64),
                                               ("one_expert", CAPACITY)])
def test_intermediate_at_its_maximum(group: dist.ProcessGroup, mma_type: str, kind: str, tokens: int) -> None:
    """docs/bench_protocol.md boundary case "I at its maximum": ``tiny`` with ``I = config.MAX_INTERMEDIATE`` (32 W1 and
    16 W2 weight tiles per expert, the widest L2 activation rows and scale columns the workspace holds)."""
    preset = "tiny-max-i"
    if (preset, mma_type) not in _max_i_weights:
        _max_i_weights[(preset, mma_type)] = make_weights(preset, 0, mma_type=mma_type)
    w = _max_i_weights[(preset, mma_type)]
    _checked_call(_buffer(group, preset, mma_type), w, preset, kind, tokens, seed=4000 + tokens)


@pytest.mark.parametrize("tokens", (1, 32))
def test_model_reference(group: dist.ProcessGroup, weights: dict[str, RankWeights], mma_type: str,
                         tokens: int) -> None:
    """docs/bench_protocol.md reference 2: y against the BF16 layer (the BF16 draws the quantized weights come from,
    the staged E4M3 activations, no requantization) meets the paper's cosine (>= 0.97 FP4, >= 0.99 FP8)."""
    preset = "dsv41-flash"
    y = _checked_call(_buffer(group, preset, mma_type), weights[preset], preset, "uniform", tokens, seed=4000 + tokens)
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", tokens, e, k, h, seed=4000 + tokens)
    model = reference_ys([inputs], [make_expert_weights(preset, 0, fmt="bf16")])[0]
    m = accuracy_metrics(y.float(), model.float())
    print(f"{mma_type} {preset} T={tokens} vs BF16 model: {m}")
    assert m["nonfinite"] == 0 and m["cosine"] >= MODEL_COSINE_MIN[mma_type], m


@pytest.mark.parametrize("preset", PRESETS)
def test_eager_and_graph_bit_identical(group: dist.ProcessGroup, weights: dict[str, RankWeights], mma_type: str,
                                       preset: str) -> None:
    """The same inputs eagerly and through a torch.cuda.graph capture of the call: bit-identical y (and both twice)."""
    buf, w = _buffer(group, preset, mma_type), weights[preset]
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", 64, e, k, h, seed=7)
    stage(buf, inputs)
    y = poisoned_y(64, h)
    _run(buf, w, y)
    eager = y.clone()
    _run(buf, w, y)
    assert_bits_equal(y, eager, "second eager call")
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        _run(buf, w, y)
    for i in range(2):
        poison(buf)
        y.fill_(float("nan"))
        outer.replay()
        torch.cuda.synchronize()
        layer.raise_for_layer_status(buf, f"graph replay {i}")
        assert_bits_equal(y, eager, f"graph replay {i}")
    check_accuracy(eager, reference_ys([inputs], [w])[0], f"{mma_type} eager", preset)


def test_replays_with_fresh_inputs(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                         mma_type: str) -> None:
    """One captured call replayed 10 000 times without host reset; every 1 000 replays fresh inputs (new routing and
    tokens, same T) are staged, and the last replay of each block (y poisoned first) is checked."""
    buf, w = _buffer(group, "dsv41-flash", mma_type), weights["dsv41-flash"]
    e, k, h, _ = preset_dims("dsv41-flash")
    tokens = 32
    stage(buf, make_inputs("uniform", tokens, e, k, h, seed=0))
    y = poisoned_y(tokens, h)
    _run(buf, w, y)  # builds and warms the graph before capture
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        _run(buf, w, y, check_values=False)
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
        check_accuracy(y, reference_ys([inputs], [w])[0], f"{mma_type} replay block {block} ({kind})", "dsv41-flash")


@pytest.mark.parametrize("kind", ("zipf", "one_expert"))
def test_partition_auto_matches_partition_on(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                             mma_type: str, kind: str) -> None:
    """GC_MOE_PARTITION=auto (the default): calls up to ``sequential_max_tokens`` run with the partition off on a
    ring sized for them, larger ones partitioned; both give the partitioned graph's y bit for bit, at the rule's
    edge too (one-expert routing: the most blocks a call of that size can fill)."""
    w, auto = weights["dsv41-flash"], _buffer(group, "dsv41-flash", mma_type, "auto")
    edge = auto.plan.sequential_max_tokens
    assert edge == 255 and auto.partition == "on"  # 48 experts, top-6: T * 6 / 48 < 32 (heuristics)
    for tokens in (1, edge, edge + 1):
        assert auto.for_call(tokens).partition == ("off" if tokens <= edge else "on")
        seed = 3100 + tokens
        got = _checked_call(auto, w, "dsv41-flash", kind, tokens, seed=seed)
        on = _checked_call(_buffer(group, "dsv41-flash", mma_type, "on"), w, "dsv41-flash", kind, tokens, seed=seed)
        assert_bits_equal(got, on, f"{mma_type} partition auto vs on, {kind} T={tokens}")


@pytest.mark.parametrize("tokens", (1, 37, CAPACITY))
def test_partition_off_matches_partition_on(group: dist.ProcessGroup, weights: dict[str, RankWeights], mma_type: str,
                                            tokens: int) -> None:
    """GC_MOE_PARTITION=off (the same kernels in sequence on the whole device, ring holding the whole pool): the
    same y bit for bit as the partitioned graph (every output element's arithmetic is the same)."""
    w = weights["dsv41-flash"]
    on = _checked_call(_buffer(group, "dsv41-flash", mma_type, "on"), w, "dsv41-flash", "zipf", tokens,
                       seed=3000 + tokens)
    off = _checked_call(_buffer(group, "dsv41-flash", mma_type, "off"), w, "dsv41-flash", "zipf", tokens,
                        seed=3000 + tokens)
    assert_bits_equal(off, on, f"{mma_type} partition off vs on, T={tokens}")
