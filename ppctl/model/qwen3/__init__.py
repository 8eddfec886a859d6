"""The Qwen3 family: Llama's blocks with each query and key head RMS-normalised before the rotation (Qwen3).

Everything but the shape is the Llama family's (``ppctl.model.llama``: its settings, checks, chunk, layers and
parameter rules, the memory shape): the shape is Llama's with ``qk_norm`` on, which gives every attention a
``q_norm`` and a ``k_norm`` of ``head_dim`` scales (``GroupedQueryAttention``). Each TP rank holds whole heads, so the
norms need no communication; their scales are replicated, and each TP rank's gradient of them is its own heads'
share, summed over TP at every layout (``ParameterRule.tp_partial``). Its Hugging Face format (``hf.py``) is
``Qwen3ForCausalLM``. Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from ppctl.model.llama import FAMILY as LLAMA


def _shape_of(resolved):
    """Llama's ``LlamaConfig`` of a ``ResolvedModel``, with the per-head q/k norms."""
    return dataclasses.replace(LLAMA.shape_of(resolved), qk_norm=True)


def _hf():
    from ppctl.model.qwen3.hf import FORMAT

    return FORMAT


FAMILY = dataclasses.replace(LLAMA, name="qwen3", shape_of=_shape_of, hf=_hf)
