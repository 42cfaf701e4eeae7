"""The cache of a sliding-window attention layer: the last W − 1 tokens, exactly.

Policy (docs/architectures.md): HqeKV compresses the *global* attention layers. A
sliding-window layer (Mistral's ``sliding_window``, Gemma3's local layers, Qwen2's
``use_sliding_window``) already bounds its own cache: token i attends to tokens
i − W + 1 … i and nothing older, so transformers keeps the last W − 1 tokens
(``DynamicSlidingWindowLayer``). :class:`SlidingWindowLayer` keeps the same tokens, at the
cache's full-precision dtype (``HqeKVConfig.resolve_fp_dtype``), and drops what leaves
the window, as the model itself would. It never quantizes or evicts: a 512-token window
is small next to a long context, and evicting from it would change what the model
attends to.

Token indices are shared by all rows (left padding occupies cache positions, as in the
unpatched model's masks), so the window is one fixed-size buffer (B, H, W − 1, D) plus a
validity mask (B, W − 1) that is False for padding and for slots not filled yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import HqeKVConfig
from .rows import RowPart, RowStateLayer, check_storable


@dataclass
class SlidingBuffer(RowPart):
    """The last W − 1 tokens of every row: ``keys``, ``values`` (B, Hkv, W − 1, D) and
    ``valid`` (B, W − 1) bool, False for padding and for slots not filled yet."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor

    PART = "sliding"


def sliding_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_index: torch.Tensor,
    key_valid: torch.Tensor,
    query_index: torch.Tensor,
    window: int,
    scaling: float,
) -> torch.Tensor:
    """Causal sliding-window attention, float32 softmax.

    query (B, Hq, S, D); keys/values (B, Hkv, L, D); key_index (L,) and query_index (S,) cache
    indices; key_valid (B, L) bool. Query at index i sees key j when i − W < j ≤ i and the key
    is valid. -> (B, S, Hq, D) in the query's dtype; a query that sees no key gets zeros.
    """
    b, hq, s, d = query.shape
    hkv = keys.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, s, d)
    scores = torch.einsum("bhrsd,bhld->bhrsl", q, keys.float()) * scaling
    visible = (key_index[None, :] <= query_index[:, None]) & (key_index[None, :] > query_index[:, None] - window)
    visible = visible[None] & key_valid[:, None, :]  # (B, S, L)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhrsl,bhld->bhrsd", weights, values.float())
    seen_any = visible.any(-1)[:, None, None, :, None]  # (B, 1, 1, S, 1)
    out = torch.where(seen_any, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.reshape(b, hq, s, d).transpose(1, 2).to(query.dtype)


class SlidingWindowLayer(RowStateLayer):
    """One sliding-window attention layer: the last ``window − 1`` tokens at full precision.

    Used through :meth:`attend`, like :class:`~hqekv.cache.layer.HqeKVLayer`: the prefill is the
    model's own attention (its sliding mask), later inputs attend over the window plus
    themselves with :func:`sliding_attention`. A decode step is a fixed-shape roll of the
    buffer, so it compiles to one graph.
    """

    is_sliding = True
    is_compileable = True
    is_croppable = False

    def __init__(self, config: HqeKVConfig, window: int, layer_idx: int | None = None, max_length: int | None = None):
        super().__init__(max_length)
        if window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {window}")
        self.config = config
        self.window = window
        self.layer_idx = layer_idx
        self.has_tokens = False

    def row_parts(self) -> list[RowPart]:
        return [self.buffer]

    def _adopt_parts(self, parts) -> None:
        (self.buffer,) = parts

    # --- CacheLayerMixin contract ----------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.init_length(self.device)
        self.fp_dtype = self.config.resolve_fp_dtype(self.dtype)
        self.batch_size, self.num_kv_heads, self.head_dim = b, h, d
        slots = self.window - 1
        self.buffer = SlidingBuffer(
            key_states.new_zeros(b, h, slots, d, dtype=self.fp_dtype),
            value_states.new_zeros(b, h, slots, d, dtype=self.fp_dtype),
            torch.zeros(b, slots, dtype=torch.bool, device=self.device),
        )
        self.is_initialized = True
        self.pin()  # fixed-size buffers, written in place: nothing to reserve

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "hqekv's sliding-window layer is used through a model patched with hqekv.patch_model (attend)"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """As ``DynamicSlidingWindowLayer``: the window's tokens plus the new ones."""
        return min(self.seen, self.window - 1) + query_length, max(self.seen - self.window + 1, 0)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an HqeKV cache cannot be cropped")

    def maintain(self) -> None:
        """Eager step before each forward: nothing to flush or re-rank, the window slides as
        tokens arrive. The window, which holds the tokens the steps since stored, is checked
        (:func:`~hqekv.cache.rows.check_storable`): on a CPU at every call, elsewhere every
        ``chunk_size`` calls (one host sync)."""
        if not self.is_initialized:
            return
        if not self.time_to_look(min(self.config.chunk_size, self.window - 1)):
            return
        check_storable(self.layer_idx, (self.buffer.keys, self.buffer.values), (self.fp_dtype,), self.seen)

    # --- attention ---------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        new_valid: torch.Tensor | None = None,
        dense_attention=None,
    ) -> torch.Tensor:
        """Attention of the new tokens over the window and themselves, then store them.

        Shapes as :meth:`hqekv.cache.layer.HqeKVLayer.attend`: query (B, Hq, S, D), key/value
        (B, Hkv, S, D) after RoPE, new_valid (B, S) -> (B, S, Hq, D).
        """
        b, _, s, _ = key.shape
        if new_valid is None:
            new_valid = torch.ones(b, s, dtype=torch.bool, device=key.device)
        self.check_fits(key)
        if not self.is_initialized:
            self._initialize(key, value)
        if not self.has_tokens and not torch.compiler.is_compiling():
            check_storable(self.layer_idx, (key, value), (self.fp_dtype,))
        if not self.has_tokens and dense_attention is not None:
            out = dense_attention(query, key, value)  # the model's own sliding mask: exactly its prefill
        else:
            slots = self.window - 1
            buffer = self.buffer
            keys = torch.cat([buffer.keys, key.to(self.fp_dtype)], dim=2)
            values = torch.cat([buffer.values, value.to(self.fp_dtype)], dim=2)
            index = torch.arange(-slots, s, device=key.device)  # relative to the first new token
            out = sliding_attention(
                query, keys, values, index, torch.cat([buffer.valid, new_valid], 1), index[slots:], self.window, scaling
            )
        self._store(key, value, new_valid)
        return out

    @torch.compiler.disable
    def _initialize(self, key, value) -> None:
        self.lazy_initialization(key, value)

    def _store(self, key, value, new_valid) -> None:
        """Keep the last ``window − 1`` tokens (fixed shapes: an in-place roll)."""
        slots = self.window - 1
        b = self.buffer
        with torch.no_grad():
            for held, new in ((b.keys, key), (b.values, value)):
                held.copy_(torch.cat([held, new.detach().to(held.dtype)], dim=2)[:, :, -slots:] if slots else held)
            b.valid.copy_(torch.cat([b.valid, new_valid], dim=1)[:, -slots:] if slots else b.valid)
        self.has_tokens = True

    # --- accounting ----------------------------------------------------------------------------

    def storage(self) -> dict[str, int]:
        """Real bytes of the window, keys and values plus the validity mask."""
        if not self.is_initialized:
            return {}
        return {self.buffer.PART: self.buffer.nbytes(), "counters": self.length.nbytes}

    def held_tokens(self) -> int:
        """Real (non-padding) tokens in the window, over all rows."""
        return int(self.buffer.valid.sum()) if self.is_initialized else 0
