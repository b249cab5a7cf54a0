"""The ``--device-map`` options read into a :class:`~nopelens.models.placement.Placement`
(apart from :mod:`.options`, which the parser imports and which imports no torch)."""

import argparse

from nopelens.models.placement import Placement

from .options import PLACEMENT_OPTIONS


def placement_of(args: argparse.Namespace):
    """The :class:`~nopelens.models.placement.Placement` the options give, or None without
    ``--device-map``.

    Raises:
        ValueError: for ``--max-memory`` or ``--offload-folder`` without ``--device-map``, for
            ``--device`` with it, or a bad budget or device (:func:`~nopelens.models.placement.parse_max_memory`).
    """
    if args.device_map is None:
        given = [name for name in PLACEMENT_OPTIONS[1:] if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies with --device-map")
        return None
    if getattr(args, "device", None) is not None:
        raise ValueError("--device and --device-map: give one (the map names the devices)")
    return Placement(args.device_map, args.max_memory, args.offload_folder)
