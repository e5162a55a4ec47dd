#!/usr/bin/env bash
# The checks that need a CUDA GPU (the 80K and 256K+ QLoRA targets of the planner, Liger, the tests that fail on
# CUDA only, Activation Beacon at 8K-128K) on a lent machine, in priority order, as one prepared script.
#
# Parts (run in the order given; default: all five in this order):
#   80k     the 80K QLoRA step with the planner's choice of what to keep and offloaded inputs (kept81920:
#           train.keep_attention=auto train.offload_checkpoints=true train.memory_budget_gib=57), then with every
#           layer checkpointed (all81920, the baseline), 2 steps each, in one gpu_check call, without expandable
#           segments (targets: >= 4,175 tokens/s at <= 60 GB reserved)                      -> qlora_80k.json
#   262k    one step at 262,144 tokens with offloaded checkpoints and the MLP tiled by 4,096 tokens
#           (target: >= 256K on one 80 GB GPU)                                              -> qlora_262k.json
#   liger   Liger's kernels against transformers' (gpu_check --no-train --liger-check; with the HARPE and STRING
#           kernel check, flash-attn against SDPA when installed, else SDPA against eager)   -> liger.json
#   tests   the tests that failed on CUDA only: tests/test_beacon.py, test_beacon_train.py, test_init_from.py,
#           test_data_and_tying.py, and test_tied_embedding.py (which compared devices the same way and never ran
#           there), pytest -v, written as it goes; stopped by SIGINT at the deadline, so pytest
#           still prints the failures it has (GPU_SESSION_TESTS="FILE ..." runs others)   -> pytest.log
#   beacon  Activation Beacon on a Llama-3-8B-shaped random model at 8K..128K: peak memory (target <= 1.25x from 8K
#           to 128K), prefill tokens/s against the stock model with SDPA, SDPA (and flash-attn) against eager at 8K,
#           parallel windows with each kernel (scripts/bench_beacon.py --shape llama3-8b)  -> beacon.json
# Every call also writes session.log (the parts' output, and this script's notes, as it goes) and parts.json (each
# part: ok / failed / stopped at the deadline / skipped, its exit status and seconds), rewritten after each part, so
# a call stopped at its limit keeps what ended. At most 8 files in $OUT: those 7, and flash-attn's wheel when it was
# built here from a carried .fa/flash-src.tgz (carry it as .fa/ next time: it installs in seconds).
#
# Time. GPU_SESSION_DEADLINE (default 560) is the seconds after this script starts by which every part has ended:
# a part starts only with the seconds it needs left (80k 150, 262k 240, and then gpu_check's --deadline skips each
# run the planner says would end later; liger 40; tests 60; beacon 150) and is stopped at the deadline. Measured
# or planned on one H100 (docs/measurements/README.md): the random 8B base is written once per machine (42 s, kept
# in /tmp/gc while the machine stays warm); each training run loads it (about 60-90 s) before its steps; the 80K
# steps take 27 + 22 s (all) and 38 + 19 s (kept); one 262K step is planned at 168 s; the wheels install in about
# 10 s. So 80k takes 5 to 6 minutes, 262k 4.5 to 5, liger under 1, tests 1 to 1.5 (5.5 on 2 CPU cores, serially),
# beacon about 2.5, and a fresh machine takes 1 to 2 minutes to start, all out of the 15 minutes of device time a
# task is lent: 80k and 262k do not fit one call (600 s), and after both about 2 minutes are left.
#
# The calls (device tool `run`, from the repository root of the session's checkout), after, here:
#   bash scripts/gpu_wheels.sh      # once: .whl/ (ignored by git); the GPU image lacks trl, datasets, bitsandbytes
#   1. run(command="bash scripts/gpu_session.sh 80k liger", carry=[".whl"], timeout_s=600)
#        -> session.log, parts.json, qlora_80k.json, liger.json (about 6 minutes)
#   2. at once (the base in /tmp/gc survives only while the machine is warm, 30 s after a call; else it is written
#      again, 42 s), with D = the budget_left_s that `status` gives minus 45 (at most 560):
#      run(command="GPU_SESSION_DEADLINE=D bash scripts/gpu_session.sh 262k tests beacon", carry=[".whl"],
#          timeout_s=D+30)
#        -> session.log, parts.json, qlora_262k.json, pytest.log, beacon.json (the parts that had time)
#   then give_back, and commit the reports under docs/measurements/<machine>-<date>/ with a note in its README.
#   A later session that is lent a machine runs what was skipped, e.g. `bash scripts/gpu_session.sh tests beacon`.
# flash-attn: with .fa/flash_attn-*.whl carried (carry=[".whl", ".fa"]) it is installed and the liger, tests and
# beacon parts check it; with only .fa/flash-src.tgz (scripts/gpu_flash_attn_src.sh) it is built in the background
# when the call runs the beacon part (about 5.5 minutes on 10 of the 16 cores, which slows the parts beside it; the
# beacon part waits for it while its own time allows); without .fa/ the flash checks are skipped and parts.json
# says so.
#
# --tiny rehearses every part on CPU with the tiny model (80k and 262k at 256 and 2,048 tokens, the MLP tiled by
# 512; tests: one quick file; beacon: the small bench model, windows of 64, at 128 and 256 tokens), into $OUT or a new
# temporary folder:
#   bash scripts/gpu_session.sh --tiny      # about 3 minutes on 2 CPU cores; tests/test_gpu_check.py runs it
set -uo pipefail   # no -e: a part that fails is recorded and the next one runs
cd "$(dirname "$0")/.."

usage="usage: bash scripts/gpu_session.sh [--tiny] [80k] [262k] [liger] [tests] [beacon]"
tiny=0
parts=()
for arg in "$@"; do
    case "$arg" in
        --tiny) tiny=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        80k|262k|liger|tests|beacon) parts+=("$arg") ;;
        *) echo "gpu_session.sh: '$arg' is no part or flag ($usage)" >&2; exit 2 ;;
    esac
done
(( ${#parts[@]} )) || parts=(80k 262k liger tests beacon)
deadline=${GPU_SESSION_DEADLINE:-560}
if ! [[ $deadline =~ ^[0-9]+$ ]]; then
    echo "gpu_session.sh: GPU_SESSION_DEADLINE=$deadline: give whole seconds (default 560)" >&2
    exit 2
fi
if [ -z "${OUT:-}" ]; then
    if (( ! tiny )); then
        echo "gpu_session.sh: \$OUT is not set: the device tool sets it (a folder whose files come back)" >&2
        exit 2
    fi
    OUT=$(mktemp -d)
fi
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
log="$OUT/session.log"
: >"$log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset PYTORCH_CUDA_ALLOC_CONF   # the caching allocator's defaults (no expandable segments) unless a variant sets it

note() {  # a line for the call's output and the log
    echo "[gpu_session $(( SECONDS ))s] $*" | tee -a "$log"
}

records=()
record() {  # part, status, exit status, seconds, file, note: one entry of parts.json (rewritten each time)
    local text entry=' {"part": "%s", "status": "%s", "exit_status": %s, "seconds": %s, "file": "%s", "note": "%s"}'
    text=$(printf '%s' "$6" | tr -d '\000-\037' | tr '"\\' "''")
    records+=("$(printf "$entry" "$1" "$2" "${3:-null}" "$4" "$5" "$text")")
    local flag=false
    ((tiny)) && flag=true
    printf '{"tiny": %s, "deadline_s": %s, "out": "%s", "parts": [\n%s\n]}\n' "$flag" "$deadline" "$OUT" \
        "$(printf '%s\n' "${records[@]}" | sed '$!s/$/,/')" >"$OUT/parts.json"
}

run_part() {  # name, seconds it needs to start, its file in $OUT, then the command (@LEFT@: seconds left, less 15)
    local name=$1 need=$2 file=$3
    shift 3
    local left=$(( deadline > SECONDS ? deadline - SECONDS : 0 ))  # past the deadline: 0 left
    if (( left < need )); then
        note "$name: skipped, ${left} s left of the deadline and it needs ${need} s"
        record "$name" skipped "" 0 "$file" "needs ${need} s, ${left} s were left"
        return
    fi
    local command=("${@//@LEFT@/$(( left - 15 ))}")
    note "$name: starts with ${left} s left: ${command[*]}"
    local began=$SECONDS
    timeout --signal=INT --kill-after=15 "$left" "${command[@]}" >>"$log" 2>&1
    local rc=$? status=ok
    (( rc == 0 )) || status=failed
    (( rc == 124 || rc == 137 )) && status="stopped at the deadline"
    note "$name: $status (exit status $rc) after $(( SECONDS - began )) s"
    record "$name" "$status" "$rc" "$(( SECONDS - began ))" "$file" "$(part_note "$name" "$OUT/$file")"
}

part_note() {  # one line of what a part's report says (its runs' peaks and speeds, its checks), for parts.json
    [ -s "$2" ] || { echo "no report"; return; }
    case "$1" in
        tests) grep -E '^(=+ .*(passed|failed|error).* =+|FAILED|ERROR)' "$2" | tail -n 12 | tr '\n' ';' ;;
        *) "$PYTHON" - "$2" <<'EOF' 2>/dev/null || echo "report unreadable"
import json
import sys

report = json.load(open(sys.argv[1]))
parts = []
for name, run in report.get("runs", {}).items():
    if "skipped" in run or "error" in run:
        parts.append(f"{name}: {run.get('skipped') or run.get('error')}")
    else:
        reserved = f"{run['peak_reserved_gib']:.1f} GiB reserved, " if "peak_reserved_gib" in run else ""
        parts.append(f"{name}: {reserved}{run['tokens_per_second']:,.0f} tokens/s")
for key in ("liger", "kernels", "beacon_peak_ratio", "parallel", "flash_attn_skipped"):
    if report.get(key) is not None:
        parts.append(f"{key}: {json.dumps(report[key])[:300]}")
print("; ".join(parts)[:1500])
EOF
        ;;
    esac
}

# --- the machine: CUDA, the carried wheels, flash-attn ----------------------------------------------------------
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
flash_build=""
if (( tiny )); then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    tokens_80k=256 tokens_262k=2048 tile=512 needs=(5 5 5 5 5)
    gpu_check=("$PYTHON" scripts/gpu_check.py --tiny --work-dir "$work")
    tests=(${GPU_SESSION_TESTS:-tests/test_beacon_ratio_mix.py})
    beacon=(--shape small --device cpu --window 64 --lengths 128 256)
else
    if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>>"$log"; then
        note "no CUDA GPU here: run this on a lent GPU machine, or with --tiny on CPU"
        exit 2
    fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        note "no .whl/ here: run bash scripts/gpu_wheels.sh on the calling machine and carry [\".whl\"]"
        exit 2
    fi
    if [ "$(ls .whl)" != "$(cat /tmp/site/.carried-wheels 2>/dev/null)" ]; then
        if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl >>"$log" 2>&1; then
            note "installing the carried wheels failed (session.log says why)"
            exit 2
        fi
        ls .whl >/tmp/site/.carried-wheels
        note "installed the carried wheels into /tmp/site"
    fi
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    work=/tmp/gc
    tokens_80k=81920 tokens_262k=262144 tile=4096 needs=(150 240 40 60 150)
    gpu_check=("$PYTHON" scripts/gpu_check.py --work-dir "$work")
    tests=(${GPU_SESSION_TESTS:-tests/test_beacon.py tests/test_beacon_train.py tests/test_init_from.py
                                 tests/test_data_and_tying.py tests/test_tied_embedding.py})
    "$PYTHON" -c "import xdist" 2>/dev/null && tests=(-n 4 "${tests[@]}")
    beacon=(--shape llama3-8b --device cuda --lengths 8192 32768 65536 131072)
    if "$PYTHON" -c "import flash_attn" 2>/dev/null; then
        note "flash-attn: installed"
    elif ls .fa/flash_attn-*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .fa/flash_attn-*.whl \
            >>"$log" 2>&1 && note "flash-attn: installed from the carried wheel"
    elif [ -f .fa/flash-src.tgz ] && [[ " ${parts[*]} " == *" beacon "* ]]; then
        (   # scripts/gpu_flash_attn_src.sh's build; the wheel comes back through $OUT
            rm -rf /tmp/fab /tmp/faw && mkdir -p /tmp/fab /tmp/faw && tar xzf .fa/flash-src.tgz -C /tmp/fab &&
            cd /tmp/fab/flash-attn &&
            FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS=90 MAX_JOBS=10 NVCC_THREADS=2 \
                "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w /tmp/faw . &&
            "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site /tmp/faw/*.whl &&
            cp /tmp/faw/*.whl "$OUT"/
        ) >/tmp/flash-build.log 2>&1 &
        flash_build=$!
        note "flash-attn: building from .fa/flash-src.tgz in the background (about 5.5 minutes)"
    else
        note "flash-attn: not installed and no .fa/ carried: the flash checks are skipped (SDPA against eager only)"
    fi
fi

wait_for_flash() {  # before the beacon part: let a background flash-attn build end while the part's time allows
    [ -n "$flash_build" ] || return 0
    while kill -0 "$flash_build" 2>/dev/null && (( deadline - SECONDS > ${needs[4]} + 30 )); do
        sleep 5
    done
    if kill -0 "$flash_build" 2>/dev/null; then
        note "flash-attn: still building; the beacon part runs without it"
    elif wait "$flash_build"; then
        note "flash-attn: built and installed; its wheel is in \$OUT"
    else
        note "flash-attn: the build failed: $(tail -n 3 /tmp/flash-build.log | tr '\n' ' ')"
    fi
    flash_build=""
}

# --- the parts ------------------------------------------------------------------------------------------------
note "parts: ${parts[*]}; deadline ${deadline} s; reports in $OUT"
for part in "${parts[@]}"; do
    case "$part" in
        80k) run_part 80k "${needs[0]}" qlora_80k.json "${gpu_check[@]}" --no-kernel-check --deadline @LEFT@ \
                --report "$OUT/qlora_80k.json" \
                --variant "kept$tokens_80k" "tokens=$tokens_80k" steps=2 train.keep_attention=auto \
                train.offload_checkpoints=true train.memory_budget_gib=57 \
                --variant "all$tokens_80k" "tokens=$tokens_80k" steps=2 ;;
        262k) run_part 262k "${needs[1]}" qlora_262k.json "${gpu_check[@]}" --no-kernel-check --deadline @LEFT@ \
                --report "$OUT/qlora_262k.json" \
                --variant "long$tokens_262k" "tokens=$tokens_262k" steps=1 train.offload_checkpoints=true \
                "train.mlp_tile_tokens=$tile" ;;
        liger) run_part liger "${needs[2]}" liger.json "${gpu_check[@]}" --no-train --liger-check \
                --report "$OUT/liger.json" ;;
        tests) run_part tests "${needs[3]}" pytest.log bash -c 'log=$1; shift; "$0" -m pytest -v -p no:cacheprovider \
                --tb=short "$@" >"$log" 2>&1' "$PYTHON" "$OUT/pytest.log" "${tests[@]}" ;;
        beacon) wait_for_flash
                run_part beacon "${needs[4]}" beacon.json "$PYTHON" scripts/bench_beacon.py "${beacon[@]}" \
                --repeats 1 --report "$OUT/beacon.json" ;;
    esac
done
[ -z "$flash_build" ] || kill "$flash_build" 2>/dev/null

note "done; $(ls "$OUT" | wc -l) files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
cat "$OUT/parts.json"
! grep -qE '"status": "(failed|stopped at the deadline)"' "$OUT/parts.json"
