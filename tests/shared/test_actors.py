"""Supervised actor tasks: a death is kept, reported once, and refuses later work; a stop
is not a death."""

from __future__ import annotations

import asyncio

import pytest

from asymspec.actors import ActorDied, Supervised


def test_a_dying_actor_keeps_its_reason_and_refuses_work() -> None:
    deaths: list[ActorDied] = []

    async def run() -> None:
        actor = Supervised("worker", deaths.append)

        async def body() -> None:
            await asyncio.sleep(0)
            raise ValueError("boom")

        actor.start(body())
        await asyncio.sleep(0.05)
        assert actor.failure == "the worker stopped (ValueError: boom)"
        with pytest.raises(ActorDied, match="boom"):
            actor.check()

    asyncio.run(run())
    assert [str(d) for d in deaths] == ["the worker stopped (ValueError: boom)"]


def test_an_actor_that_returns_has_died_too() -> None:
    deaths: list[ActorDied] = []

    async def run() -> None:
        actor = Supervised("loop", deaths.append)

        async def body() -> None:
            return None

        actor.start(body())
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert len(deaths) == 1 and "returned" in str(deaths[0])


def test_stopping_is_not_dying() -> None:
    deaths: list[ActorDied] = []

    async def run() -> str | None:
        actor = Supervised("loop", deaths.append)
        actor.start(asyncio.sleep(60))
        await asyncio.sleep(0)
        await actor.stop()
        actor.check()  # does not raise
        return actor.failure

    assert asyncio.run(run()) is None and deaths == []
