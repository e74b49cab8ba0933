"""bench/profile_layer_sm90.py, one point of the one-rank Mega MoE layer for Nsight Compute: its argument checks, and
on an H200 the profiled calls' output bit-identical to the first call's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import profile_layer_sm90 as profile_layer  # noqa: E402 - bench/ is a script folder, put on the path above

from gc_moe_compat.ab import model_config  # noqa: E402


def test_defaults_are_one_call_at_256_tokens() -> None:
    args = profile_layer.parse_args([])
    assert (args.preset, args.model_config, args.tokens, args.calls) == (None, None, 256, 1)


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--calls", "0"], ["--preset", "nope"],
                                  ["--preset", "glm52", "--model-config", "x.json"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        profile_layer.parse_args(argv)


@pytest.mark.gpu
def test_the_profiled_calls_run_the_layer_unchanged(group: dist.ProcessGroup) -> None:
    w = model_config.explicit(2048, 1024, 64, 8, ep_size=8)
    profile_layer.profile(w, 64, 2, group)  # raises where the last call's output is not the first's
