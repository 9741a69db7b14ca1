"""The one OS thread that touches a service's model: it loads the model, sets its torch
threads and runs every forward, so the model and its caches have one owner and the event
loop stays free.

Loading on the same thread matters for speed, not only ownership. torch's CPU kernels run
on OpenMP (libgomp), which keeps a team of worker threads for each thread that starts a
parallel region, and once the teams of all threads together outnumber the cores, libgomp
stops spin-waiting between regions and puts its workers to sleep after each one (its
"throttled" spin count), so every op of a forward pays a futex wake-up. A model loaded on
one thread and run on another leaves two teams: on 2 cores a bf16 16-session decode step
at 2 threads cost 86.1 ms on the second thread against 38.8 ms on the loading thread
(``loadtest/results/model-thread/model_thread_cost.txt`` in git history)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    """A single worker thread; ``run`` awaits a call on it, ``call`` blocks on one."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the thread from outside the event loop (tests, start-up checks)."""
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
