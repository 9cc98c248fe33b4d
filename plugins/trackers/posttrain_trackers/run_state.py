"""Which tracker run a run directory logs to, and the last step it logged there.

A resumed run (``trainer.resume``) restarts after its checkpoint's step, but the run it resumes
may have logged steps after that checkpoint before it was killed. Trackers keep a run's history
append-only (W&B refuses a step below the run's last one; MLflow keeps every value it is sent
for a step), so the tracker run is continued under the same id and the steps it already holds
are not sent again: every step appears once. The record lives at ``RUN_DIR/trackers/NAME.json``
and is rewritten (atomically) after each step is sent.
"""

from __future__ import annotations

import json
import os


class RunState:
    def __init__(self, path: str, run_id: str | None, logged_through: int):
        self.path = path
        # None: a new tracker run (the run starts at step 0, or nothing was recorded).
        self.run_id = run_id
        self.logged_through = logged_through
        # What earlier runs sent: fixed when the run starts, so that this run may send one
        # step in several calls (its training metrics, then an evaluation's).
        self.sent_before = logged_through

    @classmethod
    def open(cls, run_dir: str, tracker: str, start_step: int) -> RunState:
        """The state to continue from: the recorded run and last step when the run resumes
        (``start_step`` > 0), a new run otherwise."""
        path = os.path.join(run_dir, "trackers", f"{tracker}.json")
        if start_step > 0 and os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
            return cls(path, record["run_id"], max(record["logged_through"], 0))
        return cls(path, None, 0)

    def is_logged(self, step: int) -> bool:
        """Whether the tracker run holds ``step`` from the run this one resumes."""
        return step <= self.sent_before

    def start(self, run_id: str) -> None:
        self.run_id = run_id
        self._write()

    def logged(self, step: int) -> None:
        self.logged_through = max(self.logged_through, step)
        self._write()

    def _write(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        record = {"run_id": self.run_id, "logged_through": self.logged_through}
        aside = f"{self.path}.tmp"
        with open(aside, "w") as f:
            json.dump(record, f)
        os.replace(aside, self.path)
