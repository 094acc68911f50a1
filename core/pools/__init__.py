"""The physical KV memory: the K/V buffers (`KVPool`, `HybridKVPool`), their page allocators
(`PagedAllocator`, `HybridAllocator`) and the request-row table (`ReqToTokenPool`). The KV
manager (`plugserve.mem`) accounts for every slot of them; prefix caches (`plugserve.cache`)
store slots of them."""
