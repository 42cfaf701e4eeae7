"""The fused CPU ``mixed_attention`` for decoding: a C kernel (``csrc/mixed_attention_cpu.c``)
built on first use with the system C compiler and called through ``ctypes``.

The PyTorch reference decodes a token in some two hundred small tensor ops per layer and
writes the cache out as float codes before each matmul; the C kernel reads each chunk packed,
dequantizes one tile at a time and keeps the whole step in one call. Same semantics as
:func:`~hqekv.kernels.mixed_attention.mixed_attention_reference` (tested against it).

The library is built once per source, compiler and CPU into ``$HQEKV_CACHE`` (default
``~/.cache/hqekv``, :mod:`hqekv.user_cache`), with ``-march=native`` where the compiler
takes it (hence the CPU in its name), next to the sha256 its build recorded: a library
that does not match it (cut short by a full disk or a copy) is built again, not loaded. Where no C compiler is found or the build fails, :func:`available` says why,
and the op warns once and uses the reference. ``HQEKV_CPU_KERNEL=0`` (read at import)
turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from ..quantization import normal_tables
from ..user_cache import cache_dir
from ..tiers import QUANTIZED_TIERS, TIER_FORMATS
from .mixed_attention import PackedCache, check_args, tier_formats
from .quantize_pack import packed_shapes

ENABLED = os.environ.get("HQEKV_CPU_KERNEL", "1") != "0"
"""CPU decode steps use the C kernel (it builds, and not ``HQEKV_CPU_KERNEL=0``)."""

SOURCE = Path(__file__).with_name("csrc") / "mixed_attention_cpu.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC", "-pthread")

# The two argument arrays the kernel reads, by position; their names are #defined for the C source.
POINTERS = ("QUERY", "KEY", "VALUE", "NEW_VALID", "K_TIER", "K_SLOT", "V_TIER", "V_SLOT", "TAIL_K", "TAIL_V",
            "TAIL_LEN", "CENTRES", *(f"K_POOLS_{i}" for i in range(10)), *(f"V_POOLS_{i}" for i in range(10)))  # fmt: skip
SIZES = ("B", "HQ", "HKV", "S", "D", "G", "C", "GROUP", "FP_DTYPE", "META_DTYPE", "Q_DTYPE",
         "BITS_0", "BITS_1", "BITS_2", "NORMALIZED_0", "NORMALIZED_1", "NORMALIZED_2",
         "K_SLOTS_0", "K_SLOTS_1", "K_SLOTS_2", "K_SLOTS_3", "V_SLOTS_0", "V_SLOTS_1", "V_SLOTS_2", "V_SLOTS_3",
         "THREADS")  # fmt: skip
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
WORK_PER_THREAD = 1024
"""(row, KV head, chunk) triples a thread must get for the kernel to start it."""
_Pointers = ctypes.c_void_p * len(POINTERS)  # array types made once: each new one is a class the GC must track
_Sizes = ctypes.c_int64 * len(SIZES)


def _header() -> str:
    lines = [f"#define P_{name} {i}" for i, name in enumerate(POINTERS)]
    lines += ["#define P_K_POOLS P_K_POOLS_0", "#define P_V_POOLS P_V_POOLS_0"]
    lines += [f"#define A_{name} {i}" for i, name in enumerate(SIZES)]
    lines += ["#define A_BITS A_BITS_0", "#define A_NORMALIZED A_NORMALIZED_0", "#define A_K_SLOTS A_K_SLOTS_0",
              "#define A_V_SLOTS A_V_SLOTS_0"]  # fmt: skip
    return "\n".join(lines) + "\n"


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def _cpu_name() -> str:
    """What ``-march=native`` depends on: the CPU model and its instruction-set flags."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(line for line in first if line.startswith(("model name", "flags")))


def _whole(library: Path, digest: Path) -> bool:
    """Whether ``library`` is the file its build recorded in ``digest`` (sha256), byte for byte."""
    try:
        return hashlib.sha256(library.read_bytes()).hexdigest() == digest.read_text().strip()
    except OSError:
        return False


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    cc = shlex.split(compiler)  # CC may carry a launcher or options ("ccache gcc")
    source = _header() + SOURCE.read_text()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([source, *FLAGS, *version, _cpu_name(), sys.platform]).encode()).hexdigest()[:16]
    cache = cache_dir()
    target = cache / f"mixed_attention_cpu-{key}.so"
    digest = target.with_suffix(".sha256")
    if not _whole(target, digest):  # a library cut short (a full disk, a copy) would crash the process on load
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_file, so_file, sum_file = Path(tmp) / "kernel.c", Path(tmp) / "kernel.so", Path(tmp) / "kernel.sha256"
            c_file.write_text(source)
            for flags in (FLAGS, tuple(f for f in FLAGS if f != "-march=native")):  # some compilers lack it (arm64 clang)
                done = subprocess.run([*cc, *flags, str(c_file), "-o", str(so_file), "-lm"], capture_output=True, text=True)
                if not done.returncode:
                    break
            if done.returncode:
                raise RuntimeError(f"{compiler} failed:\n{done.stderr.strip()[-2000:]}")
            sum_file.write_text(hashlib.sha256(so_file.read_bytes()).hexdigest())
            os.replace(so_file, target)  # atomic: a concurrent build leaves one whole file
            os.replace(sum_file, digest)
        if not _whole(target, digest):
            raise RuntimeError(f"the kernel library {target} does not match its digest right after the build")
    library = ctypes.CDLL(str(target))
    library.hqekv_mixed_attention.restype = ctypes.c_int
    library.hqekv_mixed_attention.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double, ctypes.c_void_p]
    return library


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (see :func:`available`)."""
    global _library, _failure
    if _library is None and _failure is None and ENABLED:
        with _lock:
            if _library is None and _failure is None:
                try:
                    _library = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    _failure = str(error)
    return _library


def available() -> tuple[bool, str]:
    """(whether CPU decode steps run the C kernel, why not)."""
    if not ENABLED:
        return False, "turned off by HQEKV_CPU_KERNEL=0"
    if library() is None:
        return False, f"the C kernel could not be built: {_failure}"
    return True, ""


@functools.lru_cache(maxsize=None)
def _centres() -> torch.Tensor:
    return normal_tables(1)[1].contiguous()


def supports(query: torch.Tensor, cache: PackedCache) -> bool:
    """Whether the kernel takes these inputs: CPU tensors in float32/float16/bfloat16, the
    FP16 pools in the tail's dtype, all metadata in one dtype and every tier at its own width
    (not a prompt's waiting chunks at :data:`~hqekv.tiers.WIDE_BITS`; else the reference runs)."""
    meta = {m.dtype for pools in (cache.k_pools, cache.v_pools) for m in pools[2::3] + pools[3::3]}
    tail_dtype = cache.tail_k.dtype
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and tail_dtype in DTYPES
        and cache.tail_v.dtype == tail_dtype == cache.k_pools[0].dtype == cache.v_pools[0].dtype
        and len(meta) == 1
        and meta <= DTYPES.keys()
        and tier_formats(cache.k_pools) == tier_formats(cache.v_pools) == TIER_FORMATS
    )


def _check_pools(pools: list[torch.Tensor], per_channel: bool, h: int, g: int, d: int, group: int) -> None:
    """Each pool must have the shape its slots imply: the kernel reads them by these shapes."""
    fp = pools[0]
    if tuple(fp.shape[1:]) != (h, g, d):
        raise ValueError(f"FP16 pool of shape {tuple(fp.shape)}, expected (N, {h}, {g}, {d})")
    for i, t in enumerate(QUANTIZED_TIERS):
        codes, m0, m1 = pools[1 + 3 * i : 4 + 3 * i]
        want_codes, want_meta = packed_shapes((codes.shape[0], h, g, d), TIER_FORMATS[t][0], per_channel, group)
        if codes.dtype != torch.int32 or tuple(codes.shape) != want_codes:
            raise ValueError(f"tier {t} codes: {codes.dtype} {tuple(codes.shape)}, expected int32 {want_codes}")
        if tuple(m0.shape) != want_meta or tuple(m1.shape) != want_meta:
            raise ValueError(f"tier {t} metadata of shapes {tuple(m0.shape)}, {tuple(m1.shape)}, expected {want_meta}")


def mixed_attention_cpu(query, key, value, new_valid, cache: PackedCache, scaling: float) -> torch.Tensor:
    """The op on CPU tensors through the C kernel -> (B, S, Hq, D) in the query dtype."""
    lib = library()
    if lib is None:
        raise RuntimeError(available()[1])
    check_args(query, key, value, new_valid, cache)
    b, hq, s, d = query.shape
    hkv, g = key.shape[1], cache.chunk_size
    c = cache.k_tier.shape[1]
    k_pools, v_pools, value_group = cache.k_pools, cache.v_pools, cache.value_group
    if not supports(query, cache):
        raise ValueError("the C kernel takes CPU tensors in float32/float16/bfloat16, FP16 pools in the tail's "
                         "dtype and all metadata in one dtype")  # fmt: skip
    if not 1 <= value_group <= d:
        raise ValueError(f"value group {value_group} must be in [1, head dim {d}]")
    _check_pools(k_pools, True, hkv, g, d, value_group)
    _check_pools(v_pools, False, hkv, g, d, value_group)
    meta_dtype = k_pools[2].dtype
    keep = [
        query.float().contiguous(), key.float().contiguous(), value.float().contiguous(),
        new_valid.to(torch.uint8).contiguous(),
        *(t.to(torch.int64).contiguous() for t in cache.tables()),
        cache.tail_k.contiguous(), cache.tail_v.contiguous(), cache.tail_len.to(torch.int64).contiguous(),
        _centres(),
        *(t.contiguous() for t in k_pools), *(t.contiguous() for t in v_pools),
    ]  # fmt: skip
    sizes = [b, hq, hkv, s, d, g, c, value_group, DTYPES[cache.tail_k.dtype], DTYPES[meta_dtype], DTYPES[query.dtype]]
    sizes += [TIER_FORMATS[t][0] for t in QUANTIZED_TIERS] + [int(TIER_FORMATS[t][1]) for t in QUANTIZED_TIERS]
    for pools in (k_pools, v_pools):
        sizes += [pools[0].shape[0]] + [pools[1 + 3 * i].shape[0] for i in range(len(QUANTIZED_TIERS))]
    # torch's intra-op threads share the (row, KV head) pairs, once there is enough work for
    # a thread to be worth starting: measured a loss at 384 chunk-heads, a gain at 4096
    sizes.append(max(1, min(torch.get_num_threads(), b * hkv, b * hkv * c // WORK_PER_THREAD)))
    pointers = _Pointers(*(t.data_ptr() for t in keep))
    args = _Sizes(*sizes)
    out = torch.empty(b, s, hq, d, dtype=torch.float32)
    status = lib.hqekv_mixed_attention(pointers, args, float(scaling), out.data_ptr())
    if status == 1:
        raise ValueError("a chunk table names a tier or slot that its pools do not hold, or a tail length is outside [0, G]")
    if status:
        raise MemoryError("the CPU mixed attention could not allocate its scratch memory")
    return out.to(query.dtype)
