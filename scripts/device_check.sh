#!/usr/bin/env bash
# One command for the lent GPU machine (device tool `run`, from the repository root):
#   bash scripts/device_check.sh [--tests-only | --bench-only | --profiles-only] [--bench 'NAME [ARGS]']... [-k EXPR]
#                                [--profile PRESET:T:FORMAT]... [--counters PRESET:T:STEP,STEP...[:FORMAT]]...
#                                [--ncu-normal T:HIDDEN:EXPERTS[:NUM_SMS]]...  (the deep_ep normal-mode direction
#                                                   kernels of one eager call each under Nsight Compute with their
#                                                   stall sites per SASS line, per --tree)
#                                [--ncu-ll T[:HIDDEN:EXPERTS]]...  (the deep_ep low-latency kernels of one eager
#                                                   call each under Nsight Compute with their stall sites per SASS line)
#                                [--ncu-layer PRESET:T[:KERNEL_REGEX]]...  (the one-rank Mega MoE layer's kernels,
#                                                   default its finalize, under Nsight Compute with their stall sites
#                                                   per SASS line)
#                                [--deepep-legacy DIR]  (DeepEP's legacy tests from checkout DIR against the facade)
#                                [--legacy-timeout S]   (seconds per legacy test, default 900)
#                                [--legacy-tests 'A.py B.py']  (which of them: default both)
#                                [--no-pytest]  (with --tests-only: the legacy tests alone)
#                                [--tree NAME=DIR]... [--rounds N]  (the picked benchmarks once per staged tree and
#                                                   round, interleaved: scripts/bench_trees.sh; DIR . = this tree)
#                                [--shared-gpu P]  (P ranks on one GPU under CUDA MPS: the `multigpu` tests,
#                                                   DeepEP's legacy tests with --num-processes P, and the picked
#                                                   BENCHES_SHARED benchmarks with --ranks P)
#                                [--pack]  (at the end, everything under $OUT in one file, $OUT/device_check.tar.gz:
#                                           the device tool brings back at most 8 files)
# Carry .carry/provenance (bash scripts/tree_provenance.sh, run here first) so that result files name this commit.
# Installs what the machine lacks (carried wheels in .whl/, filled by scripts/fetch_device_deps.sh, and this
# package; the original DeepEP where scripts/build_deep_ep.sh staged it in .carry/deep_ep and deep_ep_ab runs),
# runs the `gpu` / `multigpu` tests and the benchmarks, leaves logs and result files under $OUT, and
# prints a summary table last. Later issues add their benchmark names to BENCHES and their tests under tests/.
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off (docs/platform_notes.md): every process started below inherits this.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/device_out}"
export GC_MOE_CACHE_DIR="${GC_MOE_CACHE_DIR:-/tmp/gc_moe_cache}"
PY="${PYTHON:-python3}"
# The commit this copy is (carried .carry/provenance, written here by scripts/tree_provenance.sh): the result files
# name it (GC_MOE_GIT_SHA / GC_MOE_GIT_DIRTY), not the copy's stale git; a caller's own setting wins.
[[ -n "${GC_MOE_GIT_SHA:-}" ]] || eval "$(bash scripts/tree_provenance.sh --env)"
echo "tree: ${GC_MOE_GIT_SHA:-as the copy's git says} (dirty: ${GC_MOE_GIT_DIRTY:-as the copy's git says})"

# Benchmarks run by default: bench/<name>.py --out bench/results/<name>.json (append new ones here).
BENCHES=(runtime_sm90 gemm_sm90 predispatch_sm90 sglang_sequence_sm90)
# Benchmarks that need two GPUs: run by default only where there are two.
BENCHES_X2=(operator_sm90 deep_ep_ll)
# Nsight Compute sections of a --profile run (clocks left alone: --clock-control none).
NCU_SECTIONS=(SpeedOfLight ComputeWorkloadAnalysis SchedulerStats WarpStateStats MemoryWorkloadAnalysis)
# Nsight Compute metrics of a --counters run: DRAM and L2 traffic of whole CUDA-graph replays.
NCU_COUNTERS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
NCU_COUNTERS+=,lts__t_sectors_op_read.sum,lts__t_sectors_op_read_lookup_miss.sum
# Nsight Compute sections and metrics of a --ncu-normal run.
NCU_NORMAL=(--section SpeedOfLight --section SchedulerStats --section WarpStateStats --section LaunchStats
            --section SourceCounters
            --metrics smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum)
# Benchmarks that start P ranks on one GPU themselves: the only ones --shared-gpu P runs (picked with --bench), given
# --ranks P before their own arguments.
BENCHES_SHARED=(deep_ep_ab)
# Result names that are not the script name (two-rank benchmarks name their world size).
declare -A RESULT_NAME=([operator_sm90]=operator_sm90_x2 [deep_ep_ll]=deep_ep_ll_x2)

run_tests=1 run_bench=1 picked=() pytest_k=() profiles=() counters=() ncu_normal=() ncu_ll=() ncu_layer=() deepep_legacy=
legacy_timeout=900 legacy_tests="test_intranode.py test_low_latency.py" run_pytest=1
shared_gpu= pack=0
tree_args=() rounds=1
while (($#)); do
  case "$1" in
    --tests-only) run_bench=0 ;;
    --bench-only) run_tests=0 ;;
    --profiles-only) run_tests=0 run_bench=0 ;;  # only the --profile and --counters runs
    --bench) picked+=("$2"); shift ;;  # a benchmark's name, then any arguments of its own (e.g. a part of it)
    -k) pytest_k=(-k "$2"); shift ;;
    --deepep-legacy) deepep_legacy="$2"; shift ;;  # scripts/run_deepep_legacy_tests.sh --deepep DIR
    --legacy-timeout) legacy_timeout="$2"; shift ;;  # its --timeout
    --legacy-tests) legacy_tests="$2"; shift ;;  # its --tests
    --no-pytest) run_pytest=0 ;;
    --shared-gpu) shared_gpu="$2"; shift ;;  # P ranks share the GPU (tests/kit/two_rank.py's SHARED_GPU_ENV)
    --tree) tree_args+=(--tree "$2"); shift ;;  # NAME=DIR: a tree staged by scripts/stage_base_tree.sh (. = this one)
    --rounds) rounds="$2"; shift ;;  # the trees' rounds
    --profile) profiles+=("$2"); shift ;;  # one W1 and one W2 launch of bench/profile_gemm_sm90.py under ncu
    # one CUDA graph of these steps (w1, w2, dg_w1, dg_w2) replayed twice under ncu, caches left alone
    --counters) counters+=("$2"); shift ;;
    # one eager call of each deep_ep op of bench/profile_deep_ep_host.py --ncu (normal mode: Config(NUM_SMS, 8, 256),
    # default 24) at one rank, its normal-mode dispatch and combine kernels under ncu, once per --tree (or this tree)
    --ncu-normal) ncu_normal+=("$2"); shift ;;
    # the same script's low-latency dispatch and combine kernels (Tmax: T rounded up to a multiple of 4) at one rank
    # under ncu: WarpStateStats and SourceCounters, and each kernel's SASS with its stall samples per line (ncu --page
    # source) as CSV
    --ncu-ll) ncu_ll+=("$2"); shift ;;
    # one call of bench/profile_layer_sm90.py's layer (gc-moe-ab's facade operator, one rank) under ncu: the kernels
    # KERNEL_REGEX matches (default gc_sm90_finalize, role3), their memory workload and stall samples, each kernel's
    # SASS with its stall samples per line as CSV; caches flushed before each kernel (ncu's default)
    --ncu-layer) ncu_layer+=("$2"); shift ;;
    --pack) pack=1 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if ((!run_bench)); then
  BENCHES=()
elif ((${#picked[@]})); then
  BENCHES=("${picked[@]}")
elif (($(nvidia-smi -L 2>/dev/null | grep -c '^GPU') >= 2)); then
  BENCHES+=("${BENCHES_X2[@]}")
fi
RESULTS=()
for spec in "${BENCHES[@]}"; do name="${spec%% *}"; RESULTS+=("${RESULT_NAME[$name]:-$name}"); done
mkdir -p "$OUT"

(
  set -e  # any failing setup step fails the setup
  echo "== setup $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  "$PY" -c "import sys, torch, cuda.bindings; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cuda-bindings', cuda.bindings.__version__, 'gpus', torch.cuda.device_count())"
  command -v nvcc && nvcc --version | tail -n 1
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  # The wheel installs on this Python too, with every subpackage and the kernel sources inside it.
  rm -rf /tmp/gc_wheel /tmp/gc_wheel_site
  "$PY" -m pip wheel -q --no-index --no-deps --no-build-isolation -w /tmp/gc_wheel . &&
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/gc_wheel_site /tmp/gc_wheel/gc_moe_compat-*.whl &&
    (cd /tmp && PYTHONPATH=/tmp/gc_wheel_site "$PY" -c "import sys, importlib.resources as r, gc_moe_compat.runtime, \
gc_moe_compat.deep_gemm, gc_moe_compat.deep_ep, gc_moe_compat.testing.reference; k = r.files('gc_moe_compat.kernels'); \
print('wheel ok on', sys.version.split()[0], sorted(p.name for p in k.iterdir() if p.is_dir() and p.name != '__pycache__'))")
) >"$OUT/setup.log" 2>&1
setup_rc=$?
if compgen -G ".whl/*.whl" >/dev/null; then export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi
if ((setup_rc)); then cat "$OUT/setup.log"; echo "setup failed ($setup_rc)"; exit "$setup_rc"; fi
grep "^wheel ok" "$OUT/setup.log"

# DeepGEMM 2.8.2 (SM90 baseline; docs/platform_notes.md): built from the carried sdist in the background while the tests
# run; the benchmarks import it from /tmp/deepgemm with libstdc++ preloaded (its JIT crashes otherwise).
dg_pid=
need_dg=$run_bench
[[ " ${counters[*]} " == *dg_* ]] && need_dg=1  # a --counters step of DeepGEMM's
# A warm machine keeps /tmp between calls: a DeepGEMM already built there is reused.
if ((need_dg)) && compgen -G ".whl/deepinfer_gemm-*.tar.gz" >/dev/null && [[ -d /tmp/deepgemm/deep_gemm ]]; then
  (echo "DeepGEMM already built in /tmp/deepgemm (warm machine): reused") >"$OUT/deepgemm_build.log" &
  dg_pid=$!
elif ((need_dg)) && compgen -G ".whl/deepinfer_gemm-*.tar.gz" >/dev/null; then
  (
    set -e
    mkdir -p /tmp/elfutils
    for deb in .whl/libdw-dev_*.deb .whl/libelf-dev_*.deb; do dpkg-deb -x "$deb" /tmp/elfutils; done
    inc=/tmp/elfutils/usr/include lib=/tmp/elfutils/usr/lib/x86_64-linux-gnu
    CPATH="$inc${CPATH:+:$CPATH}" LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}" \
      LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_HOME=/usr/local/cuda \
      "$PY" -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/deepgemm .whl/deepinfer_gemm-*.tar.gz
  ) >"$OUT/deepgemm_build.log" 2>&1 &
  dg_pid=$!
fi

test_rc=0
markers="gpu or multigpu" legacy_procs=1
if [[ -n "$shared_gpu" ]]; then
  # P processes share the GPU: MPS runs them concurrently (stopped on every exit path by its EXIT trap).
  source scripts/mps.sh
  mps_start >>"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
  # One client first: P clients arriving while the server still starts get "MPS server is not ready" (error 807).
  "$PY" -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" >>"$OUT/setup.log" 2>&1
  export GC_MOE_TEST_SHARED_GPU="$shared_gpu"
  markers="multigpu" legacy_procs="$shared_gpu"
  kept=() RESULTS=()
  for spec in "${BENCHES[@]}"; do
    name="${spec%% *}"
    if [[ " ${BENCHES_SHARED[*]} " == *" $name "* ]]; then
      kept+=("$name --ranks $shared_gpu${spec:${#name}}") RESULTS+=("${RESULT_NAME[$name]:-$name}")
    fi
  done
  BENCHES=("${kept[@]}")
fi
# The original DeepEP (staged by scripts/build_deep_ep.sh into .carry/deep_ep, carried): built in the background while
# the tests run where a picked benchmark compares against it (deep_ep_ab); a build already there (a warm machine) is
# reused. Its package goes on PYTHONPATH before the benchmarks (gc_moe_compat.originals finds it there).
de_pid=
if ((run_bench)) && [[ " ${BENCHES[*]} " == *" deep_ep_ab"* && -f .carry/deep_ep/SOURCE ]]; then
  if compgen -G ".carry/deep_ep/deep_ep_cpp*.so" >/dev/null; then
    (echo "DeepEP already built in .carry/deep_ep: reused") >"$OUT/deep_ep_build.log" 2>&1 &
  else
    bash scripts/build_deep_ep.sh --build >"$OUT/deep_ep_build.log" 2>&1 &
  fi
  de_pid=$!
fi

if ((run_tests && run_pytest)); then
  timeout_opt=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=300)
  "$PY" -m pytest -m "$markers" -v -s -rA "${timeout_opt[@]}" "${pytest_k[@]}" \
    --junitxml="$OUT/pytest.xml" tests >"$OUT/pytest.log" 2>&1
  test_rc=$?
fi

if [[ -n "$deepep_legacy" ]]; then
  PYTHON="$PY" bash scripts/run_deepep_legacy_tests.sh --deepep "$deepep_legacy" --logs "$OUT/deepep_legacy" \
    --num-processes "$legacy_procs" --timeout "$legacy_timeout" --tests "$legacy_tests" >"$OUT/deepep_legacy.log" 2>&1 \
    || test_rc=1
  tail -n 3 "$OUT/deepep_legacy.log"
fi

bench_rc=0
if [[ -n "$dg_pid" ]]; then
  if wait "$dg_pid"; then
    export PYTHONPATH="/tmp/deepgemm${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
    export LD_LIBRARY_PATH="/tmp/elfutils/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    echo "DeepGEMM build failed (deepgemm_build.log); benchmarks record it as unavailable" >>"$OUT/bench.log"
  fi
fi
if [[ -n "$de_pid" ]]; then
  if wait "$de_pid"; then
    eval "$(bash scripts/build_deep_ep.sh --env)"
  else
    echo "DeepEP build failed (deep_ep_build.log); deep_ep_ab records the original as unavailable" >>"$OUT/bench.log"
  fi
fi
if ((run_bench)) && ((${#tree_args[@]})); then
  # an A/B of staged trees: every run's files in $OUT/trees.tar.gz, no headline result files
  bash scripts/bench_trees.sh --out "$OUT" --rounds "$rounds" "${tree_args[@]}" "${BENCHES[@]}" || bench_rc=1
  RESULTS=()
elif ((run_bench)); then
  for spec in "${BENCHES[@]}"; do
    read -ra words <<<"$spec"
    name="${words[0]}"
    result="${RESULT_NAME[$name]:-$name}"
    echo "== bench $name -> $result" >>"$OUT/bench.log"
    # the committed files step aside, so that what comes back is this run's: a failed run's partial file (a
    # benchmark that writes as it goes, e.g. deep_ep_ab after each P) comes back too, the failure in bench.log; a
    # file the run did not write is put back
    files=("bench/results/$result.json" "bench/results/$result.png")
    for file in "${files[@]}"; do [[ -f "$file" ]] && mv "$file" "$file.committed"; done
    "$PY" "bench/$name.py" --out "bench/results/$result.json" "${words[@]:1}" >>"$OUT/bench.log" 2>&1 ||
      { bench_rc=1; echo "bench $name FAILED" >>"$OUT/bench.log"; }
    for file in "${files[@]}"; do
      if [[ -f "$file" ]]; then
        cp "$file" "$OUT/" && rm -f "$file.committed"
      elif [[ -f "$file.committed" ]]; then
        mv "$file.committed" "$file"
      fi
    done
  done
fi

for spec in "${profiles[@]}"; do
  IFS=: read -r preset tokens format <<<"$spec"
  log="$OUT/profile_${preset}_${tokens}_${format}.txt"
  sections=()
  for section in "${NCU_SECTIONS[@]}"; do sections+=(--section "$section"); done
  ncu --clock-control none --kernel-name regex:gc_sm90 --launch-skip 2 --launch-count 2 "${sections[@]}" \
    "$PY" bench/profile_gemm_sm90.py --preset "$preset" --tokens "$tokens" --format "$format" >"$log" 2>&1 ||
    echo "profile $spec FAILED ($log)" >>"$OUT/bench.log"
done

for spec in "${counters[@]}"; do
  IFS=: read -r preset tokens steps format <<<"$spec"
  csv="$OUT/counters_${preset}_${tokens}_${steps//,/+}${format:+_$format}.csv"
  # shellcheck disable=SC2086  # the steps are separate arguments
  ncu --profile-from-start off --graph-profiling graph --cache-control none --clock-control none \
    --metrics "$NCU_COUNTERS" --csv --page raw "$PY" bench/profile_gemm_sm90.py --preset "$preset" --tokens "$tokens" \
    --format "${format:-fp8xfp8}" --repeats 1 --sequence ${steps//,/ } --graph 2 >"$csv" 2>&1 ||
    echo "counters $spec FAILED ($csv)" >>"$OUT/bench.log"
done

ncu_pages() {  # BASE: BASE.ncu-rep's text report (BASE.txt) and every launch's SASS with its stall samples per line,
  # one CSV in profile order (BASE_sass.csv)
  ncu --import "$1.ncu-rep" --print-summary none >"$1.txt" 2>&1
  ncu --import "$1.ncu-rep" --page source --csv --print-source sass >"$1_sass.csv" 2>&1
}

if ((${#ncu_normal[@]})); then  # every report in one file (the device tool brings back few), a line per kernel here
  rm -rf /tmp/ncu_normal && mkdir -p /tmp/ncu_normal  # a warm machine keeps /tmp: only this call's reports
  specs=(--tree this=.)
  ((${#tree_args[@]})) && specs=("${tree_args[@]}")
  for spec in "${ncu_normal[@]}"; do
    IFS=: read -r tokens hidden experts num_sms <<<"$spec"
    sms=()  # the benchmark's own default (DeepEP's test config) unless the spec names a count
    [[ -n "$num_sms" ]] && sms=(--num-sms "$num_sms")
    for ((i = 1; i < ${#specs[@]}; i += 2)); do
      name="${specs[$i]%%=*}" dir="${specs[$i]#*=}"
      path="${PYTHONPATH:-}"
      [[ "$dir" != "." ]] && path="$(cd "$dir" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
      base="/tmp/ncu_normal/${name}_T${tokens}_H${hidden}_E${experts}_sms${num_sms:-default}"
      (cd bench && PYTHONPATH="$path" timeout 300 ncu --profile-from-start off --clock-control none \
        --kernel-name regex:'gc_ep_normal_(dispatch|combine)$' "${NCU_NORMAL[@]}" -f -o "$base" "$PY" \
        profile_deep_ep_host.py --ncu --tokens "$tokens" --hidden "$hidden" --experts "$experts" "${sms[@]}") \
        >"$base.log" 2>&1 || echo "ncu-normal $name $spec FAILED ($base.log)" >>"$OUT/bench.log"
      ncu_pages "$base"  # its SASS pages in profile order: dispatch BF16, dispatch FP8, combine (profile_deep_ep_host)
      echo "ncu-normal $name $spec: $(grep -E '^  gc_ep_normal_|^ +Duration |^ +smsp__inst_executed.sum ' "$base.txt" |
        awk '/gc_ep_normal_/ {printf "%s", (n++ ? "; " : "") $1} /Duration|inst_executed/ {printf " %s %s", $1, $NF}')"
    done
  done | tee -a "$OUT/bench.log"
  tar czf "$OUT/ncu_normal.tar.gz" -C /tmp ncu_normal
fi

if ((${#ncu_ll[@]})); then  # the reports and their SASS pages in one file, a line per kernel here
  rm -rf /tmp/ncu_ll && mkdir -p /tmp/ncu_ll
  for spec in "${ncu_ll[@]}"; do
    IFS=: read -r tokens hidden experts <<<"$spec"
    hidden="${hidden:-7168}" experts="${experts:-256}"  # the profile script's defaults, named in the report's name
    base="/tmp/ncu_ll/T${tokens}_H${hidden}_E${experts}"
    (cd bench && timeout 300 ncu --profile-from-start off --clock-control none --kernel-name-base demangled \
      --kernel-name regex:'ep_ll::(dispatch|combine)' --section SpeedOfLight --section LaunchStats \
      --section WarpStateStats --section SourceCounters -f -o "$base" "$PY" profile_deep_ep_host.py --ncu \
      --ll-tokens "$tokens" --hidden "$hidden" --experts "$experts") >"$base.log" 2>&1 ||
      echo "ncu-ll $spec FAILED ($base.log)" >>"$OUT/bench.log"
    ncu --import "$base.ncu-rep" --print-summary none >"$base.txt" 2>&1
    for kernel in dispatch combine; do
      ncu --import "$base.ncu-rep" --kernel-name-base demangled --kernel-name regex:"ep_ll::$kernel" --page source \
        --csv --print-source sass >"${base}_${kernel}_sass.csv" 2>&1
    done
    # the imported report names kernels by function ("  dispatch(PeerTable, EpLlParams) (grid)x(block), ...")
    echo "ncu-ll $spec: $(grep -E '^  (dispatch|combine)\(|^ +Duration ' "$base.txt" |
      awk '/^  (dispatch|combine)\(/ {printf "%s%s", (n++ ? "; " : ""), substr($1, 1, index($1, "(") - 1)}
           /Duration/ {printf " %s %s", $NF, $(NF-1)}')"
  done | tee -a "$OUT/bench.log"
  tar czf "$OUT/ncu_ll.tar.gz" -C /tmp ncu_ll
fi

if ((${#ncu_layer[@]})); then  # the reports and their SASS pages in one file, a line per kernel here
  rm -rf /tmp/ncu_layer && mkdir -p /tmp/ncu_layer
  for spec in "${ncu_layer[@]}"; do
    IFS=: read -r preset tokens regex <<<"$spec"
    regex="${regex:-gc_sm90_finalize}"
    base="/tmp/ncu_layer/${preset}_T${tokens}_${regex//[^A-Za-z0-9_]/_}"
    timeout 300 ncu --profile-from-start off --clock-control none --kernel-name regex:"$regex" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SourceCounters --metrics "$NCU_COUNTERS" -f -o "$base" \
      "$PY" bench/profile_layer_sm90.py --preset "$preset" --tokens "$tokens" >"$base.log" 2>&1 ||
      echo "ncu-layer $spec FAILED ($base.log)" >>"$OUT/bench.log"
    ncu_pages "$base"
    echo "ncu-layer $spec: $(grep -E '^  gc_sm90_|^ +(Duration|DRAM Throughput|Achieved Occupancy) ' "$base.txt" |
      awk '/^  gc_sm90_/ {printf "%s%s", (n++ ? "; " : ""), $1} !/^  gc_sm90_/ {printf " %s %s %s", $1, $(NF-1), $NF}')"
  done | tee -a "$OUT/bench.log"
  tar czf "$OUT/ncu_layer.tar.gz" -C /tmp ncu_layer
fi

"$PY" scripts/device_summary.py "$OUT" "${RESULTS[@]}"
if ((pack)); then  # one file back instead of many (the summary above was printed from them first)
  tar czf /tmp/device_check.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/device_check.tar.gz "$OUT/"
fi
exit $((test_rc || bench_rc))
