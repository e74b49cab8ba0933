"""The FP32 references and the seeded workloads: what ``gc-moe-ab`` measures accuracy against (a product feature of
the tools, :mod:`gc_moe_compat.ab`), and what the tests and benchmarks share with it. :mod:`.reference` (the MoE layer,
quantization-faithful and BF16-model), :mod:`.ep_reference` / :mod:`.ep_normal_reference` (DeepEP's low-latency and
normal dispatch / combine), :mod:`.operator_workload` (presets' weights and inputs, staging, every rank's reference).
The core (numerics .. facades, swap) never imports them (tests/tools/test_import_graph.py)."""
