"""Workload `serving`: an online benchmark against a running OpenAI-compatible server
(`plugserve bench serving --base-url URL`), like SGLang's bench_serving / vLLM's
benchmark_serving.

For each request rate, `--num-seqs` streaming requests are sent with Poisson arrivals (rate
`inf`: all at once), at most `--max-concurrency` in flight. Prompts: `random` (token-id
prompts of `--input-len` tokens against /v1/completions when the server reports its
vocabulary, as plugserve does; random text otherwise) or `chat` (the shipped chat prompts,
cycled, against /v1/chat/completions). Every request asks for `--output-len` tokens with EOS
ignored. Per request the client records the send time, each token's arrival (tokens of one
chunk share it) and the usage; from them, as in the offline workloads:

- TTFT: first token - send; ITL: gaps between successive tokens (0 within a chunk);
  TPOT: (latency - TTFT) / (output tokens - 1); E2E latency: last token - send;
- request and token throughput over the run's wall time;
- goodput: requests per second that met every `--goodput` limit (e.g. `ttft:500,tpot:50`,
  milliseconds; also `e2el`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from plugserve.bench.metrics import mean, percentile

NAME = "serving"
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class ServingOptions:
    base_url: str
    request_rates: tuple[float, ...] = (math.inf,)
    num_seqs: int = 32
    max_concurrency: int | None = None
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 64
    seed: int = 0
    goodput_ms: dict[str, float] = field(default_factory=dict)
    stream_interval: int | None = None  # tokens per streamed chunk, sent in each request
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        problems = []
        if not self.base_url.startswith(("http://", "https://")):
            problems.append(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.request_rates:
            problems.append("give at least one request rate")
        if any(not (r > 0) for r in self.request_rates):
            problems.append(f"request rates must be > 0 (inf = all at once), got "
                            f"{list(self.request_rates)}")
        for name in ("num_seqs", "input_len", "output_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.stream_interval is not None and self.stream_interval < 1:
            problems.append(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.dataset not in ("random", "chat"):
            problems.append(f"dataset must be random or chat, got {self.dataset!r}")
        unknown = sorted(set(self.goodput_ms) - set(SLO_KEYS))
        if unknown:
            problems.append(f"goodput limits are ttft, tpot, e2el (ms); unknown: {unknown}")
        if problems:
            raise ValueError("; ".join(problems))


def parse_rates(text: str) -> tuple[float, ...]:
    """`"1,2,inf"` -> (1.0, 2.0, inf)."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"request rates must be numbers or inf, comma-separated, got {text!r}"
                         ) from None


def parse_goodput(text: str | None) -> dict[str, float]:
    """`"ttft:500,tpot:50"` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for part in (text or "").replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, value = part.partition(":")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"goodput must look like ttft:500,tpot:50 (ms), got {text!r}"
                             ) from None
    return out


def options_from_cli(values: dict[str, Any], api_key: str | None) -> ServingOptions:
    """ServingOptions from the command's options (None = default); ValueError names the bad
    one."""
    given = {k: v for k, v in values.items() if v is not None}
    if "base_url" not in given:
        raise ValueError("bench serving needs --base-url, e.g. http://127.0.0.1:8000")
    given["request_rates"] = parse_rates(given.pop("request_rate", "inf"))
    given["goodput_ms"] = parse_goodput(given.pop("goodput", None))
    return ServingOptions(api_key=api_key, **given)


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool = False
    error: str | None = None
    sent_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times_s)
        if n < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1)

    @property
    def e2el(self) -> float:
        return self.end_s - self.sent_s


def chat_prompts(n: int) -> list[str]:
    text = resources.files("plugserve.bench").joinpath("data", "chat_prompts.jsonl").read_text(
        "utf-8")
    prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [prompts[i % len(prompts)] for i in range(n)]


def request_bodies(options: ServingOptions, model: str, vocab: int | None, seed: int
                   ) -> tuple[str, list[dict[str, Any]]]:
    """The endpoint and one body per request (random prompts differ per `seed`, so the
    server's prefix cache does not favour a later rate)."""
    rng = random.Random(seed)
    common = {"model": model, "max_tokens": options.output_len, "temperature": 0.0,
              "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
              "return_token_ids": True}
    if options.stream_interval is not None:
        common["stream_interval"] = options.stream_interval
    if options.dataset == "chat":
        return "/v1/chat/completions", [
            {**common, "messages": [{"role": "user", "content": p}]}
            for p in chat_prompts(options.num_seqs)]
    bodies = []
    for _ in range(options.num_seqs):
        if vocab:
            prompt: Any = [rng.randrange(min(3, vocab - 1), vocab) for _ in range(options.input_len)]
        else:  # ~1 token per short word on most tokenizers
            prompt = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") * 2
                              for _ in range(options.input_len))
        bodies.append({**common, "prompt": prompt})
    return "/v1/completions", bodies


async def _one(client: Any, path: str, body: dict[str, Any], out: Outcome) -> None:
    out.sent_s = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message"))
                    return
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    count = len(ids) if ids is not None else (1 if text else 0)
                    out.token_times_s += [now] * count
                if chunk.get("usage"):
                    out.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    out.output_tokens = int(chunk["usage"]["completion_tokens"])
        out.end_s = time.perf_counter()
        out.ok = True
    except Exception as exc:  # a transport error counts as a failed request
        out.error = f"{type(exc).__name__}: {exc}"
        out.end_s = time.perf_counter()


async def run_rate(client: Any, path: str, bodies: list[dict[str, Any]], rate: float,
                   options: ServingOptions) -> tuple[list[Outcome], float]:
    """Send every body with Poisson arrivals at `rate`; the outcomes and the wall time."""
    rng = random.Random(options.seed + 1)
    gate = asyncio.Semaphore(options.max_concurrency or len(bodies))
    outcomes = [Outcome() for _ in bodies]

    async def limited(body: dict[str, Any], out: Outcome) -> None:
        async with gate:
            await _one(client, path, body, out)

    start = time.perf_counter()
    tasks = []
    for i, body in enumerate(bodies):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.ensure_future(limited(body, outcomes[i])))
    await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def summarize(name: str, rate: float, outcomes: list[Outcome], seconds: float,
              goodput_ms: dict[str, float]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    output = sum(o.output_tokens for o in ok)
    gaps = [b - a for o in ok for a, b in zip(o.token_times_s, o.token_times_s[1:], strict=False)]

    def summary(values: list[float], *quantiles: int) -> dict[str, float | None]:
        out = {"mean": mean(values), "median": percentile(values, 50)}
        out.update({f"p{q}": percentile(values, q) for q in quantiles})
        return out

    def good(o: Outcome) -> bool:
        figures = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.e2el}
        return all(figures[k] is None or figures[k] * 1000 <= v  # type: ignore[operator]
                   for k, v in goodput_ms.items())

    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[str(o.error)] = errors.get(str(o.error), 0) + 1

    def per_s(x: float) -> float | None:
        return x / seconds if seconds > 0 else None

    return {
        "name": name, "request_rate": rate if math.isfinite(rate) else "inf",
        "requests": len(ok), "failed": len(outcomes) - len(ok), "errors": errors,
        "seconds": seconds, "prompt_tokens": prompt, "output_tokens": output,
        "request_per_s": per_s(len(ok)), "input_tok_per_s": per_s(prompt),
        "output_tok_per_s": per_s(output),
        "ttft_s": summary([o.ttft for o in ok if o.ttft is not None], 99),
        "itl_s": summary(gaps, 95, 99),
        "tpot_s": summary([o.tpot for o in ok if o.tpot is not None], 99),
        "e2el_s": summary([o.e2el for o in ok], 99),
        "goodput_req_per_s": per_s(sum(1 for o in ok if good(o))) if goodput_ms else None,
    }


async def _run(options: ServingOptions, progress: Any = None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    # Idle connections expire before a server's keep-alive timeout (uvicorn: 5 s) closes them.
    limits = httpx.Limits(max_connections=options.max_concurrency or options.num_seqs,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=options.base_url.rstrip("/"), headers=headers,
                                 timeout=options.timeout_s, limits=limits) as client:
        try:
            models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise RuntimeError(f"no OpenAI-compatible server answers at {options.base_url}: "
                               f"GET /v1/models failed ({exc})") from None
        card = models[0]
        runs = []
        for i, rate in enumerate(options.request_rates):
            path, bodies = request_bodies(options, card["id"], card.get("vocab_size"),
                                          options.seed + 1000 * i)
            name = f"rate {rate:g}" if math.isfinite(rate) else "rate inf"
            if options.max_concurrency:
                name += f", concurrency {options.max_concurrency}"
            if progress is not None:
                progress(name)
            outcomes, seconds = await run_rate(client, path, bodies, rate, options)
            runs.append(summarize(name, rate, outcomes, seconds, options.goodput_ms))
    work = {"name": NAME, "base_url": options.base_url, "model": card["id"], "endpoint": path,
            "dataset": options.dataset, "num_seqs": options.num_seqs,
            "input_len": options.input_len if options.dataset == "random" else None,
            "output_len": options.output_len, "max_concurrency": options.max_concurrency,
            "goodput_ms": options.goodput_ms}
    return {"workload": work, "runs": runs}


def run(options: ServingOptions, progress: Any = None) -> dict[str, Any]:
    """The JSON report of every rate."""
    return asyncio.run(_run(options, progress))
