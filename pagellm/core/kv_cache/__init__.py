"""Paged KV cache bookkeeping: block hashes, the block pool and per-request block tables.

Pure Python (no torch): the model runner owns the tensors, this package owns which
block ids each request may use.
"""

from pagellm.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagellm.core.kv_cache.hashing import BlockHash, get_request_block_hasher, hash_block_tokens
from pagellm.core.kv_cache.kv_cache_manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "get_request_block_hasher",
    "hash_block_tokens",
]
