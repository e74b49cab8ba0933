"""Shim package for scripts/run_deepep_legacy_tests.sh (never imported by the library).

Under ``GC_MOE_SWAP=deep_ep``, ``import deep_ep`` is gc-moe-compat's facade; DeepEP's tests also import
``deep_ep.utils.*`` (their helpers), which the facade does not have, so the swap loads them from "the original
deep_ep": this package, found first on ``PYTHONPATH``. It executes nothing of DeepEP's ``__init__`` (which loads
the compiled ``_C`` and NCCL); it only makes the checkout's own ``deep_ep/`` folder (``GC_MOE_DEEPEP_DIR``) a second
location of its submodules, so ``deep_ep.utils`` is DeepEP's file, unmodified, and ``deep_ep._C`` is the shim next
to this file.
"""

import os

_checkout = os.environ.get("GC_MOE_DEEPEP_DIR")
if not _checkout or not os.path.isdir(os.path.join(_checkout, "deep_ep", "utils")):
    raise ImportError(f"GC_MOE_DEEPEP_DIR must name a DeepEP checkout (with deep_ep/utils/), got {_checkout!r}")
__path__.append(os.path.join(_checkout, "deep_ep"))
if os.environ.get("GC_MOE_DEEPEP_SHARED_GPU") == "1":
    from . import _shared_gpu  # noqa: F401 - installs the shared-GPU init_dist into utils.envs
