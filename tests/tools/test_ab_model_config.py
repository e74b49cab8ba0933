"""gc-moe-ab's workloads: HuggingFace config.json contents of each model family (the field names and values of the
published configs, written here, not fetched), the presets, the per-rank share at any GPU count, and constraint
failures reported before anything is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gc_moe_compat import config
from gc_moe_compat.ab import model_config
from gc_moe_compat.ab.model_config import Workload, from_hf_config

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_hidden_layers": 61, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "vocab_size": 129280,
}
DEEPSEEK_R1 = {**DEEPSEEK_V3, "_name_or_path": "deepseek-ai/DeepSeek-R1"}
DEEPSEEK_V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus",
}
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1,
}
KIMI_K2_VL = {"architectures": ["KimiVLForConditionalGeneration"], "model_type": "kimi_vl",
              "vision_config": {"hidden_size": 1152}, "text_config": KIMI_K2}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts": 60, "num_experts_per_tok": 4,
}
GLM_45 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "n_group": 1,
}
GLM_5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "routed_scaling_factor": 2.5,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
}

FAMILIES = {  # config, (H, I, E, k, shared, scaling, clamp)
    "deepseek_v3": (DEEPSEEK_V3, (7168, 2048, 256, 8, 1, 2.5, None)),
    "deepseek_r1": (DEEPSEEK_R1, (7168, 2048, 256, 8, 1, 2.5, None)),
    "deepseek_v4": (DEEPSEEK_V4_FLASH, (5120, 2304, 384, 6, 1, 1.5, 10.0)),
    "kimi_k2": (KIMI_K2, (7168, 2048, 384, 8, 1, 2.827, None)),
    "kimi_k2_vl_text_config": (KIMI_K2_VL, (7168, 2048, 384, 8, 1, 2.827, None)),
    "qwen3_moe": (QWEN3_30B_A3B, (2048, 768, 128, 8, 0, 1.0, None)),
    "glm4_moe": (GLM_45, (5120, 1536, 160, 8, 1, 2.5, None)),
    "glm5": (GLM_5, (6144, 2048, 256, 8, 1, 2.5, None)),
    "mixtral": (MIXTRAL_8X7B, (4096, 14336, 8, 2, 0, 1.0, None)),
}


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_reads_its_moe_layer(tmp_path: Path, family: str) -> None:
    cfg, (h, i, e, k, shared, scaling, clamp) = FAMILIES[family]
    w = from_hf_config(_write(tmp_path, cfg), ep_size=8)
    assert (w.hidden, w.intermediate, w.num_experts, w.topk) == (h, i, e, k)
    assert (w.shared_experts, w.routed_scaling_factor, w.activation_clamp) == (shared, scaling, clamp)
    assert w.local_experts == e // 8 and w.fields["source"] == str(tmp_path / "config.json")
    # the dense MLP's intermediate_size is the expert width only where no MoE width exists (Mixtral)
    assert w.fields["intermediate"] == ("intermediate_size" if family == "mixtral" else "moe_intermediate_size")


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2", "qwen3_moe", "glm4_moe", "glm5", "deepseek_v4"])
def test_runnable_families_keep_the_per_rank_share_at_any_gpu_count(family: str) -> None:
    cfg, (h, i, e, k, *_) = FAMILIES[family]
    w = from_hf_config(cfg, ep_size=8)
    for world in (1, 2, 8):
        shape = w.shape(world, "fp8xfp8")
        assert isinstance(shape, config.MoEShape)
        assert (shape.num_experts, shape.num_ranks, shape.num_local_experts) == (e // 8 * world, world, e // 8)
        assert (shape.hidden, shape.intermediate, shape.topk, shape.num_shared_experts) == (h, i, k, 0)
        assert config.tokens_per_expert(64, shape) == 64 * k / (e // 8)  # tokens per expert as deployed at EP8


def test_mixtral_fails_the_intermediate_rule_with_the_operators_message() -> None:
    w = from_hf_config(MIXTRAL_8X7B, ep_size=2)
    with pytest.raises(ValueError, match=r"mixtral at 1 rank\(s\), fp8xfp8: intermediate: must be in \[1, 4096\] "
                                         r"\(K128 tiles, 64-bit W1 completion mask\), got 14336"):
        w.shape(1, "fp8xfp8")


def test_qwen2_style_shared_expert_width_counts_as_one_and_ep_size_must_divide() -> None:
    w = from_hf_config(QWEN2_MOE, ep_size=4)
    assert w.shared_experts == 1 and w.fields["shared_experts"] == "shared_expert_intermediate_size"
    with pytest.raises(ValueError, match="ep_size: must divide the model's 60 routed experts .* got 8"):
        from_hf_config(QWEN2_MOE, ep_size=8)


def test_a_missing_field_names_the_file_and_the_fields_looked_for(tmp_path: Path) -> None:
    cfg = {k: v for k, v in DEEPSEEK_V3.items() if k != "num_experts_per_tok"}
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=rf"{path}: no topk field: looked for \['num_experts_per_tok'"):
        from_hf_config(path)
    bad = _write(tmp_path, {**DEEPSEEK_V3, "hidden_size": "7168"})
    with pytest.raises(ValueError, match="hidden_size must be an integer, got '7168'"):
        from_hf_config(bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        from_hf_config(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="cannot read"):
        from_hf_config(tmp_path / "absent.json")


LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
}


@pytest.mark.parametrize("cfg", [LLAMA_3_8B, {**QWEN3_30B_A3B, "num_experts": 1, "num_experts_per_tok": 1}],
                         ids=["llama", "one_expert"])
def test_a_dense_model_is_named_as_such(tmp_path: Path, cfg: dict) -> None:
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=rf"{path}: a dense model \({cfg['model_type']}\): it has no routed experts "
                                         r"\(looked for \['n_routed_experts'.*gc-moe-ab compares Mixture-of-Experts"):
        from_hf_config(path)


def test_presets() -> None:
    dsv3 = model_config.preset("dsv3")
    assert (dsv3.hidden, dsv3.intermediate, dsv3.num_experts, dsv3.topk, dsv3.shared_experts) == (7168, 2048, 256, 8, 1)
    assert dsv3.routed_scaling_factor == 2.5 and dsv3.local_experts == 32
    assert from_hf_config(DEEPSEEK_V3).shape(1) == dsv3.shape(1)
    glm = model_config.preset("glm52", ep_size=8)
    assert glm.shape(1) == config.preset_shape("glm52", 1, mma_type="fp8xfp8", with_shared=False)
    assert from_hf_config(GLM_5).shape(2) == glm.shape(2)
    flash = model_config.preset("dsv41-flash", ep_size=4)
    assert (flash.num_experts, flash.local_experts, flash.activation_clamp) == (192, 48, 10.0)
    with pytest.raises(ValueError, match="preset: must be one of"):
        model_config.preset("tiny")


def test_workload_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="topk: must be a positive int, got 0"):
        Workload("x", 512, 256, 8, 0)
    with pytest.raises(ValueError, match="routed_scaling_factor: must be finite, got nan"):
        model_config.explicit(512, 256, 8, 2, routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match="activation_clamp: must be a positive finite float or None, got -1.0"):
        model_config.explicit(512, 256, 8, 2, activation_clamp=-1.0)


def test_the_committed_deepseek_v3_fixture_is_the_dsv3_share() -> None:
    """tests/data/deepseek_v3/config.json (what `gc-moe-ab --model-config` ran for bench/results/ab_DeepSeek-V3.json)
    holds the same MoE fields as the in-test DeepSeek-V3 config and reads as the dsv3 preset's per-rank load."""
    path = Path(__file__).resolve().parents[1] / "data" / "deepseek_v3" / "config.json"
    fixture = json.loads(path.read_text())
    shared = [k for k in DEEPSEEK_V3 if k in fixture]
    assert len(shared) >= 10 and all(fixture[k] == DEEPSEEK_V3[k] for k in shared)
    w = from_hf_config(path)
    assert w.name == "deepseek-ai/DeepSeek-V3" and w.shape(1) == model_config.preset("dsv3").shape(1)
    assert w.activation_clamp is None and w.routed_scaling_factor == 2.5
