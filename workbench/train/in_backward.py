"""The optimizer stepped inside backward (``train.optimizer_in_backward``): one optimizer per
trained parameter, stepped from the parameter's ``Tensor.register_post_accumulate_grad_hook`` as
soon as its gradient is complete, the gradient then freed, so a whole set of gradients is never
held (torch's "How to save memory by fusing the optimizer step into the backward pass" recipe;
torchtune's ``optimizer_in_bwd``).

The Trainer is given :class:`InBackwardOptimizer`: its ``step`` and ``zero_grad`` do nothing
(backward did the work), its ``param_groups`` are the per-parameter optimizers' own group dicts,
so the Trainer's learning-rate scheduler sets every one of them, and its state dict holds each
per-parameter optimizer's, so a snapshot's ``optimizer.pt`` saves them and a resume loads them.
The gradients' global norm is summed in the hooks, so the run still logs ``grad_norm``.

    >>> import torch
    >>> layer = torch.nn.Linear(2, 1)
    >>> opt = InBackwardOptimizer(layer, torch.optim.AdamW, {"lr": 0.1}, set(), 0.0)
    >>> layer(torch.ones(1, 2)).sum().backward()  # both parameters stepped here
    >>> layer.weight.grad is None and len(opt.state_dict()["per_parameter"]) == 2
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class InBackwardOptimizer(torch.optim.Optimizer):
    """Per-parameter optimizers of ``model``'s trained parameters, each stepped in backward.

    ``optimizer_cls(param_groups, **kwargs)`` builds each one (the Trainer's own class and
    arguments for its ``optim``); parameters named in ``decay`` get ``weight_decay``, the rest
    none, as the Trainer's groups do.
    """

    def __init__(self, model: torch.nn.Module, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 kwargs: dict[str, Any], decay: set[str], weight_decay: float) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the optimizer in backward found no parameter to train")
        # bitsandbytes' 8-bit optimizers keep every parameter's states in 8 bits here (the
        # Trainer's own optimizer keeps embeddings' in 32): torchtune's recipe, and what the
        # plan counts (2.03 B per parameter).
        self.optimizers = [optimizer_cls([{"params": [p], "weight_decay":
                                           weight_decay if n in decay else 0.0}], **kwargs)
                           for n, p in named]
        super().__init__([p for _, p in named], {})
        self._share_groups()
        self._grad_sq: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._stepper(opt))
                         for (_, p), opt in zip(named, self.optimizers, strict=True)]

    def _share_groups(self) -> None:
        # The scheduler writes each group's lr here, and so into the optimizer that owns it.
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    def _stepper(self, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            sq = torch.linalg.vector_norm(grad.detach()).float().square()
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq.to(
                self._grad_sq.device)
            opt.step()
            opt.zero_grad(set_to_none=True)  # the gradient is freed now, not after backward
        return step

    def take_grad_norm(self) -> torch.Tensor | None:
        """The global norm of the gradients stepped since the last call (None: none were)."""
        sq, self._grad_sq = self._grad_sq, None
        return None if sq is None else sq.sqrt()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Nothing left to do: each parameter was stepped in backward."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each gradient was freed once its parameter was stepped."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"per_parameter": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        saved = state_dict.get("per_parameter")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(
                "this snapshot's optimizer state is not of the optimizer in backward with "
                f"{len(self.optimizers)} parameters (was train.optimizer_in_backward or the "
                "model changed?): resume with the settings it was taken with")
        for opt, sd in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(sd)
        self._share_groups()  # loading replaced each optimizer's group dicts

    def remove_hooks(self) -> None:
        """Stop stepping in backward (the hooks stay until then, for every backward pass)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
