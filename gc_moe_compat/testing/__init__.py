"""What tests, benchmarks and tools share, never imported by shipped modules: the FP32 references
(:mod:`.reference`, :mod:`.ep_reference` for the DeepEP path) and the operator workloads (:mod:`.operator_workload`)."""
