"""Batched sampling on the logits' device.

Order, as in vLLM: logprobs are taken from the raw logits; then min_tokens masking,
``logit_bias``, penalties (repetition on prompt and output, presence and frequency on output),
the grammar's token mask (structured outputs, ``inference_engine.guided``), temperature, top-k,
top-p and min-p. A guided row's matcher is advanced by the token it drew; a row whose grammar
allows no token at all gets ``NO_TOKEN`` instead of one, and a row its parameters leave with no
token to draw (every one banned, or logits past float32's range: NaN) ``UNDRAWABLE``; on the
device such a row holds token 0, so that a next step launched before the host looks reads no
index past the vocabulary. Greedy rows (temperature 0) take the
argmax. Random rows draw one uniform number each and take the token where it falls in their
cumulative distribution; a seeded request draws from its own ``torch.Generator``, so its tokens
do not depend on what else is in the batch.

Nothing loops over rows on the device: per-row parameters, banned tokens and the penalties'
token occurrences (``inference_engine.penalties``) are built on the host as arrays and
uploaded without a sync (pinned, non-blocking on a GPU); the one wait is the copy of the
sampled ids (and the logprobs asked for) back. Only seeded rows draw their number one by one,
from their own generators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inference_engine import guided
from inference_engine.penalties import (
    Occurrences,
    TokenArrays,
    TokensInFlight,
    apply_dense,
    apply_sparse,
    penalty_factors,
)
from inference_engine.protocol import SamplingParams, TokenLogprobs
from inference_engine.request import NO_TOKEN, UNDRAWABLE

if TYPE_CHECKING:
    import xgrammar

# added to the closing tokens' logits of a JSON-guided row near its limit: far above any
# model's spread of logits, so a closing token the grammar allows is always drawn
CLOSING_BIAS = 1e4


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request in this step."""

    req_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    # structured outputs: the request's matcher, advanced by every token it is given
    grammar: xgrammar.GrammarMatcher | None = None
    # a JSON-guided request near its token limit: these tokens (closers, EOS) are favoured,
    # each by its weight times CLOSING_BIAS
    closing_tokens: tuple[list[int], list[float]] | None = None
    # outputs sampled before this step by a step still in flight (async scheduling): counted
    # for min_tokens; their ids are on the device only (the penalties take them from there,
    # ``TokensInFlight``)
    num_pending_outputs: int = 0

    @property
    def num_outputs(self) -> int:
        """Outputs before this step's token, known or in flight."""
        return len(self.output_token_ids) + self.num_pending_outputs


@dataclass
class SampledTokens:
    """A step's sampling on its way to the host: ``device_ids`` ``[S]`` (to feed the next
    step's inputs on the device) and, from ``result()``, the ids and logprobs on the host."""

    device_ids: torch.Tensor
    results: list[torch.Tensor]  # the ids, then the logprobs asked for, copied to the host
    copied: torch.cuda.Event | None  # recorded once the copies are queued (CUDA)
    device: torch.device
    rows: list[SamplingRow]
    wanted: list[int]  # rows that asked for logprobs
    guided_rows: list[int]
    bitmask: torch.Tensor | None  # the guided rows' token masks
    is_checked: bool = False  # results[1] says which rows had a token to draw

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Wait for the copy; a token id per row (``NO_TOKEN`` for a guided row whose grammar
        allowed none or refuses the one drawn, its matcher advanced otherwise; ``UNDRAWABLE``
        for a row with no token to draw) and its logprobs where asked for."""
        if self.copied is not None:
            self.copied.synchronize()
        elif self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        rows, wanted = self.rows, self.wanted
        results = iter(self.results)
        token_ids = next(results).tolist()
        if self.is_checked:
            for i, is_drawable in enumerate(next(results).tolist()):
                if not is_drawable:
                    token_ids[i] = UNDRAWABLE
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if wanted:
            chosen, top_values, top_ids = (tensor.tolist() for tensor in results)
            for j, i in enumerate(wanted):
                n = rows[i].params.logprobs
                logprobs[i] = TokenLogprobs(chosen[j], top_ids[j][:n], top_values[j][:n])
        if self.guided_rows:
            has_any = self.bitmask.ne(0).any(dim=-1).tolist()
            for j, i in enumerate(self.guided_rows):
                token_id = token_ids[i]  # an undrawable row stays so, and its matcher as it is
                if not has_any[j] or (
                    token_id != UNDRAWABLE and not rows[i].grammar.accept_token(token_id)
                ):
                    token_ids[i] = NO_TOKEN
        return token_ids, logprobs


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.token_arrays = TokenArrays()  # the penalised requests' ids, as numpy arrays

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.generators.pop(req_id, None)
            self.token_arrays.release(req_id)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` ``[S, V]``, one row per entry of ``rows``. Returns a token id per row and
        its logprobs where ``params.logprobs`` was set."""
        return self.launch(logits, rows).result()

    def launch(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        in_flight: TokensInFlight | None = None,
    ) -> SampledTokens:
        """Queue the sampling of ``logits`` ``[S, V]`` (one row per entry of ``rows``) and the
        copy of its results to the host, without waiting for the device. ``in_flight`` holds
        the outputs of penalised rows not on the host yet (``SamplingRow.num_pending_outputs``)."""
        params = [row.params for row in rows]
        all_greedy = all(p.is_greedy for p in params)
        guided_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
        # the grammars' masks, filled on the host while the device may still be busy
        bitmask = self._fill_grammar_masks(rows, guided_rows, logits.shape[-1])
        if all_greedy and not any(_needs_processing(row) for row in rows):
            raw_logits = logits
            if guided_rows:
                if any(p.logprobs is not None for p in params):
                    logits = logits.clone()  # logprobs come from the raw logits
                self._apply_grammar_masks(logits, guided_rows, bitmask)
            # max() is much faster than argmax() on bfloat16 on CPU; both take the first maximum
            return self._copy_to_host(
                logits.max(dim=-1).indices, raw_logits, rows, guided_rows, bitmask
            )
        logits = logits.float()
        raw_logits = logits
        logits = logits.clone(memory_format=torch.contiguous_format)
        self._mask_min_tokens(logits, rows)
        self._apply_biases(logits, rows)
        self._apply_penalties(logits, rows, in_flight)
        if guided_rows:
            self._apply_grammar_masks(logits, guided_rows, bitmask)
        top_values, token_ids = logits.max(dim=-1)  # the first maximum, as argmax
        is_drawable = top_values > float("-inf")  # not every token banned, and no NaN
        if not all_greedy:
            greedy = self._upload(np.array([p.is_greedy for p in params]))
            temperature = np.array([1.0 if p.is_greedy else p.temperature for p in params])
            logits.div_(self._upload(temperature.astype(np.float32)).unsqueeze(1))
            logits = self._top_k_top_p_min_p(logits, params)
            sampled, has_mass = self._sample(logits.softmax(dim=-1), rows)
            token_ids = torch.where(greedy, token_ids, sampled)
            is_drawable = torch.where(greedy, is_drawable, has_mass)
        token_ids = torch.where(is_drawable, token_ids, 0)
        return self._copy_to_host(
            token_ids, raw_logits, rows, guided_rows, bitmask, is_drawable=is_drawable
        )

    def _fill_grammar_masks(
        self, rows: list[SamplingRow], guided_rows: list[int], vocab_size: int
    ) -> torch.Tensor | None:
        if not guided_rows:
            return None
        return guided.fill_bitmask([rows[i].grammar for i in guided_rows], vocab_size)

    def _apply_grammar_masks(
        self, logits: torch.Tensor, guided_rows: list[int], bitmask: torch.Tensor
    ) -> None:
        index = self._upload(np.array(guided_rows, np.int64))
        guided.apply_bitmask(logits, index, self._upload(bitmask.numpy()))

    def _apply_biases(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Add each row's ``logit_bias``, and for a JSON-guided row near its token limit
        ``CLOSING_BIAS`` times each closing token's weight (so where the grammar allows one it
        is taken, and the value ends before the limit cuts it), in one scatter."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, row in enumerate(rows):
            entries = []
            if row.params.logit_bias:
                entries.append((row.params.logit_bias.keys(), row.params.logit_bias.values()))
            if row.closing_tokens:
                ids, weights = row.closing_tokens
                entries.append((ids, [weight * CLOSING_BIAS for weight in weights]))
            for ids, values in entries:
                bias_rows.extend([i] * len(ids))
                bias_ids.extend(ids)
                bias_values.extend(values)
        if bias_ids:
            index = self._upload(np.array([bias_rows, bias_ids], np.int64))
            values = self._upload(np.array(bias_values, np.float32))
            logits.index_put_((index[0], index[1]), values, accumulate=True)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting for it: pinned, then non-blocking."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _copy_to_host(
        self,
        token_ids: torch.Tensor,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        guided_rows: list[int],
        bitmask: torch.Tensor | None,
        is_drawable: torch.Tensor | None = None,
    ) -> SampledTokens:
        """Queue the copy of the sampled ids, which rows had a token to draw (where that was
        checked) and the logprobs asked for to the host, together (on a GPU into pinned
        memory, behind an event: the step's one wait is for that)."""
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        results = [token_ids] if is_drawable is None else [token_ids, is_drawable]
        if wanted:
            results.extend(self._logprobs(logits, token_ids, rows, wanted))
        copied = None
        if self.device.type != "cpu":
            results = [tensor.to("cpu", non_blocking=True) for tensor in results]
            if self.device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(self.device))
        return SampledTokens(
            token_ids,
            results,
            copied,
            self.device,
            rows,
            wanted,
            guided_rows,
            bitmask,
            is_checked=is_drawable is not None,
        )

    def _sample(
        self, probs: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row by inverse transform: a uniform number per row placed in the
        row's cumulative distribution; with whether the row had any mass to draw from (not
        where its probabilities are NaN). (The exponential race takes a random number per
        vocabulary entry: 14 ms a step at 64 rows of 8,000 on one CPU core, against 1 ms.)"""
        cumulative = probs.cumsum(dim=-1)
        total = cumulative[:, -1:]
        uniform = torch.rand(total.shape, device=probs.device)
        for i, row in enumerate(rows):
            if row.params.seed is None or row.params.is_greedy:
                continue
            generator = self.generators.get(row.req_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(row.params.seed)
                self.generators[row.req_id] = generator
            uniform[i] = torch.rand(1, generator=generator, device=probs.device)
        # strictly below the total, so the first entry past the draw always has mass
        below_total = torch.nextafter(total, torch.zeros_like(total))
        draws = torch.minimum(uniform * total, below_total)
        has_mass = (total > 0).squeeze(1)
        return torch.searchsorted(cumulative, draws, right=True).squeeze(1), has_mass

    def _mask_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            # a grammar decides alone where its output may end
            if row.num_outputs >= params.min_tokens or row.grammar is not None:
                continue
            banned = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned |= row.eos_token_ids
            banned_rows.extend([i] * len(banned))
            banned_ids.extend(banned)
        if banned_ids:
            index = self._upload(np.array([banned_rows, banned_ids], np.int64))
            logits[index[0], index[1]] = float("-inf")

    def _apply_penalties(
        self, logits: torch.Tensor, rows: list[SamplingRow], in_flight: TokensInFlight | None
    ) -> None:
        penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if not penalised:
            return
        seen = Occurrences.gather(rows, penalised, self.token_arrays)
        factors = penalty_factors(rows)
        if logits.device.type == "cpu":
            apply_sparse(logits, factors, seen, in_flight)
        else:
            apply_dense(logits, factors, seen, in_flight, self._upload)

    def _top_k_top_p_min_p(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> torch.Tensor:
        vocab_size = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        # 2.0 turns the top-p cut off for rows that did not ask for it (sums can reach 1.0)
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        min_p = [p.min_p for p in params]
        cut_k, cut_p, cut_min_p = (
            any(k < vocab_size for k in top_k),
            any(p < 1.0 for p in top_p),
            any(p > 0 for p in min_p),
        )
        if not (cut_k or cut_p or cut_min_p):
            return logits
        values = self._upload(np.array([top_k, top_p, min_p], np.float32))
        k, p, min_p_values = (column.unsqueeze(1) for column in values)
        if cut_k or cut_p:
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
            remove = ranks >= k
            sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            # drop a token once the mass before it already reaches top_p; the first stays
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            remove |= mass_before >= p
            remove[:, 0] = False
            logits = logits.scatter(1, sorted_ids, sorted_logits.masked_fill(remove, float("-inf")))
        if cut_min_p:
            probs = logits.softmax(dim=-1)
            threshold = min_p_values * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _logprobs(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        rows: list[SamplingRow],
        wanted: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of the rows in ``wanted``: the sampled token's logprob ``[W]`` and the top
        ``max(logprobs)`` values and ids ``[W, N]``."""
        index = self._upload(np.array(wanted, np.int64))
        logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
        num_top = max(max(rows[i].params.logprobs for i in wanted), 1)
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        chosen = logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
        return chosen, top_values, top_ids


def _needs_processing(row: SamplingRow) -> bool:
    return (
        row.params.has_penalties
        or bool(row.params.logit_bias)
        or bool(row.closing_tokens)
        or (row.num_outputs < row.params.min_tokens and row.grammar is None)
    )
