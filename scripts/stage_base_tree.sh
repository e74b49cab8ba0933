#!/usr/bin/env bash
# Stages this repository's package at another commit as an importable tree, for A/B runs against the working tree in
# one device call (carried, git-ignored):
#   bash scripts/stage_base_tree.sh REF [--dest DIR]     # default DIR: .carry/base_tree
# then, on the GPU host: PYTHONPATH=DIR python3 bench/<script>.py ...  (imports the staged gc_moe_compat; without
# PYTHONPATH the working tree's). The staged tree is `git archive REF gc_moe_compat kernels` with kernels/ moved to
# gc_moe_compat/kernels (where the wheel installs it, so gc_moe_compat.kernels resolves without an install);
# DIR/SOURCE names the commit. A staging replaces an earlier one only (a DIR holding no SOURCE is refused).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
ref= dest="$repo/.carry/base_tree"
while (($#)); do
  case "$1" in
    --dest) dest="$2"; shift ;;
    -*) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    *) [[ -z "$ref" ]] || { echo "one REF, got '$ref' and '$1'" >&2; exit 2; }; ref="$1" ;;
  esac
  shift
done
[[ -n "$ref" ]] || { echo "usage: bash scripts/stage_base_tree.sh REF [--dest DIR]" >&2; exit 2; }
commit="$(git -C "$repo" rev-parse --verify "$ref^{commit}")"
if [[ -d "$dest" && -n "$(ls -A "$dest")" && ! -f "$dest/SOURCE" ]]; then
  echo "--dest $dest is not empty and holds no earlier staging (no SOURCE file): choose another" >&2
  exit 2
fi
rm -rf "$dest" && mkdir -p "$dest"
git -C "$repo" archive "$commit" gc_moe_compat kernels | tar -xf - -C "$dest"
mv "$dest/kernels" "$dest/gc_moe_compat/kernels"
echo "$ref $commit" >"$dest/SOURCE"
echo "stage_base_tree: $ref ($commit) in $dest; run with PYTHONPATH=$dest"
