#!/usr/bin/env bash
# CUDA MPS for several ranks on one GPU: `source scripts/mps.sh` defines mps_start / mps_stop.
#   mps_start   starts the control daemon with its pipe and log directories in a fresh temporary directory
#               (exported as CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, so every process started after it is
#               an MPS client), and registers mps_stop on EXIT; fails if the daemon does not start.
#   mps_stop    asks the daemon to quit (`echo quit | nvidia-cuda-mps-control`) and removes the directory; safe to
#               call twice or without a start.
# The GPU's settings (compute mode, clocks, MIG) are left alone.
MPS_CONTROL="${MPS_CONTROL:-nvidia-cuda-mps-control}"

mps_start() {
  command -v "$MPS_CONTROL" >/dev/null || { echo "mps: $MPS_CONTROL is not on PATH" >&2; return 1; }
  MPS_DIR="$(mktemp -d "${TMPDIR:-/tmp}/gc_moe_mps.XXXXXX")" || return 1
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap mps_stop EXIT
  if ! "$MPS_CONTROL" -d; then
    echo "mps: the control daemon did not start (logs in $CUDA_MPS_LOG_DIRECTORY)" >&2
    mps_stop
    return 1
  fi
  echo "mps: started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
}

mps_stop() {
  [[ -n "${MPS_DIR:-}" ]] || return 0
  echo quit | "$MPS_CONTROL" >/dev/null 2>&1
  echo "mps: stopped"
  rm -rf "$MPS_DIR"
  MPS_DIR=
}
