#!/usr/bin/env bash
# Fills the git-ignored .whl/ and .carry/ with what the lent GPU machine lacks and cannot download (it has no
# network). Carry them with the device tool (`carry: [".whl", ".carry"]`); scripts/device_check.sh installs every
# .whl/*.whl there, and the tests look for their files under .carry/.
#
#   bash scripts/fetch_device_deps.sh             # the runtime (issue 3): nothing to fetch, the image has
#                                                 # torch 2.11, cuda-bindings 13.3, pytest, hypothesis, setuptools
#   bash scripts/fetch_device_deps.sh --deepgemm  # the DeepGEMM baseline (later issues): the deepinfer-gemm 2.8.2
#                                                 # sdist and Debian's libdw-dev / libelf-dev (elfutils headers its
#                                                 # build needs); see docs/platform_notes.md for how to build and run it there
#   bash scripts/fetch_device_deps.sh --sglang    # SGLang 0.5.23's sources for tests/facades/test_sglang_*.py:
#                                                 # only mega_moe_sm90.py, mega_moe.py and token_dispatcher/
#                                                 # {base,deepep}.py, read out of the registry wheel (cached in
#                                                 # ~/.cache/gc_moe_compat/registry) into .carry/sglang-0.5.23/
#                                                 # (the 38 MB wheel itself does not fit the carry limit)
# Options combine (`--deepgemm --sglang`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY="${PYTHON:-python3}"

for opt in "$@"; do
  case "$opt" in
    --deepgemm)
      # `pip download` of this sdist fails here (its setup.py needs CUDA to produce metadata): take the file the
      # registry's simple index lists for 2.8.2.
      url=$(curl -fsS https://pypi.org/simple/deepinfer-gemm/ | grep -o 'https://[^"#]*deepinfer_gemm-2\.8\.2\.tar\.gz' | head -n 1)
      (cd .whl && curl -fsSLO "$url")
      (cd .whl && apt-get download libdw-dev libelf-dev)
      ;;
    --sglang)
      rm -rf .carry/sglang-0.5.23
      "$PY" tests/kit/sglang_wheel.py .carry/sglang-0.5.23
      du -sh .carry
      ;;
    *)
      echo "unknown option $opt (expected --deepgemm and/or --sglang)" >&2
      exit 2
      ;;
  esac
done
du -sh .whl
ls -l .whl
