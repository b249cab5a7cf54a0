"""Models larger than one device: where an HF model's modules live (accelerate's device map), read
and checked before any weight is loaded, and what the placement costs once it is loaded.

``nopelens probe hf:DIR``, ``sinks`` and ``audit --hf-dir`` take ``--device-map`` (``auto``,
``balanced``, ``sequential`` or a JSON file mapping module names to devices), ``--max-memory``
(weights per device, ``cpu=200MiB,0=70GiB``) and ``--offload-folder`` (where the modules placed on
``disk`` are written). The map is computed here, on a copy of the model built on the meta device
(no memory), with accelerate's own placement (:func:`nopelens.models.device_map.resolve_device_map`),
so every refusal comes before a weight is read; transformers then loads the checkpoint into that map
and accelerate moves each module's inputs to it. This module imports no accelerate: the probes read
:func:`model_device` of every model.

Execution devices follow accelerate's ``dispatch_model``: a module mapped to a GPU runs there; one
mapped to ``cpu`` or ``disk`` runs on the main device (the first GPU of the map, else the CPU), its
weights copied there for each forward pass (the offload traffic). A hooked site's value arrives on its
block's execution device, and the statistics folded from it are made there
(:mod:`nopelens.probes.stream`), so no site's statistics cross devices per batch.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

DEVICE_MAPS = ("auto", "balanced", "sequential")
"""The device maps accelerate computes; anything else given to ``--device-map`` is a JSON file."""
UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_max_memory(text: str) -> dict[int | str, int]:
    """``--max-memory``: bytes of weights per device, ``DEVICE=SIZE`` comma separated.

    A device is ``cpu``, ``mps``, a GPU index (``0``) or ``cuda:N``; a size is a number with a unit
    (``200MiB``, ``70GiB``, ``1.5GB``; binary and decimal units as accelerate reads them).

    Returns:
        ``{device: bytes}`` with GPUs as integers, as accelerate's ``max_memory`` takes it.

    Raises:
        ValueError: on an entry that is not ``DEVICE=SIZE``, a unit it does not know, a size of 0,
            a budget for ``disk``, or a device named twice.

    Example:
        >>> parse_max_memory("cpu=200MiB,0=1.5GB")
        {'cpu': 209715200, 0: 1500000000}
    """
    budgets: dict[int | str, int] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*([a-z]+(?::[0-9]+)?|[0-9]+)\s*=\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", part)
        if match is None or match.group(3).upper() not in UNITS:
            raise ValueError(
                f"--max-memory {text!r}: each entry is DEVICE=SIZE with a unit, e.g. cpu=200MiB,0=70GiB "
                f"(units {', '.join(sorted(UNITS, key=UNITS.get))}); got {part.strip()!r}"
            )
        device = _device_key(match.group(1))
        if device == "disk":
            raise ValueError(
                f"--max-memory {part.strip()}: disk takes no budget (what the devices do not hold goes "
                "to disk, in --offload-folder)"
            )
        size = int(float(match.group(2)) * UNITS[match.group(3).upper()])
        if size <= 0:
            raise ValueError(f"--max-memory {part.strip()}: a budget must be more than 0 bytes")
        if device in budgets:
            raise ValueError(f"--max-memory {text!r} names device {device} twice")
        budgets[device] = size
    return budgets


def _device_key(name: str | int) -> int | str:
    """A device as accelerate's maps name it: GPUs as integers, else ``cpu``, ``mps``, ``disk``."""
    if isinstance(name, int) or str(name).isdigit():
        return int(name)
    if str(name).startswith("cuda:") and str(name)[5:].isdigit():
        return int(str(name)[5:])
    return str(name)


def check_device(device: int | str, what: str) -> None:
    """Refuse a device that does not exist here (``what`` names where it was given).

    Raises:
        ValueError: for a GPU index at or past ``torch.cuda.device_count()``, ``mps`` where it is not
            available, or a name that is no device (``cpu``, ``disk``, ``mps``, ``N``, ``cuda:N``).
    """
    key = _device_key(device)
    if isinstance(key, int):
        count = torch.cuda.device_count()
        if not 0 <= key < count:
            have = f"GPUs 0..{count - 1}" if count else "no GPU"
            raise ValueError(f"{what}: device {device} does not exist here ({have}; cpu and disk always do)")
    elif key == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{what}: device mps is not available here")
    elif key not in ("cpu", "disk"):
        raise ValueError(f"{what}: {device!r} is no device (cpu, disk, mps, a GPU index N or cuda:N)")


@dataclass(frozen=True)
class Placement:
    """How an HF model is spread over devices (``--device-map``, ``--max-memory``, ``--offload-folder``).

    Attributes:
        device_map: ``auto``, ``balanced``, ``sequential`` (:data:`DEVICE_MAPS`), or a JSON file
            ``{"module.name": device}`` (``""`` names the whole model).
        max_memory: bytes of weights per device, ``cpu=200MiB,0=70GiB`` (:func:`parse_max_memory`);
            None: what is free on each (accelerate's ``get_max_memory``).
        offload_folder: where modules placed on ``disk`` are written (one file per tensor), created
            if missing; needed when the map places anything on disk.
    """

    device_map: str = "auto"
    max_memory: str | None = None
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        for device in self.budgets() or {}:
            check_device(device, f"--max-memory {self.max_memory}")

    def budgets(self) -> dict[int | str, int] | None:
        return None if self.max_memory is None else parse_max_memory(self.max_memory)


def read_device_map(path: str, model: nn.Module) -> dict[str, int | str]:
    """A device map from a JSON file ``{"module.name": device}``, checked against ``model``.

    Raises:
        ValueError: if the file is missing or not a JSON object, names a module or parameter the
            model does not have, leaves a parameter unplaced, or names a device that does not exist.
    """
    try:
        given = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(
            f"--device-map {path}: not auto, balanced or sequential, and no readable JSON file "
            f"({error.strerror or error})"
        ) from None
    except ValueError as error:
        raise ValueError(f"--device-map {path} is not JSON ({error})") from None
    if not isinstance(given, dict) or not given:
        raise ValueError(
            f"--device-map {path}: give a JSON object mapping module names to devices, e.g. "
            '{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", ...}'
        )
    if "" in given and len(given) > 1:
        raise ValueError(f'--device-map {path}: "" (the whole model) must be the only entry when it is given')
    names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    unknown = [name for name in given if name not in names]
    if unknown:
        children = ", ".join(name for name, _ in model.named_children())
        raise ValueError(
            f"--device-map {path} names {unknown[0]!r}{f' and {len(unknown) - 1} more' if len(unknown) > 1 else ''}, "
            f"which {type(model).__name__} does not have (its top modules: {children})"
        )
    for name, device in given.items():
        check_device(device, f"--device-map {path} ({name})")
    placed = [
        name
        for name, _ in model.named_parameters()
        if not any(key == "" or name == key or name.startswith(key + ".") for key in given)
    ]
    if placed:
        raise ValueError(
            f"--device-map {path} places no device for {placed[0]}"
            f"{f' and {len(placed) - 1} more parameters' if len(placed) > 1 else ''}"
        )
    return {name: _device_key(device) for name, device in given.items()}


def main_device(device_map: dict[str, int | str]) -> torch.device:
    """Where a dispatched model's ``cpu`` and ``disk`` modules run and its inputs go: the first GPU
    the map names, else the CPU (accelerate's ``dispatch_model``)."""
    gpus = [device for device in device_map.values() if device not in ("cpu", "disk")]
    if not gpus:
        return torch.device("cpu")
    return torch.device(f"cuda:{gpus[0]}" if isinstance(gpus[0], int) else gpus[0])


def model_device(model: nn.Module) -> torch.device:
    """The device a model's inputs go to: for a model dispatched by a device map (its own or its
    wrapped ``original_model``'s ``hf_device_map``) the map's :func:`main_device`, else its first
    parameter's device (CPU for a model without parameters)."""
    for candidate in (model, getattr(model, "original_model", None)):
        device_map = getattr(candidate, "hf_device_map", None)
        if isinstance(device_map, dict) and device_map:
            return main_device(device_map)
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _mib(n: float) -> str:
    """A size in bytes in words: ``512 B``, ``3.0 KiB``, ``1.5 MiB``, ``2.3 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class PlacementReport:
    """Where a loaded model's weights live and what it costs per forward pass.

    Attributes:
        device_map: the map it was loaded with.
        weights: bytes of weights per device (``cpu``, ``cuda:0``, ..., ``disk``).
        block_devices: the execution device of each decoder block, in block order.
        offloaded: modules whose weights are copied to their execution device for every forward
            pass (``disk`` ones, and ``cpu`` ones where the main device is a GPU).
        offloaded_bytes: their weights' bytes: the offload traffic of one full forward pass.
        offload_folder: where the ``disk`` share lives.
        hooks: how the sites are hooked, ``bridge`` (TransformerLens) or ``forward hooks`` (PyTorch
            hooks on the decoder layers); set once the model is wrapped.
    """

    device_map: dict[str, int | str]
    weights: dict[str, int]
    block_devices: list[torch.device]
    offloaded: list[str]
    offloaded_bytes: int
    offload_folder: str | None = None
    hooks: str = "?"
    read_rate: float | None = field(default=None, repr=False)
    _loader: object = field(default=None, repr=False)  # accelerate's OffloadedWeightsLoader of the model

    def site_device(self, block: int | None) -> torch.device:
        """The execution device of block ``block``'s sites (None: embedding and final norm sites,
        on the main device)."""
        if block is None or not 0 <= block < len(self.block_devices):
            return main_device(self.device_map)
        return self.block_devices[block]

    def offload_seconds(self) -> float:
        """Seconds the offload traffic of one full forward pass takes here: its bytes over a read
        rate measured once on the model's own offloaded weights (:meth:`measure_read_rate`)."""
        if not self.offloaded_bytes:
            return 0.0
        return self.offloaded_bytes / self.measure_read_rate()

    def measure_read_rate(self) -> float:
        """Bytes per second of moving the offloaded weights to the main device, timed here on the
        model's own offloaded tensors (up to 64 MiB of them, in map order) read through the loader
        accelerate's hooks read them with (a memory map of the checkpoint's or the offload folder's
        safetensors, or the CPU copy) and copied to the main device; the slower of two reads (the
        first may miss the page cache). A model larger than the page cache reads from the disk
        itself every pass, more slowly than a read the cache serves: for it the rate is an upper
        bound, and the ETA's offload traffic a lower one."""
        if self.read_rate is None:
            main, keys, n = main_device(self.device_map), [], 0
            for key in self._loader.all_keys if self._loader is not None else []:
                if any(key.startswith(name + ".") for name in self.offloaded) and n < 64 * 2**20:
                    keys.append(key)
                    n += self._loader[key].nbytes
            rates = []
            for _ in range(2):
                start = time.perf_counter()
                for key in keys:  # a copy: a memory-mapped tensor is read only when it is used
                    self._loader[key].to(main, copy=True)
                if main.type == "cuda":
                    torch.cuda.synchronize(main)
                rates.append(max(n, 1) / max(time.perf_counter() - start, 1e-9))
            self.read_rate = min(rates)
        return self.read_rate

    def lines(self, statistics: dict[str, int] | None = None, batch: int = 0) -> list[str]:
        """The placement in words, for the plan: how the sites are hooked and where their blocks
        run, then per device the weights placed there, and the ``statistics`` (bytes per execution
        device) and ``batch`` (bytes of one batch's activations, on every execution device it
        passes) the run adds there; then what is offloaded."""
        blocks: dict[str, list[int]] = {}
        for block, device in enumerate(self.block_devices):
            blocks.setdefault(str(device), []).append(block)
        items = [
            f"sites hooked by {self.hooks} on the blocks wherever they live; each site's statistics "
            f"accumulate on its block's execution device ({_blocks_text(blocks)})"
        ]
        running = {str(device) for device in self.block_devices} | {str(main_device(self.device_map))}
        for device in sorted(
            set(self.weights) | (running if statistics is not None else set()) | set(statistics or {})
        ):
            parts = [f"weights {_mib(self.weights[device])}"] if device in self.weights else []
            if device in running and statistics is not None:  # the plan's; a bare placement has weights only
                parts += [f"statistics {_mib(statistics.get(device, 0))}", f"batches up to {_mib(batch)}"]
            items.append(f"{device}: {', '.join(parts)}")
        if self.offloaded:
            shown = ", ".join(self.offloaded[:4]) + (
                f" and {len(self.offloaded) - 4} more" if len(self.offloaded) > 4 else ""
            )
            items.append(
                f"offloaded ({_mib(self.offloaded_bytes)}, copied to {main_device(self.device_map)} for every "
                f"forward pass): {shown}"
            )
        return items


def _blocks_text(blocks_by_device: dict[str, list[int]]) -> str:
    parts = []
    for device, blocks in blocks_by_device.items():
        ranges, start = [], blocks[0]
        for previous, block in zip(blocks, blocks[1:] + [math.inf]):
            if block != previous + 1:
                ranges.append(f"{start}" if start == previous else f"{start}-{previous}")
                start = block
        parts.append(f"block{'s' * (len(blocks) > 1)} {','.join(ranges)} on {device}")
    return "; ".join(parts) or "no blocks"
