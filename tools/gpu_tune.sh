#!/usr/bin/env bash
# Tuning on the device tool's GPU machine with the product's own flow: a tracker, device
# servers on NVIDIA OpenCL, and 'thomas-tune tune' runs started with setsid, so they go on
# between calls until the machine goes back. State lives in /tmp/tt (kept on a warm machine).
#   probe   set up, start the tracker and a device server, then 'thomas-tune rpc probe' of it
#           (PROBE_TARGET, default targets/h100_opencl.json; PROBE_ARGS, default --copy-mib 1024);
#           the profile comes back as $OUT/device_profile.json
#   park    copy the carried part of the TVM tree (.devcarry/p1, p2, ..., one per call) to /tmp/tt
#   start   set up (carry .devcarry/last), start tracker, servers and the tuning jobs; resumes
#           from /tmp/tt/logs when the machine is warm, else from the tree's tuning_logs/;
#           jobs run one after another (one started while another runs waits for it, also
#           across calls; SIDE_BY_SIDE=1 starts it at once)
#   status  progress of each job; the tuning logs and outputs come back as $OUT/gpu_logs.tgz
#   watch   status every minute for WATCH seconds (default 540), then once more
#   stop    stop everything
#   setup   install TVM and the project in /tmp/tt/site only (carry .devcarry/last)
#   committed-log NAME...  the committed logs unpacked in /tmp/tt/logs/NAME, as 'start' does
#           (a log there already is kept)
#   seeding set up, start tracker and servers, then a seeded session and one from nothing in the
#           background (see seeding_job for its variables); 'seeding-status' prints progress and
#           returns each session folder as $OUT/NAME.tgz, 'seeding-watch' does so every minute
#           for WATCH seconds
#   remeasure  set up, start tracker and servers, then time each job's default schedules and
#           its logs' best records again ('thomas-tune remeasure --defaults'), one job after
#           another, in the background; then watch (logs come back with status)
#   compile-cost  set up, then time TVM's build, the driver's compile and the run of records of
#           the first job's log as recorded and with less unrolling (bench/experiments/compile_cost.py, its
#           options in CC_ARGS), in the background; its output is $TT/out/JOB.compile_cost.*
#   py      python3 with the arguments that follow, in this set-up's environment
#   rows    set up (carry .devcarry/last on a fresh machine), then in the background: export the
#           README's four rows at 224 px, batch 32, with the committed logs (records checked on
#           this device), and 'thomas-tune bench --export' each (its step checked against
#           PyTorch, then timed beside PyTorch eager), one after another; ROWS picks rows
#           (default "mnv2-all mnv2-last2 alexnet-all alexnet-last3"; also mnv2-budget, with
#           --memory-budget BUDGET, and the --precision mixed16 rows mnv2-mixed16,
#           mnv2-last2-mixed16, alexnet-all-mixed16, and mnv2-mixed16-scaled with --loss-scale
#           dynamic, whose step the check refuses, mnv2-mixed16-scaled-budget the same with
#           --memory-budget BUDGET16, default 512), BENCH_ARGS adds options, EXPORT_ONLY=1
#           exports without benching;
#           'rows-status' prints progress and returns $TT/rows as $OUT/rows.tgz; the rows wait
#           for the tuning jobs started before them (so 'start' with WATCH=0 then 'rows' in one
#           call tunes, then times the rows with the logs just tuned: size TRIALS to the lease)
#   bench   'thomas-tune bench' with the arguments that follow (result JSON and PNG -> $OUT);
#           sets up first on a fresh machine (carry .devcarry/last there), and unpacks the
#           committed log of a '--log /tmp/tt/logs/NAME' that is not there yet
# Environment: JOBS (default: every job in JOBS_FILE), JOBS_FILE (tools/gpu_jobs.txt; for PoCL
# on the machine's CPU: JOBS_FILE=tools/pocl_jobs.txt KEY=pocl-x86_64 PLATFORM=Portable
# SERVERS=1), SERVERS (8), TRIALS (20000),
# TUNE_ARGS (options added after the job's own, which they override: e.g. "--match NAME"; a
# shell parses them again, so quote what it would split: TUNE_ARGS="--match 'bn_|matmul'").
# The machine goes back 30 s after a call ends: keep calling (e.g. 'watch', under the 10-minute
# limit of one call) for as long as the jobs should run; a later lease resumes from the logs
# that came back: copy their two database files and trial_errors.jsonl under tuning_logs/h100/
# <job>/ and run 'thomas-tune log pack' on it before the commit (committed logs are packed).
set -uo pipefail
cd "$(dirname "$0")/.."
TT=/tmp/tt
SITE=$TT/site
KEY=${KEY:-h100}   # the device key, and the folder of the committed logs under tuning_logs/
PORT=9190
mkdir -p $TT
# PYTHONSAFEPATH: this process and its children (build workers, RPC servers) import the
# installed copy, never ./thomas_tune of the work tree (which lacks the package_dir mapping)
export PYTHONPATH=$SITE PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export THOMAS_TUNE_OPENCL_PLATFORM=${PLATFORM:-NVIDIA}  # PLATFORM=Portable: PoCL on the CPU
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
CL_LIB=$(ldconfig -p 2>/dev/null | awk '/libOpenCL.so.1/{print $NF; exit}')
[ -n "$CL_LIB" ] || CL_LIB=/usr/local/cuda/targets/x86_64-linux/lib/libOpenCL.so.1
export THOMAS_TUNE_OPENCL_LIB=$CL_LIB
PY="python3 -P -m thomas_tune.cli"   # -P: the installed copy, not ./thomas_tune

setup() {
  if ! [ -e $SITE/tvm/lib/libtvm_compiler.so ]; then
    [ -s .devcarry/last/tvm.parts ] || { echo "carry .devcarry/last (tools/gpu_prepare.sh makes it)"; exit 3; }
    parts=$(cat .devcarry/last/tvm.parts)
    for part in $parts; do
      [ -s $TT/$part ] || { echo "$part is not in $TT: run 'park' with each of .devcarry/p1, p2, ... first"; exit 3; }
    done
    t0=$(date +%s)
    mkdir -p $SITE
    (cd $TT && cat $parts) | xz -d | tar -x -C $SITE || exit 4
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .devcarry/last/*.whl || exit 5
    cp .devcarry/last/cl-headers.tar.xz $TT/
    echo "TVM tree and wheels installed in $(( $(date +%s) - t0 )) s"
  fi
  [ -e /usr/include/CL/cl.h ] || tar -C /usr/include -xJf $TT/cl-headers.tar.xz
  mkdir -p /etc/OpenCL/vendors
  [ -e /etc/OpenCL/vendors/nvidia.icd ] || echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
  # the project itself, as a copy (the work tree is replaced at every call); installed again
  # only when its files changed, so that a second job started beside a running one (two
  # 'seeding' sessions) does not replace the package under it
  local files="setup.cfg pyproject.toml README.md thomas_tune models schedules rpc" sum
  sum=$(find $files -type f -not -path '*/__pycache__/*' -not -path '*.egg-info/*' | sort | xargs sha256sum | sha256sum)
  if [ "$sum" != "$(cat $TT/build-src.sha256 2>/dev/null)" ]; then
    rm -rf $TT/build-src && mkdir -p $TT/build-src && cp -r $files $TT/build-src/
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target $SITE $TT/build-src >/dev/null 2>&1 \
      || python3 -m pip install --no-index --no-deps --no-build-isolation --upgrade --target $SITE $TT/build-src \
      || return 6
    echo "$sum" > $TT/build-src.sha256
  fi
  python3 -c "import thomas_tune.opencl as o; print(o.devices())"
}

jobs_list() {
  grep -v '^#' ${JOBS_FILE:-tools/gpu_jobs.txt} | grep -v '^\s*$' | { if [ -n "${JOBS:-}" ]; then grep -E "^(${JOBS// /|}) "; else cat; fi; }
}

# the tracker takes the next free port when $PORT is in use: read the one it listens on
tracker_port() {
  local p; p=$(grep -ao "listening on 127.0.0.1:[0-9]*" $TT/tracker.out 2>/dev/null | tail -1 | cut -d: -f2)
  [ -n "$p" ] && PORT=$p
}

start_services() {
  if ! pgrep -f "thomas_tune.cli rpc tracker" >/dev/null; then
    setsid nohup $PY rpc tracker --port $PORT > $TT/tracker.out 2>&1 < /dev/null &
  fi
  # the port it took (the next free one when $PORT is in use) once it says so: a cold start of
  # the tracker on a fresh machine takes longer than a few seconds
  for _ in $(seq 60); do grep -aq "listening on" $TT/tracker.out 2>/dev/null && break; sleep 1; done
  tracker_port
  local have; have=$(pgrep -fc "thomas_tune.cli rpc server" || true)
  for i in $(seq $((have + 1)) ${SERVERS:-8}); do
    setsid nohup $PY rpc server --tracker 127.0.0.1:$PORT --key $KEY --target opencl \
      --port $((9100 + i * 10)) > $TT/server$i.out 2>&1 < /dev/null &
  done
  sleep 8
}

# $TT/logs/NAME from the committed log (packed there, plain here) unless it is there already:
# runs resume from it
committed_log() {
  local log=$TT/logs/$1
  if ! [ -s $log/database_tuning_record.json ] && [ -d tuning_logs/$KEY/$1 ]; then
    mkdir -p $log && cp tuning_logs/$KEY/$1/* $log/
    for f in $log/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
  fi
}

# The start of a background job's script that waits for the device: one job at a time, each
# waiting for the lock of the jobs started before it (a second job beside the first would find
# every server taken; its restamp gives up after 30 s). SIDE_BY_SIDE=1: none (small jobs, each
# with its own servers).
device_queue() {
  [ "${SIDE_BY_SIDE:-0}" = 1 ] || echo "exec 9>$TT/device.lock; flock 9;"
}

start_jobs() {
  mkdir -p $TT/logs $TT/out
  jobs_list | while read -r job args; do
    # a job named LOG:TAG tunes into the log LOG (a second pass over one log, another graph)
    local name=${job%%:*} out=${job//:/@}
    if pgrep -f -- "thomas_tune.cli tune .*--log $TT/logs/$name " >/dev/null; then echo "$name: running"; continue; fi
    log=$TT/logs/$name
    committed_log $name
    echo "$job: starting ($args)"
    # a log of an unknown code generation (unstamped) is re-measured first: each workload's best
    # record and the defaults, the other records set aside in .stale ('remeasure --restamp');
    # tune refuses it otherwise. A log stamped with another version is not: the restamp keeps one
    # record per workload, where 'log carry' (on the development machine, before the lease)
    # keeps every record whose kernel is the same; RESTAMP=1 re-measures it anyway
    restamp=""
    status=$(python3 -P -c "import sys; from thomas_tune.logs import TuningLog; \
print(TuningLog(sys.argv[1]).version().status)" $log 2>/dev/null)
    if [ "$status" = other ] && [ "${RESTAMP:-0}" != 1 ]; then
      echo "$job: not started: $log is stamped with another code generation than this tree's;" \
        "carry it ('thomas-tune log carry', docs/cli.md) and commit it, or RESTAMP=1"
      continue
    fi
    if [ "$status" != current ]; then
      keep=$(python3 tools/job_options.py "$args" --model --width --resolution --classes \
        --batch --trainable --target --servers --build-workers)
      restamp="$PY remeasure $keep --restamp --top-k 1 --defaults logged --tracker 127.0.0.1:$PORT --key $KEY --log $log;"
    fi
    setsid nohup bash -c "echo '$name: queued'; $(device_queue) echo '$name: started'; $restamp \
      $PY tune $args ${TUNE_ARGS:-} --tracker 127.0.0.1:$PORT \
      --key $KEY --log $log --stats $TT/out/$out.stats.json --trials ${TRIALS:-20000}" \
      > $TT/out/$out.out 2>&1 < /dev/null &
    sleep 1  # the job takes the lock (or queues) before the next one starts
  done
}

start_remeasure() {
  mkdir -p $TT/logs $TT/out
  local script=$TT/remeasure.sh
  echo "set -u" > $script
  jobs_list | while read -r name args; do
    log=$TT/logs/$name
    committed_log $name
    # the job's model, target and build options; not its tuning options
    keep=$(python3 tools/job_options.py "$args" --model --width --resolution --classes \
      --batch --trainable --target --servers --build-workers)
    # --restamp: the committed logs are unstamped (see start_jobs)
    echo "$PY remeasure $keep --defaults --restamp --tracker 127.0.0.1:$PORT --key $KEY --log $log > $TT/out/$name.out 2>&1" >> $script
  done
  setsid nohup bash $script > $TT/remeasure.out 2>&1 < /dev/null &
  echo "remeasuring: $(grep -c remeasure $script) job(s), one after another"
}

start_compile_cost() {
  local name; name=$(jobs_list | head -1 | cut -d' ' -f1)
  committed_log $name
  mkdir -p $TT/out && cp bench/experiments/compile_cost.py $TT/compile_cost.py
  setsid nohup python3 -P $TT/compile_cost.py --log $TT/logs/$name --target targets/h100_opencl.json \
    ${CC_ARGS:-} --out $TT/out/$name.compile_cost.json > $TT/out/$name.compile_cost.txt 2>&1 < /dev/null &
  echo "compile_cost: started on $name"
}

status() {
  for f in $TT/out/*.out; do
    [ -e "$f" ] || continue
    n=$(basename $f .out)
    recs=$(cat $TT/logs/${n%%@*}/database_tuning_record.json 2>/dev/null | wc -l)  # LOG@TAG
    echo "== $n: $recs records; $(pgrep -f -- "thomas_tune.cli (tune|remeasure) .*--log $TT/logs/$n( |$)" >/dev/null && echo running || echo stopped)"
    grep -a -E "default schedules|tuning [0-9]+ tasks|throughput|measured|records$|error|Error" $f | tail -4
    tail -c 400 $f | tr '\r' '\n' | grep -v '^\s*$' | tail -1
    [ -s $TT/out/$n.stats.json ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print('   stats: %d trials in %.0f s = %.2f trials/s; split %s' % (d['trials'], d['elapsed_s'], \
d['trials_per_s'], {k: round(v) for k, v in d['split_s'].items()}))" $TT/out/$n.stats.json
  done
  grep -h "runner\]" $TT/out/*.out 2>/dev/null | tail -5
  if [ -n "${OUT:-}" ]; then
    tar -C $TT -czf $OUT/gpu_logs.tgz logs out 2>/dev/null
    ls -la $OUT
  fi
}

watch() {
  local end=$(( $(date +%s) + ${WATCH:-540} ))
  while [ $(date +%s) -lt $end ]; do
    sleep 60; echo "---- $(date +%T)"; OUT= status
  done
  status
}

rows_job() {
  local C="--width 1.0 --resolution 224 --classes 1000 --batch 32 --target targets/h100_opencl.json"
  mkdir -p $TT/rows
  for row in ${ROWS:-mnv2-all mnv2-last2 alexnet-all alexnet-last3}; do
    case $row in
      mnv2-all) args="--model mobilenet_v2 --trainable all" log=mobilenet_v2-w1-r224-c1000-b32 ;;
      mnv2-last2) args="--model mobilenet_v2 --trainable last:2" log=mobilenet_v2-w1-r224-c1000-b32 ;;
      alexnet-all) args="--model alexnet --trainable all" log=alexnet-w1-r224-c1000-b32 ;;
      alexnet-last3) args="--model alexnet --trainable last:3" log=alexnet-w1-r224-c1000-b32 ;;
      # issue 67's rows: a memory budget (BUDGET MB, default 1400) and half-precision storage
      mnv2-budget) args="--model mobilenet_v2 --trainable all --memory-budget ${BUDGET:-1400}"
        log=mobilenet_v2-w1-r224-c1000-b32 ;;
      mnv2-mixed16) args="--model mobilenet_v2 --trainable all --precision mixed16"
        log=mobilenet_v2-w1-r224-c1000-b32 ;;
      mnv2-last2-mixed16) args="--model mobilenet_v2 --trainable last:2 --precision mixed16"
        log=mobilenet_v2-w1-r224-c1000-b32 ;;
      alexnet-all-mixed16) args="--model alexnet --trainable all --precision mixed16"
        log=alexnet-w1-r224-c1000-b32 ;;
      mnv2-mixed16-scaled) args="--model mobilenet_v2 --trainable all --precision mixed16 \
        --loss-scale dynamic" log=mobilenet_v2-w1-r224-c1000-b32 ;;
      mnv2-mixed16-scaled-budget) args="--model mobilenet_v2 --trainable all --precision mixed16 \
        --loss-scale dynamic --memory-budget ${BUDGET16:-512}" log=mobilenet_v2-w1-r224-c1000-b32 ;;
      *) echo "unknown row $row"; continue ;;
    esac
    committed_log $log
    echo "== $row: export $(date +%T)"
    # --any-codegen: the committed logs are unstamped; export checks every record it applies
    # on this device and keeps a default schedule that is faster than a workload's best record
    [ -s $TT/rows/$row/manifest.json ] || $PY export $args $C --any-codegen --log $TT/logs/$log \
      --out $TT/rows/$row > $TT/rows/$row.export.out 2>&1 || { echo "$row: export failed"; continue; }
    [ -n "${EXPORT_ONLY:-}" ] && continue
    echo "== $row: bench $(date +%T)"
    $PY bench --export $TT/rows/$row --steps ${STEPS:-20} --kernels 0 --no-startup --quiet \
      ${BENCH_ARGS:-} --json $TT/rows/$row.bench.json > $TT/rows/$row.bench.out 2>&1
    echo "== $row: done $(date +%T)"
  done
}

# A new device or model: a session seeded from committed logs and a session from nothing, one
# after the other on this card, each with its own log under SEED_DIR (default $TT/seeding; its
# output in SEED_DIR.log; give two jobs started side by side their own, named $TT/seeding-NAME
# for seeding-status to find it, and their own servers with SEED_SERVERS, whose sum is at most
# SERVERS). SEED_JOB: the job whose model options are used, default the small MobileNetV2;
# SEED_LOGS: the jobs whose committed logs seed it, default SEED_JOB's own; SEED_COST_MODEL: the
# seeded session's starting cost model, a folder such as tuning_logs/h100/cost_model, default
# none; the session from nothing always starts untrained; SEED_TRIALS and FRESH_TRIALS: each session's trials, 0 skips
# it; SEED_TOP: --top tasks (default the job's own); SEED_SERVERS: --servers of each run
# (default: the servers free when it starts); SEED_REF: jobs whose committed logs are copied to
# SEED_DIR/ref/JOB and re-measured on this card before the sessions ('remeasure --restamp
# --top-k 1 --defaults logged', as 'start' does), the fully tuned references of the curves.
# The issue's new-model case: SEED_JOB=mobilenet_v1-w1-r224-c1000-b32
# SEED_LOGS="mobilenet_v2-w1-r224-c1000-b32 alexnet-w1-r224-c1000-b32"
# SEED_COST_MODEL=tuning_logs/h100/cost_model SEED_TRIALS=1000 FRESH_TRIALS=0
# SEED_REF=mobilenet_v1-w1-r224-c1000-b32
seeding_job() {
  local name=${SEED_JOB:-mobilenet_v2-w0.35-r64-c10-b8} dir=${SEED_DIR:-$TT/seeding}
  local args; args=$(jobs_list | awk -v n=$name '$1 == n {$1=""; print}')
  [ -n "$args" ] || { echo "SEED_JOB $name is not a job of ${JOBS_FILE:-tools/gpu_jobs.txt}"; return 2; }
  local keep; keep=$(python3 tools/job_options.py "$args" --model --width --resolution \
    --classes --batch --trainable --target --build-workers --time-share)
  local top; top=$(python3 tools/job_options.py "$args" --top | awk '{print $2}')
  local servers=""; [ -n "${SEED_SERVERS:-}" ] && servers="--servers $SEED_SERVERS"
  mkdir -p $dir
  # what the runs read later is copied now: the work tree is replaced at every call
  local seeds="" job cost=none
  for job in ${SEED_LOGS:-$name}; do committed_log $job; seeds="$seeds --seed-log $TT/logs/$job"; done
  if [ -n "${SEED_COST_MODEL:-}" ] && [ "$SEED_COST_MODEL" != none ]; then
    rm -rf $dir/cost_model && cp -r "$SEED_COST_MODEL" $dir/cost_model && cost=$dir/cost_model
  fi
  local common="$keep --top ${SEED_TOP:-${top:-20}} --trials-per-iter 16 --population 64 \
    --tracker 127.0.0.1:$PORT --key $KEY $servers"
  for job in ${SEED_REF:-}; do
    local ref=$dir/ref/$job rargs
    rargs=$(jobs_list | awk -v n=$job '$1 == n {$1=""; print}')
    [ -n "$rargs" ] && [ -d tuning_logs/$KEY/$job ] || { echo "SEED_REF $job: no such job or committed log"; continue; }
    rm -rf $ref && mkdir -p $ref && cp tuning_logs/$KEY/$job/* $ref/
    for f in $ref/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
    echo "== reference $job re-measured $(date +%T)"
    $PY remeasure $(python3 tools/job_options.py "$rargs" --model --width --resolution \
      --classes --batch --trainable --target --build-workers) $servers --restamp --top-k 1 \
      --defaults logged --tracker 127.0.0.1:$PORT --key $KEY --log $ref > $dir/ref-$job.out 2>&1
  done
  if [ "${SEED_TRIALS:-300}" != 0 ]; then
    echo "== seeded from ${SEED_LOGS:-$name} $(date +%T)"
    $PY tune $common $seeds --cost-model $cost --trials ${SEED_TRIALS:-300} \
      --log $dir/seeded --stats $dir/seeded.stats.json > $dir/seeded.out 2>&1
  fi
  if [ "${FRESH_TRIALS:-900}" != 0 ]; then
    echo "== from nothing $(date +%T)"
    $PY tune $common --cost-model none --trials ${FRESH_TRIALS:-900} --log $dir/fresh \
      --stats $dir/fresh.stats.json > $dir/fresh.out 2>&1
  fi
  echo "== done $(date +%T)"
}

# each seeding job's output, its runs' last lines and statistics; with OUT set, each SEED_DIR
# (its tuning logs, references and outputs; not the records a restamp set aside) comes back as
# $OUT/NAME.tgz
seeding_status() {
  local d f s
  for d in $TT/seeding*/; do
    [ -d "$d" ] || continue
    d=${d%/}
    echo "==== $d: $(tail -1 $d.log 2>/dev/null)"
    for f in $d/*.out; do
      [ -e "$f" ] || continue
      echo "-- $(basename $f): $(tail -c 600 $f | tr '\r' '\n' | grep -v '^\s*$' | tail -1 | cut -c1-160)"
      s=${f%.out}.stats.json
      [ -s $s ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print('   %d trials in %.0f s = %.2f trials/s, %s' % (d['trials'], d['elapsed_s'], \
d['trials_per_s'], d.get('ended', 'running')))" $s
    done
    [ -n "${OUT:-}" ] && tar -C $TT -czf $OUT/$(basename $d).tgz --exclude='*.stale' \
      $(basename $d) $(basename $d).log
  done
  return 0
}

case "${1:-status}" in
  seeding) setup && start_services || exit $?
    setsid nohup bash tools/gpu_tune.sh seeding-job > ${SEED_DIR:-$TT/seeding}.log 2>&1 < /dev/null &
    sleep 2; echo "seeding started: ${SEED_DIR:-$TT/seeding}" ;;
  seeding-job) tracker_port; seeding_job ;;
  seeding-status) seeding_status ;;
  seeding-watch) end=$(( $(date +%s) + ${WATCH:-540} ))  # seeding-status every minute, packed at the end
    while left=$(( end - $(date +%s) )); [ $left -gt 0 ]; do
      sleep $(( left < 60 ? left : 60 )); echo "---- $(date +%T)"; OUT= seeding_status; done
    seeding_status ;;
  rows) setup || exit $?
    # after the tuning jobs started before it: 'start' then 'rows' in one call tunes, then
    # times the rows with the logs just tuned
    setsid nohup bash -c "$(device_queue) bash tools/gpu_tune.sh rows-job" > $TT/rows.log 2>&1 < /dev/null &
    sleep 2; echo "rows started (after the tuning jobs that hold the device lock)" ;;
  rows-job) rows_job ;;
  rows-status) cat $TT/rows.log; for f in $TT/rows/*.out; do echo "-- $f"; tail -5 $f; done
    [ -n "${OUT:-}" ] && tar -C $TT -czf $OUT/rows.tgz --exclude='*.so' --exclude='*.npz' rows ;;
  park) cp .devcarry/p[0-9]*/tvm.part.* $TT/ && ls -la $TT ;;
  probe) setup >/dev/null || exit $?; SERVERS=${SERVERS:-1} start_services
    $PY rpc probe --tracker 127.0.0.1:$PORT --key $KEY --target ${PROBE_TARGET:-targets/h100_opencl.json} \
      ${PROBE_ARGS:---copy-mib 1024} --out ${OUT:-$TT}/device_profile.json ;;
  start) setup && start_services && start_jobs && watch ;;
  status) status ;;
  watch) watch ;;
  setup) setup ;;
  committed-log) shift; for name in "$@"; do committed_log "$name"; done ;;  # unpacked in $TT/logs
  remeasure) setup && start_services && start_remeasure && watch ;;
  compile-cost) setup && start_compile_cost ;;
  bench) shift; setup >/dev/null || exit $?; mkdir -p $TT/bench
    prev=""; for a in "$@"; do  # --log $TT/logs/NAME: unpack the committed log on a fresh machine
      [ "$prev" = --log ] && case "$a" in $TT/logs/*) committed_log "${a#$TT/logs/}" ;; esac; prev=$a
    done
    $PY bench --work $TT/bench "$@" --json ${OUT:-$TT}/bench.json ;;
  py) shift; python3 -P "$@" ;;   # a script with the set-up's environment (bench/experiments/step_split.py)
  stop) pkill -f "remeasure.sh" ; pkill -f "thomas_tune.cli (tune|remeasure)"
    # on SIGTERM the tuners join their batches in flight and write their last statistics (at
    # most the CLI's 60-s grace): wait for them before the servers go and status packs outputs
    for _ in $(seq 70); do pgrep -f "thomas_tune.cli (tune|remeasure)" >/dev/null || break; sleep 1; done
    pkill -f "thomas_tune.cli rpc" ; status ;;
  *) echo "usage: $0 park|setup|start|status|watch|stop|seeding|seeding-status|seeding-watch|bench ARGS"; exit 2 ;;
esac
