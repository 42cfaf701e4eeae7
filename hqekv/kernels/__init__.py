"""Kernels of the hot path (``hqekv::`` custom ops).

The current path is the pure-PyTorch reference: quantizers in :mod:`hqekv.quantization`,
packing in :mod:`hqekv.packing`, attention over the mixed cache in
:meth:`hqekv.cache.HqeKVLayer.physical_cache` + SDPA. Triton kernels registered as
``torch.library`` ops, with those functions as their CPU implementation and test
reference, belong in this package.
"""
