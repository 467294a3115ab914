"""Roles of text: *tuning* text calibrates and trains, *development* text chooses settings, *test* text is scored;
a recipe whose tuning or development text reads any part of a test text is refused."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aimet_quadapter.errors import QuadapterError

# tokens in a row that make two texts one: longer than the boilerplate distinct texts share, shorter than a copy
RUN = 128


@dataclass(frozen=True)
class TextUse:
    """One reading of a text: which role reads it, which tokens of which split of which source."""

    role: str  # "tuning", "development", or "test" (an evaluation text, the one checked against)
    what: str  # how an error message names this use, e.g. "calibration (train split of ptb)"
    source: str
    split: str
    tokens: torch.Tensor  # the whole split, as tokenized
    start: int = 0
    stop: int | None = None  # None: to the end

    @property
    def read(self) -> torch.Tensor:
        return self.tokens[self.start : self.stop]


def _hashes(tokens: torch.Tensor, n: int) -> np.ndarray:
    """A 64-bit polynomial hash of every run of ``n`` tokens (wrapping arithmetic)."""
    t = tokens.numpy().astype(np.uint64)
    count = len(t) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = np.zeros(count, dtype=np.uint64)
    prime = np.uint64(1_000_003)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * prime + t[k : k + count] + np.uint64(1)
    return h


def shared_run(a: torch.Tensor, b: torch.Tensor, n: int = RUN) -> int | None:
    """The first position in ``a`` where ``n`` tokens in a row also occur in ``b``; None if there is none."""
    ha, hb = _hashes(a, n), _hashes(b, n)
    if not len(ha) or not len(hb):
        return None
    hits = np.flatnonzero(np.isin(ha, hb))
    index = {int(h): i for i, h in enumerate(hb)} if len(hits) else {}
    for i in hits.tolist():  # a hash hit is confirmed token by token
        j = index[int(ha[i])]
        if torch.equal(a[i : i + n], b[j : j + n]):
            return i
    return None


def _same_text(a: TextUse, b: TextUse) -> bool:
    # a local text without split files is every split at once: compare what the splits hold, not their names
    return a.source == b.source and (a.split == b.split or torch.equal(a.tokens, b.tokens))


def _intersect(a: TextUse, b: TextUse) -> bool:
    a_stop = len(a.tokens) if a.stop is None else min(a.stop, len(a.tokens))
    b_stop = len(b.tokens) if b.stop is None else min(b.stop, len(b.tokens))
    return a.start < b_stop and b.start < a_stop


def check_roles(where: str, evaluated: list[TextUse], others: list[TextUse], n: int = RUN) -> None:
    """Refuse, in one line, any tuning or development text in ``others`` that reads tokens of an evaluated text."""
    for e in evaluated:
        for o in others:
            if _same_text(e, o):
                if _intersect(e, o):
                    raise QuadapterError(
                        f"{where}: {e.what}: also {o.role} text ({o.what}): a number on text a method was "
                        f"{'fitted to' if o.role == 'tuning' else 'chosen on'} says nothing about other text; "
                        + (
                            "evaluate another split or text"
                            if o.role == "tuning"
                            else "read another part of it (start, max_tokens) or another split or text"
                        )
                    )
                continue
            at = shared_run(e.read, o.read, n)
            if at is not None:
                raise QuadapterError(
                    f"{where}: {e.what}: {n} tokens in a row from its token {e.start + at} on are also "
                    f"{o.role} text ({o.what}): the same text in two places; evaluate text that no method tunes "
                    f"on and no setting is chosen on"
                )
