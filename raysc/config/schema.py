"""Typed configuration sections for a raysc run.

Every key a user can set lives here (``[parallel]`` in ``parallel_schema.py``, ``[serve]`` in
``serve_schema.py``, ``[track]`` in ``track_schema.py``), declared with ``options.opt``: its default,
the values it allows and a one-line help text (``metadata``). ``raysc.config.load`` checks TOML files and ``--set`` overrides against these
declarations; the key names are the public contract of raysc, so rename nothing without a migration
note in docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raysc.config.faults import KINDS as FAULT_KINDS
from raysc.config.options import opt, opt_dict
from raysc.config.parallel_schema import ParallelConfig
from raysc.config.serve_schema import ServeConfig
from raysc.config.track_schema import TrackConfig


@dataclass
class ModelConfig:
    vocab_size: int = opt(2048, "tokenizer and embedding size", min=260)
    dim: int = opt(128, "hidden size", min=8)
    n_layers: int = opt(4, "transformer blocks", min=1)
    n_heads: int = opt(4, "query heads", min=1)
    n_kv_heads: int = opt(2, "key/value heads (grouped-query attention); must divide n_heads", min=1)
    attn_head_dim: int = opt(
        0,
        "size of one attention head; 0 = dim / n_heads. Set it for checkpoints whose "
        "heads are not dim / n_heads wide (Qwen3-0.6B: dim 1024, 16 heads of 128)",
        min=0,
        key="head_dim",
    )
    ffn_dim: int = opt(0, "SwiGLU hidden size; 0 = 8/3·dim rounded up to ffn_multiple_of", min=0)
    ffn_multiple_of: int = opt(32, "rounding for the automatic ffn_dim", min=1)
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", gt=0.0)
    rope_theta: float = opt(10000.0, "rotary embedding base", gt=0.0)
    rope_scaling: str = opt(
        "none",
        "rotary frequency scaling: none, or llama3 (Llama 3.1/3.2/3.3: long wavelengths "
        "divided by rope_factor, short ones kept, a smooth band between)",
        choices=["none", "llama3"],
    )
    rope_factor: float = opt(8.0, "llama3 rope scaling: the factor long wavelengths are stretched by", gt=0.0)
    rope_low_freq_factor: float = opt(
        1.0, "llama3 rope scaling: wavelengths above original_max_position / this are scaled", gt=0.0
    )
    rope_high_freq_factor: float = opt(
        4.0, "llama3 rope scaling: wavelengths below original_max_position / this are kept", gt=0.0
    )
    rope_original_max_position: int = opt(
        8192, "llama3 rope scaling: the context length the model was first trained at", min=1
    )
    tie_embeddings: bool = opt(False, "share the input embedding with the output projection")
    attention_bias: bool = opt(
        False,
        "biases on the q, k and v projections: the Qwen2 / Qwen2.5 architecture "
        "(exported as Qwen2ForCausalLM); false = Llama",
    )
    qk_norm: bool = opt(
        False,
        "an RMSNorm over each head's queries and keys before rotary: the Qwen3 architecture "
        "(exported as Qwen3ForCausalLM)",
    )
    max_seq_len: int = opt(0, "longest sequence the rotary table covers; 0 = train.seq_len", min=0)
    init_std: float = opt(0.02, "standard deviation of the weight initialisation", gt=0.0)
    mup: bool = opt(
        False,
        "maximal update parametrisation (μP, Tensor Programs V): hidden matrices get LR/m and "
        "init_std/sqrt(m), logits ×1/m, attention scores 1/head_dim, m = dim/mup_base_width; "
        "an LR tuned at the base width transfers to wider models (docs/scaling.md)",
    )
    mup_base_width: int = opt(
        0, "μP base width: the model.dim at which optim.lr and init_std were tuned; 0 = model.dim (multiplier 1)", min=0
    )
    init_from: str = opt(
        "",
        "continued pre-training: start from this Hugging Face Llama checkpoint (a directory "
        "or URL holding config.json and model.safetensors, or shards with "
        "model.safetensors.index.json) instead of a random init; its tokenizer.json becomes "
        "the run's tokenizer when data.tokenizer is empty; the optimizer starts fresh "
        "(`raysc train --init-from`)",
    )
    init_from_options: dict = opt_dict(
        "fsspec options for reading model.init_from when it is an object-store URL, "
        'passed as they are (s3fs: {endpoint_url = "http://...", key = "...", '
        'secret = "...", client_kwargs = {region_name = "..."}})'
    )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def mup_width_mult(self) -> float:
        """μP width multiplier m = dim / mup_base_width (1 when the base width is 0 = dim)."""
        return self.dim / (self.mup_base_width or self.dim)

    @property
    def hidden_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        raw = int(8 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((raw + m - 1) // m)


@dataclass
class OptimConfig:
    lr: float = opt(3e-3, "peak learning rate", gt=0.0)
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay on matrices", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=0.999999)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=0.999999)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0.0)
    clip_norm: float = opt(1.0, "clip the global gradient norm to this value; 0 disables", min=0.0)


@dataclass
class ScheduleConfig:
    warmup_steps: int = opt(20, "linear warmup from 0 to optim.lr", min=0)
    decay: str = opt("cosine", "shape after warmup", choices=["cosine", "linear", "constant"])
    min_lr_ratio: float = opt(0.1, "floor of the decay as a fraction of optim.lr", min=0.0, max=1.0)


@dataclass
class TrainConfig:
    steps: int = opt(300, "optimizer steps", min=1)
    seq_len: int = opt(128, "tokens per training sequence", min=2)
    global_batch: int = opt(16, "sequences per optimizer step (or set global_batch_tokens instead)", min=0)
    global_batch_tokens: int = opt(0, "tokens per optimizer step; must be a multiple of seq_len", min=0)
    micro_batch: int = opt(0, "sequences per forward pass on one worker; 0 = whole local batch", min=0)
    seed: int = opt(1234, "seeds the model init, the data order and every RNG", min=0)
    document_mask: bool = opt(
        False,
        "block-causal attention: a token attends only to earlier tokens of its own "
        "document (boundaries at the tokenizer's EOS in each packed row)",
    )
    document_positions: bool = opt(False, "with document_mask: rotary positions restart at 0 at each document")
    dtype: str = opt(
        "auto", "compute precision: auto = fp32 on cpu, bf16 autocast on cuda", choices=["auto", "fp32", "bf16"]
    )
    compile: bool = opt(
        False,
        "compile each transformer block with torch.compile (inductor) before the first "
        "step (raysc.train.compile): faster steps and less activation memory; the first "
        "step pays the compile (seconds on a GPU, ~30 s for a tiny model on 2 CPU cores)",
    )
    peak_flops: float = opt(0.0, "peak FLOP/s of one device for MFU; 0 = GPU table or measured CPU matmul", min=0.0)
    log_every: int = opt(10, "print a progress line every N steps", min=1)
    require_preflight: bool = opt(
        False, "refuse to start unless <run.dir>/preflight.json (raysc preflight) passed for this same config"
    )
    measure_memory: bool = opt(
        False,
        "report every rank's peak memory in the run summary (always on with CUDA: "
        "the allocator's peak; on CPU it samples glibc's heap every 2 ms)",
    )
    save_on_stop: bool = opt(
        True,
        "on SIGINT / SIGTERM to the driver (Ctrl-C, ray job stop): save a checkpoint of "
        "the step reached unless it is committed, then exit 130 / 143",
    )
    stop_timeout_s: float = opt(
        300.0,
        "longest graceful stop (finish the step, save, shut down); then the run is "
        "aborted, keeping the last committed checkpoint",
        gt=0.0,
    )

    @property
    def global_batch_sequences(self) -> int:
        if self.global_batch:
            return self.global_batch
        return self.global_batch_tokens // self.seq_len


@dataclass
class DataConfig:
    source: str = opt(
        "bundled",
        "'bundled' (Python stdlib corpus), a JSONL file / directory with a 'text' field "
        "(plain, .jsonl.gz or .jsonl.zst), a Megatron indexed dataset (PREFIX of "
        "PREFIX.bin + PREFIX.idx, with data.tokenizer), OLMo-style token files (.npy, "
        "a file or directory, with data.tokenizer), or the output of `raysc pack` (a directory or URL with index.json: per-domain "
        "token shards fed by the mixture loader)",
    )
    schedule: str = opt(
        "",
        "domain mixture by consumed tokens, 'TOKENS:domain=weight,...; TOKENS:...' (e.g. "
        "'0:prose=0.7,code=0.3; 2e6:prose=0.3,code=0.7'); needs a packed data.source; "
        "empty = one phase in the domains' natural proportions",
    )
    prefetch: int = opt(4, "global batches the mixture loader prepares ahead in a thread of each worker", min=1, max=64)
    storage_options: dict = opt_dict("fsspec options for reading data.source when it is an object-store URL")
    tokenizer: str = opt("", "path to an existing tokenizer.json; empty = train a byte-level BPE on the corpus")
    token_dtype: str = opt(
        "auto",
        "dtype of raw token files in data.source (OLMo / Dolma .npy memmaps have no "
        "header): auto = uint16 up to 65,536 tokens, else uint32 (OLMo's rule)",
        choices=["auto", "uint16", "uint32"],
    )
    eos_token: str = opt(
        "",
        "the token that ends every document (and stops generation); empty = the tokenizer's "
        "own, read from its folder (special_tokens_map.json, tokenizer_config.json, config.json)",
    )
    bos_token: str = opt("", "the token that begins a document; empty = the tokenizer's own, if it has one")
    add_bos: str = opt(
        "auto",
        "put the BOS token before every document: auto = as the tokenizer does (Llama 2 and "
        "3, Mistral: yes; Qwen2, GPT-2, raysc's own: no)",
        choices=["auto", "true", "false"],
    )
    tokenizer_sample_mb: float = opt(4.0, "megabytes of corpus text used to train the tokenizer", gt=0.0)
    max_corpus_mb: float = opt(6.0, "cap on the bundled corpus size in megabytes", gt=0.0)
    val_fraction: float = opt(0.01, "share of packed sequences held out for validation loss", min=0.0, max=0.5)
    cache_dir: str = opt(".cache/raysc", "where built corpora, tokenizers and token shards are cached")


@dataclass
class CheckpointConfig:
    uri: str = opt(
        "",
        "where checkpoints go: a path or fsspec URL (s3://bucket/prefix, gs://, file://); "
        "empty = <run.dir>/checkpoints",
    )
    every_steps: int = opt(
        0,
        "save every N steps and always at the end; 0 (or more than train.steps) = only "
        "at the end, and Young's interval is printed as advice",
        min=0,
    )
    keep_last: int = opt(2, "committed checkpoints kept (at least 2); older ones are deleted", min=2)
    keep_every_steps: int = opt(0, "also keep every checkpoint whose step is a multiple of this; 0 = none", min=0)
    async_save: bool = opt(True, "stage to CPU and upload in the background while training continues", key="async")
    storage_options: dict = opt_dict(
        'fsspec options for the store, e.g. {endpoint_url = "http://...", '
        'region_name = "us-east-1"}; AWS_* environment variables work too'
    )
    transfer_concurrency: int = opt(
        0,
        "parallel ranged GETs per checkpoint file read from an object store "
        "(uploads use the store's multipart parts); 0 = min(8, max(2, CPU cores))",
        min=0,
        max=64,
    )
    hot_copy: bool = opt(
        True,
        "keep the newest checkpoint in Ray's object store and reuse verified node-local "
        "copies for restores; false = every restore reads the durable store",
    )
    signing_key: str = opt(
        "",
        "HMAC-SHA256 key that signs every manifest; restores refuse unsigned or altered "
        "checkpoints before parsing them. Prefer the RAYSC_CHECKPOINT_KEY environment "
        "variable (never written to disk, manifests, events or logs); at least 16 "
        "characters, e.g. `openssl rand -hex 32`; empty = RAYSC_CHECKPOINT_KEY or unsigned",
        secret=True,
    )
    upload_retries: int = opt(3, "retries (with exponential backoff from 1 s) of a failed upload", min=0)
    mtbf_hours: float = opt(24.0, "mean time between failures assumed for Young's interval advice", gt=0.0)
    on_save_failure: str = opt(
        "continue",
        "when a save fails: continue training (a checkpoint_lagging event "
        "says how far behind the newest checkpoint is) until max_failed_saves "
        "in a row, or stop at the first failure",
        choices=["continue", "stop"],
    )
    max_failed_saves: int = opt(
        3,
        "failed saves in a row after which the run stops (continue policy); the "
        "committed checkpoints are kept and the run resumes with --resume",
        min=1,
    )
    capacity_gb: float = opt(
        0.0,
        "space the store may use (a bucket quota, a volume size); raysc preflight "
        "checks it holds keep_last + 1 checkpoints; 0 = free space of a local "
        "store, not checked for object stores",
        min=0.0,
    )


@dataclass
class SupervisorConfig:
    hang_timeout_s: float = opt(
        600.0,
        "treat the fleet as hung when no worker reports progress for this long "
        "(before calibration, and while saving or restoring; a fleet's start-up and setup are "
        "bounded by start_timeout_s instead)",
        gt=0.0,
    )
    start_timeout_s: float = opt(
        60.0,
        "fail when the worker placement group cannot be scheduled in time, or a "
        "worker process has not started within this long (a restart's fleet: "
        "timeout_factor × the run's measured fleet start, when that is more)",
        gt=0.0,
    )
    node_wait_s: float = opt(
        300.0,
        "after a node is lost, how long the restart waits for the fleet to fit again "
        "(on the surviving nodes, or on a replacement node joining) before the run fails",
        gt=0.0,
    )
    spike_policy: str = opt(
        "skip",
        "on a loss spike or a NaN/Inf loss or grad norm: skip the update on every "
        "rank, and after spike_patience spikes in a row accept the new loss level; "
        "rollback = skip, and after spike_patience flagged steps in a row restore "
        "the checkpoint before them and skip skip_batches batches (once per window: "
        "if they are flagged again, the skip rule applies); or off",
        choices=["skip", "rollback", "off"],
    )
    spike_patience: int = opt(
        3,
        "flagged steps in a row that trigger a rollback; under skip, the most loss-spike "
        "updates skipped in a row (the weights do not move meanwhile): the next step at "
        "that level is accepted and the window moves to it",
        min=1,
    )
    skip_batches: int = opt(200, "batches of data skipped after a rollback (PaLM skipped 200-500)", min=0)
    spike_window: int = opt(128, "steps in the rolling window the spike detector compares against", min=2)
    spike_sigma: float = opt(
        6.0,
        "flag a step whose loss is more than this many standard deviations above the "
        "window's mean (one-sided; the grad norm's z-score is reported, it never flags "
        "a finite step alone)",
        gt=0.0,
    )
    spike_min_history: int = opt(16, "accepted steps seen before loss spikes are judged (NaN/Inf always are)", min=2)
    max_restarts: int = opt(
        3,
        "restarts and rollbacks in a row (no chunk of training completing in between) "
        "before the run gives up; 0 = fail on the first error",
        min=0,
    )
    restart_backoff_s: float = opt(
        1.0, "the first restart is immediate; wait this long before the second, doubled for each further one", min=0.0
    )
    warm_spares: bool = opt(
        True,
        "keep one idle, warm replacement worker per rank (no resources of its own, "
        "in the rank's bundle) so a restart skips process start-up",
    )
    prepare_spares: bool = opt(
        True,
        "on CPU, the warm spares also join a process group of their own and build "
        "their shards ahead, so a restart only restores the checkpoint (MTTR ~1.1 s "
        "against ~2.7 s for the tiny benchmark model); each spare then holds its "
        "shard's parameters, a second copy in the node's memory. GPU spares stop at "
        "their imports (they get the failed worker's device when they take over)",
    )
    worker_pool_idle_s: float = opt(
        120.0,
        "CPU runs take their worker processes from the cluster's pool (past "
        "Python, Ray and torch imports: a run starts ~2 s sooner per rank on a "
        "busy node) and give them back at a clean end; an idle process is "
        "stopped after this many seconds (0 = every run starts its own)",
        min=0.0,
    )
    sdc_every_steps: int = opt(
        0,
        "compare parameter fingerprints across data-parallel replicas (dp_replicate > 1) every N steps; 0 = off",
        min=0,
    )
    timeout_factor: float = opt(
        4.0,
        "hang and process-group timeouts = this × the step and collective times "
        "measured in the first steps (with timeout_floor_s as the minimum); a later "
        "fleet's start bound = this × the run's measured fleet start",
        min=3.0,
        max=5.0,
    )
    calibrate_steps: int = opt(
        5, "steps (after the first) whose times calibrate the timeouts; 0 = keep hang_timeout_s", min=0
    )
    timeout_floor_s: float = opt(
        30.0,
        "smallest calibrated timeout (covers report batching, scheduling jitter and a shared machine's slow spells)",
        gt=0.0,
    )
    stress_s: float = opt(
        0.0,
        "after calibration, run collectives at full rate for this long under the "
        "calibrated timeout and record any timeout (0 = skip)",
        min=0.0,
    )
    inject: str = opt(
        "",
        "fault injection for drills and tests: comma-separated KIND@STEP[:RANK], "
        f"KIND one of {', '.join(FAULT_KINDS)} (e.g. 'kill@50:0')",
    )


@dataclass
class CurateConfig:
    input: str = opt(
        "bundled",
        "documents to curate: 'bundled' (the stdlib corpus), or a file, directory or glob "
        "of JSONL / Parquet / plain-text files, each plain or .gz / .zst, at any fsspec URI "
        "(s3://, file://)",
    )
    output: str = opt("", "where the curated Parquet and the report go (any fsspec URI); empty = <run.dir>/curated")
    text_field: str = opt("text", "field holding a document's text (JSONL and Parquet)")
    id_field: str = opt("id", "field with the input's document id, kept in the output; missing = a content hash")
    domain_field: str = opt("domain", "field naming the document's domain; missing = tagged by rules (code/prose)")
    url_field: str = opt(
        "url",
        "field with the document's source URL (FineWeb's url), kept in the output and the "
        "dropped documents; missing = ''",
    )
    storage_options: dict = opt_dict('fsspec options for input and output, e.g. {endpoint_url = "http://..."}')
    bad_samples: int = opt(20, "bad input records sampled into the report", min=0)


@dataclass
class DedupConfig:
    exact: bool = opt(True, "drop documents whose normalised text is identical (one survivor: the smallest id)")
    near: bool = opt(True, "drop near-duplicates found by MinHash-LSH (one survivor per cluster: the smallest id)")
    shingle: int = opt(5, "words per shingle", min=1)
    num_perm: int = opt(
        112,
        "MinHash values per signature (bins of one_permutation, hash functions of "
        "k_permutations); must equal bands × rows",
        min=1,
    )
    bands: int = opt(14, "LSH bands", min=1)
    rows: int = opt(8, "signature values per band", min=1)
    seed: int = opt(1, "seed of the MinHash hashing")
    minhash: str = opt(
        "one_permutation",
        "signature scheme: one_permutation (one hash per shingle into num_perm "
        "bins, empty bins densified) or k_permutations (num_perm hashes per "
        "shingle, as datasketch)",
        choices=["one_permutation", "k_permutations"],
    )
    threshold: float = opt(
        0.7,
        "a candidate pair from an LSH bucket is a duplicate when its signatures agree "
        "on at least this share of values (estimated Jaccard)",
        min=0.0,
        max=1.0,
    )
    max_rounds: int = opt(40, "rounds of the distributed connected-components search before giving up", min=1)


@dataclass
class QualityConfig:
    enabled: bool = opt(
        True,
        "apply the Gopher, C4 and FineWeb rules; false measures nothing (no q_* columns, "
        "the report says the histograms were skipped) unless a reference_run scores",
    )
    skip_domains: str = opt("code", "comma-separated domains judged by the repetition rules only")
    min_words: int = opt(50, "Gopher: fewest words", min=0)
    max_words: int = opt(100_000, "Gopher: most words", min=1)
    min_avg_word_len: float = opt(3.0, "Gopher: shortest mean word length", min=0.0)
    max_avg_word_len: float = opt(10.0, "Gopher: longest mean word length", min=0.0)
    max_symbol_word_ratio: float = opt(0.1, "Gopher: most '#' and ellipses per word", min=0.0)
    max_bullet_lines_ratio: float = opt(0.9, "Gopher: largest share of lines starting with a bullet", min=0.0)
    max_ellipsis_lines_ratio: float = opt(0.3, "Gopher: largest share of lines ending with an ellipsis", min=0.0)
    min_alpha_words_ratio: float = opt(0.8, "Gopher: smallest share of words with a letter", min=0.0)
    min_stop_words: int = opt(2, "Gopher: fewest English stop words (the, be, to, of, and, that, have, with)", min=0)
    max_dup_line_frac: float = opt(0.3, "Gopher repetition: largest share of duplicate lines", min=0.0)
    max_dup_para_frac: float = opt(0.3, "Gopher repetition: largest share of duplicate paragraphs", min=0.0)
    max_dup_line_char_frac: float = opt(
        0.2, "Gopher repetition: largest share of characters in duplicate lines", min=0.0
    )
    max_dup_para_char_frac: float = opt(
        0.2, "Gopher repetition: largest share of characters in duplicate paragraphs", min=0.0
    )
    top_ngram_max: str = opt(
        "2:0.20,3:0.18,4:0.16", "Gopher repetition: n:max share of characters in the most frequent n-gram"
    )
    dup_ngram_max: str = opt(
        "5:0.15,6:0.14,7:0.13,8:0.12,9:0.11,10:0.10", "Gopher repetition: n:max share of characters in repeated n-grams"
    )
    c4_min_sentences: int = opt(5, "C4: fewest sentences in the lines C4 keeps", min=0)
    c4_min_words_per_line: int = opt(3, "C4: a kept line has at least this many words", min=0)
    c4_max_word_len: int = opt(1000, "C4: a kept line has no longer word", min=1)
    fw_min_line_punct_ratio: float = opt(0.12, "FineWeb: smallest share of lines ending in punctuation", min=0.0)
    fw_max_short_line_ratio: float = opt(0.67, "FineWeb: largest share of short lines", min=0.0)
    fw_short_line_chars: int = opt(30, "FineWeb: a short line has at most this many characters", min=0)
    fw_max_dup_line_char_ratio: float = opt(0.01, "FineWeb: largest share of characters in duplicate lines", min=0.0)
    fw_max_newline_ratio: float = opt(0.3, "FineWeb: most newlines per word", min=0.0)
    reference_run: str = opt(
        "",
        "a raysc run directory (a model trained on text you trust) whose newest verified "
        "checkpoint scores every document's perplexity (CCNet's recipe: q_ppl and a "
        "head/middle/tail bucket per domain); empty = no model score",
    )
    score_tokens: int = opt(
        256, "tokens of each document the reference model scores, from its start (at most the model's context)", min=2
    )
    keep_top_percent: float = opt(
        100.0,
        "keep this percent of each domain's documents, the ones with the lowest "
        "reference perplexity; 100 = score only (needs quality.reference_run)",
        gt=0.0,
        max=100.0,
    )
    max_perplexity: float = opt(
        0.0,
        "drop documents whose reference perplexity is above this; 0 = no limit (needs quality.reference_run)",
        min=0.0,
    )
    score_actors: int = opt(1, "perplexity scorer actors, one reference model each (a Ray Data actor pool)", min=1)
    score_gpus: float = opt(0.0, "GPUs per scorer actor; 0 = score on CPU", min=0.0)


@dataclass
class RunConfig:
    name: str = opt("tiny", "run name; the default run directory is runs/<name>")
    dir: str = opt("", "run directory; empty = runs/<name>")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    curate: CurateConfig = field(default_factory=CurateConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    track: TrackConfig = field(default_factory=TrackConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.run.name}"

    @property
    def checkpoint_uri(self) -> str:
        return self.checkpoint.uri or f"{self.run_dir}/checkpoints"

    @property
    def rope_len(self) -> int:
        return self.model.max_seq_len or self.train.seq_len

    @property
    def curated_uri(self) -> str:
        """Where ``raysc curate`` writes and ``raysc pack`` reads: curate.output, or <run.dir>/curated."""
        return (self.curate.output or f"{self.run_dir}/curated").rstrip("/")

    @property
    def compute_dtype(self) -> str:
        """The precision train.dtype resolves to: 'bf16' (autocast) or 'fp32'; auto = bf16 on cuda only."""
        dtype = self.train.dtype
        return "bf16" if dtype == "bf16" or (dtype == "auto" and self.parallel.device == "cuda") else "fp32"


SECTIONS: tuple[str, ...] = tuple(Config.__dataclass_fields__)
