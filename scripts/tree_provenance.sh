#!/usr/bin/env bash
# Which commit a copy of this tree is, for result files written on the lent GPU machine (its copy's git metadata is not
# this checkout's: result files named a stale commit there). Two steps:
#   bash scripts/tree_provenance.sh          # here, before the device call: writes .carry/provenance (git-ignored;
#                                            # name it in the call's carry) = "<HEAD commit> <HEAD's tree hash>"
#   eval "$(bash scripts/tree_provenance.sh --env)"   # there (scripts/device_check.sh does it): hashes the copy's
#                                            # files as git would commit them (tracked and untracked, not ignored) and
#                                            # prints `export GC_MOE_GIT_SHA=<commit> GC_MOE_GIT_DIRTY=0|1`: 0 where
#                                            # they are that commit's tree, 1 where they differ from it
# --env prints nothing where no .carry/provenance was carried or git cannot hash the copy (the result files then name
# what the copy's git says), and says why on stderr. gc_moe_compat.ab.protocol reads the two variables
# (docs/bench_protocol.md).
set -euo pipefail
cd "$(dirname "$0")/.."
record=.carry/provenance
case "${1:-}" in
  "")
    commit="$(git rev-parse HEAD)" tree="$(git rev-parse 'HEAD^{tree}')"
    mkdir -p .carry
    echo "$commit $tree" >"$record"
    [[ -z "$(git status --porcelain)" ]] ||
      echo "tree_provenance: the working tree differs from HEAD: its runs will say dirty against $commit" >&2
    echo "tree_provenance: $record = $commit (tree $tree)"
    ;;
  --env)
    if [[ ! -f "$record" ]]; then
      echo "tree_provenance: no $record (not carried): result files name the copy's own git" >&2
      exit 0
    fi
    read -r commit tree <"$record"
    index="$(mktemp -u)"
    if ! files="$(GIT_INDEX_FILE="$index" git add -A . 2>/dev/null && GIT_INDEX_FILE="$index" git write-tree)"; then
      rm -f "$index"
      echo "tree_provenance: git could not hash this copy: result files name the copy's own git" >&2
      exit 0
    fi
    rm -f "$index"
    dirty=1
    [[ "$files" == "$tree" ]] && dirty=0
    echo "export GC_MOE_GIT_SHA=$commit GC_MOE_GIT_DIRTY=$dirty"
    ;;
  *) echo "usage: bash scripts/tree_provenance.sh [--env]" >&2; exit 2 ;;
esac
