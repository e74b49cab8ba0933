"""``gc-moe-ab`` and ``gc-moe-matrix``: the tools an SGLang operator runs to decide whether to keep GC-MoE on.

* :mod:`.cli` - ``gc-moe-ab``: the original Mega MoE kernels and GC-MoE side by side on identical inputs
  (workloads from :mod:`.model_config`, operators from :mod:`.operators`, measured by :mod:`.run` with
  :mod:`.protocol`, written by :mod:`.results` and :mod:`.report`).
* :mod:`.matrix` (CPU cells) and :mod:`.matrix_gpu` (GPU cells) - ``gc-moe-matrix``: the compatibility matrix.

The tools sit above the core: they import the facades, the operator and the references
(:mod:`gc_moe_compat.testing`); nothing in the core imports them.
"""
