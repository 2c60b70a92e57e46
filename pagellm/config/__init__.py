"""Frozen engine configuration, built from EngineArgs by `create_engine_config()`.

Each section is a small frozen dataclass; `EngineConfig` groups them. Values that are
only known once the model is loaded (the number of KV blocks) are written back with
`dataclasses.replace` after the engine core's handshake.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagellm.config.arch_config import head_dim_of, num_kv_heads_of

if TYPE_CHECKING:  # the CLI parses and checks flags without loading torch
    import torch


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class ServedModelNames:
    """The names the OpenAI server answers to (model_executor.model_names makes them)."""

    served: list[str]
    """Listed by /v1/models; the first is the one responses report when a request gives none."""
    aliases: list[str]
    """Also accepted in requests, not listed."""


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's PoolerConfig, the fields pagellm reads (--pooler-config as JSON)."""

    pooling_type: str | None = None
    """LAST (the final prompt token's hidden state, vLLM's default for decoders), MEAN
    (the average over the prompt's tokens) or CLS (the first token's); None: from the
    model's sentence-transformers config (1_Pooling/config.json), else LAST."""
    normalize: bool | None = None
    """Default of PoolingParams.normalize; None: True unless the model's
    sentence-transformers modules.json lists no Normalize module."""


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """The model as the user named it (path, .gguf file or hub id)."""
    model_path: str
    """Resolved local path: a model directory or a .gguf file."""
    tokenizer: str
    """Where the tokenizer comes from (defaults to model_path)."""
    dtype: str
    """Resolved compute dtype of weights and KV cache, by name ('float32', 'bfloat16',
    'float16'; a torch.dtype given here is stored by its name): the frontend builds and
    pickles this config without importing torch. `torch_dtype` is the torch object."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    seed: int
    """Global seed for reproducible sampling."""
    served_names: ServedModelNames
    """The names the OpenAI server lists and accepts (model_executor.model_names)."""
    hf_config: Any = field(compare=False, repr=False)
    """ArchConfig of the model (config.json keys, from the directory or GGUF metadata)."""
    generation_config: dict = field(default_factory=dict, compare=False, repr=False)
    """Defaults from generation_config.json (eos ids), if any."""
    quantization: str | None = None
    """How linear weights are stored and multiplied, resolved from the checkpoint:
    'gguf' (GGUF blocks kept quantized, multiplied by CPU kernels) or None (weights in
    `dtype`; GGUF files are then dequantized at load)."""
    max_logprobs: int = 20
    """Most logprobs (and prompt logprobs) per token a request may ask for; -1 means
    the vocabulary size. vLLM's ModelConfig.max_logprobs, with its default."""
    gguf_activations: str = "auto"
    """Activations of GGUF linears on decode rows: 'q8' (int8 per 32 values, as llama.cpp),
    'q8x2' (two int8 levels) or 'float32' (exact); EngineArgs stores it resolved, 'auto'
    (the rule in quantization.resolve_gguf_activations) is resolved when the model loads."""
    runner_type: str = "generate"
    """'generate' (sampling, the completion endpoints) or 'pooling' (embeddings: each
    prompt runs once and its pooled final hidden state is returned). vLLM's --runner."""
    pooler_config: PoolerConfig | None = None
    """How a pooling engine pools (resolved; None on a generate engine)."""
    is_encoder_only: bool = False
    """An encoder family (BERT; the registry's `encoder_only`): pooling only, whole
    prompts, no KV cache."""

    @property
    def is_matryoshka(self) -> bool:
        return bool(getattr(self.hf_config, "is_matryoshka", False) or self.matryoshka_dimensions)

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return getattr(self.hf_config, "matryoshka_dimensions", None)

    @property
    def served_model_name(self) -> str:
        """The name the OpenAI server reports (the first it lists)."""
        return self.served_names.served[0]

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # torch.float32 -> 'float32'
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"]
        return archs[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return num_kv_heads_of(self.hf_config)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.hf_config)

    def eos_token_ids(self, tokenizer: Any) -> tuple[int | None, list[int]]:
        """(the EOS id: the tokenizer's, else config.json's first; the other ids
        generation_config.json lists as EOS, which stop generation too)."""
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        gen = self.generation_config.get("eos_token_id")
        gen = gen if isinstance(gen, list) else [gen] if gen is not None else []
        return eos, [t for t in gen if t != eos]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def q8_kv_cache_refusal(model_config: ModelConfig, device: str, block_size: int) -> str | None:
    """Why a q8_0 KV cache cannot serve this model here (None: it can). Only pagellm's C
    attention reads it (paged_attention.c): CPU, float32 activations, blocks of 16 and
    heads of 32-256 dims in whole q8_0 blocks, on a build with the AVX2 kernels."""
    if device != "cpu":
        return f"is a CPU cache (device {device})"
    if model_config.dtype != "float32":
        return f"needs float32 activations (dtype {model_config.dtype})"
    if block_size != 16:
        return f"needs block_size 16 (got {block_size})"
    head_dim = model_config.head_dim
    if head_dim % 32 or head_dim > 256:
        return f"needs a head dim that is a multiple of 32 up to 256 (this model's: {head_dim})"
    from pagellm import kernels

    # read from the CPU's flags, as the int8-activation rule is: nothing is built here
    if not kernels.simd_flags_available() or kernels.find_compiler() is None:
        return "needs pagellm's AVX2 attention kernels (an x86 CPU with AVX2, FMA and F16C, and a C compiler)"
    return None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    cache_dtype: str = "float32"
    """The KV cache's storage dtype, resolved from EngineArgs.kv_cache_dtype (a torch dtype
    name: float32, float16 or bfloat16; or q8_0, llama.cpp's blocks of int8 values and
    float16 scales: `attention.backend.cache_torch_dtype`)."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV cache budget in bytes; overrides the memory fraction."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (CUDA: total; CPU: of available RAM, capped)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    num_gpu_blocks: int | None = None
    """Number of KV blocks, filled in after the model is loaded and memory is measured."""
    num_gpu_blocks_override: int | None = None
    """Force this number of KV blocks (tests, debugging)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prompt chunks + decodes)."""
    max_model_len: int = 2048
    """Copy of ModelConfig.max_model_len for the scheduler."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    policy: str = "fcfs"
    """'fcfs' or 'priority' (lower priority value first, then arrival)."""


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    """Number of engine-core processes (independent model replicas)."""
    data_parallel_rank: int | None = None
    """With external load balancing: the one rank this client drives."""
    data_parallel_external_lb: bool = False
    """An external router balances across ranks; this client talks to one rank."""
    restart_engine_on_failure: bool = False
    """The async client starts a new engine-core process (same config, same rank) when one
    dies, instead of failing every later request."""
    engine_iteration_timeout_s: float = 60.0
    """Seconds an engine core may go with work and no progress (or no heartbeat at all)
    before its client treats it as hung: kills it and handles it as a death. 0: never."""
    data_parallel_size_local: int | None = None
    """Ranks this node runs (data_parallel_start_rank onwards); None: every rank from the
    start rank on. The head runs ranks 0..n-1; `--headless` nodes run the others."""
    data_parallel_start_rank: int = 0
    """First rank this node runs (0 on the head)."""
    data_parallel_address: str | None = None
    """The head's address for the engine sockets (TCP). None: one machine, IPC sockets."""
    data_parallel_rpc_port: int = 29550
    """The head binds its request socket on this port and its output socket on port + 1."""
    data_parallel_backend: str = "mp"
    """How the head starts its engine cores: 'mp' (processes of this machine) or 'ray' (Ray
    actors on a Ray cluster, placed by one placement group; they connect over TCP)."""
    tensor_parallel_size: int = 1
    """Processes that each hold a shard of the model (heads, MLP columns, vocabulary) and
    run every step together over gloo: the engine core is rank 0 and starts the others on
    its machine (pagellm/core/tensor_parallel.py)."""

    @property
    def local_ranks(self) -> range:
        """The data-parallel ranks whose engine-core processes this node starts."""
        start = self.data_parallel_start_rank
        n = self.data_parallel_size - start if self.data_parallel_size_local is None else self.data_parallel_size_local
        return range(start, start + n)

    @property
    def num_engines_on_this_machine(self) -> int:
        """Engine cores that share this machine's CPU cores: the ranks this node runs when
        ranks span nodes (data_parallel_address), else every rank (one machine, including
        one server per rank behind an external balancer)."""
        if self.data_parallel_address is None:
            return self.data_parallel_size
        return max(1, len(self.local_ranks))


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    """Resolved device type: 'cpu' or 'cuda'."""


@dataclass(frozen=True)
class AttentionConfig:
    backend: str = "torch"
    """Attention backend name (see `pagellm.attention`), chosen once for the model and
    the model runner."""


@dataclass(frozen=True)
class CompilationConfig:
    mode: int = 0
    """0 = eager; >= 1 = torch.compile the model forward."""
    backend: str = "inductor"
    """torch.compile backend when mode >= 1."""


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): each step a decoding request
    runs its last token plus up to `num_speculative_tokens` proposed ones, and keeps the
    proposals the model itself would have produced."""

    method: str | None = None
    """How tokens are proposed: 'ngram' (prompt lookup: the tokens that followed the
    latest earlier occurrence of the request's last n tokens, in its prompt or output) or
    'draft_model' (a smaller model of the same vocabulary, `model`, decodes them greedily).
    None: 'draft_model' when `model` names one, else 'ngram' (vLLM infers it from `model`
    too)."""
    num_speculative_tokens: int | None = None
    """Most tokens proposed per request per step (required)."""
    model: str | None = None
    """The draft model (method 'draft_model'): a path, .gguf file or hub id, as the target's
    `model`. Its tokenizer must give the same ids as the target's."""
    prompt_lookup_max: int | None = None
    """Longest n-gram matched (tried first); default: prompt_lookup_min, or 5 without either."""
    prompt_lookup_min: int | None = None
    """Shortest n-gram matched; default: prompt_lookup_max, or 5 without either."""
    disable_by_batch_size: int | None = None
    """No proposals in a step with at least this many running requests (None: never off
    for that; a step still proposes only while its decode rows and proposals fit the
    int8 decode kernels' 16 rows, see pagellm.spec_decode)."""
    draft_model_config: ModelConfig | None = field(default=None, repr=False, compare=False)
    """The draft model's ModelConfig, made by EngineArgs from `model` (as vLLM makes its
    draft_model_config); None for 'ngram'."""

    def __post_init__(self) -> None:
        if self.method is None:  # vLLM's inference: a model other than "ngram" is a draft
            inferred = "draft_model" if self.model not in (None, "ngram", "[ngram]") else "ngram"
            object.__setattr__(self, "method", inferred)

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(shortest, longest) n-gram, defaults filled as vLLM fills them."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 5, 5
        return (lo if lo is not None else hi), (hi if hi is not None else lo)  # type: ignore[return-value]

    def verify(self) -> None:
        """A clear error for every field out of range (before any model loads)."""
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model must name the draft model for method 'draft_model', "
                             "e.g. {\"method\": \"draft_model\", \"model\": \"draft.gguf\", "
                             "\"num_speculative_tokens\": 4}.")
        if self.method == "ngram" and self.model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config.model ({self.model!r}) applies to method 'draft_model'; "
                             "method 'ngram' proposes from the request's own tokens.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}.")
        lo, hi = self.lookup_range
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed "
                             f"prompt_lookup_max ({hi}).")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be a positive integer, got {b!r}.")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    """Grammar library for structured outputs: auto (xgrammar, falling back to guidance
    where xgrammar refuses a constraint), xgrammar or guidance."""
    reasoning_parser: str = ""
    """Reasoning parser of the model (e.g. deepseek_r1, qwen3): a constraint applies only
    after the reasoning ends."""


@dataclass(frozen=True)
class ObservabilityConfig:
    disable_log_stats: bool = False
    """Do not log periodic throughput statistics."""
    log_stats_interval: float = 5.0
    """Seconds between throughput log lines."""


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    compilation_config: CompilationConfig = CompilationConfig()
    attention_config: AttentionConfig = AttentionConfig()
    observability_config: ObservabilityConfig = ObservabilityConfig()
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative_config: SpeculativeConfig | None = None
    """None: no speculative decoding."""

    def fingerprint(self) -> dict[str, str]:
        """What every data-parallel rank must agree on, field by field (values as text): a
        node builds its config from its own flags, and the head refuses a rank whose
        fingerprint differs from its own (pagellm/engine/handshake.py). Scheduling limits
        and memory budgets may differ between nodes; what changes a request's result or
        what the frontend may send may not."""
        mc, cc = self.model_config, self.cache_config
        config_digest, weight_bytes = _model_digest(mc)
        return {
            "pagellm": _pagellm_version(),  # the wire's messages are positional: one version
            "model": mc.architecture,
            "model_config": config_digest,
            "weight_bytes": str(weight_bytes),
            "dtype": mc.dtype,
            "quantization": str(mc.quantization),
            "gguf_activations": mc.gguf_activations,
            "kv_cache_dtype": cc.cache_dtype,
            "max_model_len": str(mc.max_model_len),
            "block_size": str(cc.block_size),
            "max_logprobs": str(mc.max_logprobs),
            "runner": mc.runner_type,
            "pooler_config": repr(mc.pooler_config),
            "seed": str(mc.seed),
            "data_parallel_size": str(self.parallel_config.data_parallel_size),
            "tensor_parallel_size": str(self.parallel_config.tensor_parallel_size),
            "attention_backend": self.attention_config.backend,
            "structured_outputs_backend": self.structured_outputs_config.backend,
            "reasoning_parser": self.structured_outputs_config.reasoning_parser,
            "speculative_config": repr(self.speculative_config),
        }

    def with_data_parallel_rank(self, rank: int) -> EngineConfig:
        return dataclasses.replace(
            self, parallel_config=dataclasses.replace(self.parallel_config, data_parallel_rank=rank)
        )


def _model_digest(mc: ModelConfig) -> tuple[str, int]:
    """The model's identity without reading its weights: a hash of its architecture config
    (without what names where it was read from, or by which transformers) and the size in
    bytes of its weight files (a GGUF file, or a directory's safetensors), so two
    quantizations of one model differ. Its path may differ by node."""
    import hashlib
    import json
    import os

    path = mc.model_path
    if os.path.isdir(path):
        size = sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith((".safetensors", ".bin", ".gguf")))
    else:
        size = os.path.getsize(path) if os.path.exists(path) else 0
    values = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {"repr": repr(mc.hf_config)}
    values = {k: v for k, v in values.items() if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(values, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:12], size


def _pagellm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagellm")
    except PackageNotFoundError:
        return "unknown"
