"""What a row of seq_len tokens keeps of each record, and what the loss then learns from it.

A record (one document of a token store) longer than seq_len, under packing "documents" or
"padded", becomes by [data] long_records:

    keep_answer  (the default) its last seq_len tokens, so that its learned tokens (the
                 assistant turns, the completion) stay whole and the prompt loses its beginning;
                 when the learned part alone is longer than a row, the row starts seq_len / 2
                 tokens before its first learned token and the record's end is cut
    truncate     its first seq_len tokens (the end is cut, answer included)
    drop         nothing: the record is left out
    split        (plain text, always) pieces of seq_len tokens

Learned tokens are counted as the loss sees them: after this cut and after packing, where the
first token of a row or of a document in a row is never learned (nothing before it in the row
predicts it). `learning()` counts per record what it kept and what it lost, so a run can say
what it will learn before its first step, refuse when that is nothing, and name the seq_len
that would keep the records whole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

WARN_SHARE = 0.05   # more than this share of records losing all their learned tokens: a warning
BLOCK = 1 << 24     # targets read (and summed) this many at a time


def pieces(docs: np.ndarray, seq_len: int, rule: str, notes: dict[str, int],
           targets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, length, record) of each piece of the records `docs` delimits (where each starts,
    and the end), cut by `rule` (the module docstring); `targets`: 1 where a token is learned
    (None: every one); `notes` counts what was done."""
    starts, lengths = docs[:-1], np.diff(docs)
    record = np.arange(len(lengths), dtype=np.int64)
    long = lengths > seq_len
    notes.update(documents=int(len(lengths)), longer_than_seq_len=int(long.sum()))
    if rule == "drop":
        notes["dropped"] = int(long.sum())
        return starts[~long], lengths[~long], record[~long]
    if rule in ("truncate", "keep_answer"):
        notes["truncated"] = int(long.sum())
        cut = np.array(starts, dtype=np.int64)
        if rule == "keep_answer":
            for i in np.flatnonzero(long).tolist():
                cut[i] += keep_answer_start(targets, int(starts[i]), int(lengths[i]), seq_len)
        return cut, np.minimum(lengths, seq_len), record
    out_s, out_n, out_r = [], [], []
    for r, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        for o in range(0, n, seq_len):
            out_s.append(s + o)
            out_n.append(min(seq_len, n - o))
            out_r.append(r)
    notes["split"] = int(long.sum())
    return (np.asarray(out_s, dtype=np.int64), np.asarray(out_n, dtype=np.int64),
            np.asarray(out_r, dtype=np.int64))


def keep_answer_start(targets: np.ndarray | None, start: int, n: int, seq_len: int) -> int:
    """Where in a record of n > seq_len tokens the row keeping its answer starts."""
    if targets is None:
        return 0  # every token is learned: keep the beginning, as "truncate" does
    learned = np.flatnonzero(np.asarray(targets[start + 1:start + n]))
    if not len(learned):
        return 0
    first = int(learned[0]) + 1  # a row's first token is never learned: one token of prompt before it
    if n - seq_len <= first - 1:
        return n - seq_len  # the learned part fits whole: the prompt loses its beginning
    return max(0, first - seq_len // 2)


def learned_in(targets: np.ndarray | None, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Learned tokens in each span [starts[i], ends[i]) (spans in order, as records and their
    pieces are), reading `targets` BLOCK tokens at a time (a store may be far larger than memory)."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    if targets is None:
        return np.maximum(ends - starts, 0)
    out = np.zeros(len(starts), dtype=np.int64)
    i = 0
    while i < len(starts):
        lo = int(starts[i])
        j = max(i + 1, int(np.searchsorted(ends, lo + BLOCK, side="right")))
        hi = max(lo, int(ends[i:j].max()))
        sums = np.concatenate([[0], np.cumsum(np.asarray(targets[lo:hi]), dtype=np.int64)])
        s, e = np.clip(starts[i:j] - lo, 0, hi - lo), np.clip(ends[i:j] - lo, 0, hi - lo)
        out[i:j] = np.maximum(sums[e] - sums[s], 0)
        i = j
    return out


@dataclass
class Learning:
    """What one split's records hold to learn, and what rows of seq_len learn of it per epoch."""
    records: int
    before: int              # learned tokens of the whole records (a record's first never counts)
    learned: int             # learned tokens of the rows: after the cut and the packing
    cut: int | None          # records that lost some of theirs (None: "mixed" cuts a stream, not records)
    emptied: int | None      # records that lost all of theirs (dropped ones included)
    dropped: int
    longest: list[int]       # the longest records' lengths in tokens, longest first
    p95: int                 # the 95th percentile of the records' lengths: a seq_len keeping 95% whole
    seq_len: int
    rule: str                # how long records were cut (the module docstring)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def how(self) -> str:
        """What the rule did to the long records, in words."""
        return {"keep_answer": "long_records = \"keep_answer\" keeps the last tokens of each",
                "truncate": f"long_records = \"truncate\" keeps the first {self.seq_len} tokens of each",
                "drop": f"long_records = \"drop\" leaves out the {self.dropped} longer ones",
                "split": "long documents are split"}.get(self.rule, self.rule)

    def _remedy(self) -> str:
        other = (", or set [data] long_records = \"keep_answer\" to cut the prompt's beginning instead"
                 if self.rule in ("truncate", "drop") else "")
        return (f"The longest records have {', '.join(f'{n:,}' for n in self.longest)} tokens; seq_len = "
                f"{self.p95:,} would keep 95% of them whole. Raise [data] seq_len{other}")

    def refusal(self) -> str | None:
        """Why a run cannot train on this split (no learned token left), or None."""
        if self.learned > 0:
            return None
        if self.before == 0:  # no row length would help: raising seq_len is not the remedy
            return (f"[data] nothing to learn: none of the {self.records} training records has a learned token "
                    f"at any seq_len: every assistant turn (completion) in them is context only (weight 0). "
                    f"Give the turns to learn weight 1 (the default), or set [data] train_on = \"all\" to learn "
                    f"every token. Nothing was trained.")
        return (f"[data] nothing to learn: none of the {self.records} training records keeps a learned token "
                f"in rows of seq_len {self.seq_len} ({self.how()}; they held {self.before:,} learned tokens, "
                f"{self.emptied or 0} records lost all of theirs). {self._remedy()}. Nothing was trained.")

    def eval_refusal(self) -> str | None:
        """Why this held-out split cannot evaluate anything (no learned token left in its rows),
        or None: refused before training, as a training split with nothing to learn is. Every
        evaluation would be a loss over no token, and [eval] patience and keep_best could never act."""
        if self.learned > 0:
            return None
        if self.before == 0:
            return (f"[eval] nothing to evaluate: none of the {self.records} held-out records has a learned token: "
                    f"every assistant turn (completion) in them is context only (weight 0). Give the turns to "
                    f"evaluate weight 1, or set [data] train_on = \"all\". Nothing was trained.")
        lost = (f"all {self.records} longer than seq_len {self.seq_len}, and long_records = \"drop\" leaves "
                f"them out" if self.dropped == self.records else
                f"{self.emptied or 0} of them lost all of theirs: {self.how()}")
        return (f"[eval] nothing to evaluate: none of the {self.records} held-out records keeps a learned token in "
                f"rows of seq_len {self.seq_len} (they held {self.before:,} learned tokens; {lost}). "
                f"{self._remedy()}. Nothing was trained.")

    def warning(self) -> str | None:
        """A warning when more than WARN_SHARE of the records lose all their learned tokens."""
        if not self.emptied or self.emptied <= WARN_SHARE * self.records:
            return None
        return (f"{self.emptied} of {self.records} training records ({self.emptied / self.records:.0%}) lose all "
                f"their learned tokens in rows of seq_len {self.seq_len} ({self.how()}) and train nothing. "
                f"{self._remedy()}.")

    def summary(self) -> str:
        """The learned-token figures in one phrase."""
        if self.learned == self.before:
            return f"{self.learned:,} tokens learned"
        lost = f": {self.cut} records lost some, {self.emptied} all of theirs" if self.cut else ""
        return f"{self.learned:,} of their {self.before:,} learned tokens kept in rows of {self.seq_len}{lost}"


def learning(tokens_path: Path, seq_len: int, packing: str, rule: str) -> Learning:
    """What the split stored at `tokens_path` learns in rows of seq_len (packing, rule: as
    ember.data.loader.resolve_packing says): one pass over its targets."""
    folder = Path(tokens_path).parent
    targets = np.load(folder / "targets.npy", mmap_mode="r") if (folder / "targets.npy").is_file() else None
    size = len(np.load(tokens_path, mmap_mode="r"))
    docs = np.load(folder / "docs.npy") if (folder / "docs.npy").is_file() else np.array([0, size])
    lengths = np.diff(docs)
    first = np.minimum(docs[:-1] + 1, docs[1:])
    per_record = learned_in(targets, first, docs[1:])
    longest = np.sort(lengths)[::-1][:3].tolist()
    p95 = int(np.ceil(np.percentile(lengths, 95))) if len(lengths) else 0
    if packing == "mixed":  # the stream in rows of seq_len, the ragged tail dropped
        rows = np.arange(size // seq_len, dtype=np.int64) * seq_len
        learned = int(learned_in(targets, rows + 1, rows + seq_len).sum())
        return Learning(len(lengths), int(per_record.sum()), learned, None, None, 0, longest, p95, seq_len, rule)
    notes: dict[str, int] = {}
    start, length, record = pieces(docs, seq_len, rule, notes, targets)
    kept = learned_in(targets, start + 1, start + length)
    after = np.bincount(record, weights=kept, minlength=len(lengths)).astype(np.int64)
    lost = per_record > after
    return Learning(len(lengths), int(per_record.sum()), int(kept.sum()), int(lost.sum()),
                    int((lost & (after == 0)).sum()), notes.get("dropped", 0), longest, p95, seq_len, rule)
