"""The one-command benchmark: every mode × link profile on real processes and a shaped link.

    python -m loadtest.bench --models tiny --modes asymspec,standard --profiles weak  # smoke
    python -m loadtest.bench                         # all 9 modes × weak/medium/strong

Per (mode, profile) cell the runner re-shapes the namespace testbed (``loadtest.testbed``),
starts the cloud verifier in the cloud namespace (core 1) and the edge gateway in the edge
namespace (core 0), and runs the load driver inside the edge namespace, so the only traffic
on the shaped veth is the edge<->cloud channel. Outputs land in ``loadtest/results/<run>/``.

Modules, one owner each:

| module | owns |
|---|---|
| ``config`` | the run configuration and the model pair |
| ``workload`` | which prompts, seeds and request bodies a phase sends |
| ``loadgen`` | the streaming HTTP client: one record per request (TTFT, TPOT, e2e, tokens) |
| ``prometheus`` | scraping /metrics and the deltas between two scrapes |
| ``driver`` | the process inside the edge namespace: health, warm-up, measured phases |
| ``cell`` | one cell's processes in the testbed: cloud, edge, driver, logs, teardown |
| ``report`` | what one cell reports: percentiles, per-token figures, latency breakdown |
| ``tables`` | results.json, CSV and the markdown tables with ratios |
| ``plots`` | the PNG figures (throughput as Fig. 4, breakdown as Fig. 2) |
| ``runner`` | the loop over profiles × modes, rate checks, progress bar |
| ``cli`` | the command line |
"""
