"""scripts/sass_kstep.py's loop finder on a made-up listing in cuobjdump's format: each MMA is counted in the smallest
backward-branch range holding it (the K loop, not the task loop around it, nor the stage wait's retry loop inside
it), with the opcodes of that range, predicate guards and modifiers stripped."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import sass_kstep  # noqa: E402 - scripts/ is a script folder, put on the path above

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E.CONSTANT R2, desc[UR4][R4.64] ;         /* 0x0000000000027981 */
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R7+URZ], R6 ;
        /*0030*/               @!P1 BRA 0x20 ;
        /*0040*/                   QGMMA.64x96x32.F32.E4M3.E4M3 R72, gdesc[UR20], RZ, !UPT ;
        /*0050*/                   QGMMA.64x96x32.F32.E4M3.E4M3 R72, gdesc[UR24], R72, gsb0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0070*/                   LDS R8, [R9+0x100] ;
        /*0080*/                   FMUL R10, R2, R8 ;
        /*0090*/                   FFMA R3, R72, R10, R3 ;
        /*00a0*/                @P2 BRA 0x10 ;
        /*00b0*/                   STG.E desc[UR4][R4.64], R3 ;
        /*00c0*/                   BRA `(.L_x_1) 0x0 ;
        /*00d0*/                   EXIT ;
"""


def test_the_k_loop_is_the_smallest_range_holding_the_mmas() -> None:
    loops = sass_kstep.mma_loops(LISTING)
    assert [(loop.start, loop.end) for loop in loops] == [(0x10, 0xA0)]
    (loop,) = loops
    assert loop.mma == "QGMMA.64x96x32.F32.E4M3.E4M3" and loop.mmas == 2
    assert loop.total == 10  # 0x10 ... 0xa0, the retry loop's two instructions included
    assert loop.counts["FFMA"] == 1 and loop.counts["FMUL"] == 1 and loop.counts["LDS"] == 1
    assert loop.counts["BRA"] == 2 and loop.counts["QGMMA"] == 2


def test_opcodes_lose_guards_and_modifiers() -> None:
    assert sass_kstep.opcode("@!P1 BRA 0x20") == "BRA"
    assert sass_kstep.opcode("LDG.E.CONSTANT R2, desc[UR4][R4.64]") == "LDG"


def test_the_table_scales_to_256_weight_rows() -> None:
    (loop,) = sass_kstep.mma_loops(LISTING)
    rows = sass_kstep.table("k", [loop], warps=8, weight_rows=128)
    assert rows[-1].endswith("| 80 | 160 |")  # 10 per warp x 8 warps, twice for 256 rows
