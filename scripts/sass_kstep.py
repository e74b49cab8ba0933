"""Static machine-code count of the grouped GEMM's K loop: role2's consumer warps against the original SM90 Mega MoE's
math warps, per K step of 128 (no GPU needed).

Issue 30's large-T misses left one reading to check by count: that role2's consumers spend more instructions per
weight byte than the original's (their promotions into a second accumulator set against the original's rescaled
single set). This builds role2 (FP8xFP8, operator mode, pipelined) at each ``--bm`` through the project's own JIT,
and, with ``--original-src`` (a sgl-project/DeepGEMM checkout: its ``deep_gemm/include`` and
``third-party/cutlass/include``), one instantiation of the original's ``sm90_fp8_mega_moe_impl`` with the template
arguments given by ``--original-args`` (default: what its heuristic picks at DeepSeek-V3's EP8 share, T = 256 per
rank, 64 rows per expert: BLOCK_M 128 tokens, BLOCK_N 256 weight rows, four math warpgroups at 112 registers, the
accumulator reused as the final one). Both cubins are disassembled (``cuobjdump -sass``) and every loop whose body
holds tensor-core MMAs (``QGMMA``) and no inner loop is counted: its static instructions per iteration (one K step
of 128) and the floating-point, shared-load and special-function ones among them. Static counts include the
not-taken paths inside a body (a stage wait's retry, a timeout report), so each is an upper bound of what a warp
issues per K step; the per-SM figure multiplies by the math warps of a CTA. A weight K step is 256 rows x 128 bytes
in both kernels, so per-SM instructions per K step compare the issue work per weight byte.

``python scripts/sass_kstep.py [--bm 64 96] [--original-src PATH] [--cuobjdump PATH] [--out FILE]``
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gc_moe_compat.compute_paths import PATHS
from gc_moe_compat.operator.ring import DEFAULT_GEOMETRY
from gc_moe_compat.operator.sm90.role2_gemm import role2_defines
from gc_moe_compat.runtime import jit

ROLE2_CONSUMER_WARPS = 8  # two consumer warpgroups (the producer warpgroup issues no MMA)
ROLE2_ROWS = DEFAULT_GEOMETRY.w1_rows  # weight rows per task, the rows of every K step (W1 and W2 alike)

# The original's template arguments in its order (sm90_fp8_mega_moe_impl), at DeepSeek-V3's EP8 share (H 7168,
# I 2048, 32 local experts, top-8), one rank, 2048 tokens of capacity, T = 256 per rank on 8 ranks: 64 expected rows
# per expert, so BLOCK_M 128 / BLOCK_N 256 and 512 math threads; pool and SF-pool sizes from its layout helpers.
ORIGINAL_ARGS = ("2048, 7168, 2048, 32, 8, 32, 128, 256, 128, kPool, kSfPool, 4, 64, 64, 512, 132, 1, 10.0f, true, "
                 "112, true, true, false, true")
ORIGINAL_MATH_WARPS = 16  # 512 math threads
ORIGINAL_UNIT = """#include <deep_gemm/impls/sm90_fp8_mega_moe.cuh>
using namespace deep_gemm;
constexpr uint32_t kPool = layout::get_num_max_pool_tokens<uint32_t>(1, 2048, 8, 32);
constexpr uint32_t kSfPool = layout::get_num_padded_sf_pool_tokens<uint32_t>(kPool, {block_m});
static void instantiate() {{ (void)reinterpret_cast<void*>(&sm90_fp8_mega_moe_impl<{args}>); }}
"""

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA (?:`\()?0x([0-9a-f]+)")


@dataclass(frozen=True)
class KLoop:
    """One innermost MMA loop of a disassembled kernel: its address range, MMA shape and per-iteration counts."""

    start: int
    end: int
    mma: str
    mmas: int
    counts: collections.Counter

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def opcode(text: str) -> str:
    """The opcode of one SASS instruction without its predicate guard or modifiers (``@!P1 BRA ...`` -> ``BRA``)."""
    words = text.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def mma_loops(sass: str) -> list[KLoop]:
    """The innermost MMA loops: for each QGMMA, the smallest backward-branch range holding it (a stage wait's retry
    loop inside a K loop issues no MMA, so the K loop is what is found; an outer task loop only where no K loop is)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    backs = [(int(b.group(1), 16), at) for at, text in code if (b := _BRANCH.search(text)) and int(b.group(1), 16) < at]
    innermost = set()
    for at, text in code:
        if "QGMMA" in text:
            holding = [(end - start, start, end) for start, end in backs if start <= at <= end]
            if holding:
                innermost.add(min(holding)[1:])
    loops = []
    for start, end in sorted(innermost):
        body = [text for at, text in code if start <= at <= end]
        mmas = [text.split()[0] for text in body if "QGMMA" in text]
        loops.append(KLoop(start, end, mmas[0], len(mmas), collections.Counter(opcode(t) for t in body)))
    return loops


def disassemble(cubin: Path, cuobjdump: str) -> str:
    return subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def compile_original(src: Path, args: str, workdir: Path) -> Path:
    """One instantiation of the original's kernel, compiled for sm_90a with the project's nvcc."""
    unit, cubin = workdir / "original_mega_moe.cu", workdir / "original_mega_moe.cubin"
    unit.write_text(ORIGINAL_UNIT.format(args=args, block_m=args.split(",")[6].strip()))  # BLOCK_M: 7th
    cmd = [str(jit.find_nvcc()), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++20", "-O3",
           "--expt-relaxed-constexpr", f"-I{src / 'deep_gemm/include'}", f"-I{src / 'third-party/cutlass/include'}",
           "-o", str(cubin), str(unit)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return cubin


def table(name: str, loops: list[KLoop], warps: int, weight_rows: int) -> list[str]:
    """Markdown rows of one kernel's K loops; the last column scales the per-SM count to role2's 256 weight rows per
    K step (the original's BLOCK_N 256), so that kernels of other tile widths compare per weight byte."""
    rows = [f"## {name} ({warps} math warps per CTA, {weight_rows} weight rows per K step)",
            "| loop | MMA | MMAs | instructions per warp | FFMA | FMUL | LDS | MUFU | per SM | per SM, 256 rows |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for loop in loops:
        c, per_sm = loop.counts, loop.total * warps
        rows.append(f"| {loop.start:#x}-{loop.end:#x} | {loop.mma.removeprefix('QGMMA.')} | {loop.mmas} | "
                    f"{loop.total} | {c['FFMA']} | {c['FMUL']} | {c['LDS']} | {c['MUFU']} | {per_sm} | "
                    f"{per_sm * ROLE2_ROWS // weight_rows} |")
    return rows


def find_cuobjdump(given: str | None) -> str:
    for candidate in (given, shutil.which("cuobjdump"), str(jit.find_nvcc().parent / "cuobjdump")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("cuobjdump: not found (pass --cuobjdump PATH; the nvidia-cuda-cuobjdump wheel ships one)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bm", type=int, nargs="+", default=[64, 96], help="role2 blocks to build (FP8xFP8)")
    parser.add_argument("--original-src", type=Path, help="a sgl-project/DeepGEMM checkout to build the original from")
    parser.add_argument("--original-args", default=ORIGINAL_ARGS, help="the original's template arguments")
    parser.add_argument("--original-math-warps", type=int, default=ORIGINAL_MATH_WARPS)
    parser.add_argument("--cuobjdump", help="cuobjdump to disassemble with (default: PATH, then beside nvcc)")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    lines = [f"nvcc {jit.find_nvcc()}; static instructions per K step (128) of each innermost MMA loop"]
    for bm in args.bm:
        cubin = jit.compile_cubin(PATHS["fp8xfp8"].kernel, role2_defines(bm, pipelined=True))
        lines += ["", *table(f"role2 FP8xFP8 BM = {bm} ({cubin.path.name})",
                             mma_loops(disassemble(cubin.path, cuobjdump)), ROLE2_CONSUMER_WARPS, ROLE2_ROWS)]
    if args.original_src:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = compile_original(args.original_src.resolve(), args.original_args, Path(tmp))
            lines += ["", *table(f"original sm90_fp8_mega_moe_impl<{args.original_args}>",
                                 mma_loops(disassemble(cubin, cuobjdump)), args.original_math_warps,
                                 int(args.original_args.split(",")[7]))]  # BLOCK_N: 8th
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
