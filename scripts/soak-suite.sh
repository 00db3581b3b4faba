#!/usr/bin/env bash
# Run CI (.ci/run: the servers and packages the suite needs, then the full suite with CI=true)
# N times in a row, from a fresh clone of the committed main (untracked and uncommitted files
# play no part). With --burn, one busy loop per core runs beside
# it, so a test that races the code it checks shows up. Prints one line per run and a summary;
# exits non-zero if any run failed. Each run's log is kept in the directory printed first.
#
#   bash scripts/soak-suite.sh 5                  # five runs on a quiet machine
#   bash scripts/soak-suite.sh 5 --burn           # five runs with every core busy
#   bash scripts/soak-suite.sh 5 --commit 1a2b3c  # a given commit instead of main's head
set -euo pipefail

burn=false runs="" commit=""
while [ $# -gt 0 ]; do
    case "$1" in
        --burn) burn=true ;;
        --commit) [ $# -ge 2 ] || { echo "soak: --commit needs a revision" >&2; exit 2; }
                  shift; commit="$1" ;;
        *) runs="$1" ;;
    esac
    shift
done
usage="usage: soak-suite.sh N [--burn] [--commit REV]"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "$usage" >&2; exit 2; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d /tmp/firm-channel-soak.XXXXXX)"
logs="$work/logs"
mkdir -p "$logs"
git clone -q --branch main "$repo" "$work/repo"
cd "$work/repo"
if [ -n "$commit" ]; then
    git checkout -q --detach "$commit" || { echo "soak: no commit $commit on main" >&2; exit 2; }
fi
echo "soak: commit $(git rev-parse --short HEAD), $runs run(s), burn=$burn; logs in $logs"
# The clone's own venv, made before the first run so that no run's wall time includes it.
bash scripts/_venv.sh >"$logs/venv.log" 2>&1

burners=()
stop_burners() {
    for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done
    burners=()
}
trap stop_burners EXIT
if $burn; then
    for _ in $(seq "$(nproc)"); do
        python3 -c "while True: pass" &
        burners+=("$!")
    done
fi

count() {  # count WORD LOG: the number before WORD in pytest's closing line, 0 if absent
    tail -n 1 "$2" | grep -oE "[0-9]+ $1" | grep -oE "[0-9]+" || echo 0
}

bad=0
printf '%-4s %7s %7s %7s %7s\n' run passed failed errors seconds
for i in $(seq "$runs"); do
    log="$logs/run-$i.log"
    start=$SECONDS
    status=0
    bash .ci/run >"$log" 2>&1 || status=$?
    passed=$(count passed "$log")
    failed=$(count failed "$log")
    errors=$(count "errors?" "$log")
    if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$errors" -ne 0 ]; then bad=$((bad + 1)); fi
    printf '%-4s %7s %7s %7s %7s\n' "$i" "$passed" "$failed" "$errors" "$((SECONDS - start))"
done
stop_burners

echo "soak: $((runs - bad)) of $runs run(s) green (burn=$burn); logs in $logs"
[ "$bad" -eq 0 ]
