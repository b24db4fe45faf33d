"""A chat socket's frame budget (``chat.frame_budget``): a client flooding frames is refused
past it, told once, and served again once the budget allows; a page never meets it, and a stop
is never refused for the frames before it."""

import asyncio

import pytest

from chat import frame_budget
from chat.frame_budget import FrameBudget, retry_after_seconds
from tests.chat.conftest import open_chat


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """The budgets' clock, frozen: a flood takes no time, however loaded the machine."""
    clock = Clock()
    monkeypatch.setattr(frame_budget, "now", clock)
    return clock


def test_a_burst_then_the_rate_and_one_refusal_answered_per_run():
    clock = Clock()
    budget = FrameBudget(per_second=2, burst=3, clock=clock)
    assert [budget.take() for _ in range(3)] == [0, 0, 0]
    assert budget.take() == pytest.approx(0.5)  # one token at 2 a second
    assert budget.first_refusal() and not budget.first_refusal()
    clock.now += 0.25
    assert budget.take() == pytest.approx(0.25) and not budget.first_refusal()
    clock.now += 0.25
    assert budget.take() == 0  # one frame again, and the next refusal is answered
    assert budget.take() > 0 and budget.first_refusal()
    clock.now += 60  # refilled to the burst, no further
    assert [budget.take() for _ in range(4)][-2:] == [0, pytest.approx(0.5)]


def test_retry_after_is_whole_seconds_at_least_one():
    assert [retry_after_seconds(wait) for wait in (0.01, 1.0, 1.2)] == [1, 1, 2]


async def test_a_flood_of_frames_is_refused_once_told_and_served_again_later(
    chat_world, async_db, monkeypatch, clock
):
    monkeypatch.setattr(frame_budget, "FRAME_BURST", 4)
    monkeypatch.setattr(frame_budget, "FRAMES_PER_SECOND", 2.0)
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    assert connected
    for _ in range(12):
        await chat.send(type="dance")
    answers = [await chat.receive() for _ in range(5)]
    assert [answer["code"] for answer in answers] == ["unknown_type"] * 4 + ["too_many_frames"]
    assert answers[-1]["retry_after"] == 1 and "4 at once" in answers[-1]["message"]
    assert await chat.is_quiet()  # the other seven were dropped, and not answered

    clock.now += 0.5  # one frame's worth of budget
    await chat.send(type="settings", system_prompt="Still here.")
    settings = await chat.receive()
    await chat.send(type="dance")
    refused = await chat.receive()
    await chat.close()
    assert settings["type"] == "settings"
    assert settings["settings"]["system_prompt"] == "Still here."
    assert refused["code"] == "too_many_frames"  # a new run of refusals is answered again


async def test_a_stop_after_a_flood_still_stops_the_reply(chat_world, async_db, monkeypatch, clock):
    from chat import consumers

    async def slow_reply(*, on_text, **kwargs):
        for n in range(200):
            await on_text(f"t{n} ")
            await asyncio.sleep(0.05)

    monkeypatch.setattr(consumers, "generate_reply", slow_reply)
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    await chat.send(type="send", content="Tell me a long story")
    await chat.receive_until("start")
    for _ in range(frame_budget.FRAME_BURST + 5):
        await chat.send(type="dance")
    refusal, _ = await chat.receive_until("error")
    while refusal["code"] != "too_many_frames":
        refusal, _ = await chat.receive_until("error")
    await chat.send(type="stop")
    done, _ = await chat.receive_until("done", "error")
    await chat.close()
    assert done["type"] == "done" and done["status"] == "stopped", done


async def test_a_page_sized_burst_is_within_the_budget(chat_world, async_db, clock):
    """A reconnect's sync and a burst of changes at once: all served."""
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    assert connected
    await chat.send(type="sync")
    for value in range(frame_budget.FRAME_BURST - 1):
        await chat.send(type="settings", max_tokens=8 + value)
    frames = [await chat.receive() for _ in range(frame_budget.FRAME_BURST)]
    await chat.close()
    assert not [frame for frame in frames if frame["type"] == "error"], frames
