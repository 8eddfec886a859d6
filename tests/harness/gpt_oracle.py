"""An independent GPT written in plain PyTorch, used as an oracle for ppctl's model.

It shares no code with ``ppctl``: attention, rotary embedding, MLP, loss and the
mapping of parameter names are written here from the model's description, so a test
that compares the two checks ppctl's model against a second implementation.

The oracle keeps its own parameter structure (separate query, key and value
projections, exactly ``vocab_size`` vocabulary rows) and translates from and to
ppctl's global parameter names (``embedding.word.weight``,
``layers.<i>.attention.qkv.weight``, ...) in ``load_ppctl_parameters`` and
``ppctl_gradients``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class OracleConfig:
    """Shape of the oracle GPT (the same fields as the model it checks, without padding)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_length: int
    position_embedding: str = "learned"
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-5
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


def rotary_tables(position_ids: torch.Tensor, head_dim: int, base: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the rotary angles, ``[batch, 1, seq, head_dim]``, computed in float64.

    Frequency ``i`` (0 <= i < head_dim/2) is ``base ** (-2i / head_dim)``; the angle of a
    token is its position times the frequency, and the table repeats the half-width
    angles twice, ``[angles, angles]``, to match the rotate-half convention.
    """
    half = head_dim // 2
    frequencies = torch.tensor([base ** (-2.0 * i / head_dim) for i in range(half)], dtype=torch.float64)
    angles = position_ids.to(torch.float64)[..., None] * frequencies.to(position_ids.device)
    doubled = torch.cat([angles, angles], dim=-1)[:, None]
    return doubled.cos().to(dtype), doubled.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[j], x[j + d/2])`` of ``x [batch, heads, seq, d]`` by the tabled angles."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class OracleAttention(nn.Module):
    """Causal multi-head self-attention with separate query, key and value projections."""

    def __init__(self, config: OracleConfig, dtype: torch.dtype):
        super().__init__()
        width = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.query = nn.Linear(width, width, bias=False, dtype=dtype)
        self.key = nn.Linear(width, width, bias=False, dtype=dtype)
        self.value = nn.Linear(width, width, bias=False, dtype=dtype)
        self.out = nn.Linear(width, width, bias=True, dtype=dtype)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden]`` -> ``[batch, heads, seq, head_dim]``."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Attend causally over ``x [batch, seq, hidden]``; ``rotary`` is ``(cos, sin)`` or None."""
        q, k, v = (self.split_heads(projection(x)) for projection in (self.query, self.key, self.value))
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        seq = x.shape[1]
        visible = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(x.shape)
        return self.out(mixed)


class OracleMLP(nn.Module):
    """Linear, exact (erf) GELU, Linear."""

    def __init__(self, config: OracleConfig, dtype: torch.dtype):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.ffn_hidden_size, dtype=dtype)
        self.down = nn.Linear(config.ffn_hidden_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x [batch, seq, hidden]``."""
        return self.down(F.gelu(self.up(x), approximate="none"))


class OracleNorm(nn.Module):
    """LayerNorm with a learned scale and shift."""

    def __init__(self, width: int, epsilon: float, dtype: torch.dtype):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.ones(width, dtype=dtype))
        self.shift = nn.Parameter(torch.zeros(width, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return F.layer_norm(x, (x.shape[-1],), self.scale, self.shift, self.epsilon)


class OracleBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: OracleConfig, dtype: torch.dtype):
        super().__init__()
        self.ln1 = OracleNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.attn = OracleAttention(config, dtype)
        self.ln2 = OracleNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.mlp = OracleMLP(config, dtype)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Return the block output ``[batch, seq, hidden]``."""
        x = x + self.attn(self.ln1(x), rotary)
        return x + self.mlp(self.ln2(x))


class OracleGPT(nn.Module):
    """The whole GPT: embeddings, blocks, final norm, output head and per-token cross-entropy.

    Parameters start at zero; fill them with ``load_ppctl_parameters``.
    """

    def __init__(self, config: OracleConfig, dtype: torch.dtype = torch.float64):
        super().__init__()
        if config.position_embedding not in ("learned", "rope"):
            raise ValueError(f"unknown position embedding {config.position_embedding!r}")
        self.config = config
        self.token_table = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.position_table = (nn.Embedding(config.max_seq_length, config.hidden_size, dtype=dtype)
                               if config.position_embedding == "learned" else None)
        self.blocks = nn.ModuleList(OracleBlock(config, dtype) for _ in range(config.num_layers))
        self.ln_final = OracleNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if config.tie_embeddings:
            self.head.weight = self.token_table.weight
        for param in self.parameters():
            nn.init.zeros_(param)

    def forward(self, token_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab_size]`` for ``token_ids`` and ``position_ids`` ``[batch, seq]``."""
        x = self.token_table(token_ids)
        rotary = None
        if self.position_table is not None:
            x = x + self.position_table(position_ids)
        else:
            rotary = rotary_tables(position_ids, self.config.head_dim, self.config.rope_base, x.dtype)
        for block in self.blocks:
            x = block(x, rotary)
        return self.head(self.ln_final(x))

    def token_losses(self, token_ids: torch.Tensor, position_ids: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy ``[batch, seq]``: log-sum-exp of the logits minus the label's logit."""
        logits = self(token_ids, position_ids)
        label_logits = logits.gather(-1, labels[..., None]).squeeze(-1)
        return torch.logsumexp(logits, dim=-1) - label_logits

    def ppctl_name_map(self) -> dict[str, list[str]]:
        """For each ppctl global parameter name, the oracle parameters whose rows, stacked, make it."""
        names = {"embedding.word.weight": ["token_table.weight"]}
        if self.position_table is not None:
            names["embedding.position.weight"] = ["position_table.weight"]
        for index in range(self.config.num_layers):
            names.update(_layer_name_map(index))
        names["final_norm.weight"] = ["ln_final.scale"]
        names["final_norm.bias"] = ["ln_final.shift"]
        if not self.config.tie_embeddings:
            names["output_layer.weight"] = ["head.weight"]
        return names

    @torch.no_grad()
    def load_ppctl_parameters(self, ppctl_parameters: dict[str, torch.Tensor]) -> None:
        """Copy values given by ppctl global name; vocabulary tensors give their first ``vocab_size`` rows."""
        name_map = self.ppctl_name_map()
        _check_same_names(set(ppctl_parameters), set(name_map))
        own = dict(self.named_parameters())
        for ppctl_name, oracle_names in name_map.items():
            row_counts = [own[name].shape[0] for name in oracle_names]
            rows = ppctl_parameters[ppctl_name][:sum(row_counts)]
            for name, part in zip(oracle_names, rows.split(row_counts)):
                own[name].copy_(part)

    def ppctl_gradients(self) -> dict[str, torch.Tensor]:
        """The oracle's gradients by ppctl global name (vocabulary tensors: the ``vocab_size`` real rows)."""
        own = dict(self.named_parameters())
        return {ppctl_name: torch.cat([own[name].grad for name in oracle_names])
                for ppctl_name, oracle_names in self.ppctl_name_map().items()}


def _layer_name_map(index: int) -> dict[str, list[str]]:
    """The ppctl-to-oracle name map of transformer layer ``index``."""
    ppctl, oracle = f"layers.{index}.", f"blocks.{index}."
    return {
        ppctl + "attn_norm.weight": [oracle + "ln1.scale"],
        ppctl + "attn_norm.bias": [oracle + "ln1.shift"],
        ppctl + "attention.qkv.weight": [oracle + f"attn.{part}.weight" for part in ("query", "key", "value")],
        ppctl + "attention.proj.weight": [oracle + "attn.out.weight"],
        ppctl + "attention.proj.bias": [oracle + "attn.out.bias"],
        ppctl + "mlp_norm.weight": [oracle + "ln2.scale"],
        ppctl + "mlp_norm.bias": [oracle + "ln2.shift"],
        ppctl + "mlp.fc_in.weight": [oracle + "mlp.up.weight"],
        ppctl + "mlp.fc_in.bias": [oracle + "mlp.up.bias"],
        ppctl + "mlp.fc_out.weight": [oracle + "mlp.down.weight"],
        ppctl + "mlp.fc_out.bias": [oracle + "mlp.down.bias"],
    }


def _check_same_names(given: set[str], expected: set[str]) -> None:
    """Raise KeyError unless the given parameter names are exactly the expected ones."""
    if given != expected:
        raise KeyError(f"parameter names differ: missing {sorted(expected - given)}, "
                       f"unexpected {sorted(given - expected)}")
