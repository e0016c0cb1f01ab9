#!/usr/bin/env bash
# The one script to run on a lent GPU machine (device tool `run`, carry [".gpu"]), from the repo root:
#   bash tools/gpu_runner.sh [tests|bench|ops|split|all] [test paths (tests/...) or extra pytest args...]
# Installs the payload that tools/../shared/tools/gpu-payload put in .gpu/ (gguf, platformdirs wheels and
# the fixtures), makes `minecart` importable without a build (links the package folders), runs the GPU
# tests and/or the benchmark, and writes logs and JSON to $OUT (at most 8 files come back).
# `split` (not part of `all`): tests/gpu/test_split.py with the speed/memory test switched on
# (MINECART_SPLIT_PERF=1; split_tests.log), then `minecart bench --devices cuda:0,cuda:1` on the
# 9B shape at an 18,432-token prompt: 1 device, 2 devices, 2 devices on simulated PCIe Gen1 x1
# risers (split.json, split.log). cuda:1 is the second GPU when there are two, else a logical
# device sharing cuda:0 (engine/rig.py).
# Env: BENCH_ARGS (default: --shape qwen3.5-9b --quant q8_0), BENCH_TIMEOUT (s, default 420),
#      TEST_TIMEOUT (s, default 300), SPLIT_ARGS (default: --shape qwen3.5-9b --quant q8_0
#      --split-prompt 18432 --decode-tokens 32), SPLIT_TEST_TIMEOUT (s, default 200),
#      SPLIT_TIMEOUT (s, default 330; tests + bench stay under the 600 s of one device call).
# `compare OLD_TREE [OLD_TREE ...]` (not part of `all`): the same synthesized file benchmarked by older
# checkouts of the code (each a folder with app/ engine/ kernels/ resources/, e.g. a `git archive` of the
# commit before a refactor; the first is "old", the others by their folder names) and by this tree,
# alternating old, ..., new, old, ..., new, so a change that must not slow the engine is judged in one run
# (COMPARE_ARGS, default: --prefill 4096 --decode-ctx 0 --decode-tokens 64; COMPARE_KV: this tree's KV
# cache types, default f32; compare.log, compare_*.json).
# `steps OLD_TREE ...` (not part of `all`): a decode step's GPU time, this tree against older ones, alternated
# (below; docs/BENCHMARKS.md v42). `matmuls OLD_TREE ...` (not part of `all`): the same for the matmul kernels
# alone, kernels/bench_gemv.py's 9B step lines (below; v45).
# `kernel-profile` (not part of `all`): Nsight Compute's sections for a few launches of one kernel
# (KP_KERNEL, default gemm_batch) inside bench_gemv --multi (KP_ARGS); KP_LOG (default kernel_profile.txt).
# `ptx` (not part of `all`): the GPU tests with every kernel loaded from compute_61 PTX, then from
# compute_70 PTX (MINECART_KERNEL_PTX=.gpu/ptx61, .gpu/ptx70; the driver JIT-compiles them, so the
# Pascal/Volta code paths run on this card). Make the PTX BEFORE the device call, on the machine with
# the NVRTC 12 wheel: `python tools/make_ptx.py` (writes .gpu/ptx.tar.xz; unpacked here). A stale
# archive (kernel sources changed since) is refused up front. PTX_TESTS: the tests to run (default
# tests/gpu without the split, vision and q3-model tests); PTX_TIMEOUT (s per pytest run, default
# 170); separate probe caches per build. PTX_GROUPS=N (default 1: one pytest run per architecture, one
# after the other): N pytest processes per architecture, both architectures at once, then the files that
# measure memory alone (the whole default list in 406 s with N = 3 and PTX_TIMEOUT=320 on an H100,
# docs/BENCHMARKS.md v42; the slowest group took 309 s of its 320). Logs: ptx61_tests.log,
# ptx70_tests.log.
# `sweep` (not part of `all`): one call's worth of the checks a session owes, in order, each begun only
# while its time is left (below).
# `setup`: only the install and the links above, for a call's own script (then PYTHONPATH=/tmp/mc:/tmp/site).
set -u
MODE=${1:-all}
shift || true
MODES="all tests bench ops split compare steps matmuls batch profile moe-host host-diag kernel-profile ptx sweep setup"
known=""
for m in $MODES; do [ "$m" = "$MODE" ] && known=1; done
if [ -z "$known" ]; then echo "gpu_runner.sh: no mode '$MODE' (one of: $MODES)" >&2; exit 2; fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$(pwd)

# tests / ptx: test paths given as arguments (tests/..., selectors included) name the files to run, as
# GPU_TESTS / PTX_TESTS do; the other arguments go to pytest. (Before, such paths went to pytest beside the
# whole default list, and a call meant for a few files ran the suite from its first file.)
if [ "$MODE" = tests ] || [ "$MODE" = ptx ]; then
  paths=""
  rest=()
  for a in "$@"; do
    case $a in
      tests/*) paths="$paths $a" ;;
      *) rest+=("$a") ;;
    esac
  done
  paths=${paths# }
  if [ -n "$paths" ]; then
    var=GPU_TESTS
    [ "$MODE" = ptx ] && var=PTX_TESTS
    if [ -n "${!var:-}" ]; then
      echo "gpu_runner.sh $MODE: test paths given both in $var and as arguments ($paths); name them once" >&2
      exit 2
    fi
    export "$var=$paths"
    set -- "${rest[@]}"
  fi
fi

# link_tree DIR DEST: DEST/minecart/{app,engine,kernels,resources} -> DIR's folders, so DEST on PYTHONPATH
# imports DIR's code without a build
link_tree() {
  mkdir -p "$2/minecart"
  for d in app engine kernels resources; do ln -sfn "$1/$d" "$2/minecart/$d"; done
}

python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl >"$OUT/env.txt" 2>&1
link_tree "$ROOT" /tmp/mc
export PYTHONPATH=/tmp/mc:/tmp/site
export MINECART_FIXTURES="$ROOT/.gpu/fixtures"
export MINECART_CACHE_DIR=/tmp/minecart-cache
{
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())"
  python3 -c "import minecart.kernels.ops, minecart.engine.backends.cupy_backend as c; print('backend import ok; gpus', c.device_count())"
} >>"$OUT/env.txt" 2>&1

# llama.cpp's llama-bench for the peer comparisons (moe-host, sweep): built by ../shared/tools/llama-peer's
# .gpu/build-llama.sh once a machine. start_peer_build [NICE] starts that build in the background unless the
# binary is there or a build runs (/tmp/peer_build.pid holds its PID: a call's own script may start it
# earlier); peer_building says whether one still runs.
LB=/tmp/peer/build/bin/llama-bench
peer_building() { [ -f /tmp/peer_build.pid ] && kill -0 "$(cat /tmp/peer_build.pid)" 2>/dev/null; }
start_peer_build() {
  if [ -x "$LB" ] || peer_building; then return 0; fi
  (nice -n "${1:-0}" bash .gpu/build-llama.sh >"$OUT/peer_build.log" 2>&1) &
  echo $! >/tmp/peer_build.pid
}

# ncu_kernel_times LIMIT CSV ERR ARGS...: Nsight Compute's GPU time of every kernel that
# `tools/profile_decode.py ARGS --ncu` measures (one eager step, or one prefill), as CSV (profile, sweep;
# summed by name with `tools/profile_decode.py --summarize CSV`)
ncu_kernel_times() {
  local limit=$1 csv=$2 err=$3
  shift 3
  timeout "$limit" ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 tools/profile_decode.py "$@" --ncu >"$csv" 2>"$err"
}

# the test files a list of pytest arguments names (folders expanded as pytest orders them, selectors cut)
test_files() {
  for t in "$@"; do
    t=${t%%::*}
    if [ -d "$t" ]; then ls "$t"/test_*.py; else echo "$t"; fi
  done
}

# The files that measure memory or take both devices: with TEST_GROUPS / PTX_GROUPS they run alone,
# after the groups. alone_files -v FILES...: the others; alone_files "" FILES...: these (space separated)
ALONE_FILES="tests/gpu/test_load_memory.py tests/gpu/test_context_limit_gpu.py tests/gpu/test_weight_arenas.py tests/gpu/test_split.py"
alone_files() {
  local how=$1
  shift
  # shellcheck disable=SC2046,SC2086
  printf '%s\n' "$@" | grep $how -x -F $(printf -- '-e %s ' $ALONE_FILES) | tr '\n' ' '
}

# run_pytest LIMIT WHAT LOG ENV FILES [pytest args...]: one pytest process over FILES (-v, so that a run cut off
# after LIMIT seconds still says what passed) with ENV (VAR=value words, no spaces inside) in its
# environment, appending to LOG, then "WHAT exit N" there and on stdout (the tests and ptx modes)
run_pytest() {
  local limit=$1 what=$2 log=$3 envs=$4 files=$5
  shift 5
  # shellcheck disable=SC2086
  timeout "$limit" env $envs python3 -m pytest -v -rfE -p no:cacheprovider $files "$@" >>"$log" 2>&1
  echo "$what exit $?" | tee -a "$log"
}

# start_groups N LOGBASE RUN FILES [pytest args...]: RUN (a command's words, called as RUN GROUP_FILES LOG
# LABEL [pytest args...]) on each of N groups of FILES (dealt out in turn), all in the background, group
# g logging to LOGBASE_gg.log; an empty group runs nothing (pytest with no path would run every test).
# The caller waits, then collect_groups N LOGBASE LOG appends the groups' logs to LOG in group order.
start_groups() {
  local n=$1 base=$2 run=$3 files=$4 g grp
  shift 4
  for g in $(seq 1 "$n"); do
    # shellcheck disable=SC2086
    grp=$(printf '%s\n' $files | awk -v n="$n" -v g="$g" '(NR - 1) % n == g - 1' | tr '\n' ' ')
    rm -f "${base}_g$g.log"
    # shellcheck disable=SC2086
    [ -n "${grp// /}" ] && $run "$grp" "${base}_g$g.log" "group$g" "$@" &
  done
}
collect_groups() {
  local g
  for g in $(seq 1 "$1"); do
    if [ -f "${2}_g$g.log" ]; then cat "${2}_g$g.log" >>"$3"; fi
  done
}

if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  # GPU_TESTS: the files to run (default the whole tests/gpu, which takes more than one call's 600 s in
  # one process: run it in parts, or in groups). -v, so that a run cut off by TEST_TIMEOUT still says
  # what passed (summary below). TEST_GROUPS=N (default 1): N pytest processes at once on the card (the
  # files dealt out in turn, each process with its own probe cache), then the files that measure memory
  # and the split alone (the whole tests/gpu in 272-295 s with N = 4 on an H100, docs/BENCHMARKS.md v42;
  # TEST_TIMEOUT then bounds each group and the alone run)
  # pytest over some of the files, appending to the log $2 (label $3: each group its own probe cache)
  gpu_pytest() {
    local cache=$MINECART_CACHE_DIR
    [ "$3" = all ] || cache="$cache-$3"
    run_pytest "${TEST_TIMEOUT:-300}" "gpu tests ($3)" "$2" "MINECART_CACHE_DIR=$cache" "$1" --timeout 240 -s "${@:4}"
  }
  log="$OUT/gpu_tests.log"
  rm -f "$log"
  # shellcheck disable=SC2086
  files=$(test_files ${GPU_TESTS:-tests/gpu})
  if [ "${TEST_GROUPS:-1}" -le 1 ]; then
    # shellcheck disable=SC2086
    gpu_pytest "${GPU_TESTS:-tests/gpu}" "$log" all "$@"
  else
    # shellcheck disable=SC2086
    start_groups "$TEST_GROUPS" /tmp/gpu_tests gpu_pytest "$(alone_files -v $files)" "$@"
    wait
    collect_groups "$TEST_GROUPS" /tmp/gpu_tests "$log"
    # shellcheck disable=SC2086
    alone=$(alone_files "" $files)
    if [ -n "${alone// /}" ]; then gpu_pytest "$alone" "$log" alone "$@"; fi
    grep -E "^(FAILED|ERROR)|passed|failed" "$log" | tail -20
  fi
  # shellcheck disable=SC2086
  python3 tools/gpu_test_summary.py "$log" $files | tee -a "$log"
fi

if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-420}" python3 -m minecart.engine.cli bench ${BENCH_ARGS:---shape qwen3.5-9b --quant q8_0} \
    --workdir /tmp/bench --json >"$OUT/bench.json" 2>"$OUT/bench.log"
  echo "bench exit $?" | tee -a "$OUT/bench.log"
  tail -25 "$OUT/bench.log"
fi

if [ "$MODE" = ops ] || [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 120 python3 -c "import json; from minecart.kernels.probe import op_breakdown; print(json.dumps(op_breakdown(), indent=1))" \
    >"$OUT/ops.json" 2>&1
  echo "ops exit $?"; cat "$OUT/ops.json" | head -60
fi

if [ "$MODE" = split ]; then
  MINECART_SPLIT_PERF=1 timeout "${SPLIT_TEST_TIMEOUT:-200}" python3 -m pytest -q -rfE -p no:cacheprovider --timeout 240 \
    -s tests/gpu/test_split.py "$@" >"$OUT/split_tests.log" 2>&1
  echo "split tests exit $?" | tee -a "$OUT/split_tests.log"
  grep -E "tok/s|memory|identical|stage runs|passed|failed|skipped|Error" "$OUT/split_tests.log" | tail -40
  GPUS=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
  echo "physical GPUs: $GPUS (cuda:1 is $([ "${GPUS:-0}" -ge 2 ] && echo 'the second GPU' || echo 'a logical device on cuda:0'))" \
    | tee "$OUT/split.log"
  # shellcheck disable=SC2086
  timeout "${SPLIT_TIMEOUT:-330}" python3 -m minecart.engine.cli bench \
    ${SPLIT_ARGS:---shape qwen3.5-9b --quant q8_0 --split-prompt 18432 --decode-tokens 32} \
    --devices cuda:0,cuda:1 --workdir /tmp/bench --json >"$OUT/split.json" 2>>"$OUT/split.log"
  echo "split bench exit $?" | tee -a "$OUT/split.log"
  python3 -c "
import json, sys
from minecart.engine.cli.bench_cmd import format_split_table
d = json.load(open(sys.argv[1]))
print(format_split_table(d['rows'], d['model'].rsplit('/', 1)[-1], d['prompt_tokens'], d['chunk']))
" "$OUT/split.json" 2>&1 | tee -a "$OUT/split.log"
fi

if [ "$MODE" = compare ]; then
  OLD_TREE=$(cd "${1:?compare needs the old tree}" && pwd)
  link_tree "$OLD_TREE" /tmp/mc_old
  olds="old"
  for t in "${@:2}"; do
    name=$(basename "$t")
    link_tree "$(cd "$t" && pwd)" "/tmp/mc_$name"
    olds="$olds $name"
  done
  timeout 240 python3 -m minecart.engine.cli synth ${BENCH_ARGS:---shape qwen3.5-9b --quant q8_0} /tmp/cmp.gguf \
    >"$OUT/compare.log" 2>&1
  # new runs once per KV type in COMPARE_KV (default "f32": the old code's cache; add f16 to see what
  # the default cache costs); the older trees run with their own default cache
  # the SM clock, power and temperature every 200 ms while the benchmarks run (compare_clocks.csv; a
  # short burst measures the ceilings at the top clock, a long prefill may run below it): a summary per run
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader \
    -lms 200 >"$OUT/compare_clocks.csv" 2>/dev/null &
  clock_pid=$!
  for round in 1 2; do
    for which in $olds ${COMPARE_KV:-f32}; do
      path=/tmp/mc:/tmp/site
      extra="--kv-type $which"
      case " $olds " in *" $which "*) path=/tmp/mc_$which:/tmp/site && extra="" ;; esac
      lines=$(wc -l <"$OUT/compare_clocks.csv")
      # shellcheck disable=SC2086
      PYTHONPATH=$path timeout 200 python3 -m minecart.engine.cli bench /tmp/cmp.gguf \
        ${COMPARE_ARGS:---prefill 4096 --decode-ctx 0 --decode-tokens 64} $extra --json \
        >"$OUT/compare_${which}_${round}.json" 2>>"$OUT/compare.log"
      echo "$which round $round exit $?" | tee -a "$OUT/compare.log"
      # this run's samples while the card was busy (power within 80% of the run's highest: the prefill and
      # the decode, not the load): their lowest SM clock and the clock at the highest power
      tail -n +"$((lines + 1))" "$OUT/compare_clocks.csv" | awk -F', *' -v w="$which $round" '
        NF > 3 { n++; c[n] = $2 + 0; p[n] = $4 + 0; top = $3 + 0; if (p[n] > pmax) { pmax = p[n]; cpk = c[n] } }
        END {
          if (!n) exit
          lo = 0; busy = 0
          for (i = 1; i <= n; i++) if (p[i] >= 0.8 * pmax) { busy++; if (!lo || c[i] < lo) lo = c[i] }
          printf "%s clocks: %d of %d samples busy (power >= 80%% of %.0f W): SM %d MHz at the highest power, lowest %d (top %d)\n", w, busy, n, pmax, cpk, lo, top
        }' | tee -a "$OUT/compare.log"
    done
  done
  kill "$clock_pid" 2>/dev/null
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/compare.log"
import glob, json, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/compare_*.json")):
    try:
        d = json.load(open(f))
    except Exception as exc:  # a failed run leaves no JSON
        print(f, "unreadable:", exc)
        continue
    which = f.rsplit("/", 1)[-1].split("_")[1]
    rows.setdefault(which, []).append(d)
def pick(d, key):
    out = {}
    for r in d.get(key, []):
        out[r["context"] if "context" in r else r.get("tokens")] = round(r.get("tokens_per_s", 0), 1)
    return out
for which, ds in rows.items():
    for d in ds:
        print(which, "prefill", pick(d, "prefill"), "decode", pick(d, "decode"))
PY
fi

# link_old_trees LOG TREE...: each older tree (a folder with app/ engine/ kernels/ resources/, e.g. a `git
# archive` of a commit) linked at /tmp/mc_tN, so PYTHONPATH=/tmp/mc_tN:/tmp/site imports it; sets `trees`
# to "this t1 t2 ..." and names each in LOG (the steps and matmuls modes)
link_old_trees() {
  local log=$1 t d i=0
  shift
  trees="this"
  for t in "$@"; do
    i=$((i + 1))
    d=$(cd "$t" && pwd) || { echo "no tree $t" | tee -a "$log"; return 1; }
    link_tree "$d" "/tmp/mc_t$i"
    trees="$trees t$i"
    echo "tree t$i: $t" >>"$log"
  done
}

# tree_path TREE: the PYTHONPATH that imports TREE's code ("this", or a tree link_old_trees linked)
tree_path() { if [ "$1" = this ]; then echo /tmp/mc:/tmp/site; else echo "/tmp/mc_$1:/tmp/site"; fi; }

# steps_args: the synth arguments of the steps mode's model (STEPS_ARGS, default the 9B Q4_K shape);
# steps_file: where that model is kept (a call script may make it beside other work first: source both,
# `sed -n '/^steps_[a-z]*()/p' tools/gpu_runner.sh`)
steps_args() { echo "${STEPS_ARGS:---shape qwen3.5-9b --quant q4_k}"; }
steps_file() { echo "/tmp/bench/steps_$(steps_args | tr -c 'a-z0-9.\n' '_').gguf"; }

if [ "$MODE" = steps ]; then
  # a decode step's GPU time in this tree and in older checkouts, alternated: the replayed graph of the
  # step of each STEPS_BATCHES size (default "1 8 16"; 1 = one token of one sequence, more = a batched
  # step; tools/profile_decode.py), tree after tree, for STEPS_ROUNDS rounds, on one synthesized file
  # (STEPS_ARGS, default --shape qwen3.5-9b --quant q4_k); the one-token step after each of
  # STEPS_CONTEXTS tokens of context (default 64; e.g. "64 16384").
  # Each older tree is a folder with app/ engine/ kernels/ resources/ (a `git archive` of a commit). On
  # an H100 the rounds agreed to 0.2%, where end-to-end tok/s of two runs one after the other moved by
  # several percent (docs/BENCHMARKS.md v41 / v42), so a kernel change is judged this way.
  #   bash tools/gpu_runner.sh steps OLD_TREE [OTHER_TREE ...]
  # STEPS_BUDGET (s, default 480): no measurement starts past it. Log: steps.log (a line a measurement,
  # then per step and tree the best GPU ms and its ratio to the first older tree's: tools/rounds_summary.py)
  T0=$(date +%s)
  SL="$OUT/steps.log"
  : >"$SL"
  link_old_trees "$SL" "$@" || exit 1
  # one file per STEPS_ARGS, made once per machine
  F=$(steps_file)
  mkdir -p /tmp/bench
  # shellcheck disable=SC2046
  [ -s "$F" ] || { timeout 240 python3 -m minecart.engine.cli synth $(steps_args) "$F.part" >>"$SL" 2>&1 \
    && mv "$F.part" "$F"; }
  for round in $(seq 1 "${STEPS_ROUNDS:-3}"); do
    for tree in $trees; do
      path=$(tree_path "$tree")
      for b in ${STEPS_BATCHES:-1 8 16}; do
        ctxs=64
        [ "$b" = 1 ] && ctxs=${STEPS_CONTEXTS:-64}
        for ctx in $ctxs; do
          if [ $(($(date +%s) - T0)) -ge "${STEPS_BUDGET:-480}" ]; then echo "budget spent" >>"$SL"; break 4; fi
          rm -f /tmp/steps.json
          PYTHONPATH=$path timeout 150 python3 tools/profile_decode.py --path "$F" --batch "$b" --context "$ctx" \
            --json /tmp/steps.json >>"$OUT/steps_runs.log" 2>&1
          ms=$(python3 -c "import json; d = json.load(open('/tmp/steps.json')); print(f\"{d['graph_gpu_ms_per_step']} ms GPU, {d['wall_ms_per_step']} ms wall\")" \
            2>/dev/null) && line="batch $b context $ctx $ms" || line="rc failed (batch $b context $ctx)"
          echo "round $round tree $tree | $line" | tee -a "$SL"
        done
      done
    done
  done
  python3 tools/rounds_summary.py "$SL" 2>&1 | tee -a "$SL"
fi

if [ "$MODE" = matmuls ]; then
  # the matmul kernels alone (python -m minecart.kernels.bench_gemv) in this tree and in older checkouts,
  # alternated, as docs/BENCHMARKS.md v45 measured them:
  #   bash tools/gpu_runner.sh matmuls OLD_TREE [OTHER_TREE ...]
  # MATMUL_RUNS: bench_gemv argument lists separated by ';' (default the batched step's matmuls at 8 and
  # 32 sequences and the 4K prefill GEMMs, Q4_K and Q8_0), each run tree after tree, MATMUL_ROUNDS rounds
  # (default 2); MATMUL_BUDGET (s, default 480): no run starts past it. Log: matmuls.log (the 9B step
  # lines of each run, then per line and tree the best ms and its ratio to the first older tree's);
  # matmuls_runs.log (every run's whole output).
  T0=$(date +%s)
  ML="$OUT/matmuls.log"
  : >"$ML"
  link_old_trees "$ML" "$@" || exit 1
  IFS=';' read -r -a runs <<<"${MATMUL_RUNS:---multi --types Q4_K,Q8_0 --tokens 8,32;--prefill 4096 --types Q8_0,Q4_K}"
  for round in $(seq 1 "${MATMUL_ROUNDS:-2}"); do
    for tree in $trees; do
      path=$(tree_path "$tree")
      for args in "${runs[@]}"; do
        if [ $(($(date +%s) - T0)) -ge "${MATMUL_BUDGET:-480}" ]; then echo "budget spent" >>"$ML"; break 3; fi
        echo "== round $round tree $tree: bench_gemv $args" | tee -a "$ML" >>"$OUT/matmuls_runs.log"
        # shellcheck disable=SC2086
        PYTHONPATH=$path timeout 150 python3 -m minecart.kernels.bench_gemv $args >/tmp/matmuls_run.log 2>&1
        echo "rc $?" >>/tmp/matmuls_run.log
        cat /tmp/matmuls_run.log >>"$OUT/matmuls_runs.log"
        grep -E "time of a 9B|^rc [1-9]" /tmp/matmuls_run.log | sed "s/^/round $round tree $tree | /" >>"$ML"
      done
    done
  done
  python3 tools/rounds_summary.py "$ML" 2>&1 | tee -a "$ML"
fi

if [ "$MODE" = batch ]; then
  # issue #17's GPU numbers in one go: the multi-token GEMVs (kernels/bench_gemv.py --multi), the MoE
  # decode block old vs new (kernels/moe.py), then tools/bench_batch_gpu.py on the 9B Q4_K shape
  # (BATCH_BUDGET seconds). Logs: gemv_multi.log, moe_block.log, batch.log / batch.json.
  timeout 75 python3 -m minecart.kernels.bench_gemv --multi ${GEMV_MULTI_ARGS:---types Q4_K,Q8_0} >"$OUT/gemv_multi.log" 2>&1
  echo "bench_gemv --multi exit $?"; tail -30 "$OUT/gemv_multi.log"
  timeout 60 python3 -m minecart.kernels.moe --tokens "" --block-tokens 1,8 >"$OUT/moe_block.log" 2>&1
  echo "moe block exit $?"; tail -8 "$OUT/moe_block.log"
  timeout "${BATCH_TIMEOUT:-200}" python3 tools/bench_batch_gpu.py --shape qwen3.5-9b --quant q4_k \
    --dir /tmp/bench --budget "${BATCH_BUDGET:-120}" --json "$OUT/batch.json" >"$OUT/batch.log" 2>&1
  echo "batch bench exit $?"; tail -14 "$OUT/batch.log"
fi

if [ "$MODE" = profile ]; then
  # where a decode step goes: Nsight Compute kernel times of one eager single-token step and of one
  # eager batched step per PROFILE_BATCHES entry (tools/profile_decode.py), then the graphed step's wall
  # vs GPU time, the same for each batched step. PROFILE_ARGS (default: --shape qwen3.5-9b --quant q4_k).
  # Logs: profile_*.txt.
  PA=${PROFILE_ARGS:---shape qwen3.5-9b --quant q4_k}
  # the card's probe first, outside Nsight Compute: run under it, its timings picked the HFMA2 path on
  # the H200 (docs/BENCHMARKS.md v29) and the cache kept that pick for every run after
  # shellcheck disable=SC2086
  timeout 120 python3 tools/profile_decode.py $PA >"$OUT/profile_probe.txt" 2>&1
  for b in 1 ${PROFILE_BATCHES:-8}; do
    # shellcheck disable=SC2086
    ncu_kernel_times 240 "$OUT/ncu_b$b.csv" "$OUT/profile_b$b.err" $PA --batch "$b"
    echo "ncu batch $b exit $?" | tee "$OUT/profile_b$b.txt"
    python3 tools/profile_decode.py --summarize "$OUT/ncu_b$b.csv" 2>&1 | head -40 | tee -a "$OUT/profile_b$b.txt"
    rm -f "$OUT/ncu_b$b.csv"
  done
  # shellcheck disable=SC2086
  timeout 120 python3 tools/profile_decode.py $PA 2>&1 | tail -12 | tee "$OUT/profile_graph.txt"
  for b in ${PROFILE_BATCHES:-8}; do  # the graphed batched step: wall vs GPU, and the logits' host copy
    # shellcheck disable=SC2086
    timeout 120 python3 tools/profile_decode.py $PA --batch "$b" 2>&1 | tail -40 | tee "$OUT/profile_graph_b$b.txt"
  done
fi

if [ "$MODE" = moe-host ]; then
  # issue #15's host-expert benchmark against the peer, in one call: llama.cpp builds in the background
  # (.gpu/build-llama.sh from ../shared/tools/llama-peer) while the 35B-A3B Q4_K shape is synthesized and
  # minecart runs it (a) all on the GPU and (b) on the GPU capped at MOE_CAP (default 8GiB) with
  # `--experts-on auto` (the experts that do not fit in host RAM: streamed for prefill, CPU integer
  # kernels for decode, MOE_THREADS threads); then llama-bench on the same file (c) all on the GPU and
  # (d) with --n-cpu-moe N, N = the number of layers minecart's plan put in host RAM, same threads.
  # Logs: moe_ours_gpu.json, moe_ours_host.json, moe_peer.log (+ .err files).
  # MOE_TESTS: GPU test files to run while the peer builds (moe_tests.log); the 35B file is synthesized
  # meanwhile too, and the timed runs start only when the build is done (it takes every core)
  T=${MOE_THREADS:-16}
  # (a build started earlier in the same call, e.g. in the background during the GPU tests, is waited for)
  start_peer_build
  F=/tmp/bench/qwen3.6-35b-a3b-q4_k.gguf
  mkdir -p /tmp/bench
  [ -f "$F" ] || timeout 300 python3 -m minecart.engine.cli synth --shape qwen3.6-35b-a3b --quant q4_k "$F" \
    >"$OUT/moe_synth.log" 2>&1 &
  SYNTH=$!
  if [ -n "${MOE_TESTS:-}" ]; then
    # shellcheck disable=SC2086
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfE -p no:cacheprovider --timeout 240 -s $MOE_TESTS \
      >"$OUT/moe_tests.log" 2>&1
    echo "moe tests exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe_tests.log" | tail -8
  fi
  wait "$SYNTH"
  while peer_building; do sleep 2; done
  # MOE_CHUNK: minecart's prefill chunk (0: the 4,096-token prompt in one pass; 2048: the runtime's
  # shortest run with streamed host-RAM experts, placement.STREAMED_EXPERTS_CHUNK)
  MB="--prefill 4096 --chunk ${MOE_CHUNK:-0} --decode-ctx 0 --decode-tokens 32 --threads $T --json"
  if [ -z "${MOE_HOST_ONLY:-}" ]; then  # MOE_HOST_ONLY=1: only the host-expert runs, ours and the peer's
    # shellcheck disable=SC2086
    timeout 200 python3 -m minecart.engine.cli bench "$F" $MB >"$OUT/moe_ours_gpu.json" 2>"$OUT/moe_ours_gpu.err"
    echo "ours all-GPU exit $?"; tail -4 "$OUT/moe_ours_gpu.err"
  fi
  # shellcheck disable=SC2086
  timeout 300 python3 -m minecart.engine.cli bench "$F" $MB --experts-on auto --experts-cap "${MOE_CAP:-8GiB}" \
    >"$OUT/moe_ours_host.json" 2>"$OUT/moe_ours_host.err"
  echo "ours host-experts exit $?"; tail -8 "$OUT/moe_ours_host.err"
  N=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['host_experts']['layers'])" \
      "$OUT/moe_ours_host.json" 2>/dev/null || echo 30)
  while peer_building; do sleep 2; done; tail -3 "$OUT/peer_build.log" 2>/dev/null
  {
    [ -n "${MOE_HOST_ONLY:-}" ] || { echo "== peer all on GPU"; timeout 150 $LB -m "$F" -ngl 99 -fa 1 -r 2 -p 4096 -n 32 -t "$T"; }
    echo "== peer --n-cpu-moe $N (the layers minecart put in host RAM)"
    timeout 240 $LB -m "$F" -ngl 99 -fa 1 -r 2 -p 4096 -n 32 -t "$T" --n-cpu-moe "$N"
  } >"$OUT/moe_peer.log" 2>&1
  echo "peer exit $?"; grep -E "^\||==" "$OUT/moe_peer.log" | tail -12
fi

if [ "$MODE" = host-diag ]; then
  # where a host-expert decode token's time goes (tools/diag_host_decode.py) on the 35B-A3B Q4_K shape
  # capped at MOE_CAP, for expert threads DIAG_THREADS, under BLAS threads 16 and then 1 (host_diag.log)
  F=/tmp/bench/qwen3.6-35b-a3b-q4_k.gguf
  mkdir -p /tmp/bench
  [ -f "$F" ] || timeout 300 python3 -m minecart.engine.cli synth --shape qwen3.6-35b-a3b --quant q4_k "$F" \
    >"$OUT/moe_synth.log" 2>&1
  for blas in ${DIAG_BLAS:-16 1}; do
    echo "== OPENBLAS/OMP threads $blas" >>"$OUT/host_diag.log"
    OPENBLAS_NUM_THREADS=$blas OMP_NUM_THREADS=$blas timeout "${DIAG_TIMEOUT:-150}" python3 tools/diag_host_decode.py "$F" \
      --cap "${MOE_CAP:-8GiB}" --expert-threads "${DIAG_THREADS:-8,16,4}" ${DIAG_ARGS:-} >>"$OUT/host_diag.log" 2>&1
    echo "exit $?" >>"$OUT/host_diag.log"
  done
  cat "$OUT/host_diag.log" | tail -30
fi

if [ "$MODE" = kernel-profile ]; then
  # where one kernel's time goes: Nsight Compute's sections (throughput against the card's peaks, memory
  # workload, warp stall reasons, occupancy, scheduler) for a few launches of the kernels matching
  # KP_KERNEL (default gemm_batch) inside `bench_gemv --multi` (KP_ARGS, default --types Q4_K --tokens 8
  # --shapes 24576x4096: the gate+up matrix). KP_METRICS: more metrics, comma separated (ncu --metrics:
  # e.g. regex:smsp__average_warps_issue_stalled_.*_per_issue_active for the stall reasons).
  # Log: KP_LOG (default kernel_profile.txt).
  KPL="$OUT/${KP_LOG:-kernel_profile.txt}"
  # shellcheck disable=SC2086
  timeout "${KP_TIMEOUT:-300}" ncu --kernel-name "regex:${KP_KERNEL:-gemm_batch}" --launch-skip "${KP_SKIP:-20}" \
    --launch-count "${KP_COUNT:-3}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section InstructionStats ${KP_METRICS:+--metrics "$KP_METRICS"} \
    python3 -m minecart.kernels.bench_gemv --multi ${KP_ARGS:---types Q4_K --tokens 8 --shapes 24576x4096} \
    >"$KPL" 2>&1
  echo "kernel profile exit $?"; grep -E "^  [A-Za-z]|Duration|Throughput|Stall|Occupancy|Registers" "$KPL" | head -60
fi

if [ "$MODE" = ptx ]; then
  rm -rf .gpu/ptx61 .gpu/ptx70
  if ! tar -xJf .gpu/ptx.tar.xz -C .gpu 2>"$OUT/ptx.log"; then
    echo "no .gpu/ptx.tar.xz: run python tools/make_ptx.py before the device call" | tee -a "$OUT/ptx.log"
  fi
  # the route check first (it proves the kernels come from the PTX), then the kernel tests and the
  # fixture models, then the other files of tests/gpu (new ones included) but the split, vision and
  # q3-model tests; explicit files, because pytest keeps the order of files but not of a directory
  first="tests/gpu/test_ptx_route.py tests/gpu/test_kernels.py tests/gpu/test_model.py"
  DEFAULT_PTX_TESTS="$first $(ls tests/gpu/test_*.py | grep -v -x -F -e tests/gpu/test_split.py \
    -e tests/gpu/test_vision_gpu.py -e tests/gpu/test_kvq3_model.py $(printf -- '-e %s ' $first) | tr '\n' ' ')"
  # pytest over some of the files with every kernel from compute_$1 PTX, appending to the log $3
  ptx_pytest() {
    run_pytest "${PTX_TIMEOUT:-170}" "compute_$1 PTX gpu tests ($4)" "$3" \
      "MINECART_KERNEL_PTX=$ROOT/.gpu/ptx$1 MINECART_CACHE_DIR=/tmp/minecart-cache-ptx$1-$4" "$2" \
      --timeout 120 --durations=15 "${@:5}"
  }
  verified=""
  for arch in 61 70; do
    dir="$ROOT/.gpu/ptx$arch"
    log="$OUT/ptx${arch}_tests.log"
    # the whole registry must resolve from this PTX, from this tree's sources, before device time is spent
    if ! python3 -c "
import sys
from minecart.kernels.build import verify_ptx_dir
problems = verify_ptx_dir(sys.argv[1])
stale = sorted({p.split(\"'\")[1] for p in problems if 'other sources' in p})
print(f'{len(problems)} problem(s); stale modules: {\", \".join(stale) or \"none\"}; first: {problems[0]}'
      if problems else 'PTX directory complete: ' + sys.argv[1])
sys.exit(1 if problems else 0)" "$dir" >"$log" 2>&1; then
      cat "$log"
      echo "compute_$arch PTX refused (above): rebuild with python tools/make_ptx.py" | tee -a "$log"
      continue
    fi
    verified="$verified $arch"
  done
  PTX_FILES=${PTX_TESTS:-$DEFAULT_PTX_TESTS}
  if [ "${PTX_GROUPS:-1}" -le 1 ]; then
    for arch in $verified; do ptx_pytest "$arch" "$PTX_FILES" "$OUT/ptx${arch}_tests.log" all "$@"; done
  else
    # PTX_GROUPS pytest processes per architecture, both architectures at once (the files dealt out in
    # turn), then the files that measure memory alone, one architecture after the other
    # shellcheck disable=SC2086
    alone=$(alone_files "" $PTX_FILES)
    # shellcheck disable=SC2086
    for arch in $verified; do start_groups "$PTX_GROUPS" "/tmp/ptx$arch" "ptx_pytest $arch" "$(alone_files -v $PTX_FILES)" "$@"; done
    wait
    for arch in $verified; do
      collect_groups "$PTX_GROUPS" "/tmp/ptx$arch" "$OUT/ptx${arch}_tests.log"
      if [ -n "${alone// /}" ]; then ptx_pytest "$arch" "$alone" "$OUT/ptx${arch}_tests.log" alone "$@"; fi
    done
  fi
  for arch in $verified; do
    log="$OUT/ptx${arch}_tests.log"
    grep -E "^(FAILED|ERROR)|KernelPtxError|passed|failed" "$log" | tail -15
    # shellcheck disable=SC2086
    python3 tools/gpu_test_summary.py "$log" $(test_files $PTX_FILES) | tee -a "$log"
  done
  rm -rf .gpu/ptx61 .gpu/ptx70  # unpacked copies only (~48 MiB): never carried back or along
fi

if [ "$MODE" = sweep ]; then
  # One device call's worth of checks, in order, each begun only while its time fits before SWEEP_END
  # seconds from the start (default 560; a call may run 600): llama.cpp's build niced in the background
  # (when ../shared/tools/llama-peer put .gpu/build-llama.sh there and no build is on this machine yet),
  # then the SWEEP_PARTS (default "ptx decode profile peer"):
  #   ptx      this runner's ptx mode (PTX_TESTS, PTX_GROUPS, PTX_TIMEOUT as there; needs PTX_TIMEOUT + 20 s)
  #   tests    this runner's tests mode (GPU_TESTS, TEST_GROUPS, TEST_TIMEOUT as there)
  #   decode   `minecart bench` on each 9B file of SWEEP_QUANTS (default "q4_k q8_0", synthesized once a
  #            machine into /tmp/bench): decode at context 0 and prefill of SWEEP_PREFILL (default
  #            512,4096) beside the ceilings of the same run (sweep_QUANT.json, sweep_bench.log)
  #   profile  Nsight Compute over one prefill of SWEEP_PROFILE_TOKENS (default 4096) on the first of
  #            SWEEP_QUANTS, every kernel's time summed by name (sweep_prefill_profile.txt)
  #   peer     llama-bench on the same files (-p SWEEP_PREFILL -n 128 -fa 1 -ngl 99 -r 3), once the build is
  #            done (sweep_peer.log)
  # Log: sweep.log (what ran, what was skipped for time, each part's exit).
  T0=$(date +%s)
  SW="$OUT/sweep.log"
  : >"$SW"
  left() { echo $(( ${SWEEP_END:-560} - ($(date +%s) - T0) )); }
  # fits NEED WHAT: whether NEED more seconds fit; says so in the log when not
  fits() {
    if [ "$(left)" -ge "$1" ]; then echo "$(date +%T) $2 (left $(left) s)" | tee -a "$SW"; return 0; fi
    echo "$(date +%T) skipped $2: needs $1 s, $(left) left" | tee -a "$SW"; return 1
  }
  if [ -f .gpu/build-llama.sh ]; then
    start_peer_build 19
    echo "$(date +%T) llama.cpp: $([ -x "$LB" ] && echo built || echo building in the background)" >>"$SW"
  fi
  PF=${SWEEP_PREFILL:-512,4096}
  QS=${SWEEP_QUANTS:-q4_k q8_0}
  mkdir -p /tmp/bench
  for part in ${SWEEP_PARTS:-ptx decode profile peer}; do
    case $part in
      ptx)
        fits $(( ${PTX_TIMEOUT:-170} + 20 )) ptx && { bash tools/gpu_runner.sh ptx; echo "ptx exit $?" >>"$SW"; } ;;
      tests)
        fits $(( ${TEST_TIMEOUT:-300} + 20 )) tests && { bash tools/gpu_runner.sh tests; echo "tests exit $?" >>"$SW"; } ;;
      decode)
        for q in $QS; do
          need=150; [ -s "/tmp/bench/qwen3.5-9b-$q.gguf" ] || need=230
          fits "$need" "decode + prefill $PF, 9B $q" || continue
          timeout $((need - 10)) python3 -m minecart.engine.cli bench --shape qwen3.5-9b --quant "$q" \
            --workdir /tmp/bench --prefill "$PF" --decode-ctx 0 --decode-tokens 128 --json \
            >"$OUT/sweep_$q.json" 2>>"$OUT/sweep_bench.log"
          echo "bench $q exit $?" | tee -a "$SW"
        done ;;
      profile)
        q=${QS%% *}
        F=/tmp/bench/qwen3.5-9b-$q.gguf
        [ -s "$F" ] || { echo "skipped profile: no $F" | tee -a "$SW"; continue; }
        fits 120 "Nsight Compute over one ${SWEEP_PROFILE_TOKENS:-4096}-token prefill, $q" || continue
        P="$OUT/sweep_prefill_profile.txt"
        ncu_kernel_times 110 /tmp/sweep_prefill.csv "$P.err" --path "$F" --prefill "${SWEEP_PROFILE_TOKENS:-4096}"
        echo "ncu exit $?" | tee -a "$SW" >"$P"
        python3 tools/profile_decode.py --summarize /tmp/sweep_prefill.csv >>"$P" 2>&1
        head -45 "$P" ;;
      peer)
        fits 100 "llama-bench (waiting for the build first)" || continue
        while peer_building && [ "$(left)" -ge 90 ]; do sleep 3; done
        [ -x "$LB" ] || { echo "skipped peer: no llama-bench ($(tail -2 "$OUT/peer_build.log" 2>/dev/null))" | tee -a "$SW"; continue; }
        for q in $QS; do
          F=/tmp/bench/qwen3.5-9b-$q.gguf
          [ -s "$F" ] || continue
          fits 60 "llama-bench $q" || continue
          timeout 120 "$LB" -m "$F" -p "$PF" -n 128 -fa 1 -ngl 99 -r 3 >>"$OUT/sweep_peer.log" 2>&1
          echo "llama-bench $q exit $?" | tee -a "$SW"
        done
        grep -E "^\|" "$OUT/sweep_peer.log" | tail -8 ;;
      *) echo "sweep: no part '$part'" | tee -a "$SW" ;;
    esac
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$SW"
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/sweep_*.json")):
    name = f.rsplit("/", 1)[-1]
    try:
        d = json.load(open(f))
    except Exception as exc:  # a run cut off leaves no JSON
        print(name, "unreadable:", exc)
        continue
    print(name, "ceilings", d.get("ceilings"))
    for kind in ("decode", "prefill"):
        for r in d.get(kind, []):
            share = f"{r['ratio']:.0%} of {r['ceiling_tokens_per_s']:.0f}" if r.get("ratio") else ""
            print(name, kind, {k: v for k, v in r.items() if k in ("context", "tokens", "prompt_tokens")},
                  round(r["tokens_per_s"], 1), "tok/s", share)
PY
  echo "sweep done at $(( $(date +%s) - T0 )) s" | tee -a "$SW"
fi
