"""A JSONL file of one record per step, as a resumable run keeps it.

The run's history (``RUN_DIR/history.jsonl``, the driver's own) and the ``jsonl`` logger's
``metrics.jsonl`` are both step logs. A resumed run logs again the steps after its checkpoint, so
opening a log drops what an earlier run (a killed one) wrote beyond the step it starts after:
each step is in the file once.
"""

from __future__ import annotations

import json
import os


class StepLog:
    """``path``'s records with ``"step" <= start_step`` are kept, the rest dropped (a line cut
    short by a kill, and everything after it, too)."""

    def __init__(self, path: str, start_step: int = 0):
        self.path = path
        self.records = self._kept(start_step) if os.path.exists(path) else []
        self._rewrite()

    def _kept(self, step: int) -> list[dict]:
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    if record["step"] > step:
                        continue
                except (json.JSONDecodeError, KeyError, TypeError):
                    break
                kept.append(record)
        return kept

    def _rewrite(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.records)
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
