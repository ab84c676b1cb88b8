#!/usr/bin/env bash
# DeepSpeed's own unit tests (tests/unit/checkpoint/*.py and the top-level tests/unit/runtime/*.py)
# run on CPU plain and with the "protrain" section injected into every config (sitecustomize.py
# here), one pytest per file, junit XML per file; compare.py then lists what passes plain and
# not injected. DeepSpeed's tests are never copied into this repository: pass a checkout.
#
#   bash bench/ds_unit_tests/run.sh DEEPSPEED_SRC OUT [one|two|both]
#
# DEEPSPEED_SRC: a DeepSpeed source tree whose tests/ match the installed deepspeed as closely as
#   there is a tag for (e.g. git clone https://github.com/deepspeedai/DeepSpeed; git checkout <tag>).
# one: every test id on 1 rank (world_size >= 2 tests skip: the CPU accelerator has one device);
# two: the ids of two_rank_ids.txt on 2 ranks (LOCAL_SIZE=2). Needs pytest-timeout.
# Time on 2 cores: one ~30-40 min per mode, two ~6 min plain and ~5 min injected.
set -u
SRC=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); WHICH=${3:-both}
HERE=$(cd "$(dirname "$0")" && pwd)
EXCLUDE=${EXCLUDE:-"test_engine_eigenvalue|test_mup_optimizers|test_pld"}   # do not import on 0.19.8
cd "$SRC/tests"

one_file() {   # MODE RANKS FILE [IDS...]
    local mode=$1 ranks=$2 f=$3; shift 3
    local name; name=$(echo "$f" | tr '/' '_' | sed 's/\.py$//')
    local dir="$OUT/$mode-$ranks"; mkdir -p "$dir"
    local inject=0; [ "$mode" = injected ] && inject=1
    local start; start=$(date +%s)
    env -u PYTHONPATH PYTHONPATH="$HERE" DSUNIT_INJECT=$inject DSUNIT_LOG="$dir/initialize.log" \
        LOCAL_SIZE=$ranks DS_UNITTEST_TIMEOUT=300 timeout -k 10 ${FILE_TIMEOUT:-600} \
        python3 -m pytest -p no:cacheprovider -q -rfE --timeout=120 --rootdir="$SRC/tests" \
        --junitxml="$dir/$name.xml" "${@:-$f}" > "$dir/$name.log" 2>&1
    echo "$mode ranks=$ranks $f rc=$? secs=$(( $(date +%s) - start ))" | tee -a "$OUT/files.txt"
}

if [ "$WHICH" != two ]; then
    files=$(ls unit/checkpoint/test_*.py unit/runtime/test_*.py | grep -v -E "$EXCLUDE")
    for mode in plain injected; do
        for f in $files; do one_file $mode 1 "$f"; done
    done
fi
if [ "$WHICH" != one ]; then
    for mode in plain injected; do
        for f in $(cut -d: -f1 "$HERE/two_rank_ids.txt" | sort -u); do
            one_file $mode 2 "$f" $(grep "^$f::" "$HERE/two_rank_ids.txt")
        done
    done
fi
python3 "$HERE/compare.py" "$OUT"
