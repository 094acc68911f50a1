"""`plugserve bench WORKLOAD`: an offline benchmark with serving metrics, tables, a plot.

Every option is checked (workload options, engine configurations of every run, the plot
file) before the first engine starts, so a mistake costs nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from plugserve.cli.bench_options import (
    add_llamacpp_run,
    add_vllm_run,
    bench_workload_options,
    check_plot_path,
    checked_llamacpp,
    checked_vllm,
    parse_compare,
    refuse_foreign_options,
    refuse_under_torchrun,
)
from plugserve.cli.errors import UsageError, reported_errors
from plugserve.cli.logs import stderr_logging
from plugserve.cli.options import (
    AttentionOpt,
    CacheOpt,
    DebugOpt,
    DeviceOpt,
    DraftModelOpt,
    DtypeOpt,
    JsonOpt,
    KVCacheDtypeOpt,
    LogLevelOpt,
    MemCheckOpt,
    ModelOpt,
    PageSizeOpt,
    PluginOpt,
    QuantActivationsOpt,
    QuantizationOpt,
    SpecDraftTokensOpt,
    SpecOpt,
    SpecStepsOpt,
    SpecTopkOpt,
    TpOpt,
    checked_plugin_host,
    engine_config,
    print_json,
    stderr_console,
)


def bench_command(
    workload: Annotated[
        str,
        typer.Argument(
            metavar="WORKLOAD",
            help="throughput (default), prefill, latency, shared-prefix, spec, sessions, "
            "long-context or serving.",
            show_default=False,
        ),
    ] = "throughput",
    model: ModelOpt = None,
    plugin: PluginOpt = None,
    attention: AttentionOpt = None,
    cache: CacheOpt = None,
    page_size: PageSizeOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = None,
    quantization: QuantizationOpt = None,
    quant_activations: QuantActivationsOpt = None,
    kv_pool_tokens: Annotated[
        int | None, typer.Option(help="KV slots per pool (tokens); default: sized by the "
                                 "workload or from the context.")
    ] = None,
    device: DeviceOpt = None,
    mem_check: MemCheckOpt = None,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    spec_steps: SpecStepsOpt = None,
    spec_topk: SpecTopkOpt = None,
    spec_draft_tokens: SpecDraftTokensOpt = None,
    tp: TpOpt = None,
    num_seqs: Annotated[
        int | None, typer.Option(help="throughput: requests in the workload (default 64); "
                                 "prefill: prompts (default 1); "
                                 "serving: requests per rate (default 32).")
    ] = None,
    max_input_len: Annotated[
        int | None,
        typer.Option(help="throughput: longest prompt (tokens, >= 16) (default 256)."),
    ] = None,
    max_output_len: Annotated[
        int | None,
        typer.Option(help="throughput: longest output (tokens, >= 16) (default 256)."),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(help="throughput, shared-prefix, sessions, serving: workload seed "
                     "(default 0)."),
    ] = None,
    structured: Annotated[
        str | None,
        typer.Option(help="throughput: json constrains every output to a JSON schema (the "
                     "grammar mask's time per step is reported); none (default).")
    ] = None,
    groups: Annotated[
        int | None, typer.Option(help="shared-prefix: groups G (default 8).")
    ] = None,
    prompts_per_group: Annotated[
        int | None, typer.Option(help="shared-prefix: prompts per group P (default 8).")
    ] = None,
    prefix_len: Annotated[
        int | None,
        typer.Option(help="shared-prefix: shared prefix tokens S (default 512)."),
    ] = None,
    question_len: Annotated[
        int | None, typer.Option(help="shared-prefix: question tokens Q (default 32).")
    ] = None,
    output_len: Annotated[
        int | None,
        typer.Option(help="shared-prefix: output tokens O (default 32); spec: new tokens "
                     "N (default 64); serving: output tokens per request (default 64); "
                     "latency: output tokens per sequence (default 128)."),
    ] = None,
    spec_prompts: Annotated[
        int | None, typer.Option(help="spec: chat prompts used (default 8).")
    ] = None,
    sessions: Annotated[
        int | None, typer.Option(help="sessions: conversations S (default 8).")
    ] = None,
    turns: Annotated[
        int | None, typer.Option(help="sessions: turns T per conversation (default 32).")
    ] = None,
    turn_input_len: Annotated[
        int | None, typer.Option(help="sessions: new tokens per turn (default 32).")
    ] = None,
    turn_output_len: Annotated[
        int | None, typer.Option(help="sessions: output tokens per turn (default 32).")
    ] = None,
    background_prompts: Annotated[
        int | None,
        typer.Option(help="sessions: one-shot requests of other users per round (default 0)."),
    ] = None,
    background_len: Annotated[
        int | None, typer.Option(help="sessions: tokens of each background request (default 512).")
    ] = None,
    base_url: Annotated[
        str | None, typer.Option(help="serving: the server, e.g. http://127.0.0.1:8000.")
    ] = None,
    request_rate: Annotated[
        str | None,
        typer.Option(help="serving: requests/s (Poisson), comma-separated for several runs; "
                     "inf = all at once (default inf)."),
    ] = None,
    max_concurrency: Annotated[
        int | None, typer.Option(help="serving: most requests in flight (default: no limit).")
    ] = None,
    stream_interval: Annotated[
        int | None,
        typer.Option(help="serving: generated tokens per streamed chunk (each request's "
                     "stream_interval; with --compare vllm both servers' --stream-interval; "
                     "default: the server's, 1)."),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="serving: random (token-id prompts) or chat (shipped chat prompts) "
                     "(default random)."),
    ] = None,
    input_len: Annotated[
        int | None, typer.Option(help="serving, latency: random prompt tokens (default 128); "
                                 "prefill: tokens per prompt (default 1024).")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="latency: sequences in the batch (default 1).")
    ] = None,
    num_iters: Annotated[
        int | None, typer.Option(help="latency: timed iterations (default 3); prefill: timed "
                                 "prefills, each of new prompts, the median reported (default 1).")
    ] = None,
    num_iters_warmup: Annotated[
        int | None, typer.Option(help="latency: untimed iterations first (default 1).")
    ] = None,
    goodput: Annotated[
        str | None,
        typer.Option(help="serving: latency limits in ms for goodput, e.g. ttft:500,tpot:50 "
                     "(also e2el)."),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option(help="Also time another implementation: transformers, vllm, or both "
                     "(transformers,vllm); latency: llamacpp."),
    ] = None,
    hf_batch_sizes: Annotated[
        str, typer.Option(help="Batch sizes tried for transformers; the best counts.")
    ] = "16,32,64",
    vllm_python: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="--compare vllm: the Python interpreter that has "
                     "vLLM (benchmarks/setup_vllm.sh makes .venv-vllm/bin/python)."),
    ] = None,
    llamacpp_python: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="--compare llamacpp: the Python interpreter that has "
                     "llama-cpp-python (benchmarks/setup_llamacpp.sh makes "
                     ".venv-llamacpp/bin/python)."),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(metavar="FILE.png", help="Write a bar chart of the main figures."),
    ] = None,
    json_out: JsonOpt = False,
    log_level: LogLevelOpt = "WARNING",
    debug: DebugOpt = False,
) -> None:
    """Offline benchmark of one workload (greedy, EOS ignored), with serving metrics.

    \b
    throughput     random prompts and output lengths, all at once (64 seqs:
                   9,536 prompt / 8,224 output tokens)
    prefill        N prompts of L random tokens (default one of 1,024), one
                   output token each: prefill speed (input tok/s)
    latency        one batch of B prompts of I random tokens, O output tokens
                   each, timed --num-iters times (vLLM's bench latency): mean
                   latency and percentiles, prefill and decode tok/s, the share
                   of the (quantized) roofline; --compare llamacpp runs the same
                   GGUF file and prompt through llama.cpp (batch 1, same threads)
    shared-prefix  G groups x P prompts, each a shared S-token prefix + a Q-token
                   question; run with the radix cache and without
    spec           chat prompts; plain vs EAGLE chain (3 steps) vs tree (topk 4,
                   8 tokens), page size 1 and 16, batch 1 and 8; needs a draft
                   model (--draft-model) unless the engine ships one
    sessions       S conversations x T turns, all S advancing one turn per
                   round (batched); streaming sessions (only new tokens sent)
                   vs re-sending the history to the radix cache; per-turn
                   latency (head vs tail) and prefill tokens computed per turn
    long-context   long prompts (4,096-token contexts) on a hybrid sliding-window
                   model (tiny Gemma-3 shape unless --model): SWA pools vs one
                   full pool under the same KV bytes; peak slots per pool and
                   the most requests running at once
    serving        against a running server (--base-url): streaming requests at
                   --request-rate (Poisson) or --max-concurrency; reports TTFT,
                   ITL, TPOT, E2E latency (mean, median, p99) and goodput

    \b
    Every run reports req/s, input and output tok/s, and
    TTFT  time to first token: mean, median, p99
    ITL   gaps between a request's successive tokens: mean, median, p95,
          p99; tokens of one speculative verify round arrive together,
          a gap of 0
    TPOT  (latency - TTFT) / (output tokens - 1) per request: mean
    step time by phase (schedule, metadata, forward, sample, post-process,
    check, and draft/verify/accept/draft_extend with speculation).
    spec adds the acceptance length (tokens per verify round) and target
    forwards per output token ((1 prefill + verify rounds) / output tokens;
    1.0 without speculation).
    """

    with reported_errors(debug):
        serving_values: dict[str, Any] = {
            "base_url": base_url, "request_rate": request_rate,
            "max_concurrency": max_concurrency, "dataset": dataset, "input_len": input_len,
            "stream_interval": stream_interval,
            "goodput": goodput,
        }
        if workload == "serving":
            offline = {  # options of the offline workloads and of the engine
                "model": model, "plugin": plugin, "attention": attention, "cache": cache,
                "tp": tp,
                "page_size": page_size, "dtype": dtype, "device": device,
                "mem_check": mem_check, "spec": spec, "draft_model": draft_model,
                "spec_steps": spec_steps, "spec_topk": spec_topk,
                "spec_draft_tokens": spec_draft_tokens, "compare": compare,
                "vllm_python": vllm_python,
                "max_input_len": max_input_len, "max_output_len": max_output_len,
                "groups": groups, "prompts_per_group": prompts_per_group,
                "prefix_len": prefix_len, "question_len": question_len,
                "spec_prompts": spec_prompts, "sessions": sessions, "turns": turns,
                "turn_input_len": turn_input_len, "turn_output_len": turn_output_len,
                "background_prompts": background_prompts, "background_len": background_len,
                "structured": structured, "batch_size": batch_size, "num_iters": num_iters,
                "num_iters_warmup": num_iters_warmup, "llamacpp_python": llamacpp_python,
            }
            serving_values.update(num_seqs=num_seqs, output_len=output_len, seed=seed)
            from plugserve.cli.bench_serving import run_serving

            run_serving(serving_values, offline, plot, json_out)
            return
        from plugserve.bench.hf import Comparison
        from plugserve.bench.runner import Runner
        from plugserve.bench.workloads import get_workload
        from plugserve.validation import validate_config

        try:
            chosen = get_workload(workload)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        check_plot_path(plot)
        engine_values: dict[str, Any] = {
            "cache": cache,
            "page_size": page_size,
            "kv_pool_tokens": kv_pool_tokens,
            "spec": spec,
            "spec_steps": spec_steps,
            "spec_topk": spec_topk,
            "spec_draft_tokens": spec_draft_tokens,
        }
        workload_values: dict[str, Any] = {
            "num_seqs": num_seqs,
            "max_input_len": max_input_len,
            "max_output_len": max_output_len,
            "seed": seed,
            "structured": structured,
            "groups": groups,
            "prompts_per_group": prompts_per_group,
            "prefix_len": prefix_len,
            "question_len": question_len,
            "output_len": output_len,
            "spec_prompts": spec_prompts,
            "sessions": sessions,
            "turns": turns,
            "turn_input_len": turn_input_len,
            "turn_output_len": turn_output_len,
            "background_prompts": background_prompts,
            "background_len": background_len,
            "batch_size": batch_size,
            "num_iters": num_iters,
            "num_iters_warmup": num_iters_warmup,
            **serving_values,
        }
        refuse_foreign_options(chosen.name, chosen.engine_fields_set, engine_values,
                               workload_values)
        # The spec workload turns speculation on and off itself: its draft model is a
        # workload option, not part of the base engine config.
        spec_draft_model = draft_model if chosen.name == "spec" else None
        if spec_draft_model is not None:
            draft_model = None
        config = engine_config(
            model=model,
            attention=attention,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization, quant_activations=quant_activations,
            device=device,
            mem_check=mem_check,
            draft_model=draft_model,
            tp_size=tp,
            **engine_values,
        )
        with stderr_logging(log_level, config.mem_check):
            options = plugin or []
            host = checked_plugin_host(options, config, debug)
            refuse_under_torchrun(config)
            compared = parse_compare(compare, vllm_python, llamacpp_python, chosen.name)
            try:
                batch_sizes = tuple(
                    int(part) for part in hf_batch_sizes.split(",") if part.strip()
                )
            except ValueError:
                raise UsageError(
                    f"--hf-batch-sizes must be comma-separated integers, got {hf_batch_sizes!r}"
                ) from None
            try:
                workload_options = bench_workload_options(chosen.name, workload_values)
                if spec_draft_model is not None:
                    workload_options = dataclasses.replace(workload_options,
                                                           draft_model=spec_draft_model)
                comparison = Comparison(batch_sizes) if "transformers" in compared else None
            except ValueError as exc:
                raise UsageError(f"invalid benchmark options: {exc}") from None
            for label, derived in chosen.engine_configs(config, workload_options).items():
                reasons = validate_config(derived, host.registries)
                if reasons:
                    raise UsageError(
                        f"unsupported configuration for {chosen.name} run {label!r}: "
                        + "; ".join(reasons)
                    )
            vllm = checked_vllm(vllm_python, config, chosen.name) if "vllm" in compared else None
            llamacpp = checked_llamacpp(llamacpp_python, config) if "llamacpp" in compared \
                else None
            runner = Runner(config, tuple(options), console=stderr_console(),
                            show_progress=not json_out)
            with runner.session():
                report = chosen.run(runner, workload_options, comparison)
                if vllm is not None:
                    add_vllm_run(report, vllm, runner)
                if llamacpp is not None:
                    add_llamacpp_run(report, llamacpp, runner)
            if plot is not None:
                report["plot"] = str(write_plot(report, plot))
            if json_out:
                print_json(report)
            else:
                from plugserve.bench.report import print_report

                if not getattr(chosen.module, "OWN_REPORT", False):  # long-context: own table
                    print_report(report)
                tables = getattr(chosen.module, "print_tables", None)  # the workload's own
                if tables is not None:
                    tables(report)
                if plot is not None:
                    typer.echo(f"plot written to {report['plot']}", err=True)


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """The chart of a finished run; a file system error is one line naming the path."""
    from plugserve.bench.plot import write_plot as draw

    try:
        return draw(report, path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"--plot {str(path)!r} could not be written: {reason}") from None
