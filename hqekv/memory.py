"""Honest memory accounting of an HqeKV cache (SPEC §1.1: real bytes, everything counted)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .tiers import FP16, KEY, QUANTIZED_TIERS, TIER_CODE_BITS, TIER_NAMES, VALUE


OVER_BUDGET_WARNING = 1.0
"""Bits per element above the requested bavg at which ``generate`` warns (once per patched model)."""


@dataclass
class MemoryReport:
    """What a cache stores, in real bytes, against what an uncompressed cache would.

    Parameters
    ----------
    bytes_by_part : dict[str, int]
        Real bytes per part, summed over layers: ``k.fp16``, ``k.int4``, ... (codes and
        metadata), ``tail``, ``tables``, ``window`` (queries kept for re-ranking), ``counters``,
        ``sliding``: the exact windows of sliding-attention layers (docs/architectures.md),
        and ``reserve``: pool slots and table columns a static cache holds for chunks to
        come (``max_length``; docs/kernels.md).
    dense_bytes : int
        Bytes a ``DynamicCache`` in the model dtype holds for the same input (padding included;
        in a sliding layer, its window).
    fp16_bytes : int
        Bytes of the real tokens' keys and values at 16 bits.
    elements : int
        Key and value elements of the real tokens seen (evicted ones included).
    code_bits : int
        Code bits the paper counts for them (FP16 chunks and the tail 16, evicted 0).
    chunks : dict[str, int]
        Kept chunks per component and tier and evicted chunks, summed over layers (with
        ``head_tiers``, a chunk of each KV head counts once: a chunk's heads hold tiers of
        their own); tail tokens and real tokens of all sequences (the same in every layer).
    sliding_elements : int
        Of ``elements``, those in sliding-window layers (kept exactly, 16 code bits each).
    requested_bavg : float or None
        The bavg the cache was configured for.
    """

    bytes_by_part: dict[str, int] = field(default_factory=dict)
    dense_bytes: int = 0
    fp16_bytes: int = 0
    elements: int = 0
    code_bits: int = 0
    chunks: dict[str, int] = field(default_factory=dict)
    sliding_elements: int = 0
    requested_bavg: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_part.values())

    @property
    def bavg(self) -> float:
        """Average code bits per element achieved (the paper's bavg)."""
        return self.code_bits / self.elements if self.elements else 0.0

    @property
    def compressed_bavg(self) -> float:
        """Code bits per element in the compressed (global attention) layers alone."""
        n = self.elements - self.sliding_elements
        return (self.code_bits - 16 * self.sliding_elements) / n if n else 0.0

    @property
    def over_budget(self) -> float:
        """Bits per element the compressed layers store above the requested bavg (0 if not above).

        On short inputs the protected FP16 chunks and the FP16 tail are a large share of the
        tokens and push the achieved bavg past the request (:data:`OVER_BUDGET_WARNING`)."""
        if self.requested_bavg is None or not self.elements - self.sliding_elements:
            return 0.0
        return max(0.0, self.compressed_bavg - self.requested_bavg)

    @property
    def effective_bits(self) -> float:
        """Real stored bits per element: everything stored, metadata and bookkeeping included."""
        return 8 * self.total_bytes / self.elements if self.elements else 0.0

    @property
    def ratio_to_dense(self) -> float:
        return self.total_bytes / self.dense_bytes if self.dense_bytes else 0.0

    @property
    def ratio_to_fp16(self) -> float:
        return self.total_bytes / self.fp16_bytes if self.fp16_bytes else 0.0

    def to_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "bytes_by_part": dict(self.bytes_by_part),
            "dense_bytes": self.dense_bytes,
            "fp16_bytes": self.fp16_bytes,
            "ratio_to_dense": self.ratio_to_dense,
            "ratio_to_fp16": self.ratio_to_fp16,
            "elements": self.elements,
            "bavg": self.bavg,
            "effective_bits": self.effective_bits,
            "chunks": dict(self.chunks),
            "sliding_elements": self.sliding_elements,
            "requested_bavg": self.requested_bavg,
            "compressed_bavg": self.compressed_bavg,
            "over_budget": self.over_budget,
        }

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"HqeKV cache: {self.total_bytes / mib:.2f} MiB stored "
            f"({self.ratio_to_fp16:.1%} of FP16 {self.fp16_bytes / mib:.2f} MiB; "
            f"{self.ratio_to_dense:.1%} of the dense cache {self.dense_bytes / mib:.2f} MiB)",
            f"  bavg {self.bavg:.3f} code bits/element, effective {self.effective_bits:.3f} bits/element",
        ]
        if self.sliding_elements:
            lines.append(f"  compressed layers alone: bavg {self.compressed_bavg:.3f} (sliding windows are kept exact)")
        if self.over_budget > OVER_BUDGET_WARNING:
            lines.append(
                f"  above the requested bavg {self.requested_bavg:g} by {self.over_budget:.2f} bits: the protected FP16 "
                f"chunks and the FP16 tail dominate at {self.chunks.get('real_tokens', 0)} tokens"
            )
        for part, n in sorted(self.bytes_by_part.items()):
            if n:
                lines.append(f"  {part:<10} {n / mib:9.3f} MiB")
        c = self.chunks
        if c:
            lines.append(
                "  chunks K: "
                + " ".join(f"{t}={c.get('k.' + t, 0)}" for t in ("fp16", "int4", "int2", "int1"))
                + " | V: "
                + " ".join(f"{t}={c.get('v.' + t, 0)}" for t in ("fp16", "int4", "int2", "int1"))
                + f" | evicted={c.get('evicted', 0)} tail tokens={c.get('tail_tokens', 0)}"
            )
        return "\n".join(lines)


def cache_report(layers: Iterable, requested_bavg: float | None, chunk_size: int) -> MemoryReport:
    """The :class:`MemoryReport` of a cache's layers: each layer's ``storage()`` bytes, and its
    elements and code bits from ``chunk_counts()`` (an HqeKV layer) or ``held_tokens()`` (a
    sliding-window layer, ``is_sliding``).

    Sliding-window layers count as part ``sliding``; their dense and FP16 baselines are the
    window the unpatched model keeps, not the whole sequence.
    """
    report = MemoryReport(requested_bavg=requested_bavg)
    for layer in layers:
        if not layer.is_initialized:
            continue
        for part, n in layer.storage().items():
            report.bytes_by_part[part] = report.bytes_by_part.get(part, 0) + n
        per_token = layer.model_kv_heads * layer.head_dim  # elements per token per component
        elt = torch.empty(0, dtype=layer.dtype).element_size()
        if layer.is_sliding:
            held = layer.held_tokens()
            report.dense_bytes += 2 * layer.rows * min(layer.seen, layer.window - 1) * per_token * elt
            report.fp16_bytes += 2 * held * per_token * 2
            report.elements += 2 * held * per_token
            report.sliding_elements += 2 * held * per_token
            report.code_bits += 2 * held * per_token * 16
            continue
        counts = layer.chunk_counts()
        for part, n in counts.items():
            # chunk counts add up over layers; token counts are the same in every layer
            per_layer = part in ("real_tokens", "tail_tokens")
            report.chunks[part] = n if per_layer else report.chunks.get(part, 0) + n
        report.dense_bytes += 2 * layer.rows * layer.seen * per_token * elt
        report.fp16_bytes += 2 * counts["real_tokens"] * per_token * 2
        report.elements += 2 * counts["real_tokens"] * per_token
        chunk_elements = chunk_size * layer.num_kv_heads * layer.head_dim  # a stored chunk's: one head's under head_tiers
        for comp in (KEY, VALUE):
            for t in (FP16, *QUANTIZED_TIERS):
                bits = TIER_CODE_BITS[t] if t == FP16 else layer.pools[comp].bits(t)  # a prompt's waiting keys: 8
                report.code_bits += counts[f"{comp}.{TIER_NAMES[t]}"] * chunk_elements * bits
        report.code_bits += 2 * counts["tail_tokens"] * per_token * 16
    return report
