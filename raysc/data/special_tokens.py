"""A tokenizer's special tokens as data: which id ends a document, which (if any) begins one, whether
the tokenizer adds it, which ids stop generation.

A raysc-trained tokenizer has one special token, ``<|endoftext|>`` at id 0, that ends documents and
nothing that begins them. A public checkpoint's tokenizer folder says its own: Llama 3 ends with
``<|end_of_text|>`` (128001) and begins with ``<|begin_of_text|>`` (128000), Llama 2 and Mistral with
``</s>`` (2) and ``<s>`` (1), Qwen2 ends with ``<|endoftext|>`` (151643) and adds no BOS, GPT-2 uses
``<|endoftext|>`` (50256) for both.

``read_special_tokens`` reads them the way transformers does, from the files beside ``tokenizer.json``:
``special_tokens_map.json`` over ``tokenizer_config.json`` for the token strings, then the model's
``config.json`` ids; ``generation_config.json``'s ``eos_token_id`` (an id or a list) adds stop ids;
whether BOS is added comes from ``tokenizer_config.json``'s ``add_bos_token``, else from what the
tokenizer's own post-processor does to a document. A folder with ``tokenizer.json`` alone falls back to
the end-of-text tokens public tokenizers use. Config keys (``data.eos_token``, ``data.bos_token``,
``data.add_bos``) override every file.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer

# what a tokenizer folder may hold beside tokenizer.json, copied as it came into the run and its exports
SIDECARS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# end-of-text and begin-of-text tokens of public tokenizers, in the order a bare tokenizer.json is searched:
# raysc's own and GPT-2/Qwen2/Phi-3, Llama 3, Llama 2/Mistral, Gemma
KNOWN_ENDS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
KNOWN_BEGINS = ("<|begin_of_text|>", "<s>", "<bos>")


class SpecialTokenError(ValueError):
    """The tokenizer (or the config's override) does not name a usable special token."""


@dataclass(frozen=True)
class SpecialTokens:
    eos: str
    eos_id: int
    bos: str | None = None
    bos_id: int | None = None
    add_bos: bool = False
    pad_id: int | None = None
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.add_bos and self.bos_id is None:
            raise SpecialTokenError(
                'add_bos is set but the tokenizer has no BOS token; set data.bos_token or data.add_bos = "false"'
            )

    @property
    def stops(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS first, then generation_config's others."""
        return (self.eos_id, *[i for i in self.stop_ids if i != self.eos_id])

    def begin(self, ids: list[int]) -> list[int]:
        """A prompt's ids as the run's documents begin: after BOS when the run packed with one."""
        return [self.bos_id, *ids] if self.add_bos else list(ids)

    def to_dict(self) -> dict:
        return {**asdict(self), "stop_ids": list(self.stops)}

    @classmethod
    def from_dict(cls, d: dict) -> SpecialTokens:
        return cls(**{**d, "stop_ids": tuple(d.get("stop_ids") or ())})


RAYSC = SpecialTokens(eos="<|endoftext|>", eos_id=0)  # a tokenizer raysc trained


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise SpecialTokenError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    return data if isinstance(data, dict) else {}


def _token(value) -> str | None:
    """A token as tokenizer_config.json / special_tokens_map.json write it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _id_of(tok: Tokenizer, token: str, what: str, source: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise SpecialTokenError(
            f"{source} names {what} {token!r}, which is not in the tokenizer's vocabulary; "
            f"fix {source} or set data.{what.lower()}_token to a token the tokenizer has"
        )
    return i


def _pick(
    tok: Tokenizer, what: str, override: str, files: list[tuple[str, dict]], model: dict, key: str
) -> tuple[str, int] | None:
    """(token, id) for ``what`` (EOS or BOS), in transformers' precedence."""
    if override:
        return override, _id_of(tok, override, what, f"data.{what.lower()}_token")
    for name, data in files:
        if key in data:  # an explicit null (Qwen2's bos_token) means "none": later files do not bring one back
            token = _token(data[key])
            return (token, _id_of(tok, token, what, name)) if token else None
    ids = _ids(model.get(f"{key}_id"))
    if ids and tok.id_to_token(ids[0]) is not None:
        return tok.id_to_token(ids[0]), ids[0]
    for token in KNOWN_ENDS if what == "EOS" else KNOWN_BEGINS:
        if tok.token_to_id(token) is not None:
            return token, tok.token_to_id(token)
    return None


def _adds_bos(tok: Tokenizer, bos_id: int) -> bool:
    """Whether the tokenizer's post-processor puts ``bos_id`` before a document."""
    ids = tok.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def read_special_tokens(
    tokenizer_json: str | Path,
    eos_token: str = "",
    bos_token: str = "",
    add_bos: str = "auto",
    tok: Tokenizer | None = None,
) -> SpecialTokens:
    """The special tokens of the tokenizer at ``tokenizer_json`` (its folder's other files read too);
    ``eos_token``/``bos_token``/``add_bos`` ("auto", "true", "false") override them."""
    path = Path(tokenizer_json)
    tok = tok or Tokenizer.from_file(str(path))
    # a folder's files belong to the tokenizer.json in it, not to another tokenizer file that sits there
    folder = path.parent if path.name == "tokenizer.json" else None

    def read(name: str) -> dict:
        return _json(folder / name) if folder else {}

    files = [(f, read(f)) for f in ("special_tokens_map.json", "tokenizer_config.json")]
    model, generation = read("config.json"), read("generation_config.json")
    eos = _pick(tok, "EOS", eos_token, files, model, "eos_token")
    if eos is None:
        raise SpecialTokenError(
            f"tokenizer {str(path)!r} has no end-of-text token: none is named in its folder's "
            f"special_tokens_map.json, tokenizer_config.json or config.json, and it has none of {list(KNOWN_ENDS)}. "
            f"raysc ends every document with one; set data.eos_token to the token that ends a document"
        )
    bos = _pick(tok, "BOS", bos_token, files, model, "bos_token")
    if add_bos == "auto":
        config_add = files[1][1].get("add_bos_token")
        adds = bool(config_add) if isinstance(config_add, bool) else bool(bos) and _adds_bos(tok, bos[1])
    else:
        adds = add_bos == "true"
    if adds and bos is None:
        raise SpecialTokenError(
            f'data.add_bos = "true" but tokenizer {str(path)!r} has no BOS token; set '
            f"data.bos_token to the token that begins a document"
        )
    pad = None
    for _, data in files:
        token = _token(data.get("pad_token"))
        if token and tok.token_to_id(token) is not None:
            pad = tok.token_to_id(token)
            break
    stops = [
        i
        for i in _ids(generation.get("eos_token_id")) + _ids(model.get("eos_token_id"))
        if tok.id_to_token(i) is not None
    ]
    return SpecialTokens(
        eos=eos[0],
        eos_id=eos[1],
        bos=bos[0] if bos else None,
        bos_id=bos[1] if bos else None,
        add_bos=adds,
        pad_id=pad,
        stop_ids=tuple(dict.fromkeys(stops)),
    )


def copy_tokenizer(tokenizer_json: str | Path, out_dir: str | Path) -> None:
    """``tokenizer.json`` and the files beside it that say its special tokens, copied as they came."""
    src, out = Path(tokenizer_json), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, out / "tokenizer.json")
    for name in SIDECARS if src.name == "tokenizer.json" else ():  # a folder's files belong to its tokenizer.json
        if (src.parent / name).is_file():
            shutil.copyfile(src.parent / name, out / name)


RUN_FILE = "special_tokens.json"  # in a run directory: the special tokens the run packed its data with


def write_special_tokens(run_dir: str | Path, special: SpecialTokens) -> None:
    (Path(run_dir) / RUN_FILE).write_text(json.dumps(special.to_dict(), indent=2))


def run_special_tokens(run_dir: str | Path) -> SpecialTokens:
    """The special tokens of the run at ``run_dir``."""
    return special_tokens_beside(Path(run_dir) / "tokenizer.json")


def special_tokens_beside(tokenizer_json: str | Path) -> SpecialTokens:
    """The special tokens a run recorded beside its ``tokenizer.json``; for any other tokenizer.json (or a
    run from before they were recorded) the tokenizer's own, read as a new run would."""
    recorded = Path(tokenizer_json).parent / RUN_FILE
    if Path(tokenizer_json).name == "tokenizer.json" and recorded.is_file():
        return SpecialTokens.from_dict(json.loads(recorded.read_text()))
    return read_special_tokens(tokenizer_json)
