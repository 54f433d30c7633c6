#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60), one after another, from its seed corpus
# (fuzz/seeds/TARGET, made by fuzz/seed.sh) and its growing corpus (fuzz/corpus/TARGET, not committed),
# and appends one line per target to fuzz/runs.csv: date, target, seconds, executions, corpus size,
# and the result (ok, or the crash file libFuzzer wrote under fuzz/artifacts/TARGET).
#
#   fuzz/run.sh [SECONDS] [TARGET...]
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain, or a stable one with
# RUSTC_BOOTSTRAP=1 (used when no nightly is installed). A crash stops nothing: every target runs, and the
# script exits non-zero at the end if any crashed. Each crash gets a regression test before it is fixed.
set -uo pipefail
cd "$(dirname "$0")"
SECONDS_EACH=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(tfrecord tar index proto query frames hpack)
[ -d seeds ] || ./seed.sh
toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then toolchain=(+nightly); else export RUSTC_BOOTSTRAP=1; fi
[ -f runs.csv ] || echo "date,target,seconds,executions,corpus_files,result" >runs.csv
failed=0
for t in "${TARGETS[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    log=$(mktemp)
    cargo "${toolchain[@]}" fuzz run "$t" "corpus/$t" "seeds/$t" -- -max_total_time="$SECONDS_EACH" \
        -artifact_prefix="artifacts/$t/" >"$log" 2>&1
    rc=$?
    execs=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' | tail -1)
    [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    result=ok
    if [ $rc -ne 0 ]; then
        result=$(grep -oE "artifacts/$t/[a-z]+-[0-9a-f]+" "$log" | tail -1)
        result=${result:-"exit $rc (see the log below)"}
        failed=1
        tail -40 "$log"
    fi
    files=$(find "corpus/$t" -type f | wc -l)
    echo "$(date -u +%FT%TZ),$t,$SECONDS_EACH,${execs:-?},$files,$result" | tee -a runs.csv
    rm -f "$log"
done
exit $failed
