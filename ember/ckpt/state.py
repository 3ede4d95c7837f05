"""RunState: everything that must survive a restart besides model, optimizer, scheduler and
scaler state. A test pins its field list, so adding state is a deliberate change."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ember.device import rng_states, set_rng_states


@dataclass
class DataCursor:
    """Position in the data stream: sequence `offset` of the permutation for `epoch`."""

    epoch: int = 0
    offset: int = 0


@dataclass
class RunState:
    step: int = 0                   # optimizer steps completed
    tokens_seen: int = 0            # training tokens consumed by completed steps
    cursor: DataCursor = field(default_factory=DataCursor)
    train_seconds: float = 0.0      # wall-clock spent inside completed steps, all attempts
    recipe_digest: str = ""         # SHA-256 of the recipe that produced this state
    rng: dict[str, Any] = field(default_factory=dict)  # Python, NumPy, torch CPU and devices
    loss_window: list[float] = field(default_factory=list)   # recent accepted losses (spikes)
    skip_batches: list[int] = field(default_factory=list)    # micro-batch ordinals never to train on
    bad_steps: list[dict[str, Any]] = field(default_factory=list)  # step, why, loss, batches
    lr_scale: float = 1.0           # product of rollback learning-rate factors
    bad_streak: int = 0             # consecutive bad steps so far
    best_eval_loss: float | None = None  # lowest held-out loss so far (None: no finite one yet)
    best_step: int = 0              # the step it was evaluated at ([checkpoint] keep_best keeps it)
    evals_since_best: int = 0       # evaluations since then that did not lower it ([eval] patience)

    def capture_rng(self, device: torch.device) -> None:
        """Record every RNG this process draws from, as of now."""
        kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        self.rng = {
            "python": random.getstate(),
            # As plain values and a tensor, so torch.load(weights_only=True) can read them back.
            "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "gauss": gauss},
            "torch": rng_states(device),
        }

    def restore_rng(self, device: torch.device) -> None:
        random.setstate(_as_tuple(self.rng["python"]))
        n = self.rng["numpy"]
        np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["gauss"]))
        set_rng_states(self.rng["torch"], device)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunState:
        d = dict(d)
        d["cursor"] = DataCursor(**d["cursor"])
        return cls(**d)


def _as_tuple(x: Any) -> Any:
    """torch.save turns nothing into lists, but be strict: random.setstate needs tuples."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for a fresh run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
