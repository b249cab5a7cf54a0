"""One module per HF model family (or group that shares its code), each defining ``FAMILIES``: the
:class:`~nopelens.models.hf.family.Family` declarations of its ``model_type`` values. The registry
(:func:`nopelens.models.hf.family.discover`) reads every module here; nothing else lists them."""
