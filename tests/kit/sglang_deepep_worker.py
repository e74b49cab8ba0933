"""Worker of tests/facades/test_sglang_deepep.py: SGLang 0.5.23's own ``DeepEPDispatcher`` (low-latency mode) against
the swapped ``deep_ep`` (``GC_MOE_SWAP=deep_ep``), bit for bit against :mod:`gc_moe_compat.references.ep_reference`.

Per rank: SGLang builds its DeepEP buffer (``DeepEPBuffer.get_deepep_buffer``: ``Buffer.get_low_latency_rdma_size_hint``
and ``Buffer(...)``), dispatches decode tokens (FP8 with FP32 1x128 scales, as on Hopper with DeepGEMM, and BF16),
the test stands in for the expert GEMMs, and SGLang combines; with and without SGLang's receive hooks, over several
batches. ``--suite auto``: SGLang's default ``--deepep-mode auto`` sizes one buffer for both modes (normal-mode
``num_nvl_bytes`` as well as the low-latency RDMA bytes) and runs its decode batches in low-latency mode through it.
"""

from __future__ import annotations

import os
import types

import sglang_deepep_kit as kit
import sglang_kit
import torch
import torch.distributed as dist
from two_rank import run_suite

from gc_moe_compat.references.ep_reference import combine_reference, ll_quantize, receive_plan

TMAX, HIDDEN, TOPK, EXPERTS_PER_RANK = 64, 2048, 8, 16


def batch(seed: int, ranks: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's hidden states, top-k ids (with -1 holes) and weights, from one seed."""
    gen = torch.Generator().manual_seed(seed)
    experts = EXPERTS_PER_RANK * ranks
    xs, ids, ws = [], [], []
    for _ in range(ranks):
        xs.append(torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(experts, generator=gen)[:TOPK] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, TOPK, dtype=torch.int64)
        ids.append(torch.where(torch.rand(tokens, TOPK, generator=gen) < 0.1, -1, idx))
        ws.append(torch.rand(tokens, TOPK, generator=gen))
    return xs, ids, ws


def expert_stand_in(hidden: torch.Tensor, scales: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """What the expert GEMMs would hand to combine: the dequantized rows times (local expert + 1), BF16; rows past
    ``masked_m`` are NaN (a combine that read them would show)."""
    rows = hidden.float()
    if scales is not None:
        rows = rows * scales.float().repeat_interleave(128, dim=-1)
    factor = torch.arange(1, hidden.shape[0] + 1, device=hidden.device, dtype=torch.float32).view(-1, 1, 1)
    out = (rows * factor).to(torch.bfloat16)
    valid = torch.arange(hidden.shape[1], device=hidden.device).view(1, -1) < counts.view(-1, 1)
    return torch.where(valid.unsqueeze(-1), out, torch.full_like(out, float("nan")))


def run_batches(deepep: object, rank: int, ranks: int, use_fp8: bool, hook: bool,
                mode: object = kit.DeepEPMode.LOW_LATENCY) -> None:
    kit.DEPLOYMENT.output_dtype = kit.DispatcherOutputDtype.FP8 if use_fp8 else kit.DispatcherOutputDtype.BF16
    dispatcher = deepep.DeepEPDispatcher(
        dist.group.WORLD, router_topk=TOPK, permute_fusion=True, num_experts=EXPERTS_PER_RANK * ranks,
        num_local_experts=EXPERTS_PER_RANK, hidden_size=HIDDEN, params_dtype=torch.bfloat16,
        deepep_mode=mode, return_recv_hook=hook)
    assert dispatcher._low_latency_dispatcher.use_fp8 == use_fp8
    for step, tokens in enumerate((TMAX, 1, 37, 0, TMAX)):
        xs, ids, ws = batch(100 * step + 7 * use_fp8 + hook, ranks, tokens)
        plan = receive_plan(ids, EXPERTS_PER_RANK * ranks)
        out = dispatcher.dispatch(xs[rank].cuda(), kit.TopKOutput(ws[rank].cuda(), ids[rank].cuda(), None))
        counts = [len(rows) for rows in plan.rows[rank]]
        assert out.masked_m.tolist() == counts, (out.masked_m.tolist(), counts)
        quant = [ll_quantize(x) for x in xs]
        for le, rows in enumerate(plan.rows[rank]):
            if not rows:
                continue
            got = out.hidden_states[le, :len(rows)].cpu()
            if use_fp8:
                want = torch.stack([quant[s][0][t] for s, t, _ in rows])
                want_s = torch.stack([quant[s][1][t] for s, t, _ in rows])
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"fp8 rows, expert {le}"
                assert torch.equal(out.hidden_states_scale[le, :len(rows)].cpu(), want_s), f"scales, expert {le}"
            else:
                want = torch.stack([xs[s][t] for s, t, _ in rows])
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"bf16 rows, expert {le}"
        y = expert_stand_in(out.hidden_states, out.hidden_states_scale, out.masked_m)
        gathered = [torch.empty_like(y) for _ in range(ranks)]
        dist.all_gather(gathered, y)
        combined = dispatcher.combine((y, out.topk_ids, out.topk_weights))
        torch.cuda.synchronize()
        want = combine_reference(rank, ids[rank], ws[rank], [g.cpu() for g in gathered], plan)
        assert not combined.isnan().any(), "combine read a row past masked_m or left an element unwritten"
        assert torch.equal(combined.cpu().view(torch.int16), want.view(torch.int16)), f"combine, batch {step}"
    print(f"rank {rank}: SGLang DeepEPDispatcher {mode} use_fp8={use_fp8} hook={hook}: 5 batches bit-exact",
          flush=True)


def load_deepep() -> types.ModuleType:
    """SGLang's ``token_dispatcher/deepep.py`` loaded against the swapped ``deep_ep`` (both checked)."""
    assert os.environ.get("GC_MOE_SWAP") == "deep_ep"
    deepep = kit.load(sglang_kit.source_dir(), dist.group.WORLD, TMAX)
    assert deepep.Buffer.__module__.startswith("gc_moe_compat.deep_ep"), deepep.Buffer.__module__
    return deepep


def suite_low_latency(rank: int, ranks: int) -> None:
    deepep = load_deepep()
    for use_fp8 in (True, False):
        for hook in (False, True):
            run_batches(deepep, rank, ranks, use_fp8, hook)
            deepep.DeepEPBuffer._state().buffer = None  # SGLang keeps one buffer per process; rebuild per case


def suite_auto(rank: int, ranks: int) -> None:
    deepep = load_deepep()
    run_batches(deepep, rank, ranks, use_fp8=True, hook=False, mode=kit.DeepEPMode.AUTO)
    buffer = deepep.DeepEPBuffer._state().buffer
    assert buffer.num_nvl_bytes > 0 and buffer.num_rdma_bytes > 0, (buffer.num_nvl_bytes, buffer.num_rdma_bytes)
    print(f"rank {rank}: --deepep-mode auto buffer num_nvl_bytes={buffer.num_nvl_bytes} "
          f"num_rdma_bytes={buffer.num_rdma_bytes}", flush=True)


if __name__ == "__main__":
    run_suite({"low_latency": suite_low_latency, "auto": suite_auto})
