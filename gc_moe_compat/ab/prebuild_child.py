"""One child process of :func:`gc_moe_compat.ab.prebuild.prebuild_originals`: builds each runnable original
operator of the workload (``gc-moe-ab``'s own arguments) on zero weights, as the run does, and calls it once at the
``--tokens`` value, so that the originals JIT-compile that point's kernels into their caches."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gc_moe_compat.ab.prebuild import ORIGINAL_OPS

__all__ = ["main"]


def _zero_weights(local_experts: int, hidden: int, intermediate: int, device: object) -> object:
    """FP8 128x128-block experts of zeros (unit scales): the shapes the originals compile for, nothing to compute."""
    import torch

    from gc_moe_compat.ab.inputs import LayerWeights
    from gc_moe_compat.references.reference import ExpertWeights

    def one(n: int, k: int) -> ExpertWeights:
        payload = torch.zeros(local_experts, n, k, dtype=torch.float8_e4m3fn, device=device)
        scales = torch.ones(local_experts, n // 128, k // 128, dtype=torch.float32, device=device)
        return ExpertWeights("fp8_block128", payload, scales)

    return LayerWeights({"fp8_block128": (one(2 * intermediate, hidden), one(hidden, intermediate))})


def main(argv: Sequence[str] | None = None) -> int:
    """Build each runnable original operator of the workload on zero weights as the run does and call it once at
    the (single) ``--tokens`` value; 2 for a workload outside the operator's constraints (nothing allocated)."""
    import torch

    from gc_moe_compat.ab import cli, operators
    from gc_moe_compat.ab.inputs import make_tokens
    from gc_moe_compat.ab.run import Ranks

    argv = list(sys.argv[1:] if argv is None else argv)
    args, w, problems = cli.parse(argv)
    if problems:
        print(f"prebuild: constraint: {problems}", file=sys.stderr)
        return 2
    specs = [s for s in operators.select(args.ops, args.partition_sweep) if s.name in ORIGINAL_OPS]
    if (args.world_size or 1) > 1:  # one rank here would pick the one-rank configurations: leave it to the run
        print("prebuild: originals are prebuilt for one-GPU runs only; the run compiles them at first use")
        return 0
    ranks = Ranks()
    shape = w.shape(ranks.world, "fp8xfp8")
    ctx = operators.Context(ranks.group, w, ranks.world, ranks.rank,
                            _zero_weights(w.local_experts, w.hidden, w.intermediate, ranks.device), ranks.device)
    code = 0
    for t in args.tokens:
        tokens = make_tokens(t, shape.num_experts, w.topk, w.hidden, ranks.rank, ranks.world,
                             w.routed_scaling_factor, ranks.device)
        for spec in specs:
            if spec.probe() is not None:
                continue
            try:
                runner = spec.build(ctx)
                runner.stage(tokens)
                runner.run()
                torch.cuda.synchronize()
                runner.close()
            except Exception as exc:  # noqa: BLE001 - reported; the timed run reports its own error
                print(f"prebuild: {spec.name} T={t}: {type(exc).__name__}: {exc}", file=sys.stderr)
                code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # FACTS.md: destroy_process_group() after NCCL use can hang at exit


if __name__ == "__main__":
    sys.exit(main())
