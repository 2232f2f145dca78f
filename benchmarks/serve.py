"""Serving benchmark: continuous batching (raysc serve -> vLLM, CPU build) against static batching
(Hugging Face transformers ``generate`` on padded batches), speculative decoding at batch 1 and 8,
and the replica's memory next to ``raysc plan --serve``.

1. The same exported model folder (the demo run's export, ``max_position_embeddings`` raised to
   ``--max-len`` in a copy: the demo model trained on 128 positions, its RoPE computes at any
   position, and throughput does not depend on what the tokens say) and the same ``--requests``
   seeded requests: prompt lengths uniform in 16-512 tokens, output lengths uniform in 8-256,
   greedy, end-of-sequence ignored so every request produces exactly its output length.
   - static: batches of ``--batch`` requests in arrival order, left-padded to the longest prompt,
     ``generate`` until the longest output of the batch (that is static batching: a batch is done
     when its last sequence is); only the requested tokens count as output.
   - continuous: the streaming ``openai`` client against ``raysc serve`` with at most ``--batch``
     requests in flight (the same concurrency), ``serve.max_num_seqs = --batch``; time to first
     token, inter-token latency per streamed chunk (Ray Serve's ingress forwards a stream in batches,
     so a client sees tokens in bursts: the per-chunk gaps are mostly ~0 with a long tail) and time per
     output token per request ((last - first token) / (tokens - 1)).
   Both sides get ``--threads`` threads: ``torch.set_num_threads`` for transformers; vLLM's CPU
   engine (VLLM_CPU_OMP_THREADS_BIND=auto) binds one OpenMP thread per core and keeps one core for
   its frontend (its log: ``reserve_cpu_num=1``, ``core ids=[0]`` on this 2-core machine), so
   ``--threads`` defaults to the machine's cores minus one to match.
2. Speculative decoding on the demo run itself (held-out prompts of 48 tokens, 64 new tokens):
   none, n-gram prompt lookup with k from ``runs/demo/serve_speculative.json``, and the draft run
   (``runs/draft``) with its tuned k, at batch 1 and 8; vLLM's reported acceptance when it logs one.
3. Memory: the RSS of the vLLM engine process of the continuous-batching replica and the KV-cache
   size vLLM logs, next to ``raysc.plan.serve_memory``'s prediction for the same settings.

``--random-model CONFIG [--model-set model.dim=512 ...]`` serves a random-weights model of that
config's shape instead of an export (raysc's own initialisation and a BPE of its vocabulary trained on
the bundled corpus; throughput does not depend on the weights), to see where batching pays on bigger
models. ``static_padding`` in the output: the token slots static batching computes per useful token
for this request mix (the most continuous batching can gain at equal concurrency when compute-bound).

Repetitions: ``--reps`` of each throughput measurement, the median reported. Prints JSON on its
last line. Run it under ``flock /tmp/raysc-ray.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs: prompts 16-512 tokens, outputs 8-256, seeded."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = rng.randint(16, 512), rng.randint(8, 256)
        out.append(([rng.randrange(1, vocab) for _ in range(p)], o))
    return out


def bench_folder(src: Path, dst: Path, max_len: int) -> Path:
    """A copy of the export ``src`` whose config allows ``max_len`` positions."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = max_len
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def random_model_folder(config: str, overrides: list[str], dst: Path, max_len: int) -> Path:
    """An HF folder of a raysc model with ``config``'s shape (plus ``overrides``) and random weights
    (raysc's own initialisation, no training: throughput does not depend on what the tokens say), and a
    BPE tokenizer of its vocabulary trained on 2 MB of the bundled corpus."""
    import torch

    from raysc.config import load_config
    from raysc.data.corpus import build_bundled_corpus
    from raysc.data.tokenizer import train_tokenizer
    from raysc.export.hf import export_hf
    from raysc.model.llama import build_model

    cfg = load_config(Path(config), overrides)
    texts = [json.loads(line)["text"] for line in build_bundled_corpus(dst.parent / "cache", 2.0).open()]
    tok = train_tokenizer(texts, cfg.model.vocab_size)
    tok.save(str(dst.parent / "tokenizer.json"))
    model = build_model(cfg.model, max_len, cfg.train.seed)
    export_hf(model, dst.parent / "tokenizer.json", dst, torch.float32)
    conf = json.loads((dst / "config.json").read_text())
    conf["max_position_embeddings"] = max_len
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    return dst


def static_padding(reqs: list, batch: int) -> dict:
    """Token slots static batching computes per useful token: prompts padded to the longest of their
    batch, every row decoded to the batch's longest output. In the compute-bound limit, continuous
    batching (no padding, a finished slot refilled at once) beats static by at most about this factor."""
    pre = dec = 0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        pre += len(chunk) * max(len(p) for p, _ in chunk)
        dec += len(chunk) * max(o for _, o in chunk)
    useful_pre, useful_dec = sum(len(p) for p, _ in reqs), sum(o for _, o in reqs)
    return {
        "prefill_slots_per_token": pre / useful_pre,
        "decode_slots_per_token": dec / useful_dec,
        "all_slots_per_token": (pre + dec) / (useful_pre + useful_dec),
    }


def static_batching(folder: Path, reqs: list, batch: int, threads: int) -> dict:
    """transformers ``generate``: padded batches of ``batch``, greedy, each batch to its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    useful = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, (p, _) in enumerate(chunk):  # left padding: every row's last prompt token at the end
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            new = max(o for _, o in chunk)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.shape[1] == width + new, out.shape
            useful += sum(o for _, o in chunk)
    wall = time.perf_counter() - t0
    return {"output_tokens": useful, "wall_s": wall, "tokens_per_s": useful / wall}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def _stream_all(url: str, model_id: str, reqs: list, concurrency: int) -> dict:
    """Every request through the streaming client, at most ``concurrency`` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    ttft, itl, tpot, tokens, errors = [], [], [], [0], []

    async def one(prompt: list[int], n: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            last, first, got = None, None, 0
            try:
                stream = await client.completions.create(
                    model=model_id,
                    prompt=prompt,
                    max_tokens=n,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices:  # one engine step's new tokens (several under speculation)
                        new = len(getattr(chunk.choices[0], "token_ids", None) or []) or 1
                        if last is None:
                            ttft.append(now - t0)
                            first = now
                        else:
                            itl.extend([(now - last) / new] * new)
                        last = now
                    if chunk.usage is not None:
                        got = chunk.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                errors.append(f"{type(e).__name__}: {e}"[:200])
            tokens[0] += got
            if first is not None and got > 1:  # time per output token after the first, per request
                tpot.append((last - first) / (got - 1))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in reqs))
    wall = time.perf_counter() - t0
    await client.close()
    return {
        "output_tokens": tokens[0],
        "wall_s": wall,
        "tokens_per_s": tokens[0] / wall,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5),
        "tpot_p99_s": _pct(tpot, 0.99),
    }


def continuous(url: str, model_id: str, reqs: list, concurrency: int) -> dict:
    return asyncio.run(_stream_all(url, model_id, reqs, concurrency))


def engine_memory() -> dict:
    """RSS of the vLLM engine-core process(es) (the model and the KV cache) and of the Serve replica
    actor that drives it, on this machine."""
    import psutil

    out = {"engine_rss_bytes": 0, "engine_pids": [], "replica_actor_rss_bytes": 0, "replica_actor_pids": []}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            text = (p.info["name"] or "") + " " + " ".join(p.info["cmdline"] or [])
            key = (
                "engine"
                if "EngineCore" in text
                else "replica_actor"
                if "ServeReplica" in text and "LLMServer" in text
                else None
            )
            if key:
                out[f"{key}_rss_bytes"] += p.memory_info().rss
                out[f"{key}_pids"].append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _session_logs() -> Path:
    try:
        import ray._private.worker as w

        return Path(w._global_node.get_session_dir_path()) / "logs"
    except Exception:  # noqa: BLE001 - Ray's private API moved: the default place
        return Path("/tmp/ray/session_latest/logs")


def logged_kv_cache(since: float) -> dict:
    """The KV-cache size the newest vLLM engine logged (Ray's session logs), in tokens and GiB if found."""
    logs = _session_logs()
    found: dict = {}
    for f in sorted(logs.rglob("*"), key=lambda f: f.stat().st_mtime if f.is_file() else 0):
        if not f.is_file() or f.stat().st_mtime < since or f.suffix not in (".out", ".err", ".log"):
            continue
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for m in re.finditer(r"KV cache size: ([\d,]+) tokens", text):
            found["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        for m in re.finditer(r"(?:Available KV cache memory|KV cache memory)[^\d]*([\d.]+) GiB", text):
            found["kv_cache_gib"] = float(m.group(1))
        for m in re.finditer(r"[Aa]cceptance rate: ([\d.]+)%", text):
            found["acceptance_rate_pct"] = float(m.group(1))
        for m in re.finditer(r"[Mm]ean acceptance length: ([\d.]+)", text):
            found["mean_acceptance_length"] = float(m.group(1))
    return found


def speculative(port: int, batches: list[int], n_new: int, spec_json: dict) -> dict:
    """none / n-gram / draft model on the demo run, held-out prompts, at each batch size."""
    from raysc.config import load_config
    from raysc.serve.command import deploy, settings, undeploy
    from raysc.serve.source import resolve
    from raysc.serve.spec_tune import held_out_prompts

    demo = str(ROOT / "runs/demo")
    # the run's export folder, not the run: a run with serve_speculative.json always speculates
    export = resolve(demo).path
    prompts = held_out_prompts(load_config(Path(demo) / "config.toml"), 16, 48).tolist()
    k_ngram = int(spec_json.get("candidates", {}).get("ngram", {}).get("num_speculative_tokens", 4))
    k_draft = int(spec_json.get("candidates", {}).get("draft_model", {}).get("num_speculative_tokens", 1))
    base = [f"serve.port={port}", f"serve.max_num_seqs={max(batches)}"]
    variants = {
        "none": (base + ["serve.num_speculative_tokens=0", 'serve.model_id="demo-none"'], None),
        "ngram": (
            base
            + [
                f"serve.num_speculative_tokens={k_ngram}",
                'serve.speculative_method="ngram"',
                'serve.model_id="demo-ngram"',
            ],
            None,
        ),
        "draft_model": (
            base
            + [
                f"serve.num_speculative_tokens={k_draft}",
                'serve.speculative_method="draft_model"',
                'serve.model_id="demo-draft"',
            ],
            str(ROOT / "runs/draft"),
        ),
    }
    out: dict = {
        "k": {"ngram": k_ngram, "draft_model": k_draft},
        "alpha_tuned": {m: c.get("alpha") for m, c in spec_json.get("candidates", {}).items()},
    }
    for name, (overrides, draft) in variants.items():
        since = time.time()
        try:
            dep = deploy(export, settings(demo, overrides), draft=draft)
        except Exception as e:  # noqa: BLE001 - the draft path may fail in vLLM CPU: report it
            out[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            print(json.dumps({name: out[name]}), flush=True)
            continue
        try:
            row: dict = {"speculative": dep.speculative}
            continuous(dep.url, dep.model_id, [(p, 8) for p in prompts[:2]], 2)  # warm-up
            for b in batches:
                reqs = [(p, n_new) for p in prompts[: max(4, 2 * b)]]
                row[f"batch_{b}"] = continuous(dep.url, dep.model_id, reqs, b)
            row["vllm_log"] = logged_kv_cache(since)
            out[name] = row
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        finally:
            undeploy(dep)
        print(json.dumps({name: out[name]}), flush=True)
    for b in batches:
        none = out.get("none", {}).get(f"batch_{b}", {}).get("tokens_per_s")
        for name in ("ngram", "draft_model"):
            got = out.get(name, {}).get(f"batch_{b}", {}).get("tokens_per_s")
            if none and got:
                out[name][f"speedup_batch_{b}"] = got / none
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="static batch size = client concurrency = max_num_seqs")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each throughput measurement (median)")
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="transformers' threads; default = the cores vLLM's engine binds (all but one)",
    )
    ap.add_argument("--max-len", type=int, default=768, help="serve.max_model_len (512 + 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8475)
    ap.add_argument("--export", default=str(ROOT / "runs/demo/hf"), help="the exported model folder to serve")
    ap.add_argument(
        "--random-model",
        metavar="CONFIG",
        help="instead of --export: a random-weights model of this config's shape (e.g. jobs/configs/small.toml)",
    )
    ap.add_argument(
        "--model-set",
        action="append",
        default=[],
        help="override of --random-model's config, e.g. model.dim=512 (repeatable)",
    )
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--skip-spec", action="store_true")
    ap.add_argument("--spec-batches", default="1,8")
    args = ap.parse_args()

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    work = Path(tempfile.mkdtemp(prefix="raysc-serve-bench-"))
    if args.random_model:
        folder = random_model_folder(args.random_model, args.model_set, work / "bench-model", args.max_len)
    else:
        folder = bench_folder(Path(args.export), work / "bench-model", args.max_len)
    conf = json.loads((folder / "config.json").read_text())
    from tokenizers import Tokenizer

    vocab = min(conf["vocab_size"], Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size())
    reqs = make_requests(args.requests, args.seed, vocab)
    params = os.path.getsize(folder / "model.safetensors") // 4  # fp32
    result: dict = {
        "requests": args.requests,
        "batch": args.batch,
        "threads": args.threads,
        "max_len": args.max_len,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": sum(o for _, o in reqs),
        "model": (f"random {args.random_model} {' '.join(args.model_set)}" if args.random_model else args.export),
        "params": params,
        "shape": {
            k: conf[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
            )
        },
        "static_padding": static_padding(reqs, args.batch),
        "machine": f"{os.cpu_count()} CPUs",
    }
    print(json.dumps({"setup": result}), flush=True)

    if not args.skip_static:
        reps = [static_batching(folder, reqs, args.batch, args.threads) for _ in range(args.reps)]
        result["static"] = sorted(reps, key=lambda r: r["tokens_per_s"])[len(reps) // 2]
        result["static"]["reps_tokens_per_s"] = [r["tokens_per_s"] for r in reps]
        print(json.dumps({"static": result["static"]}), flush=True)

    import ray

    from raysc.plan.serve_memory import serve_memory_from_hf
    from raysc.serve.command import deploy, settings, undeploy

    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        overrides = [
            f"serve.port={args.port}",
            f"serve.max_num_seqs={args.batch}",
            f"serve.max_model_len={args.max_len}",
            "serve.enable_prefix_caching=false",
        ]
        cfg = settings(str(folder), overrides)
        since = time.time()
        t0 = time.perf_counter()
        dep = deploy(str(folder), cfg)
        result["deploy_s"] = time.perf_counter() - t0
        try:
            continuous(dep.url, dep.model_id, reqs[:2], 2)  # warm-up
            reps = [continuous(dep.url, dep.model_id, reqs, args.batch) for _ in range(args.reps)]
            result["continuous"] = sorted(reps, key=lambda r: r["tokens_per_s"])[len(reps) // 2]
            result["continuous"]["reps_tokens_per_s"] = [r["tokens_per_s"] for r in reps]
            print(json.dumps({"continuous": result["continuous"]}), flush=True)
            mem = {**engine_memory(), **logged_kv_cache(since)}
            mem["plan"] = serve_memory_from_hf(json.loads((folder / "config.json").read_text()), dep.serve)
            result["memory"] = mem
            print(json.dumps({"memory": mem}), flush=True)
        finally:
            undeploy(dep)
        if "static" in result:
            result["ratio"] = result["continuous"]["tokens_per_s"] / result["static"]["tokens_per_s"]
        if not args.skip_spec:
            spec_path = ROOT / "runs/demo/serve_speculative.json"
            spec_json = json.loads(spec_path.read_text()) if spec_path.is_file() else {}
            batches = [int(b) for b in args.spec_batches.split(",")]
            result["speculative"] = speculative(args.port, batches, 64, spec_json)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
