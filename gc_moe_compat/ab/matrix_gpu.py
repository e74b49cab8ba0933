"""The GPU cells of the compatibility matrix (:mod:`.matrix`): the layer through each entry point, and the originals'
own test suites.

``layer`` cells: entry point x ``mma_type`` x shared experts x scale format x T (0, 1, odd, capacity) x world
size, on a small shape (H 512, I 256, 4 experts per rank, top-2, capacity 64), every operand seeded
(:mod:`.inputs`) and each output compared with the quantization-faithful reference (cosine >= 0.9999, processed
diff <= 1e-4, no NaN/Inf). A combination the facade refuses at setup or validation (``NotImplementedError``, or
the ``ValueError`` / ``TypeError`` naming the argument, before any launch) is ``not supported`` with that message;
an error at or after the launch, or wrong numbers, is ``fail``. The two-rank cells belong to the multi-GPU runs.

``suite`` cells: DeepEP's ``tests/legacy`` (through ``scripts/run_deepep_legacy_tests.sh``), DeepGEMM's
``tests/test_mega_moe.py`` and the SM90 Mega MoE tests of sgl-project/DeepGEMM, each file unmodified under
``GC_MOE_SWAP``, from the checkouts the user names; the cell is the file's exit status with the tail of its log.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gc_moe_compat.ab import inputs, model_config, operators, prebuild
from gc_moe_compat.ab.cells import Cell
from gc_moe_compat.ab.protocol import REPO
from gc_moe_compat.ab.results import COSINE_FAITHFUL, PROCESSED_FAITHFUL
from gc_moe_compat.compute_paths import MMA_TYPES, compute_path

__all__ = ["LAYER_TOKENS", "SUITES", "layer_cells", "suite_cells"]

SHAPE = {"hidden": 512, "intermediate": 256, "experts": 4, "topk": 2, "capacity": 64}
LAYER_TOKENS = (0, 1, 7, SHAPE["capacity"])
CLAMP, SCALING = 10.0, 2.5
SETUP_ERRORS = (NotImplementedError, ValueError, TypeError)
SUITES = ("DeepEP tests/legacy", "DeepGEMM tests", "sgl-project/DeepGEMM SM90 tests")
"""The originals' test suites :func:`suite_cells` runs (the entry of their cells)."""


def _group() -> object:
    """An NCCL group of one rank (the facades and the originals allocate through it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD


class _Native:
    """The native API (``fp8_fp8_gc_moe`` / ``fp8_fp4_gc_moe``), optionally with the fused shared expert."""

    def __init__(self, ctx: operators.Context, mma_type: str, shared: tuple[object, object] | None) -> None:
        from gc_moe_compat.operator import api

        self.api, self.ctx, self.mma = api, ctx, mma_type
        w = ctx.workload
        self.buf = api.get_symm_buffer_for_gc_moe(ctx.group, w.local_experts, w.capacity, w.topk, w.hidden,
                                                  w.intermediate, mma_type, int(shared is not None))
        l1, l2 = ctx.weights[compute_path(mma_type).weight_format]
        self.w1, self.w2 = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales),
                                                            mma_type)
        self.shared = {} if shared is None else {
            "shared_l1_weights": (shared[0].payload, shared[0].scales),
            "shared_l2_weights": (shared[1].payload, shared[1].scales)}

    def run(self, tokens: inputs.Tokens) -> torch.Tensor:
        from gc_moe_compat.testing.operator_workload import stage

        stage(self.buf, tokens.staged)
        y = torch.zeros(tokens.count, self.ctx.workload.hidden, dtype=torch.bfloat16, device=self.ctx.device)
        call = getattr(self.api, compute_path(self.mma).native_fn)
        call(y, self.w1, self.w2, self.buf, activation_clamp=CLAMP, **self.shared)
        return y

    def close(self) -> None:
        self.buf.destroy()


class _Facade:
    """SGLang's Hopper sequence on the ``deep_gemm`` facade (:class:`operators.MegaMoeSequence`)."""

    def __init__(self, ctx: operators.Context, mma_type: str, buffer_mma_type: str, shared: int) -> None:
        from gc_moe_compat import deep_gemm

        self.seq = operators.MegaMoeSequence(deep_gemm, ctx, mma_type=mma_type, buffer_mma_type=buffer_mma_type,
                                             num_shared_experts=shared)

    def run(self, tokens: inputs.Tokens) -> torch.Tensor:
        self.seq.stage(tokens)
        self.seq.run()
        torch.cuda.synchronize()
        return self.seq.tokens.y  # max(T, 1) rows: with T = 0 one padded row, which must come back zero

    def close(self) -> None:
        self.seq.close()


def _case(axes: dict[str, object], tokens: object, world: int = 1) -> str:
    """A layer cell's row label: every axis of the combination."""
    return (f"{axes['mma_type']}, buffer {axes['buffer_mma_type']}, shared {axes['shared']}, {axes['scale_format']}, "
            f"T={tokens}, world {world}")


def _verdict(y: torch.Tensor, ref: torch.Tensor, tokens: int) -> tuple[str, str]:
    from gc_moe_compat.testing.reference import accuracy_metrics

    if y.shape[0] > tokens:  # the facade's padded row of T = 0
        pad = y[tokens:]
        if not bool((pad.float() == 0).all()):
            return "fail", f"the padded row past T={tokens} is not zero (max |y| {float(pad.float().abs().max())})"
        y = y[:tokens]
    m = accuracy_metrics(y.float(), ref.float())
    ok = m["cosine"] >= COSINE_FAITHFUL and m["processed_diff"] <= PROCESSED_FAITHFUL and m["nonfinite"] == 0
    detail = (f"cosine {m['cosine']:.6f}, processed diff {m['processed_diff']:.2e}, max abs {m['max_abs_err']:.3g}, "
              f"nonfinite {m['nonfinite']}")
    if not ok:
        detail = f"assert cosine >= {COSINE_FAITHFUL} and processed diff <= {PROCESSED_FAITHFUL}: {detail}"
    return ("pass" if ok else "fail"), detail


def _reference(tokens: inputs.Tokens, weights: tuple[object, object], shared: tuple[object, object] | None,
               fmt: str) -> torch.Tensor:
    from gc_moe_compat.testing.operator_workload import INTERMEDIATE_QUANT
    from gc_moe_compat.testing.reference import expert_parallel_reference

    s = tokens.staged
    return expert_parallel_reference([(s.x, s.x_sf)], [s.topk_idx], [s.topk_weights], [weights[0]], [weights[1]],
                                     shared=shared, activation_clamp=CLAMP,
                                     intermediate_quant=INTERMEDIATE_QUANT[fmt])[0].y


def _entries() -> list[tuple[str, dict[str, object], Callable[..., object]]]:
    """(entry point, axes, builder(ctx, shared weights)) of every layer combination."""
    out = []
    for buffer_mma in MMA_TYPES:
        for shared in (0, 1):
            out.append(("deep_gemm.mega_moe_pre_dispatch_sm90 + fp8_mega_moe",
                        {"mma_type": "fp8xfp8", "buffer_mma_type": buffer_mma, "shared": shared,
                         "scale_format": "FP8 128x128 blocks; x FP32 1x128"},
                        lambda ctx, sw, b=buffer_mma, s=shared: _Facade(ctx, "fp8xfp8", b, s)))
    out.append(("deep_gemm.mega_moe_pre_dispatch_sm90 + fp8_fp4_mega_moe",
                {"mma_type": "fp8xfp4", "buffer_mma_type": "fp8xfp4", "shared": 0,
                 "scale_format": "MXFP4 UE8M0 K32; x FP32 1x128"},
                lambda ctx, sw: _Facade(ctx, "fp8xfp4", "fp8xfp4", 0)))
    for mma, fmt in (("fp8xfp8", "FP8 128x128 blocks"), ("fp8xfp4", "MXFP4 UE8M0 K32")):
        for shared in (0, 1):
            out.append((f"gc_moe.fp8_{mma[-3:]}_gc_moe",
                        {"mma_type": mma, "buffer_mma_type": mma, "shared": shared,
                         "scale_format": f"{fmt}; x FP32 1x128" + ("; shared FP8 128x128" if shared else "")},
                        lambda ctx, sw, m=mma, s=shared: _Native(ctx, m, sw if s else None)))
    return out


def layer_cells() -> list[Cell]:
    """Every layer combination on this GPU (world size 1), plus the world-size-2 cells as ``not run``."""
    entries = _entries()
    if not torch.cuda.is_available():
        return [Cell("layer", entry, _case(axes, "all"), "not run", "needs a CUDA GPU", axes)
                for entry, axes, _ in entries]
    device = torch.device("cuda", torch.cuda.current_device())
    group = _group()
    nonzero = [t for t in LAYER_TOKENS if t]
    prebuild.prebuild(prebuild.kernel_jobs(MMA_TYPES, nonzero, 1, SHAPE["topk"], SHAPE["experts"]))
    w = model_config.explicit(SHAPE["hidden"], SHAPE["intermediate"], SHAPE["experts"], SHAPE["topk"], ep_size=1,
                              routed_scaling_factor=SCALING, activation_clamp=CLAMP, capacity=SHAPE["capacity"])
    weights = inputs.make_weights(w.local_experts, w.hidden, w.intermediate, 0, inputs.WEIGHT_FORMATS, device)
    shared_w = inputs.make_weights(1, w.hidden, w.intermediate, 1000, ("fp8_block128",), device)["fp8_block128"]
    ctx = operators.Context(group, w, 1, 0, weights, device)
    cells = []
    for entry, axes, build in entries:
        fmt = compute_path(axes["mma_type"]).weight_format
        try:
            runner = build(ctx, shared_w)
        except SETUP_ERRORS as exc:
            cells += [Cell("layer", entry, _case(axes, t), "not supported", f"{type(exc).__name__}: {exc}",
                           {**axes, "tokens": t, "world_size": 1}) for t in LAYER_TOKENS]
            continue
        except Exception as exc:  # noqa: BLE001 - a setup failure of a supported combination
            cells += [Cell("layer", entry, _case(axes, t), "fail", f"setup: {type(exc).__name__}: {exc}",
                           {**axes, "tokens": t, "world_size": 1}) for t in LAYER_TOKENS]
            continue
        for t in LAYER_TOKENS:
            cell_axes = {**axes, "tokens": t, "world_size": 1}
            tokens = inputs.make_tokens(t, w.local_experts, w.topk, w.hidden, 0, 1, SCALING, device)
            try:
                y = runner.run(tokens)
                torch.cuda.synchronize()
                ref = _reference(tokens, weights[fmt], shared_w if axes["shared"] else None, fmt)
                result, detail = _verdict(y, ref, t)
            except SETUP_ERRORS as exc:
                result, detail = "not supported", f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - the cell records it
                result, detail = "fail", f"{type(exc).__name__}: {exc}"
            cells.append(Cell("layer", entry, _case(axes, t), result, detail, cell_axes))
        runner.close()
        torch.cuda.synchronize()
    gpus = torch.cuda.device_count()
    cells += [Cell("layer", entry, _case(axes, "all", world=2), "not run",
                   "the matrix runs one rank; the two-rank layer (2 GPUs on one host) is the tests marked "
                   f"multigpu; {gpus} GPU(s) here",
                   {**axes, "world_size": 2}) for entry, axes, _ in entries]
    return cells


def _run_file(kind_entry: str, case: str, cmd: Sequence[str], cwd: Path, env: dict[str, str],
              timeout: int) -> Cell:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return Cell("suite", kind_entry, case, "fail", f"timed out after {timeout} s")
    tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
    return Cell("suite", kind_entry, case, "pass" if proc.returncode == 0 else "fail",
                f"rc={proc.returncode}: {tail[-600:]}")


def suite_cells(deepep: Path | None, deepgemm: Path | None, sgl_deepgemm: Path | None, timeout: int) -> list[Cell]:
    """The originals' test files, unmodified, under the swap (one cell per file); ``not run`` without a checkout."""
    cells = []
    if deepep is None:
        cells.append(Cell("suite", SUITES[0], "-", "not run", "no checkout given (--deepep-src)"))
    else:
        logs = Path(os.environ.get("OUT", "/tmp")) / "matrix_deepep_legacy"
        proc = subprocess.run(["bash", str(REPO / "scripts" / "run_deepep_legacy_tests.sh"), "--deepep", str(deepep),
                               "--logs", str(logs), "--timeout", str(timeout)], capture_output=True, text=True,
                              check=False)
        verdicts = re.findall(r"^(PASS|FAIL) (\S+) rc=(-?\d+) \((.*)\)$", proc.stdout, flags=re.M)
        if not verdicts:
            cells.append(Cell("suite", SUITES[0], "-", "fail", f"rc={proc.returncode}: "
                              f"{(proc.stdout + proc.stderr)[-600:]}"))
        for verdict, test, rc, log in verdicts:
            tail = " / ".join(Path(log).read_text(errors="replace").strip().splitlines()[-4:]) if Path(
                log).is_file() else ""
            cells.append(Cell("suite", SUITES[0], test, "pass" if verdict == "PASS" else "fail",
                              f"rc={rc} (GC_MOE_SWAP=deep_ep, --num-processes 1): {tail[-500:]}"))
    env = dict(os.environ, GC_MOE_SWAP="deep_gemm", PYTHONUNBUFFERED="1")
    for name, root, pattern, flag in ((SUITES[1], deepgemm, "test_mega_moe.py", "--deepgemm-src"),
                                      (SUITES[2], sgl_deepgemm, "test_mega_moe_hopper.py", "--sgl-deepgemm-src")):
        if root is None:
            cells.append(Cell("suite", name, "-", "not run", f"no checkout given ({flag})"))
            continue
        files = sorted((root / "tests").glob(pattern))
        if not files:
            cells.append(Cell("suite", name, pattern, "fail", f"no tests/{pattern} under {root}"))
        for f in files:
            cells.append(_run_file(name, f.name, [sys.executable, str(f)], f.parent, env, timeout))
    return cells
