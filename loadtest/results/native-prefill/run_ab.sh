#!/bin/bash
# make run's services, 34e064b (before this session) as a worktree and this checkout in
# turn: throughput at 1 and 16 chats with the long-prompt checks (twice), then the
# long-prompt checks alone (four times). Nothing in either tree changes while it runs.
set -e
cd /work/main
HEAD=$(git rev-parse --short HEAD)
git worktree add -f /tmp/wt-base 34e064b 2>/dev/null || true
OUT=loadtest/results/native-prefill/make-run-ab
for r in 1 2; do
  .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-base --label "34e064b r$r" --prefill --prefill-repeats 3 --concurrency 1 16 --requests-per-slot 2 --out $OUT --append
  .venv/bin/python scripts/bench_make_run.py --label "$HEAD r$r" --prefill --prefill-repeats 3 --concurrency 1 16 --requests-per-slot 2 --out $OUT --append
done
OUT=loadtest/results/native-prefill/make-run-prefill-ab
for r in 1 2 3 4; do
  .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-base --label "34e064b p$r" --modes target-only --prefill --prefill-repeats 3 --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append
  .venv/bin/python scripts/bench_make_run.py --label "$HEAD p$r" --modes target-only --prefill --prefill-repeats 3 --concurrency 1 --min-requests 4 --requests-per-slot 1 --out $OUT --append
done
echo DONE
