"""A step's forward pass that fails only the requests that made it fail.

    run(batch)                      ok      -> StepOutput(logits of every sampling span)
                                    raises  -> run(span alone) for each span of the batch:
        run([span])                 ok      -> its logits row; its K,V rewritten (same tokens and
                                               positions, so the values the batch would have written)
        run([span])                 raises  -> failed[request id] = why; a zeros row in its place

A culprit (an id its model cannot embed, logits that cannot be sampled, a
fault injected by a test) then ends alone while the rest of its batch carries
on. A span re-run alone writes only its own positions in its own blocks; the
culprit's half-written blocks were never committed and are freed with it. The
reason given to the request is the error's type and first line: the
traceback goes to this process's log. Knows nothing of the pool, of sampling
or of requests' state.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from prefixpool.engine.batch import Batch, StepOutput

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 200


def forward_isolated(run: Callable[[Batch], torch.Tensor], batch: Batch, vocab_size: int) -> StepOutput:
    """`run` gives fp32 CPU logits [sampling spans, vocab] of a batch; a failure costs only its culprits."""
    try:
        return StepOutput(run(batch))
    except Exception as err:  # a fault boundary: the culprit is found below, the traceback logged here
        if len(batch.spans) == 1:
            log.exception("forward pass failed for request %d", batch.spans[0].seq.request_id)
            return _all_failed(batch, err, vocab_size)
        log.exception("forward pass of %d spans failed; re-running each alone", len(batch.spans))
    rows: list[torch.Tensor] = []
    failed: dict[int, str] = {}
    for span in batch.spans:
        try:
            logits = run(Batch([span]))
        except Exception as err:  # this span is a culprit: it alone fails
            log.exception("forward pass failed for request %d", span.seq.request_id)
            failed[span.seq.request_id] = failure_reason(err)
            logits = torch.zeros(int(span.sample), vocab_size)
        rows.append(logits)
    return StepOutput(torch.cat(rows) if rows else torch.empty(0, vocab_size), failed)


def _all_failed(batch: Batch, err: Exception, vocab_size: int) -> StepOutput:
    num_rows = sum(span.sample for span in batch.spans)
    why = failure_reason(err)
    return StepOutput(torch.zeros(num_rows, vocab_size), {span.seq.request_id: why for span in batch.spans})


def failure_reason(err: BaseException) -> str:
    """What the request is told: the error's type and the first line of its message, no traceback."""
    lines = str(err).strip().splitlines()
    first = lines[0][:MAX_REASON_CHARS] if lines else ""
    return f"the engine failed on this request: {type(err).__name__}" + (f": {first}" if first else "")
