#!/usr/bin/env bash
# The picked benchmarks run once per tree and round, the trees interleaved within each round: an A/B of several
# commits in one device call (the commits staged by scripts/stage_base_tree.sh; scripts/device_check.sh --tree calls
# this):
#   bash scripts/bench_trees.sh --out DIR [--rounds N] [--tail K] [--bench-dir DIR] --tree NAME=TREE [--tree ...] \
#        'BENCH [ARGS]' ['BENCH [ARGS]']...
#   --tree NAME=TREE  TREE's package goes first on PYTHONPATH for that tree's runs (TREE = . : the installed one,
#                     i.e. the working tree); NAME names its files
#   --rounds N        how many times each tree runs each benchmark (default 1): round 1 runs every tree, then round 2...
#   --tail K          the lines of each run's output printed after it (default 8: the end of a benchmark's table)
#   --bench-dir DIR   where BENCH.py lives (default bench/)
# Each run: `BENCH.py --out DIR/trees/BENCH_NAME_ROUND.json ARGS` (BENCH-I_NAME_ROUND where BENCH is picked more than
# once, I its place among the picks; BENCH gc-moe-ab: the tree's own `python -P -m gc_moe_compat.ab`, -P keeping this
# checkout off the path), its output beside it (.log); first, for each tree, the file its `import gc_moe_compat` finds
# (seen from the benchmark folder, as the benchmarks import it) and the commit its SOURCE names (its runs' result files
# name it: GC_MOE_GIT_SHA). At the end the runs' files are packed into DIR/trees.tar.gz, one file however many runs
# there were (the device tool brings back only a few files of a call).
# Exits 1 when a run failed (the other runs still run), 2 on a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out= rounds=1 tail_lines=8 bench_dir=bench trees=() benches=()
while (($#)); do
  case "$1" in
    --out) out="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    --tail) tail_lines="$2"; shift ;;
    --bench-dir) bench_dir="$2"; shift ;;
    --tree) trees+=("$2"); shift ;;
    -*) echo "bench_trees: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    *) benches+=("$1") ;;
  esac
  shift
done
usage() { echo "bench_trees: $*" >&2; exit 2; }
[[ -n "$out" ]] || usage "--out DIR is required"
((${#trees[@]})) || usage "at least one --tree NAME=TREE"
((${#benches[@]})) || usage "at least one benchmark"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || usage "--rounds: a positive integer, got '$rounds'"
declare -A path_of=() sha_of=() seen=()
for tree in "${trees[@]}"; do
  name="${tree%%=*}" dir="${tree#*=}"
  [[ "$tree" == *=* && "$name" =~ ^[A-Za-z0-9_.-]+$ ]] ||
    usage "--tree NAME=TREE with NAME of letters, digits, _.-: got '$tree'"
  [[ -z "${seen[$name]:-}" ]] || usage "--tree $name given twice"
  seen[$name]=1
  if [[ "$dir" == "." ]]; then
    path_of[$name]="${PYTHONPATH:-}"
  else
    [[ -d "$dir/gc_moe_compat" ]] ||
      usage "--tree $tree: $dir holds no gc_moe_compat (stage it with scripts/stage_base_tree.sh)"
    dir="$(cd "$dir" && pwd)"
    path_of[$name]="$dir${PYTHONPATH:+:$PYTHONPATH}"
  fi
  found="$(cd "$bench_dir" && PYTHONPATH="${path_of[$name]}" "$PY" -c \
    'import gc_moe_compat; print(gc_moe_compat.__file__)' 2>&1 | tail -n 1)"
  source_line= sha_of[$name]=
  if [[ "$dir" != "." && -f "$dir/SOURCE" ]]; then
    read -r _ sha_of[$name] <"$dir/SOURCE"
    source_line=" (staged from $(head -n 1 "$dir/SOURCE"))"
  fi
  echo "tree $name: gc_moe_compat from $found$source_line"
done

# a benchmark picked more than once (other arguments) gets its place among the picks in its files' names
declare -A picks=()
for spec in "${benches[@]}"; do read -ra words <<<"$spec"; picks[${words[0]}]=$((${picks[${words[0]}]:-0} + 1)); done
runs="$out/trees"
mkdir -p "$runs"
rc=0
for ((round = 1; round <= rounds; round++)); do
  for tree in "${trees[@]}"; do
    name="${tree%%=*}"
    for i in "${!benches[@]}"; do
      read -ra words <<<"${benches[$i]}"
      place=
      ((picks[${words[0]}] > 1)) && place="-$((i + 1))"
      tag="${words[0]}${place}_${name}_${round}"
      if [[ "${words[0]}" == gc-moe-ab ]]; then
        command=("$PY" -P -m gc_moe_compat.ab)
      else
        command=("$PY" "$bench_dir/${words[0]}.py")
      fi
      # a staged tree's result files name its commit (docs/bench_protocol.md: GC_MOE_GIT_SHA, GC_MOE_GIT_DIRTY)
      provenance=()
      [[ -n "${sha_of[$name]}" ]] && provenance=(GC_MOE_GIT_SHA="${sha_of[$name]}" GC_MOE_GIT_DIRTY=0)
      if env "${provenance[@]}" PYTHONPATH="${path_of[$name]}" "${command[@]}" --out "$runs/$tag.json" \
        "${words[@]:1}" >"$runs/$tag.log" 2>&1; then
        echo "== $tag"
      else
        rc=1
        echo "== $tag FAILED ($tag.log in trees.tar.gz)"
      fi
      tail -n "$tail_lines" "$runs/$tag.log"
    done
  done
done
tar -czf "$out/trees.tar.gz" -C "$out" trees && rm -rf "$runs"
exit "$rc"
