#!/bin/bash
# make run's services at dab9190 (the Python layer loop) and e2b327a (native_layers.c) as
# worktrees, in turn, two rounds: both modes at 1 and 16 streaming chats (64 tokens,
# T = 0.7), and the long-prompt checks (three repeats, medians).
set -e
cd /work/main
git worktree add -f /tmp/wt-dab dab9190 2>/dev/null || true
git worktree add -f /tmp/wt-e2b e2b327a 2>/dev/null || true
OUT=loadtest/results/native-layers/make-run-ab
for r in 1 2; do
  for wt in dab e2b; do
    label=$([ $wt = dab ] && echo dab9190 || echo e2b327a)
    .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-$wt --label "$label r$r" --prefill --prefill-repeats 3 --concurrency 1 16 --requests-per-slot 2 --out $OUT --append
  done
done
echo DONE
