"""Repeated short-beside-long measurements against one make-run stack per checkout."""
import sys, json, time, asyncio, statistics
from pathlib import Path
sys.path.insert(0, "/work/main/scripts")
import bench_make_run as b
import httpx
repo, label, mode, reps, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
stack = b.Stack(repo, mode, Path(f"/tmp/pfrep-{label}-{mode}.log"))
try:
    stack.wait_ready()
    long_messages = b.long_prompt(240)
    short = b.workload(1)[0]
    async def run():
        url = f"http://127.0.0.1:{b.EDGE_PORT}"
        rows = []
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            await b.one_chat(client, short, 0, 32)
            for r in range(reps):
                alone = await b.one_chat(client, short, 1, 32)
                body = {"model": "asymspec", "messages": long_messages, "max_tokens": 1}
                t0 = time.perf_counter()
                reply = await client.post("/v1/chat/completions", json=body)
                prefill_s = time.perf_counter() - t0
                async def delayed():
                    await asyncio.sleep(0.5)
                    return await b.one_chat(client, short, 1, 32)
                body = {**body, "max_tokens": 8}
                t1 = time.perf_counter()
                (lr, beside) = await asyncio.gather(client.post("/v1/chat/completions", json=body), delayed())
                long2_s = time.perf_counter() - t1
                rows.append({"alone_s": round(alone["e2e_s"],3), "beside_s": round(beside["e2e_s"],3),
                             "slowdown": round(beside["e2e_s"]/alone["e2e_s"],3),
                             "prefill_tok_s": round(1984/prefill_s,1), "long_beside_s": round(long2_s,3)})
                print(label, mode, json.dumps(rows[-1]), flush=True)
        return rows
    rows = asyncio.run(run())
    summary = {"label": label, "mode": mode, "median_slowdown": statistics.median(r["slowdown"] for r in rows),
               "median_prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rows), "runs": rows}
    with open(out, "a") as f: f.write(json.dumps(summary) + "\n")
    print("SUMMARY", json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
finally:
    stack.stop()
