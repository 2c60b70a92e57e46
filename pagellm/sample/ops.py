"""Tensor transforms the Sampler applies to a batch of logits, one concern per function.

In: float32 logits [B, V] (modified in place) plus per-row parameters. Out: the same
logits with tokens masked (-inf) or shifted. No knowledge of requests or the scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.platforms import kernels_for

_NEG_INF = float("-inf")


def _row_kernels(logits: torch.Tensor) -> Any:
    """pagellm's C kernels when `logits` are float32 CPU rows with contiguous columns (what
    kernels/sampling.c takes), else None: the callers then run torch's ops (other devices,
    dtypes, layouts, or no C compiler)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    return kernels_for(logits)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) ([B] int64, the first index on ties and the first NaN if a
    row has one), through pagellm's C kernel for float32 CPU rows: torch's reduction
    takes ~5x longer over a large vocabulary."""
    lib = _row_kernels(logits)
    if lib is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.pg_argmax_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                       out.data_ptr())
    return out


def apply_allowed_token_ids(logits: torch.Tensor, disallowed: torch.Tensor) -> None:
    """`disallowed` is [B, V] bool, True where a row may not pick the token."""
    logits.masked_fill_(disallowed, _NEG_INF)


def apply_bad_words(
    logits: torch.Tensor,
    bad_words: dict[int, list[list[int]]],
    output_token_ids: list[list[int]],
) -> None:
    """Bans the last token of a bad word when the output already ends with the rest of it."""
    for row, words in bad_words.items():
        output = output_token_ids[row]
        for word in words:
            prefix_len = len(word) - 1
            if prefix_len > len(output):
                continue
            if prefix_len == 0 or output[-prefix_len:] == word[:-1]:
                logits[row, word[-1]] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in logit_bias.items():
        for token_id, value in bias.items():
            rows.append(row)
            cols.append(token_id)
            values.append(value)
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(values, device=device, dtype=logits.dtype), True)


def apply_min_tokens(
    logits: torch.Tensor,
    min_tokens: dict[int, tuple[int, set[int]]],
    output_token_ids: list[list[int]],
) -> None:
    """Masks EOS and stop token ids of rows that have not yet produced min_tokens tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_toks, stop_ids) in min_tokens.items():
        if len(output_token_ids[row]) < min_toks:
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = _NEG_INF


def _pad_rows(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [r + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).view(len(rows), width)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] occurrence counts (the pad column is cut)."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> None:
    """Repetition penalty over prompt + output tokens; presence and frequency over output.

    Repetition divides positive logits and multiplies negative ones (vLLM/HF semantics);
    presence subtracts a constant once a token appeared; frequency subtracts per count.
    Float32 CPU rows take pg_apply_penalties (kernels/sampling.c): the same float32
    operations, touching only the tokens each request has seen instead of ~10 passes over
    the vocabulary.
    """
    vocab_size = logits.shape[1]
    lib = _row_kernels(logits)
    if lib is not None:  # only the tokens each request has seen (pg_apply_penalties)
        rows = logits.shape[0]
        prompt = None
        if prompt_token_ids is not None:
            prompt = prompt_token_ids.to(device="cpu", dtype=torch.int64).contiguous()
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([len(ids) for ids in output_token_ids]).cumsum(0)
        flat = torch.tensor([t for ids in output_token_ids for t in ids], dtype=torch.int64)
        presence, frequency, repetition = (
            p.to(device="cpu", dtype=torch.float32).contiguous()
            for p in (presence_penalties, frequency_penalties, repetition_penalties))
        rc = lib.pg_apply_penalties(
            logits.data_ptr(), logits.stride(0), rows, vocab_size,
            prompt.data_ptr() if prompt is not None else None,
            prompt.stride(0) if prompt is not None else 0,
            prompt.shape[1] if prompt is not None else 0,
            flat.data_ptr(), offsets.data_ptr(), presence.data_ptr(), frequency.data_ptr(),
            repetition.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("penalties: out of memory for the scratch of a logits row")
        return
    outputs = _pad_rows(output_token_ids, vocab_size, logits.device)
    output_counts = _token_counts(outputs, vocab_size)
    seen = output_counts > 0
    if prompt_token_ids is not None:
        seen_in_prompt = _token_counts(prompt_token_ids.to(logits.device), vocab_size) > 0
        seen_any = seen | seen_in_prompt
    else:
        seen_any = seen
    rep = repetition_penalties.to(logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen_any, penalised, logits))
    logits -= frequency_penalties.to(logits.device).unsqueeze(1) * output_counts
    logits -= presence_penalties.to(logits.device).unsqueeze(1) * seen


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    top_prob = probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < min_p.unsqueeze(1) * top_prob, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Returns logits with everything outside the top-k and the top-p nucleus at -inf.

    One ascending sort per row serves both: after it, the k best tokens are the last k
    columns, and the nucleus is what remains once the low tail of mass <= 1 - p is cut.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        top_k = top_k.to(logits.device)
        k = torch.where(top_k <= 0, vocab_size, top_k).clamp(max=vocab_size)
        kth_best = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_best, _NEG_INF)
    if top_p is not None:
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        cut = cumulative <= 1 - top_p.to(logits.device).unsqueeze(1)
        cut[:, -1] = False  # the best token always survives
        sorted_logits.masked_fill_(cut, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draws one token per row with the exponential race: argmax(p / q), q ~ Exp(1).

    Seeded rows draw q from their own generator, so their draw depends only on their seed
    and step count, not on which other requests share the batch. (The torch path; float32
    CPU rows take `sample_rows`.)
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


def sample_rows(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    generators: dict[int, torch.Generator],
    skip: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One token per row drawn from softmax(logits) after top-k and top-p, as
    `apply_top_k_top_p` + `random_sample` would keep and weigh them, in one C pass
    (pg_sample_rows in kernels/sampling.c) that sorts only the best tokens and draws with
    one uniform number per row instead of an exponential per token: for a 49152-token
    vocabulary ~60x less work per row than sorting and drawing in torch. Seeded rows
    take their number from their own generator (batch-independent, as above).

    `skip` [B] bool marks rows whose result is not wanted (greedy rows); their entries
    are left as garbage. Returns None where the kernel does not apply (no C kernels,
    not float32 CPU rows with contiguous columns): the caller then takes the torch path.
    """
    lib = _row_kernels(logits)
    if lib is None:
        return None
    rows = logits.shape[0]
    uniform = (torch.rand(rows, dtype=torch.float64) if len(generators) < rows
               else torch.empty(rows, dtype=torch.float64))
    for row, generator in generators.items():
        uniform[row] = torch.rand((), dtype=torch.float64, generator=generator)
    if top_k is not None:
        top_k = top_k.to(torch.int64).contiguous()
    if top_p is not None:
        top_p = top_p.to(torch.float32).contiguous()
    if skip is not None:
        skip = skip.to(torch.uint8).contiguous()
    out = torch.zeros(rows, dtype=torch.int64)
    rc = lib.pg_sample_rows(
        logits.data_ptr(), logits.stride(0), rows, logits.shape[1],
        top_k.data_ptr() if top_k is not None else None,
        top_p.data_ptr() if top_p is not None else None,
        uniform.data_ptr(), skip.data_ptr() if skip is not None else None, out.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("sampling: out of memory for the scratch of a logits row")
    return out


def logprobs_rows(
    logits: torch.Tensor, num_top: int, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(token ids [B, 1 + k], logprobs [B, 1 + k], ranks [B]) of each row's chosen token
    and its `num_top` best under log_softmax, through pg_logprobs_rows (kernels/sampling.c):
    two passes over the row instead of a [B, V] log_softmax, a top-k and a comparison.
    None where it does not apply (no C kernels, not float32 CPU rows with contiguous
    columns, or more than 64 top logprobs): the caller then takes torch's ops."""
    lib = _row_kernels(logits)
    if lib is None or not 0 <= num_top <= min(64, logits.shape[1]):
        return None
    rows = logits.shape[0]
    chosen = chosen.to(device="cpu", dtype=torch.int64).contiguous()
    ids = torch.empty(rows, 1 + num_top, dtype=torch.int64)
    values = torch.empty(rows, 1 + num_top, dtype=torch.float32)
    ranks = torch.empty(rows, dtype=torch.int64)
    rc = lib.pg_logprobs_rows(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], num_top,
                              chosen.data_ptr(), ids.data_ptr(), values.data_ptr(), ranks.data_ptr())
    if rc != 0:
        raise ValueError(f"logprobs: cannot take {num_top} top logprobs of {logits.shape[1]}")
    return ids, values, ranks
