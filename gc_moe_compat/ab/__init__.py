"""``gc-moe-ab``: the tool an SGLang operator runs to decide whether to keep GC-MoE on.

* :mod:`.cli` - ``gc-moe-ab``: the original Mega MoE kernels and GC-MoE side by side on identical inputs
  (workloads from :mod:`.model_config`, operators from :mod:`.operators`, measured by :mod:`.run` with
  :mod:`.protocol`, written by :mod:`.results` and :mod:`.report`).

Tools sit beside the shipped stack: they import the facades, the operator and ``gc_moe_compat.testing``; nothing
shipped imports them.
"""
