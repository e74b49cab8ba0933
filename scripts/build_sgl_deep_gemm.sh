#!/usr/bin/env bash
# Builds the original SM90 Mega MoE (sgl-project/DeepGEMM's SM90 branch, refs/pull/36/head "Add SM90 MegaMoE support
# with TVM FFI bindings": sgl_deep_gemm/__init__.py, csrc/apis/sm90_mega.hpp, impls/sm90_fp8_mega_moe.cuh) from a
# source tree you point to, into a git-ignored folder, so that gc-moe-ab can compare against it (its
# original_deep_gemm and composed_deepep_deepgemm operators; docs/platform_notes.md: SGLang's prebuilt sgl-deep-gemm wheels need
# torch 2.14):
#   bash scripts/build_sgl_deep_gemm.sh (--src DIR | --git-dir DIR --ref REF) [--cutlass DIR] [--fmt DIR]
#                                       [--tvm-ffi WHEEL] [--dest DIR] [--build]
#   bash scripts/build_sgl_deep_gemm.sh --build [--dest DIR]     # build an earlier staging (e.g. on the GPU host)
#   bash scripts/build_sgl_deep_gemm.sh --env [--dest DIR]       # print the exports that use it (eval them)
#   --src      a checkout of that branch (nothing is fetched here, and nothing of it is committed)
#   --git-dir / --ref  a (bare) clone and the ref to stage from it (git archive), e.g. refs/pull/36/head
#   --cutlass  a tree with include/cute and include/cutlass (default SRC/third-party/cutlass; the deepinfer-gemm
#              2.8.2 sdist's third-party/cutlass works too)
#   --fmt      a tree with include/fmt (default SRC/third-party/fmt: the submodule, commit 553ec11e)
#   --third-party-of STAGING  instead of --cutlass / --fmt: DEST/third-party is a relative link to an earlier
#              staging's (a sibling folder of DEST, e.g. .carry/sgl_deep_gemm), so that two stagings travel to the GPU
#              host together within the device tool's 64 MiB (cutlass is ~28 MB of each); carry both
#   --tvm-ffi  the apache-tvm-ffi wheel its bindings need (0.1.15.post2 cp312 works), kept in DEST/wheels and
#              installed into DEST/site by --build where this Python cannot import tvm_ffi
#   --dest     where the package is staged (default .carry/sgl_deep_gemm: git-ignored, carried to the lent GPU
#              machine with carry: [".carry"])
#   --build    import it once with this Python's torch: sgl_deep_gemm's __init__ then builds DEST/deep_gemm/_C.so
#              with tvm_ffi (objects in DEST/deep_gemm/_C_build; needs CUDA_HOME or nvcc on PATH, ninja; ~75 s on
#              an H200 host); the log is DEST/build.log and the last lines say where it failed
# Where the build and its caches live (all under DEST, so that bringing DEST back from a GPU host skips them next
# time): _C.so in DEST/deep_gemm/; tvm_ffi's torch DLPack addon in TVM_FFI_CACHE_DIR (DEST/cache/tvm_ffi; tvm_ffi's
# default ~/.cache/tvm-ffi); DeepGEMM's JIT kernels in DG_JIT_CACHE_DIR (DEST/cache/deep_gemm; its default
# ~/.deep_gemm), compiled at first use per kernel configuration. `--env` prints these exports plus PYTHONPATH and
# LD_PRELOAD of the system libstdc++ (DeepGEMM's JIT crashes in std::regex under the torch image's one, docs/platform_notes.md).
# Then: eval "$(bash scripts/build_sgl_deep_gemm.sh --env)"; gc-moe-ab ... (the tool loads the original through
# gc_moe_compat.originals, beside the facade). Layout (what sgl_deep_gemm's __init__ expects, the package's parent as
# its root): DEST/deep_gemm/ (the *.py and VERSION of sgl_deep_gemm/, utils testing legacy mega,
# include/deep_gemm, include/{cute,cutlass} linked into DEST/third-party/cutlass/include), DEST/csrc,
# DEST/third-party/{cutlass,fmt}/include, DEST/SOURCE (where it came from).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
src= gitdir= ref= cutlass= fmt= shared= wheel= dest="$repo/.carry/sgl_deep_gemm" build=0 env=0
while (($#)); do
  case "$1" in
    --src) src="$2"; shift ;;
    --git-dir) gitdir="$2"; shift ;;
    --ref) ref="$2"; shift ;;
    --cutlass) cutlass="$2"; shift ;;
    --fmt) fmt="$2"; shift ;;
    --third-party-of) shared="$2"; shift ;;
    --tvm-ffi) wheel="$2"; shift ;;
    --dest) dest="$2"; shift ;;
    --build) build=1 ;;
    --env) env=1 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
fail() { echo "build_sgl_deep_gemm: $*" >&2; exit 1; }
source "$repo/scripts/checkout_commit.sh"
dest="$(mkdir -p "$(dirname "$dest")" && cd "$(dirname "$dest")" && pwd)/$(basename "$dest")"
exports() {
  echo "export PYTHONPATH=$dest/site:$dest\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export DG_JIT_CACHE_DIR=$dest/cache/deep_gemm TVM_FFI_CACHE_DIR=$dest/cache/tvm_ffi"
  echo "export CUDA_HOME=\${CUDA_HOME:-/usr/local/cuda}"
  # docs/platform_notes.md: DeepGEMM's JIT (std::regex on the nvcc version) crashes under the torch image's libstdc++ otherwise
  local stdcxx=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
  [[ -f $stdcxx ]] && echo "export LD_PRELOAD=$stdcxx"
  return 0
}
if ((env)); then exports; exit 0; fi

stage() {  # copy the source tree, cutlass, fmt (and the wheel) into DEST
  if [[ -n "$gitdir" ]]; then
    [[ -z "$src" && -n "$ref" ]] || fail "--git-dir needs --ref (and no --src)"
    src="$(mktemp -d)"
    trap 'rm -rf "$src"' EXIT
    git --git-dir="$gitdir" archive "$ref" | tar x -C "$src" || fail "git archive $ref from $gitdir failed"
    source_line="$ref = $(git --git-dir="$gitdir" rev-parse "$ref") from $gitdir"
  else
    src="$(cd "$src" && pwd)"
    commit="$(checkout_commit "$src")"
    source_line="$src at ${commit:-a tree that is not a git checkout}"
  fi
  if [[ -n "$shared" ]]; then
    [[ -z "$cutlass$fmt" ]] || fail "--third-party-of takes the place of --cutlass and --fmt"
    shared="$(cd "$shared" 2>/dev/null && pwd)" || fail "--third-party-of: no folder $shared"
    [[ "$(dirname "$shared")" == "$(dirname "$dest")" ]] || fail "--third-party-of $shared is not beside --dest $dest"
    cutlass="$shared/third-party/cutlass" fmt="$shared/third-party/fmt"
  fi
  cutlass="${cutlass:-$src/third-party/cutlass}" fmt="${fmt:-$src/third-party/fmt}"
  for f in sgl_deep_gemm/__init__.py sgl_deep_gemm/VERSION csrc/tvm_ffi_api.cpp csrc/apis/sm90_mega.hpp \
           deep_gemm/include/deep_gemm/impls/sm90_fp8_mega_moe.cuh deep_gemm/mega/__init__.py; do
    [[ -f "$src/$f" ]] || fail "--src $src has no $f: not the SM90 Mega MoE branch (refs/pull/36/head)"
  done
  [[ -d "$cutlass/include/cute" && -d "$cutlass/include/cutlass" ]] ||
    fail "--cutlass $cutlass has no include/cute and include/cutlass (uninitialized submodule? pass --cutlass)"
  [[ -d "$fmt/include/fmt" ]] || fail "--fmt $fmt has no include/fmt (uninitialized submodule? pass --fmt)"
  case "$dest" in "$repo"/*) git -C "$repo" check-ignore -q "$dest" || fail "--dest $dest is inside the repository "\
  "but not git-ignored (use .carry/...)" ;; esac

  if [[ -e "$dest" && ! -f "$dest/deep_gemm/VERSION" ]]; then
    fail "--dest $dest exists and is not an earlier staging of this script (no deep_gemm/VERSION): not removing it"
  fi
  rm -rf "$dest"
  mkdir -p "$dest/deep_gemm/include"
  cp "$src/sgl_deep_gemm/"*.py "$src/sgl_deep_gemm/VERSION" "$dest/deep_gemm/"  # __init__.py and its modules
  for sub in utils testing legacy mega; do cp -r "$src/deep_gemm/$sub" "$dest/deep_gemm/"; done
  cp -r "$src/deep_gemm/include/deep_gemm" "$dest/deep_gemm/include/"
  cp -r "$src/csrc" "$dest/"
  if [[ -n "$shared" ]]; then
    ln -s "../$(basename "$shared")/third-party" "$dest/third-party"
  else
    mkdir -p "$dest/third-party/cutlass" "$dest/third-party/fmt"
    cp -r "$cutlass/include" "$dest/third-party/cutlass/"
    cp -r "$fmt/include" "$dest/third-party/fmt/"
  fi
  ln -s ../../third-party/cutlass/include/cute "$dest/deep_gemm/include/cute"
  ln -s ../../third-party/cutlass/include/cutlass "$dest/deep_gemm/include/cutlass"
  if [[ -n "$wheel" ]]; then
    [[ -f "$wheel" ]] || fail "--tvm-ffi $wheel is not a file"
    mkdir -p "$dest/wheels" && cp "$wheel" "$dest/wheels/"
  fi
  echo "$source_line; cutlass $cutlass; fmt $fmt${shared:+ (third-party linked to ../$(basename "$shared")/third-party)};"\
    "tvm-ffi ${wheel:-not staged}" >"$dest/SOURCE"
  echo "staged $(du -sh "$dest" | cut -f1) in $dest (sgl_deep_gemm $(cat "$dest/deep_gemm/VERSION"), source $source_line)"
}

if [[ -z "$src" && -z "$gitdir" ]]; then
  ((build)) || fail "--src or --git-dir/--ref must name sgl-project/DeepGEMM's SM90 Mega MoE branch (or --build an earlier staging)"
  [[ -f "$dest/deep_gemm/VERSION" ]] || fail "--build: $dest is not a staging of this script (no deep_gemm/VERSION)"
else
  stage
fi

if ((build)); then
  PY="${PYTHON:-python3}"
  eval "$(exports)"
  mkdir -p "$DG_JIT_CACHE_DIR" "$TVM_FFI_CACHE_DIR"
  if ! "$PY" -c "import tvm_ffi" 2>/dev/null; then
    compgen -G "$dest/wheels/*.whl" >/dev/null || fail "--build: this Python cannot import tvm_ffi and no wheel is staged (--tvm-ffi WHEEL)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$dest/site" "$dest"/wheels/*.whl
  fi
  start=$SECONDS
  if "$PY" -c "import deep_gemm, sys; \
assert deep_gemm.__file__.startswith(sys.argv[1]), deep_gemm.__file__; print('built', deep_gemm.__file__, \
[n for n in ('fp8_mega_moe', 'get_symm_buffer_for_mega_moe', 'transform_weights_for_mega_moe_sm90', \
'mega_moe_pre_dispatch_sm90', 'm_grouped_fp8_gemm_nt_masked', 'm_grouped_fp8_fp4_gemm_nt_masked', \
'fp8_m_grouped_gemm_nt_masked') if hasattr(deep_gemm, n)])" "$dest" >"$dest/build.log" 2>&1; then
    echo "$(tail -n 1 "$dest/build.log") in $((SECONDS - start)) s"
  else
    echo "build_sgl_deep_gemm: importing (and so building _C) failed; the end of $dest/build.log:" >&2
    tail -n 25 "$dest/build.log" >&2
    exit 1
  fi
fi
((build)) || echo "build it where the GPU is: bash $0 --build --dest $dest; use it: eval \"\$(bash $0 --env --dest $dest)\""
