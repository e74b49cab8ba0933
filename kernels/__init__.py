"""CUDA device sources, shipped as package data and compiled at first use by gc_moe_compat.runtime.jit."""
