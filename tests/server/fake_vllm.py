"""TEST DOUBLE for vLLM's environment in `plugserve bench serving --compare vllm` tests.

Run as the "vLLM interpreter" (through a one-line shell wrapper that `--vllm-python` names):

- `-m vllm.entrypoints.openai.api_server --model M --dtype D --port P ...` stands in for vLLM's
  server: it runs `plugserve serve` on the same model, port and `--stream-interval` (the other
  flags dropped);
- `-c CODE --base-url URL --endpoint E --num-prompts N --random-input-len I
  --random-output-len O --result-dir D --result-filename F ...` stands in for `vllm bench serve`:
  N streaming requests at once, and a result file with the keys vLLM's client writes.

Nothing of vLLM is used; only the plumbing (commands, ports, result files, stopping) is tested.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


def serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--dtype", "--port", "--served-model-name", "--stream-interval"):
        parser.add_argument(flag)
    args, _ = parser.parse_known_args(argv)
    interval = [] if args.stream_interval is None else ["--stream-interval", args.stream_interval]
    os.execv(sys.executable, [sys.executable, "-m", "plugserve", "serve", "--model", args.model,
                              "--dtype", args.dtype, "--port", args.port,
                              "--served-model-name", args.served_model_name, *interval])


async def one(client: object, url: str, body: dict[str, object]) -> tuple[float, int]:
    import httpx

    assert isinstance(client, httpx.AsyncClient)
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and (chunk["choices"][0].get("text")
                                         or chunk["choices"][0].get("delta", {}).get("content")):
                    first = first or time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


async def bench(args: argparse.Namespace) -> dict[str, object]:
    import httpx

    chat = args.endpoint.endswith("chat/completions")
    prompt = " ".join(["word"] * args.random_input_len)
    body: dict[str, object] = {"model": args.model, "max_tokens": args.random_output_len,
                               "ignore_eos": True, "temperature": 0, "stream": True,
                               "repetition_penalty": 1.0,
                               "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat
                else {"prompt": prompt})
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        results = await asyncio.gather(*(one(client, args.base_url + args.endpoint, body)
                                         for _ in range(args.num_prompts)))
    duration = time.perf_counter() - start
    out_tokens = args.num_prompts * args.random_output_len
    streamed = sum(r[1] for r in results)
    if streamed != out_tokens:  # the server under test did not stream every token
        sys.exit(f"fake vLLM client: {streamed} tokens streamed, {out_tokens} expected")
    return {"completed": len(results), "failed": 0, "duration": duration,
            "request_throughput": len(results) / duration,
            "output_throughput": out_tokens / duration,
            "total_token_throughput": (out_tokens + args.num_prompts * args.random_input_len)
            / duration, "mean_ttft_ms": 1000 * sum(r[0] for r in results) / len(results),
            "median_ttft_ms": 0.0, "mean_tpot_ms": 0.0, "mean_itl_ms": 0.0,
            "total_input_tokens": args.num_prompts * args.random_input_len,
            "total_output_tokens": streamed}


def client(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--base-url", "--endpoint", "--model", "--result-dir", "--result-filename",
                 "--backend", "--dataset-name"):
        parser.add_argument(flag)
    for flag in ("--num-prompts", "--random-input-len", "--random-output-len"):
        parser.add_argument(flag, type=int)
    args, _ = parser.parse_known_args(argv)
    assert args.dataset_name == "random", args.dataset_name
    result = asyncio.run(bench(args))
    Path(args.result_dir, args.result_filename).write_text(json.dumps(result))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        serve(argv[2:])
    elif argv[:1] == ["-c"]:
        client(argv[2:])
    else:
        sys.exit(f"fake vLLM: unexpected arguments {argv}")
