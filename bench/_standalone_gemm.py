"""The standalone SM90 expert GEMMs' harness (the GEMM tests' and benchmarks', not shipped): weights prepared for the
kernels, variants compiled, W1 -> W2 launched.

:class:`ExpertGemmSM90` runs the grouped W1 GEMM with the fused SwiGLU / routing-weight / requantization epilogue,
then the grouped W2 GEMM writing BF16 partial rows, on one stream: the role2 kernels' standalone variants
(``GC_OPERATOR`` unset; the operator runs them over its token ring, :mod:`gc_moe_compat.operator.sm90.role2_gemm`),
for both weight formats:

* ``fp8xfp8`` (:func:`prepare_fp8_weights`, kernels/sm90/role2_gemm_fp8xfp8.cu): FP8 weights with FP32 128x128 block
  scales, FP32 1x128 intermediate requant.
* ``fp8xfp4`` (:func:`prepare_fp4_weights`, kernels/sm90/role2_gemm_fp8xfp4.cu): MXFP4 weights window-repacked
  and lane-permuted (:mod:`gc_moe_compat.operator.sm90.fp4_layout`), decoded to E4M3 in registers for register-A WGMMA;
  UE8M0 1x128 intermediate requant (a power-of-two scale per token and 128 columns, so that W2 promotes once per
  K128 step as W1 does; per-32 groups cost W2 a promotion per K32 MMA).

Activations are E4M3 with FP32 1x128 scales in both (the Hopper path's input format).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
from _grouping import GroupedTokens
from _standalone_heuristics import KernelConfig, max_stages, w2_slabs

from gc_moe_compat.compute_paths import FP8XFP4, FP8XFP8, compute_path
from gc_moe_compat.layouts import interleave_gate_up
from gc_moe_compat.operator.heuristics import (
    BLOCK_M_CANDIDATES,
    W1_SLABS,
    W2_SLABS,
    smem_bytes,
    tile_rows,
)
from gc_moe_compat.operator.sm90.fp4_layout import UNIT_ROWS, permute_units
from gc_moe_compat.operator.weights import transform_weights_for_gc_moe
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.launch import launch, max_active_clusters
from gc_moe_compat.runtime.params import ptr
from gc_moe_compat.runtime.status import new_status, raise_for_status, spin_timeout_ns
from gc_moe_compat.runtime.tensormap import encode_2d
from gc_moe_compat.testing.reference import ExpertWeights

EPI_W1, EPI_W2 = 1, 2
_PREP_CHUNK = 8  # experts per window-repack / permutation chunk in prepare_fp4_weights
SITES = {1: "dynamic shared memory below the variant's need", 2: "producer wait for a free stage", 3: "consumer wait"}


def variant_defines(
    bm: int, epi: int, pipelined: bool, stages: int, fast_math: bool = True, slabs: int = W2_SLABS,
    cluster: bool = False,
) -> dict[str, int]:
    """Compile-time parameters of one kernel variant (``slabs``: 64-row slabs per consumer warpgroup of a W2 task;
    W1 tasks always have :data:`W1_SLABS`; ``cluster``: cluster pairs, GC_CLUSTER, named only where set so that the
    other variants keep their defines)."""
    defines = {
        "GC_BM": bm,
        "GC_EPI": epi,
        "GC_M_SUB": W1_SLABS if epi == EPI_W1 else slabs,
        "GC_PRODUCER_WG": int(pipelined),
        "GC_STAGES": stages,
        "GC_FAST_MATH": int(fast_math),
    }
    return defines | ({"GC_CLUSTER": 1} if cluster else {})


def all_variants(mma_type: str = "fp8xfp8") -> list[dict[str, int]]:
    """Every variant of the ``mma_type`` kernel the heuristic can pick (both epilogues, every BM, both thread
    layouts, default stages, W2 tasks as :func:`_standalone_heuristics.w2_slabs` picks them)."""
    out = []
    for bm in BLOCK_M_CANDIDATES:
        for pipelined in (True, False):
            out.append(variant_defines(bm, EPI_W1, pipelined, max_stages(bm, W1_SLABS, mma_type)))
            slabs = w2_slabs(bm, mma_type)
            out.append(variant_defines(bm, EPI_W2, pipelined, max_stages(bm, slabs, mma_type), slabs=slabs))
    # Cluster pairs: where BM caps at 64 (_standalone_heuristics.cluster_pairs), pipelined; FP8xFP8 W2 in 128- or
    # 256-row tasks (256 where 256 divides H: select_config), FP8xFP4 W2 always in 256-row tasks (w2_slabs).
    bm = BLOCK_M_CANDIDATES[-1]
    out.append(variant_defines(bm, EPI_W1, True, max_stages(bm, W1_SLABS, mma_type), cluster=True))
    for slabs in (w2_slabs(bm, mma_type),) if compute_path(mma_type).fp4 else (W2_SLABS, 2):
        out.append(variant_defines(bm, EPI_W2, True, max_stages(bm, slabs, mma_type), slabs=slabs, cluster=True))
    return out


def recorded_variants(mma_type: str = "fp8xfp8") -> list[dict[str, int]]:
    """The standalone variants whose cubin hashes tests/data/sm90_*_standalone_cubins.json records (every
    :func:`all_variants` one, plus the first two without fast math): tests/operator/test_role2_operator_host.py checks
    them,
    scripts/record_sm90_cubins.py rewrites them after a deliberate kernel change."""
    variants = all_variants(mma_type)
    return variants + [{**d, "GC_FAST_MATH": 0} for d in variants[:2]]


@dataclass(frozen=True)
class Fp8Weights:
    """FP8 expert weights as the kernels read them.

    ``w1`` FP8 ``[E * 2I, H]`` with gate/up rows interleaved by 8 per expert; ``w1_sf`` FP32 ``[E, 2I/128, H/128]``
    in the natural (gate blocks, then up blocks) order: a 256-row W1 task reads gate block ``tile`` and up block
    ``I/128 + tile``, each row's scale looked up by its source row (layouts.interleave_gate_up_block_scales explains
    why the blocks cannot be permuted). ``w2`` FP8 ``[E * H, I]``, ``w2_sf`` FP32 ``[E, H/128, I/128]``.
    """

    w1: torch.Tensor
    w1_sf: torch.Tensor
    w2: torch.Tensor
    w2_sf: torch.Tensor
    num_experts: int
    hidden: int
    inter: int


def prepare_fp8_weights(l1: ExpertWeights, l2: ExpertWeights) -> Fp8Weights:
    """Kernel layout of canonical ``fp8_block128`` weights (L1 ``[E, 2I, H]`` gate rows first, L2 ``[E, H, I]``)."""
    if l1.fmt != "fp8_block128" or l2.fmt != "fp8_block128":
        raise ValueError(f"weights: the FP8xFP8 kernels take fp8_block128, got {l1.fmt} and {l2.fmt}")
    e, two_i, h = l1.payload.shape
    inter = two_i // 2
    if tuple(l2.payload.shape) != (e, h, inter) or inter % 128 or h % 128:
        raise ValueError(
            f"weights: need L1 [E, 2I, H], L2 [E, H, I] with I, H multiples of 128, got "
            f"{tuple(l1.payload.shape)} and {tuple(l2.payload.shape)}"
        )
    w1 = interleave_gate_up(l1.payload).reshape(e * two_i, h).contiguous()
    w2 = l2.payload.reshape(e * h, inter).contiguous()
    return Fp8Weights(w1, l1.scales.float().contiguous(), w2, l2.scales.float().contiguous(), e, h, inter)


@dataclass(frozen=True)
class Fp4Weights:
    """MXFP4 expert weights as the FP8xFP4 kernels read them.

    ``w1`` / ``w2``: uint8 ``[E * K/128 * N/64 * UNIT_ROWS, 128]``, the lane-permuted units of
    :mod:`gc_moe_compat.operator.sm90.fp4_layout` (W1: ``N = 2I`` rows interleaved gate/up by 8, ``K = H``; W2: ``N =
    H``,
    ``K = I``) viewed as 128-byte rows for the TMA; ``w1_factor`` / ``w2_factor``: FP32 ``[E]``, the window
    repack's ``2^base`` per expert (the kernel multiplies by it and by the decoder's x64 headroom once per task).
    """

    w1: torch.Tensor
    w1_factor: torch.Tensor
    w2: torch.Tensor
    w2_factor: torch.Tensor
    num_experts: int
    hidden: int
    inter: int


def prepare_fp4_weights(l1: ExpertWeights, l2: ExpertWeights) -> Fp4Weights:
    """Kernel layout of canonical ``mxfp4`` weights (L1 ``[E, 2I, H]`` gate rows first, L2 ``[E, H, I]``).

    The interleave and the window repack are the native API's (:func:`transform_weights_for_gc_moe`, ``fp8xfp4``);
    this adds the lane permutation into K128 x 64-row units. Only rearranges and re-expresses scales exactly: groups
    inside the window dequantize to the same values (tests/operator/test_gemm_sm90_host.py).
    """
    if l1.fmt != "mxfp4" or l2.fmt != "mxfp4":
        raise ValueError(f"weights: the FP8xFP4 kernels take mxfp4, got {l1.fmt} and {l2.fmt}")
    e, two_i, _ = l1.payload.shape
    units: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    factors: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for start in range(0, e, _PREP_CHUNK):  # the window is per expert: chunks bound the int temporaries
        stop = min(e, start + _PREP_CHUNK)
        l1c, l2c = l1.experts(start, stop), l2.experts(start, stop)
        pair = transform_weights_for_gc_moe((l1c.payload, l1c.scales), (l2c.payload, l2c.scales), "fp8xfp4")
        for i, t in enumerate(pair):
            units[i].append(permute_units(t.payload.view(torch.uint8), t.scales))
            factors[i].append(t.factor)
    w1, w2 = (torch.cat(u, dim=0).reshape(-1, 128) for u in units)
    return Fp4Weights(w1, torch.cat(factors[0]), w2, torch.cat(factors[1]), e, l2.payload.shape[1], two_i // 2)


@dataclass
class Workspace:
    """The intermediate between W1 and W2 and the partial rows: FP8 ``[R, I]``, its FP32 scales ``[I/128, R]``
    (1x128 groups: any FP32 value for fp8xfp8, a power of two, UE8M0, for fp8xfp4), BF16 ``[R, H]``."""

    inter: torch.Tensor
    inter_sf_t: torch.Tensor
    out: torch.Tensor

    @classmethod
    def empty(cls, rows: int, weights: Fp8Weights | Fp4Weights, dev: torch.device) -> Workspace:
        return cls(
            torch.empty(rows, weights.inter, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(weights.inter // 128, rows, dtype=torch.float32, device=dev),
            torch.empty(rows, weights.hidden, dtype=torch.bfloat16, device=dev),
        )


class ExpertGemmSM90:
    """W1 -> W2 of grouped tokens on a stream with one :class:`KernelConfig` (the heuristic's or an explicit one).

    The weights' type picks the kernel (:class:`Fp8Weights`: FP8xFP8, :class:`Fp4Weights`: FP8xFP4).
    ``activation_clamp`` None means no clamp; ``fast_math`` selects ``__expf`` + ``__frcp_rn`` in the sigmoid.
    ``num_sms`` bounds the persistent grid (default: the device's SM count, e.g. a green partition's size).
    """

    def __init__(
        self,
        weights: Fp8Weights | Fp4Weights,
        config: KernelConfig,
        *,
        activation_clamp: float | None = None,
        activation_alpha: float = 1.0,
        fast_math: bool = True,
        num_sms: int | None = None,
    ) -> None:
        if config.cluster and not config.pipelined:
            raise NotImplementedError("cluster pairs: only the pipelined kernels have a cluster variant")
        if weights.hidden % tile_rows(config.w2_slabs):
            raise ValueError(f"config: w2_slabs={config.w2_slabs} needs a hidden size that is a multiple of "
                             f"{tile_rows(config.w2_slabs)}, got {weights.hidden}")
        self.weights, self.config = weights, config
        self.device = weights.w1.device
        ordinal = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.num_sms = num_sms or torch.cuda.get_device_properties(ordinal).multi_processor_count
        self.clamp = math.inf if activation_clamp is None else float(activation_clamp)
        self.alpha = float(activation_alpha)
        self.status = new_status(self.device)
        self.timeout_ns = spin_timeout_ns()
        path = FP8XFP4 if isinstance(weights, Fp4Weights) else FP8XFP8
        self.mma_type = path.name
        source, name = path.kernel, path.standalone_entry
        self._stages = {EPI_W1: config.stages_w1, EPI_W2: config.stages_w2}
        self._slabs = {EPI_W1: W1_SLABS, EPI_W2: config.w2_slabs}
        self._kernels = {}
        for epi in (EPI_W1, EPI_W2):
            defines = variant_defines(config.bm, epi, config.pipelined, self._stages[epi], fast_math,
                                      slabs=config.w2_slabs, cluster=config.cluster)
            self._kernels[epi] = jit.load_kernel(source, defines, name, shared_bytes=self._smem(epi),
                                                 ordinal=ordinal)
        # Cluster pairs: the persistent grid is what the SMs' pairing (GPC layout, partition) holds at once.
        self._clusters = {
            epi: max_active_clusters(k, config.threads, 2, self._smem(epi)) for epi, k in self._kernels.items()
        } if config.cluster else {}
        if config.cluster and min(self._clusters.values()) < 1:
            raise RuntimeError(f"config: cluster pairs, but this device or partition holds no cluster of two CTAs of "
                               f"the variant ({self._clusters}); pick a config with cluster=False")
        halves = 2 if config.cluster else 1  # a cluster pair's CTA loads half a task's weights per box (multicast)
        if isinstance(weights, Fp4Weights):  # a task's slabs of one K step: one box of UNIT_ROWS rows per slab
            self._tm_w1 = encode_2d(weights.w1, 2 * W1_SLABS * UNIT_ROWS // halves, swizzle=False)
            self._tm_w2 = encode_2d(weights.w2, 2 * config.w2_slabs * UNIT_ROWS // halves, swizzle=False)
            self._w_sf = (weights.w1_factor, weights.w2_factor)
        else:
            self._tm_w1 = encode_2d(weights.w1.view(torch.uint8), tile_rows(W1_SLABS) // halves)
            self._tm_w2 = encode_2d(weights.w2.view(torch.uint8), tile_rows(config.w2_slabs) // halves)
            self._w_sf = (weights.w1_sf, weights.w2_sf)

    def _smem(self, epi: int) -> int:
        return smem_bytes(self.config.bm, self._slabs[epi], self._stages[epi], self.mma_type)

    def workspace(self, grouped: GroupedTokens) -> Workspace:
        """Buffers for :meth:`run` on ``grouped`` (allocate once to replay the launches in a graph)."""
        return Workspace.empty(grouped.rows, self.weights, self.device)

    def _launch(
        self,
        epi: int,
        tm_x: ctypes.Array,
        w_sf: torch.Tensor,
        x_sf_t: torch.Tensor,
        grouped: GroupedTokens,
        out: torch.Tensor,
        out_sf_t: torch.Tensor,
        n_w: int,
        k: int,
        stream: int,
    ) -> None:
        tiles = n_w // tile_rows(self._slabs[epi])
        args = [
            self._tm_w1 if epi == EPI_W1 else self._tm_w2,
            tm_x,
            ptr(w_sf),
            ptr(x_sf_t),
            ptr(grouped.pair_blocks if self.config.cluster else grouped.blocks),
            ptr(grouped.num_blocks),
            ptr(grouped.routing_w),
            ptr(out),
            ptr(out_sf_t),
            ctypes.c_int32(n_w),
            ctypes.c_int32(k),
            ctypes.c_int32(grouped.rows),
            ctypes.c_float(self.clamp),
            ctypes.c_float(self.alpha),
            ptr(self.status),
            ctypes.c_uint64(self.timeout_ns),
        ]
        if self.config.cluster:  # one pair task per (tile, two table rows), two CTAs each
            clusters = min(tiles * -(-grouped.blocks.shape[0] // 2), self._clusters[epi], self.num_sms // 2)
            grid, cluster = 2 * clusters, 2
        else:
            grid, cluster = min(grouped.blocks.shape[0] * tiles, self.num_sms), 1
        launch(self._kernels[epi], grid, self.config.threads, args, stream, self._smem(epi), cluster=cluster)

    def run(self, grouped: GroupedTokens, ws: Workspace | None = None, stream: int | None = None) -> Workspace:
        """Launches W1 then W2 on ``stream`` (default: torch's current stream); returns the workspace (``ws.out``)."""
        ws = self.run_w1(grouped, ws, stream)
        return self.run_w2(grouped, ws, stream)

    def _prepare(self, grouped: GroupedTokens, ws: Workspace | None, stream: int | None) -> tuple[Workspace, int]:
        if grouped.bm != self.config.bm:
            raise ValueError(f"grouped: built with bm={grouped.bm}, this runner's variant has bm={self.config.bm}")
        if grouped.x.shape[1] != self.weights.hidden:
            raise ValueError(f"grouped: hidden size {grouped.x.shape[1]} != weights' {self.weights.hidden}")
        ws = ws or self.workspace(grouped)
        return ws, torch.cuda.current_stream(self.device).cuda_stream if stream is None else stream

    def run_w1(self, grouped: GroupedTokens, ws: Workspace | None = None, stream: int | None = None) -> Workspace:
        """Launches W1 alone (``ws.inter`` and its scales): :meth:`run`'s first half, timed apart by the benchmark."""
        ws, stream = self._prepare(grouped, ws, stream)
        w = self.weights
        self._launch(EPI_W1, encode_2d(grouped.x.view(torch.uint8), grouped.bm), self._w_sf[0], grouped.x_sf_t,
                     grouped, ws.inter, ws.inter_sf_t, 2 * w.inter, w.hidden, stream)
        return ws

    def run_w2(self, grouped: GroupedTokens, ws: Workspace, stream: int | None = None) -> Workspace:
        """Launches W2 alone on the intermediate that :meth:`run_w1` left in ``ws``; returns ``ws`` (``ws.out``)."""
        ws, stream = self._prepare(grouped, ws, stream)
        w = self.weights
        self._launch(EPI_W2, encode_2d(ws.inter.view(torch.uint8), grouped.bm), self._w_sf[1], ws.inter_sf_t,
                     grouped, ws.out, ws.inter_sf_t, w.hidden, w.inter, stream)
        return ws

    def check(self) -> None:
        """Raises if a launch recorded a device error (timeout or shared-memory mismatch); synchronizes."""
        raise_for_status(self.status, "SM90 expert GEMM", SITES)
