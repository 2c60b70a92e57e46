"""Final projection from hidden states to vocabulary logits, always returned in float32
and contiguous, so the sampler sees the same numbers and layout whatever the model dtype."""

from __future__ import annotations

import torch

from pagellm.model_executor.layers.linear import (
    SMALL_BATCH_ROWS,
    Linear,
    UnquantizedLinearMethod,
    linear,
)

VOCAB_CHUNK = 1024
"""Vocabulary rows per matmul when few hidden rows are projected on CPU."""


def compute_logits(hidden: torch.Tensor, lm_head: Linear) -> torch.Tensor:
    """[N, hidden] x [vocab, hidden] -> [N, vocab] float32. A vocab-parallel head (tensor
    parallelism) computes its rank's columns and gathers every rank's, in order."""
    if lm_head.parallel == "vocab":
        tp, vocab = lm_head.tp, lm_head.full_output_sizes[0]
        local = _local_logits(hidden, lm_head)
        part = -(-vocab // tp.size)  # every rank's share padded to the first's for the gather
        if local.shape[1] < part:
            local = torch.nn.functional.pad(local, (0, part - local.shape[1]))
        return tp.all_gather(local)[:, :vocab].contiguous()
    return _local_logits(hidden, lm_head)


def _local_logits(hidden: torch.Tensor, lm_head: Linear) -> torch.Tensor:
    if (not isinstance(lm_head.quant_method, UnquantizedLinearMethod)
            or lm_head.packed_weight is not None):
        # the method's own product (for a packed float32 head: the C kernel for a few
        # rows, else oneDNN's), contiguous in both cases
        return lm_head(hidden).float().contiguous()
    lm_head_weight = lm_head.weight
    n, vocab = hidden.shape[0], lm_head_weight.shape[0]
    if hidden.device.type != "cpu" or n >= SMALL_BATCH_ROWS or vocab <= VOCAB_CHUNK:
        return linear(hidden, lm_head_weight).float().contiguous()
    # Decode-sized batches: W[chunk] @ h.T per slice of the vocabulary, each transposed
    # into place while it is still in cache. Measured at N=64 on a 49152 x 576 head:
    # 50 ms against 61 ms for one product plus a transposing copy, 92 ms for h @ W.T.
    out = torch.empty(n, vocab, dtype=hidden.dtype)
    part = torch.empty(VOCAB_CHUNK, n, dtype=hidden.dtype)
    ht = hidden.t()
    for start in range(0, vocab, VOCAB_CHUNK):
        rows = min(VOCAB_CHUNK, vocab - start)
        torch.mm(lm_head_weight[start : start + rows], ht, out=part[:rows])
        out[:, start : start + rows].copy_(part[:rows].t())
    return out.float()
