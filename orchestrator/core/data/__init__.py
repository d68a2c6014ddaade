"""The pure half of data loading: the token shard format and checks, window sampling, host rows.

`orchestrator.core.config.check` uses it at plan time; `stages.data` reads with it on the hosts.
"""
from orchestrator.core.data.sampler import WindowSampler, affine, host_rows, windows_per_shard
from orchestrator.core.data.shards import (
    DTYPES, FORMAT, INDEX, SCAN_BYTES, ShardError, TokenSet, index_dict, regular_file, resolve_tokens, scan_max,
)

__all__ = ["WindowSampler", "affine", "host_rows", "windows_per_shard", "DTYPES", "FORMAT", "INDEX",
           "SCAN_BYTES", "ShardError", "TokenSet", "index_dict", "regular_file", "resolve_tokens", "scan_max"]
