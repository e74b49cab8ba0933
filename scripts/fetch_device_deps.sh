#!/usr/bin/env bash
# Fills the git-ignored .whl/ with what the lent GPU machine lacks and cannot download (it has no network).
# Carry it with the device tool (`carry: [".whl"]`); scripts/device_check.sh installs every .whl/*.whl there.
#
#   bash scripts/fetch_device_deps.sh             # the runtime (issue 3): nothing to fetch, the image has
#                                                 # torch 2.11, cuda-bindings 13.3, pytest, hypothesis, setuptools
#   bash scripts/fetch_device_deps.sh --deepgemm  # the DeepGEMM baseline (later issues): the deepinfer-gemm 2.8.2
#                                                 # sdist and Debian's libdw-dev / libelf-dev (elfutils headers its
#                                                 # build needs); see FACTS.md for how to build and run it there
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--deepgemm" ]]; then
  # `pip download` of this sdist fails here (its setup.py needs CUDA to produce metadata): take the file the
  # registry's simple index lists for 2.8.2.
  url=$(curl -fsS https://pypi.org/simple/deepinfer-gemm/ | grep -o 'https://[^"#]*deepinfer_gemm-2\.8\.2\.tar\.gz' | head -n 1)
  (cd .whl && curl -fsSLO "$url")
  (cd .whl && apt-get download libdw-dev libelf-dev)
fi
du -sh .whl
ls -l .whl
