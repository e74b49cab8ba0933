#!/usr/bin/env bash
# Builds the original SM90 Mega MoE (sgl-project/DeepGEMM's SM90 branch, refs/pull/36/head "Add SM90 MegaMoE support
# with TVM FFI bindings": sgl_deep_gemm/__init__.py, csrc/apis/sm90_mega.hpp, impls/sm90_fp8_mega_moe.cuh) from a
# source tree you point to, into a git-ignored folder, so that gc-moe-ab can compare against it (its
# original_deep_gemm operator; FACTS.md: SGLang's prebuilt sgl-deep-gemm wheels need torch 2.14):
#   bash scripts/build_sgl_deep_gemm.sh --src DIR [--cutlass DIR] [--fmt DIR] [--dest DIR] [--build]
#   --src      a checkout of that branch (nothing is fetched here, and nothing of it is committed)
#   --cutlass  a tree with include/cute and include/cutlass (default SRC/third-party/cutlass; the deepinfer-gemm
#              2.8.2 sdist's third-party/cutlass works too)
#   --fmt      a tree with include/fmt (default SRC/third-party/fmt: the submodule, commit 553ec11e)
#   --dest     where the package is staged (default .carry/sgl_deep_gemm: git-ignored, carried to the lent GPU
#              machine with carry: [".carry"])
#   --build    import it once with this Python's torch: sgl_deep_gemm's __init__ then builds _C with tvm_ffi
#              (needs apache-tvm-ffi importable, CUDA_HOME or nvcc on PATH, ~75 s on an H200 host); the log is
#              DEST/build.log and the last lines say where it failed
# Then: PYTHONPATH=DEST gc-moe-ab ... (the tool loads the original through gc_moe_compat.originals, beside the
# facade). Layout (what sgl_deep_gemm's __init__ expects, the package's parent as its root): DEST/deep_gemm/
# (__init__.py and VERSION from sgl_deep_gemm/, utils testing legacy mega, include/deep_gemm, include/{cute,cutlass}
# linked into DEST/third-party/cutlass/include), DEST/csrc, DEST/third-party/{cutlass,fmt}/include.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
src= cutlass= fmt= dest="$repo/.carry/sgl_deep_gemm" build=0
while (($#)); do
  case "$1" in
    --src) src="$2"; shift ;;
    --cutlass) cutlass="$2"; shift ;;
    --fmt) fmt="$2"; shift ;;
    --dest) dest="$2"; shift ;;
    --build) build=1 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
fail() { echo "build_sgl_deep_gemm: $*" >&2; exit 1; }
[[ -n "$src" ]] || fail "--src must name a checkout of sgl-project/DeepGEMM's SM90 Mega MoE branch"
src="$(cd "$src" && pwd)"
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
mkdir -p "$dest/deep_gemm/include" "$dest/third-party/cutlass" "$dest/third-party/fmt"
cp "$src/sgl_deep_gemm/__init__.py" "$src/sgl_deep_gemm/VERSION" "$dest/deep_gemm/"
for sub in utils testing legacy mega; do cp -r "$src/deep_gemm/$sub" "$dest/deep_gemm/"; done
cp -r "$src/deep_gemm/include/deep_gemm" "$dest/deep_gemm/include/"
cp -r "$src/csrc" "$dest/"
cp -r "$cutlass/include" "$dest/third-party/cutlass/"
cp -r "$fmt/include" "$dest/third-party/fmt/"
ln -s ../../third-party/cutlass/include/cute "$dest/deep_gemm/include/cute"
ln -s ../../third-party/cutlass/include/cutlass "$dest/deep_gemm/include/cutlass"
echo "staged $(du -sh "$dest" | cut -f1) in $dest (sgl_deep_gemm $(cat "$dest/deep_gemm/VERSION"), source" \
     "$(git -C "$src" rev-parse HEAD 2>/dev/null || echo 'not a git checkout'))"

if ((build)); then
  PY="${PYTHON:-python3}"
  if PYTHONPATH="$dest${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import deep_gemm, sys; \
assert deep_gemm.__file__.startswith(sys.argv[1]), deep_gemm.__file__; print('built', deep_gemm.__file__, \
[n for n in ('fp8_mega_moe', 'get_symm_buffer_for_mega_moe', 'transform_weights_for_mega_moe_sm90', \
'mega_moe_pre_dispatch_sm90') if hasattr(deep_gemm, n)])" "$dest" >"$dest/build.log" 2>&1; then
    tail -n 1 "$dest/build.log"
  else
    echo "build_sgl_deep_gemm: importing (and so building _C) failed; the end of $dest/build.log:" >&2
    tail -n 25 "$dest/build.log" >&2
    exit 1
  fi
fi
echo "use it: PYTHONPATH=$dest gc-moe-ab --check ...  (original_deep_gemm should say 'would run')"
