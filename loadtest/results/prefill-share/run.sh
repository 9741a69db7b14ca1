#!/bin/bash
# make run's services at dab9190 (a worktree), target-only, the long-prompt checks under
# three prefill settings in turn, three rounds: the default (share 0.3, rounds alone up to
# 200 ms), share 0.15, and share 0.15 with rounds alone up to 100 ms.
set -e
cd /work/main
git worktree add -f /tmp/wt-dab dab9190 2>/dev/null || true
OUT=loadtest/results/prefill-share
for r in 1 2 3; do
  for cfg in "0.3 200" "0.15 200" "0.15 100"; do
    set -- $cfg
    ASYMSPEC_CLOUD_PREFILL_SHARE=$1 ASYMSPEC_CLOUD_PREFILL_ROUND_MS=$2 \
    .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-dab --label "share $1 round $2 r$r" --modes target-only --prefill --prefill-repeats 3 --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append
  done
done
echo DONE
