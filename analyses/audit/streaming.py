"""Forward hooks that hold a pass's tensors one layer at a time, and the count of what they hold.

The audit reads each layer's attention (``[batch, head, T, T]`` scores and patterns) as soon as the
layer is complete and drops it before the next layer's: its memory is bounded by one layer's
attention, not all of them (:func:`~.probe.stream`, :func:`~.detector.detect`, step 3's dropped
bias).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor


class HeldBytes:
    """Bytes of ``[..., T, T]`` tensors (attention scores, patterns, biases) a pass holds, and their peak."""

    def __init__(self, length: int):
        self.length, self.now, self.peak = length, 0, 0

    def _bytes(self, x: Tensor) -> int:
        return x.numel() * x.element_size() if tuple(x.shape[-2:]) == (self.length, self.length) else 0

    def add(self, x: Tensor) -> None:
        self.now += self._bytes(x)
        self.peak = max(self.peak, self.now)

    def drop(self, tensors) -> None:
        self.now -= sum(self._bytes(x) for x in tensors)


def hold_by_layer(
    names,
    layer_of: Callable[[str], int | None],
    on_layer: Callable[[int, dict[str, Tensor]], None],
    kept: dict[str, Tensor],
    held: HeldBytes,
    on_tensor: Callable[[str, Tensor], None] | None = None,
    clone: bool = False,
):
    """Forward hooks that hold the hooks of each layer (``layer_of(name)``) until a later layer's first
    hook fires, then hand them to ``on_layer(layer, tensors)`` and drop them; hooks of no layer
    (``layer_of`` None) go to ``kept``.

    Returns ``(hooks, finish)``: ``finish()``, called after the forward pass, hands over the last
    layer. Hook names are bound here, not read from ``hook.name`` (a bridge names its hook points
    by their component and the audit by TransformerLens' aliases). ``clone``: hold copies (the
    model may change a hooked tensor in place later in the pass).

    Raises:
        RuntimeError: from the forward pass, if a layer's hook fires after a later layer's did.
    """
    state: dict[str, Any] = {"layer": None, "tensors": {}, "done": set()}

    def flush():
        layer, tensors = state["layer"], state["tensors"]
        if layer is not None:
            state["done"].add(layer)
            state["layer"], state["tensors"] = None, {}
            try:
                on_layer(layer, tensors)
            finally:
                held.drop(tensors.values())
                tensors.clear()

    def keep(name):
        layer = layer_of(name)

        def hook(x, hook):
            x = x.detach().clone() if clone else x.detach()
            if on_tensor is not None:
                on_tensor(name, x)
            if layer is None:
                kept[name] = x
                return
            if layer != state["layer"]:
                flush()
                if layer in state["done"]:
                    raise RuntimeError(
                        f"{name} fired after the hooks of a later layer: the audit reads a layer's "
                        "hooks once it is complete, so they must fire layer by layer"
                    )
                state["layer"] = layer
            state["tensors"][name] = x
            held.add(x)

        return hook

    return [(name, keep(name)) for name in names], flush
