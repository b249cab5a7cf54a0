"""The subject of a model built by the user's own Python factory (spec ``factory:FILE.py:FUNCTION`` or
``factory:package.module:FUNCTION``): the module the factory returns, hooked with no hand-written map
(:func:`nopelens.models.anymodel.hook_any`, which prints the map it chose to stderr), read on uniform
random token ids below the vocabulary of the ``nn.Embedding`` the token ids go through (``hook_embed``;
the first ``nn.Embedding`` where none is found), with no BOS."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from nopelens.models.anymodel import hook_any, load_factory
from nopelens.models.io import file_sha256

FACTORY_PREFIX = "factory:"


def factory_subject(spec: str, n_sequences: int, seq_len: int, seed: int, subject_class):
    """A ``subject_class`` (:class:`nopelens.analyses.subjects.Subject`) of the module ``spec``'s factory builds.

    Raises:
        as :func:`~nopelens.models.anymodel.load_factory` and :func:`~nopelens.models.anymodel.hook_any`
        (an unmappable model: one line saying which map to pass); ValueError if the module has no
        ``nn.Embedding`` to take the vocabulary from.
    """
    model = load_factory(spec[len(FACTORY_PREFIX) :])
    embeddings = {path: module for path, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    if not embeddings:
        raise ValueError(f"{spec}: {type(model).__name__} has no nn.Embedding, so its vocabulary is unknown")
    census = torch.randint(
        0,
        min(e.num_embeddings for e in embeddings.values()),
        (2, seq_len),
        generator=torch.Generator().manual_seed(seed),
    )  # valid ids for every table
    hooked = hook_any(model, tokens=census)
    vocab = embeddings.get(hooked.site_paths.get("hook_embed"), next(iter(embeddings.values()))).num_embeddings
    tokens = torch.randint(0, vocab, (n_sequences, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hooked(tokens[:2])  # records the window or chunk of each block's attention call (hooked.key_windows)
    info = {"factory": spec[len(FACTORY_PREFIX) :], "sites": dict(hooked.site_paths), "input": "random"}
    return subject_class(
        spec, hooked, hooked.n_blocks, "unknown", "external", tokens, torch.ones_like(tokens), has_bos=False, info=info
    )


def factory_fingerprint(spec: str) -> dict | None:
    """What a run folder records of a ``factory:`` model, so a rerun can tell the model changed:
    ``{"files": {}, "factory_sha256": hex}`` of the factory's source (the ``.py`` file, or the
    module's origin); None where it cannot be read. Weights the factory reads elsewhere are not seen."""
    source = spec[len(FACTORY_PREFIX) :].rpartition(":")[0]
    try:
        path = Path(source if source.endswith(".py") else importlib.util.find_spec(source).origin)
        return {"files": {}, "factory_sha256": file_sha256(path)}
    except (ImportError, AttributeError, ValueError, TypeError, OSError):
        return None
