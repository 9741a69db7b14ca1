#!/bin/bash
# make run's services: 8487666 (the session's start) and fdcabd9 (column pairs) as
# worktrees, in turn: the long-prompt checks alone (target-only, four rounds), then
# throughput at 1 and 16 chats with the long-prompt checks (one round each).
set -e
cd /work/main
git worktree add -f /tmp/wt-base 8487666 2>/dev/null || true
git worktree add -f /tmp/wt-head fdcabd9 2>/dev/null || true
OUT=loadtest/results/linear-pairs/make-run-prefill-ab
for r in 1 2 3 4; do
  for wt in base head; do
    label=$([ $wt = base ] && echo 8487666 || echo fdcabd9)
    .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-$wt --label "$label p$r" --modes target-only --prefill --prefill-repeats 3 --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append
  done
done
OUT=loadtest/results/linear-pairs/make-run-ab
for wt in base head; do
  label=$([ $wt = base ] && echo 8487666 || echo fdcabd9)
  .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-$wt --label "$label r1" --prefill --prefill-repeats 3 --concurrency 1 16 --requests-per-slot 2 --out $OUT --append
done
echo DONE
