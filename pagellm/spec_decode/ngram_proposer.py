"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence
of a request's last n tokens (in its prompt or its output so far), trying the longest n
first (vLLM's method "ngram", with prompt_lookup_min / prompt_lookup_max).

In: a request's token ids. Out: up to k proposed token ids (none where nothing matches).
Knows no requests, blocks or tensors.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        assert 1 <= lookup_min <= lookup_max
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to k tokens: for the longest n in [lookup_max .. lookup_min] whose last-n
        suffix occurs earlier, the tokens after its latest earlier occurrence."""
        if k < 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if length < self.lookup_min + 1:
            return []
        # Candidate starts i (i + n <= length - 1: the match ends before the suffix's last
        # token) are where the suffix's last token reappears, shifted back.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            starts = ends[ends >= n - 1] - (n - 1)
            if len(starts) == 0:
                continue
            hit = (tokens[starts[:, None] + np.arange(n)] == tokens[length - n:]).all(axis=1)
            found = np.flatnonzero(hit)
            if len(found):
                i = int(starts[found[-1]])  # the latest occurrence
                return tokens[i + n : i + n + k].tolist()
        return []
