"""An exponential moving average of the weights during training (Polyak averaging), the running
counterpart of averaging saved checkpoints (``tformer average``):

    shadow <- decay_t * shadow + (1 - decay_t) * weights,   decay_t = min(decay, (1 + t) / (10 + t))

after optimizer step t. The warm-up of decay_t keeps the random initial weights from lingering in
the average of a short run. The shadow weights are kept beside the model and saved as a
checkpoint of their own (``checkpoints/ema``) that eval and generate accept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tformer_cli.accel import ops


class WeightEMA:
    def __init__(self, model: torch.nn.Module, decay: float, updates: int = 0) -> None:
        """Start from the model's weights as they are; ``updates`` steps already count toward the
        warm-up of decay_t (when averaging is switched on as a run resumes)."""
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied matrices appear once
        self.shadow = [p.detach().clone() for p in self.params]  # fp32, as the parameters are kept
        self.decay = decay
        self.updates = updates

    @torch.no_grad()
    def update(self) -> None:
        """Fold in the weights after one more optimizer step."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        ops.foreach_lerp_(self.shadow, self.params, 1.0 - decay)

    @contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """Within the block, the model holds the averaged weights (to save or evaluate them). They are
        copied in and out, not swapped, because FSDP keeps its own reference to each weight's storage."""
        live = [p.detach().clone() for p in self.params]
        for p, s in zip(self.params, self.shadow):
            p.copy_(s)
        try:
            yield
        finally:
            for p, data in zip(self.params, live):
                p.copy_(data)

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"{len(state['shadow'])} averaged tensors saved, the model has {len(self.shadow)}")
        self.updates = state["updates"]
        for s, saved in zip(self.shadow, state["shadow"]):
            s.copy_(saved)
