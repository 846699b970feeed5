"""Weight patches shared by a family of per-rank replicas: deltas, functions and layer patches.

The same operations in the same order give the same weights on every replica; a replica
applies them when it loads (weights/replicas.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

PatchFunction = Callable[[str, torch.Tensor], torch.Tensor]
# (name, replica module, device) -> the patched tensor for `name`, read from the module's layer
LayerPatchFunction = Callable[[str, torch.nn.Module, torch.device], torch.Tensor]


class WeightPatches:
    """Weight patches keyed by tensor name, shared by a family of replicas.

    Each name has an ordered list of entries: additive deltas (weight += strength * delta) or
    functions fn(name, weight_fp32) -> patched weight (float32, or the dtype the function
    computes in). Deltas are added in float32 on the replica's device; the result is cast back
    with `cast(name, weight, dtype)` (default: .to(dtype)).

    A tensor of a quantized layer (see replicas.holds_wrapped_tensor) has a layer patch instead: one
    function that computes the patched tensor from the layer as its loader rebuilt it on the
    replica's device (e.g. dequantize, add the LoRA, requantize with a fixed seed).
    """

    def __init__(self):
        self._entries: dict[str, list[tuple[str, Any, float]]] = {}
        self._layer: dict[str, LayerPatchFunction] = {}
        self.version = 0
        self.cast: Callable[[str, torch.Tensor, torch.dtype], torch.Tensor] = (
            lambda name, weight, dtype: weight.to(dtype))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return [*self._entries, *self._layer]

    def layer_patch(self, name: str) -> LayerPatchFunction | None:
        return self._layer.get(name)

    def add(self, name: str, kind: str, value: Any, strength: float) -> None:
        """Append one entry for `name`: kind "delta" (value a tensor, added times `strength`) or
        "function" (value fn(name, weight_fp32) -> patched weight). Call `bump` afterwards."""
        self._entries.setdefault(name, []).append((kind, value, strength))

    def set_layer_patch(self, name: str, fn: LayerPatchFunction) -> None:
        """Patch the quantized layer's tensor `name` with fn(name, module, device). Call `bump` afterwards."""
        self._layer[name] = fn

    def bump(self) -> None:
        """Mark the patch set changed: a resident replica whose version is older reloads."""
        self.version += 1

    def apply(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The patched weight as a new tensor on weight's device and dtype (weight is not changed)."""
        work = weight.to(torch.float32, copy=True)
        for kind, value, strength in self._entries.get(name, ()):
            if kind == "delta":
                if work.dtype != torch.float32:
                    work = work.to(torch.float32)
                work.add_(value.to(work.device, torch.float32), alpha=strength)
            else:
                # cast as the function returns it: ComfyUI's patch math returns its LoRA compute
                # dtype, and its rounding to the stored dtype starts from that
                work = value(name, work)
        return self.cast(name, work, weight.dtype)


class QuantizedPatchError(ValueError):
    """A weight patch (e.g. a LoRA) on quantized layers, which replicas from the base cannot apply."""

    def __init__(self, names: Sequence[str], message: str):
        super().__init__(message)
        self.names = list(names)

