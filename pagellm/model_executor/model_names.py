"""The names the server answers to: what `/v1/models` lists and what a request's `model`
may say. In: the model as the user named it, its resolved path, `--served-model-name`.
Out: ServedModelNames (listed ids, first one reported; extra aliases accepted).

Without `--served-model-name`, a GGUF file is listed under a clean id
(`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`), and its file name,
the model as given and the file's `general.name` are accepted too, so a client may use
whichever it read in the docs. Names given with `--served-model-name` are the only ones.
"""

from __future__ import annotations

import os
import re

from pagellm.config import ServedModelNames

# A trailing quantization tag as llama.cpp's tools and hub uploads spell it:
# .Q4_1, -Q4_K_M, .q8_0, -IQ4_XS, .F16, -bf16, .Q4_0_4_4 ...
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16)$", re.IGNORECASE)


def gguf_model_id(path: str) -> str:
    """`dir/SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`."""
    stem = os.path.basename(path).removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem) or stem


def served_model_names(model: str | None, model_path: str, given: list[str]) -> ServedModelNames:
    """`given` (--served-model-name) wins; otherwise a GGUF gets its clean id and an HF
    directory or hub id its name as given (vLLM's rule)."""
    from pagellm.model_executor.weight_utils import GGUFIndex, is_gguf

    if given:
        return ServedModelNames(list(given), [])
    if not is_gguf(model_path):
        return ServedModelNames([model or os.path.basename(model_path.rstrip(os.sep))], [])
    served = gguf_model_id(model_path)
    candidates = [os.path.basename(model_path), model, GGUFIndex(model_path).name]
    return ServedModelNames([served], [a for a in dict.fromkeys(candidates) if a and a != served])
