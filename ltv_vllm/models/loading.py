"""Loading a transformers causal LM for capture: spec → directory → tokenizer and model.

The precision comes from `hardware.resolve_dtype` (`auto`: what the device computes natively);
`device_map` and bitsandbytes quantisation serve large (transfer-source) models on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.core.vector import ModelIdentity, model_identity
from ltv_vllm.models.cache import DEFAULT_MODEL, ModelError
from ltv_vllm.models.hardware import checkpoint_dtype, resolve_dtype
from ltv_vllm.models.resolve import resolve_model


@dataclass
class LoadedModel:
    """A transformers causal LM ready for capture, with what a TaskVector records about it."""

    model: Any
    tokenizer: Any
    spec: str
    identity: ModelIdentity


def load_model(
    spec: str | None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    device_map: str | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Resolve a model spec (alias | local dir | hub id) and load it with transformers.

    `device_map="auto"` spreads the layers over every visible GPU (then CPU) with accelerate;
    `quantization` "8bit" / "4bit" loads the linear layers with bitsandbytes (LM head kept
    as it is, so logits stay in the checkpoint's precision).
    """
    from transformers import AutoModelForCausalLM

    spec = spec or DEFAULT_MODEL
    path = resolve_model(spec)
    # a device map places weights where they fit: GPUs first when there are any
    spread = (device_map or quantization) and torch.cuda.is_available()
    where = "cuda" if spread else device
    resolved = resolve_dtype(dtype, device=where, checkpoint=checkpoint_dtype(path))
    kwargs: dict[str, Any] = {"dtype": getattr(torch, resolved)}
    if device_map:
        kwargs["device_map"] = device_map
    if quantization:
        kwargs["quantization_config"] = quantization_config(quantization)
        kwargs.setdefault("device_map", "auto")  # bitsandbytes places weights on the GPU itself
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    model.eval()
    return LoadedModel(model=model, tokenizer=tok, spec=spec, identity=model_identity(model, spec))


def load_tokenizer(spec: str | None) -> Any:
    """The tokenizer of a model spec, without its weights: enough to check label tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(spec))


QUANTIZATIONS = ("8bit", "4bit")


def check_quantization(quantization: str) -> None:
    """Refuse a quantisation this machine cannot run (cheap: no transformers import)."""
    import importlib.util

    if quantization not in QUANTIZATIONS:
        raise ModelError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
        raise ModelError(f"{quantization} loading needs a CUDA GPU and `pip install bitsandbytes`")


def quantization_config(quantization: str) -> Any:
    from transformers import BitsAndBytesConfig

    check_quantization(quantization)
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.bfloat16)


def local_model_dir(spec: str, *, weights: bool = True) -> str:
    """A model spec as a local directory: hub ids go through the local hub cache/download.
    `weights=False`: a hub id's config, weight index and tokenizer files alone (what a
    memory plan reads), not its weights (145 GB for a 72B model)."""

    path = resolve_model(spec)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    files = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
    try:
        return snapshot_download(path, allow_patterns=files + ["*.safetensors"] * weights)
    except LocalEntryNotFoundError:
        raise ModelError(f"{spec}: not in the Hugging Face cache, and the hub cannot be reached "
                         f"(offline, or HF_HUB_OFFLINE set); fetch it first: hf download {path}"
                         ) from None
    except Exception as e:  # noqa: BLE001 - unknown repo, gated repo, a bad id
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{spec}: not a packaged alias, local directory or reachable hub model "
                         f"({first})") from None
