"""The workload of an A/B run: a model's MoE layer as one rank of an expert-parallel deployment sees it.

Three sources, one result (:class:`Workload`):

* ``--preset``: the per-rank presets of :data:`config.PRESETS` (docs/bench_protocol.md): ``dsv41-flash``, ``glm52``
  and ``dsv3``, DeepSeek-V3's load at EP8 (H 7168, I 2048, 32 of 256 routed experts, top-8, one shared expert, routed
  scaling 2.5).
* ``--model-config PATH``: a HuggingFace ``config.json`` (DeepSeek V3/R1/V4, Kimi K2, Qwen3-MoE, GLM-4.5/5,
  Mixtral-style names; a multimodal ``text_config`` is followed), read by :func:`from_hf_config`.
* explicit ``--hidden --intermediate --experts --topk``.

The deployment spreads the model's ``E`` routed experts over ``ep_size`` ranks, so one rank holds ``e = E/ep_size``
experts. A run on ``W`` GPUs keeps that per-rank share (docs/bench_protocol.md's per-rank-equivalent rule): ``E = e·W``
experts, the same tokens per expert and the same per-rank weight bytes as the deployment; only the remote fraction
of the dispatch traffic changes. :meth:`Workload.shape` builds the operator's :class:`config.MoEShape`, whose
construction runs the operator's own constraint checks (config.py is the one validation layer): a shape the
operator cannot run fails there, naming the rule, before anything is allocated.

Shared experts are recorded but not yet part of the compared layer: SGLang's Hopper Mega MoE path runs them outside
``fp8_mega_moe`` (its pin refuses ``num_shared_experts > 0`` on SM90); comparing GC-MoE's fused shared expert (role4)
against a separate shared-expert GEMM is bench/sglang_sequence_sm90.py's today, not this tool's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gc_moe_compat import config

__all__ = ["DEFAULT_EP_SIZE", "PRESET_NAMES", "Workload", "explicit", "from_hf_config", "preset"]

DEFAULT_EP_SIZE = 8
"""The deployment's expert-parallel size when none is given (the paper's EP8)."""

# HuggingFace config field names per quantity, first match wins. "intermediate_size" is the dense MLP's width in
# DeepSeek/GLM/Qwen configs, so it counts as the expert width only where no MoE-specific field exists (Mixtral).
_FIELDS: Mapping[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "d_model", "dim"),
    "intermediate": ("moe_intermediate_size", "expert_intermediate_size", "moe_inter_dim", "moe_ffn_hidden_size"),
    "experts": ("n_routed_experts", "num_routed_experts", "num_experts", "num_local_experts", "moe_num_experts",
                "n_experts"),
    "topk": ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "n_activated_experts", "top_k"),
    "shared": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    "scaling": ("routed_scaling_factor", "route_scale"),
    "clamp": ("swiglu_limit", "swiglu_clamp_limit", "activation_clamp"),
}
_DENSE_INTERMEDIATE = "intermediate_size"
_SHARED_WIDTH = "shared_expert_intermediate_size"  # Qwen2-MoE style: one shared expert of its own width
_NESTED = ("text_config", "language_config", "llm_config")


@dataclass(frozen=True)
class Workload:
    """One MoE layer as deployed: the model's global routed-expert count over ``ep_size`` ranks, per-rank capacity.

    ``fields`` records where each value came from (a config field name, ``preset:<name>`` or ``argument``)."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    ep_size: int = DEFAULT_EP_SIZE
    shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    activation_clamp: float | None = None
    capacity: int = 256
    fields: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for arg in ("hidden", "intermediate", "num_experts", "topk", "ep_size", "capacity"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self._source(arg)}: must be a positive int, got {value!r}")
        if isinstance(self.shared_experts, bool) or not isinstance(self.shared_experts, int) or self.shared_experts < 0:
            raise ValueError(f"{self._source('shared_experts')}: must be an int >= 0, got {self.shared_experts!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"ep_size: must divide the model's {self.num_experts} routed experts (one rank holds "
                             f"E/ep_size of them), got {self.ep_size}")
        if not math.isfinite(self.routed_scaling_factor):
            raise ValueError(f"{self._source('routed_scaling_factor')}: must be finite, got "
                             f"{self.routed_scaling_factor}")
        if self.activation_clamp is not None and not (math.isfinite(self.activation_clamp)
                                                      and self.activation_clamp > 0):
            raise ValueError(f"{self._source('activation_clamp')}: must be a positive finite float or None, got "
                             f"{self.activation_clamp}")

    def _source(self, arg: str) -> str:
        origin = self.fields.get(arg)
        return f"{arg} ({origin})" if origin else arg

    @property
    def local_experts(self) -> int:
        """Experts one rank of the deployment holds, ``e = E/ep_size``."""
        return self.num_experts // self.ep_size

    def shape(self, world_size: int, mma_type: str = "fp8xfp8") -> config.MoEShape:
        """The operator's shape for a run on ``world_size`` ranks at the deployment's per-rank share: ``E = e·W``.

        Raises the operator's ``ValueError`` / ``TypeError`` (argument, rule, reason, value) prefixed with this
        workload's name where the shape lies outside what the operator runs."""
        try:
            return config.MoEShape(num_experts=self.local_experts * world_size, num_ranks=world_size,
                                   hidden=self.hidden, intermediate=self.intermediate, topk=self.topk,
                                   num_shared_experts=0, capacity=self.capacity, mma_type=mma_type)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{self.name} at {world_size} rank(s), {mma_type}: {exc}") from exc

    def describe(self) -> dict[str, object]:
        """The workload as the result file records it."""
        return {"name": self.name, "hidden": self.hidden, "intermediate": self.intermediate,
                "num_experts": self.num_experts, "topk": self.topk, "ep_size": self.ep_size,
                "local_experts": self.local_experts, "shared_experts": self.shared_experts,
                "shared_experts_in_layer": False, "routed_scaling_factor": self.routed_scaling_factor,
                "activation_clamp": self.activation_clamp, "capacity": self.capacity, "fields": dict(self.fields)}


PRESET_NAMES = tuple(n for n in config.PRESETS if n != "tiny")
"""The presets a run can name: :data:`config.PRESETS` without the test preset."""


def preset(name: str, ep_size: int | None = None, capacity: int = 256) -> Workload:
    """A named workload: presets are per rank (``e`` local experts; ``E = e·ep_size``); ``ep_size`` defaults to
    :data:`DEFAULT_EP_SIZE`."""
    ep = DEFAULT_EP_SIZE if ep_size is None else ep_size
    if name not in PRESET_NAMES:
        raise ValueError(f"preset: must be one of {list(PRESET_NAMES)}, got {name!r}")
    p = config.PRESETS[name]
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep_size: must be a positive int, got {ep!r}")
    return Workload(name, p.hidden, p.intermediate, p.local_experts * ep, p.topk, ep, p.shared_experts,
                    p.routed_scaling_factor, p.activation_clamp, capacity, {"source": f"preset:{name}"})


def explicit(hidden: int, intermediate: int, experts: int, topk: int, *, ep_size: int | None = None,
             shared_experts: int = 0, routed_scaling_factor: float = 1.0, activation_clamp: float | None = None,
             capacity: int = 256) -> Workload:
    """A workload from explicit sizes (``experts`` is the model's global routed-expert count)."""
    name = f"H{hidden}-I{intermediate}-E{experts}-k{topk}"
    return Workload(name, hidden, intermediate, experts, topk, DEFAULT_EP_SIZE if ep_size is None else ep_size,
                    shared_experts, routed_scaling_factor, activation_clamp, capacity, {"source": "argument"})


def _moe_section(cfg: Mapping[str, object]) -> Mapping[str, object]:
    """The mapping that holds the MoE fields: ``cfg`` itself or its nested language-model config."""
    if any(name in cfg for name in _FIELDS["experts"]):
        return cfg
    for key in _NESTED:
        if isinstance(cfg.get(key), Mapping):
            return _moe_section(cfg[key])
    return cfg


def _pick(cfg: Mapping[str, object], what: str, path: str, required: bool) -> tuple[str | None, object]:
    for name in _FIELDS[what]:
        if cfg.get(name) is not None:
            return name, cfg[name]
    if required:
        raise ValueError(f"{path}: no {what} field: looked for {list(_FIELDS[what])}")
    return None, None


def _refuse_dense(moe: Mapping[str, object], cfg: Mapping[str, object], path: str) -> None:
    """``ValueError`` naming a dense (non-MoE) model as such: no routed-expert count (or fewer than two experts)
    and no top-k field. A config with only one of them is an MoE config missing a field (:func:`_pick` names it)."""
    experts = next((moe[n] for n in _FIELDS["experts"] if moe.get(n) is not None), None)
    topk = next((moe[n] for n in _FIELDS["topk"] if moe.get(n) is not None), None)
    few = isinstance(experts, int) and not isinstance(experts, bool) and experts < 2
    if (experts is None and topk is None) or few:
        model = cfg.get("model_type") or moe.get("model_type") or "unknown model_type"
        raise ValueError(f"{path}: a dense model ({model}): it has no routed experts (looked for "
                         f"{list(_FIELDS['experts'])}{'' if experts is None else f', found {experts}'}); gc-moe-ab "
                         "compares Mixture-of-Experts layers only")


def _int(path: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: {name} must be an integer, got {value!r}")
    return value


def from_hf_config(source: str | Path | Mapping[str, object], ep_size: int | None = None,
                   capacity: int = 256) -> Workload:
    """The MoE layer of a HuggingFace ``config.json`` (a path, or the parsed mapping).

    Read fields (first present name wins): hidden (``hidden_size``), expert width (``moe_intermediate_size``; plain
    ``intermediate_size`` only where the config has no MoE-specific width, as in Mixtral), routed experts
    (``n_routed_experts`` / ``num_experts`` / ``num_local_experts``), top-k (``num_experts_per_tok``), shared
    experts (``n_shared_experts``; Qwen2-MoE's ``shared_expert_intermediate_size`` counts as one), routed scaling
    (``routed_scaling_factor``, default 1.0) and the SwiGLU clamp (``swiglu_limit``, default none). Raises
    ``ValueError`` naming the file and the missing or malformed field."""
    if isinstance(source, Mapping):
        path, cfg = "config", source
    else:
        path = str(source)
        try:
            cfg = json.loads(Path(source).read_text())
        except OSError as exc:
            raise ValueError(f"--model-config: cannot read {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"--model-config: {path} is not JSON: {exc}") from exc
        if not isinstance(cfg, Mapping):
            raise ValueError(f"--model-config: {path} must hold a JSON object, got {type(cfg).__name__}")
    moe = _moe_section(cfg)
    _refuse_dense(moe, cfg, path)
    fields: dict[str, str] = {"source": path}
    values: dict[str, object] = {}
    for what in ("hidden", "experts", "topk"):
        name, value = _pick(moe, what, path, required=True)
        fields[what] = name
        values[what] = _int(path, name, value)
    name, value = _pick(moe, "intermediate", path, required=False)
    if name is None:
        if moe.get(_DENSE_INTERMEDIATE) is None:
            raise ValueError(f"{path}: no expert width field: looked for "
                             f"{[*_FIELDS['intermediate'], _DENSE_INTERMEDIATE]}")
        name, value = _DENSE_INTERMEDIATE, moe[_DENSE_INTERMEDIATE]
    fields["intermediate"] = name
    values["intermediate"] = _int(path, name, value)
    name, value = _pick(moe, "shared", path, required=False)
    if name is None and moe.get(_SHARED_WIDTH):
        name, value = _SHARED_WIDTH, 1
    fields["shared_experts"] = name or "default 0"
    shared = 0 if name is None else _int(path, name, value)
    name, value = _pick(moe, "scaling", path, required=False)
    fields["routed_scaling_factor"] = name or "default 1.0"
    scaling = 1.0 if value is None else float(value)
    name, value = _pick(moe, "clamp", path, required=False)
    fields["activation_clamp"] = name or "default none"
    clamp = None if value is None else float(value)
    model = cfg.get("_name_or_path") or moe.get("model_type") or cfg.get("model_type") or Path(path).parent.name
    return Workload(str(model), values["hidden"], values["intermediate"], values["experts"], values["topk"],
                    DEFAULT_EP_SIZE if ep_size is None else ep_size, shared, scaling, clamp, capacity, fields)
