#!/usr/bin/env bash
# Builds the original DeepEP (the V1 `Buffer` SGLang's deepep backend drives; tag v1.2.1 builds against the NCCL 2.28
# of the H200 image, main needs NCCL >= 2.29) from a source tree you point to, into a git-ignored folder, so that the
# A/B runs can load it beside the facade (gc_moe_compat.originals):
#   bash scripts/build_deep_ep.sh (--src DIR | --git-dir DIR --ref REF) [--dest DIR] [--build]
#   bash scripts/build_deep_ep.sh --build [--dest DIR]     # build an earlier staging (on the GPU host; for
#                                                          # deep_ep_ab, scripts/device_check.sh builds .carry/deep_ep)
#   bash scripts/build_deep_ep.sh --env [--dest DIR]       # print the export that puts it on PYTHONPATH (eval it)
#   --src      a DeepEP checkout (nothing is fetched here, and nothing of it is committed)
#   --git-dir / --ref  a (bare) clone and the ref to stage from it with git archive, e.g. v1.2.1
#   --dest     where it is staged and built (default .carry/deep_ep: git-ignored, carried to the GPU host with
#              carry: [".carry"]); DEST/SOURCE says where it came from
#   --build    `python3 setup.py build_ext --inplace` in DEST with TORCH_CUDA_ARCH_LIST=9.0 and CUDA 13's libcu++
#              headers on nvcc's and the host compiler's include paths (the image's NVSHMEM headers include cuda/std/*, which CUDA 13 keeps
#              under include/cccl); NVSHMEM comes from the nvidia-nvshmem pip package (or NVSHMEM_DIR). The log is
#              DEST/build.log; on failure its last lines are printed
# Then: eval "$(bash scripts/build_deep_ep.sh --env)" and run with GC_MOE_SWAP=deep_ep: `import deep_ep` is the facade,
# gc_moe_compat.originals.load("deep_ep") the build.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
src= gitdir= ref= dest="$repo/.carry/deep_ep" build=0 env=0
while (($#)); do
  case "$1" in
    --src) src="$2"; shift ;;
    --git-dir) gitdir="$2"; shift ;;
    --ref) ref="$2"; shift ;;
    --dest) dest="$2"; shift ;;
    --build) build=1 ;;
    --env) env=1 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
fail() { echo "build_deep_ep: $*" >&2; exit 1; }
source "$repo/scripts/checkout_commit.sh"
dest="$(mkdir -p "$(dirname "$dest")" && cd "$(dirname "$dest")" && pwd)/$(basename "$dest")"
if ((env)); then
  echo "export PYTHONPATH=$dest\${PYTHONPATH:+:\$PYTHONPATH}"
  exit 0
fi
if [[ -n "$src" || -n "$gitdir" ]]; then
  [[ -n "$src" && -n "$gitdir" ]] && fail "--src and --git-dir exclude each other"
  if [[ -n "$src" ]]; then
    [[ -f "$src/setup.py" && -d "$src/deep_ep" && -d "$src/csrc" ]] || fail "--src $src is not a DeepEP checkout"
  else
    [[ -n "$ref" ]] || fail "--git-dir needs --ref"
  fi
  # a fresh staging replaces an earlier one only (DEST/SOURCE), never another folder's files
  if [[ -d "$dest" && -n "$(ls -A "$dest")" && ! -f "$dest/SOURCE" ]]; then
    fail "--dest $dest is not empty and holds no earlier staging (no SOURCE file): choose another --dest"
  fi
  rm -rf "$dest" && mkdir -p "$dest"
  if [[ -n "$src" ]]; then
    (cd "$src" && tar --exclude=.git -cf - .) | tar -xf - -C "$dest"
    if [[ ! -f "$src/SOURCE" ]]; then  # an earlier staging keeps its SOURCE (copied above): where it came from
      commit="$(checkout_commit "$src")"
      echo "$(cd "$src" && pwd) ${commit:-unknown}" >"$dest/SOURCE"
    fi
  else
    git --git-dir="$gitdir" archive "$ref" | tar -xf - -C "$dest"
    echo "$gitdir $ref $(git --git-dir="$gitdir" rev-parse "$ref^{commit}")" >"$dest/SOURCE"
  fi
  echo "build_deep_ep: staged $(cat "$dest/SOURCE") in $dest"
fi
if ((build)); then
  [[ -f "$dest/setup.py" ]] || fail "nothing staged in $dest (run with --src or --git-dir first)"
  cuda="${CUDA_HOME:-/usr/local/cuda}"
  start=$SECONDS
  # nvcc and the host compiler (csrc/deep_ep.cpp includes nvshmem.h too) both need the libcu++ headers
  if (cd "$dest" && CUDA_HOME="$cuda" TORCH_CUDA_ARCH_LIST=9.0 CPATH="$cuda/include/cccl${CPATH:+:$CPATH}" \
      NVCC_PREPEND_FLAGS="-I$cuda/include/cccl${NVCC_PREPEND_FLAGS:+ $NVCC_PREPEND_FLAGS}" \
      python3 setup.py build_ext --inplace) >"$dest/build.log" 2>&1; then
    echo "build_deep_ep: built in $((SECONDS - start)) s ($(cat "$dest/SOURCE" 2>/dev/null)); log $dest/build.log"
  else
    tail -n 30 "$dest/build.log" >&2
    fail "the build failed after $((SECONDS - start)) s (log $dest/build.log, its last lines above)"
  fi
fi
