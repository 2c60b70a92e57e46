"""Reading checkpoints: GGUF files (metadata, tensor index, dequantization, llama.cpp →
Hugging Face tensor names) and safetensors directories. Yields (HF name, tensor) pairs:
float tensors, or on the quantized GGUF path `GGUFTensor`s (a 2-D weight still in the
file's blocks); knows nothing about model classes beyond the names they use.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagellm.config.arch_config import num_kv_heads_of
from pagellm.model_executor.registry import ModelRegistry
from pagellm.utils import cdiv

if TYPE_CHECKING:  # the frontend reads GGUF metadata without importing torch
    import torch


# GGUF general.architecture -> HF architectures name (and config model_type).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = ModelRegistry.gguf_architectures()

# Tensor types we dequantize (gguf.quants covers them); anything else is refused by name.
SUPPORTED_GGUF_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip

_DEQUANT_SLAB = 1 << 20  # values dequantized per numpy call

# llama.cpp per-layer tensor stem -> HF module path under model.layers.N (Llama's).
LLAMA_GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class GGUFFamily:
    """What llama.cpp's converter did to one family's tensors, so the loader can give
    them back under Hugging Face's names and conventions. Each model class owns one
    (`gguf_family`)."""

    layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    """llama.cpp per-layer tensor stem -> HF module path under model.layers.N."""
    permuted_qk: bool = False
    """q/k rows were interleaved per head (llama.cpp's LlamaModel converter: Llama,
    Mistral), undone on loading."""
    norm_offset: float = 0.0
    """Subtracted from every norm weight: Gemma's converter stores 1 + w where HF keeps
    w (transformers' GGUF loader does the same subtraction)."""


def is_gguf(path: str) -> bool:
    """A .gguf path (existing or not: opening a missing one then fails with its name)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


# ----------------------------------------------------------------------------- GGUF


def open_gguf(path: str) -> Any:
    """Parse a GGUF file's header (metadata + tensor index; tensors stay memory-mapped).

    Cached per (path, size, mtime) so config and weight loading parse the file once.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    st = os.stat(path)
    return _open_gguf(os.path.abspath(path), st.st_size, st.st_mtime_ns, path)


@functools.lru_cache(maxsize=2)
def _open_gguf(abspath: str, size: int, mtime_ns: int, shown_path: str) -> Any:
    import gguf

    class _FastReader(gguf.GGUFReader):
        # GGUFReader slices its np.memmap once per metadata item; the memmap subclass
        # makes each slice ~10x slower than a plain ndarray view of the same bytes, and a
        # tokenizer has ~100k items. Same bytes, same results, 4x faster parse.
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    try:
        return _FastReader(abspath)
    except Exception as e:  # numpy/struct errors on truncated or foreign files
        raise ValueError(f"{shown_path}: not a valid GGUF file: {e}") from e


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """Scalar or string value of a metadata key (arrays: their length is `gguf_len`)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def gguf_len(reader: Any, key: str) -> int:
    field = reader.fields.get(key)
    return len(field.data) if field is not None else 0


def gguf_architecture(path: str) -> tuple[str, str, str]:
    """(gguf arch, HF architectures name, HF model_type); ValueError if unsupported."""
    arch = gguf_field(open_gguf(path), "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    if arch == "llama" and (gguf_field(open_gguf(path), "llama.expert_count") or 0) > 0:
        return arch, "MixtralForCausalLM", "mixtral"  # llama.cpp files Mixtral under llama
    return (arch, *GGUF_ARCHITECTURES[arch])


def _gguf_rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    """rope.scaling.* (or the older rope.scale_linear) as HF's rope_scaling, read the way
    llama.cpp reads them: a factor without a type is linear, a factor of 0 means none.
    Types pagellm does not implement (yarn, ...) are passed on, so loading refuses them
    by name instead of running the model without its scaling."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = gguf_field(reader, f"{arch}.rope.scale_linear")
    if kind == "none" or (kind is None and not factor):
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor or 1.0)}
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor:
        scaling["factor"] = float(factor)
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


_GGUF_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Phi-3's LongRoPE divisors (rotary dims / 2 each), read into the config, not loaded."""


def _gguf_longrope(path: str, reader: Any, arch: str) -> dict[str, Any] | None:
    """Phi-3's LongRoPE as HF's rope_scaling, where the file has llama.cpp's
    rope_factors_long/short tensors (its converter writes no scaling type for them) with
    rope.scaling.original_context_length and, where written, attn_factor."""
    tensors = {t.name: t for t in reader.tensors if t.name in _GGUF_LONGROPE_TENSORS}
    if len(tensors) != len(_GGUF_LONGROPE_TENSORS):
        return None
    long, short = (dequantize_gguf_tensor(path, tensors[n]).reshape(-1).tolist()
                   for n in _GGUF_LONGROPE_TENSORS)
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    attn_factor = gguf_field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    return scaling


def gguf_config_kwargs(path: str) -> tuple[str, str, dict[str, Any]]:
    """(HF architectures name, model_type, config kwargs) from GGUF metadata."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    reader = open_gguf(path)
    arch, hf_arch, model_type = gguf_architecture(path)
    splits = gguf_field(reader, "split.count")
    if splits is not None and splits > 1:
        raise ValueError(
            f"{path} is part 1 of a GGUF split in {splits} files, which pagellm does not load; "
            "merge them into one file first (llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)"
        )
    kwargs: dict[str, Any] = {}
    mapping = GGUF_CONFIG_MAPPING.get(arch) or GGUF_CONFIG_MAPPING.get(model_type)
    for gguf_key, hf_key in (mapping or GGUF_CONFIG_MAPPING["llama"]).items():
        value = gguf_field(reader, f"{arch}.{gguf_key}")
        if hf_key and value is not None:
            kwargs[hf_key] = value
    head_dim = gguf_field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:  # Qwen3: head_dim != hidden / heads
        kwargs["head_dim"] = head_dim
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = gguf_len(reader, "tokenizer.ggml.tokens") or (int(embed.shape[-1]) if embed is not None else 0)
    kwargs.setdefault("vocab_size", vocab)
    scaling = _gguf_rope_scaling(reader, arch)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    names = {t.name for t in reader.tensors}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # llama3 scaling as llama.cpp's converter stores it
        kwargs["rope_freq_factors"] = dequantize_gguf_tensor(path, freqs).reshape(-1).tolist()
    longrope = _gguf_longrope(path, reader, arch)
    if longrope is not None:
        kwargs["rope_scaling"] = longrope
    # rotary dims short of a head (Phi-4-mini: 96 of 128) where the mapping has no key
    rope_dims = gguf_field(reader, f"{arch}.rope.dimension_count")
    heads = kwargs.get("num_attention_heads")
    full = kwargs.get("head_dim") or (kwargs.get("hidden_size", 0) // heads if heads else 0)
    if rope_dims and full and rope_dims < full:
        kwargs["partial_rotary_factor"] = rope_dims / full
    window = gguf_field(reader, f"{arch}.attention.sliding_window")
    if window and "sliding_window" not in kwargs:  # Phi-3 (0: none, Phi-4-mini)
        kwargs["sliding_window"] = window
    kwargs["tie_word_embeddings"] = "output.weight" not in names
    for key, hf_key in (("attn_logit_softcapping", "attn_logit_softcapping"),  # Gemma 2
                        ("final_logit_softcapping", "final_logit_softcapping"),
                        ("expert_count", "num_experts"),  # MoE (Mixtral's llama files too)
                        ("expert_used_count", "num_experts_per_tok"),
                        ("expert_feed_forward_length", "moe_intermediate_size"),
                        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        value = gguf_field(reader, f"{arch}.{key}")
        if value is not None:
            kwargs[hf_key] = value
    if arch == "gemma3" and "rope_scaling" in kwargs:
        # Gemma 3 scales only its global layers' rope, and max_position_embeddings is
        # already the scaled context: transformers' per-kind form says both
        kwargs["rope_parameters"] = {"full_attention": {
            **kwargs.pop("rope_scaling"), "rope_theta": kwargs.get("rope_theta", 1e6)}}
    for key, hf_key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("padding", "pad_token_id"),
    ):
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            kwargs[hf_key] = token_id
    return hf_arch, model_type, kwargs


def _gguf_hf_name(name: str, family: GGUFFamily) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None to skip."""
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        hf = family.layer_names.get(part)
        return f"model.layers.{layer}.{hf}.{suffix}" if hf else None
    hf = _GGUF_GLOBAL_NAMES.get(stem)
    return f"{hf}.{suffix}" if hf else None


def llama_row_order(rows: int, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's rows of q/k from HF's "rotate half"
    layout (first half, second half) to interleaved pairs; `w[llama_row_order(...)]`
    puts them back: rows [head, pair, 2] -> [head, 2, pair]."""
    pair = rows // n_head // 2
    return np.arange(rows).reshape(n_head, pair, 2).swapaxes(1, 2).reshape(-1)


def dequantize_gguf_tensor(path: str, tensor: Any) -> np.ndarray:
    """One GGUF tensor as float32 numpy in HF shape [rows, cols] (GGUF lists dims reversed)."""
    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_GGUF_TYPES:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has unsupported quantization type {qtype}; "
            f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
        )
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    try:
        return _dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except ValueError as e:
        raise ValueError(f"{path}: tensor {tensor.name!r} ({qtype}) is corrupt: {e}") from e


def _dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """gguf's dequantize() works 16 rows at a time (Python overhead dominates small rows);
    slabs of ~1M values are 3x faster and keep temporaries small."""
    import gguf.quants

    quant = getattr(gguf.quants, qtype.name, None)
    if quant is None or data.ndim != 2 or not hasattr(quant, "dequantize_rows"):
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    values_per_row = data.shape[1] // quant.type_size * quant.block_size
    rows = max(1, _DEQUANT_SLAB // values_per_row)
    slabs = [quant.dequantize_rows(data[i : i + rows]) for i in range(0, data.shape[0], rows)]
    return np.concatenate(slabs) if len(slabs) > 1 else slabs[0]


class GGUFTensorInfo:
    """One entry of a GGUF file's tensor index, with its data as a view of the mapping
    (shaped as gguf's GGUFReader shapes it: float types [rows, cols] of their dtype,
    block types [rows, bytes per row] uint8)."""

    def __init__(self, path: str, name: str, dims: list[int], qtype: Any, data_offset: int,
                 n_bytes: int, mapping: np.ndarray) -> None:
        self.path = path
        self.name = name
        self.shape = np.array(dims, dtype=np.uint64)  # GGUF order: [cols, rows]
        self.tensor_type = qtype
        self.data_offset = data_offset
        self.n_bytes = n_bytes
        self._mapping = mapping

    @property
    def data(self) -> np.ndarray:
        import gguf

        raw = self._mapping[self.data_offset : self.data_offset + self.n_bytes]
        if raw.nbytes != self.n_bytes:
            raise ValueError(f"{self.path}: tensor {self.name!r} is cut short (truncated file?)")
        dims = [int(d) for d in reversed(self.shape)]
        float_dtypes = {gguf.GGMLQuantizationType.F32: np.float32,
                        gguf.GGMLQuantizationType.F16: np.float16}
        dtype = float_dtypes.get(self.tensor_type)
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        block, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * size)


class GGUFIndex:
    """The parts of a GGUF file the weight loaders need, read without building Python
    objects for the metadata (a vocabulary is ~100k fields: gguf's GGUFReader spends
    ~0.5 s and ~75 MB on them, which the engine process would keep): the architecture,
    the model's name (`general.name`), and the tensor index over a read-only memory map."""

    _SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: str) -> None:
        import struct

        import gguf

        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such GGUF file")
        mapping = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(mapping)
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype == self._STRING:
                n = take("<Q")  # (not `pos += take(...)`: take moves pos itself)
                pos += n
            elif vtype == self._ARRAY:
                etype, count = take("<I"), take("<Q")
                if etype in self._SCALAR:
                    pos += struct.calcsize(self._SCALAR[etype]) * count
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                pos += struct.calcsize(self._SCALAR[vtype])

        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic number")
            pos = 8  # magic, version
            n_tensors, n_kv = take("<Q"), take("<Q")
            self.architecture: str | None = None
            self.name: str | None = None
            alignment = 32
            for _ in range(n_kv):
                key, vtype = string(), take("<I")
                if key == "general.architecture" and vtype == self._STRING:
                    self.architecture = string()
                elif key == "general.name" and vtype == self._STRING:
                    self.name = string()
                elif key == "general.alignment" and vtype in self._SCALAR:
                    alignment = int(take(self._SCALAR[vtype]))
                else:
                    skip(vtype)
            infos = []
            for _ in range(n_tensors):
                name, n_dims = string(), take("<I")
                dims = [take("<Q") for _ in range(n_dims)]
                qtype, offset = gguf.GGMLQuantizationType(take("<I")), take("<Q")
                infos.append((name, dims, qtype, offset))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid GGUF file: {e}") from e
        start = cdiv(pos, alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        for name, dims, qtype, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) // block * size
            self.tensors.append(GGUFTensorInfo(path, name, dims, qtype, start + offset, n_bytes, mapping))


def gguf_family(hf_config: Any) -> GGUFFamily:
    """The GGUF facts of the config's model class (imports the family's module)."""
    model_cls = ModelRegistry.resolve_model_cls(hf_config.architectures[0])
    return getattr(model_cls, "gguf_family", GGUFFamily())


def _gguf_tensors(path: str, hf_config: Any) -> Iterator[tuple[str, Any, int | None]]:
    """(HF name, GGUF tensor, heads whose q/k rows llama.cpp permuted or None) for every
    weight of a GGUF file."""
    index = GGUFIndex(path)
    family = gguf_family(hf_config)
    n_heads = hf_config.num_attention_heads
    n_kv = num_kv_heads_of(hf_config)
    for tensor in index.tensors:
        hf_name = _gguf_hf_name(tensor.name, family)
        if hf_name is None:
            if tensor.name != "rope_freqs.weight" and tensor.name not in _GGUF_LONGROPE_TENSORS:
                raise ValueError(f"{path}: unknown GGUF tensor {tensor.name!r}")
            continue
        permuted = None
        if family.permuted_qk and ".attn_q." in tensor.name:
            permuted = n_heads
        elif family.permuted_qk and ".attn_k." in tensor.name:
            permuted = n_kv
        yield hf_name, tensor, permuted


def _float_tensor(path: str, tensor: Any, hf_name: str, family: GGUFFamily) -> np.ndarray:
    """A 1-D (or float) tensor dequantized, with the family's norm offset taken back."""
    w = dequantize_gguf_tensor(path, tensor)
    if family.norm_offset and hf_name.endswith("norm.weight"):
        return (w - np.float32(family.norm_offset)).astype(np.float32)
    return w


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(array)


def gguf_weights_iterator(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor of a GGUF file."""
    family = gguf_family(hf_config)
    for hf_name, tensor, permuted in _gguf_tensors(path, hf_config):
        w = _float_tensor(path, tensor, hf_name, family)
        if permuted is not None:
            w = w[llama_row_order(w.shape[0], permuted)]
        if not w.flags.writeable:  # F32/F16 tensors are views of the read-only mapping
            w = w.copy()
        yield hf_name, _from_numpy(np.ascontiguousarray(w))


class GGUFTensor:
    """One 2-D GGUF weight kept in the file's block format: `rows` rows of `row_bytes`
    bytes, each row `cols` values of ggml type `qtype`. `data` is a view of the
    memory-mapped file (nothing read yet); `read_rows()` copies the rows (in HF order:
    llama.cpp's q/k row permutation undone) without touching the mapping."""

    def __init__(self, path: str, tensor: Any, permuted_heads: int | None) -> None:
        self.path = path
        self.name = tensor.name
        self._tensor = tensor
        self.qtype = int(tensor.tensor_type)
        self.type_name = tensor.tensor_type.name
        dims = [int(d) for d in tensor.shape]  # GGUF order: cols, rows[, experts]
        self.experts = dims[2] if len(dims) == 3 else None
        """A 3-D tensor (MoE experts stacked, [experts, rows, cols]) is seen as its
        experts' rows one after another: rows = experts x rows of one."""
        self.cols, self.rows = dims[0], dims[1] * (self.experts or 1)
        self.data: np.ndarray = tensor.data.reshape(self.rows, -1).view(np.uint8)
        self.row_bytes = self.data.shape[1]
        self.file_offset = int(tensor.data_offset)
        self.row_order = None if permuted_heads is None else llama_row_order(self.rows, permuted_heads)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def read_rows(self) -> np.ndarray:
        """The rows as an owned [rows, row_bytes] uint8 array, read from the file rather
        than the mapping, so its pages are not resident twice."""
        raw = np.empty((self.rows, self.row_bytes), dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.file_offset)
            if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
                raise ValueError(f"{self.path}: tensor {self.name!r} is cut short (truncated file?)")
        return raw if self.row_order is None else raw[self.row_order]

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols] in HF row order (gguf's reference dequantization)."""
        w = dequantize_gguf_tensor(self.path, self._tensor).reshape(self.rows, self.cols)
        if self.row_order is not None:
            w = w[self.row_order]
        return np.array(w, dtype=np.float32, copy=True)


def gguf_quantized_weights_iterator(path: str, hf_config: Any) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, weight) for every tensor of a GGUF file: 2-D weights and 3-D
    stacked experts as `GGUFTensor` (still in the file's blocks), 1-D ones (norms) as
    float32 tensors."""
    family = gguf_family(hf_config)
    for hf_name, tensor, permuted in _gguf_tensors(path, hf_config):
        if len(tensor.shape) == 3 or (len(tensor.shape) == 2 and int(tensor.shape[1]) > 1):
            yield hf_name, GGUFTensor(path, tensor, permuted)
        else:
            w = _float_tensor(path, tensor, hf_name, family)
            yield hf_name, _from_numpy(np.array(w, dtype=np.float32, copy=True))



# ------------------------------------------------------------------------ safetensors


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint shards of an HF directory (index-listed, or every *.safetensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(
            os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors")
        )
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file}: listed in the safetensors index but missing")
    return files


def safetensors_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_dir):
        yield from safetensors_file_iterator(file)


def safetensors_file_iterator(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{file}: not a valid safetensors file: {e}") from e
