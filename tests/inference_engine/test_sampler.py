from __future__ import annotations

import math

import pytest
import torch

from inference_engine.penalties import TokensInFlight
from inference_engine.protocol import SamplingParams
from inference_engine.sampler import Sampler, SamplingRow

VOCAB = 10


def row(req_id="r", outputs=(), prompt=(1,), eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(req_id, SamplingParams(**params), list(prompt), list(outputs), eos)


def logits_for(*rows_of_values: list[float]) -> torch.Tensor:
    return torch.tensor(rows_of_values, dtype=torch.float32)


LINEAR = [float(i) for i in range(VOCAB)]  # token 9 is the argmax


def sample_many(params: dict, logits_row=LINEAR, n=200, **row_kwargs) -> set[int]:
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(*[logits_row] * n)
    rows = [row(f"r{i}", **row_kwargs, **params) for i in range(n)]
    return set(sampler(logits, rows)[0])


def test_greedy_takes_the_argmax_per_row():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(LINEAR, LINEAR[::-1])
    tokens, logprobs = sampler(logits, [row(temperature=0), row(temperature=0)])
    assert tokens == [9, 0] and logprobs == [None, None]


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-300, 5e-324])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature):
    """Logits divided by a temperature that is 0 in float32 (or close to it) are inf, their
    softmax NaN, and the draw came back as token ``VOCAB``: out of the vocabulary, it failed
    the next step for every request in the batch. Below ``SAMPLING_EPS`` it is greedy, as in
    vLLM."""
    assert SamplingParams(temperature=temperature).is_greedy
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(LINEAR, LINEAR[::-1], LINEAR)
    rows = [row("t", temperature=temperature), row("u", temperature=temperature), row("g")]
    tokens, _ = sampler(logits, rows)
    assert tokens[:2] == [9, 0] and 0 <= tokens[2] < VOCAB


def test_top_k_limits_candidates():
    assert sample_many({"top_k": 3, "temperature": 5.0}) == {7, 8, 9}
    assert sample_many({"top_k": 1}) == {9}


def test_top_p_keeps_the_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.2: top_p=0.7 keeps two tokens, the first always survives
    logits_row = [math.log(0.5), math.log(0.3), math.log(0.2)] + [-1e9] * (VOCAB - 3)
    assert sample_many({"top_p": 0.7}, logits_row) == {0, 1}
    assert sample_many({"top_p": 0.01}, logits_row) == {0}


def test_min_p_drops_unlikely_tokens():
    logits_row = [math.log(0.6), math.log(0.3), math.log(0.1)] + [-1e9] * (VOCAB - 3)
    assert sample_many({"min_p": 0.4}, logits_row) == {0, 1}


def test_repetition_presence_and_frequency_penalties():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for([5.0, 4.5, 0.0] + [-10.0] * (VOCAB - 3))
    # token 0 appeared in the prompt: divided by 2 it falls below token 1
    tokens, _ = sampler(logits, [row(temperature=0, prompt=[0], repetition_penalty=2.0)])
    assert tokens == [1]
    tokens, _ = sampler(logits, [row(temperature=0, outputs=[0], presence_penalty=1.0)])
    assert tokens == [1]
    tokens, _ = sampler(logits, [row(temperature=0, outputs=[0], frequency_penalty=0.3)])
    assert tokens == [0]  # one occurrence costs 0.3 only
    tokens, _ = sampler(logits, [row(temperature=0, outputs=[0, 0], frequency_penalty=0.3)])
    assert tokens == [1]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(LINEAR)
    banned = row(temperature=0, eos=frozenset({9}), stop_token_ids=[8], min_tokens=2, max_tokens=5)
    assert sampler(logits, [banned])[0] == [7]
    reached = row(temperature=0, outputs=[1, 2], eos=frozenset({9}), min_tokens=2, max_tokens=5)
    assert sampler(logits, [reached])[0] == [9]
    ignored = row(temperature=0, eos=frozenset({9}), min_tokens=2, ignore_eos=True, max_tokens=5)
    assert sampler(logits, [ignored])[0] == [9]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "params",
    [
        {"min_tokens": 2, "max_tokens": 4, "stop_token_ids": list(range(VOCAB))},
        {"repetition_penalty": 1e-40},  # 0 in float32: positive logits / 0 are inf
    ],
)
def test_a_row_left_no_token_to_draw_is_undrawable_and_in_range_on_the_device(params, temperature):
    """Every token banned (greedy or not), or a softmax made NaN by an infinite logit: the
    inverse-transform draw gave token ``VOCAB``, which the client received and whose embedding
    the next step failed on, for every request in the batch."""
    from inference_engine.request import UNDRAWABLE

    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(LINEAR, LINEAR)
    bad = row("bad", prompt=range(VOCAB), temperature=temperature, **params)
    if "repetition_penalty" in params and temperature == 0:
        pytest.skip("greedy takes the first infinite logit: a token, if an odd one")
    launched = sampler.launch(logits, [bad, row("good", temperature=0)])
    assert launched.device_ids.tolist() == [0, 9]  # the next step reads in-range ids
    assert launched.result()[0] == [UNDRAWABLE, 9]


def test_logprobs_of_the_sampled_token_and_top_n():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(LINEAR, LINEAR)
    tokens, logprobs = sampler(logits, [row("a", temperature=0, logprobs=3), row("b")])
    expected = torch.tensor(LINEAR).log_softmax(-1)
    assert logprobs[1] is None
    assert logprobs[0].logprob == pytest.approx(expected[9].item())
    assert logprobs[0].top_token_ids == [9, 8, 7]
    assert logprobs[0].top_logprobs == pytest.approx(expected[[9, 8, 7]].tolist())
    _, none_top = sampler(logits[:1], [row(temperature=0, logprobs=0)])
    assert none_top[0].top_token_ids == [] and none_top[0].logprob == pytest.approx(
        expected[9].item()
    )


def test_seeded_rows_do_not_depend_on_the_batch():
    flat = [0.0] * VOCAB

    def draws(batch_size: int, index: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"))
        out = []
        for _ in range(8):
            rows = [row(f"other{i}") for i in range(batch_size)]
            rows.insert(index, row("seeded", seed=42))
            tokens, _ = sampler(logits_for(*[flat] * (batch_size + 1)), rows)
            out.append(tokens[index])
        return out

    assert draws(0, 0) == draws(5, 3) == draws(2, 2)
    assert len(set(draws(0, 0))) > 1


def test_mixed_greedy_and_random_rows():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_for(LINEAR, [0.0] * VOCAB)
    tokens, _ = sampler(logits, [row("g", temperature=0), row("s", seed=1, top_k=2)])
    assert tokens[0] == 9 and tokens[1] in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)


def test_batched_penalties_and_bans_match_each_row_sampled_alone():
    """Penalty counts and min-token bans are gathered for the whole batch at once: each row
    must still see only its own prompt, outputs and stop tokens."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=generator) * 3
    logits[1, 5], logits[1, 6] = 20.0, 15.0  # b's prompt token leads until penalised
    logits[3, 7], logits[3, 8] = 50.0, 40.0  # d's EOS and stop token lead until banned
    rows = [
        row("a", outputs=[1, 1, 2], prompt=[3], temperature=0, frequency_penalty=0.7),
        row("b", outputs=[4], prompt=[4, 5], temperature=0, repetition_penalty=1.8),
        row("c", temperature=0),
        row("d", outputs=[6], eos=frozenset({7}), stop_token_ids=[8], min_tokens=3, temperature=0),
        row("e", outputs=[9, 0], prompt=[2], temperature=0, presence_penalty=2.0, logprobs=2),
    ]
    batched_tokens, batched_logprobs = Sampler(torch.device("cpu"))(logits, rows)
    for i, one in enumerate(rows):
        tokens, logprobs = Sampler(torch.device("cpu"))(logits[i : i + 1], [one])
        assert batched_tokens[i] == tokens[0]
        assert batched_logprobs[i] == logprobs[0]
    assert batched_logprobs[4] is not None and len(batched_logprobs[4].top_token_ids) == 2


def test_penalties_count_outputs_still_in_flight_on_the_device():
    """Async scheduling: a penalised row's last output is still being sampled by the step in
    flight; given its id on the device, the row samples as if the id were on the host."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=generator)
    logits[:, 3], logits[:, 4] = 12.0, 11.0  # token 3 leads unless its output counts
    on_host = [
        row("a", outputs=[3], temperature=0, presence_penalty=2.0),
        row("b", outputs=[1, 3], temperature=0, frequency_penalty=1.5, logprobs=2),
        row("c", outputs=[3], temperature=0),  # no penalties: the id in flight changes nothing
        row("d", outputs=[2, 3], prompt=[5], temperature=0, repetition_penalty=20.0),
    ]
    in_flight = [
        row("a", temperature=0, presence_penalty=2.0),
        row("b", outputs=[1], temperature=0, frequency_penalty=1.5, logprobs=2),
        row("c", temperature=0),
        row("d", outputs=[2], prompt=[5], temperature=0, repetition_penalty=20.0),
    ]
    for pending in in_flight:
        pending.num_pending_outputs = 1
    ids = TokensInFlight(rows=torch.tensor([0, 1, 3]), ids=torch.tensor([3, 3, 3]))
    want = Sampler(torch.device("cpu"))(logits, on_host)
    got = Sampler(torch.device("cpu")).launch(logits, in_flight, ids).result()
    assert got == want
    assert want[0] == [4, 4, 3, 4]
    # without the ids in flight the penalised rows would still take token 3
    assert Sampler(torch.device("cpu"))(logits, in_flight)[0] == [3, 3, 3, 3]


def test_random_draws_follow_the_distribution_and_never_pick_a_masked_token():
    torch.manual_seed(0)
    # probabilities 0.5, 0.3, 0.2 on tokens 0-2; the last token leads but is cut by top_k
    logits_row = [math.log(0.5), math.log(0.3), math.log(0.2)] + [-1e9] * (VOCAB - 4) + [9.0]
    logits_row[VOCAB - 1] = -1e9
    rows = 4000
    tokens, _ = Sampler(torch.device("cpu"))(
        logits_for(*[logits_row] * rows), [row(f"r{i}", top_k=3) for i in range(rows)]
    )
    counts = [tokens.count(token) / rows for token in range(VOCAB)]
    assert set(tokens) == {0, 1, 2}
    for token, expected in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] - expected) < 0.03, (token, counts)


def test_a_draw_at_the_top_of_the_range_stays_on_a_token_with_mass(monkeypatch):
    """A draw times the total mass can round up to the total (1.0 here stands for that
    product): it must not run past the last token with probability, onto a masked one."""
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape))
    logits_row = [2.0, 1.0] + [-float("inf")] * (VOCAB - 2)
    tokens, _ = Sampler(torch.device("cpu"))(logits_for(logits_row), [row(temperature=1.0)])
    assert tokens == [1]
