"""The HqeKV cache: :class:`HqeKVCache` holds one layer per attention layer of a model, an
:class:`HqeKVLayer` for each global attention layer and a :class:`SlidingWindowLayer` for
each sliding-window one. A layer is composed of parts that own their state
(docs/architecture.md):

- ``rows.py``: what every layer shares (logical length, row parts, storage capacity);
- ``pools.py``, ``table.py``, ``tail.py``, ``query_window.py``, ``counters.py``: the parts;
- ``room.py``: the room a static cache reserves;
- ``view.py``: the storage read as one view (attention, dequantized tiles);
- ``rerank.py``: re-ranking, whole (importance → policy or allocator → rebuild);
- ``layer.py``: :class:`HqeKVLayer`; ``sliding.py``: :class:`SlidingWindowLayer`;
- ``model_cache.py``: :class:`HqeKVCache`, what concerns all layers at once.
"""

from .layer import HqeKVLayer
from .model_cache import HqeKVCache
from .sliding import SlidingWindowLayer

__all__ = ["HqeKVCache", "HqeKVLayer", "SlidingWindowLayer"]
