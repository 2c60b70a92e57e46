"""Chained content hashes of full KV blocks, the keys of the prefix cache.

In: a request's token ids. Out: one 32-byte sha256 digest per
full block, each covering its parent's digest, so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.core.request import Request

# A block's identity in the prefix cache: sha256 digest of (parent, tokens).
BlockHash = bytes

# Stands in for the parent of a request's first block. Fixed, so hashes are reproducible
# across processes (the frontend and engine core may both hash).
NONE_HASH: BlockHash = hashlib.sha256(b"pagellm-prefix-cache-root").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """sha256 over: parent digest (32 B) | token count (4 B) | token ids (int64 each).
    Every field has a known width, so the encoding is unambiguous.
    """
    h = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """Returns the hasher a Request calls at creation and after each token append.

    It hashes only blocks that are full and not yet in ``request.block_hashes``:

        all_token_ids  |<- block 0 ->|<- block 1 ->|<- block 2 (partial) ->
        block_hashes   [  h0,           h1         ]     (h2 once it fills)
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def hasher(request: Request) -> list[BlockHash]:
        token_ids = request.all_token_ids
        start = len(request.block_hashes)  # first block without a hash
        num_full = len(token_ids) // block_size
        parent = request.block_hashes[-1] if start > 0 else None
        new_hashes: list[BlockHash] = []
        for i in range(start, num_full):
            parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
            new_hashes.append(parent)
        return new_hashes

    return hasher
