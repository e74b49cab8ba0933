#!/usr/bin/env bash
# Runs DeepEP's own legacy tests (tests/legacy/test_intranode.py, test_low_latency.py), UNMODIFIED, against
# gc-moe-compat's deep_ep facade (GC_MOE_SWAP=deep_ep), from a DeepEP checkout you point to:
#   bash scripts/run_deepep_legacy_tests.sh --deepep DIR [--num-processes N] [--logs DIR] [--tests 'A.py B.py']
#                                           [--timeout SECONDS] [-- ARGS passed to every test]
# Needs this package installed in the Python that runs it (pip install -e ., which puts the swap's .pth hook in
# site-packages). Each test's output goes to LOGS/<test>.log; a summary line per test (rc, PASS/FAIL) is printed
# last, and the exit status is non-zero if any test failed. After a failed test the next one starts only once the GPU
# accepts a new CUDA client (polled for up to GC_MOE_GPU_READY_S seconds, default 90): under CUDA MPS, clients
# killed while their kernels spin can leave the server refusing new ones for a while ("CUDA-capable device(s) is/are
# busy or unavailable"), which would fail the next test for a reason of the previous one; if it never does, the
# remaining tests are NOT RUN with that reason.
#
# Shims (scripts/deepep_shims/, put first on PYTHONPATH; nothing of DeepEP's is copied or edited):
#   deep_ep/__init__.py  the "original deep_ep" the swap loads DeepEP's test helpers (deep_ep.utils.*) from: it runs
#                        none of DeepEP's __init__ (compiled _C, NCCL) and adds the checkout's deep_ep/ folder to
#                        its submodule path, so deep_ep/utils/*.py are DeepEP's own files.
#   deep_ep/_C.py        DeepEP's compiled extension as its utils import it: EventHandle (the facade's) only; the
#                        NCCL/topology functions envs.py and comm.py wrap are not called by the legacy tests.
#   deep_ep/_shared_gpu.py  with more processes than GPUs (several ranks on one GPU: start CUDA MPS first, as
#                        scripts/device_check.sh --shared-gpu P does): init_dist on a gloo group, NCCL refusing that.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
deepep= nproc=1 logs="${OUT:-$PWD}/deepep_legacy" tests="test_intranode.py test_low_latency.py" limit=900 extra=()
while (($#)); do
  case "$1" in
    --deepep) deepep="$2"; shift ;;
    --num-processes) nproc="$2"; shift ;;
    --logs) logs="$2"; shift ;;
    --tests) tests="$2"; shift ;;
    --timeout) limit="$2"; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$deepep" || ! -d "$deepep/tests/legacy" || ! -d "$deepep/deep_ep/utils" ]]; then
  echo "--deepep must name a DeepEP checkout (tests/legacy/ and deep_ep/utils/), got '${deepep}'" >&2
  exit 2
fi
deepep="$(cd "$deepep" && pwd)"
mkdir -p "$logs"
PY="${PYTHON:-python3}"
export GC_MOE_SWAP=deep_ep GC_MOE_DEEPEP_DIR="$deepep" PYTHONUNBUFFERED=1
export PYTHONPATH="$here/deepep_shims${PYTHONPATH:+:$PYTHONPATH}"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if ((nproc > gpus)); then export GC_MOE_DEEPEP_SHARED_GPU=1; fi  # ranks share GPUs: the gloo init_dist shim
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
"$PY" -m gc_moe_compat.swap --check >"$logs/swap_check.log" 2>&1
# Whether a new process can create a CUDA context and run a kernel, polled until it can or the wait is over.
gpu_accepts_clients() {
  local waited=0 wait_s="${GC_MOE_GPU_READY_S:-90}"
  until "$PY" -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" >/dev/null 2>&1; do
    ((waited >= wait_s)) && return 1
    sleep 3; waited=$((waited + 3))
  done
}
summary=() failed=0 refused=
for test in $tests; do
  log="$logs/${test%.py}.log"
  if [[ -n "$refused" ]] || { ((failed)) && ! gpu_accepts_clients; }; then
    refused="the GPU refused new CUDA clients for ${GC_MOE_GPU_READY_S:-90} s after a failed test"
    echo "NOT RUN: $refused" >"$log"
    summary+=("NOT RUN $test: $refused ($log)")
    continue
  fi
  (cd "$deepep/tests/legacy" && timeout "$limit" "$PY" "$test" --num-processes "$nproc" "${extra[@]}") >"$log" 2>&1
  rc=$?
  if ((rc == 0)); then verdict=PASS; else verdict=FAIL; failed=1; fi
  summary+=("$verdict $test rc=$rc ($log)")
done
cat "$logs/swap_check.log"
for test in $tests; do echo "== tail of ${test%.py}.log"; tail -n 25 "$logs/${test%.py}.log"; done
printf '%s\n' "${summary[@]}"
exit "$failed"
