"""What a rank raises for the supervisor to act on, importable without torch (the supervisor
process does not import it): ``SilentCorruption`` (``raysc.train.sdc`` raises it). A loss spike's
``SpikeRollback`` lives with its detector in ``raysc.train.stability``, which is torch-free too."""

from __future__ import annotations


class SilentCorruption(RuntimeError):
    """Replicas of the same parameters disagree at ``step`` (raised on every rank alike)."""

    def __init__(self, step: int, evidence: dict) -> None:
        super().__init__(f"parameter fingerprints of data-parallel replicas disagree at step {step}: {evidence}")
        self.step, self.evidence = step, evidence

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return (SilentCorruption, (self.step, self.evidence))
