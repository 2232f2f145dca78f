"""``RunPreparation``: a run's steps before training, in the order the supervisor takes them.

Open the checkpoint store and claim it for this run, write ``config.toml``, reserve and spawn the
fleet's workers (an elastic run at the largest size the cluster holds), open the [track] trackers,
check ``model.init_from``, pack the data (the workers' processes start meanwhile), then set the
fleet up and restore the checkpoint a resumed run starts from. ``Supervisor`` holds one and takes
the checkpoint coordinator from it as soon as it exists, so that a failure after that salvages
its saves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ray

from raysc.config.load import config_hash, dump_config
from raysc.config.schema import Config
from raysc.data.prepare import prepare_data
from raysc.data.special_tokens import SpecialTokens, copy_tokenizer, write_special_tokens
from raysc.fleet.bookkeeping import Bookkeeping
from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.elastic import Elastic
from raysc.fleet.events import EventKind
from raysc.fleet.fleet import Fleet
from raysc.fleet.watch import Watch
from raysc.track.run_tracker import RunTracker, read_track_ids


class RunPreparation:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        resume: bool | str,
        overwrite: bool,
        book: Bookkeeping,
        fleet: Fleet,
        elastic: Elastic | None,
        watch: Watch,
    ) -> None:
        self.cfg, self.run_dir, self.resume, self.overwrite = cfg, run_dir, resume, overwrite
        self.book, self.fleet, self.elastic, self.watch = book, fleet, elastic, watch
        self.ckpt: CheckpointCoordinator | None = None

    def open_store(self) -> CheckpointCoordinator:
        """The run's checkpoint coordinator, which the hang watch polls for a save's failure."""
        self.ckpt = CheckpointCoordinator(self.cfg, self.book.event, self.watch.wait)
        self.watch.poll = self.ckpt.poll
        return self.ckpt

    def prepare(self) -> dict:
        """Claim the checkpoint store (``open_store``'s) for this run, reserve and spawn the workers, pack
        the data; the data's object refs."""
        self.ckpt.probe()
        # before anything in the run directory is written: a refused run leaves the other run's files alone
        self.ckpt.claim(self.resume, self.overwrite, self.run_dir)
        (self.run_dir / "config.toml").write_text(dump_config(self.cfg))
        # the workers' processes start (Python, Ray, torch: seconds) while the checkpoint to init from is
        # read and the data is packed; they are set up with the final config in ``start``
        self.book.phase = "starting workers"
        self._start_size()
        self.fleet.reserve()
        if self.elastic:
            self.elastic.request_growth()
        self.fleet.spawn()
        self._track()
        if self.cfg.model.init_from:
            self._init_from()
        self.book.phase = "preparing data"
        packed, tok_path, data_info = prepare_data(self.cfg, self._data_progress)
        # the tokenizer as it came (with the files beside it that name its special tokens) and the special
        # tokens this run packed with: exports, generation and serving read them from the run directory
        copy_tokenizer(tok_path, self.run_dir)
        write_special_tokens(self.run_dir, SpecialTokens.from_dict(data_info["special_tokens"]))
        self.book.event(
            EventKind.DATA_READY,
            **{
                k: data_info[k]
                for k in (
                    "tokens",
                    "documents",
                    "train_sequences",
                    "val_sequences",
                    "corpus_sha256",
                    "domains",
                    "schedule",
                )
                if k in data_info
            },
        )
        # the EOS id: with train.document_mask the ranks find document boundaries by it
        return {
            "train": ray.put(packed.train),
            "val": ray.put(packed.val),
            "eos_id": int(data_info["special_tokens"]["eos_id"]),
        }

    def _data_progress(self, message: str) -> None:
        """How tokenizing a plain-text corpus goes, in the run's phase (``raysc status``, the dashboard)."""
        self.book.phase = f"preparing data: {message}"

    def _start_size(self) -> None:
        """An elastic run starts with the largest allowed size the alive nodes hold (the configured
        one when none does yet: the fleet waits for nodes as a fixed one does)."""
        el = self.elastic
        size = el.largest_fitting() if el else None
        if size is not None and size < el.size:
            full = el.size
            el.resize(size)
            self.book.event(
                EventKind.RESIZED,
                dim=el.dim,
                **{"from": full, "to": size},
                world_size=el.world(size),
                why=f"the cluster holds {el.world(size)} of the configured {el.world(full)} workers at the start",
                seconds=0.0,
                steps_lost=0,
                note="grows at a checkpoint boundary once its growth request is placed",
            )

    def _track(self) -> None:
        """Open the [track] trackers: a resumed run continues the tracker runs recorded in the run
        directory (or, resumed into a new one, in the checkpoint's manifest); a fresh run starts new."""
        if not (self.cfg.track.tensorboard or self.cfg.track.mlflow_uri or self.cfg.track.wandb_project):
            return
        ids = (read_track_ids(self.run_dir) or self.ckpt.tracker_ids(self.resume)) if self.resume else {}
        self.book.tracker = RunTracker(self.cfg, self.run_dir, self.book.event, ids)
        self.ckpt.trackers = self.book.tracker.ids
        self.book.tracker.start(self.ckpt.run_id, config_hash(self.cfg))

    def _init_from(self) -> None:
        """Check ``model.init_from`` against the config before any worker starts, take its tokenizer when
        ``data.tokenizer`` is empty, and record the checkpoint's content hash (workers read it themselves)."""
        from raysc.model.hf_checkpoint import check_init_from, content_sha256  # (torch: only when used)
        from raysc.model.hf_fetch import init_dir

        m = self.cfg.model
        local = init_dir(m.init_from, m.init_from_options, self.cfg.data.cache_dir)
        info = check_init_from(local, m)
        took = bool(info["tokenizer"]) and not self.cfg.data.tokenizer
        if took:
            self.cfg.data.tokenizer = info["tokenizer"]
        self.book.event(
            EventKind.INIT_FROM,
            source=m.init_from,
            sha256=content_sha256(local),
            tensors=info["tensors"],
            bytes=info["bytes"],
            tokenizer=info["tokenizer"] if took else None,
            note="weights from the checkpoint, optimizer and schedule fresh",
        )

    def start(self, data: dict, touch: Callable[[], None]) -> int:
        """Set up the fleet ``prepare`` spawned; the step it starts from (a resumed checkpoint's, else 0)."""
        self.book.phase = "starting workers"
        self.fleet.start(data, self.watch.wait, touch)
        self.ckpt.workers = self.fleet.workers
        return self.ckpt.restore(self.resume) if self.resume else 0
