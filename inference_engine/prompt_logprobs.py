"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens
before it, and the top ``n`` there, from the raw logits of the prompt's own positions.

The logits of position ``p`` predict token ``p + 1``, so a step keeps, after its sampling
rows, the rows of every prompt position whose next token is still a prompt token
(``plan_prompt_rows``; the scheduler bounds them per step). ``launch`` queues their
log-softmax on the device a slice at a time (one slice's float32 copy, never the whole
step's) and their copy to the host behind an event, and ``PendingPromptLogprobs.result``
waits for that copy alone. The core keeps each request's entries by position (a recomputed
chunk, after a preemption, writes the same ones again) and sends them with its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inference_engine.protocol import TokenLogprobs

if TYPE_CHECKING:
    from inference_engine.request import Request
    from inference_engine.scheduler import ScheduledRequest

# prompt rows turned into float32 logprobs at once: 1,024 rows of a 128k vocabulary are 512 MiB
SLICE_ROWS = 1024


@dataclass
class PromptRows:
    """The prompt rows a step keeps logits for (``P`` of them, after its sampling rows)."""

    rows: np.ndarray  # [P] rows of the step's packed tokens
    targets: np.ndarray  # [P] the prompt token each row predicts
    # per request: it, the position of its first row here, its number of rows
    owners: list[tuple[Request, int, int]]
    num_top: int  # the most alternatives a request here asked for


def plan_prompt_rows(scheduled: list[ScheduledRequest], cu_lens: np.ndarray) -> PromptRows | None:
    """The rows of this step's prompt chunks whose logprobs are wanted and not yet sent; None
    when there are none."""
    rows, targets, owners, num_top = [], [], [], 0
    for i, item in enumerate(scheduled):
        request = item.request
        if request.prompt_logprobs is None:  # not asked for, or sent already
            continue
        end = min(item.start + item.num_new_tokens, request.num_prompt_tokens - 1)
        if end <= item.start:
            continue
        first_row = int(cu_lens[i])
        rows.append(np.arange(first_row, first_row + end - item.start, dtype=np.int64))
        targets.append(np.asarray(request.prompt_token_ids[item.start + 1 : end + 1], np.int64))
        owners.append((request, item.start, end - item.start))
        num_top = max(num_top, request.sampling_params.prompt_logprobs)
    if not owners:
        return None
    return PromptRows(np.concatenate(rows), np.concatenate(targets), owners, num_top)


@dataclass
class PendingPromptLogprobs:
    """A step's prompt logprobs, queued on the device."""

    owners: list[tuple[Request, int, int]]
    # on the host, or on their way there behind ``copied``
    chosen: torch.Tensor  # [P] the prompt token's logprob
    top_values: torch.Tensor | None  # [P, N] the top N logprobs, descending
    top_ids: torch.Tensor | None  # [P, N] their token ids
    copied: torch.cuda.Event | None = None

    def result(self) -> list[tuple[Request, int, list[TokenLogprobs]]]:
        """Per request: it, the position of its first entry, its entries in order. Waits for
        their copy alone, not for the steps queued after this one (async scheduling)."""
        if self.copied is not None:
            self.copied.synchronize()
        chosen = self.chosen.tolist()
        top_values = self.top_values.tolist() if self.top_values is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        results, row = [], 0
        for request, start, count in self.owners:
            num_top = request.sampling_params.prompt_logprobs
            entries = [
                TokenLogprobs(
                    chosen[j],
                    top_ids[j][:num_top] if num_top else [],
                    top_values[j][:num_top] if num_top else [],
                )
                for j in range(row, row + count)
            ]
            results.append((request, start, entries))
            row += count
        return results


def launch(logits: torch.Tensor, prompt: PromptRows) -> PendingPromptLogprobs:
    """Queue the logprobs of ``logits`` ``[P, V]``, the rows of ``prompt``, on their device."""
    targets = torch.from_numpy(prompt.targets).to(logits.device, non_blocking=True)
    chosen, top_values, top_ids = [], [], []
    for start in range(0, len(prompt.targets), SLICE_ROWS):
        logprobs = logits[start : start + SLICE_ROWS].float().log_softmax(dim=-1)
        target = targets[start : start + SLICE_ROWS].unsqueeze(1)
        chosen.append(logprobs.gather(1, target).squeeze(1))
        if prompt.num_top:
            values, ids = logprobs.topk(prompt.num_top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    results = [torch.cat(chosen)]
    if top_values:
        results += [torch.cat(top_values), torch.cat(top_ids)]
    copied = None
    if logits.device.type != "cpu":  # to the host without a wait: a copy behind an event
        results = [tensor.to("cpu", non_blocking=True) for tensor in results]
        if logits.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(logits.device))
        else:
            torch.accelerator.synchronize(logits.device)
    chosen_host, *tops = results
    return PendingPromptLogprobs(
        prompt.owners,
        chosen_host,
        tops[0] if tops else None,
        tops[1] if tops else None,
        copied,
    )
