"""Batched sampling on the logits' device.

Order, as in vLLM: logprobs are taken from the raw logits; then min_tokens masking, penalties
(repetition on prompt and output, presence and frequency on output), temperature, top-k, top-p
and min-p. Greedy rows (temperature 0) take the argmax. Random rows use the exponential race
(argmax of probs / Exp(1) noise); a seeded request draws its noise from its own
``torch.Generator``, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.protocol import SamplingParams, TokenLogprobs


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request in this step."""

    req_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.generators.pop(req_id, None)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` ``[S, V]``, one row per entry of ``rows``. Returns a token id per row and
        its logprobs where ``params.logprobs`` was set."""
        params = [row.params for row in rows]
        if all(p.is_greedy for p in params) and not any(_needs_processing(row) for row in rows):
            # max() is much faster than argmax() on bfloat16 on CPU; both take the first maximum
            token_ids = logits.max(dim=-1).indices.tolist()
            return token_ids, self._logprobs(logits, rows, token_ids)
        logits = logits.float()

        raw_logits = logits
        logits = logits.clone()
        self._mask_min_tokens(logits, rows)
        self._apply_penalties(logits, rows)
        greedy = torch.tensor([p.is_greedy for p in params], device=self.device)
        token_ids = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temperature = torch.tensor(
                [p.temperature if p.temperature > 0 else 1.0 for p in params],
                device=self.device,
            )
            logits = logits / temperature.unsqueeze(1)
            logits = _top_k_top_p_min_p(logits, params, self.device)
            probs = logits.softmax(dim=-1)
            noise = self._exponential_noise(probs, rows)
            sampled = (probs / noise).argmax(dim=-1)
            token_ids = torch.where(greedy, token_ids, sampled)
        token_id_list = token_ids.tolist()
        return token_id_list, self._logprobs(raw_logits, rows, token_id_list)

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.params.seed is None or row.params.is_greedy:
                continue
            generator = self.generators.get(row.req_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(row.params.seed)
                self.generators[row.req_id] = generator
            noise[i].exponential_(generator=generator)
        return noise

    def _mask_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            params = row.params
            if len(row.output_token_ids) >= params.min_tokens:
                continue
            banned = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned |= row.eos_token_ids
            if banned:
                logits[i, list(banned)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        if not any(_has_penalty(row.params) for row in rows):
            return
        num_rows, vocab_size = logits.shape
        output_counts = torch.zeros(num_rows, vocab_size, device=self.device)
        seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=self.device)
        for i, row in enumerate(rows):
            if not _has_penalty(row.params):
                continue
            if row.output_token_ids:
                ids = torch.tensor(row.output_token_ids, device=self.device)
                output_counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float))
            if row.params.repetition_penalty != 1.0 and row.prompt_token_ids:
                seen[i, torch.tensor(row.prompt_token_ids, device=self.device)] = True
        seen |= output_counts > 0
        repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=self.device)
        repetition = repetition.unsqueeze(1).expand_as(logits)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalised, logits))
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=self.device)
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=self.device)
        logits -= frequency.unsqueeze(1) * output_counts
        logits -= presence.unsqueeze(1) * (output_counts > 0).float()

    def _logprobs(
        self, logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
    ) -> list[TokenLogprobs | None]:
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        results: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return results
        logprobs = logits[wanted].float().log_softmax(dim=-1)
        num_top = max(rows[i].params.logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(max(num_top, 1), dim=-1)
        chosen_ids = torch.tensor([[token_ids[i]] for i in wanted], device=logprobs.device)
        chosen = logprobs.gather(1, chosen_ids).squeeze(1)
        top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), chosen.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            results[i] = TokenLogprobs(chosen[j], top_ids[j][:n], top_values[j][:n])
        return results


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _needs_processing(row: SamplingRow) -> bool:
    return _has_penalty(row.params) or len(row.output_token_ids) < row.params.min_tokens


def _top_k_top_p_min_p(
    logits: torch.Tensor, params: list[SamplingParams], device: torch.device
) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    # 2.0 turns the top-p cut off for rows that did not ask for it (float sums can reach 1.0)
    top_p_cut = [p if p < 1.0 else 2.0 for p in top_p]
    min_p = [p.min_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        k = torch.tensor(top_k, device=device).clamp(max=vocab_size)
        ranks = torch.arange(vocab_size, device=device).unsqueeze(0)
        remove = ranks >= k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p; the first always stays
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= mass_before >= torch.tensor(top_p_cut, device=device).unsqueeze(1)
        remove[:, 0] = False
        logits = logits.scatter(1, sorted_ids, sorted_logits.masked_fill(remove, float("-inf")))
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
