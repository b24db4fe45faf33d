"""The penalties' two paths give the same floats (dense passes on an accelerator, sparse on the
CPU), and the requests' token arrays follow their lists from step to step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference_engine.penalties import (
    GrowingArray,
    Occurrences,
    TokenArrays,
    TokensInFlight,
    apply_dense,
    apply_sparse,
    penalty_factors,
)
from inference_engine.protocol import SamplingParams
from inference_engine.sampler import SamplingRow

VOCAB = 50


def rows_with_penalties(generator: np.random.Generator) -> list[SamplingRow]:
    """Every mix of the three penalties, a row with none, repeated tokens and empty outputs."""
    mixes = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.7},
        {"presence_penalty": 1.1},
        {"repetition_penalty": 0.8, "frequency_penalty": -0.4, "presence_penalty": 0.5},
        {},
        {"repetition_penalty": 1.7, "presence_penalty": -0.3},
        {"frequency_penalty": 2.0},  # no outputs yet
    ]
    rows = []
    for i, mix in enumerate(mixes):
        num_outputs = 0 if i == len(mixes) - 1 else int(generator.integers(1, 30))
        rows.append(
            SamplingRow(
                f"r{i}",
                SamplingParams(temperature=0, **mix),
                generator.integers(0, VOCAB, int(generator.integers(1, 20))).tolist(),
                generator.integers(0, VOCAB // 3, num_outputs).tolist(),  # repeats
                frozenset(),
            )
        )
    return rows


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("with_tokens_in_flight", [False, True])
def test_the_dense_and_the_sparse_paths_give_the_same_floats(seed, with_tokens_in_flight):
    generator = np.random.default_rng(seed)
    rows = rows_with_penalties(generator)
    logits = torch.from_numpy(generator.normal(0, 4, (len(rows), VOCAB)).astype(np.float32))
    logits[0, :5] = float("-inf")  # banned tokens (min_tokens) stay banned
    logits[3, 10] = 0.0
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    seen = Occurrences.gather(rows, penalised, TokenArrays())
    factors = penalty_factors(rows)
    in_flight = None
    if with_tokens_in_flight:
        # a token each that a step in flight samples: one already among the row's outputs
        in_flight = TokensInFlight(
            torch.tensor([0, 3, 6]), torch.tensor([rows[0].output_token_ids[0], 44, 7])
        )
    dense, sparse = logits.clone(), logits.clone()
    apply_dense(dense, factors, seen, in_flight, torch.from_numpy)
    apply_sparse(sparse, factors, seen, in_flight)
    assert torch.equal(dense, sparse)
    assert not torch.equal(dense, logits)
    assert torch.equal(dense[4], logits[4])  # the row without penalties is untouched


def test_penalties_match_a_per_token_reference():
    """vLLM's rules, spelled out token by token."""
    generator = np.random.default_rng(9)
    rows = rows_with_penalties(generator)
    logits = torch.from_numpy(generator.normal(0, 4, (len(rows), VOCAB)).astype(np.float32))
    got = logits.clone()
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    apply_sparse(
        got, penalty_factors(rows), Occurrences.gather(rows, penalised, TokenArrays()), None
    )
    want = logits.double()
    for i, row in enumerate(rows):
        p = row.params
        for token in range(VOCAB):
            count = row.output_token_ids.count(token)
            value = want[i, token]
            if p.repetition_penalty != 1.0 and (count or token in row.prompt_token_ids):
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            want[i, token] = value
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)


def test_a_growing_array_takes_only_the_new_tokens():
    outputs = [3, 4]
    array = GrowingArray(outputs)
    assert array.view().tolist() == [3, 4]
    outputs.extend(range(100))  # past the buffer: it grows
    assert array.view().tolist() == [3, 4, *range(100)]
    array.buffer[0] = -1  # what was copied is not copied again
    outputs.append(7)
    assert array.view()[[0, -1]].tolist() == [-1, 7]


def test_token_arrays_follow_the_request_and_forget_it_on_release():
    arrays = TokenArrays()
    row = SamplingRow("a", SamplingParams(presence_penalty=1.0), [1, 2], [5], frozenset())
    prompt, outputs = arrays.of(row)
    assert (prompt.tolist(), outputs.tolist()) == ([1, 2], [5])
    row.output_token_ids.append(6)
    assert arrays.of(row)[1].tolist() == [5, 6]
    # another list under the same id (a new request, or a test) is read afresh
    other = SamplingRow("a", row.params, [9], [8], frozenset())
    assert [array.tolist() for array in arrays.of(other)] == [[9], [8]]
    arrays.release("a")
    assert len(arrays) == 0
