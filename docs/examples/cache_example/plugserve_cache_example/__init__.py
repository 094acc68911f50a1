"""Worked example of a plugserve cache policy: `lru_radix`, a radix cache that keeps at most
`max_cached_tokens` cached tokens, evicting the least recently used past that bound even when
the KV pool has room."""
