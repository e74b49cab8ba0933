"""The GPU cells of the compatibility matrix (:mod:`.matrix`): the layer through each entry point, and the originals'
own test suites.

``layer`` cells: entry point x ``mma_type`` x shared experts x scale format x T (0, 1, odd, capacity; per rank) x
world size (1 and 2), on a small shape (H 512, I 256, 4 experts per rank, top-2, capacity 64), every operand seeded
(:mod:`.inputs`) and each rank's output compared with the quantization-faithful reference of its tokens (cosine
>= 0.9999, processed diff <= 1e-4, no NaN/Inf). A combination the facade refuses at setup or validation
(``NotImplementedError``, or the ``ValueError`` / ``TypeError`` naming the argument, before any launch) is
``not supported`` with that message; an error at or after the launch, or wrong numbers, is ``fail``.

One code path serves both world sizes (:func:`layer_outcomes`, run by every rank of a group): world size 1 runs in
the matrix process on an NCCL group of one; world size 2 runs as two processes of :mod:`.matrix_rank` that the
matrix starts (:func:`two_rank_cells`) with a deadline, one GPU each on a host with two or more, or both on one GPU
under CUDA MPS with ``--shared-gpu`` (gloo host group, :func:`gc_moe_compat.runtime.colocation.init_rank_group`).
Each rank reports its outcome per cell; :func:`merge_ranks` makes one cell of them: ``pass`` only when every rank
passes (the detail names the placement and each rank's metrics, the worst rank first), ``fail`` naming the rank
that failed, timed out or reported nothing. Where two ranks cannot run (no GPU; one GPU without ``--shared-gpu``;
``--shared-gpu`` without MPS serving the GPU, where two spinning ranks would hang) the world-size-2 cells are
``not run`` with the reason and the flag to pass (:func:`two_rank_reason`).

``suite`` cells: DeepEP's ``tests/legacy`` (through ``scripts/run_deepep_legacy_tests.sh``), DeepGEMM's
``tests/test_mega_moe.py`` and the SM90 Mega MoE tests of sgl-project/DeepGEMM, each file unmodified under
``GC_MOE_SWAP``, from the checkouts the user names; the cell is the file's exit status with the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gc_moe_compat.ab import inputs, model_config, operators, prebuild
from gc_moe_compat.ab.cells import Cell
from gc_moe_compat.ab.protocol import MULTICAST_OFF, REPO
from gc_moe_compat.ab.results import COSINE_FAITHFUL, PROCESSED_FAITHFUL
from gc_moe_compat.compute_paths import MMA_TYPES, compute_path

__all__ = ["LAYER_TOKENS", "SUITES", "TWO_RANK_TIMEOUT_S", "Outcome", "case_label", "layer_cells", "layer_outcomes",
           "merge_ranks", "placement_text", "suite_cells", "two_rank_cells", "two_rank_reason"]

SHAPE = {"hidden": 512, "intermediate": 256, "experts": 4, "topk": 2, "capacity": 64}
"""The layer of every cell; ``experts`` per rank (a world-size-2 cell's layer has twice as many)."""
LAYER_TOKENS = (0, 1, 7, SHAPE["capacity"])
"""The token counts of the cells, per rank."""
CLAMP, SCALING = 10.0, 2.5
SETUP_ERRORS = (NotImplementedError, ValueError, TypeError)
SUITES = ("DeepEP tests/legacy", "DeepGEMM tests", "sgl-project/DeepGEMM SM90 tests")
"""The originals' test suites :func:`suite_cells` runs (the entry of their cells)."""
TWO_RANKS = 2
TWO_RANK_TIMEOUT_S = 600
"""Default deadline (seconds) of the two rank processes of the world-size-2 cells; past it they are stopped and the
cells they did not report fail."""
PEER_GRACE_S = 60
"""How long a rank may still run after its peer exited with an error (it may be waiting for that peer) before it is
stopped."""
SHARED_GPU_HOWTO = ("gc-moe-ab matrix --shared-gpu, with CUDA MPS started first: `source scripts/mps.sh; "
                    "mps_start`")
"""How a user runs the world-size-2 cells on one GPU (named by the cells that could not run)."""


@dataclass(frozen=True)
class Outcome:
    """One rank's result of one layer cell: the cell's result and detail, plus the metrics of the comparison (empty
    where no output was compared), by which a world-size-2 cell's detail ranks its ranks."""

    result: str
    detail: str
    metrics: dict[str, float] = field(default_factory=dict)


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
        # the buffer takes the group's expert count: E = (experts per rank) x world size
        self.buf = api.get_symm_buffer_for_gc_moe(ctx.group, ctx.shape(mma_type).num_experts, w.capacity, w.topk,
                                                  w.hidden, w.intermediate, mma_type, int(shared is not None))
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


def case_label(axes: dict[str, object], tokens: object, world: int = 1) -> str:
    """A layer cell's row label: every axis of the combination (the key that pairs the ranks' outcomes of a cell)."""
    return (f"{axes['mma_type']}, buffer {axes['buffer_mma_type']}, shared {axes['shared']}, {axes['scale_format']}, "
            f"T={tokens}, world {world}")


def _verdict(y: torch.Tensor, ref: torch.Tensor, tokens: int) -> Outcome:
    """This rank's ``y`` (``tokens`` rows, plus the facade's padded row at T = 0) against its reference rows."""
    from gc_moe_compat.testing.reference import accuracy_metrics

    if y.shape[0] > tokens:  # the facade's padded row of T = 0
        pad = y[tokens:]
        if not bool((pad.float() == 0).all()):
            return Outcome("fail", f"the padded row past T={tokens} is not zero (max |y| "
                           f"{float(pad.float().abs().max())})")
        y = y[:tokens]
    m = accuracy_metrics(y.float(), ref.float())
    ok = m["cosine"] >= COSINE_FAITHFUL and m["processed_diff"] <= PROCESSED_FAITHFUL and m["nonfinite"] == 0
    detail = (f"cosine {m['cosine']:.6f}, processed diff {m['processed_diff']:.2e}, max abs {m['max_abs_err']:.3g}, "
              f"nonfinite {m['nonfinite']}")
    if not ok:
        detail = f"assert cosine >= {COSINE_FAITHFUL} and processed diff <= {PROCESSED_FAITHFUL}: {detail}"
    metrics = {k: float(m[k]) for k in ("cosine", "processed_diff", "max_abs_err", "nonfinite")}
    return Outcome("pass" if ok else "fail", detail, metrics)


def _reference(tokens: Sequence[inputs.Tokens], weights: Sequence[tuple[object, object]],
               shared: tuple[object, object] | None, fmt: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the quantization-faithful reference of the layer over every rank's tokens
    (``tokens[r]``) and experts (``weights[r]``, in ``fmt``); ``shared`` is replicated on every rank."""
    from gc_moe_compat.testing.operator_workload import INTERMEDIATE_QUANT
    from gc_moe_compat.testing.reference import expert_parallel_reference

    staged = [t.staged for t in tokens]
    return expert_parallel_reference([(s.x, s.x_sf) for s in staged], [s.topk_idx for s in staged],
                                     [s.topk_weights for s in staged], [w[0] for w in weights],
                                     [w[1] for w in weights], shared=shared, activation_clamp=CLAMP,
                                     intermediate_quant=INTERMEDIATE_QUANT[fmt])[rank].y


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


def _workload() -> model_config.Workload:
    """The cells' layer as one rank holds it (:data:`SHAPE`); at world size P the group's layer has P times the
    experts (:meth:`~gc_moe_compat.ab.model_config.Workload.shape`)."""
    return model_config.explicit(SHAPE["hidden"], SHAPE["intermediate"], SHAPE["experts"], SHAPE["topk"], ep_size=1,
                                 routed_scaling_factor=SCALING, activation_clamp=CLAMP, capacity=SHAPE["capacity"])


def _agree(group: object, world: int, error: Outcome | None) -> Outcome | None:
    """The first rank's setup error of a combination, on every rank (collective): all ranks skip a combination any
    of them could not set up, since the others would wait for it in the layer's collectives."""
    if world == 1:
        return error
    import torch.distributed as dist

    seen: list[object] = [None] * world
    dist.all_gather_object(seen, error, group=group)
    return next((e for e in seen if e is not None), None)


def _barrier(group: object, world: int) -> None:
    """Between two calls of a combination and before its buffers go (world size > 1): no rank restages or frees
    while a peer may still read its rows or write into its symmetric memory."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier(group=group)


def layer_outcomes(group: object, world: int, rank: int, device: torch.device
                   ) -> Iterator[tuple[str, dict[str, object], int, Outcome]]:
    """(entry point, axes, T, this rank's :class:`Outcome`) of every layer combination at every T of
    :data:`LAYER_TOKENS`, on rank ``rank`` of the ``world``-rank ``group``: the one code path of both world sizes.

    Every rank runs it, in the same order (buffers and calls are collective). Every rank builds every rank's experts
    and tokens from the seeds (:mod:`.inputs`), so the reference of its own tokens needs no communication."""
    w = _workload()
    num_experts = w.local_experts * world
    weights = [inputs.make_weights(w.local_experts, w.hidden, w.intermediate, r, inputs.WEIGHT_FORMATS, device)
               for r in range(world)]
    shared_w = inputs.make_weights(1, w.hidden, w.intermediate, 1000, ("fp8_block128",), device)["fp8_block128"]
    ctx = operators.Context(group, w, world, rank, weights[rank], device)
    for entry, axes, build in _entries():
        fmt = compute_path(axes["mma_type"]).weight_format
        runner, error = None, None
        try:
            runner = build(ctx, shared_w)
        except SETUP_ERRORS as exc:
            error = Outcome("not supported", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a setup failure of a supported combination
            error = Outcome("fail", f"setup: {type(exc).__name__}: {exc}")
        error = _agree(group, world, error)
        if error is not None:
            if runner is not None:
                runner.close()
            for t in LAYER_TOKENS:
                yield entry, axes, t, error
            continue
        for t in LAYER_TOKENS:
            tokens = [inputs.make_tokens(t, num_experts, w.topk, w.hidden, r, world, SCALING, device)
                      for r in range(world)]
            _barrier(group, world)
            try:
                y = runner.run(tokens[rank])
                torch.cuda.synchronize()
                ref = _reference(tokens, [lw[fmt] for lw in weights], shared_w if axes["shared"] else None, fmt,
                                 rank)
                outcome = _verdict(y, ref, t)
            except SETUP_ERRORS as exc:
                outcome = Outcome("not supported", f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - the cell records it
                outcome = Outcome("fail", f"{type(exc).__name__}: {exc}")
            yield entry, axes, t, outcome
        _barrier(group, world)
        runner.close()
        torch.cuda.synchronize()


def _cell(entry: str, axes: dict[str, object], tokens: int, world: int, outcome: Outcome) -> Cell:
    """The cell of one rank's outcome (world size 1: the rank is the whole group)."""
    return Cell("layer", entry, case_label(axes, tokens, world), outcome.result, outcome.detail,
                {**axes, "tokens": tokens, "world_size": world})


def _not_run(world: int, reason: str) -> list[Cell]:
    """One ``not run`` cell per entry of :func:`_entries` at ``world`` ranks, with ``reason``."""
    return [Cell("layer", entry, case_label(axes, "all", world), "not run", reason, {**axes, "world_size": world})
            for entry, axes, _ in _entries()]


def two_rank_reason(gpus: int, shared_gpu: bool, mps: bool | None = None) -> str | None:
    """Why the world-size-2 cells cannot run on a host with ``gpus`` GPUs, naming what would let them; None where they
    can: two or more GPUs (one rank each), or one GPU that ``shared_gpu`` (``--shared-gpu``) lets both ranks share
    while CUDA MPS serves it (``mps``; without MPS the two ranks' kernels, each spinning for the other, would hang)."""
    if gpus >= TWO_RANKS:
        return None
    want = f"needs 2 GPUs on one host, or one GPU shared by 2 ranks ({SHARED_GPU_HOWTO})"
    if gpus <= 0:
        return f"{want}; no CUDA GPU here"
    if not shared_gpu:
        return f"{want}; 1 GPU here and no --shared-gpu"
    if not mps:
        return (f"--shared-gpu: CUDA MPS does not serve this GPU, so the 2 ranks were not started (their kernels, "
                f"each spinning for the other, would hang without it); start MPS before the matrix "
                f"({SHARED_GPU_HOWTO})")
    return None


def _mps_serves(index: int) -> bool:
    """Whether CUDA MPS serves GPU ``index`` (False where the driver cannot say)."""
    from gc_moe_compat.runtime.colocation import mps_enabled

    try:
        return mps_enabled(index)
    except Exception:  # noqa: BLE001 - no answer: the ranks are not started
        return False


def placement_text(info: Mapping[str, object] | None, world: int) -> str:
    """Where a world-size-``world`` cell ran, from rank 0's :func:`gc_moe_compat.runtime.colocation.describe`
    (plus ``gpu``): the shared-GPU label and whether MPS served the GPU, or one GPU per rank; and the rendezvous."""
    if not info:
        return f"{world} ranks (placement not reported)"
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    if info.get("label"):
        return (f"{info['label']}{gpu} (rendezvous {info.get('rendezvous')}, MPS "
                f"{'on' if info.get('mps') else 'off'})")
    return f"{world} ranks, one GPU each{gpu} (rendezvous {info.get('rendezvous')})"


def _ranked(got: Sequence[Outcome]) -> str:
    """Every rank's metrics, the worst rank (lowest cosine, then highest processed diff) first."""
    order = sorted(range(len(got)), key=lambda r: (got[r].metrics.get("cosine", 1.0),
                                                  -got[r].metrics.get("processed_diff", 0.0)))
    return "; ".join(f"{'worst ' if i == 0 else ''}rank {r}: {got[r].detail}" for i, r in enumerate(order))


def merge_ranks(expected: Sequence[tuple[str, dict[str, object], int]], per_rank: Sequence[Mapping[tuple[str, str],
                Outcome]], where: str, missing: str) -> list[Cell]:
    """One cell at world size ``len(per_rank)`` per ``expected`` (entry point, axes, T), from every rank's outcomes
    (``per_rank[r]``: rank r's, keyed by (entry point, :func:`case_label`)).

    ``pass`` only when every rank passes (the detail: ``where``, the placement, then each rank's metrics, the worst
    rank first); ``fail`` when any rank fails (naming it, with its detail) or has no outcome (``missing`` says why:
    it exited early or ran past the deadline); ``not supported`` when every rank refused the combination; ranks that
    disagree otherwise fail, each named with its result."""
    world = len(per_rank)
    cells = []
    for entry, axes, t in expected:
        case = case_label(axes, t, world)
        got = [outcomes.get((entry, case)) for outcomes in per_rank]
        failed = [f"rank {r}: {o.detail}" for r, o in enumerate(got) if o is not None and o.result == "fail"]
        silent = [str(r) for r, o in enumerate(got) if o is None]
        absent = [f"no result from rank {' and '.join(silent)} ({missing})"] if silent else []
        results = {o.result for o in got if o is not None}
        if failed or absent:
            result, detail = "fail", f"{where}; " + "; ".join(failed + absent)
        elif results == {"pass"}:
            result, detail = "pass", f"{where}; " + _ranked(got)
        elif results == {"not supported"}:
            result, detail = "not supported", got[0].detail
        else:
            result, detail = "fail", f"{where}; the ranks disagree: " + "; ".join(
                f"rank {r}: {o.result}: {o.detail}" for r, o in enumerate(got))
        cells.append(Cell("layer", entry, case, result, detail, {**axes, "tokens": t, "world_size": world}))
    return cells


def _free_port() -> int:
    """A TCP port free on this host now, for the ranks' rendezvous (``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 6) -> str:
    """The last ``lines`` lines of a rank's log on one line (what a cell it did not report shows of it)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return " / ".join(text.strip().splitlines()[-lines:])[-600:]


def _stop(proc: subprocess.Popen) -> None:
    """Kill a rank process and what it started (its own session: e.g. a compiler it was waiting for)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _rank_command() -> list[str]:
    """The command of one rank process (its ``--result PATH`` follows)."""
    return [sys.executable, "-m", "gc_moe_compat.ab.matrix_rank"]


def _run_ranks(folder: Path, world: int, timeout: float) -> list[str | None]:
    """Run ``world`` rank processes (:func:`_rank_command`: :mod:`.matrix_rank`) with torchrun's environment
    variables set, rank ``r`` reporting into ``folder/rank<r>.json`` and its output in ``folder/rank<r>.log``, for at
    most ``timeout`` seconds; a rank left running :data:`PEER_GRACE_S` after its peer failed is stopped too. Per
    rank: None where it exited 0, else why not (its exit status or the deadline, with the tail of its log)."""
    base = dict(os.environ, **MULTICAST_OFF, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    procs = []
    for r in range(world):
        with (folder / f"rank{r}.log").open("w") as log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(
                [*_rank_command(), "--result", str(folder / f"rank{r}.json")],
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
    why: list[str | None] = [None] * world
    deadline = time.monotonic() + timeout
    stop_at = deadline
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if stop_at == deadline and any(p.returncode not in (None, 0) for p in procs):
            stop_at = min(deadline, now + PEER_GRACE_S)
        if now >= stop_at:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    _stop(p)
                    why[r] = (f"ran past the {timeout:.0f} s deadline and was stopped" if now >= deadline else
                              f"stopped {PEER_GRACE_S} s after its peer failed")
            break
        time.sleep(0.5)
    for r, p in enumerate(procs):
        if why[r] is None and p.returncode != 0:
            why[r] = f"exited rc={p.returncode}"
    return [None if w is None else f"rank {r} {w}: {_tail(folder / f'rank{r}.log')}" for r, w in enumerate(why)]


def _read_rank(path: Path) -> dict[str, object]:
    """A rank's report (:mod:`.matrix_rank`): its placement and its outcomes keyed by (entry point, case); empty
    where it wrote none (or a partial file)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"placement": None, "outcomes": {}}
    outcomes = {(o["entry"], o["case"]): Outcome(o["result"], o["detail"], o.get("metrics", {}))
                for o in data.get("outcomes", [])}
    return {"placement": data.get("placement"), "outcomes": outcomes}


def two_rank_cells(timeout: float = TWO_RANK_TIMEOUT_S) -> list[Cell]:
    """The world-size-2 layer cells: two rank processes (:mod:`.matrix_rank`: a GPU each where the host has two,
    else both on the one GPU; the caller checked :func:`two_rank_reason`), stopped at ``timeout`` seconds; their
    outcomes merged into one cell per combination and T (:func:`merge_ranks`). Their reports and logs stay in a
    fresh folder under ``$OUT`` (the device runs' output folder) where it is set, else under the system's temporary
    folder; cells without a result name it."""
    expected = [(entry, axes, t) for entry, axes, _ in _entries() for t in LAYER_TOKENS]
    root = os.environ.get("OUT")
    folder = Path(tempfile.mkdtemp(prefix="matrix_two_rank_", dir=root if root and Path(root).is_dir() else None))
    exits = _run_ranks(folder, TWO_RANKS, timeout)
    reports = [_read_rank(folder / f"rank{r}.json") for r in range(TWO_RANKS)]
    placement = next((rep["placement"] for rep in reports if rep["placement"]), None)
    missing = "; ".join(e for e in exits if e) or "the rank exited 0 without reporting it"
    missing += f"; the ranks' logs: {folder}"
    return merge_ranks(expected, [rep["outcomes"] for rep in reports], placement_text(placement, TWO_RANKS),
                       missing)


def _prebuild_jobs(worlds: Sequence[int]) -> list[tuple[str, dict[str, int]]]:
    """The kernels of every cell at each world size of ``worlds`` (:func:`prebuild.kernel_jobs`), each once."""
    nonzero = [t for t in LAYER_TOKENS if t]
    jobs: dict[tuple[str, tuple[tuple[str, int], ...]], tuple[str, dict[str, int]]] = {}
    for world in worlds:
        for source, defines in prebuild.kernel_jobs(MMA_TYPES, nonzero, world, SHAPE["topk"],
                                                    SHAPE["experts"] * world):
            jobs.setdefault((source, tuple(sorted(defines.items()))), (source, defines))
    return list(jobs.values())


def layer_cells(shared_gpu: bool = False, two_rank_timeout: float = TWO_RANK_TIMEOUT_S) -> list[Cell]:
    """Every layer combination at world size 1 (in this process) and 2 (:func:`two_rank_cells`, where two ranks can
    run here: 2+ GPUs, or one with ``shared_gpu`` under CUDA MPS; else ``not run`` with :func:`two_rank_reason`).
    The kernels of both world sizes are compiled first, in parallel (:mod:`.prebuild`)."""
    if not torch.cuda.is_available():
        return _not_run(1, "needs a CUDA GPU") + _not_run(TWO_RANKS, two_rank_reason(0, shared_gpu))
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", torch.cuda.current_device())
    group = _group()
    why = two_rank_reason(gpus, shared_gpu, _mps_serves(device.index) if shared_gpu and gpus == 1 else None)
    prebuild.prebuild(_prebuild_jobs((1,) if why else (1, TWO_RANKS)))
    cells = [_cell(entry, axes, t, 1, outcome) for entry, axes, t, outcome in layer_outcomes(group, 1, 0, device)]
    if why:
        return cells + _not_run(TWO_RANKS, why)
    torch.cuda.empty_cache()  # the rank processes share this GPU where there is one
    return cells + two_rank_cells(two_rank_timeout)


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
