"""gc-moe-compat: the GC-MoE operator behind DeepEP / DeepGEMM Mega MoE call signatures."""

__version__ = "0.1.0"
