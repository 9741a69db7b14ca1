#!/bin/bash
# make run's services at 6cda082 (a prompt chunk beside work costed by its rows) and at
# 01031b6 (and by the keys its rows attend), as worktrees, in turn, three rounds: the
# long-prompt checks in both modes (three repeats each, medians).
set -e
cd /work/main
OUT=loadtest/results/prefill-keys
for r in 1 2 3; do
  for wt in 6cd keys; do
    label=$([ $wt = 6cd ] && echo "6cda082 r$r" || echo "01031b6 r$r")
    .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-$wt --label "$label" --modes target-only asymspec --prefill --prefill-repeats 3 --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append
  done
done
echo DONE
