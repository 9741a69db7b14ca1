#!/bin/bash
# make run's services at e2b327a and at e2b327a with GENERATE_CHUNK_TOKENS = 64 (a paused
# request asks the cloud for up to 64 tokens at a time instead of 16), as worktrees, in
# turn, three rounds: both modes at 16 streaming chats (64 tokens, T = 0.7).
set -e
cd /work/main
OUT=loadtest/results/paused-chunk
for r in 1 2 3; do
  for wt in e2b chunk; do
    label=$([ $wt = e2b ] && echo "chunk 16" || echo "chunk 64")
    .venv/bin/python scripts/bench_make_run.py --repo /tmp/wt-$wt --label "$label r$r" --concurrency 16 --requests-per-slot 2 --out $OUT --append
  done
done
echo DONE
