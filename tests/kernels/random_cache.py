"""A random mixed-tier cache in the ``mixed_attention`` layout, for kernel tests and benchmarks."""

from __future__ import annotations

import torch

from hqekv.tiers import INT4, QUANTIZED_TIERS, TIER_FORMATS
from hqekv.kernels.mixed_attention import PackedCache
from hqekv.kernels.quantize_pack import quantize_pack_reference


def random_mixed_cache(
    b: int, hq: int, hkv: int, s: int, d: int, n_chunks: int, g: int = 32, value_group: int = 32,
    dtype=torch.float32, tiers=(0, 1, 2, 3), empty_every: int = 0, seed: int = 0, device="cpu", quantize=None,
    fp_dtype=None, int4_bits=(4, 4),
) -> dict:  # fmt: skip
    """The inputs of ``mixed_attention`` by name, the cache's fields laid out flat (so that a
    test can replace one; :func:`packed` gathers them), with ``n_chunks`` table entries per row.

    Each row's chunks get tiers drawn from ``tiers`` (K and V independently); every
    ``empty_every``-th entry is left empty (-1). Pools hold the chunks in shuffled slots plus
    a free slot at the end. ``quantize`` defaults to the reference quantizer. ``fp_dtype``
    stores the FP16 pools and the tails in another dtype than the queries (as a cache does
    for an fp32 model). ``int4_bits``: the code width of the keys' and the values' 4-bit
    pools (8: a prompt's waiting chunks, :data:`hqekv.tiers.WIDE_BITS`).
    """
    quantize = quantize or quantize_pack_reference
    gen = torch.Generator().manual_seed(seed)
    meta_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    tables = {}
    pools = {}
    for comp, width in zip(("k", "v"), int4_bits):
        tier = torch.tensor(tiers)[torch.randint(len(tiers), (b, n_chunks), generator=gen)]
        if empty_every:
            tier[:, empty_every - 1 :: empty_every] = -1
        slot = torch.full_like(tier, -1)
        comp_pools = []
        for t in (0, *QUANTIZED_TIERS):
            rows, cols = (tier == t).nonzero(as_tuple=True)
            n = rows.numel()
            slot[rows, cols] = torch.randperm(n, generator=gen)
            chunks = randn(n + 1, hkv, g, d) * (1 + torch.arange(d, device=device) % 3)  # + 1 free slot
            if t == 0:
                comp_pools.append(chunks if fp_dtype is None else chunks.to(fp_dtype))
            else:
                bits, normalized = TIER_FORMATS[t]
                bits = width if t == INT4 else bits
                comp_pools += quantize(chunks, bits, normalized, comp == "k", value_group, meta_dtype)
        tables[f"{comp}_tier"], tables[f"{comp}_slot"] = tier.to(device), slot.to(device)
        pools[f"{comp}_pools"] = comp_pools
    tail_len = torch.randint(0, g + 1, (b,), generator=gen).to(device)
    new_valid = torch.ones(b, s, dtype=torch.bool)
    if s > 1:
        new_valid[0, 0] = False  # left padding in row 0
    return dict(
        query=randn(b, hq, s, d), key=randn(b, hkv, s, d), value=randn(b, hkv, s, d),
        new_valid=new_valid.to(device), **pools, **tables,
        tail_k=randn(b, hkv, g, d).to(fp_dtype or dtype), tail_v=randn(b, hkv, g, d).to(fp_dtype or dtype), tail_len=tail_len,
        scaling=d**-0.5, value_group=value_group,
    )  # fmt: skip


def packed(args: dict) -> dict:
    """Keyword arguments of the ``mixed_attention`` implementations: the new tokens, the
    cache's fields of ``args`` as one :class:`PackedCache`, and the scaling."""
    cache = PackedCache(*(args[name] for name in PackedCache._fields))
    return dict(query=args["query"], key=args["key"], value=args["value"], new_valid=args["new_valid"], cache=cache,
                scaling=args["scaling"])  # fmt: skip


def op_arguments(args: dict) -> tuple:
    """The arguments of the ``hqekv::mixed_attention`` op, in its schema's order."""
    p = packed(args)
    return (p["query"], p["key"], p["value"], p["new_valid"], p["scaling"], *p["cache"])
