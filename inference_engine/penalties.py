"""Repetition, presence and frequency penalties, as vLLM applies them: repetition divides a
positive logit (multiplies a negative one) of every token in the row's prompt or outputs;
frequency subtracts its factor once per output occurrence, presence once per distinct output
token.

The rows' token ids reach the host arrays through ``TokenArrays``, kept from step to step and
extended by each step's new tokens, so building them costs O(new tokens) a step rather than
O(all outputs). On an accelerator the penalties are dense over ``[S, V]`` (a few passes the
device does in microseconds, and no size depends on the data, so nothing syncs); on the CPU
they touch only the seen tokens (``[S, V]`` passes cost 300 ms a step at 256 rows x 32,000).
The two give the same floats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from inference_engine.sampler import SamplingRow

EMPTY = np.zeros(0, np.int64)


@dataclass
class TokensInFlight:
    """Outputs of some rows that a step still in flight is sampling (async scheduling), on the
    device: ``ids`` ``[P]`` for the rows ``rows`` ``[P]``. The penalties count them."""

    rows: torch.Tensor
    ids: torch.Tensor


class GrowingArray:
    """A list of token ids mirrored in a numpy array, extended by what the list gained since
    the last ``view()``; a list that is not the one it mirrors, or shorter, needs a new one."""

    __slots__ = ("buffer", "size", "source")

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self.buffer = np.empty(max(16, len(source)), np.int64)
        self.size = 0

    def mirrors(self, source: list[int]) -> bool:
        return self.source is source and len(source) >= self.size

    def view(self) -> np.ndarray:
        n = len(self.source)
        if n > self.buffer.size:
            grown = np.empty(max(n, 2 * self.buffer.size), np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        if n > self.size:
            self.buffer[self.size : n] = self.source[self.size : n]
            self.size = n
        return self.buffer[:n]


class TokenArrays:
    """Each request's prompt and outputs as numpy arrays, kept until ``release``."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[GrowingArray, GrowingArray]] = {}

    def of(self, row: SamplingRow) -> tuple[np.ndarray, np.ndarray]:
        """``(prompt ids, output ids)`` of the row's request."""
        entry = self._arrays.get(row.req_id)
        if (
            entry is None
            or not entry[0].mirrors(row.prompt_token_ids)
            or not entry[1].mirrors(row.output_token_ids)
        ):
            entry = (GrowingArray(row.prompt_token_ids), GrowingArray(row.output_token_ids))
            self._arrays[row.req_id] = entry
        return entry[0].view(), entry[1].view()

    def release(self, req_id: str) -> None:
        self._arrays.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._arrays)


@dataclass
class Occurrences:
    """Where a batch's penalised rows have seen tokens, as ``(row, token)`` pairs: each output
    token once per occurrence, and the prompt tokens of rows with a repetition penalty."""

    output_rows: np.ndarray
    output_ids: np.ndarray
    prompt_rows: np.ndarray
    prompt_ids: np.ndarray

    @classmethod
    def gather(
        cls, rows: list[SamplingRow], penalised: list[int], arrays: TokenArrays
    ) -> Occurrences:
        outputs, prompts = [], []
        for i in penalised:
            prompt, output = arrays.of(rows[i])
            outputs.append(output)
            prompts.append(prompt if rows[i].params.repetition_penalty != 1.0 else EMPTY)
        index = np.array(penalised, np.int64)
        return cls(
            np.repeat(index, [len(ids) for ids in outputs]),
            np.concatenate(outputs),
            np.repeat(index, [len(ids) for ids in prompts]),
            np.concatenate(prompts),
        )


def penalty_factors(rows: list[SamplingRow]) -> np.ndarray:
    """``[3, S]`` float32: each row's repetition, frequency and presence penalty."""
    return np.array(
        [
            [r.params.repetition_penalty for r in rows],
            [r.params.frequency_penalty for r in rows],
            [r.params.presence_penalty for r in rows],
        ],
        np.float32,
    )


def apply_dense(
    logits: torch.Tensor,
    factors: np.ndarray,
    seen: Occurrences,
    in_flight: TokensInFlight | None,
    upload: Callable[[np.ndarray], torch.Tensor],
) -> None:
    """Penalise float32 ``logits`` ``[S, V]`` in place with whole-batch passes."""
    num_rows, vocab_size = logits.shape
    repetition, frequency, presence = upload(factors).unsqueeze(2)
    output_counts = torch.zeros(num_rows, vocab_size, device=logits.device)
    if seen.output_ids.size:
        index = upload(np.stack([seen.output_rows, seen.output_ids]))
        ones = torch.ones(seen.output_ids.size, device=logits.device)
        output_counts.index_put_((index[0], index[1]), ones, accumulate=True)
    if in_flight is not None:
        ones = torch.ones(in_flight.ids.shape, device=logits.device)
        output_counts.index_put_((in_flight.rows, in_flight.ids), ones, accumulate=True)
    is_seen = output_counts > 0
    if seen.prompt_ids.size:
        index = upload(np.stack([seen.prompt_rows, seen.prompt_ids]))
        is_seen[index[0], index[1]] = True
    penalties = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(is_seen, penalties, logits))
    logits -= frequency * output_counts
    logits -= presence * (output_counts > 0).float()


def apply_sparse(
    logits: torch.Tensor,
    factors: np.ndarray,
    seen: Occurrences,
    in_flight: TokensInFlight | None,
) -> None:
    """The same on contiguous float32 CPU ``logits``, touching only the seen tokens."""
    vocab_size = logits.shape[1]
    flat = logits.view(-1)
    repetition, frequency, presence = factors
    output_keys = seen.output_rows * vocab_size + seen.output_ids
    if in_flight is not None:  # on the CPU the "device" ids are on the host
        keys_in_flight = in_flight.rows.numpy() * vocab_size + in_flight.ids.numpy()
        output_keys = np.concatenate([output_keys, keys_in_flight])
    if seen.prompt_ids.size or (repetition != 1.0).any():
        penalised_outputs = output_keys[repetition[output_keys // vocab_size] != 1.0]
        prompt_keys = seen.prompt_rows * vocab_size + seen.prompt_ids
        keys = torch.from_numpy(np.unique(np.concatenate([penalised_outputs, prompt_keys])))
        values = flat[keys]
        factor = torch.from_numpy(repetition[keys.numpy() // vocab_size])
        flat[keys] = torch.where(values > 0, values / factor, values * factor)
    keys, counts = np.unique(output_keys, return_counts=True)
    row_of = keys // vocab_size
    keys = torch.from_numpy(keys)
    # one subtraction each, as the dense passes do: the same floats
    flat.index_add_(0, keys, torch.from_numpy(-(frequency[row_of] * counts.astype(np.float32))))
    flat.index_add_(0, keys, torch.from_numpy(-presence[row_of]))
