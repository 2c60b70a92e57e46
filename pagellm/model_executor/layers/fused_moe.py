"""Mixture-of-experts feed-forward: a router picks `top_k` of `num_experts` SiLU-gated
MLPs for each token, and the token's output is their outputs weighted by the router's
probabilities (Qwen2-MoE, Qwen3-MoE; Qwen2-MoE adds an always-on shared expert, in the
model module).

Weights. On the float path the experts are two float tensors, w13 [E, 2I, H] (gate rows
then up rows of each expert) and w2 [E, H, I]. On the GGUF path they stay in the file's
blocks: llama.cpp stores each projection of all experts as one 3-D tensor
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [E, rows, cols]), which is kept as a view
of the memory-mapped file; expert e is rows e*rows .. (e+1)*rows of it, multiplied by the
GGUF kernels in place (int8 activations for a step's decode rows where the file's type has
an int8 kernel, as for every other GGUF linear). Nothing is dequantized; a type without a
kernel is, with one log line.

Compute. Each expert that any token of the step chose runs once, over all the rows routed
to it (so its weights are read once a step), in ascending expert order; each row's
outputs are summed in that order, as transformers sums them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model_executor.layers.activation import SiluAndMul
from pagellm.model_executor.layers.quantization import QuantizationConfig
from pagellm.model_executor.layers.quantization.gguf import (
    INT8_LEVELS,
    WeightGroup,
    _as_block_matrix,
    gguf_matmul,
    int8_rows,
)
from pagellm.platforms import platform_of

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize = renormalize
        """Scale the chosen probabilities to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
        self.prefix = prefix
        self.act = SiluAndMul()
        self.kernels = platform_of("cpu").kernels()
        """pagellm's C kernels (routing CPU logits), or None: torch's softmax and topk."""
        self.gguf = quant_config is not None and quant_config.get_name() == "gguf"
        e, h, i = num_experts, hidden_size, intermediate_size
        if self.gguf:
            activations = getattr(quant_config, "activations", "float32")
            self.q8 = activations != "float32"
            self.int8_levels = INT8_LEVELS[activations]
            self._stacked: dict[str, tuple[int, Any]] = {}
            self.expert_groups: list[tuple[list[WeightGroup], list[WeightGroup]]] = []
            """Per expert: (gate|up groups into [rows, 2I], down groups into [rows, H])."""
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self._loaded: dict[str, set[int]] = {p: set() for p in PROJECTIONS}

    # -- loading ---------------------------------------------------------------------

    def expected_weights(self) -> list[str]:
        """What the loader must have filled: each projection of every expert."""
        return list(PROJECTIONS)

    def loaded_weights(self) -> list[str]:
        return [p for p in PROJECTIONS if len(self._loaded[p]) == self.num_experts]

    def load_expert(self, projection: str, expert: int | None, tensor: Any) -> None:
        """One expert's projection (HF's `experts.{e}.gate_proj.weight`), or all experts'
        stacked (expert None: a [E, rows, cols] tensor, or a GGUF 3-D tensor in blocks)."""
        if projection not in PROJECTIONS:
            raise KeyError(f"{self.prefix}: no expert projection {projection!r}")
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        rows, cols = (h, i) if projection == "down_proj" else (i, h)
        if expert is None:
            if self.gguf:
                self._stacked[projection] = _as_block_matrix(
                    f"{self.prefix}.experts.{projection}", tensor, e * rows, cols)
            else:
                if tuple(tensor.shape) != (e, rows, cols):
                    raise ValueError(f"{self.prefix}.experts.{projection}: expected shape "
                                     f"{(e, rows, cols)}, got {tuple(tensor.shape)}")
                for k in range(e):
                    self._copy(projection, k, tensor[k])
            self._loaded[projection] = set(range(e))
            return
        if not 0 <= expert < e:
            raise KeyError(f"{self.prefix}: expert {expert} of {e}")
        if self.gguf:
            raise ValueError(f"{self.prefix}: a GGUF file holds experts stacked, not one by one")
        if tuple(tensor.shape) != (rows, cols):
            raise ValueError(f"{self.prefix}.experts.{expert}.{projection}: expected shape "
                             f"{(rows, cols)}, got {tuple(tensor.shape)}")
        self._copy(projection, expert, tensor)
        self._loaded[projection].add(expert)

    def _copy(self, projection: str, expert: int, tensor: torch.Tensor) -> None:
        i = self.intermediate_size
        target = {"gate_proj": lambda: self.w13[expert, :i], "up_proj": lambda: self.w13[expert, i:],
                  "down_proj": lambda: self.w2[expert]}[projection]()  # fmt: skip
        with torch.no_grad():
            target.copy_(tensor)

    def process_weights_after_loading(self) -> None:
        """GGUF: each expert's rows as weight groups over the stacked blocks (views)."""
        if not self.gguf or self.expert_groups or not self._stacked:
            return
        i, h = self.intermediate_size, self.hidden_size
        (gt, gate), (ut, up), (dt, down) = (self._stacked[p] for p in PROJECTIONS)
        gate, up, down = (_rows_of(m) for m in (gate, up, down))
        for k in range(self.num_experts):
            self.expert_groups.append((
                [WeightGroup(gt, gate[k * i : (k + 1) * i], 0, i),
                 WeightGroup(ut, up[k * i : (k + 1) * i], i, i)],
                [WeightGroup(dt, down[k * h : (k + 1) * h], 0, h)],
            ))  # fmt: skip
        self._stacked = {}

    # -- compute ---------------------------------------------------------------------

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in the logits' dtype, expert ids [T, top_k]): softmax over
        the experts in float32, the top_k, renormalised where the family does. float32
        logits on the CPU take the C pass the one-region stack also routes with
        (`pg_moe_route`), so both paths pick the same experts."""
        lib = self.kernels if router_logits.is_cpu else None  # CPU kernels, CPU logits
        if lib is not None and router_logits.dtype == torch.float32 and router_logits.dim() == 2:
            logits = router_logits.contiguous()
            t, e = logits.shape
            probs = torch.empty(t, e, dtype=torch.float32)
            ids = torch.empty(t, self.top_k, dtype=torch.int64)
            weights = torch.empty(t, self.top_k, dtype=torch.float32)
            lib.pg_moe_route(logits.data_ptr(), t, e, self.top_k, int(self.renormalize),
                             probs.data_ptr(), ids.data_ptr(), weights.data_ptr())
            return weights, ids
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype), ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        weights, ids = self.route(router_logits)
        out = torch.zeros_like(x)
        hit = torch.bincount(ids.reshape(-1), minlength=self.num_experts).nonzero().flatten().tolist()
        q8 = self._q8_mask(x.shape[0]) if self.gguf else None
        for expert in hit:
            rows, slot = torch.where(ids == expert)
            h = self._expert(expert, x[rows], None if q8 is None else q8[rows])
            out.index_add_(0, rows, h * weights[rows, slot, None])
        return out

    def _q8_mask(self, t: int) -> torch.Tensor | None:
        """Which of the step's rows multiply int8 activations (int8_rows), as a mask."""
        if not self.q8:
            return None
        rows = int8_rows(t)
        if rows is None:
            return None
        mask = torch.zeros(t, dtype=torch.bool)
        mask[rows] = True
        return mask

    def _expert(self, expert: int, x: torch.Tensor, q8: torch.Tensor | None) -> torch.Tensor:
        """Expert `expert`'s MLP on its rows x [M, H]."""
        if not self.gguf:
            return F.linear(self.act.forward(F.linear(x, self.w13[expert])), self.w2[expert])
        gate_up, down = self.expert_groups[expert]
        rows: slice | torch.Tensor | None = None
        if q8 is not None and bool(q8.any()):
            rows = slice(0, x.shape[0]) if bool(q8.all()) else q8.nonzero().flatten()
        kw = {"float_direct_rows": 0, "int8_levels": self.int8_levels} if self.q8 else {}
        h = gguf_matmul(gate_up, x, 2 * self.intermediate_size, rows, **kw)
        return gguf_matmul(down, self.act.forward(h), self.hidden_size, rows, **kw)


def _rows_of(matrix: Any) -> Any:
    """The [rows, row_bytes] uint8 rows of a stacked projection: the file's mapping for a
    GGUF tensor, the float32 values' bytes where it was dequantized."""
    import numpy as np

    if isinstance(matrix, np.ndarray):
        return np.ascontiguousarray(matrix, dtype=np.float32).view(np.uint8)
    return matrix.data
