"""Real public tokenizers for the tests: llama.cpp's vocabulary-only GGUF files (Llama 3, Llama 2, Qwen2,
GPT-2, from the llama-cpp-python sdist that `make dev` extracts under .cache/llama-vocab) made into Hugging
Face folders as those models ship them (``build_folders``, the ``hf_folders`` fixture in conftest.py), and
llama.cpp's expected token ids for each (its .inp/.out files). `make dev` runs this file to build the
folders before the suite; the fixture builds what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, processors

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT / ".cache" / "llama-vocab"

# what each model's repository ships beside tokenizer.json (Llama 3: no add_bos_token, its post-processor
# adds BOS; GPT-2: config.json only)
FOLDERS = {
    "llama-bpe": {
        "tokenizer_config.json": {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    },
    "llama-spm": {
        "tokenizer_config.json": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "tokenizer_class": "LlamaTokenizer",
        }
    },
    "qwen2": {
        "tokenizer_config.json": {
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "tokenizer_class": "Qwen2Tokenizer",
        },
        "generation_config.json": {"bos_token_id": 151643, "eos_token_id": 151643},
    },
    "gpt-2": {"config.json": {"bos_token_id": 50256, "eos_token_id": 50256, "model_type": "gpt2"}},
}
BYTE_LEVEL = ["llama-bpe", "qwen2", "gpt-2"]  # llama.cpp's gpt2 model; llama-spm is its llama (SentencePiece) one
# the repositories' tokenizer.json post-processors that add BOS (Llama 3's, and Llama 2's TemplateProcessing)
ADDS_BOS = {"llama-bpe": ("<|begin_of_text|>", 128000), "llama-spm": ("<s>", 1)}
LAYOUT = 2  # bump when what the folders hold changes: they are cached per transformers version and layout


def gguf_file(name: str) -> Path:
    path = VOCAB / f"ggml-vocab-{name}.gguf"
    assert path.is_file(), f"{path} is missing: `make dev` extracts llama.cpp's vocabulary files into {VOCAB}"
    return path


def metadata(path: Path) -> dict[str, str]:
    """A GGUF file's metadata as llama.cpp reads it (its C reader: gguf-py's takes seconds on 128k tokens)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return {**llm.metadata, "n_vocab": str(llm.n_vocab())}


def expected_ids(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer tests: each text of the .inp file with the ids of the .out file."""
    texts = gguf_file(name).with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = gguf_file(name).with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(i) for i in line.split()]) for t, line in zip(texts, ids)]


def convert(name: str, folder: Path) -> None:
    from transformers import AutoTokenizer

    tok: Tokenizer = AutoTokenizer.from_pretrained(str(VOCAB), gguf_file=gguf_file(name).name).backend_tokenizer
    # the converter's own template may add BOS; the repository's tokenizer.json says whether it does
    steps = [processors.ByteLevel(trim_offsets=False)] if name in BYTE_LEVEL else []
    if name in ADDS_BOS:  # Llama 3's and Llama 2's add their BOS in the post-processor
        bos, bos_id = ADDS_BOS[name]
        steps.append(
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
        )
    tok.post_processor = processors.Sequence(steps) if len(steps) > 1 else (steps[0] if steps else None)
    spec = json.loads(tok.to_str())
    # the converter adds special tokens the model never had (Llama 3 gains an <|endoftext|> at 128256)
    n = int(metadata(gguf_file(name))["n_vocab"])
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < n]
    if name == "llama-bpe":  # as Llama 3 ships it: a whole word in the vocabulary wins over the merges
        spec["model"]["ignore_merges"] = True
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


def build_folders() -> dict[str, Path]:
    """A Hugging Face tokenizer folder per family: tokenizer.json from the GGUF vocabulary (transformers'
    converter), beside the files its repository ships. Built once per transformers version under
    .cache/llama-vocab/hf (the conversion takes about a minute on 2 cores)."""
    import transformers

    root = VOCAB / "hf" / f"{transformers.__version__}-{LAYOUT}"
    out = {}
    for name, files in FOLDERS.items():
        folder = root / name
        if not (folder / "tokenizer.json").is_file():
            tmp = root / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            convert(name, tmp)
            for fname, data in files.items():
                (tmp / fname).write_text(json.dumps(data))
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        out[name] = folder
    return out


if __name__ == "__main__":  # `make dev`: build the folders once, outside the timed suite
    for name, folder in build_folders().items():
        print(f"{name}: {folder}")
