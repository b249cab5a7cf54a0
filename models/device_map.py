"""accelerate's side of a placement (:mod:`nopelens.models.placement`): the device map of an HF model
built on the meta device, computed and checked before any weight is read (:func:`resolve_device_map`),
and the report of a model loaded into it (:func:`placement_report`). Imported by the HF loading path
only: accelerate takes over a second to import, which nothing else pays.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from accelerate import dispatch_model
from accelerate.utils import (
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    infer_auto_device_map,
)
from torch import nn

from .placement import DEVICE_MAPS, Placement, PlacementReport, _device_key, _mib, main_device, read_device_map


def resolve_device_map(placement: Placement, model: nn.Module) -> dict[str, int | str]:
    """The device map of ``model`` (built on the meta device, in the dtype it will be loaded in) under
    ``placement``, checked: every name a module or parameter of the model, every parameter placed,
    every device present (:func:`~nopelens.models.placement.read_device_map`), the main device's
    budget large enough for the largest layer (an offloaded layer is copied there to run), and an
    offload folder that can be written and holds the disk share.

    ``auto``, ``balanced`` and ``sequential`` are accelerate's ``infer_auto_device_map`` over the
    ``--max-memory`` budgets (balanced first by ``get_balanced_memory`` except for ``sequential``),
    the model's ``_no_split_modules`` kept whole, as transformers' ``from_pretrained`` computes them.

    Raises:
        ValueError: naming what is wrong, in one line.
    """
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(model)
    budgets = placement.budgets()
    if placement.device_map in DEVICE_MAPS:
        inferred = budgets
        if placement.device_map != "sequential":
            inferred = get_balanced_memory(model, max_memory=budgets, no_split_module_classes=no_split)
        device_map = dict(infer_auto_device_map(model, max_memory=inferred, no_split_module_classes=no_split))
    else:
        device_map = read_device_map(placement.device_map, model)
        _check_tied(placement.device_map, device_map, model)
    main = main_device(device_map)
    layer, names = get_max_layer_size(list(model.named_children()), sizes, no_split)
    budget = (budgets or {}).get(_device_key(main.index if main.type == "cuda" else main.type))
    if budget is not None and layer > budget:
        raise ValueError(
            f"--max-memory {placement.max_memory}: the {_mib(budget)} for {main} cannot hold one layer "
            f"({names[0] if names else 'the largest'}, {_mib(layer)}), which must sit on {main} while it "
            "runs; give that device more memory"
        )
    disk = sum(sizes[key] for key, device in device_map.items() if device == "disk")
    if disk:
        _check_offload_folder(placement.offload_folder, disk)
    return device_map


def _check_tied(path: str, device_map: dict[str, int | str], model: nn.Module) -> None:
    """Refuse a map placing one tied weight (an embedding shared with the unembedding) on two devices."""

    def placed(name: str):
        return device_map[
            max((key for key in device_map if key == "" or name == key or name.startswith(key + ".")), key=len)
        ]

    for group in find_tied_parameters(model):
        devices = {name: placed(name) for name in group}
        if len(set(devices.values())) > 1:
            shown = ", ".join(f"{name} on {device}" for name, device in devices.items())
            raise ValueError(
                f"--device-map {path}: {' and '.join(group)} are one tied weight, placed apart ({shown}); "
                "place them on one device"
            )


def _check_offload_folder(folder: str | None, need: int) -> None:
    if folder is None:
        raise ValueError(
            f"the device map places {_mib(need)} of weights on disk: give --offload-folder DIR (or more --max-memory)"
        )
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"--offload-folder {folder} cannot be written ({error.strerror or error})") from None
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ValueError(
            f"--offload-folder {folder}: the device map places {_mib(need)} on disk, more than the "
            f"{_mib(free)} free there"
        )


def placement_report(model: nn.Module, block_paths: list[str], offload_folder: str | None = None) -> PlacementReport:
    """The :class:`~nopelens.models.placement.PlacementReport` of an HF model loaded with a device
    map (its ``hf_device_map``); ``block_paths`` are its decoder layers' module names."""
    device_map = dict(model.hf_device_map)
    sizes = compute_module_sizes(model, dtype=next(model.parameters()).dtype)
    main = main_device(device_map)
    weights: dict[str, int] = {}
    for key, device in device_map.items():
        name = "disk" if device == "disk" else str(main_device({key: device}))
        weights[name] = weights.get(name, 0) + sizes.get(key, 0)
    moved = ("disk",) if main.type == "cpu" else ("cpu", "disk")
    offloaded = [key for key, device in device_map.items() if device in moved]

    def runs_on(path: str):
        keys = [key for key in device_map if key == "" or path == key or path.startswith(key + ".")]
        device = device_map[max(keys, key=len)] if keys else "cpu"
        return main if device in ("cpu", "disk") else main_device({path: device})

    hooks = (getattr(module, "_hf_hook", None) for module in model.modules())
    loader = next(
        (
            hook.weights_map.dataset
            for hook in hooks
            if getattr(hook, "offload", False) and hasattr(getattr(hook, "weights_map", None), "dataset")
        ),
        None,
    )
    return PlacementReport(
        device_map,
        weights,
        [runs_on(path) for path in block_paths],
        offloaded,
        sum(sizes.get(key, 0) for key in offloaded),
        offload_folder,
        _loader=loader,
    )


def dispatch_hf_model(model: nn.Module, placement: Placement) -> nn.Module:
    """Spread an HF model already built in memory over devices and disk (accelerate's
    ``dispatch_model``) by ``placement``'s map (:func:`resolve_device_map`, checked the same way): the
    ``disk`` share is written to the offload folder and freed, the ``cpu`` share kept in memory, and
    every module's inputs moved to where it runs. Returns the model, with ``hf_device_map`` set as
    ``from_pretrained(device_map=...)`` sets it.

    Raises:
        ValueError: as :func:`resolve_device_map`.
    """
    device_map = resolve_device_map(placement, model)
    dispatch_model(model, device_map, offload_dir=placement.offload_folder)
    model.hf_device_map = device_map
    return model
