"""One point of the one-rank Mega MoE layer (the facade's SGLang Hopper call, gc-moe-ab's ``facade`` operator) launched
for Nsight Compute: issue 30's serial parts, chiefly the finalize (role3, ``gc_sm90_finalize``), the largest of
them at T = 256 (bench/README.md).

Builds the layer for ``--preset`` (or ``--model-config``) at ``--tokens`` on one rank, runs three warm-up calls (the
first loads the kernels), then ``--calls`` calls between ``cudaProfilerStart`` and ``cudaProfilerStop``, for ``ncu
--profile-from-start off``; the kernels run inside the layer's CUDA graph as in a replay (ncu profiles each kernel
node by itself). It times nothing: the profiler's counters are the output. The output of the last call is checked
against the first's (bit-identical, as every replay of the layer is).

``bash scripts/device_check.sh --profiles-only --ncu-layer glm52:256`` runs it under ncu (the finalize's launches,
its SASS with stall samples per line); by hand: ``ncu --profile-from-start off --kernel-name gc_sm90_finalize
python bench/profile_layer_sm90.py --preset glm52 --tokens 256``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from _common import require_gpus
from cuda.bindings import runtime

from gc_moe_compat.ab import model_config
from gc_moe_compat.ab.inputs import make_tokens, make_weights
from gc_moe_compat.ab.operators import Context, MegaMoeSequence
from gc_moe_compat.runtime.single_rank import single_rank_group

WARMUP_CALLS = 3
"""Calls before the profiled ones (the first loads the kernels)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=model_config.PRESET_NAMES, help="default: glm52")
    source.add_argument("--model-config", type=Path, help="a HuggingFace config.json (gc-moe-ab's option)")
    parser.add_argument("--tokens", type=int, default=256, help="T, tokens on the one rank")
    parser.add_argument("--calls", type=int, default=1, help="calls between cudaProfilerStart and cudaProfilerStop")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.calls < 1:
        parser.error(f"--tokens and --calls must be >= 1, got {args.tokens} and {args.calls}")
    return args


def _profiler(start: bool) -> None:
    err = (runtime.cudaProfilerStart() if start else runtime.cudaProfilerStop())[0]
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaProfiler{'Start' if start else 'Stop'}: {err.name}")


def profile(w: model_config.Workload, tokens: int, calls: int, group: object) -> None:
    """Builds the layer of ``w`` at ``tokens`` on the one-rank ``group``, warms it up and runs ``calls`` calls
    inside the profiler's range; raises where the last call's output differs from the first's."""
    from gc_moe_compat import deep_gemm

    device = torch.device("cuda", torch.cuda.current_device())
    weights = make_weights(w.local_experts, w.hidden, w.intermediate, 0, ("fp8_block128",), device)
    ctx = Context(group, w, 1, 0, weights, device)
    layer = MegaMoeSequence(deep_gemm, ctx)
    try:
        layer.stage(make_tokens(tokens, ctx.shape("fp8xfp8").num_experts, w.topk, w.hidden, 0, 1,
                                w.routed_scaling_factor, device))
        first = layer.run().clone()
        for _ in range(WARMUP_CALLS - 1):
            layer.run()
        torch.cuda.synchronize()
        _profiler(True)
        for _ in range(calls):
            last = layer.run()
        torch.cuda.synchronize()
        _profiler(False)
        layer.check(f"profile_layer_sm90 {w.name} T={tokens}")
        if not torch.equal(first, last):
            raise RuntimeError(f"{w.name} T={tokens}: the profiled call's output differs from the first call's")
    finally:
        layer.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    require_gpus("bench/profile_layer_sm90.py")
    w = (model_config.preset(args.preset or "glm52") if args.model_config is None
         else model_config.from_hf_config(args.model_config))
    with single_rank_group() as group:
        profile(w, args.tokens, args.calls, group)
    print(f"profile_layer_sm90: {w.name} T={args.tokens}, {args.calls} profiled call(s), output bit-identical to the "
          "first call's")


if __name__ == "__main__":
    main()
