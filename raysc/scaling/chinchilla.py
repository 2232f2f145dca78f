"""The Chinchilla compute-optimal split (Hoffmann et al. 2022) and model shapes near a parameter count.

Rule of thumb from the paper's approaches 1 and 2: training compute C ≈ 6·N·D
FLOPs and, at the optimum, D ≈ 20·N tokens, so N = sqrt(C/120) and D = 20·N;
N counts all parameters, embeddings included (as Hoffmann et al. did). The
parametric loss L(N, D) = E + A/N^α + B/D^β (approach 3) is reported with two
published fits, both approximate: its constants depend on the data and the
tokenizer. Shapes are exact raysc parameter counts (``raysc.model.flops``) on a
grid of Llama shapes. Written here because it is a few formulas over our own
``ModelConfig``; no library computes shapes for our model.
"""

from __future__ import annotations

import dataclasses
import math
import re

from raysc.config.schema import ModelConfig
from raysc.model.flops import flops_per_token, param_count

TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022, Table 3: about 20 tokens per parameter at every scale
FLOPS_PER_PARAM_TOKEN = 6.0  # forward + backward matmuls (Kaplan et al. 2020)
ASPECT_BAND = (32.0, 128.0)  # dim / n_layers of well-performing shapes (Kaplan et al. 2020; Levine et al. 2020)


@dataclasses.dataclass(frozen=True)
class LossFit:
    """L(N, D) = E + A/N^alpha + B/D^beta, N parameters, D training tokens, loss in nats/token."""

    name: str
    source: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n_params: float, n_tokens: float) -> float:
        return self.E + self.A / n_params**self.alpha + self.B / n_tokens**self.beta


FITS: tuple[LossFit, ...] = (
    LossFit(
        "hoffmann2022",
        "Hoffmann et al. 2022, approach 3 (eq. 10), MassiveText + SentencePiece",
        E=1.69,
        A=406.4,
        B=410.7,
        alpha=0.34,
        beta=0.28,
    ),
    LossFit(
        "besiroglu2024",
        "Besiroglu et al. 2024 replication of approach 3 on the same data points",
        E=1.82,
        A=482.0,
        B=2085.4,
        alpha=0.3478,
        beta=0.3658,
    ),
)

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtTpP]?)\s*$")


def parse_count(text: str | float | int, what: str = "value") -> float:
    """A positive count like ``1.3e9``, ``7B``, ``350M``, ``1.4T``, ``1e21``; ValueError naming ``what``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _NUMBER.match(str(text))
        if not m:
            raise ValueError(f"{what}: {text!r} is not a number (examples: 1.3e9, 7B, 350M, 1.4T, 1e21)")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: {text!r} must be a positive, finite number")
    return value


def compute_optimal(params: float | None = None, compute: float | None = None, tokens: float | None = None) -> dict:
    """The Chinchilla split from exactly one of N (parameters), C (FLOPs) or D (tokens)."""
    given = {k: v for k, v in (("params", params), ("compute", compute), ("tokens", tokens)) if v is not None}
    if len(given) != 1:
        raise ValueError(f"give exactly one of params, compute or tokens (got {sorted(given) or 'none'})")
    ((what, value),) = given.items()
    value = parse_count(value, what)
    ratio = TOKENS_PER_PARAM * FLOPS_PER_PARAM_TOKEN  # C = 6·N·(20·N) = 120·N²
    n = {"params": value, "compute": math.sqrt(value / ratio), "tokens": value / TOKENS_PER_PARAM}[what]
    d = TOKENS_PER_PARAM * n
    return {
        "given": what,
        "params": n,
        "tokens": d,
        "compute": FLOPS_PER_PARAM_TOKEN * n * d,
        "tokens_per_param": TOKENS_PER_PARAM,
    }


def loss_estimates(n_params: float, n_tokens: float) -> dict[str, dict]:
    """L(N, D) under each published fit (approximate: other data and tokenizers shift the constants)."""
    return {
        f.name: {
            "loss": f.loss(n_params, n_tokens),
            "source": f.source,
            "E": f.E,
            "A": f.A,
            "B": f.B,
            "alpha": f.alpha,
            "beta": f.beta,
        }
        for f in FITS
    }


def shape_config(base: ModelConfig, n_layers: int, dim: int, head_dim: int) -> ModelConfig:
    """``base`` (vocab, GQA ratio, norms, tying) at a new shape; ffn_dim automatic (8/3·dim)."""
    n_heads = dim // head_dim
    groups = max(1, base.n_heads // base.n_kv_heads)
    n_kv = n_heads // groups if n_heads % groups == 0 else n_heads
    return dataclasses.replace(base, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=0)


def suggest_shapes(
    n_params: float,
    base: ModelConfig | None = None,
    k: int = 5,
    aspect: tuple[float, float] = ASPECT_BAND,
    tolerance: float = 0.02,
    max_diff: float = 0.10,
) -> list[dict]:
    """Up to ``k`` Llama shapes with exact parameter counts near ``n_params``, spread over the aspect band.

    Grid: dim a multiple of 128 (64 below 100M parameters), head_dim 128 from
    dim 2048 on and 64 below, dim/n_layers inside ``aspect``; vocabulary, tying
    and GQA ratio from ``base`` (n_heads a multiple of its heads per KV head
    wherever some shape allows it). The aspect band is cut into ``k`` bins
    (equal in log scale) and each bin offers its closest shape, preferring among
    those within ``tolerance`` of that count the "roundest" dim (largest
    power-of-two factor); the result is sorted by distance to ``n_params``, and
    shapes more than ``max_diff`` away are dropped while at least 3 remain.
    """
    base = base or ModelConfig()
    n_params = parse_count(n_params, "params")
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one shape")
    step = 64 if n_params < 1e8 else 128
    emb = base.vocab_size * (1 if base.tie_embeddings else 2)
    groups = max(1, base.n_heads // base.n_kv_heads)
    # per layer ≈ (2 + 2/groups)·d² attention + 8·d² SwiGLU; look far enough around the estimate to
    # meet dims whose head count the GQA ratio divides (every groups·head_dim/step steps)
    coeff, reach = 10.0 + 2.0 / groups, 2 + groups * 128 // step
    cands: dict[tuple[int, int], dict] = {}
    for n_layers in range(1, 513):
        per_layer = coeff * n_layers
        d_est = (-emb + math.sqrt(emb * emb + 4 * per_layer * n_params)) / (2 * per_layer)
        centre = round(d_est / step)
        for j in range(centre - reach, centre + reach + 1):
            dim = j * step
            if dim < 64 or not aspect[0] <= dim / n_layers <= aspect[1]:
                continue
            head_dim = 128 if dim >= 2048 else 64
            cfg = shape_config(base, n_layers, dim, head_dim)
            counts = param_count(cfg)
            cands[(n_layers, dim)] = {
                "n_layers": n_layers,
                "dim": dim,
                "n_heads": cfg.n_heads,
                "n_kv_heads": cfg.n_kv_heads,
                "head_dim": head_dim,
                "ffn_dim": cfg.hidden_ffn_dim,
                "aspect": dim / n_layers,
                "params": counts["total"],
                "non_embedding": counts["non_embedding"],
                "rel_diff": counts["total"] / n_params - 1.0,
            }

    keep_gqa = [s for s in cands.values() if s["n_heads"] % groups == 0]
    pool = keep_gqa or list(cands.values())

    def dist(s: dict) -> float:
        return abs(math.log1p(s["rel_diff"]))

    lo, hi = math.log(aspect[0]), math.log(aspect[1])
    bins: list[list[dict]] = [[] for _ in range(k)]
    for s in pool:
        bins[min(k - 1, int((math.log(s["aspect"]) - lo) / (hi - lo) * k))].append(s)
    picks = []
    for group in bins:
        if group:
            best = min(dist(s) for s in group)
            near = [s for s in group if dist(s) <= best + tolerance]
            picks.append(max(near, key=lambda s: (s["dim"] & -s["dim"], -dist(s))))
    picks.sort(key=dist)
    near_n = [s for s in picks if abs(s["rel_diff"]) <= max_diff]
    return near_n if len(near_n) >= 3 else picks[:3]


def plan(
    params: float | None = None,
    compute: float | None = None,
    tokens: float | None = None,
    model: ModelConfig | None = None,
    global_batch_tokens: float | None = None,
    seq_len: int = 0,
    n_shapes: int = 5,
) -> dict:
    """Compute-optimal N, D, C; L(N, D) under both fits; shapes near N; steps for a global batch.

    Each shape also gets its own 20·N token budget, its steps and its exact
    training compute 6N + 12·L·H·Q·T FLOPs per token (``seq_len`` > 0).
    """
    base = model or ModelConfig()
    opt = compute_optimal(params, compute, tokens)
    batch = parse_count(global_batch_tokens, "global_batch_tokens") if global_batch_tokens is not None else None
    shapes = suggest_shapes(opt["params"], base, n_shapes)
    for s in shapes:
        s["tokens"] = TOKENS_PER_PARAM * s["params"]
        if batch:
            s["steps"] = math.ceil(s["tokens"] / batch)
        if seq_len:
            cfg = shape_config(base, s["n_layers"], s["dim"], s["head_dim"])
            s["compute_exact"] = flops_per_token(cfg, seq_len) * s["tokens"]
    return {
        **opt,
        "global_batch_tokens": batch,
        "steps": math.ceil(opt["tokens"] / batch) if batch else None,
        "seq_len": seq_len or None,
        "vocab_size": base.vocab_size,
        "loss": loss_estimates(opt["params"], opt["tokens"]),
        "shapes": shapes,
        "notes": [
            "N = sqrt(C/120), D = 20·N, C = 6·N·D (Hoffmann et al. 2022 approaches 1-2); N counts embeddings",
            "loss fits are approximate: constants depend on data and tokenizer; compare trends, not absolutes",
            "for dense decoder-only models trained for one epoch; deliberately over-train (D >> 20N) when "
            "inference cost matters (e.g. Llama 3: ~1,900 tokens/param at 8B)",
        ],
    }


def _si(x: float) -> str:
    """``x`` with a unit, rounded to 3 significant digits before the unit is picked (999.6e6 -> 1B)."""
    x = float(f"{x:.3g}")
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_plan(p: dict) -> str:
    """A readable rendering of ``plan(...)``."""
    lines = [
        f"Chinchilla compute-optimal split (given {p['given']}):",
        f"  params N  {_si(p['params']):>10}   ({p['params']:.4g})",
        f"  tokens D  {_si(p['tokens']):>10}   ({p['tokens']:.4g}, {p['tokens_per_param']:g} tokens/param)",
        f"  compute C {p['compute']:>10.3g}   FLOPs (6·N·D)",
    ]
    if p["steps"]:
        lines.append(f"  steps     {p['steps']:>10,}   at {_si(p['global_batch_tokens'])} tokens per step")
    lines.append("")
    lines.append("Loss L(N, D) = E + A/N^α + B/D^β (approximate; nats/token on the fit's data):")
    for name, f in p["loss"].items():
        lines.append(
            f"  {f['loss']:.3f}  {name}: E={f['E']} A={f['A']} B={f['B']} α={f['alpha']} β={f['beta']}  ({f['source']})"
        )
    lines.append("")
    lines.append(f"Shapes near N (vocab {p['vocab_size']}, ffn 8/3·dim):")
    head = (
        f"  {'layers':>6} {'dim':>6} {'heads':>5} {'kv':>4} {'hd':>4} {'ffn':>6} {'dim/L':>6} "
        f"{'params':>8} {'diff':>7} {'tokens':>8}"
    )
    if p["steps"]:
        head += f" {'steps':>10}"
    if p["seq_len"]:
        head += f" {'C exact':>9}"
    lines.append(head)
    for s in p["shapes"]:
        row = (
            f"  {s['n_layers']:>6} {s['dim']:>6} {s['n_heads']:>5} {s['n_kv_heads']:>4} {s['head_dim']:>4} "
            f"{s['ffn_dim']:>6} {s['aspect']:>6.1f} {_si(s['params']):>8} {s['rel_diff']:>+7.1%} "
            f"{_si(s['tokens']):>8}"
        )
        if p["steps"]:
            row += f" {s['steps']:>10,}"
        if p["seq_len"]:
            row += f" {s['compute_exact']:>9.3g}"
        lines.append(row)
    if p["seq_len"]:
        lines.append(f"  (C exact = (6N + 12·L·H·Q·T)·20N FLOPs at T = {p['seq_len']}, without the embedding lookup)")
    lines.append("")
    lines.extend(f"note: {n}" for n in p["notes"])
    return "\n".join(lines)
