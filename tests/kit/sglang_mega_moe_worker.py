"""One rank running SGLang 0.5.23's own Hopper Mega MoE code against the swapped ``deep_gemm`` (started through
torchrun by tests/facades/test_sglang_mega_moe_sm90.py, and on CPU by tests/facades/test_sglang_mega_moe_host.py).

The process starts with ``GC_MOE_SWAP=deep_gemm``, so ``import deep_gemm`` inside SGLang's files is gc-moe-compat's
facade (checked). SGLang's ``mega_moe_sm90.py`` and ``mega_moe.py`` are executed from their sources with only the
unrelated imports stubbed (``sglang_kit.STUBS``). Per rank: random block-FP8 experts (``operator_kit.make_weights``,
every rank builds every rank's, seeded) are handed to SGLang's ``build_sm90_mega_moe_experts_weights`` as its FusedMoE
layer holds them; SGLang's ``_get_mega_moe_symm_buffer`` creates the buffer as the deployment does. Then, per case,
the BF16 hidden states and top-k routing of every rank (seeded) go through one of:

* ``sm90``: ``run_sm90_mega_routed`` (SGLang's Hopper function: pre-dispatch, ``fp8_mega_moe``) on that buffer;
* ``routed``: ``run_mega_routed_experts`` (SGLang's entry above it: int32 conversion, buffer cache, ``num_tokens = 0``
  with no routing tensors), which must reuse the same buffer;
* ``facade``: ``deep_gemm.mega_moe_pre_dispatch_sm90`` + ``deep_gemm.fp8_mega_moe`` with
  ``cumulative_local_expert_recv_stats`` and ``fast_math=False`` (SGLang passes neither; the counts must equal the
  reference's received rows per local expert);
* ``capture``: ``run_mega_routed_experts`` captured in a ``torch.cuda.graph`` after one eager warm-up (what SGLang's
  graph runner does), replayed with fresh inputs copied into the static tensors.

Every rank's ``y`` is compared with the quantization-faithful reference of the whole expert-parallel layer
(``expert_parallel_reference``, FP32 1x128 activations, ``fp32_128`` intermediate, the case's clamp, weights scaled by
``routed_scaling_factor``) at BENCH_PROTOCOL.md's bounds; the staged buffer rows are checked bit for bit against the
reference's own quantization. A barrier before each call stands for the collectives SGLang runs between MoE layers.
On a host without CUDA (suite ``dry-run``) every call must stop at the operator launch (host memory) after staging;
the staging and everything before it is checked. With ``--simulate-launch`` (CPU only) the launch is replaced by the
reference computed from the staged rows and the operator's weights (:func:`_host_launch`), so the checks after a
call (accuracy, statistics) run too: a test of this worker, not of the kernels. Prints one line per case, the mode, and
``PASS rank <r>``.
"""

from __future__ import annotations

from dataclasses import dataclass

import sglang_kit
import torch
import torch.distributed as dist
from operator_kit import check_accuracy, make_inputs, make_weights, preset_dims
from two_rank import finish, join, suite_parser

from gc_moe_compat import layouts, quant
from gc_moe_compat.operator import api
from gc_moe_compat.operator.sm90 import layer
from gc_moe_compat.references.reference import (
    ExpertWeights,
    dispatch_plan,
    expert_parallel_reference,
    recv_counts,
)

CLAMP = 10.0


@dataclass(frozen=True)
class Case:
    """One layer call on every rank: SGLang entry ``path``, routing ``kind``, tokens per rank, scaling, clamp."""

    path: str
    kind: str
    tokens: tuple[int, ...]
    factor: float = 1.0
    clamp: float | None = CLAMP


def _local_cases() -> list[Case]:
    return [
        *(Case("sm90", "uniform", (t,), 2.5 if t % 2 == 0 else 1.0) for t in (1, 8, 64, 256)),
        Case("sm90", "zipf", (33,)), Case("sm90", "holes", (17,), 2.5), Case("sm90", "uniform", (0,)),
        Case("routed", "uniform", (5,), 2.5), Case("routed", "one_expert", (64,)),
        Case("routed", "uniform", (16,), clamp=None), Case("routed", "uniform", (0,)),
        Case("facade", "uniform", (40,)), Case("facade", "zipf", (7,), 2.5),
        Case("capture", "uniform", (8,), 2.5),
    ]


def _ep2_cases() -> list[Case]:
    return [
        Case("sm90", "uniform", (1, 1)), Case("sm90", "uniform", (64, 5), 2.5), Case("sm90", "uniform", (0, 37)),
        Case("sm90", "uniform", (256, 256)), Case("sm90", "holes", (17, 3)),
        Case("routed", "zipf", (3, 256), 2.5), Case("routed", "uniform", (0, 0)),
        Case("routed", "one_expert", (32, 32), clamp=None),
        Case("facade", "uniform", (40, 9)), Case("facade", "zipf", (1, 70), 2.5),
        Case("capture", "uniform", (8, 8), 2.5),
    ]


SUITES = {
    # name: (world size, preset, SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK, cases)
    "local": (1, "dsv41-flash", 256, _local_cases()),
    "local-8192": (1, "dsv41-flash", 8192, [Case("routed", "uniform", (1,)), Case("routed", "uniform", (300,), 2.5),
                                            Case("routed", "zipf", (2048,))]),
    "ep2": (2, "dsv41-flash", 256, _ep2_cases()),
    "ep2-8192": (2, "dsv41-flash", 8192, [Case("routed", "uniform", (1, 2048), 2.5), Case("routed", "zipf", (300, 0))]),
    "dry-run": (1, "tiny", 256, [Case("sm90", "uniform", (5,), 2.5), Case("sm90", "holes", (3,)),
                                 Case("routed", "uniform", (4,)), Case("routed", "uniform", (0,)),
                                 Case("facade", "zipf", (6,), 2.5)]),
}


def _host_launch(fn, buffer, y, w1, w2, t, model, plan, activation_alpha, activation_clamp, *, fast_math=True,
                 recv_stats=None, shared=None) -> None:
    """Stand-in for ``api._launch`` on a host without CUDA (``--simulate-launch``): one rank's layer from the
    staged rows and the operator's weights (L1 de-interleaved back; ``shared``: the canonical shared pairs, role4)
    by the reference, and the statistics update."""
    idx, e = buffer.topk_idx[:t], buffer.shape.num_experts
    l1 = ExpertWeights("fp8_block128", layouts.deinterleave_gate_up(w1.payload), w1.scales)
    l2 = ExpertWeights("fp8_block128", w2.payload, w2.scales)
    shared = None if shared is None else tuple(ExpertWeights("fp8_block128", *pair) for pair in shared)
    result = expert_parallel_reference([(buffer.x[:t], buffer.x_sf[:t])], [idx], [buffer.topk_weights[:t]], [l1],
                                       [l2], shared=shared, activation_clamp=activation_clamp,
                                       activation_alpha=activation_alpha, intermediate_quant="fp32_128")[0]
    y.copy_(result.y)
    if recv_stats is not None:
        recv_stats += recv_counts(dispatch_plan([idx], e))[0]


@dataclass(frozen=True)
class Inputs:
    """One rank's layer inputs as SGLang holds them: BF16 hidden states, top-k ids (global, -1 unused), weights."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


class Run:
    """The loaded SGLang modules, the experts and buffer of this rank, and the reference data of every rank."""

    def __init__(self, suite: str, simulate_launch: bool) -> None:
        world, self.preset, self.capacity, self.cases = SUITES[suite]
        self.dry = not torch.cuda.is_available()
        self.simulated = simulate_launch
        if simulate_launch:
            assert self.dry, "--simulate-launch replaces the operator launch on a host without CUDA only"
            api._launch = _host_launch
        if self.dry:
            dist.init_process_group("gloo")
            self.device = torch.device("cpu")
        else:
            join()
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        assert self.world == world, f"suite {suite} runs on {world} ranks, got {self.world}"
        assert self.dry == (suite == "dry-run"), f"suite {suite} on a host with CUDA={not self.dry}"
        self.group = dist.group.WORLD
        self.sgl = sglang_kit.load(sglang_kit.source_dir(), self.group, self.capacity, sglang_kit.device_sm())
        import deep_gemm

        assert deep_gemm.__name__ == "gc_moe_compat.deep_gemm", f"GC_MOE_SWAP did not swap deep_gemm: {deep_gemm}"
        self.deep_gemm = deep_gemm
        if self.dry:
            deep_gemm.set_num_sms(132)  # no device to ask; SGLang's buffer key reads get_num_sms()
        self.e, self.k, self.h, self.inter = preset_dims(self.preset)
        self.num_experts = self.e * self.world
        self.weights = [make_weights(self.preset, r, self.device) for r in range(self.world)]
        mine = self.weights[self.rank]
        self.experts = sglang_kit.experts(mine.l1, mine.l2, self.num_experts)
        self.sgl.sm90.build_sm90_mega_moe_experts_weights(self.experts)
        assert self.sgl.sm90.is_sm90_fp8_mega_moe_available(self.experts), "SGLang's Hopper gate refused"
        assert self.sgl.mega_moe.is_mega_moe_experts_ready(self.experts)
        l1_built = self.experts.mega_l1_weights[0].view(torch.uint8)
        assert torch.equal(l1_built, layouts.interleave_gate_up(mine.l1.payload).view(torch.uint8))
        self.buf = self.sgl.mega_moe._get_mega_moe_symm_buffer(
            self.group, num_experts=self.num_experts, num_max_tokens_per_rank=self.capacity, num_topk=self.k,
            hidden=self.h, intermediate_hidden=self.inter, num_shared_experts=0,
            mma_type=self.sgl.mega_moe._mega_moe_mma_type(self.experts))
        assert isinstance(self.buf, deep_gemm.SymmBuffer) and self.buf.mma_type == "fp8xfp4"
        self.stats = torch.zeros(self.e, dtype=torch.int32, device=self.device)
        self.stats_expected = torch.zeros(self.e, dtype=torch.int32)

    # -------------------------------------------------------------------------------------------------- inputs
    def inputs(self, kind: str, tokens: tuple[int, ...], seed: int) -> list[Inputs]:
        """Every rank's inputs for one call (identical on every rank for the same seed)."""
        out = []
        for r, t in enumerate(tokens):
            s = seed * self.world + r
            routing = make_inputs(kind, t, self.num_experts, self.k, self.h, seed=s, device=self.device)
            gen = torch.Generator().manual_seed(10_000 + s)
            x = torch.randn(t, self.h, generator=gen).to(self.device, torch.bfloat16)
            out.append(Inputs(x, routing.topk_idx, routing.topk_weights.float()))
        return out

    def reference(self, case: Case, inputs: list[Inputs]) -> torch.Tensor:
        """This rank's reference ``y``; also checks that the staged buffer rows are the reference's quantization."""
        # The activations as the pre-dispatch stages them (the originals' reciprocal-multiply FP32 1x128 recipe).
        xs = [quant.quantize_fp8_pre_dispatch(i.x, "fp32x128") for i in inputs]
        weights = [i.topk_weights * case.factor if case.factor != 1.0 else i.topk_weights for i in inputs]
        mine, t = inputs[self.rank], inputs[self.rank].x.shape[0]
        if t:
            (q, sf), buf = xs[self.rank], self.buf
            assert torch.equal(buf.x[:t].view(torch.uint8), q.view(torch.uint8)), "staged x differs"
            assert torch.equal(buf.x_sf[:t], sf), "staged x_sf differs"
            assert torch.equal(buf.topk_idx[:t], mine.topk_idx.long()), "staged topk_idx differs"
            assert torch.equal(buf.topk_weights[:t], weights[self.rank]), "staged topk_weights differs"
        else:
            assert bool((self.buf.topk_idx[0] == -1).all()), "T = 0: row 0 must route nowhere"
        results = expert_parallel_reference(
            xs, [i.topk_idx for i in inputs], weights, [w.l1 for w in self.weights], [w.l2 for w in self.weights],
            activation_clamp=case.clamp, intermediate_quant="fp32_128")
        return results[self.rank].y

    # ---------------------------------------------------------------------------------------------------- calls
    def call(self, case: Case, mine: Inputs, inputs: list[Inputs]) -> torch.Tensor:
        """One layer call through the case's SGLang entry; returns this rank's ``y [T, H]``."""
        t = mine.x.shape[0]
        kw = dict(activation_clamp=case.clamp, routed_scaling_factor=case.factor)
        if case.path == "sm90":  # SGLang's run_mega_routed_experts hands it int32 ids and float32 weights
            return self.sgl.sm90.run_sm90_mega_routed(
                self.experts, mine.x, mine.topk_idx.to(torch.int32), mine.topk_weights, self.buf, t,
                hidden_size=self.h, **kw)
        if case.path == "routed":
            ids, weights = (mine.topk_idx, mine.topk_weights) if t else (None, None)
            return self.sgl.mega_moe.run_mega_routed_experts(
                self.experts, mine.x, ids, weights, hidden_size=self.h, intermediate_size=self.inter, top_k=self.k,
                num_tokens=t, **kw)
        if case.path == "facade":
            dg, buf = self.deep_gemm, self.buf
            dg.mega_moe_pre_dispatch_sm90(mine.x, mine.topk_idx.to(torch.int32), mine.topk_weights, buf.x, buf.x_sf,
                                          buf.topk_idx, buf.topk_weights, num_tokens=t, group_size=128,
                                          routed_scaling_factor=case.factor)
            y = torch.empty(max(t, 1), self.h, dtype=torch.bfloat16, device=self.device)
            plan = dispatch_plan([i.topk_idx.cpu() for i in inputs], self.num_experts)
            self.stats_expected += recv_counts(plan)[self.rank]
            dg.fp8_mega_moe(y, self.experts.mega_l1_weights, self.experts.mega_l2_weights, buf,
                            cumulative_local_expert_recv_stats=self.stats, recipe=(128, 128, 128),
                            activation="swiglu", activation_clamp=case.clamp, fast_math=False)
            return y[:t]
        raise ValueError(f"path: {case.path!r}")

    def check(self, case: Case, what: str, y: torch.Tensor, inputs: list[Inputs]) -> None:
        t = inputs[self.rank].x.shape[0]
        assert tuple(y.shape) == (t, self.h) and y.dtype == torch.bfloat16, f"{what}: y {y.dtype} {tuple(y.shape)}"
        y_ref = self.reference(case, inputs)
        if t and (self.simulated or not self.dry):
            m = check_accuracy(y, y_ref, f"rank {self.rank} {what}", self.preset)
            print(f"rank {self.rank}: {what}: cosine {m['cosine']:.7f} processed {m['processed_diff']:.2e}",
                  flush=True)
        else:
            print(f"rank {self.rank}: {what}: staged inputs checked{'' if self.dry else ' (T = 0)'}", flush=True)

    def run_case(self, i: int, case: Case) -> None:
        what = (f"{self.preset} cap={self.capacity} {case.path} {case.kind} T={case.tokens} f={case.factor} "
                f"clamp={case.clamp}")
        if case.path == "capture":
            self.run_capture(i, case, what)
            return
        inputs = self.inputs(case.kind, case.tokens, seed=i)
        dist.barrier()
        try:
            y = self.call(case, inputs[self.rank], inputs)
        except RuntimeError as err:
            if not (self.dry and "lives in host memory" in str(err)):
                raise
            y = torch.empty(inputs[self.rank].x.shape[0], self.h, dtype=torch.bfloat16)  # stopped at the launch
        if not self.dry:
            torch.cuda.synchronize()
        self.check(case, what, y, inputs)

    def run_capture(self, i: int, case: Case, what: str) -> None:
        """SGLang's decode pattern: eager warm-up, capture, replays with fresh inputs in the static tensors."""
        static = self.inputs(case.kind, case.tokens, seed=i)[self.rank]
        static = Inputs(static.x.clone(), static.topk_idx.clone(), static.topk_weights.clone())
        routed = Case("routed", case.kind, case.tokens, case.factor, case.clamp)
        dist.barrier()
        self.call(routed, static, [])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = self.call(routed, static, [])
        for rep in range(3):
            inputs = self.inputs(case.kind, case.tokens, seed=1000 + 10 * i + rep)
            mine = inputs[self.rank]
            static.x.copy_(mine.x)
            static.topk_idx.copy_(mine.topk_idx)
            static.topk_weights.copy_(mine.topk_weights)
            y_static.fill_(float("nan"))
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            layer.raise_for_layer_status(self.buf.workspace, f"{what} replay {rep}")
            self.check(case, f"{what} replay {rep}", y_static, inputs)

    def finish(self) -> None:
        if any(c.path == "facade" for c in self.cases) and (self.simulated or not self.dry):
            got = self.stats.cpu()
            assert torch.equal(got, self.stats_expected), (f"cumulative_local_expert_recv_stats {got.tolist()} != "
                                                          f"reference {self.stats_expected.tolist()}")
            print(f"rank {self.rank}: cumulative_local_expert_recv_stats = reference ({int(got.sum())} rows)",
                  flush=True)
        buffers = self.sgl.mega_moe._MEGA_MOE_SYMM_BUFFER
        assert list(buffers.values()) == [self.buf], f"SGLang's buffer cache holds {len(buffers)} buffers"


def main() -> None:
    parser = suite_parser(sorted(SUITES), description=__doc__.splitlines()[0])
    parser.add_argument("--simulate-launch", action="store_true", help="CPU only: the reference stands in for the "
                        "operator launch (tests this worker's checks, not the kernels)")
    args = parser.parse_args()
    run = Run(args.suite, args.simulate_launch)
    for i, case in enumerate(run.cases):
        run.run_case(i, case)
    run.finish()
    print(f"rank {run.rank}: mode: {'simulated launch' if run.simulated else 'dry run' if run.dry else 'GPU'}",
          flush=True)
    finish(run.rank)


if __name__ == "__main__":
    main()
