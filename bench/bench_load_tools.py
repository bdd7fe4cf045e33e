"""aiperf and inference-perf, run as their users run them, against inferd and against kvroute over two hosts.

    .venv/bin/python bench/bench_load_tools.py [--quick] [--json]

Load tools someone else wrote, pointed at kvpool's front door (each in its own
venv: bench/load_tools.py; nothing downloaded at run time but those, the
tokenizer a local directory, the data synthetic or written here):

- **aiperf**: multi-turn chat conversations, streamed, with a shared system
  prompt and a per-conversation context, each conversation's turns under an
  `X-Session-Id` header (`--session-header`), the prefix cache reset before
  the run (`--reset-kv-cache`), usage read from every chunk
  (`--per-chunk-usage`), and the server's metrics scraped (its `vllm:*`
  names) beside its own;
- **inference-perf**: its `shared_prefix` data as multi-turn chats
  (`enable_multi_turn_chat`: it sends them to /v1/completions), and a
  ShareGPT-format file of chats (written here) streamed to
  /v1/chat/completions, each with its session header;
- **bench_http_chat**'s own load (sessions, streamed), against the same
  server, for a figure beside theirs.

Each against two targets, started fresh (for each inference-perf run too:
it names its sessions the same on every run): **inferd** (memd + inferd --http)
and **kvroute** (two such hosts, memd --kv-events, behind kvroute
--kv-events). Reported per run: requests answered and failed (the tools' own
counts), TTFT p50/p99 and ITL p50 by the tool's own clock, output tokens/s,
and the share of prompt tokens the server served from cache (by its usage).
A run with a failed request fails the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bench_http_chat
import load_tools
from kv_hosts import serving
from tables import table

from inferd.tiny import CORPUS, make_tiny_model

FULL = {"conversations": 16, "turns": 3, "concurrency": 4, "system": 400, "context": 100, "question": 40,
        "output": 16, "groups": 4, "rate": 4.0, "seconds": 10,
        "model": {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 0}}
QUICK = {"conversations": 4, "turns": 2, "concurrency": 2, "system": 100, "context": 20, "question": 20,
         "output": 4, "groups": 2, "rate": 4.0, "seconds": 2,
         "model": {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "seed": 0}}
TARGETS = ("inferd", "kvroute")
SESSION_HEADER = "X-Session-Id"


@contextmanager
def target(name: str, model_dir: Path, work: Path) -> Iterator[str]:
    """The target's base URL: one host's inferd, or kvroute in front of two hosts (by their KV events)."""
    with serving(work, model_dir, hosts=1 if name == "inferd" else 2, pool="64MiB", kvroute=name == "kvroute") \
            as url:
        yield url


def run_aiperf(url: str, model_dir: Path, out: Path, shape: dict[str, Any]) -> dict[str, Any]:
    command = [str(load_tools.aiperf()), "profile", "--model", "tiny", "--url", url, "--endpoint-type", "chat",
               "--streaming", "--tokenizer", str(model_dir), "--conversation-num", str(shape["conversations"]),
               "--conversation-turn-mean", str(shape["turns"]), "--conversation-turn-stddev", "0",
               "--shared-system-prompt-length", str(shape["system"]),
               "--user-context-prompt-length", str(shape["context"]),
               "--prompt-input-tokens-mean", str(shape["question"]), "--prompt-input-tokens-stddev", "0",
               "--prompt-output-tokens-mean", str(shape["output"]), "--prompt-output-tokens-stddev", "0",
               "--concurrency", str(shape["concurrency"]), "--extra-inputs", "ignore_eos:true",
               "--session-header", SESSION_HEADER, "--reset-kv-cache", "--per-chunk-usage",
               "--use-server-token-count", "--random-seed", "0", "--no-gpu-telemetry", "--ui-type", "none",
               "--artifact-dir", str(out)]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=900)
    report = out / "profile_export_aiperf.json"
    if not report.exists():
        raise RuntimeError(f"aiperf wrote no report (exit {ran.returncode}): {ran.stderr.strip()[-500:]}")
    r = json.loads(report.read_text())
    prompt, cached = r["usage_prompt_tokens"]["avg"], r.get("usage_prompt_cache_read_tokens", {}).get("avg", 0.0)
    errors = sum(int(e.get("count", 1)) for e in r.get("error_summary") or [])
    return {"command": " ".join(command[1:]), "exit": ran.returncode, "ok": int(r["request_count"]["avg"]),
            "failed": errors, "ttft_p50_ms": r["time_to_first_token"]["p50"],
            "ttft_p99_ms": r["time_to_first_token"]["p99"], "itl_p50_ms": r["inter_token_latency"]["p50"],
            "output_tok_s": r["output_token_throughput"]["avg"], "cached_share": cached / prompt if prompt else 0.0,
            "server_metrics": (out / "server_metrics_export.json").exists()}


def run_inference_perf(url: str, model_dir: Path, out: Path, shape: dict[str, Any], data: str) -> dict[str, Any]:
    """`data`: "shared_prefix" (its multi-turn chats, sent to /v1/completions) or "sharegpt" (chats streamed to
    /v1/chat/completions from a file written here)."""
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "api": {"type": "completion" if data == "shared_prefix" else "chat", "streaming": True,
                "session_id_header_key": SESSION_HEADER},
        "load": {"type": "constant", "stages": [{"rate": shape["rate"], "duration": shape["seconds"]}]},
        "server": {"type": "vllm", "model_name": "tiny", "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(model_dir)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": False}},
        "storage": {"local_storage": {"path": str(out / "reports")}}}
    if data == "shared_prefix":
        config["data"] = {"type": "shared_prefix", "shared_prefix": {
            "num_groups": shape["groups"], "num_prompts_per_group": shape["conversations"] // shape["groups"],
            "system_prompt_len": shape["system"], "question_len": shape["question"], "output_len": shape["output"],
            "seed": 0, "enable_multi_turn_chat": True}}
    else:
        config["data"] = {"type": "shareGPT", "path": str(sharegpt(out / "sharegpt.json", shape))}
    (out / "config.yml").write_text(json.dumps(config, indent=1))          # JSON is YAML too
    command = [str(load_tools.inference_perf()), "--config_file", str(out / "config.yml")]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=out)
    found = sorted((out / "reports").rglob("summary_lifecycle_metrics.json"))
    if not found:
        raise RuntimeError(f"inference-perf wrote no report (exit {ran.returncode}): {ran.stderr.strip()[-500:]}")
    r = json.loads(found[0].read_text())
    ok, failed = r["successes"], r["failures"]["count"]
    latency, tokens = ok["latency"], ok.get("prompt_tokens", {})
    return {"command": " ".join(command[1:]) + f"  ({data}; {load_tools.inference_perf_python_note()})",
            "exit": ran.returncode, "ok": ok["count"], "failed": failed,
            "ttft_p50_ms": 1000 * latency["time_to_first_token"]["median"],
            "ttft_p99_ms": 1000 * latency["time_to_first_token"]["p99"],
            "itl_p50_ms": 1000 * latency["inter_token_latency"]["median"],
            "output_tok_s": ok["throughput"]["output_tokens_per_sec"],
            "cached_share": tokens.get("cached", 0.0) / tokens["total"] if tokens.get("total") else 0.0,
            "token_count_mismatches": ok.get("token_count_mismatches", 0)}


def sharegpt(path: Path, shape: dict[str, Any]) -> Path:
    """Chats in ShareGPT's format: a human's turn, the model's, and so on."""
    words = CORPUS.split()
    chats = []
    for i in range(shape["conversations"]):
        turns = []
        for t in range(shape["turns"]):
            start = (97 * i + 31 * t) % (len(words) - 60)
            turns += [{"from": "human", "value": f"Question {t + 1} of chat {i}: " + " ".join(words[start:start + 40])},
                      {"from": "gpt", "value": " ".join(words[start + 40:start + 60])}]
        chats.append({"id": f"chat-{i}", "conversations": turns})
    path.write_text(json.dumps(chats))
    return path


def run_http_chat(url: str, shape: dict[str, Any]) -> dict[str, Any]:
    load = {"users": shape["concurrency"], "turns": shape["turns"], "think_s": 0.0, "max_tokens": shape["output"],
            "corpus": 1}
    run = asyncio.run(bench_http_chat.load("session", f"{url}/v1", load))
    s = bench_http_chat.summary(run)
    return {"command": "bench_http_chat.py's session load", "exit": 0,
            "ok": len(run.ttft_first) + len(run.ttft_later), "failed": 0,
            "ttft_p50_ms": 1000 * bench_http_chat.pct(run.ttft_first + run.ttft_later, 50),
            "ttft_p99_ms": 1000 * bench_http_chat.pct(run.ttft_first + run.ttft_later, 99),
            "itl_p50_ms": s["itl_p50_ms"], "output_tok_s": s["output_tok_s"],
            "cached_share": s["cached_share_later"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and load: checks the bench still runs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    shape = dict(QUICK if args.quick else FULL)
    try:
        load_tools.aiperf()
        load_tools.inference_perf()
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-load-tools-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny", **shape["model"])
        try:
            # --quick: kvroute alone (its workers are inferds), one start for every tool: it checks that
            # they all run through, not their figures.
            for name in ("kvroute",) if args.quick else TARGETS:
                with target(name, model_dir, work) as url:
                    runs[f"{name} aiperf"] = run_aiperf(url, model_dir, work / f"aiperf-{name}", shape)
                    runs[f"{name} bench_http_chat"] = run_http_chat(url, shape)
                    if args.quick:
                        for data in ("shared_prefix", "sharegpt"):
                            runs[f"{name} inference-perf {data}"] = run_inference_perf(
                                url, model_dir, work / f"inference-perf-{name}-{data}", shape, data)
                        continue
                # Fresh servers for each inference-perf run: it names its sessions the same every run
                # ("user_session_N"), and a second run's chats would continue the first's.
                for data in ("shared_prefix", "sharegpt"):
                    with target(name, model_dir, work) as url:
                        runs[f"{name} inference-perf {data}"] = run_inference_perf(
                            url, model_dir, work / f"inference-perf-{name}-{data}", shape, data)
        except (subprocess.SubprocessError, OSError, RuntimeError, KeyError) as exc:
            print(f"bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            print("--- daemons.log\n" + "".join((work / "daemons.log").read_text().splitlines(True)[-12:]),
                  file=sys.stderr)
            return 1
    failed = sum(r["failed"] for r in runs.values())
    if args.json:
        print(json.dumps({"shape": {k: v for k, v in shape.items() if k != "model"}, "runs": runs,
                          "failed": failed}, indent=2))
    else:
        rows = [["target / tool", "ok", "failed", "TTFT p50", "p99", "ITL p50", "output tok/s", "cached"]]
        for name, r in runs.items():
            rows.append([name, str(r["ok"]), str(r["failed"]), f"{r['ttft_p50_ms']:.1f} ms",
                         f"{r['ttft_p99_ms']:.1f} ms", f"{r['itl_p50_ms']:.1f} ms", f"{r['output_tok_s']:.0f}",
                         f"{100 * r['cached_share']:.0f}%"])
        print(table(rows))
        print("\ncommands:\n" + "\n".join(f"  {name}: {r['command']}" for name, r in runs.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
