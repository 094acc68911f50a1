"""lm-eval through `plugserve serve` against lm-eval's own `hf` backend, on the same model.

    .venv/bin/python benchmarks/lm_eval_check.py [--model HF_FOLDER] [--venv .venv-lmeval]

Makes its own virtual environment with `lm-eval[api,hf]` (never the project's, never CI),
writes three small local tasks (no hub access needed), and runs each twice:

- `plugserve_mc`: multiple choice (the `loglikelihood` requests of MMLU, ARC, HellaSwag, ...);
- `plugserve_ppl`: `loglikelihood_rolling` perplexity over a few paragraphs;
- `plugserve_gen`: `generate_until`, greedy;

once with lm-eval's `hf` backend (transformers in lm-eval's venv, fp32) and once through the
server: `local-completions` for all three and `local-chat-completions --apply_chat_template`
(against `hf --apply_chat_template`) for the generations. It prints, per task, the largest
per-sample loglikelihood difference, both accuracies / perplexities, how many generations
are identical, and each run's wall time. Goals (fp32): identical multiple-choice accuracy,
every per-sample loglikelihood within 1e-3, perplexity within 0.1%, identical generations.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = "lm-eval[api,hf]==0.4.13"
TORCH = "torch==2.13.0"
TASKS = ("plugserve_mc", "plugserve_ppl", "plugserve_gen")

MC = [
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What do bees make?", ["milk", "silk", "honey", "wax paper"], 2),
    ("What is frozen water called?", ["steam", "ice", "fog", "rain"], 1),
    ("Which animal barks?", ["cat", "dog", "fish", "bird"], 1),
    ("What color is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
    ("How many days are in a week?", ["five", "six", "seven", "eight"], 2),
    ("What is two plus two?", ["three", "four", "five", "six"], 1),
    ("Which is the largest ocean?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], 1),
    ("Who wrote Romeo and Juliet?", ["Dickens", "Shakespeare", "Austen", "Tolstoy"], 1),
    ("What is the boiling point of water in Celsius?", ["50", "90", "100", "120"], 2),
    ("Which shape has three sides?", ["square", "circle", "triangle", "hexagon"], 2),
    ("What do cows drink?", ["milk", "water", "juice", "tea"], 1),
    ("Which month comes after June?", ["May", "July", "August", "March"], 1),
]
PARAGRAPHS = [
    "The river wound through the valley, carrying melted snow from the mountains to the "
    "sea. Farmers along its banks planted wheat in the spring and harvested it before the "
    "autumn rains. In the evenings, children gathered by the water to watch the herons.",
    "Computers store information as bits, each of which is either zero or one. Groups of "
    "eight bits form a byte, and bytes are combined to represent numbers, letters and "
    "pictures. A modern laptop can hold billions of bytes in its memory.",
    "Bread is made from flour, water, salt and yeast. The yeast eats sugars in the dough "
    "and releases gas, which makes the bread rise. Baking sets the structure, and the crust "
    "turns brown as the sugars caramelize in the heat of the oven.",
    "The library opened early on Saturdays. Students came to study for exams, retirees "
    "read the morning papers, and a small group met in the back room every week to talk "
    "about the history of the town and the families who had founded it.",
]
GEN = [
    "Write one sentence about the moon.", "List three colors.",
    "Say hello in French.", "Name a fruit that is yellow.",
    "Complete the sequence: 1, 2, 3,", "What is the opposite of hot?",
    "Give a synonym for happy.", "Describe a cat in five words.",
]


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import lm_eval"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"lm_eval_check: making {venv} with {LM_EVAL} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)  # the CPU build, before lm-eval pulls one
    subprocess.run([*pip, LM_EVAL], check=True)
    return python


def write_tasks(folder: Path) -> None:
    def jsonl(name: str, rows: list[dict[str, Any]]) -> Path:
        path = folder / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path

    mc = jsonl("mc.jsonl", [{"question": q, "choices": c, "answer": a} for q, c, a in MC])
    ppl = jsonl("ppl.jsonl", [{"text": t} for t in PARAGRAPHS])
    gen = jsonl("gen.jsonl", [{"prompt": p, "target": ""} for p in GEN])
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        f"task: plugserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "ppl.yaml").write_text(
        f"task: plugserve_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {ppl}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n")
    (folder / "gen.yaml").write_text(
        f"task: plugserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: target\n"
        "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 32\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def lm_eval(python: Path, out: Path, tasks: str, model: str, model_args: str,
            task_dir: Path, *extra: str) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(python), "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
           "--tasks", tasks, "--include_path", str(task_dir), "--log_samples",
           "--output_path", str(out), "--seed", "1234", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"lm_eval_check: lm-eval ({model}) failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def samples(out: Path, task: str) -> list[dict[str, Any]]:
    files = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    if not files:
        sys.exit(f"lm_eval_check: no samples of {task} under {out}")
    rows = [json.loads(line) for line in Path(max(files)).read_text().splitlines() if line]
    return sorted(rows, key=lambda r: r["doc_id"])


def results(out: Path) -> dict[str, Any]:
    files = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return dict(json.loads(Path(max(files)).read_text())["results"])


def loglikelihoods(row: dict[str, Any]) -> list[float]:
    """Each request's loglikelihood of a sample (multiple choice: one per choice)."""
    out = []
    for resp in row["resps"]:
        value = resp[0]
        out.append(float(value[0] if isinstance(value, list) else value))
    return out


def compare(ref_out: Path, srv_out: Path) -> list[dict[str, Any]]:
    rows = []
    ref_res, srv_res = results(ref_out), results(srv_out)
    for task in TASKS:
        ref, srv = samples(ref_out, task), samples(srv_out, task)
        row: dict[str, Any] = {"task": task, "samples": len(ref)}
        if task == "plugserve_gen":
            same = sum(a["filtered_resps"] == b["filtered_resps"]
                       for a, b in zip(ref, srv, strict=True))
            row["identical generations"] = f"{same}/{len(ref)}"
        else:
            diffs = [abs(x - y) for a, b in zip(ref, srv, strict=True)
                     for x, y in zip(loglikelihoods(a), loglikelihoods(b), strict=True)]
            row["max |loglik diff|"] = max(diffs)
            if task == "plugserve_mc":
                row["acc hf / server"] = (f"{ref_res[task]['acc,none']:.4f} / "
                                          f"{srv_res[task]['acc,none']:.4f}")
                row["per-sample choice agreement"] = sum(
                    a["acc"] == b["acc"] for a, b in zip(ref, srv, strict=True))
            else:
                a, b = ref_res[task]["word_perplexity,none"], srv_res[task]["word_perplexity,none"]
                row["word ppl hf / server"] = f"{a:.4f} / {b:.4f}"
                row["ppl rel diff"] = abs(a - b) / a
        rows.append(row)
    return rows


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(model: Path, port: int, name: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "plugserve", "serve", "--model", str(model), "--port",
           str(port), "--dtype", "float32", "--served-model-name", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"lm_eval_check: plugserve serve exited: {proc.stderr.read().decode()}"
                     if proc.stderr else "lm_eval_check: plugserve serve exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("lm_eval_check: the server did not start in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF folder (default: the default model)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-lmeval")
    parser.add_argument("--out", type=Path, help="where lm-eval writes (default: a temp dir)")
    args = parser.parse_args()
    if args.model is None:
        from plugserve.model.default_model import default_model_path

        args.model = default_model_path()
    python = ensure_venv(args.venv)
    out = args.out or Path(tempfile.mkdtemp(prefix="lm_eval_check-"))
    task_dir = out / "tasks"
    task_dir.mkdir(parents=True, exist_ok=True)
    write_tasks(task_dir)
    name = "served"
    model = str(args.model.resolve())
    times: dict[str, float] = {}
    hf_args = f"pretrained={model},dtype=float32"
    times["hf"] = lm_eval(python, out / "hf", ",".join(TASKS), "hf", hf_args, task_dir,
                          "--device", "cpu", "--batch_size", "1")
    times["hf chat"] = lm_eval(python, out / "hf_chat", "plugserve_gen", "hf", hf_args,
                               task_dir, "--device", "cpu", "--batch_size", "1",
                               "--apply_chat_template")
    port = free_port()
    server = serve(args.model, port, name)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        api = (f"model={name},tokenizer={model},tokenizer_backend=huggingface,"
               "num_concurrent=1,max_retries=1,tokenized_requests=True")
        times["server completions"] = lm_eval(
            python, out / "srv", ",".join(TASKS), "local-completions",
            f"{api},base_url={base}/completions", task_dir)
        times["server chat"] = lm_eval(
            python, out / "srv_chat", "plugserve_gen", "local-chat-completions",
            f"model={name},tokenizer={model},tokenizer_backend=huggingface,num_concurrent=1,"
            f"max_retries=1,base_url={base}/chat/completions", task_dir,
            "--apply_chat_template")
    finally:
        server.terminate()
        server.wait(60)
    rows = compare(out / "hf", out / "srv")
    chat_ref = samples(out / "hf_chat", "plugserve_gen")
    chat_srv = samples(out / "srv_chat", "plugserve_gen")
    same = sum(a["filtered_resps"] == b["filtered_resps"]
               for a, b in zip(chat_ref, chat_srv, strict=True))
    rows.append({"task": "plugserve_gen (chat template)", "samples": len(chat_ref),
                 "identical generations": f"{same}/{len(chat_ref)}"})
    print(f"model {model} (fp32); lm-eval output in {out}")
    for row in rows:
        print("  " + "; ".join(f"{k}: {_fmt(v)}" for k, v in row.items()))
    print("  wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    failed = [r["task"] for r in rows
              if r.get("max |loglik diff|", 0) > 1e-3 or r.get("ppl rel diff", 0) > 1e-3
              or ("identical generations" in r
                  and not r["identical generations"].startswith(str(r["samples"])))
              or ("acc hf / server" in r and len(set(r["acc hf / server"].split(" / "))) > 1)]
    if failed:
        sys.exit(f"lm_eval_check: goals missed on {', '.join(failed)}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2e}" if value < 1e-2 or math.isnan(value) else f"{value:.4f}"
    return str(value)


if __name__ == "__main__":
    main()
