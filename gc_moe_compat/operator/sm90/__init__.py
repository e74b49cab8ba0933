"""The SM90 operator: :mod:`.layer` builds the three-node graph of one replay from the roles, each a host module
named like its kernel file: :mod:`.role1_dispatch` (``kernels/sm90/role1_dispatch.cu``), :mod:`.role2_gemm`
(``kernels/sm90/role2_gemm_fp8xfp8.cu`` / ``role2_gemm_fp8xfp4.cu``), :mod:`.role3_finalize`
(``kernels/sm90/role3_finalize.cu``); :mod:`.fp4_layout` is the FP4 weight unit order role2's kernel decodes."""
