"""Tests of gc_moe_compat.config: presets, the per-rank-equivalent rule and one test per operator constraint."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from gc_moe_compat.config import (
    MAX_CAPACITY,
    PRESETS,
    SWEEP_TOKENS,
    MoEShape,
    preset_shape,
    tokens_per_expert,
    validate,
)

FP8 = torch.float8_e4m3fn
T = 3


def tiny(num_ranks: int = 2, **overrides: object) -> MoEShape:
    """The `tiny` preset (H=512, I=256, e=4, k=2, one shared expert) with optional field overrides."""
    return dataclasses.replace(preset_shape("tiny", num_ranks), **overrides)


def activations(shape: MoEShape, tokens: int = T, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Valid per-call operands for `shape`; routing is -1-padded round robin over all experts."""
    k, h = shape.topk, shape.hidden
    idx = (torch.arange(tokens * k) % shape.num_experts).view(tokens, k)
    if tokens and device != "meta":
        idx[0, -1] = -1
    return {
        "x": torch.zeros(tokens, h, dtype=FP8, device=device),
        "x_sf": torch.ones(tokens, h // 128, dtype=torch.float32, device=device),
        "topk_idx": idx.to(device),
        "topk_weights": torch.full((tokens, k), 0.5, device=device),
        "y": torch.empty(tokens, h, dtype=torch.bfloat16, device=device),
    }


def routed_weights(shape: MoEShape, packed_sf: bool = False, device: str = "cpu") -> dict[str, tuple]:
    """Valid routed (l1, l2) pairs for `shape`'s mma_type (meta tensors keep big presets free)."""
    e, h, i = shape.num_local_experts, shape.hidden, shape.intermediate

    def pair(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if shape.mma_type == "fp8xfp8":
            return (torch.empty(e, n, k, dtype=FP8, device=device),
                    torch.empty(e, n // 128, k // 128, device=device))
        sf = torch.empty(e, n, k // 128, dtype=torch.int32, device=device) if packed_sf else \
            torch.empty(e, n, k // 32, dtype=torch.uint8, device=device)
        return torch.empty(e, n, k // 2, dtype=torch.uint8, device=device), sf

    return {"l1_weights": pair(2 * i, h), "l2_weights": pair(h, i)}


def shared_weights(shape: MoEShape, form: str = "k32", device: str = "cpu") -> dict[str, tuple]:
    """Valid shared-expert pairs with scale form `k32` (uint8), `packed` (int32) or `block` (float32 128x128)."""
    s, h, i = shape.num_shared_experts, shape.hidden, shape.intermediate

    def pair(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        sf = {
            "k32": lambda: torch.empty(s, n, k // 32, dtype=torch.uint8, device=device),
            "packed": lambda: torch.empty(s, n, k // 128, dtype=torch.int32, device=device),
            "block": lambda: torch.empty(s, n // 128, k // 128, device=device),
        }[form]()
        return torch.empty(s, n, k, dtype=FP8, device=device), sf

    return {"shared_l1_weights": pair(2 * i, h), "shared_l2_weights": pair(h, i)}


def raises(exc: type[Exception], *fragments: str) -> pytest.RaisesExc:
    """pytest.raises whose message must contain every fragment (argument name, value seen, ...)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ------------------------------------------------------------------------------------------------ presets
def test_presets_match_bench_protocol() -> None:
    got = {n: (p.hidden, p.intermediate, p.local_experts, p.topk, p.shared_experts, p.shared_weight_k_group)
           for n, p in PRESETS.items()}
    assert got == {
        "dsv41-flash": (5120, 2304, 48, 6, 1, 32),
        "glm52": (6144, 2048, 32, 8, 1, 128),
        "tiny": (512, 256, 4, 2, 1, 128),
        "dsv3": (7168, 2048, 32, 8, 1, 128),
    }
    for p in PRESETS.values():
        model = (p.activation_clamp, p.routed_scaling_factor)
        assert model == ((None, 2.5) if p.name == "dsv3" else (10.0, 1.0)), p.name  # DeepSeek-V3: no SwiGLU limit
        assert (p.capacity, p.activation_alpha, p.fast_math) == (256, 1.0, True)
    assert SWEEP_TOKENS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(TypeError):
        PRESETS["x"] = PRESETS["tiny"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].hidden = 1  # type: ignore[misc]


def test_paper_ep8_shapes() -> None:
    assert preset_shape("dsv41-flash", 8).num_experts == 384
    assert preset_shape("glm52", 8).num_experts == 256
    assert tokens_per_expert(1, preset_shape("glm52", 8)) == 0.25  # the paper's T/4


@pytest.mark.parametrize(("name", "ranks"), [
    ("tiny", 1), ("tiny", 2), ("tiny", 8), ("tiny", 72),
    ("dsv41-flash", 1), ("dsv41-flash", 2), ("dsv41-flash", 8), ("dsv41-flash", 42),
    ("glm52", 1), ("glm52", 2), ("glm52", 8), ("glm52", 64),
])
@pytest.mark.parametrize("mma_type", ["fp8xfp4", "fp8xfp8"])
def test_preset_passes_validation(name: str, ranks: int, mma_type: str) -> None:
    shape = preset_shape(name, ranks, mma_type=mma_type)
    assert shape.num_experts == PRESETS[name].local_experts * ranks
    form = "k32" if PRESETS[name].shared_weight_k_group == 32 else "block"
    validate(shape, **activations(shape, device="meta"), **routed_weights(shape, device="meta"),
             **shared_weights(shape, form, device="meta"), num_tokens=T)


@pytest.mark.parametrize(("name", "ranks"), [("dsv41-flash", 43), ("glm52", 65), ("tiny", 73)])
def test_preset_beyond_envelope_rejected(name: str, ranks: int) -> None:
    with pytest.raises(ValueError, match="num_experts|num_ranks"):
        preset_shape(name, ranks)


def test_preset_options_and_unknown_name() -> None:
    assert preset_shape("tiny", 2, with_shared=False).num_shared_experts == 0
    assert preset_shape("tiny", 2, mma_type="fp8xfp8").mma_type == "fp8xfp8"
    with raises(ValueError, "name", "'nope'"):
        preset_shape("nope", 8)
    with raises(TypeError, "num_ranks", "2.0"):
        preset_shape("tiny", 2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("mma_type", ["fp8xfp4", "fp8xfp8"])
def test_per_rank_equivalent_rule(name: str, mma_type: str) -> None:
    """E = e·P keeps tokens per expert and per-rank weight bytes identical across P."""
    shapes = [preset_shape(name, p, mma_type=mma_type) for p in (1, 2, 4, 8)]
    e, k = PRESETS[name].local_experts, PRESETS[name].topk
    for t in SWEEP_TOKENS:
        assert {tokens_per_expert(t, s) for s in shapes} == {t * k / e}
    assert len({s.routed_weight_bytes_per_rank for s in shapes}) == 1
    assert {s.num_local_experts for s in shapes} == {e}


def test_routed_weight_bytes_match_floor_formula() -> None:
    """docs/bench_protocol.md floor: FP4 1.5·H·I bytes per expert (x2 for W1) + one UE8M0 byte per 32 values."""
    s = preset_shape("dsv41-flash", 8)
    h, i = s.hidden, s.intermediate
    assert s.routed_weight_bytes_per_rank == 48 * (3 * h * i // 2 + 3 * h * i // 32)
    s8 = preset_shape("dsv41-flash", 8, mma_type="fp8xfp8")
    assert s8.routed_weight_bytes_per_rank == 48 * (3 * h * i + 4 * 3 * (h // 128) * (i // 128))


def test_derived_properties() -> None:
    s = tiny(8)
    assert (s.num_experts, s.num_local_experts, s.num_combine_slots, s.num_w1_tiles) == (32, 4, 3, 4)


def test_tokens_per_expert_rejects_negative() -> None:
    with raises(ValueError, "num_tokens", "-1"):
        tokens_per_expert(-1, tiny())


# ------------------------------------------------------------------------------------------------ scalar rules
@pytest.mark.parametrize(("field", "value", "arg", "rule"), [
    ("intermediate", 200, "intermediate", "multiple of 128"),
    ("intermediate", 4224, "intermediate", "[1, 4096]"),
    ("intermediate", 0, "intermediate", "[1, 4096]"),
    ("hidden", 384, "hidden", "multiple of 256"),
    ("hidden", 0, "hidden", "[1, 8192]"),
    ("hidden", 256 * 2**32, "hidden", "bounds the symmetric buffer"),  # was an attempt to allocate ~2 PB
    ("topk", 0, "topk", "[1, 31]"),
    ("topk", 32, "topk", "k + num_shared_experts <= 32"),
    ("num_shared_experts", 2, "num_shared_experts", "[0, 1]"),
    ("num_shared_experts", -1, "num_shared_experts", "[0, 1]"),
    ("num_experts", 4096, "num_experts", "2048"),
    ("num_experts", 0, "num_experts", "[1, 2048]"),
    ("num_experts", 9, "num_experts", "multiple of 2"),
    ("num_ranks", 0, "num_ranks", "[1, 72]"),
    ("num_ranks", 73, "num_ranks", "72 offsets"),
    ("capacity", 0, "capacity", "[1, 8192]"),
    ("capacity", MAX_CAPACITY + 1, "capacity", "[1, 8192]"),
])
def test_scalar_rule(field: str, value: int, arg: str, rule: str) -> None:
    with raises(ValueError, f"{arg}:", rule, f"got {value}"):
        tiny(**{field: value})


def test_topk_at_most_the_experts_names_both() -> None:
    with raises(ValueError, "topk:", "<= num_experts (1)", "k <= E", "got 2"):
        tiny(num_experts=1)


def test_topk_31_allowed_without_shared_only() -> None:
    tiny(num_experts=64, topk=31)  # 31 + 1 shared = 32 slots: allowed
    tiny(num_experts=64, topk=32, num_shared_experts=0)
    with raises(ValueError, "topk", "got 32"):
        tiny(num_experts=64, topk=32)


def test_local_experts_limit() -> None:
    tiny(1, num_experts=512)
    with raises(ValueError, "num_experts / num_ranks", "got 513"):
        tiny(1, num_experts=513)


@pytest.mark.parametrize("field", ["hidden", "topk", "capacity", "num_ranks"])
@pytest.mark.parametrize("value", [512.0, True, "512"])
def test_scalar_wrong_type(field: str, value: object) -> None:
    with raises(TypeError, f"{field}:", repr(value)):
        tiny(**{field: value})


def test_mma_type() -> None:
    with raises(ValueError, "mma_type", "'fp4xfp4'"):
        tiny(mma_type="fp4xfp4")
    with raises(TypeError, "mma_type", "None"):
        tiny(mma_type=None)


def test_validate_needs_shape_and_rechecks_it() -> None:
    with raises(TypeError, "shape", "dict"):
        validate({})  # type: ignore[arg-type]
    s = tiny()
    object.__setattr__(s, "intermediate", 200)  # bypass the constructor
    with raises(ValueError, "intermediate", "got 200"):
        validate(s)


@pytest.mark.parametrize("num_tokens", [-1, 257])
def test_num_tokens_range(num_tokens: int) -> None:
    with raises(ValueError, "num_tokens", f"got {num_tokens}"):
        validate(tiny(), num_tokens=num_tokens)


def test_num_tokens_bounds_accepted() -> None:
    s = tiny()
    validate(s, num_tokens=0, **activations(s, 0))
    validate(s, num_tokens=256, **activations(s, 256))


def test_tensor_tokens_above_capacity() -> None:
    s = tiny(capacity=2)
    with raises(ValueError, "x.shape[0] (tokens)", "got 3"):
        validate(s, **activations(s, 3))


# ------------------------------------------------------------------------------------------------ activations
@pytest.mark.parametrize("mma_type", ["fp8xfp4", "fp8xfp8"])
def test_activations_pass(mma_type: str) -> None:
    s = tiny(mma_type=mma_type)
    validate(s, **activations(s), num_tokens=T)


def test_x_sf_packed_int32_only_for_fp8xfp4() -> None:
    packed = torch.zeros(T, 4, dtype=torch.int32)
    validate(tiny(), x_sf=packed)
    with raises(TypeError, "x_sf", "torch.int32", "torch.float32"):
        validate(tiny(mma_type="fp8xfp8"), x_sf=packed)


@pytest.mark.parametrize(("arg", "bad"), [
    ("x", torch.zeros(T, 512, dtype=torch.bfloat16)),
    ("x_sf", torch.zeros(T, 4, dtype=torch.uint8)),
    ("topk_idx", torch.zeros(T, 2, dtype=torch.int16)),
    ("topk_weights", torch.zeros(T, 2, dtype=torch.bfloat16)),
    ("y", torch.zeros(T, 512, dtype=torch.float32)),
])
def test_activation_wrong_dtype(arg: str, bad: torch.Tensor) -> None:
    with raises(TypeError, f"{arg}:", str(bad.dtype)):
        validate(tiny(), **{arg: bad})


@pytest.mark.parametrize(("arg", "bad_shape"), [
    ("x", (T, 256)), ("x", (T, 512, 1)), ("x_sf", (T, 2)), ("topk_idx", (T, 3)),
    ("topk_weights", (T,)), ("y", (T, 1024)),
])
def test_activation_wrong_shape(arg: str, bad_shape: tuple[int, ...]) -> None:
    good = activations(tiny())[arg]
    with raises(ValueError, f"{arg}:", str(bad_shape)):
        validate(tiny(), **{arg: torch.zeros(bad_shape, dtype=good.dtype)})


def test_not_a_tensor() -> None:
    with raises(TypeError, "x:", "list"):
        validate(tiny(), x=[[0.0]])  # type: ignore[arg-type]


@pytest.mark.parametrize("arg", ["x", "topk_idx", "y"])
def test_non_contiguous_rejected(arg: str) -> None:
    good = activations(tiny())[arg]
    wide = torch.zeros(T, good.shape[1] * 2, dtype=good.dtype)
    with raises(ValueError, f"{arg}:", "contiguous", "strides"):
        validate(tiny(), **{arg: wide[:, ::2]})


def test_token_count_mismatch() -> None:
    acts = activations(tiny())
    acts["y"] = torch.empty(T + 1, 512, dtype=torch.bfloat16)
    with raises(ValueError, "y.shape[0]", "x.shape[0]=3", f"got {T + 1}"):
        validate(tiny(), **acts)
    with raises(ValueError, "x.shape[0]", "num_tokens=2", "got 3"):
        validate(tiny(), x=acts["x"], num_tokens=2)


def test_device_mismatch() -> None:
    acts = activations(tiny())
    with raises(ValueError, "y:", "x's device cpu", "got meta"):
        validate(tiny(), x=acts["x"], y=acts["y"].to("meta"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_topk_idx_int32_int64_and_minus_one(dtype: torch.dtype) -> None:
    s = tiny()
    idx = torch.tensor([[0, -1], [s.num_experts - 1, -1], [-1, -1]], dtype=dtype)
    validate(s, topk_idx=idx)


@pytest.mark.parametrize(("value", "seen"), [(-2, "min -2"), (8, "max 8"), (1 << 40, f"max {1 << 40}")])
def test_topk_idx_out_of_range(value: int, seen: str) -> None:
    idx = torch.tensor([[0, 1], [2, value]], dtype=torch.int64)
    with raises(ValueError, "topk_idx:", "[-1, 8)", seen):
        validate(tiny(), topk_idx=idx)


def test_value_checks_skipped_when_disabled_or_meta() -> None:
    bad_idx = torch.tensor([[0, -5]])
    bad_w = torch.tensor([[0.5, float("nan")]])
    validate(tiny(), topk_idx=bad_idx, topk_weights=bad_w, check_values=False)
    validate(tiny(), topk_idx=bad_idx.to("meta"), topk_weights=bad_w.to("meta"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_topk_weights_must_be_finite(bad: float) -> None:
    w = torch.tensor([[0.5, 0.5], [0.5, bad]])
    with raises(ValueError, "topk_weights:", "finite", "1 non-finite"):
        validate(tiny(), topk_weights=w)


# ------------------------------------------------------------------------------------------------ weights
@pytest.mark.parametrize("packed_sf", [False, True])
@pytest.mark.parametrize("payload", [torch.uint8, torch.int8])
def test_fp4_routed_weights_pass(packed_sf: bool, payload: torch.dtype) -> None:
    s = tiny()
    w = routed_weights(s, packed_sf)
    w["l1_weights"] = (w["l1_weights"][0].view(payload), w["l1_weights"][1])
    w["l2_weights"] = (w["l2_weights"][0].view(payload), w["l2_weights"][1])
    validate(s, **w)


def test_fp8_routed_weights_pass() -> None:
    s = tiny(mma_type="fp8xfp8")
    validate(s, **routed_weights(s))


@pytest.mark.parametrize("form", ["k32", "packed", "block"])
def test_shared_weights_pass(form: str) -> None:
    s = tiny()
    validate(s, **shared_weights(s, form))


@pytest.mark.parametrize(("mma_type", "which", "bad_shape"), [
    ("fp8xfp4", 0, (2, 512, 512)),  # unpacked K
    ("fp8xfp4", 1, (2, 512, 8)),  # K/64 scales
    ("fp8xfp4", 0, (3, 512, 256)),  # wrong local expert count
    ("fp8xfp8", 1, (2, 512, 4)),  # per-row instead of 128x128 blocks
])
def test_routed_weight_wrong_shape(mma_type: str, which: int, bad_shape: tuple[int, ...]) -> None:
    s = tiny(mma_type=mma_type)
    w = routed_weights(s)
    pair = list(w["l1_weights"])
    pair[which] = torch.empty(bad_shape, dtype=pair[which].dtype)
    with raises(ValueError, f"l1_weights[{which}]:", str(bad_shape)):
        validate(s, l1_weights=tuple(pair))


@pytest.mark.parametrize(("mma_type", "which", "dtype"), [
    ("fp8xfp4", 0, FP8), ("fp8xfp4", 1, torch.float32), ("fp8xfp8", 0, torch.uint8), ("fp8xfp8", 1, torch.uint8),
])
def test_routed_weight_wrong_dtype(mma_type: str, which: int, dtype: torch.dtype) -> None:
    s = tiny(mma_type=mma_type)
    pair = list(routed_weights(s)["l2_weights"])
    pair[which] = pair[which].view(torch.uint8)[..., :1].contiguous().to(dtype)
    with raises(TypeError, f"l2_weights[{which}]:", str(dtype)):
        validate(s, l2_weights=tuple(pair))


def test_shared_weight_wrong_shape_and_dtype() -> None:
    s = tiny()
    w, sf = shared_weights(s)["shared_l2_weights"]
    with raises(ValueError, "shared_l2_weights[0]:", "(2, 512, 256)"):
        validate(s, shared_l2_weights=(torch.empty(2, 512, 256, dtype=FP8), sf))
    with raises(TypeError, "shared_l2_weights[0]:", "torch.uint8"):
        validate(s, shared_l2_weights=(w.view(torch.uint8), sf))


def test_mixed_scale_forms_rejected() -> None:
    s = tiny()
    with raises(ValueError, "l2_weights[1]", "l1_weights[1]", "torch.int32"):
        validate(s, l1_weights=routed_weights(s)["l1_weights"], l2_weights=routed_weights(s, True)["l2_weights"])
    with raises(ValueError, "shared_l2_weights[1]", "torch.float32"):
        validate(s, shared_l1_weights=shared_weights(s)["shared_l1_weights"],
                 shared_l2_weights=shared_weights(s, "block")["shared_l2_weights"])


def test_shared_weights_without_shared_expert() -> None:
    s = tiny(num_shared_experts=0)
    with raises(ValueError, "shared_l1_weights", "num_shared_experts is 0"):
        validate(s, shared_l2_weights=shared_weights(tiny())["shared_l2_weights"])


@pytest.mark.parametrize(("bad", "exc", "seen"), [
    (torch.empty(1), TypeError, "Tensor"),
    ({"w": 1}, TypeError, "dict"),
])
def test_weight_pair_not_a_tuple(bad: object, exc: type[Exception], seen: str) -> None:
    with raises(exc, "l1_weights:", "2-tuple", seen):
        validate(tiny(), l1_weights=bad)  # type: ignore[arg-type]


def test_weight_pair_wrong_length_and_member_type() -> None:
    w, sf = routed_weights(tiny())["l1_weights"]
    with raises(ValueError, "l1_weights:", "length 3"):
        validate(tiny(), l1_weights=(w, sf, sf))  # type: ignore[arg-type]
    with raises(TypeError, "l1_weights[1]:", "NoneType"):
        validate(tiny(), l1_weights=(w, None))  # type: ignore[arg-type]
    validate(tiny(), l1_weights=[w, sf])  # type: ignore[arg-type]


def test_weights_device_must_match_activations() -> None:
    s = tiny()
    with raises(ValueError, "l1_weights[0]:", "x's device cpu", "meta"):
        validate(s, x=activations(s)["x"], **routed_weights(s, device="meta"))


def test_full_call_passes() -> None:
    s = tiny(8)
    validate(s, **activations(s), **routed_weights(s, packed_sf=True), **shared_weights(s), num_tokens=T)
