"""What tests, benchmarks and tools share, never imported by shipped modules: the FP32 references
(:mod:`.reference`, :mod:`.ep_reference` for the DeepEP path), workloads (:mod:`.gemm_workload`,
:mod:`.operator_workload`) and the standalone GEMM harness (:mod:`.standalone_gemm`, :mod:`.grouping`)."""
