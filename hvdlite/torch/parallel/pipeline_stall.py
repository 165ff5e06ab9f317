"""Stall diagnostics for pipelines: what a waiting stage is waiting for, where it is in its
program, and the warnings and timeout errors that name the message."""
from __future__ import annotations


from ...common import basics as _basics
from .pipeline_values import _ACT, PipelineTimeoutError, log


class _StallDiagnostics:
    """Warnings and timeout errors while a stage waits (a mixin of `Pipeline`)."""

    @staticmethod
    def _describe_items(items) -> str:
        return ", ".join("the activation" if x == _ACT else f"skip {x!r}" for x in items)

    def _where(self, program, idx: int) -> str:
        nxt = next((w for k, w in program[idx:] if k == "compute"), None)
        done = sum(1 for k, _ in program[:idx] if k == "compute")
        total = sum(1 for k, _ in program if k == "compute")
        return (f"after {done} of {total} actions of its {self.schedule_name} schedule"
                + (f", before {nxt}" if nxt is not None else ""))

    def _wait_text(self, msg, waited: float, program, idx: int) -> str:
        what = "activations" if msg.kind == "F" else "gradients"
        return (f"pipeline stage {self.stage} (rank {_basics.rank()}) has waited {waited:.1f} s "
                f"for message '{self._msg_name(msg)}': the {what} of micro-batch {msg.mb} from "
                f"stage {msg.src} (rank {self.stage_ranks[msg.src]}), "
                f"{self._where(program, idx)}")

    def _warner(self, msg, program, idx):
        def warn(waited: float) -> None:
            log.warning("%s. Is that stage running the same schedule, or stuck itself?",
                        self._wait_text(msg, waited, program, idx))
        return warn

    def _timeouter(self, msg, program, idx):
        def make(waited: float) -> Exception:
            return PipelineTimeoutError(self._wait_text(msg, waited, program, idx)
                                        + f"; giving up after the {self.timeout:g} s timeout")
        return make

    def _send_warner(self, sh):
        def warn(waited: float) -> None:
            log.warning("pipeline stage %d (rank %d) has waited %.1f s for rank %d to receive "
                        "message '%s'", self.stage, _basics.rank(), waited, sh.dst, sh.name)
        return warn

    def _send_timeouter(self, sh):
        def make(waited: float) -> Exception:
            return PipelineTimeoutError(
                f"pipeline stage {self.stage} (rank {_basics.rank()}): rank {sh.dst} did not "
                f"receive message '{sh.name}' within {self.timeout:g} s")
        return make

    # ------------------------------------------------------------------ compute
