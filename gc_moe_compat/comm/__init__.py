"""Host side of the DeepEP-style communication kernels behind the ``deep_ep`` facade, one module per kernel file:
:mod:`.ep_ll` (``kernels/sm90/ep_ll.cu``, low-latency dispatch/combine)."""
