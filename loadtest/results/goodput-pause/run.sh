#!/bin/bash
cd /work/main
for r in 1 2; do
  .venv/bin/python -m loadtest.bench --models embedded --concurrency 16 --requests 48 --modes asymspec,target-only --profiles weak,strong --out /tmp/exp2/off-r$r > /tmp/exp2/off-r$r.log 2>&1
  .venv/bin/python -m loadtest.bench --models embedded --concurrency 16 --requests 48 --modes asymspec --profiles weak,strong --goodput-pause --out /tmp/exp2/on-r$r > /tmp/exp2/on-r$r.log 2>&1
done
.venv/bin/python -m loadtest.bench --models embedded --concurrency 1 --requests 8 --modes asymspec,target-only --profiles weak --out /tmp/exp2/c1-off > /tmp/exp2/c1-off.log 2>&1
.venv/bin/python -m loadtest.bench --models embedded --concurrency 1 --requests 8 --modes asymspec --profiles weak --goodput-pause --out /tmp/exp2/c1-on > /tmp/exp2/c1-on.log 2>&1
echo done > /tmp/exp2/DONE
