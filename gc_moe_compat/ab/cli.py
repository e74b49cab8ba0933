"""``gc-moe-ab``: run the original Mega MoE kernels and GC-MoE side by side on identical inputs.

Usage (``python -m gc_moe_compat.ab`` is the same)::

    gc-moe-ab --preset glm52 [--tokens 1 8 64] [--ops facade native_fp8xfp4 ...] [--partition-sweep]
    gc-moe-ab --model-config path/to/config.json --ep-size 8
    gc-moe-ab --hidden 7168 --intermediate 2048 --experts 256 --topk 8 [--ep-size 8]
    gc-moe-ab --check ...          # what would run and what is missing; no GPU needed
    gc-moe-ab matrix ...           # the compatibility matrix (the same as gc-moe-matrix)

The workload is checked against the operator's constraints before anything is allocated (a failing rule is
printed, exit code 2; ``--check`` prints it and exits 2 as well). On a machine with several GPUs the tool starts one
process per GPU itself (``torchrun``, ``--world-size`` to choose fewer), or runs under an existing ``torchrun``.
Results: ``--out`` (default ``ab_<workload>.json`` in the working directory, never the checkout's committed
``bench/results/`` unless ``--out`` names it) plus a PNG next to it, and a table in the terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from gc_moe_compat.ab import model_config
from gc_moe_compat.ab.model_config import Workload
from gc_moe_compat.config import SWEEP_TOKENS

__all__ = ["build_parser", "default_out", "main", "parse", "plan_lines", "workload_from_args"]

QUICK_WINDOWS = (3, 10)
"""``--quick``: (warm-up, measured) windows of a smoke run; the protocol's 10 + 30 otherwise."""
OPTIONAL_PACKAGES = {
    "rich": "pip install rich (progress bar and table; plain lines without it)",
    "matplotlib": "pip install matplotlib (the PNG; none without it)",
    "triton": "pip install triton (DeepGEMM's and the composed baseline's kernels)",
}


DESCRIPTION = "Run the original Mega MoE kernels and GC-MoE side by side on identical inputs."
USAGE = """gc-moe-ab (--preset NAME | --model-config PATH | --hidden H --intermediate I --experts E --topk K) [options]
       gc-moe-ab matrix [--cpu-only] [...]   (the compatibility matrix: gc-moe-ab matrix --help)"""


def _epilog() -> str:
    """``--help``'s end: the subcommand, every operator ``--ops`` can name with what it is, the settings, the output
    and the exit status."""
    from gc_moe_compat.ab import deep_ep_probe, operators

    lines = ["subcommand:", "  matrix: the compatibility matrix of the facades on this machine (= gc-moe-matrix; "
             "gc-moe-ab matrix --help)", "",
             f"operators (--ops NAME ...; default: every one below but the --partition-sweep ones; speedups divide by "
             f"{operators.REFERENCE_OP}):"]
    for spec in operators.operator_specs(partition_sweep=True):
        if spec.name.startswith("facade_dispatch_sms_") and not spec.name.endswith(f"_{operators.DISPATCH_SWEEP[0]}"):
            continue
        sweep = ", ".join(map(str, operators.DISPATCH_SWEEP))
        name = (f"facade_dispatch_sms_N (N = {sweep}; --partition-sweep adds all)"
                if spec.name.startswith("facade_dispatch_sms_") else spec.name)
        label = spec.label.replace(f"={operators.DISPATCH_SWEEP[0]}", "=N").replace(
            f"request {operators.DISPATCH_SWEEP[0]} SMs", "request N SMs")
        lines += textwrap.wrap(f"{name}: {label}", 116, initial_indent="  ", subsequent_indent="      ")
    lines += [""] + textwrap.wrap(
        f"settings: {deep_ep_probe.SETTING} (default {deep_ep_probe.DEFAULT_TIMEOUT_S:g}): the seconds after which "
        "the child process that tries the original deep_ep's low-latency mode is killed, before "
        "composed_deepep_deepgemm uses it (the gc_moe_compat.deep_ep facade where it does not start: NVSHMEM's "
        "start can hang); also GC_MOE_PARTITION, GC_MOE_DISPATCH_SMS, GC_MOE_DEEP_EP_PARTITION (README).", 118)
    lines += ["", "output: --out (default ab_<workload>.json in the working directory) and a PNG beside it; the "
              "committed", "bench/results/ of a checkout is written only when --out names it.",
              "exit status: 0 done (--check: every requested point is inside the operator's constraints); 1 no CUDA "
              "GPU;", "2 a bad argument or a constraint that blocks a requested point."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gc-moe-ab", usage=USAGE, description=DESCRIPTION,
                                     epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("workload (one of --preset, --model-config, or the explicit sizes)")
    src.add_argument("--preset", choices=model_config.PRESET_NAMES, help="a per-rank workload of config.PRESETS")
    src.add_argument("--model-config", type=Path, metavar="PATH", help="a HuggingFace config.json of an MoE model")
    src.add_argument("--hidden", type=int, help="the model's hidden size H")
    src.add_argument("--intermediate", type=int, help="one routed expert's intermediate width I")
    src.add_argument("--experts", type=int, help="the model's routed experts (global)")
    src.add_argument("--topk", type=int, help="routed experts per token")
    src.add_argument("--shared-experts", type=int, default=0,
                     help="shared experts (recorded, outside the compared layer; default 0)")
    src.add_argument("--routed-scaling-factor", type=float, default=None,
                     help="default: the config's routed_scaling_factor, else 1.0")
    src.add_argument("--activation-clamp", type=float, default=None,
                     help="SwiGLU clamp (default: the config's swiglu_limit, else none)")
    src.add_argument("--ep-size", type=int, default=None,
                     help=f"ranks the deployment spreads the experts over (default {model_config.DEFAULT_EP_SIZE}); "
                          "each GPU of the run holds one rank's share")
    src.add_argument("--capacity", type=int, default=256, help="tokens per rank the buffers hold (default 256)")
    run = parser.add_argument_group("run")
    run.add_argument("--tokens", type=int, nargs="+", default=list(SWEEP_TOKENS),
                     help=f"tokens per rank (default {' '.join(map(str, SWEEP_TOKENS))})")
    run.add_argument("--ops", nargs="+", default=None, metavar="NAME",
                     help="operators to compare (default: all; the list is below)")
    run.add_argument("--partition-sweep", action="store_true",
                     help="add the facade partitioned at every T (GC_MOE_PARTITION=on) and at dispatch SM requests "
                          "4/8/16/24 (GC_MOE_DISPATCH_SMS)")
    run.add_argument("--world-size", type=int, default=None,
                     help="ranks, one per GPU (default: every visible one); more than the GPUs needs --shared-gpu")
    run.add_argument("--shared-gpu", action="store_true",
                     help="let --world-size exceed the visible GPUs: several ranks per GPU (start CUDA MPS first, "
                          "scripts/mps.sh); the results say so and are no NVLink figures")
    run.add_argument("--warmup", type=int, default=10, help="warm-up windows (default 10)")
    run.add_argument("--windows", type=int, default=30, help="measured windows of 100 graph replays (default 30)")
    run.add_argument("--repeats", type=_at_least_one, default=2, metavar="N",
                     help="timing rounds per point, interleaved over the operators (each round: the warm-up and "
                          "measured windows); the latency is the median of every round's windows, the result file "
                          "keeps each round's and their spread (default 2)")
    run.add_argument("--timeline", type=int, default=0, metavar="N",
                     help="after each operator's timing rounds, N more graph replays under the PyTorch profiler: per "
                          "kernel its median start / end offset and duration within a replay, in the point's "
                          "`timeline` (each rank's; not the protocol's timing: no L2 flush between those replays)")
    run.add_argument("--quick", action="store_true",
                     help=f"smoke run: {QUICK_WINDOWS[0]} + {QUICK_WINDOWS[1]} windows instead of the protocol's")
    run.add_argument("--out", type=Path, default=None,
                     help="result JSON (default ./ab_<workload>.json; a PNG is written next to it)")
    run.add_argument("--prebuild-only", action="store_true",
                     help="compile every kernel the run would use (GC-MoE's and the originals' JIT kernels, in "
                          "parallel) and exit without timing: run several of these at once before timed runs")
    run.add_argument("--check", action="store_true",
                     help="print what would run and what is missing (no GPU needed); exit 2 if a constraint blocks "
                          "a requested point, else 0")
    return parser


def _at_least_one(text: str) -> int:
    """``--repeats``'s value: a whole number >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (timing rounds per point), got {text!r}")
    return value


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload the arguments name; ``ValueError`` names the argument at fault."""
    explicit = [args.hidden, args.intermediate, args.experts, args.topk]
    given = sum(x is not None for x in (args.preset, args.model_config)) + any(v is not None for v in explicit)
    if given != 1:
        raise ValueError("workload: give exactly one of --preset, --model-config, or all of --hidden "
                         "--intermediate --experts --topk")
    if args.preset is not None:
        w = model_config.preset(args.preset, args.ep_size, args.capacity)
    elif args.model_config is not None:
        w = model_config.from_hf_config(args.model_config, args.ep_size, args.capacity)
    else:
        if any(v is None for v in explicit):
            missing = [n for n, v in zip(("--hidden", "--intermediate", "--experts", "--topk"), explicit,
                                         strict=True) if v is None]
            raise ValueError(f"workload: explicit sizes need {missing} too")
        w = model_config.explicit(args.hidden, args.intermediate, args.experts, args.topk, ep_size=args.ep_size,
                                  shared_experts=args.shared_experts, capacity=args.capacity,
                                  routed_scaling_factor=1.0, activation_clamp=args.activation_clamp)
    overrides = {}
    if args.routed_scaling_factor is not None:
        overrides["routed_scaling_factor"] = args.routed_scaling_factor
    if args.activation_clamp is not None:
        overrides["activation_clamp"] = args.activation_clamp
    if overrides:
        w = dataclasses.replace(w, **overrides, fields={**w.fields, **dict.fromkeys(overrides, "argument")})
    return w


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Workload, list[str]]:
    """Arguments, workload and the constraint failures of the requested run (empty: every shape is runnable).

    Raises ``ValueError`` for a malformed workload (nothing is allocated)."""
    from gc_moe_compat.ab import operators

    args = build_parser().parse_args(list(argv))
    w = workload_from_args(args)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or max(_visible_gpus(), 1)
    specs = operators.select(args.ops, args.partition_sweep)  # unknown names raise here
    problems = []
    for mma in sorted({s.mma_type for s in specs}):
        try:
            w.shape(world, mma)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    bad = [t for t in args.tokens if not 1 <= t <= w.capacity]
    if bad:
        problems.append(f"--tokens: every T must lie in [1, --capacity={w.capacity}], got {bad}")
    return args, w, problems


def placement_lines(world: int, gpus: int) -> list[str]:
    """Where ``world`` ranks run on ``gpus`` GPUs: how the buffers map their peers, the host collectives, the
    partition each rank gets, and what ``deep_gemm.set_num_sms`` does to it."""
    from gc_moe_compat.runtime.colocation import host_backend, mps_enabled
    from gc_moe_compat.runtime.split import deep_ep_partition_mode, dispatch_request, partition_mode

    backend, why = host_backend(world, max(gpus, 1))
    rendezvous = "local" if world == 1 else "cuda-ipc" if why else "torch-symm-mem"
    lines = [f"ranks: {world} on {max(gpus, 1)} GPU(s): peers mapped by {rendezvous}, host collectives {backend}"
             + (f" ({why})" if why else "")]
    if why:
        mps = "on" if gpus and mps_enabled(0) else "off (start CUDA MPS first: scripts/mps.sh)"
        lines.append(f"  shared GPU: CUDA MPS {mps}; the partition is off, each rank's grids at its share of the SMs; "
                     "timings are shared-GPU figures, not NVLink ones")
    lines.append(f"partition: {partition_mode()} (GC_MOE_PARTITION), dispatch SM request {dispatch_request()} "
                 "(GC_MOE_DISPATCH_SMS); deep_gemm.set_num_sms is kept for get_num_sms and does not shape it")
    lines.append(f"deep_ep facade kernels: partition {deep_ep_partition_mode()} (GC_MOE_DEEP_EP_PARTITION; off: the "
                 "caller's stream, as DeepEP's)")
    return lines


def partition_rule_line(w: Workload, world: int, gpus: int) -> str:
    """What ``GC_MOE_PARTITION`` makes of each T of this workload: under ``auto`` the tokens up to which one rank's
    calls run with the partition off (:func:`gc_moe_compat.operator.heuristics.sequential_max_tokens`)."""
    from gc_moe_compat.operator.heuristics import SEQUENTIAL_BELOW_ROWS, sequential_max_tokens
    from gc_moe_compat.runtime.colocation import host_backend
    from gc_moe_compat.runtime.split import partition_mode

    mode = partition_mode()
    if host_backend(world, max(gpus, 1))[1]:  # why gloo: the ranks share a GPU
        return "partition per call: off at every T (ranks share a GPU)"
    if mode != "auto":
        return f"partition per call: {mode} at every T (GC_MOE_PARTITION={mode})"
    edge = sequential_max_tokens(world, w.topk, w.local_experts * world, w.capacity)
    if edge == 0:
        return (f"partition per call: on at every T ({world} ranks: the rule that runs small calls in sequence is "
                "measured on one rank only)")
    return (f"partition per call: off for T <= {edge} (fewer than {SEQUENTIAL_BELOW_ROWS:g} expected rows per expert), "
            f"on above (GC_MOE_PARTITION=auto)")


def plan_lines(args: argparse.Namespace, w: Workload, problems: Sequence[str]) -> list[str]:
    """``--check``'s report: the workload, the shape per GPU count, each operator with why it cannot run, the
    optional packages."""
    import torch

    from gc_moe_compat.ab import operators

    gpus = _visible_gpus()
    world = args.world_size or max(gpus, 1)
    lines = [f"workload: {w.name}: H={w.hidden} I={w.intermediate} E={w.num_experts} top-{w.topk} "
             f"shared={w.shared_experts} (outside the compared layer) routed_scaling={w.routed_scaling_factor} "
             f"clamp={w.activation_clamp} ep_size={w.ep_size} -> {w.local_experts} experts per rank",
             f"fields: {dict(w.fields)}",
             f"run: {world} rank(s) x E={w.local_experts * world}, capacity {w.capacity}, tokens per rank "
             f"{list(args.tokens)}",
             f"device: {torch.cuda.get_device_name() if gpus else 'no CUDA GPU visible'} ({gpus} visible), torch "
             f"{torch.__version__}"]
    lines += [f"constraint: {p}" for p in problems] or ["constraints: the shape is inside the operator's envelope"]
    lines += placement_lines(world, gpus)
    lines.append(partition_rule_line(w, world, gpus))
    for spec in operators.select(args.ops, args.partition_sweep):
        reason, source = spec.probe(), spec.source_fn()
        lines.append(f"  {'would run' if reason is None else 'cannot run'}: {spec.name} - {spec.label}"
                     + ("" if source is None else f"\n      build: {source}")
                     + ("" if reason is None else f"\n      why: {reason}"))
    if any(spec.name == "composed_deepep_deepgemm" for spec in operators.select(args.ops, args.partition_sweep)):
        lines.append(deep_ep_line())
    kernels = kernel_sources()
    lines.append(f"kernels: {kernels}" if kernels else "kernels: gc_moe_compat.kernels is not importable in this "
                 f"Python ({sys.executable}): install the package into it (python -m pip install -e .)")
    for name, how in OPTIONAL_PACKAGES.items():
        found = importlib.util.find_spec(name) is not None
        lines.append(f"package {name}: {'found' if found else 'missing: ' + how}")
    return lines


def deep_ep_line() -> str:
    """Which ``deep_ep`` the composed operator would use: whether an original imports (importing it is cheap and
    bounded) and that its low-latency mode is only tried at the run, in a probe child killed after
    ``GC_MOE_AB_DEEP_EP_PROBE_S`` seconds (NVSHMEM's start can hang forever; ``--check`` does not start it)."""
    from gc_moe_compat import originals
    from gc_moe_compat.ab import deep_ep_probe
    from gc_moe_compat.ab.operators import _source

    try:
        limit = f"{deep_ep_probe.probe_timeout():g} s"
    except ValueError as exc:
        limit = f"invalid: {exc}"
    try:
        ep = originals.load("deep_ep")
    except ImportError as exc:
        return (f"deep_ep (composed_deepep_deepgemm): the gc_moe_compat.deep_ep facade (the original deep_ep is not "
                f"importable: {exc})")
    return (f"deep_ep (composed_deepep_deepgemm): the original at {_source(ep)} imports; its low-latency mode is "
            f"probed at the run in a child process killed after {limit} ({deep_ep_probe.SETTING}), not here: the "
            "facade runs where it does not start (on every rank, where any rank's probe fails)")


def kernel_sources() -> str | None:
    """Where the CUDA sources the operator compiles are (``gc_moe_compat.kernels``), or None when this Python
    cannot import them: the package is not installed into this interpreter (``python -m pip install -e .``
    installs the editable mapping of ``kernels/``; a ``pip`` of another Python does not)."""
    try:
        from gc_moe_compat.runtime.jit import kernels_root

        return str(kernels_root())
    except Exception:  # noqa: BLE001 - ModuleNotFoundError or the JitError of a non-directory resource
        return None


def default_out(w: Workload) -> Path:
    """``ab_<workload>.json`` in the working directory: a run never replaces a checkout's committed results unless
    ``--out`` names them."""
    slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in w.name.split(" ")[0].split("/")[-1])
    return Path.cwd() / f"ab_{slug}.json"


def _launch_ranks(world: int, argv: Sequence[str]) -> int:
    """Re-run this command under ``torch.distributed.run`` with one process per GPU."""
    from gc_moe_compat.ab.protocol import torchrun_command

    cmd, env = torchrun_command(["-m", "gc_moe_compat.ab", *argv], world)
    return subprocess.call(cmd, env=env)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["matrix"]:
        from gc_moe_compat.ab import matrix

        return matrix.main(argv[1:])
    try:
        args, w, problems = parse(argv)
    except ValueError as exc:
        print(f"gc-moe-ab: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print("\n".join(plan_lines(args, w, problems)))
        return 2 if problems else 0
    if problems:
        for p in problems:
            print(f"gc-moe-ab: constraint: {p}", file=sys.stderr)
        return 2
    gpus = _visible_gpus()
    if gpus == 0:
        print("gc-moe-ab: no CUDA GPU visible; `gc-moe-ab --check ...` says what would run", file=sys.stderr)
        return 1
    if kernel_sources() is None:
        print(f"gc-moe-ab: gc_moe_compat.kernels is not importable in {sys.executable}: the operator's CUDA sources "
              "are missing; install the package into this Python (python -m pip install -e .)", file=sys.stderr)
        return 2
    world = args.world_size or gpus
    if world > gpus and not args.shared_gpu:
        print(f"gc-moe-ab: --world-size {world} exceeds the {gpus} visible GPU(s); --shared-gpu runs several ranks "
              "per GPU (under CUDA MPS: scripts/mps.sh)", file=sys.stderr)
        return 2
    if world > 1 and "LOCAL_RANK" not in os.environ:
        return _launch_ranks(world, argv)
    from gc_moe_compat.ab import operators, run

    warmup, windows = QUICK_WINDOWS if args.quick else (args.warmup, args.windows)
    command = ["gc-moe-ab", *argv]  # without --out it writes the same default file again
    out = args.out or default_out(w)
    cfg = run.RunConfig(workload=w, tokens=tuple(args.tokens), ops=tuple(operators.select(args.ops,
                        args.partition_sweep)), warmup=warmup, windows=windows, repeats=args.repeats, out=out,
                        command=tuple(command), quick=args.quick, prebuild_only=args.prebuild_only,
                        timeline=args.timeline)
    return run.main_ranks(cfg)
