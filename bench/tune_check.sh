#!/usr/bin/env bash
# The autotuner's GPU checks, each a step (TUNE_CHECK_STEPS, default all) that fits one call of a
# time-limited GPU host; everything lands in OUTDIR (journals, tables, reports, logs).
#   exhaustive64, exhaustive128
#               the search (60 measured candidates) against every point of the same space, on the
#               1 x 32k bucket of five keys: head_dim 64 group 4 bf16/FP8/NVFP4 (about 1080 points),
#               head_dim 128 group 4/8 bf16 (about 500)
#   workers     two worker processes sharing one journal (--devices $TUNE_CHECK_DEVICES: 0,1 on a
#               host with two GPUs, by default 0,0: two workers on one GPU); each tunes whole keys
#   killed      a run killed (SIGKILL) after $TUNE_CHECK_KILL_AFTER seconds (default 20), then the
#               same command again on its journal: what the first had measured is kept, not redone
#   sweep       the report's % bandwidth against context length (tuned, built-in, FlashInfer) of six
#               keys, tuned into a copy of the shipped table
#
#   [PYTHON=python3] [TUNE_CHECK_STEPS=workers,killed] [TUNE_CHECK_DEVICES=0,1] bench/tune_check.sh OUTDIR
set -u
py=${PYTHON:-python3}
out=${1:?usage: bench/tune_check.sh OUTDIR}
mkdir -p "$out"
steps=",${TUNE_CHECK_STEPS:-exhaustive64,exhaustive128,workers,killed,sweep},"
wants() { [[ $steps == *",$1,"* ]]; }
tune() { "$py" -m splitkv.cli --arch sm90 --tune "$@" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$\|s/it\]$\|^\s*$'; }

if wants exhaustive64; then
    tune --head-dim 64 --group 4 --dtype bf16,fp8_e4m3,nvfp4 --bucket b1-l32k --trials 60 --iters 15 --exhaustive \
        --study exh- --storage "$out/exhaustive.log" --out "$out/exhaustive" --report "$out/exhaustive-report-64" | tail -8
fi
if wants exhaustive128; then
    tune --head-dim 128 --group 4,8 --dtype bf16 --bucket b1-l32k --trials 60 --iters 15 --exhaustive \
        --study exh- --storage "$out/exhaustive.log" --out "$out/exhaustive" --report "$out/exhaustive-report-128" | tail -6
fi

# Per study of a journal: measured candidates by worker pid, trials failed as interrupted, trials
# still running, specs measured more than once (a resumed run must add none), whether the confirmed
# entry was saved.
studies() {
    "$py" - "$1" <<'PY'
import collections, sys, optuna
from splitkv.autotune import studies
storage = studies.make_storage(sys.argv[1])
for summary in optuna.get_all_study_summaries(storage):
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    done = studies.measured(study)
    by_pid = collections.Counter(t.user_attrs.get("pid") for t in done)
    twice = sum(n - 1 for n in collections.Counter(t.user_attrs.get("spec") for t in done).values() if n > 1)
    interrupted = sum(1 for t in study.trials if t.user_attrs.get("interrupted"))
    running = sum(1 for t in study.trials if t.state == optuna.trial.TrialState.RUNNING)
    print(f"{summary.study_name}: measured by pid {dict(by_pid)}, interrupted {interrupted}, running {running},"
          f" measured twice {twice}, entry saved {studies.OUTCOME_ATTR in study.user_attrs}")
PY
}

if wants workers; then
    tune --head-dim 128 --group 1,4 --dtype bf16 --study workers- --storage "$out/workers.log" \
        --devices "${TUNE_CHECK_DEVICES:-0,0}" --out "$out/workers" | tail -6
    studies "$out/workers.log"
fi

if wants killed; then
    timeout -s KILL "${TUNE_CHECK_KILL_AFTER:-20}" "$py" -m splitkv.cli --arch sm90 --tune --head-dim 64 --group 1 \
        --dtype bf16 --study killed- --storage "$out/killed.log" --out "$out/killed" > "$out/killed-first.log" 2>&1
    echo "first run: status $? (137: killed)"
    studies "$out/killed.log"
    echo "the same command again:"
    tune --head-dim 64 --group 1 --dtype bf16 --study killed- --storage "$out/killed.log" --out "$out/killed" | tail -5
    studies "$out/killed.log"
fi

if wants sweep; then
    mkdir -p "$out/sweep" && cp -r splitkv/tuned_configs/sm_90 "$out/sweep/"
    tune --head-dim 64,128 --group 4 --dtype bf16,fp8_e4m3,nvfp4 --trials 20 --storage "$out/sweep.log" \
        --out "$out/sweep" --report "$out/sweep-report" | tail -8
fi
