"""The causal prefill attention kernels (`plugserve.kernels.prefill_attention`) against torch's
`scaled_dot_product_attention` (what the torch_native backend runs otherwise), per prompt
length: milliseconds per layer at the default model's shape (9 query / 3 KV heads of 64).

    python benchmarks/prefill_attention_speed.py [--tokens 150,512,1024] [--dtype bfloat16]
        [--prefix 0] [--heads 9 --kv-heads 3 --head-dim 64] [--threads 2]

SDPA runs as the backend calls it: [1, H, E, D] views, is_causal without a prefix, a boolean
mask with one (and then K/V of the query heads' count). "vector" is the float32-vector
kernel, "AMX" the AMX-tile one (bf16 on a CPU with AMX only). Inputs are random; best of
--repeats calls.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from plugserve.bench.bandwidth import best_seconds
from plugserve.kernels import prefill_attention as pa

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          prefix: int) -> torch.Tensor:
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, E, D]
    mask = None
    if prefix > 0:
        q_pos = prefix + torch.arange(q.shape[0])
        mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="150,512,1024")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not pa.available():
        raise SystemExit(f"the prefill kernel is unavailable: {pa.why_unavailable()}")
    dtype = DTYPES[args.dtype]
    amx = pa.amx_applies(dtype, args.head_dim)
    print(f"{args.dtype}, {args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}, "
          f"prefix {args.prefix}, {args.threads} threads, kernels' copy {pa.isa()}; "
          f"ms per layer")
    gen = torch.Generator().manual_seed(0)
    scale = args.head_dim**-0.5
    for tokens in (int(t) for t in args.tokens.split(",")):
        keys = args.prefix + tokens
        q = torch.randn(tokens, args.heads, args.head_dim, generator=gen).to(dtype)
        k = torch.randn(keys, args.kv_heads, args.head_dim, generator=gen).to(dtype)
        v = torch.randn(keys, args.kv_heads, args.head_dim, generator=gen).to(dtype)

        def ms(fn: Callable[[], object]) -> float:
            return best_seconds(fn, args.repeats) * 1e3

        with torch.inference_mode():
            sdpa = ms(lambda q=q, k=k, v=v: _sdpa(q, k, v, scale, args.prefix))
            vector = ms(lambda q=q, k=k, v=v: pa.prefill_attention(
                q, k, v, scale, args.prefix, amx=False))
            line = (f"tokens {tokens:5d}: SDPA {sdpa:7.3f}, vector kernel {vector:7.3f} "
                    f"(SDPA / kernel {sdpa / vector:.2f})")
            if amx:
                tiles = ms(lambda q=q, k=k, v=v: pa.prefill_attention(q, k, v, scale, args.prefix))
                line += f", AMX kernel {tiles:7.3f} (SDPA / kernel {sdpa / tiles:.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
