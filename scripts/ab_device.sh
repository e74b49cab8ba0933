#!/usr/bin/env bash
# gc-moe-ab and gc-moe-matrix on the lent GPU machine (device tool `run` with carry [".carry"], which holds
# .carry/provenance: run bash scripts/tree_provenance.sh here first, so that result files name this commit), from the
# repository root:
#   bash scripts/ab_device.sh [--ab WORKLOAD]... [--ab-args "ARGS"] [--matrix] [--matrix-args "ARGS"] [--pytest EXPR]
#                             [--original NAME] [--ncu "ARGS"]...
#   WORKLOAD: a gc-moe-ab workload's arguments, e.g. "--preset glm52" or "--model-config tests/data/deepseek_v3/config.json"
#   --ab-args     appended to every gc-moe-ab run (e.g. "--quick --tokens 1 8")
#   --matrix      run gc-moe-matrix (GPU + CPU cells) with --matrix-args (e.g. "--deepep-src .carry/DeepEP"; shell
#                 quoting inside it is honoured)
#   --pytest EXPR run the gpu tests of tests/tools/test_ab_*.py matching EXPR first
#   --prebuild S  first, at the same time and for at most S seconds: `gc-moe-ab WORKLOAD --prebuild-only` of every
#                 workload (GC-MoE's kernels and the originals' JIT kernels of every point; one original's workloads
#                 at a time), the matrix and the pytest run (neither is timed); then the gc-moe-ab runs one after the
#                 other on the idle GPU
#   --parallel    run the gc-moe-ab workloads at the same time (a smoke run that compiles every kernel variant of
#                 every workload at once; its latencies are not measurements)
#   --deadline S  end every step by S seconds after the start (the device call's limit minus a margin) and still
#                 pack what came back
#   --original NAME  the staging in .carry/NAME to build and compare against (default sgl_deep_gemm, e.g.
#                 sgl_deep_gemm_pr323 for another ref staged with build_sgl_deep_gemm.sh --dest .carry/NAME); given
#                 more than once, every workload runs once per original in turn (each run with the facade too, so
#                 the originals are ranked within one call), the result files named ab_<workload>.<NAME>.json/png
#                 (a second staging fits in the carry with build_sgl_deep_gemm.sh --third-party-of)
#   --ncu "ARGS"  after the timed runs, one `gc-moe-ab ARGS` (a workload, one point, one op: e.g. "--preset glm52
#                 --tokens 256 --ops facade --repeats 1 --quick") under Nsight Compute (clocks left alone, each graph
#                 node profiled alone): NCU_LAUNCHES launches of role2 or of the original's Mega MoE kernel after the
#                 first NCU_SKIP (role2's first is its graph warm-up, which returns at once), the NCU_SECTIONS report in
#                 ncu_<ARGS>.txt among the logs; given once per op to compare (each run times its ops in turn)
# Steps: install this package; build (or reuse) the original SM90 Mega MoE staged in .carry/NAME by
# scripts/build_sgl_deep_gemm.sh (its _C.so and both JIT caches live there); each gc-moe-ab run writes its default
# ./ab_<workload>.json + PNG in the repository root (so meta.command is the plain command), the matrix
# ./compat_matrix.*; copy the ones to keep into bench/results/ by hand.
# $OUT gets few files (the device tool brings back at most 8): results.tar.gz (those result files and every log),
# carry_c.tar.gz (the built _C.so) and carry_jit.tar.gz (DeepGEMM's JIT kernels, tvm_ffi's addon, GC-MoE's cubins
# in .carry/gc_moe_cache): restore both with tar xzf FILE -C .carry for the next call. A summary with the seconds
# of each step is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/device_out}"
export GC_MOE_CACHE_DIR="${GC_MOE_CACHE_DIR:-$PWD/.carry/gc_moe_cache}"
PY="${PYTHON:-python3}"
# The commit this copy is (carried .carry/provenance, written here by scripts/tree_provenance.sh): the result files
# name it, not the copy's stale git; a caller's own GC_MOE_GIT_SHA wins.
[[ -n "${GC_MOE_GIT_SHA:-}" ]] || eval "$(bash scripts/tree_provenance.sh --env)"
echo "tree: ${GC_MOE_GIT_SHA:-as the copy's git says} (dirty: ${GC_MOE_GIT_DIRTY:-as the copy's git says})"
workloads=() ab_args= matrix=0 matrix_args= pytest_k= parallel=0 deadline=0 prebuild=0 originals=() ncu_runs=()
# The --ncu runs: kernels, launches and sections (the kernels' names as ncu's default function base shows them).
NCU_KERNELS='regex:gc_sm90_fp8_role2|sm90_fp8_mega_moe_impl' NCU_SKIP=2 NCU_LAUNCHES=3
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats
              --section MemoryWorkloadAnalysis --section LaunchStats)
while (($#)); do
  case "$1" in
    --ab) workloads+=("$2"); shift ;;
    --ab-args) ab_args="$2"; shift ;;
    --matrix) matrix=1 ;;
    --matrix-args) matrix_args="$2"; shift ;;
    --pytest) pytest_k="$2"; shift ;;
    --parallel) parallel=1 ;;
    --deadline) deadline="$2"; shift ;;
    --prebuild) prebuild="$2"; shift ;;
    --original) originals+=("$2"); shift ;;
    --ncu) ncu_runs+=("$2"); shift ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
((${#originals[@]})) || originals=(sgl_deep_gemm)
for original in "${originals[@]}"; do
  [[ "$original" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "--original: a folder name under .carry, got '$original'" >&2; exit 2; }
done
LOGS=/tmp/ab_device_logs
rm -rf "$LOGS" && mkdir -p "$OUT" "$LOGS" "$GC_MOE_CACHE_DIR"
PACK_RESERVE=10  # seconds kept for packing at the deadline
summary=()
phase_end=0  # while > 0: steps end by then too (the --prebuild phase)
left() {  # seconds a step may still take (a large number without --deadline)
  local end=100000
  ((deadline)) && end=$((deadline - PACK_RESERVE))
  ((phase_end && phase_end < end)) && end=$phase_end
  echo $((end - SECONDS))
}
log_name() { echo "ab_$(echo "$*" | tr -c 'A-Za-z0-9_-' _).log"; }
run_step() {  # run_step NAME LOG COMMAND...: run under the deadline, record the exit status and seconds
  local name="$1" log="$2" start=$SECONDS rc budget
  shift 2
  budget=$(left)
  if ((budget < 5)); then summary+=("$(printf '%-44s skipped: the deadline' "$name")"); return 124; fi
  echo "== $name $(date -u +%T) (up to ${budget} s)"
  timeout -k 3 "$budget" "$@" >"$LOGS/$log" 2>&1
  rc=$?
  summary+=("$(printf '%-44s rc=%-3s %4d s  %s' "$name" "$rc" $((SECONDS - start)) "$log")")
  tail -n 3 "$LOGS/$log"
  return $rc
}
pack() {  # the result files, the logs and the caches into $OUT (few files)
  cp ab_*.json ab_*.png compat_matrix.* "$LOGS/" 2>/dev/null
  tar czf "$OUT/results.tar.gz" -C "$LOGS" . 2>/dev/null
  (cd .carry && tar czf "$OUT/carry_c.tar.gz" "${originals[@]/%//deep_gemm/_C.so}" 2>/dev/null
   tar czf "$OUT/carry_jit.tar.gz" "${originals[@]/%//cache}" gc_moe_cache 2>/dev/null)
}
# The command after its arguments with original $1's exports (build_sgl_deep_gemm.sh --env) where it is staged.
with_original=(bash -c '[[ -f .carry/$0/deep_gemm/VERSION ]] &&
  eval "$(bash scripts/build_sgl_deep_gemm.sh --env --dest ".carry/$0")"; exec "$@"')
suffix_results() {  # with several originals: the run's ab_<workload>.json / .png become ab_<workload>.$1.json / .png
  ((${#originals[@]} > 1)) || return 0
  local f o
  for f in ab_*.json ab_*.png; do
    [[ -f $f ]] || continue
    for o in "${originals[@]}"; do [[ $f == *".$o.json" || $f == *".$o.png" ]] && continue 2; done
    mv "$f" "${f%.*}.$1.${f##*.}"
  done
}

run_step setup setup.log "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || {
  cat "$LOGS/setup.log"; exit 1; }
pids=()
for original in "${originals[@]}"; do  # the builds at the same time (CPU work)
  dg=.carry/$original
  if [[ -f $dg/deep_gemm/VERSION ]]; then
    run_step "original $original build" "build_$original.log" bash scripts/build_sgl_deep_gemm.sh --build \
      --dest "$dg" &
    pids+=($!)
  else
    summary+=("original SM90 Mega MoE: not staged ($dg; scripts/build_sgl_deep_gemm.sh)")
  fi
done
((${#pids[@]})) && wait "${pids[@]}"
for original in "${originals[@]}"; do  # (run_step's summary line is lost in a background job)
  [[ -f "$LOGS/build_$original.log" ]] &&
    summary+=("$(printf '%-44s %s' "original $original build" "$(tail -n 1 "$LOGS/build_$original.log" | cut -c1-90)")")
  cp ".carry/$original/build.log" "$LOGS/build_${original}_detail.log" 2>/dev/null
done
pack
pids=()
if ((prebuild)); then  # untimed work at the same time: compiles, the matrix's cells, the tests
  phase_end=$((SECONDS + prebuild))
  if ((matrix)); then
    run_step gc-moe-matrix matrix.log "${with_original[@]}" "${originals[0]}" bash -c "gc-moe-matrix $matrix_args" &
    pids+=($!)
    matrix=0
  fi
  if [[ -n $pytest_k ]]; then
    run_step "pytest -k $pytest_k" pytest.log "${with_original[@]}" "${originals[0]}" "$PY" -m pytest -q -rs -m gpu \
      tests/tools -k "$pytest_k" &
    pids+=($!)
    pytest_k=
  fi
  # One original's workloads at a time: each process holds that original's buffers, and two originals' at once ran
  # out of GPU memory on an H100 (80 GB).
  for original in "${originals[@]}"; do
    group=()
    for w in "${workloads[@]}"; do
      # shellcheck disable=SC2086 # the workload and the shared arguments are word lists
      run_step "gc-moe-ab $w --prebuild-only [$original]" "prebuild_${original}_$(log_name "$w")" \
        "${with_original[@]}" "$original" gc-moe-ab $w $ab_args --prebuild-only &
      group+=($!)
    done
    ((${#group[@]})) && wait "${group[@]}"
  done
  ((${#pids[@]})) && wait "${pids[@]}"
  summary+=("$(printf '%-44s %4d s (every step below ran alone on the GPU)' "prebuild phase" "$SECONDS")")
  for f in "$LOGS"/prebuild_* "$LOGS"/matrix.log "$LOGS"/pytest.log; do
    [[ -f $f ]] && summary+=("  $(basename "$f"): $(grep -E 'prebuild: [0-9.]+ s|compat matrix:|passed|failed' "$f" \
      | tail -n 1 | cut -c1-100)")
  done
  phase_end=0 pids=()
fi
if [[ -n $pytest_k ]]; then
  run_step "pytest -k $pytest_k" pytest.log "${with_original[@]}" "${originals[0]}" "$PY" -m pytest -q -rs -m gpu \
    tests/tools -k "$pytest_k"
fi
for w in "${workloads[@]}"; do
  # shellcheck disable=SC2086 # the workload and the shared arguments are word lists
  if ((parallel)); then
    run_step "gc-moe-ab $w (parallel)" "$(log_name "$w")" "${with_original[@]}" "${originals[0]}" gc-moe-ab $w $ab_args &
    pids+=($!)
  else
    for original in "${originals[@]}"; do
      run_step "gc-moe-ab $w [$original]" "${original}_$(log_name "$w")" "${with_original[@]}" "$original" \
        gc-moe-ab $w $ab_args
      suffix_results "$original"
    done
  fi
done
((${#pids[@]})) && wait "${pids[@]}"
((parallel)) && for w in "${workloads[@]}"; do
  summary+=("$(printf '%-44s %s' "gc-moe-ab $w (parallel)" "$(grep -c 'T=' "$LOGS/$(log_name "$w")") lines with T=")")
done
if ((matrix)); then
  run_step gc-moe-matrix matrix.log "${with_original[@]}" "${originals[0]}" bash -c "gc-moe-matrix $matrix_args"
fi
for args in "${ncu_runs[@]}"; do
  # shellcheck disable=SC2086 # the run's arguments are a word list
  run_step "ncu gc-moe-ab $args" "ncu_$(log_name "$args" | sed 's/^ab_//; s/\.log$/.txt/')" "${with_original[@]}" \
    "${originals[0]}" ncu --graph-profiling node --clock-control none --kernel-name "$NCU_KERNELS" \
    --launch-skip "$NCU_SKIP" --launch-count "$NCU_LAUNCHES" "${NCU_SECTIONS[@]}" gc-moe-ab $args --out /tmp/ncu_ab.json
done
printf '%s\n' "${summary[@]}" >"$LOGS/summary.txt"
pack
echo "== summary"
cat "$LOGS/summary.txt"
ls -la "$OUT"
