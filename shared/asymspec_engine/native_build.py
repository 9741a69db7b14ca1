"""Building the engine's native C kernels (``native_attention.c``, ``native_linear.c``,
``native_pointwise.c``) and the loop that drives them (``native_layers.c``).

Each kernel is compiled on first use with the machine's C compiler (``-march=native``: the
machine that runs it builds it), cached by source, flags, compiler and CPU, and loaded with
ctypes after torch, so its OpenMP loops run on torch's own libgomp thread pool. No torch
headers, so a build takes about a second. Where there is no compiler, or the settings say
``off``, the engine keeps torch's operators.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from asymspec_engine.hardware import cpu_flags, cpu_model

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
Kernel = TypeVar("Kernel")


class KernelUse(enum.StrEnum):
    AUTO = "auto"  # where it builds and the model and CPU suit it
    ON = "on"  # the same, but failing to build is an error
    OFF = "off"  # torch's operators

    @property
    def wanted(self) -> bool:
        return self != KernelUse.OFF

    @property
    def required(self) -> bool:
        return self == KernelUse.ON


class NativeKernelSettings(BaseSettings):
    """Read from the environment (prefix ASYMSPEC_) when an engine is built."""

    model_config = SettingsConfigDict(env_prefix="ASYMSPEC_", extra="ignore")

    native_attention: KernelUse = Field(
        KernelUse.AUTO,
        description="The native decode/verify attention kernel: auto, on or off.",
    )
    native_linear: KernelUse = Field(
        KernelUse.AUTO,
        description="The native AMX bf16 products (the linear layers): auto, on or off.",
    )
    native_pointwise: KernelUse = Field(
        KernelUse.AUTO,
        description="The native fused pointwise work of a layer (norms, rotary, SiLU): "
        "auto, on or off.",
    )
    native_layers: KernelUse = Field(
        KernelUse.AUTO,
        description="A forward's decoder layers in one native call, where the linear, "
        "pointwise and attention kernels are all native: auto, on or off.",
    )
    kernel_cache: Path = Field(
        Path.home() / ".cache" / "asymspec" / "kernels",
        description="Where the native kernels are compiled to (one file per source, CPU and "
        "compiler).",
    )


class KernelUnavailable(RuntimeError):
    """A native kernel cannot run here (no compiler, a CPU or model it does not suit)."""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


@functools.cache
def _compiler_version(compiler: str) -> list[str]:
    """The compiler's version line (asked once a process: every engine loads 3 kernels)."""
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[:1]


def _library_path(source: Path, cache: Path, compiler: str, libs: tuple[str, ...]) -> Path:
    """The cached build's path: a hash of everything that changes the machine code."""
    version = _compiler_version(compiler)
    key = hashlib.sha256()
    recipe = " ".join(CFLAGS + libs) + " compiled, then linked apart"
    for part in (source.read_bytes(), recipe.encode(), *map(str.encode, version)):
        key.update(part)
    key.update(cpu_model().encode())
    key.update(" ".join(sorted(cpu_flags())).encode())
    return cache / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, settings: NativeKernelSettings, libs: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` unless this machine's build is cached; returns the library."""
    compiler = _compiler()
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, or $CC) on PATH")
    cache = settings.kernel_cache.expanduser()
    library = _library_path(source, cache, compiler, libs)
    if library.is_file():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    # Two services may build at once: each writes its own file and renames it into place.
    fd, partial = tempfile.mkstemp(dir=cache, suffix=".so.partial")
    os.close(fd)
    obj = partial.removesuffix(".so.partial") + ".o"
    # Compiled and linked apart: linking with -ffast-math would add crtfastmath.o, which on
    # loading sets flush-to-zero for the whole process (torch's and numpy's arithmetic too).
    commands = [
        [compiler, *CFLAGS, "-fPIC", "-c", str(source), "-o", obj],
        [compiler, "-shared", "-fopenmp", obj, "-o", partial, *libs],
    ]
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                Path(partial).unlink(missing_ok=True)
                message = f"{' '.join(command)} failed:\n{done.stderr[-2000:]}"
                raise KernelUnavailable(message)
    finally:
        Path(obj).unlink(missing_ok=True)
    os.replace(partial, library)
    log.info("native kernel: built %s", library)
    return library


def load_kernel(
    name: str,
    use: bool | None,
    reason: str | None,
    load: Callable[[NativeKernelSettings], Kernel],
) -> Kernel | None:
    """Kernel ``name`` (its setting is ``native_<name>``) if it is wanted and can run here,
    by ``load`` (which builds and opens it); else None, logged why. ``use``: True requires
    it (failing is an error), False declines it, None leaves it to the settings.
    ``reason``: why the model or CPU does not suit it, None when they do."""
    settings = NativeKernelSettings()
    choice: KernelUse = getattr(settings, f"native_{name}")
    if use is not None:
        choice = KernelUse.ON if use else KernelUse.OFF
    if not choice.wanted:
        return None
    try:
        if reason is not None:
            raise KernelUnavailable(reason)
        return load(settings)
    except (KernelUnavailable, OSError) as error:
        if choice.required:
            raise
        log.info("native %s off: %s", name, str(error).splitlines()[0])
        return None
