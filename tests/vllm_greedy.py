"""vLLM's greedy continuations of some prompts for each Hugging Face folder, as JSON lines (one per folder:
its path, the prompt ids vLLM's tokenizer made, the generated ids). A script, not an import: vLLM must
start under ``__main__``. Its engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
several folders load one after the other without a new engine process, and a new import, each.

    python tests/vllm_greedy.py '["prompt", ...]' MAX_TOKENS DIR...
"""

from __future__ import annotations

import gc
import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
    for folder in sys.argv[3:]:
        llm = LLM(model=folder, enforce_eager=True, dtype="float32", max_model_len=128, seed=0)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        print(
            "RESULT "
            + json.dumps(
                {
                    "path": folder,
                    "prompt_ids": [list(o.prompt_token_ids) for o in outs],
                    "ids": [list(o.outputs[0].token_ids) for o in outs],
                }
            ),
            flush=True,
        )
        del llm
        gc.collect()
