"""``gc-moe-matrix`` (also ``gc-moe-ab matrix``): the compatibility matrix of the facades on the machine at hand.

One *cell* per combination, each with a result: ``pass``, ``fail`` (with the assertion or the unexpected error),
``not supported`` (with the reason the facade gives, e.g. its NotImplementedError) or ``not run`` (with why: no
GPU, two ranks that cannot run here, no checkout given). Kinds of cells:

* ``signature`` (CPU): per facade entry point and per original version recorded in ``tests/data/*.json``
  (``scripts/gen_signatures.py``: ``deepinfer-gemm`` 2.8.2, ``sgl-deep-gemm`` 0.2.3.post2, ``sgl-deep-ep``
  0.1.2.post1): that version's parameters are a prefix of the facade's (same names, kinds, defaults), so code
  written against it binds. Plus the known divergences of versions not recorded there (:data:`KNOWN_DIVERGENCES`).
* ``validation`` (CPU): bad input raises the documented exception naming the argument, before any launch; an
  unsupported option raises NotImplementedError naming it (a ``not supported`` cell with that message).
* ``pre-dispatch`` (CPU): the facade's pre-dispatch staging at T = 0, 1, odd, capacity, per buffer ``mma_type``
  and scale format, byte for byte against the originals' arithmetic (:func:`gc_moe_compat.quant`'s model).
* ``swap`` (CPU): ``GC_MOE_SWAP`` values, each in a fresh interpreter: where ``deep_gemm`` / ``deep_ep`` come from.
* ``layer`` (GPU, :mod:`.matrix_gpu`): entry point x ``mma_type`` x shared experts x scale format x T x world size
  (1, and 2 as two rank processes: a GPU each on a host with two, or both on one GPU under CUDA MPS with
  ``--shared-gpu``; ``not run`` with the reason and the flag elsewhere), each rank against the
  quantization-faithful reference of its tokens; a two-rank cell passes only when both ranks pass.
* ``suite`` (GPU): the originals' own test files from checkouts the user points to, run unmodified under the swap.

Writes ``compat_matrix.md`` and ``compat_matrix.json`` (into ``--out-dir``, default the working directory) with
the versions of torch, CUDA, the driver, the GPU and each original found. ``--cpu-only`` runs the CPU cells (what CI
runs); ``--kinds`` picks kinds of cells (e.g. ``--kinds layer``: the layer cells alone).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

from gc_moe_compat.ab.cells import RESULTS, Cell
from gc_moe_compat.ab.protocol import REPO, portable_path, portable_text, result_meta, write_result
from gc_moe_compat.compute_paths import MMA_TYPES
from gc_moe_compat.runtime.single_rank import single_rank_group

__all__ = ["CPU_KINDS", "KINDS", "KNOWN_DIVERGENCES", "Cell", "checkout_signature_cells", "cpu_cells", "main",
           "markdown", "selected_kinds", "signature_cells", "surface", "swap_cells", "validation_cells", "versions"]

DATA_DIR = REPO / "tests" / "data"
SIGNATURE_FILES = {"deep_gemm": "deep_gemm_mega_moe.json", "deep_ep": "deep_ep_buffer.json"}
DISTRIBUTIONS = ("sgl-deep-gemm", "deepinfer-gemm", "deep-gemm", "sgl-deep-ep", "deep-ep", "deepinfer-ep")
"""Registry names of the originals whose installed versions the matrix records."""
CPU_KINDS = ("signature", "validation", "pre-dispatch", "swap")
"""The kinds of cells that need no GPU (what ``--cpu-only`` and CI run)."""
KINDS = (*CPU_KINDS, "layer", "suite")
"""Every kind of cell, in the order the matrix runs them (``--kinds`` picks some)."""


@dataclass(frozen=True)
class Divergence:
    """A difference of an original version that ``tests/data`` does not record (docs/data_contracts.md)."""

    entry: str
    version: str
    what: str
    check: Callable[[], bool]
    """True where the facade already accepts the original's form."""


def _accepts(module: str, name: str, param: str) -> Callable[[], bool]:
    def check() -> bool:
        obj = _resolve(module, name)
        return param in inspect.signature(obj).parameters

    return check


def _has(module: str, name: str) -> Callable[[], bool]:
    def check() -> bool:
        mod = __import__(f"gc_moe_compat.{module}", fromlist=["_"])
        return name in getattr(mod, "__all__", ())

    return check


KNOWN_DIVERGENCES = (
    Divergence("deep_gemm.mega_moe_pre_dispatch", "sgl-deep-gemm dev branch (sgl-project/DeepGEMM)",
               "renames mma_type= to use_fp4_acts=; both spellings should be accepted where they do not conflict",
               _accepts("deep_gemm", "mega_moe_pre_dispatch", "use_fp4_acts")),
    Divergence("deep_gemm.bf16_mega_gate", "sgl-deep-gemm 0.2.5", "adds bf16_mega_gate (forwarded to an installed "
               "original; MissingOriginalError without one)", _has("deep_gemm", "bf16_mega_gate")),
    Divergence("deep_gemm.mega_mhc", "sgl-deep-gemm 0.2.5", "adds mega_mhc (forwarded to an installed original; "
               "MissingOriginalError without one)", _has("deep_gemm", "mega_mhc")),
)


def _resolve(module: str, name: str) -> object:
    obj: object = __import__(f"gc_moe_compat.{module}", fromlist=["_"])
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _records(sig: inspect.Signature) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]


def _recorded(params: list[dict]) -> list[tuple[str, str, object]]:
    import ast

    empty = inspect.Parameter.empty
    return [(p["name"], p["kind"], empty if p["default"] is None else ast.literal_eval(p["default"])) for p in params]


def _fmt(rec: tuple[str, str, object]) -> str:
    name, kind, default = rec
    return f"{name}" + ("" if default is inspect.Parameter.empty else f"={default!r}") + f" [{kind}]"


def _compare(entry: str, version: str, rec: dict | None, ours: list[tuple[str, str, object]],
             divergence: str = "fail") -> Cell:
    """One version's parameters (``rec`` as ``tests/data`` records them) against the facade's ``ours``: they bind
    when they are a prefix of ours. A divergence is ``divergence`` (``fail`` for a pinned version the facade
    mirrors, ``not supported`` for a checkout's newer form)."""
    axes = {"version": version}
    if rec is None:
        return Cell("signature", entry, version, "pass", "absent in this version (the facade adds it)", axes)
    if rec["params"] is None:
        return Cell("signature", entry, version, "pass", "compiled in this version (no Python signature to "
                    "compare)", axes)
    theirs, mine = _recorded(rec["params"]), ours
    if theirs and theirs[0][0] == "self":  # a method: drop self
        theirs = theirs[1:]
        mine = ours[1:] if ours and ours[0][0] == "self" else ours
    diffs = [f"{_fmt(t)} vs facade {_fmt(m) if m else 'missing'}"
             for t, m in zip(theirs, [*mine, *[None] * len(theirs)], strict=False) if t != m]
    if diffs:
        return Cell("signature", entry, version, divergence, "; ".join(diffs), axes)
    extra = [r[0] for r in mine[len(theirs):]]
    return Cell("signature", entry, version, "pass",
                f"{len(theirs)} parameters bind" + (f"; the facade adds {extra}" if extra else ""), axes)


def _facade_records(module: str, name: str) -> list[tuple[str, str, object]] | str:
    try:
        return _records(inspect.signature(_resolve(module, name)))
    except (AttributeError, TypeError, ValueError) as exc:
        return f"facade: {type(exc).__name__}: {exc}"


def surface(data_dir: Path = DATA_DIR) -> dict[str, dict[str, dict[str, dict | None]]]:
    """``{module: {name: {version: record}}}`` of the recorded signature files (the facades' surfaces)."""
    return {module: json.loads((data_dir / filename).read_text())["names"]
            for module, filename in SIGNATURE_FILES.items()}


def signature_cells(data_dir: Path = DATA_DIR) -> list[Cell]:
    """Every recorded (entry point, version): is that version's parameter list a prefix of the facade's? Plus the
    known divergences of versions not recorded there."""
    cells = []
    for module, names in surface(data_dir).items():
        for name, per_version in names.items():
            ours = _facade_records(module, name)
            for version, rec in per_version.items():
                if isinstance(ours, str):
                    cells.append(Cell("signature", f"{module}.{name}", version, "fail", ours, {"version": version}))
                else:
                    cells.append(_compare(f"{module}.{name}", version, rec, ours))
    for div in KNOWN_DIVERGENCES:
        ok = div.check()
        cells.append(Cell("signature", div.entry, div.version, "pass" if ok else "not supported",
                          f"{div.what}: {'accepted' if ok else 'not accepted by the facade yet'}",
                          {"version": div.version}))
    return cells


def _signature_reader() -> ModuleType | None:
    """``scripts/gen_signatures.py`` of this checkout (its source readers), or None outside a checkout."""
    path = REPO / "scripts" / "gen_signatures.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("gen_signatures", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_signatures", module)  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _package_root(module: str, root: Path) -> Iterator[Path]:
    """The tree whose ``<module>/__init__.py`` is the package a user imports: ``root`` itself, or for an
    sgl-project/DeepGEMM checkout (``sgl_deep_gemm/__init__.py`` is what installs as ``deep_gemm``) a temporary
    copy laid out as its wheel is."""
    if module != "deep_gemm" or not (root / "sgl_deep_gemm" / "__init__.py").is_file():
        yield root
        return
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "deep_gemm"
        shutil.copytree(root / "deep_gemm", pkg, ignore=shutil.ignore_patterns("include", "*.so"))
        shutil.copy2(root / "sgl_deep_gemm" / "__init__.py", pkg / "__init__.py")
        yield Path(tmp)


def checkout_signature_cells(module: str, root: Path, label: str) -> list[Cell]:
    """The facade's surface against a source checkout's signatures (read with ``scripts/gen_signatures.py``'s
    readers, never imported): a divergence is ``not supported``, with what differs."""
    reader = _signature_reader()
    version = f"{label} checkout {_git_head(root)}"
    if reader is None:
        return [Cell("signature", module, version, "not run", "needs this repository's scripts/gen_signatures.py")]
    try:
        with _package_root(module, root) as tree:
            found = (reader._deep_ep_classes(tree) if module == "deep_ep" else reader._deep_gemm_bindings(tree))[0]
    except Exception as exc:  # noqa: BLE001 - the checkout is not what the flag says
        return [Cell("signature", module, version, "fail", f"reading {root}: {type(exc).__name__}: {exc}")]
    cells = []
    for name in surface()[module]:
        ours = _facade_records(module, name)
        if isinstance(ours, str):
            cells.append(Cell("signature", f"{module}.{name}", version, "fail", ours, {"version": version}))
        else:
            cells.append(_compare(f"{module}.{name}", version, found.get(name), ours, divergence="not supported"))
    return cells


def _git_head(root: Path) -> str:
    """The checkout's short commit; a folder inside another repository (or none) is named, not given its SHA."""
    try:
        top, head = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                                   capture_output=True, text=True, check=True, timeout=30).stdout.split()
    except (OSError, ValueError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return f"{root.name} (not a git checkout)"
    return head if Path(top).resolve() == root.resolve() else f"{root.name} (not a git checkout)"


def _expect(kind: str, entry: str, case: str, call: Callable[[], object], exc_type: type[BaseException],
            needle: str, axes: dict[str, object] | None = None) -> Cell:
    """Run ``call``: the expected exception naming ``needle`` passes (a NotImplementedError is a ``not supported``
    cell carrying its message); anything else fails with what happened."""
    try:
        call()
    except exc_type as exc:
        if needle not in str(exc):
            return Cell(kind, entry, case, "fail", f"{type(exc).__name__} without {needle!r}: {exc}", axes or {})
        result = "not supported" if exc_type is NotImplementedError else "pass"
        return Cell(kind, entry, case, result, f"{type(exc).__name__}: {exc}", axes or {})
    except Exception as exc:  # noqa: BLE001 - the cell records it
        return Cell(kind, entry, case, "fail", f"expected {exc_type.__name__} naming {needle!r}, got "
                    f"{type(exc).__name__}: {exc}", axes or {})
    return Cell(kind, entry, case, "fail", f"expected {exc_type.__name__} naming {needle!r}, nothing raised",
                axes or {})


def validation_cells(group: object) -> list[Cell]:
    """Bad inputs and unsupported options of each entry point (host memory, one rank)."""
    from gc_moe_compat import deep_ep
    from gc_moe_compat import deep_gemm as dg
    from gc_moe_compat.operator import api

    h, i, e, k, cap = 512, 256, 4, 2, 64
    fp8 = torch.float8_e4m3fn

    def buf(**kw: object) -> object:
        args = dict(group=group, num_experts=e, num_max_tokens_per_rank=cap, num_topk=k, hidden=h,
                    intermediate_hidden=i) | kw
        return dg.get_symm_buffer_for_mega_moe(**args)

    good = buf(mma_type="fp8xfp8")
    dev = good.x.device  # host memory without CUDA, the GPU with it: every operand on the buffer's device
    w1 = (torch.zeros(e, 2 * i, h, dtype=fp8, device=dev),
          torch.ones(e, 2 * i // 128, h // 128, dtype=torch.float32, device=dev))
    w2 = (torch.zeros(e, h, i, dtype=fp8, device=dev),
          torch.ones(e, h // 128, i // 128, dtype=torch.float32, device=dev))
    y = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)
    x = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(1, k, dtype=torch.int32, device=dev)
    wts = torch.ones(1, k, dtype=torch.float32, device=dev)
    views = (good.x, good.x_sf, good.topk_idx, good.topk_weights)
    E = "deep_gemm.get_symm_buffer_for_mega_moe"  # noqa: N806 - a label
    cases = [
        (E, "mma_type='bogus'", lambda: buf(mma_type="bogus"), ValueError, "mma_type"),
        (E, "mma_type='nvfp4xnvfp4'", lambda: buf(mma_type="nvfp4xnvfp4"), NotImplementedError, "mma_type"),
        (E, "mma_type='bf16xbf16'", lambda: buf(mma_type="bf16xbf16"), NotImplementedError, "mma_type"),
        (E, "activation='swigluoai'", lambda: buf(activation="swigluoai"), NotImplementedError, "activation"),
        (E, "num_topk=0", lambda: buf(num_topk=0), ValueError, "topk"),
        (E, "intermediate_hidden=14336 (Mixtral)", lambda: buf(intermediate_hidden=14336), ValueError, "intermediate"),
        (E, "hidden=640 (not a multiple of 256)", lambda: buf(hidden=640), ValueError, "hidden"),
        (E, "num_shared_experts=2", lambda: buf(num_shared_experts=2), ValueError, "num_shared_experts"),
        (E, "use_fp8_dispatch='yes'", lambda: buf(use_fp8_dispatch="yes"), TypeError, "use_fp8_dispatch"),
        (E, "num_max_tokens_per_rank=9000", lambda: buf(num_max_tokens_per_rank=9000), ValueError,
         "num_max_tokens_per_rank"),
        ("deep_gemm.fp8_mega_moe", "y float32", lambda: dg.fp8_mega_moe(y.float(), w1, w2, good), TypeError, "y"),
        ("deep_gemm.fp8_mega_moe", "recipe=(1, 1, 32)",
         lambda: dg.fp8_mega_moe(y, w1, w2, good, recipe=(1, 1, 32)), ValueError, "recipe"),
        ("deep_gemm.fp8_mega_moe", "activation_clamp=-1",
         lambda: dg.fp8_mega_moe(y, w1, w2, good, activation_clamp=-1.0), ValueError, "activation_clamp"),
        ("deep_gemm.fp8_mega_moe", "fast_math='no'",
         lambda: dg.fp8_mega_moe(y, w1, w2, good, fast_math="no"), TypeError, "fast_math"),
        ("deep_gemm.fp8_mega_moe", "l1 weights of another expert count",
         lambda: dg.fp8_mega_moe(y, (w1[0][:2], w1[1][:2]), w2, good), ValueError, "l1_weights"),
        ("deep_gemm.fp8_fp4_mega_moe", "recipe=(1, 1, 16) (NVFP4)",
         lambda: dg.fp8_fp4_mega_moe(y, w1, w2, good, recipe=(1, 1, 16)), NotImplementedError, "NVFP4"),
        ("deep_gemm.fp8_fp4_mega_moe", "weight_layout='trtllm'",
         lambda: dg.fp8_fp4_mega_moe(y, w1, w2, good, weight_layout="trtllm"), NotImplementedError,
         "weight_layout"),
        ("deep_gemm.fp8_fp4_mega_moe", "post_expert_norm=True",
         lambda: dg.fp8_fp4_mega_moe(y, w1, w2, good, post_expert_norm=True), NotImplementedError,
         "post_expert_norm"),
        ("deep_gemm.nvfp4_mega_moe", "any call", lambda: dg.nvfp4_mega_moe(y, w1, w2, good), NotImplementedError,
         "NVFP4"),
        ("deep_gemm.bf16_mega_moe", "any call", lambda: dg.bf16_mega_moe(y, w1, w2, good), NotImplementedError,
         "BF16"),
        ("deep_gemm.mega_moe_pre_dispatch_sm90", "group_size=32",
         lambda: dg.mega_moe_pre_dispatch_sm90(x, idx, wts, *views, num_tokens=1, group_size=32), ValueError,
         "group_size"),
        ("deep_gemm.mega_moe_pre_dispatch_sm90", "routed_scaling_factor=nan",
         lambda: dg.mega_moe_pre_dispatch_sm90(x, idx, wts, *views, num_tokens=1, routed_scaling_factor=math.nan),
         ValueError, "routed_scaling_factor"),
        ("deep_gemm.mega_moe_pre_dispatch_sm90", "num_tokens above the buffer",
         lambda: dg.mega_moe_pre_dispatch_sm90(x, idx, wts, *views, num_tokens=cap + 1), ValueError, "num_tokens"),
        ("deep_gemm.mega_moe_pre_dispatch", "SM90 buffer (FP32 x_sf) with the SM100 K32 staging",
         lambda: dg.mega_moe_pre_dispatch(x, idx, wts, *views, num_tokens=1), ValueError, "buf_x_sf"),
        ("deep_gemm.mega_moe_pre_dispatch", "group_size=16 (NVFP4)",
         lambda: dg.mega_moe_pre_dispatch(x, idx, wts, *views, num_tokens=1, group_size=16), NotImplementedError,
         "group_size"),
        ("deep_gemm.transform_weights_for_mega_moe", "BF16 weights",
         lambda: dg.transform_weights_for_mega_moe(w1[0].float(), w2[0].float()), NotImplementedError, "BF16"),
        ("deep_gemm.transform_scales_for_mega_moe", "any call",
         lambda: dg.transform_scales_for_mega_moe(w1[1], w2[1]), NotImplementedError, "NVFP4"),
        ("deep_ep.Buffer", "low_latency_mode='yes'", lambda: deep_ep.Buffer(group, 0, 1 << 20, low_latency_mode="yes"),
         TypeError, "low_latency_mode"),
        ("deep_ep.Buffer.get_low_latency_rdma_size_hint", "hidden=100",
         lambda: deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 100, 1, 8), ValueError, "hidden"),
        ("deep_ep.Buffer", "num_rdma_bytes in normal mode (the pin's rule)",
         lambda: deep_ep.Buffer(group, 0, 1 << 20), ValueError, "num_rdma_bytes"),
        ("deep_ep.Config", "num_max_nvl_chunked_send_tokens=256 (not below the receive chunk)",
         lambda: deep_ep.Config(20, 256, 256), ValueError, "num_max_nvl_chunked_send_tokens"),
        ("deep_gemm.mega_moe_pre_dispatch_sm90", "int64 topk_idx (the pin takes int32)",
         lambda: dg.mega_moe_pre_dispatch_sm90(x, idx.long(), wts, *views, num_tokens=1), TypeError, "topk_idx"),
        ("deep_gemm.mega_moe_pre_dispatch_sm90", "num_tokens below x's rows (the pin: num_tokens == x.size(0))",
         lambda: dg.mega_moe_pre_dispatch_sm90(x, idx, wts, *views, num_tokens=0), ValueError, "num_tokens"),
        ("gc_moe.get_symm_buffer_for_gc_moe", "mma_type='fp4xfp4'",
         lambda: api.get_symm_buffer_for_gc_moe(group, e, cap, k, h, i, "fp4xfp4", compute_sms=128), ValueError,
         "mma_type"),
        ("gc_moe.get_symm_buffer_for_gc_moe", "dispatch_sms=1",
         lambda: api.get_symm_buffer_for_gc_moe(group, e, cap, k, h, i, "fp8xfp8", dispatch_sms=1, compute_sms=128),
         ValueError, "dispatch_sms"),
    ]
    cells = [_expect("validation", entry, case, call, exc, needle) for entry, case, call, exc, needle in cases]
    good.destroy()
    return cells


def predispatch_cells(group: object) -> list[Cell]:
    """The facade's pre-dispatch staging at the T of the grid, per buffer ``mma_type`` and scale format, byte for
    byte against the originals' arithmetic (the torch model the kernel is tested against)."""
    from gc_moe_compat import deep_gemm as dg
    from gc_moe_compat import quant

    h, i, e, k, cap = 512, 256, 4, 2, 64
    cells = []
    for mma in MMA_TYPES:
        b = dg.get_symm_buffer_for_mega_moe(group, e, cap, k, h, i, mma_type=mma)
        dev = b.x.device  # on a GPU the fused kernel stages, on a host the torch path: both against the model
        for t in (0, 1, 7, b.num_max_tokens_per_rank):
            gen = torch.Generator().manual_seed(t)
            x = torch.randn(t, h, generator=gen, dtype=torch.float32, device="cpu").to(dev, torch.bfloat16)
            idx = torch.randint(-1, e, (t, k), generator=gen, dtype=torch.int32, device="cpu").to(dev)
            w = torch.rand(t, k, generator=gen, dtype=torch.float32, device="cpu").to(dev)
            axes = {"mma_type": mma, "scale_format": "fp32 1x128", "tokens": t, "world_size": 1}
            case = f"buffer mma_type={mma}, T={t}"
            try:
                dg.mega_moe_pre_dispatch_sm90(x, idx, w, b.x, b.x_sf, b.topk_idx, b.topk_weights, num_tokens=t,
                                              routed_scaling_factor=2.5)
                q, s = quant.quantize_fp8_pre_dispatch(x, "fp32x128")
                checks = {
                    "x bytes": torch.equal(b.x[:t].view(torch.uint8), q.view(torch.uint8)),
                    "x_sf": torch.equal(b.x_sf[:t], s),
                    "topk_idx": torch.equal(b.topk_idx[:t], idx.to(b.topk_idx.dtype)),
                    "topk_weights x 2.5": torch.equal(b.topk_weights[:t], w * torch.full_like(w, 2.5)),
                    "rows past T are (-1, 0)": bool((b.topk_idx[t:] == -1).all() and (b.topk_weights[t:] == 0).all()),
                }
                bad = [name for name, ok in checks.items() if not ok]
                cells.append(Cell("pre-dispatch", "deep_gemm.mega_moe_pre_dispatch_sm90", case,
                                  "fail" if bad else "pass", f"differs: {bad}" if bad else "byte-identical",
                                  axes))
            except Exception as exc:  # noqa: BLE001 - the cell records it
                cells.append(Cell("pre-dispatch", "deep_gemm.mega_moe_pre_dispatch_sm90", case, "fail",
                                  f"{type(exc).__name__}: {exc}", axes))
        b.destroy()
    return cells


SWAP_CASES = {  # GC_MOE_SWAP -> (deep_gemm from the facade, deep_ep from the facade) or the error expected
    None: (False, False), "0": (False, False), "1": (True, True), "deep_gemm": (True, False),
    "deep_ep": (False, True), "bogus": "SwapConfigError",
}
_SWAP_PROBE = """
import json, sys
out = {}
for name in ("deep_gemm", "deep_ep"):
    try:
        m = __import__(name)
        out[name] = m.__name__
    except Exception as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)[:200]
print(json.dumps(out))
"""


def swap_cells() -> list[Cell]:
    """Each ``GC_MOE_SWAP`` value in a fresh interpreter (the ``.pth`` hook acts at start-up)."""
    cells = []
    for value, expected in SWAP_CASES.items():
        env = {k: v for k, v in os.environ.items() if k != "GC_MOE_SWAP"}
        if value is not None:
            env["GC_MOE_SWAP"] = value
        proc = subprocess.run([sys.executable, "-c", _SWAP_PROBE], capture_output=True, text=True, env=env,
                              timeout=120, check=False)
        case = f"GC_MOE_SWAP={value if value is not None else '(unset)'}"
        try:
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            cells.append(Cell("swap", "import deep_gemm / deep_ep", case, "fail", f"probe failed: {proc.stderr}"))
            continue
        for pos, name in enumerate(("deep_gemm", "deep_ep")):
            got = seen[name]
            if isinstance(expected, str):
                ok = got.startswith(expected)
                want = f"{expected} raised"
            else:
                facade = got == f"gc_moe_compat.{name}"
                ok = facade if expected[pos] else not facade  # off: the real package, or not importable
                want = "the facade" if expected[pos] else "the original (or not importable)"
            cells.append(Cell("swap", f"import {name}", case, "pass" if ok else "fail", f"want {want}; got {got}",
                              {"swap": value}))
    return cells


def cpu_cells(kinds: Collection[str] = CPU_KINDS) -> list[Cell]:
    """The CPU cells of ``kinds`` (default every CPU kind: what CI runs)."""
    cells = signature_cells() if "signature" in kinds else []
    if {"validation", "pre-dispatch"} & set(kinds):
        with single_rank_group() as group:
            if "validation" in kinds:
                cells += validation_cells(group)
            if "pre-dispatch" in kinds:
                cells += predispatch_cells(group)
    return cells + (swap_cells() if "swap" in kinds else [])


def versions() -> dict[str, object]:
    """torch, CUDA, driver, GPU and every original package found."""
    from gc_moe_compat import originals
    from gc_moe_compat.ab.protocol import _driver_version

    found = {}
    for dist_name in DISTRIBUTIONS:
        try:
            found[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "driver": _driver_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "originals_installed": found,
        "originals_on_path": {name: portable_path(originals.location(name)) for name in originals.NAMES},
    }


def checked_versions(cells: Sequence[Cell], data_dir: Path = DATA_DIR) -> dict[str, dict[str, list[str]]]:
    """Per facade entry point: the original versions its signature was checked against, and every divergence
    the signature cells found (what the facade adds, what an original has that the facade lacks)."""
    out: dict[str, dict[str, list[str]]] = {}
    for module, filename in SIGNATURE_FILES.items():
        data = json.loads((data_dir / filename).read_text())
        for name, per_version in data["names"].items():
            out[f"{module}.{name}"] = {"versions": list(per_version), "divergences": []}
    for c in cells:
        if c.kind != "signature":
            continue
        entry = out.setdefault(c.entry, {"versions": [], "divergences": []})
        if c.case not in entry["versions"]:
            entry["versions"].append(c.case)
        if c.result != "pass" or "adds" in c.detail or "absent" in c.detail:
            entry["divergences"].append(f"{c.case}: {c.result}: {c.detail}")
    return out


def markdown(cells: Sequence[Cell], info: dict[str, object], checked: dict[str, dict[str, list[str]]]) -> str:
    """``compat_matrix.md``: the versions, the counts, one table per kind of cell, the checked versions."""
    lines = ["# GC-MoE compatibility matrix", "",
             f"Produced by `{info.get('command', 'gc-moe-matrix')}` at {info.get('git_sha', '?')} "
             f"({info.get('date', '?')}).", ""]
    if info.get("complete") is False:
        lines += ["**Incomplete**: written before every stage ran (the run was cut short after these cells).", ""]
    if info.get("kinds"):
        lines += [f"**Kinds selected** (`--kinds`): {', '.join(info['kinds'])}; the others were not run.", ""]
    lines += ["| what | version |", "|---|---|"]
    v = info["versions"]
    for key in ("torch", "cuda", "driver", "gpu", "gpus"):
        lines.append(f"| {key} | {v[key]} |")
    for name, ver in v["originals_installed"].items():
        lines.append(f"| {name} (installed) | {ver} |")
    for name, loc in v["originals_on_path"].items():
        lines.append(f"| original `{name}` on sys.path | {loc or 'none'} |")
    counts = {r: sum(c.result == r for c in cells) for r in RESULTS}
    lines += ["", "Cells: " + ", ".join(f"{n} {r}" for r, n in counts.items()), ""]
    for kind in dict.fromkeys(c.kind for c in cells):
        lines += [f"## {kind}", "", "| entry point | case | result | detail |", "|---|---|---|---|"]
        for c in cells:
            if c.kind == kind:
                detail = c.detail.replace("|", "\\|").replace("\n", " ")
                lines.append(f"| `{c.entry}` | {c.case} | {c.result} | {detail[:400]} |")
        lines.append("")
    lines += ["## Original versions each entry point's signature was checked against", "",
              "| entry point | versions | divergences |", "|---|---|---|"]
    for entry, rec in checked.items():
        divergences = "; ".join(rec["divergences"]).replace("|", "\\|") or "none"
        lines.append(f"| `{entry}` | {', '.join(rec['versions']) or '-'} | {divergences} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    from gc_moe_compat.ab.matrix_gpu import TWO_RANK_TIMEOUT_S

    parser = argparse.ArgumentParser(prog="gc-moe-matrix", description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(),
                        help="where compat_matrix.md / .json go (default: the working directory; the checkout's "
                             "committed bench/results/ only when named here)")
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU cells (what CI runs)")
    parser.add_argument("--deepep-src", type=Path,
                        help="a DeepEP checkout: its Buffer signatures, and its tests/legacy/ run unmodified")
    parser.add_argument("--deepgemm-src", type=Path,
                        help="a DeepGEMM checkout: its Mega MoE signatures, and tests/test_mega_moe.py")
    parser.add_argument("--sgl-deepgemm-src", type=Path,
                        help="an sgl-project/DeepGEMM checkout (any branch, e.g. dev): its signatures, and "
                             "tests/test_mega_moe_hopper.py (SM90)")
    parser.add_argument("--suite-timeout", type=int, default=600, help="seconds per original test file")
    parser.add_argument("--suites-not-run", metavar="REASON", default=None,
                        help="record the originals' test suites as 'not run' with REASON instead of running them "
                             "(the checkouts still give their signature cells)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, metavar="KIND", default=None,
                        help=f"only these kinds of cells ({', '.join(KINDS)}; default all), e.g. --kinds layer")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="on a host with one GPU, run the world-size-2 layer cells as 2 ranks sharing it (start "
                             "CUDA MPS first: source scripts/mps.sh; mps_start); without it they are 'not run' there")
    parser.add_argument("--two-rank-timeout", type=float, default=TWO_RANK_TIMEOUT_S, metavar="S",
                        help=f"seconds the two rank processes of the world-size-2 cells may take (default "
                             f"{TWO_RANK_TIMEOUT_S}); past it they are stopped and their unreported cells fail")
    return parser


def selected_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """The kinds of cells a run makes: ``--kinds`` (default every kind), less the GPU kinds with ``--cpu-only``."""
    kinds = args.kinds or KINDS
    return tuple(k for k in KINDS if k in kinds and not (args.cpu_only and k not in CPU_KINDS))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out_dir = args.out_dir
    command = ["gc-moe-matrix", *(sys.argv[1:] if argv is None else argv)]
    meta = {k: v for k, v in result_meta("gc-moe-matrix", [], {}, command=command).items() if k != "partition"}
    kinds = selected_kinds(args)
    info = {**meta, "versions": versions(), **({"kinds": list(kinds)} if args.kinds else {})}
    cells = cpu_cells([k for k in kinds if k in CPU_KINDS])
    for module, root, label in (("deep_ep", args.deepep_src, "DeepEP"), ("deep_gemm", args.deepgemm_src, "DeepGEMM"),
                                ("deep_gemm", args.sgl_deepgemm_src, "sgl-project/DeepGEMM")):
        if root is not None and "signature" in kinds:
            cells += checkout_signature_cells(module, root, label)
    if "layer" in kinds or "suite" in kinds:
        from gc_moe_compat.ab import matrix_gpu

        _write(out_dir, cells, info, complete=False)  # a run cut short keeps the cells it has
    if "layer" in kinds:
        cells += matrix_gpu.layer_cells(args.shared_gpu, args.two_rank_timeout)
        _write(out_dir, cells, info, complete=False)
    if "suite" in kinds:
        if args.suites_not_run:
            cells += [Cell("suite", name, "-", "not run", args.suites_not_run) for name in matrix_gpu.SUITES]
        else:
            cells += matrix_gpu.suite_cells(args.deepep_src, args.deepgemm_src, args.sgl_deepgemm_src,
                                            args.suite_timeout)
    _write(out_dir, cells, info, complete=True)
    counts = {r: sum(c.result == r for c in cells) for r in RESULTS}
    print(f"compat matrix: {len(cells)} cells: " + ", ".join(f"{n} {r}" for r, n in counts.items())
          + f"; wrote {out_dir / 'compat_matrix.md'} and .json")
    for c in cells:
        if c.result == "fail":
            print(f"FAIL {c.kind} {c.entry} {c.case}: {c.detail[:300]}")
    return 1 if counts["fail"] else 0


def _write(out_dir: Path, cells: list[Cell], info: dict[str, object], *, complete: bool) -> None:
    """``compat_matrix.json`` + ``.md`` of the cells so far (``meta.complete`` says whether every stage ran)."""
    checked = checked_versions(cells)
    meta = {**info, "complete": complete}
    write_result(out_dir / "compat_matrix.json",
                 {"meta": meta, "checked_versions": checked, "cells": [asdict(c) for c in cells]})
    (out_dir / "compat_matrix.md").write_text(portable_text(markdown(cells, meta, checked)))
