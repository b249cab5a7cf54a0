"""Loading a local HF causal-LM directory (``hf:DIR``) offline: its config, weights, tokenizer,
dtype and device, and the refusals that name what is wrong with it before anything is measured.

:mod:`nopelens.models.adapters` hooks the loaded model; :mod:`nopelens.models.hf` describes it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .adapters import load_hf_model
from .device_map import resolve_device_map
from .hf import SIZE_FIELDS, ConfigError, check_config, check_sizes
from .placement import Placement
from .tasks import default_documents

# what transformers raises for a config.json field of the wrong type (huggingface_hub's strict
# dataclasses), besides ValueError; an older huggingface_hub lacks the class and raises TypeError
try:
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # pragma: no cover
    CONFIG_ERRORS: tuple[type[Exception], ...] = (TypeError, AttributeError)
else:
    # AttributeError: transformers reads a wrong-typed field as the type it expects (a rope entry "nope")
    CONFIG_ERRORS = (StrictDataclassError, TypeError, AttributeError)


INPUTS = ("text", "random", "repeated")
"""What an HF model reads (``nopelens probe hf:DIR --input``): text through its own tokenizer,
uniformly random token ids after the config's BOS, or one token repeated without BOS (a known
answer, :func:`nopelens.analyses.sweep.streamed.repeated_token_answer`)."""
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class HFInput:
    """How an HF model is read: its input, device and dtype (``nopelens probe hf:DIR``).

    Attributes:
        input: one of :data:`INPUTS`. ``text`` reads ``text`` (default: the corpus nopelens ships,
            :func:`nopelens.models.tasks.default_documents`) through the tokenizer saved in the
            model's directory, with the special tokens (BOS) the tokenizer adds.
        text: a UTF-8 text file, or None for the shipped corpus.
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available).
        dtype: ``bfloat16``, ``float16``, ``float32`` or None (the checkpoint's own, its config's ``dtype``).
        placement: a :class:`~nopelens.models.placement.Placement` (``--device-map``, ``--max-memory``,
            ``--offload-folder``) spreading the model over devices and disk instead of ``device``;
            None: the whole model on ``device``.
    """

    input: str = "random"
    text: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if self.input not in INPUTS:
            raise ValueError(f"--input must be one of {', '.join(INPUTS)}, got {self.input!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.text is not None and self.input != "text":
            raise ValueError(f"--text is read only with --input text, not --input {self.input}")

    def torch_device(self) -> torch.device:
        """The device to run on.

        Raises:
            ValueError: for ``cuda`` where no CUDA device is available.
        """
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available here (use --device cpu or auto)")
        return torch.device(self.device)


def eager_attention_bytes(seq_len: int, n_heads: int, activation_bytes: int) -> int:
    """The least memory one sequence's forward pass needs for one layer's attention:
    ``T^2 ((item + 4) n_heads + 1)`` bytes for ``T`` tokens: the scores ``[n_heads, T, T]`` in the
    model's dtype (``item`` bytes each) and their float32 softmax, which eager attention (the
    attention the pattern hooks read) materializes, and a boolean ``[T, T]`` mask at least. A
    floor, not an estimate (:func:`~nopelens.analyses.sweep.budget.sequence_bytes` counts the rest).

    >>> eager_attention_bytes(1024, 16, 2) / 2**20  # bfloat16, 16 heads, 1,024 tokens: (6 * 16 + 1) MiB
    97.0
    """
    return seq_len * seq_len * ((activation_bytes + 4) * n_heads + 1)


def attention_shortfall(seq_len: int, n_heads: int, activation_bytes: int, room: int, where: str) -> str | None:
    """Why one sequence's eager attention (:func:`eager_attention_bytes`) cannot fit ``room`` bytes
    (``where``: which memory, in words), or None when it can."""
    need = eager_attention_bytes(seq_len, n_heads, activation_bytes)
    if need <= room:
        return None
    return (
        f"one sequence of {seq_len:,} tokens needs at least {need / 2**20:,.1f} MiB for one layer's attention "
        f"(eager attention, which the pattern hooks read, materializes the scores [{n_heads}, {seq_len:,}, "
        f"{seq_len:,}] and their float32 softmax), more than the {max(room, 0) / 2**20:,.1f} MiB {where}; give a "
        f"shorter --seq-len, or run where more memory is free"
    )


def load_tokenizer(directory: Path):
    """The tokenizer saved in an HF model's directory, offline.

    Raises:
        ValueError: if the directory holds no tokenizer (nopelens never fetches one).
    """
    transformers.logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as error:
        cause = " ".join(str(error).split())
        raise ValueError(
            f"{directory} holds no tokenizer: save one there (tokenizer.json and tokenizer_config.json) "
            f"or use --input random (nopelens loads none from the hub; the tokenizer library said: "
            f"{cause[:100] + ('...' if len(cause) > 100 else '')})"
        ) from None


def text_windows(
    tokenizer, path: str | None, n_sequences: int, seq_len: int, seed: int, d_vocab: int
) -> tuple[Tensor, int | None]:
    """``n_sequences`` windows of ``seq_len`` tokens of a text, through the model's tokenizer.

    The text (a UTF-8 file, or the shipped corpus :func:`~nopelens.models.tasks.default_documents`
    joined by blank lines) is tokenized once without special tokens (a special token's text in it,
    such as an HTML ``<s>``, is read as characters, not as that token) and cut into non-overlapping
    windows; ``n_sequences`` of them are drawn with ``seed``, and each gets the special tokens the
    tokenizer adds around a text (e.g. BOS first), so ``seq_len`` counts them.

    Returns:
        (int64 ``[n_sequences, seq_len]`` tokens, the BOS id when the tokenizer starts every text
        with its BOS token, else None).

    Raises:
        FileNotFoundError: if ``path`` is not a file.
        ValueError: if the text is not UTF-8, is empty, gives fewer than ``n_sequences`` windows,
            or a token id falls outside the model's vocabulary; if ``seq_len`` leaves no room
            besides the special tokens.
    """
    if path is None:
        text, name = "\n\n".join(default_documents().values()), "the shipped corpus"
    else:
        if Path(path).is_dir():
            raise IsADirectoryError(f"--text {path} is a directory: give a UTF-8 text file")
        if not Path(path).is_file():
            raise FileNotFoundError(f"--text {path}: no such file")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"--text {path} is not UTF-8: {error}") from None
        name = f"--text {path}"
    if not text.strip():
        raise ValueError(f"{name} is empty")
    content = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a", add_special_tokens=True)["input_ids"]
    at = next((k for k in range(len(framed) - len(content) + 1) if framed[k : k + len(content)] == content), 0)
    prefix, suffix = framed[:at], framed[at + len(content) :]
    width = seq_len - len(prefix) - len(suffix)
    if width <= 0:
        raise ValueError(
            f"--seq-len {seq_len} leaves no room for text: the model's tokenizer adds "
            f"{len(prefix) + len(suffix)} special tokens to every sequence; give a longer --seq-len"
        )
    # the text is text: a "<s>" or "</s>" in it is read as characters, not as the BOS or EOS token
    ids = np.asarray(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], dtype=np.int64)
    n_windows = len(ids) // width
    if n_windows == 0:
        raise ValueError(
            f"{name} gives {len(ids)} tokens through the model's tokenizer, shorter than one "
            f"{seq_len}-token sequence ({len(prefix) + len(suffix)} of them special); give a longer "
            "--text or a shorter --seq-len"
        )
    if n_windows < n_sequences:
        raise ValueError(
            f"{name} gives {len(ids)} tokens through the model's tokenizer: {n_windows} windows of "
            f"{seq_len} tokens ({len(prefix) + len(suffix)} special), fewer than the {n_sequences} "
            "sequences asked for; give a longer --text, or fewer --n-sequences or a shorter --seq-len"
        )
    chosen = np.sort(np.random.default_rng(seed).choice(n_windows, n_sequences, replace=False))
    windows = ids[: n_windows * width].reshape(n_windows, width)[chosen]
    tokens = np.concatenate(
        [
            np.tile(np.asarray(prefix, dtype=np.int64), (n_sequences, 1)),
            windows,
            np.tile(np.asarray(suffix, dtype=np.int64), (n_sequences, 1)),
        ],
        axis=1,
    )
    if tokens.min() < 0 or tokens.max() >= d_vocab:
        raise ValueError(
            f"the tokenizer gives token id {int(tokens.max())} (or a negative one), outside the model's "
            f"vocabulary 0..{d_vocab - 1}: tokenizer and model do not match"
        )
    bos = tokenizer.bos_token_id
    return torch.from_numpy(tokens), (bos if prefix and bos is not None and prefix[0] == bos else None)


def load_hf_dir(
    directory: Path,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    placement: Placement | None = None,
    *,
    device_map: str | None = None,
    max_memory: str | None = None,
    offload_folder: str | None = None,
) -> Any:
    """Load a local HF causal LM offline (no hub access) and hook it: through TransformerLens'
    bridge where it can, else with forward hooks (:func:`nopelens.models.adapters.load_hf_model`;
    a bridge that fails is retried with hooks on a freshly loaded copy).

    ``dtype``: ``bfloat16``, ``float32`` or None (the checkpoint's own); ``device``: where it runs.
    A model larger than one device is spread over devices and disk by accelerate's device map
    instead: ``placement`` (a :class:`~nopelens.models.placement.Placement`), or its fields as
    keywords (``device_map="auto"``, ``max_memory="cpu=200MiB"``, ``offload_folder="offload"``). The
    map is computed and checked on a meta-device copy before any weight is read; the returned model's
    ``placement`` attribute is then its :class:`~nopelens.models.placement.PlacementReport` (None
    without a map).

    Raises:
        FileNotFoundError: if ``directory`` is not a directory.
        ValueError: if it holds no loadable model (weights must be safetensors; pickled
            ``pytorch_model.bin`` files are refused), or the placement cannot hold it (a device
            that does not exist, a map naming modules the model lacks, a budget smaller than one
            layer, an offload folder that cannot be written).
    """
    if placement is None and device_map is not None:
        placement = Placement(device_map, max_memory, offload_folder)
    elif max_memory is not None or offload_folder is not None:
        raise ValueError("max_memory and offload_folder apply with a device_map (or a placement)")
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"no such HF model directory: {directory}")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    def load():
        cls = checked_hf_config(directory)
        _check_sizes_before_loading(cls, directory)
        placed = {}
        if placement is not None:
            # the plan names what is offloaded; accelerate's own warning would say it again, unasked
            logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)
            placed = {
                "device_map": resolve_device_map(placement, _meta_model(cls, directory, dtype)),
                "offload_folder": placement.offload_folder,
            }
        try:
            # safetensors only: a pytorch_model.bin is a pickle, and nopelens never unpickles a user file;
            # mismatched shapes are reported below from transformers' loading info, not its log
            model, info = cls.from_pretrained(
                directory,
                local_files_only=True,
                use_safetensors=True,
                dtype=dtype or "auto",
                ignore_mismatched_sizes=True,
                output_loading_info=True,
                **placed,
            )
        except (OSError, ValueError) as error:
            raise ValueError(f"{directory} holds no loadable HF causal LM: {error}") from None
        except CONFIG_ERRORS as error:
            raise ValueError(f"{directory}/config.json is not a valid config: {_config_message(error)}") from None
        except KeyError as error:  # the model's code looks up an entry the config lacks
            raise ValueError(
                f"{directory}/config.json: transformers cannot build this model from it (it looks up "
                f"{error.args[0] if error.args else '?'!r}, which the config does not give)"
            ) from None
        except SafetensorError as error:
            raise ValueError(f"{directory}: a safetensors weight file is corrupted or truncated ({error})") from None
        except AssertionError as error:  # torch's own checks while transformers builds the layers
            raise ValueError(
                f"{directory}/config.json: transformers cannot build this model from it "
                f"({_built_from(error, directory)})"
            ) from None
        _check_weights_match(info, model, directory)
        model.config._attn_implementation = "eager"
        return (model if placement is not None else model.to(device)).eval()

    return load_hf_model(load(), reload=load)  # the placement report of a model loaded into a map


def _meta_model(cls, directory: Path, dtype: str | None = None):
    """The model ``directory``'s config describes, built on the meta device (no memory), in
    ``dtype`` (None: its config's)."""
    config = _config_class(cls).from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = cls.from_config(config) if cls is AutoModelForCausalLM else cls._from_config(config)
    dtype = dtype or getattr(config, "dtype", None)
    return model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype) if dtype else model


def _built_from(error: AssertionError, directory: Path) -> str:
    """What an ``AssertionError`` raised while building a model says, naming the config field behind
    the one known case: torch's ``Embedding`` refuses a ``padding_idx`` (``pad_token_id``) outside it."""
    if "Padding_idx" in str(error):
        config = _json_object(Path(directory) / "config.json")
        fields = config.get("text_config", config)
        pad, vocab = fields.get("pad_token_id"), fields.get("vocab_size")
        return f"pad_token_id {pad} is outside the vocabulary (0..{vocab - 1 if isinstance(vocab, int) else '?'})"
    return " ".join(str(error).split()) or "an internal check failed"


def checked_hf_config(directory: Path):
    """Read and check an HF model directory's ``config.json`` offline, before anything else is
    loaded (its tokenizer reads it too, and would blame itself); returns the model class to load.

    Raises:
        ValueError: naming ``config.json`` when it is missing, not JSON, has a field of the wrong
            type or fields that contradict each other (e.g. a width the head count does not divide),
            or describes a model nopelens cannot read (:func:`nopelens.models.hf.check_config`).
    """
    _check_field_types(directory)
    cls = _causal_lm_class(directory)
    try:
        check_config(_config_class(cls).from_pretrained(directory, local_files_only=True))
    except ConfigError as error:
        raise ValueError(f"{directory}/config.json: {error}") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{directory} holds no loadable HF causal LM: {error}") from None
    except CONFIG_ERRORS as error:  # a field of the wrong type ("hidden_size": "big"), or fields in conflict
        raise ValueError(f"{directory}/config.json is not a valid config: {_config_message(error)}") from None
    return cls


def _check_weights_match(info: dict, model: Any, directory: Path) -> None:
    """Refuse a model whose saved weights do not fill it, or that leaves saved weights unused: a
    tensor of another shape than its config gives, one the config asks for that the checkpoint
    lacks (transformers would initialize either at random; nopelens never measures that), or one
    the model has no place for (a config cut to fewer layers than were saved measures another
    model than the checkpoint's). Unused tensors transformers itself ignores (the model's
    ``_keys_to_ignore_on_load_unexpected``, tied weights, old ``rotary_emb.inv_freq`` buffers) are
    not in its ``unexpected_keys``, so they pass.

    ``info`` is ``from_pretrained(..., output_loading_info=True)``'s: ``mismatched_keys`` holds
    ``(name, checkpoint shape, model shape)`` triples, ``missing_keys`` and ``unexpected_keys`` names.
    """
    order = {name: k for k, name in enumerate(model.state_dict())}
    mismatched = sorted(
        info.get("mismatched_keys") or (), key=lambda entry: (order.get(entry[0], len(order)), entry[0])
    )
    missing = sorted(info.get("missing_keys") or (), key=lambda name: (order.get(name, len(order)), name))
    if mismatched:
        raise ValueError(_mismatch(mismatched, model.config, directory))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(
            f"{directory}: config.json asks for weights the checkpoint does not hold ({missing[0]}{more}); "
            "check num_hidden_layers and the other sizes against the saved model"
        )
    unused = sorted(info.get("unexpected_keys") or (), key=_natural)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        layers = [int(found.group(1)) for name in unused if (found := re.search(r"\.layers\.(\d+)\.", name))]
        given = getattr(model.config.get_text_config(), "num_hidden_layers", "?")
        check = (
            f"num_hidden_layers ({given}; the checkpoint holds layer {max(layers)})"
            if layers
            else "its sizes and architectures against the saved model"
        )
        raise ValueError(
            f"{directory}: the checkpoint holds weights config.json does not use ({', '.join(unused[:3])}"
            f"{more}); nopelens measures no part of a saved model: check {check}"
        )


def _mismatch(mismatched: list, config: Any, directory: Path) -> str:
    """The refusal of saved weights of other shapes than ``config`` gives: ``mismatched`` holds
    ``(name, checkpoint shape, model shape)`` triples, the first named."""
    name, saved, built = mismatched[0]
    sizes = " / ".join(field for field in SIZE_FIELDS if getattr(config, field, None) is not None)
    more = f"; {len(mismatched) - 1} more tensors differ" if len(mismatched) > 1 else ""
    return (
        f"{directory}: the saved weights do not match config.json ({name}: checkpoint {list(saved)}, "
        f"config gives {list(built)}{more}): check {sizes}"
    )


def _check_sizes_before_loading(cls, directory: Path) -> None:
    """Refuse, before any weight is allocated, a config whose model does not fit the checkpoint: the
    model is built on the meta device (no memory) and its tensors' shapes compared with the
    safetensors headers (names both hold), and its size with theirs: a model more than twice the
    checkpoint's size (a config fallen back to a full-size default, a vocab_size off by orders of
    magnitude) would be allocated before :func:`_check_weights_match` could name what is missing.
    Silent where the meta build or the headers fail: the load itself names those."""
    index = _json_object(Path(directory) / "model.safetensors.index.json").get("weight_map")
    files = sorted(set(index.values())) if isinstance(index, dict) else ["model.safetensors"]  # as transformers reads
    try:
        saved = {}
        for path in (Path(directory) / name for name in files):
            with safe_open(path, framework="pt") as weights:
                saved.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})
        model = _meta_model(cls, directory)
        config = model.config
    except Exception:  # noqa: BLE001 - any failure here is the real load's to name
        return
    built = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    mismatched = [(name, saved[name], shape) for name, shape in built.items() if name in saved and saved[name] != shape]
    if mismatched:
        raise ValueError(_mismatch(mismatched, config.get_text_config(), directory))
    n_built, n_saved = sum(p.numel() for p in model.parameters()), sum(math.prod(shape) for shape in saved.values())
    if n_saved and n_built > 2 * n_saved:
        raise ValueError(
            f"{directory}: config.json gives a model of {n_built:,} parameters, more than twice the "
            f"{n_saved:,} the checkpoint holds: check num_hidden_layers, the sizes and text_config against "
            "the saved model"
        )


def _natural(name: str) -> list:
    """A sort key reading the numbers in a tensor name as numbers (``layers.2`` before ``layers.10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _config_class(model_class):
    """The config class ``model_class.from_pretrained`` reads: ``AutoConfig`` for the auto class."""
    return AutoConfig if model_class is AutoModelForCausalLM else model_class.config_class


def _check_field_types(directory: Path) -> None:
    """Refuse a ``config.json`` whose ``dtype`` (or older ``torch_dtype``) names no torch dtype
    (transformers looks the name up on ``torch`` and fails with an AttributeError), or whose sizes
    are not whole numbers (:func:`nopelens.models.hf.check_sizes`)."""
    config = _json_object(Path(directory) / "config.json")  # the config's own check names a missing or broken file
    try:
        check_sizes(config)
    except ConfigError as error:
        raise ValueError(f"{directory}/config.json is not a valid config: {error}") from None

    def named(value) -> bool:
        return isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)

    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        # a multimodal config may give one dtype per sub-model
        if value is not None and not (named(value) or isinstance(value, dict) and all(map(named, value.values()))):
            raise ValueError(f"{directory}/config.json: {key} {value!r} is not a torch dtype (e.g. bfloat16, float32)")


def _causal_lm_class(directory: str | Path):
    """``AutoModelForCausalLM``, or, for a config transformers' auto mapping lacks (Mistral 4 in
    5.24; multimodal wrappers such as Muse Glimmer), the ``...ForCausalLM`` (or
    ``...ForConditionalGeneration``) class its ``config.json`` names in ``architectures``."""
    config = _json_object(Path(directory) / "config.json")  # it reports a missing or broken config itself
    model_type, given = config.get("model_type"), config.get("architectures")
    named = [name for name in given or [] if str(name).endswith(("ForCausalLM", "ForConditionalGeneration"))]
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if named and hasattr(transformers, named[0]):
        return getattr(transformers, named[0])
    if model_type not in CONFIG_MAPPING_NAMES:
        return AutoModelForCausalLM  # it names the unknown model_type itself
    # transformers knows the model type but has no causal-LM auto class for it: architectures must name the class
    fits = [
        name
        for table, names in vars(modeling_auto).items()
        if table.endswith("_MAPPING_NAMES")
        for name in [names.get(model_type)]
        if str(name).endswith(("ForCausalLM", "ForConditionalGeneration"))
    ]
    fix = f'["{fits[0]}"]' if fits else "the model's ...ForCausalLM or ...ForConditionalGeneration class"
    what = "is missing" if not given else f"is {given!r}, which names no causal LM class transformers has"
    raise ValueError(
        f"{directory}/config.json: architectures {what}, and transformers' AutoModelForCausalLM has no "
        f"class for model_type {model_type!r}: set architectures to {fix}"
    )


def _config_message(error: Exception) -> str:
    """A config error's text on one line, without the exception type names huggingface_hub's
    strict dataclasses put in it (``Validation error for field 'x': TypeError: Field 'x' expected
    int, got NoneType``): they say where nopelens failed, not what is wrong with the config."""
    return re.sub(r"\b(TypeError|ValueError|KeyError|AttributeError): ", "", " ".join(str(error).split()))


def config_bos_id(directory: Path) -> int | None:
    """The BOS id an HF model directory gives, or None where it gives no integer id: ``config.json``'s
    ``bos_token_id``, else its ``text_config``'s (a multimodal wrapper keeps it there: GLM-5 Next,
    Mistral Large 4, Muse), else ``generation_config.json``'s."""
    config = _json_object(Path(directory) / "config.json")
    text = config.get("text_config")
    for fields in (
        config,
        text if isinstance(text, dict) else {},
        _json_object(Path(directory) / "generation_config.json"),
    ):
        bos = fields.get("bos_token_id")
        if isinstance(bos, int) and not isinstance(bos, bool):
            return bos
    return None


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``, or ``{}`` where there is none (no file, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
