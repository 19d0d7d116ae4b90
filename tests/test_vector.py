"""vector: file round trips, self-description, and every refusal."""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest
import torch

from conftest import make_llama, make_tokenizer
from ltv_vllm.core.vector import (
    ModelIdentity,
    TaskVector,
    VectorError,
    fingerprint_lm_head,
    load_task_vector,
    model_identity,
)
from ltv_vllm.core.vector_files import read_safetensors
from ltv_vllm.tasks.specs import BUILTIN_TASKS, label_token_ids

TASK = BUILTIN_TASKS["sst2"]


def make_vector(model, tokenizer, *, rank: int = 3, bias: bool = False) -> TaskVector:
    g = torch.Generator().manual_seed(0)
    d = model.config.hidden_size
    return TaskVector(
        kind="hidden",
        U=torch.randn(d, rank, generator=g),
        V=torch.randn(d, rank, generator=g),
        bias=torch.randn(d, generator=g) if bias else None,
        model=model_identity(model, "tiny"),
        label_token_ids=tuple(label_token_ids(TASK, tokenizer)),
        provenance={"task": TASK.to_dict(), "k": 30, "n": 256, "lam": 5.0, "seed": 1,
              "metrics": {"ltv": {"accuracy": 0.5, "d_ntp": 0.1}}},
        gram=torch.randn(rank, rank, generator=g),
    )


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("bias", [False, True])
def test_round_trip(tmp_path, tiny_model, tokenizer, suffix, bias):
    tv = make_vector(tiny_model, tokenizer, bias=bias)
    path = tv.save(tmp_path / f"v{suffix}")
    back = load_task_vector(path)
    assert torch.equal(back.U, tv.U) and torch.equal(back.V, tv.V)
    assert torch.equal(back.gram, tv.gram)
    assert (back.bias is None) == (tv.bias is None)
    if bias:
        assert torch.equal(back.bias, tv.bias)
    assert back.model == tv.model
    assert back.label_token_ids == tv.label_token_ids
    assert back.meta == tv.meta and back.kind == "hidden"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left
    back.check_model(model_identity(tiny_model))
    back.check_tokenizer(tokenizer)


def test_fingerprint_survives_dtype_but_not_another_model(tiny_model, tokenizer):
    w = tiny_model.lm_head.weight
    assert fingerprint_lm_head(w) == fingerprint_lm_head(w.to(torch.bfloat16))
    other = make_llama(len(tokenizer), seed=7)
    assert fingerprint_lm_head(other.lm_head.weight) != fingerprint_lm_head(w)


def test_mismatches_are_refused(tiny_model, tokenizer):
    tv = make_vector(tiny_model, tokenizer)
    with pytest.raises(VectorError, match="hidden size 64 .* has hidden size 32"):
        tv.check_model(model_identity(make_llama(len(tokenizer), hidden=32)))
    with pytest.raises(VectorError, match="vocabulary size"):
        tv.check_model(model_identity(make_llama(len(tokenizer) + 8)))
    with pytest.raises(VectorError, match="was extracted from tiny"):
        tv.check_model(model_identity(make_llama(len(tokenizer), seed=9), "other"))
    other_tok = make_tokenizer(bos=True)
    # a tokenizer whose label ids differ (here: a shifted copy of the recorded ids)
    bad = TaskVector(tv.kind, tv.U, tv.V, None, tv.model,
                     tuple(i + 1 for i in tv.label_token_ids), tv.meta)
    with pytest.raises(VectorError, match="label tokens"):
        bad.check_tokenizer(other_tok)


@pytest.mark.usefixtures("tokenizer")
def test_bad_shapes_refused(tiny_model):
    ident = model_identity(tiny_model)
    with pytest.raises(VectorError, match="factors"):
        TaskVector("hidden", torch.zeros(64, 2), torch.zeros(64, 3), None, ident, (1, 2))
    with pytest.raises(VectorError, match="hidden size 64"):
        TaskVector("hidden", torch.zeros(32, 2), torch.zeros(32, 2), None, ident, (1, 2))
    with pytest.raises(VectorError, match="bias"):
        TaskVector("hidden", torch.zeros(64, 2), torch.zeros(64, 2), torch.zeros(3), ident, (1, 2))
    with pytest.raises(VectorError, match="kind"):
        TaskVector("other", torch.zeros(64, 2), torch.zeros(64, 2), None, ident, (1, 2))  # type: ignore[arg-type]
    with pytest.raises(VectorError, match="gram"):
        TaskVector("hidden", torch.zeros(64, 2), torch.zeros(64, 2), None, ident, (1, 2), {},
                   torch.zeros(3, 3))


def test_corrupt_and_foreign_files_refused(tmp_path, tiny_model, tokenizer):
    tv = make_vector(tiny_model, tokenizer)
    for suffix in (".pt", ".safetensors"):
        good = tv.save(tmp_path / f"good{suffix}")
        data = good.read_bytes()
        trunc = tmp_path / f"trunc{suffix}"
        trunc.write_bytes(data[: len(data) // 2])
        with pytest.raises(VectorError, match="trunc"):
            load_task_vector(trunc)
    # a .pt of something else
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(VectorError, match="not an ltv-vllm task-vector file"):
        load_task_vector(tmp_path / "other.pt")
    # a safetensors file without our header
    from safetensors.torch import save_file

    save_file({"U": torch.zeros(2, 1), "V": torch.zeros(2, 1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(VectorError, match="not an ltv-vllm task-vector file"):
        load_task_vector(tmp_path / "plain.safetensors")
    with pytest.raises(VectorError, match="not found"):
        load_task_vector(tmp_path / "missing.pt")
    with pytest.raises(VectorError, match=r"\.pt or \.safetensors"):
        tv.save(tmp_path / "v.bin")


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"tensors": Evil()}, f)
    with pytest.raises(VectorError, match="evil.pt"):
        load_task_vector(path)
    assert not marker.exists()


def test_newer_format_and_failed_write_leave_nothing(tmp_path, tiny_model, tokenizer, monkeypatch):
    tv = make_vector(tiny_model, tokenizer)
    import json

    torch.save({"tensors": tv._tensors(),
                "ltv_vllm": json.dumps({**tv._header(), "format_version": 99})},
               tmp_path / "new.pt")
    with pytest.raises(VectorError, match="newer ltv-vllm"):
        load_task_vector(tmp_path / "new.pt")

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        tv.save(tmp_path / "sub" / "v.pt")
    assert list((tmp_path / "sub").iterdir()) == []


def test_identity_dict_round_trip(tiny_model):
    ident = model_identity(tiny_model, "x")
    assert ModelIdentity(**ident.to_dict()) == ident


def test_truncated_copy_with_the_same_head_is_refused(tmp_path, tokenizer):
    """`models derive` keeps the LM head, so only the layer count tells the copy apart."""
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.models.derive import derive_model

    model = make_llama(len(tokenizer), layers=3, seed=3)
    model.save_pretrained(tmp_path / "full")
    tokenizer.save_pretrained(tmp_path / "full")
    tv = make_vector(model, tokenizer)
    assert tv.model.num_layers == 3
    short = derive_model(str(tmp_path / "full"), keep_layers=2, out=tmp_path / "short",
                         progress=False)
    ident = identity_from_dir(short)
    assert ident.lm_head_fingerprint == tv.model.lm_head_fingerprint
    with pytest.raises(VectorError, match=r"\(3 layers\), not from .* \(2 layers\)"):
        tv.check_model(ident)
    tv.check_model(identity_from_dir(tmp_path / "full"))
    # files written before the layer count was recorded still load and check
    old = ModelIdentity.from_dict({k: v for k, v in tv.model.to_dict().items()
                                   if k != "num_layers"})
    assert old.num_layers is None
    TaskVector(tv.kind, tv.U, tv.V, None, old, tv.label_token_ids, tv.meta).check_model(ident)


class _Boom:
    """Unpickling this would call os.system: what a malicious .pt file does."""

    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_refused_and_truncated_files_say_so_in_one_line(tmp_path, tiny_model):
    from ltv_vllm.core.vector import VectorError, load_task_vector

    tv = TaskVector("hidden", torch.ones(64, 2), torch.ones(64, 2), None,
                    model_identity(tiny_model, "tiny"), (1, 2), {"task": {"name": "t"}})
    for suffix in (".pt", ".safetensors"):
        good = tv.save(tmp_path / f"good{suffix}")
        data = good.read_bytes()
        for name, blob in (("truncated", data[: len(data) // 2]), ("empty", b""),
                           ("garbage", b"\x00garbage" * 10)):
            bad = tmp_path / f"{name}{suffix}"
            bad.write_bytes(blob)
            with pytest.raises(VectorError) as e:
                load_task_vector(bad)
            assert str(e.value) == f"{bad}: not a task-vector file: truncated or corrupt"
    # a pickle holding code: torch's weights-only unpickler refuses it; we say why, in one line
    evil = tmp_path / "evil.pt"
    torch.save({"tensors": {"U": torch.ones(2, 1)}, "ltv_vllm": _Boom()}, evil)
    with pytest.raises(VectorError) as e:
        load_task_vector(evil)
    msg = str(e.value)
    assert msg.startswith(f"{evil}: refused: the file contains code") and "\n" not in msg
    # through the CLI: one line, exit 1, no torch paragraph, no warning
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    for path, text in ((evil, "refused: the file contains code"),
                       (tmp_path / "truncated.pt", "truncated or corrupt")):
        r = CliRunner().invoke(main, ["inspect", str(path)])
        assert r.exit_code == 1 and text in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_provenance_is_typed_and_keeps_unknown_keys(tmp_path, tiny_model):
    """Files from older (or newer) versions: known keys typed, unknown ones kept verbatim."""
    from ltv_vllm.core.vector import Provenance, load_task_vector

    old_meta = {"task": TASK.to_dict(), "k": 30, "n": 256, "lam": 5, "seed": 1,
                "ridge_form": "dual", "some_future_key": {"x": [1, 2]}}
    tv = TaskVector("hidden", torch.ones(64, 2), torch.ones(64, 2), None,
                    model_identity(tiny_model, "tiny"), (1, 2), old_meta)
    pv = tv.provenance
    assert isinstance(pv, Provenance) and pv.k == 30 and pv.lam == 5.0 and pv.dtype is None
    assert isinstance(pv.lam, float) and pv.extra == {"some_future_key": {"x": [1, 2]}}
    assert tv.task_name == TASK.name
    for suffix in (".pt", ".safetensors"):
        back = load_task_vector(tv.save(tmp_path / f"v{suffix}"))
        assert back.provenance == pv and back.meta == {**old_meta, "lam": 5.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        pv.k = 3  # type: ignore[misc]


def _write_raw(path, tensors, header):
    """A file as `TaskVector.save` writes it, from tensors and a header given as they are:
    nothing checks them on the way (the files a broken or hostile writer makes)."""
    import json

    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"ltv_vllm": json.dumps(header)})
    else:
        torch.save({"tensors": tensors, "ltv_vllm": json.dumps(header)}, path)
    return path


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize(("name", "bad"), [("U", float("nan")), ("V", float("inf")),
                                           ("bias", float("nan")), ("gram", -float("inf"))])
def test_non_finite_vectors_are_refused(tmp_path, tiny_model, tokenizer, suffix, name, bad):
    tv = make_vector(tiny_model, tokenizer, bias=True)
    tensors = {k: v.clone() for k, v in tv._tensors().items()}
    tensors[name].view(-1)[3] = bad  # one bad value among thousands
    assert not torch.isfinite(tensors[name]).all()
    msg = (f"task vector {TASK.name!r}: {name} holds non-finite values (NaN or inf)")
    with pytest.raises(VectorError) as e:
        TaskVector(tv.kind, tensors["U"], tensors["V"], tensors["bias"], tv.model,
                   tv.label_token_ids, tv.meta, gram=tensors["gram"])
    assert str(e.value) == msg
    path = _write_raw(tmp_path / f"bad{suffix}", tensors, tv._header())
    with pytest.raises(VectorError) as e:
        load_task_vector(path)
    assert str(e.value) == f"{path}: {msg}"
    # the same file with finite tensors loads: the refusal is the value, not the writing
    assert load_task_vector(_write_raw(tmp_path / f"ok{suffix}", tv._tensors(), tv._header()))


@pytest.mark.parametrize(("meta", "msg"), [
    (["not", "a", "dict"], "meta: an object, got list"),
    ({"task": ["sst2"]}, "meta.task: an object, got list"),
    ({"hardware": "h100"}, "meta.hardware: an object, got str"),
    ({"timings": 3.0}, "meta.timings: an object, got float"),
    ({"source_model": 1}, "meta.source_model: an object, got int"),
    ({"source_load": [1]}, "meta.source_load: an object, got list"),
    ({"metrics": {"ltv": 0.5}}, "meta.metrics['ltv']: an object, got float"),
    ({"metrics": [0.5]}, "meta.metrics: an object, got list"),
    ({"k": "30"}, "meta.k: an integer, got str"),
    ({"n": True}, "meta.n: an integer, got bool"),
    ({"seed": 1.5}, "meta.seed: an integer, got float"),
    ({"lam": "5"}, "meta.lam: a finite number, got str"),
    ({"lam": float("nan")}, "meta.lam: a finite number, got nan"),
    ({"lam": False}, "meta.lam: a finite number, got bool"),
    ({"method": ["ltv"]}, "meta.method: a string, got list"),
    # a server reads shift_steps for every request that names no policy: checked on load
    ({"shift_steps": "bogus"}, "meta.shift_steps: 'bogus' is not a step policy ('all', "
                               "'first' or a count ≥ 0)"),
    ({"shift_steps": "-1"}, "meta.shift_steps: '-1' is not a step policy ('all', 'first' or "
                            "a count ≥ 0)"),
    ({"shift_steps": "١"}, "meta.shift_steps: '١' is not a step policy ('all', 'first' or "
                           "a count ≥ 0)"),
    ({"shift_steps": 1}, "meta.shift_steps: a string, got int"),
])
def test_malformed_provenance_is_one_line(tmp_path, tiny_model, tokenizer, meta, msg):
    """A file's `meta` is untrusted (a server reads uploads): a wrong type is a one-line
    VectorError naming the field, never a TypeError or AttributeError."""
    from ltv_vllm.core.vector import Provenance

    with pytest.raises(VectorError) as e:
        Provenance.from_dict(meta)
    assert str(e.value) == msg
    tv = make_vector(tiny_model, tokenizer)
    for suffix in (".pt", ".safetensors"):
        path = _write_raw(tmp_path / f"v{suffix}", tv._tensors(), {**tv._header(), "meta": meta})
        with pytest.raises(VectorError) as e:
            load_task_vector(path)
        assert str(e.value) == f"{path}: {msg}"


def test_malformed_model_header_is_one_line(tmp_path, tiny_model, tokenizer):
    tv = make_vector(tiny_model, tokenizer)
    for model in (["tiny"], "tiny"):
        path = _write_raw(tmp_path / "v.pt", tv._tensors(), {**tv._header(), "model": model})
        with pytest.raises(VectorError, match=r"v\.pt: malformed task-vector header"):
            load_task_vector(path)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_non_finite_metrics_load_as_none(tmp_path, tiny_model, tokenizer, suffix):
    """A metric undefined at extraction (NaN) or a timing that overflowed (inf) must not make
    the file unloadable, and its meta must stay valid strict JSON."""
    import json

    tv = make_vector(tiny_model, tokenizer)
    metrics = {"ltv": {"accuracy": 0.5, "mse": float("nan"), "curve": [1.0, float("inf")]},
               "icl": {"mse": float("-inf")}}
    header = {**tv._header(), "meta": {**tv.meta, "metrics": metrics,
                                       "timings": {"extraction_seconds": float("nan"),
                                                   "capture_seconds": 2.5}}}
    assert "NaN" in json.dumps(header)  # what Python's json writes, and strict readers refuse
    back = load_task_vector(_write_raw(tmp_path / f"v{suffix}", tv._tensors(), header))
    assert back.provenance.metrics == {"ltv": {"accuracy": 0.5, "mse": None,
                                               "curve": [1.0, None]},
                                       "icl": {"mse": None}}
    assert back.provenance.timings == {"extraction_seconds": None, "capture_seconds": 2.5}
    json.dumps(back.meta, allow_nan=False)  # raises ValueError on any NaN or inf left


class _Print:
    """Unpickling this would call print("x"): a stand-in for any code a pickle can run."""

    def __reduce__(self):
        return (print, ("x",))


def test_plain_pickles_are_refused_unread(tmp_path, capsys):
    """A .pt that is a plain pickle (not torch.save's zip) is never unpickled: one that names
    Python objects is refused as code, one that does not as a foreign file."""
    import pickletools

    code = pickle.dumps({"tensors": {"U": _Print()}}, protocol=4)
    # an independent look at what the payload holds: it imports and calls
    assert {op.name for op, _, _ in pickletools.genops(code)} & {"STACK_GLOBAL", "REDUCE"}
    cases = [
        ("x.pt", code, "refused: a plain pickle that names Python objects (code that would "
                       "run on load); task-vector files are safetensors or torch.save zip files"),
        ("x2.pt", pickle.dumps(_Print(), protocol=2), "refused: a plain pickle that names "
         "Python objects"),
        ("plain.pt", pickle.dumps({"a": 1}), "a plain pickle, not a task-vector file "
         "(task-vector files are safetensors or torch.save zip files)"),
        ("cut.pt", pickle.dumps({"a": list(range(100))})[:20], CORRUPT_MSG),
        # named .safetensors, holds a pickle: not a safetensors file, whatever is inside
        ("x.safetensors", code, CORRUPT_MSG),
    ]
    for name, data, msg in cases:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(VectorError) as e:
            load_task_vector(path)
        assert str(e.value).startswith(f"{path}: {msg}"), str(e.value)
        assert "\n" not in str(e.value)
    assert capsys.readouterr().out == ""  # print("x") never ran


CORRUPT_MSG = "not a task-vector file: truncated or corrupt"


def test_sniff_suffix(tmp_path, tiny_model, tokenizer):
    from ltv_vllm.core.vector_files import sniff_suffix

    tv = make_vector(tiny_model, tokenizer)
    for suffix in (".pt", ".safetensors"):
        assert sniff_suffix(tv.save(tmp_path / f"v{suffix}").read_bytes()) == suffix
    assert sniff_suffix(pickle.dumps({"a": 1})) == ".pt"  # refused on load, with its reason
    assert sniff_suffix(b"") == ".safetensors" and sniff_suffix(b"garbage") == ".safetensors"


def test_sniff_suffix_reads_a_safetensors_header_first(tmp_path, tiny_model, tokenizer):
    """A safetensors file starts with its header's length (8 bytes, little-endian): one of
    length 128 mod 256 starts with 0x80, a pickle's PROTO byte. It once was taken for a
    pickle and refused as corrupt; it is a safetensors file."""
    from safetensors.torch import save_file

    from ltv_vllm.core.vector_files import sniff_suffix

    tv = make_vector(tiny_model, tokenizer)
    path = tv.save(tmp_path / "v.safetensors")
    header_json, tensors = read_safetensors(path)
    for pad in range(300):  # a metadata key of growing length walks the header length
        save_file(tensors, str(path), metadata={"ltv_vllm": header_json, "pad": "x" * pad})
        data = path.read_bytes()
        if data[0] == 0x80:
            break
    else:
        raise AssertionError("no header length of 128 mod 256 reached")
    assert sniff_suffix(data) == ".safetensors"
    assert torch.equal(load_task_vector(path).U, tv.U)


@pytest.mark.parametrize(("value", "steps"), [("all", None), ("first", 1), (0, 0), ("3", 3),
                                              (12, 12), ("007", 7)])
def test_step_policies_parse(value, steps):
    from ltv_vllm.core.vector import parse_steps

    assert parse_steps(value) == steps


@pytest.mark.parametrize("value", [True, False, "١", "２", -1, "-1", 1.5, "x", "", None,
                                   "All", [1]])
def test_step_policies_are_strict(value):
    """JSON true is 1 to Python and to vLLM's request parser; Unicode digits are digits to
    str.isdigit and int(): none of them is a step count here."""
    from ltv_vllm.core.vector import parse_steps

    with pytest.raises(ValueError, match="must be 'all', 'first' or a count"):
        parse_steps(value)


def test_a_gram_that_cannot_be_cut_is_one_line(tiny_model, tokenizer):
    """A rank cut factors the training-state Gram (Cholesky): one that is not positive
    definite (a damaged or hand-made file) is a VectorError, not torch's message."""
    tv = make_vector(tiny_model, tokenizer)
    r = tv.rank
    bad = dataclasses.replace(tv, gram=-torch.eye(r))
    with pytest.raises(VectorError, match="gram is not positive definite"):
        bad.truncated(1)
