"""What machine this is, and the dtype it should decode in.

Whether bf16 pays depends on the hardware, not on taste: a CPU with AVX-512-BF16 or AMX multiplies bf16
natively (several times fp32's rate, half the bytes to stream), while an AVX2-only CPU emulates every bf16
product (~15 GFLOP/s whatever the row count, so each extra row of a tree pass costs as much as the first)
and is faster in fp32. `--dtype auto` (the default everywhere) asks this module.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
from dataclasses import dataclass

import torch

from medusa.errors import MedusaError

# Accepted spellings -> short name. The short names are what stats and reports carry.
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32"}
DTYPE_CHOICES = ["auto", *DTYPE_NAMES]
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHORT_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_HINT = f"choose auto, {', '.join(list(TORCH_DTYPES)[:-1])} or {list(TORCH_DTYPES)[-1]}"


@dataclass(frozen=True)
class Machine:
    """The facts a speed figure or a cached calibration depends on."""

    device: str  # "cpu" or "cuda"
    name: str  # CPU model name or GPU name
    capability: str  # torch's CPU capability (AVX2, AVX512, ...) or the CUDA compute capability
    native_bf16: bool  # bf16 matmul runs natively (not emulated)
    threads: int

    def describe(self) -> str:
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        if self.device == "cuda":
            return f"{self.name} (compute capability {self.capability}, {bf16})"
        return f"{self.name} ({self.capability}, {bf16}, {self.threads} threads)"

    def to_dict(self) -> dict:
        return {"device": self.device, "name": self.name, "capability": self.capability,
                "native_bf16": self.native_bf16, "threads": self.threads}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo on Linux; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def onednn_bf16() -> bool:
    """oneDNN runs bf16 kernels here (natively or by its AVX-512 emulation)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_native_bf16() -> bool:
    """oneDNN must run bf16 kernels, and the CPU must have bf16 instructions (AVX-512-BF16 or AMX) rather
    than oneDNN's AVX-512 emulation; where the flags cannot be read, oneDNN's word is taken."""
    if not onednn_bf16():
        return False
    flags = cpu_flags()
    return not flags or bool(flags & {"avx512_bf16", "amx_bf16"})


def machine(device: torch.device | str = "cpu") -> Machine:
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return Machine("cuda", torch.cuda.get_device_name(index), f"{major}.{minor}",
                       torch.cuda.is_bf16_supported(), torch.get_num_threads())
    return Machine(device.type, cpu_name(), torch.backends.cpu.get_cpu_capability(), cpu_native_bf16(),
                   torch.get_num_threads())


# Compiled CPU kernels are kept per matrix shape in two caches: oneDNN's primitive cache and the computation
# cache of PyTorch's ideep layer, 1024 entries each by default. Each (layer shape, row count) a packed linear
# layer meets takes an entry in both (~0.25 + ~0.4 MB for a 576x1536 layer, AMD EPYC Zen 3, fp32;
# `benchmarks/kernel_cache_memory.py`), so a server that meets many prompt lengths grows until both are full:
# bounded, but by hundreds of MB. A cap bounds it lower; a shape evicted and met again is compiled again (~1 ms).
KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_DEFAULT = 1024


def limit_kernel_caches(entries: int | None) -> dict[str, int]:
    """Cap both kernel caches at `entries` each (None: leave them as they are), unless the environment
    already sets one (the user's value wins). Takes effect only before the process's first oneDNN kernel.
    Returns the capacity each cache gets."""
    out = {}
    for var in KERNEL_CACHE_VARS:
        if entries is not None and var not in os.environ:
            os.environ[var] = str(entries)
        out[var] = int(os.environ.get(var, KERNEL_CACHE_DEFAULT))
    return out


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, shell-quoted; an installed entry point (`medusa`) by its name only."""
    import shlex
    from pathlib import Path

    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).parent == Path(sys.executable).parent:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def provenance(dtype: str | torch.dtype | None, device: torch.device | str = "cpu",
               machine_: Machine | None = None, threads: int | None = None) -> dict:
    """What every written result carries: the machine it was measured on (with the dtype it decoded in and,
    given `threads`, the threads of the process measured when that is not this one) and the command line
    that produced it."""
    m = machine_ or machine(device)
    if threads is not None:
        m = dataclasses.replace(m, threads=threads)
    if isinstance(dtype, torch.dtype):
        dtype = SHORT_NAMES.get(dtype, str(dtype))
    elif dtype is not None:
        dtype = _short_name(dtype) or str(dtype)
    return {"machine": {**m.to_dict(), "dtype": dtype}, "command": command_line()}


def _short_name(spelling: str) -> str | None:
    """The short name of an accepted spelling (any case, `torch.` prefix allowed); None if there is none."""
    return DTYPE_NAMES.get(str(spelling).lower().removeprefix("torch."))


def short_dtype(name: str | torch.dtype) -> str:
    """'bfloat16', torch.bfloat16, 'bf16' -> 'bf16' (and so on); refuses anything else by name."""
    if isinstance(name, torch.dtype):
        if name not in SHORT_NAMES:
            raise MedusaError(f"--dtype: unsupported dtype {name}")
        return SHORT_NAMES[name]
    short = _short_name(name)
    if short is None:
        raise MedusaError(f"--dtype: unknown dtype {name!r}; {DTYPE_HINT}")
    return short


def check_dtype_spelling(spec: str) -> str:
    """For config validators: `auto` or an accepted spelling passes unchanged; anything else is a ValueError."""
    if spec.lower() != "auto" and _short_name(spec) is None:
        raise ValueError(f"unknown dtype {spec!r}; {DTYPE_HINT}")
    return spec


def auto_dtype(m: Machine) -> tuple[str, str]:
    """(short dtype name, why) for a machine."""
    if m.native_bf16:
        return "bf16", f"{m.device} {m.name} multiplies bf16 natively"
    if m.device == "cuda":
        return "fp32", f"{m.name} has no bf16"
    return "fp32", f"{m.capability} CPU without native bf16: bf16 matmuls would be emulated"


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # bf16 / fp16 / fp32
    reason: str

    @property
    def torch(self) -> torch.dtype:
        return TORCH_DTYPES[self.name]


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device | str = "cpu",
                  announce: bool = False) -> DtypeChoice:
    """`auto` (or None) -> the machine's dtype; any other spelling -> its short name, as asked."""
    if spec is None or (isinstance(spec, str) and spec.lower() == "auto"):
        name, why = auto_dtype(machine(device))
        choice = DtypeChoice(name, f"auto: {why}")
    else:
        choice = DtypeChoice(short_dtype(spec), "requested")
    if announce:
        _announce(choice)
    return choice


_announced: set[DtypeChoice] = set()


def _announce(choice: DtypeChoice) -> None:
    """Say the choice once per process on stderr (stdout may be JSON)."""
    if choice not in _announced and os.environ.get("MEDUSA_QUIET", "") in ("", "0"):
        _announced.add(choice)
        print(f"medusa: dtype {choice.name} ({choice.reason})", file=sys.stderr)
