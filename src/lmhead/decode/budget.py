"""How many prompt columns the next piece of a joining prompt takes while other rows decode (`PrefillBudget`)."""

from __future__ import annotations

import math

# chunked prefill while rows decode (`PrefillBudget`): a piece costs at most this share of their decode round, so
# a round with a piece costs at most (1 + share)× one without
PIECE_SHARE = 1.0
PIECE_UNIT = 8  # positions (rows × columns) a piece is a multiple of: the coded product's passes of 8 query rows
ROUNDS_KEPT = 5  # the decode rounds whose median is "a round"


class PrefillBudget:
    """How many prompt columns the next piece of a joining prompt takes while other rows decode: chunked prefill
    under a per-round budget, as vLLM's `max_num_batched_tokens`, in time rather than tokens.

        note_round(s)            a decode round of the running rows took s seconds (`Batch.step`)
        note_piece(s, n)         a piece of n positions (rows × columns) took s seconds (`Batch.prefill`)
        columns(rows, most)      → the next piece's columns: as many as PIECE_SHARE × the median of the last
                                 ROUNDS_KEPT rounds, at the seconds per position of the last piece, allow; a
                                 multiple of PIECE_UNIT positions, at least one unit, at most `most` positions
                                 (rounded down to a unit) and at most twice the last piece

    Both rates come from this process (its machine, its load, the model, the context the piece attends over),
    and the last piece's rate is the freshest for the next one, whose context is a piece longer. A piece of
    few positions costs more per position (each reads every weight once), so sizing from a small one errs
    small; the doubling bound keeps a piece from outgrowing its measurement. The first piece of a join is one
    unit.

    Why multiples of PIECE_UNIT at most `most` (`LeanBody.CODED_MAX_ROWS`): the coded step computes each
    position's numbers the same way in every pass of 8 query rows, so pieces of any such sizes give the same
    cache, bit for bit — the joined row's tokens and logprobs do not depend on the timings that sized its
    pieces.
    """

    def __init__(self) -> None:
        self.rounds: list[float] = []
        self.rate: float | None = None  # seconds per position of the last piece
        self.last = 0  # the last piece's columns (0: none yet in this join)

    def start(self) -> None:
        """A new join: its first piece is one unit again."""
        self.last, self.rate = 0, None

    def note_round(self, seconds: float) -> None:
        self.rounds = [*self.rounds[1 - ROUNDS_KEPT:], seconds]

    def note_piece(self, seconds: float, positions: int, columns: int) -> None:
        self.rate, self.last = seconds / max(positions, 1), columns

    def columns(self, rows: int, most: int) -> int:
        """The next piece's columns for `rows` joining rows (see the class docstring)."""
        if rows < 1 or most < 1:
            raise ValueError(f"rows and most must be ≥ 1, got {rows} and {most}")
        unit = PIECE_UNIT // math.gcd(rows, PIECE_UNIT)  # columns: rows × unit is a multiple of PIECE_UNIT
        cap = max(unit, most // (rows * unit) * unit)
        if self.rate is None or not self.rounds or not self.last:
            return unit
        budget = PIECE_SHARE * sorted(self.rounds)[len(self.rounds) // 2]
        want = int(budget / max(self.rate, 1e-12) / rows) // unit * unit
        return max(unit, min(want, cap, 2 * self.last))
