"""Rows of a per-sequence buffer, one for each running sequence: a compressed pool's open key groups
(coded.py), the recurrent layers' state slots (state_slots.py). A sequence takes a row the first time it runs and
gives it back when the pool releases it."""

from __future__ import annotations


class SequenceRows:
    def __init__(self, n: int, what: str):
        self.of: dict = {}                          # running sequence -> its row
        self.free = list(range(n - 1, -1, -1))      # row 0 is handed out first
        self.what = what                            # the buffer, named in the error when rows run out

    def __contains__(self, seq) -> bool:
        return seq in self.of

    def __getitem__(self, seq) -> int:
        return self.of[seq]

    def __len__(self) -> int:
        return len(self.of)

    def take(self, seqs) -> tuple[list[int], list[int]]:
        """Each sequence's row, and the rows newly taken by this call (their contents are stale)."""
        rows, taken = [], []
        for seq in seqs:
            if seq not in self.of:
                if not self.free:
                    raise RuntimeError(f"more running sequences than {self.what} (max_batch)")
                self.of[seq] = self.free.pop()
                taken.append(self.of[seq])
            rows.append(self.of[seq])
        return rows, taken

    def release(self, seq) -> None:
        row = self.of.pop(seq, None)
        if row is not None:
            self.free.append(row)
