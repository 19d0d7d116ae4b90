"""Every method, the evaluations and a transfer place their tensors where CUDA accepts them,
checked on the CPU with `placement.Placement` (the model's tensors tagged as on a device, the
host's as on the host; a mix CUDA refuses raises). FV's head patch once kept its mean
activations on the host and failed on the GPU only; `test_the_old_fv_patch_is_caught` shows
the suite now fails on it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from click.testing import CliRunner
from placement import DEVICE, Placement, PlacementError

from conftest import make_llama, write_model_pair, write_toy_task
from ltv_vllm.cli import main
from ltv_vllm.evaluation.evaluate import all_methods
from ltv_vllm.evaluation.regress import regression_methods
from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.methods import METHODS, Context, MethodOptions
from ltv_vllm.methods import fv as fv_module
from ltv_vllm.models import loading
from ltv_vllm.models.loading import LoadedModel
from ltv_vllm.pipeline import transfer as pipeline_transfer
from ltv_vllm.tasks.data import load_dataset, sample_episode
from ltv_vllm.tasks.specs import get_task, label_token_ids

pytestmark = pytest.mark.slow(seconds=18)  # see conftest's ordering

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "movie"]


def tensors_of(x) -> Iterator[torch.Tensor]:
    """Every tensor an artifact keeps (dataclass fields, dicts, lists, tuples)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from tensors_of(getattr(x, f.name))
    elif isinstance(x, dict):
        yield from (t for v in x.values() for t in tensors_of(v))
    elif isinstance(x, (list, tuple)):
        yield from (t for v in x for t in tensors_of(v))


def test_placement_follows_cudas_rules():
    """The checker itself, rule by rule (each of these is what CUDA does with a model on
    cuda:0 and a tensor made without a device)."""
    lin = torch.nn.Linear(4, 4)
    mode = Placement()
    with mode:
        mode.put(lin)
        assert lin.weight.device == DEVICE
        x = torch.ones(2, 4)                       # made without a device: the host
        assert x.device != DEVICE
        with pytest.raises(PlacementError, match="CUDA refuses"):
            lin(x)
        y = lin(x.to(lin.weight.device))           # moved where the model is: fine
        assert mode.on_device(y) and mode.on_device(y * torch.tensor(2.0))  # 0-dim: a scalar
        with pytest.raises(PlacementError):
            y + torch.ones(4)
        idx = torch.tensor([1, 0])                 # host indices may index a device tensor
        assert mode.on_device(y[idx])
        z = y.detach().clone()
        z[idx] = y.detach()[idx]
        with pytest.raises(PlacementError):
            z[idx] = torch.zeros(2, 4)             # a host value into a device tensor
        with pytest.raises(PlacementError, match="numpy"):
            y.detach().numpy()
        assert not mode.on_device(y.detach().cpu())
        assert mode.on_device(torch.zeros_like(y)) and mode.on_device(y.new_zeros(3))
        assert not mode.on_device(torch.zeros(3, device="cpu"))
        assert mode.on_device(torch.arange(3, device=y.device))
        w = torch.nn.Parameter(torch.ones(4))      # a host parameter, used on the device
        (g,) = torch.autograd.grad((y * w.to(y.device)).sum(), [w])
        assert not mode.on_device(g)               # its gradient lives where it does
    assert mode.checked > 0


@pytest.fixture(scope="module")
def placed(tokenizer, tmp_path_factory):
    """A tiny model put on the device, its Capturer and a method Context made under the mode
    (as `extract` makes them after loading)."""
    model = make_llama(len(tokenizer), seed=7, layers=3)
    task = get_task(str(write_toy_task(tmp_path_factory.mktemp("toy"), WORDS)))
    ep = sample_episode(load_dataset(task), k=6, n=24, n_test=12, seed=2, n_val=8)
    mode = Placement()
    with mode:
        mode.put(model)
        cap = Capturer(model, tokenizer, progress=False, batch_size=5)
        ctx = Context(cap, ep, label_token_ids(task, tokenizer),
                      MethodOptions(progress=False, fv_prompts=4, fv_trials=3, batch_size=5,
                                    i2cl_epochs=3))
    return mode, model, ctx


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_keeps_its_artifact_on_the_host_and_applies_it_on_the_device(
        placed, name):
    """Each registered method's fit runs without a device/host mix, keeps every tensor of its
    artifact on the host (files written on a GPU load anywhere; each use moves them), its hook
    runs on a device input, giving the logits it gives with no checker at all, and a
    hidden-space method's closed form shifts the captured (host) states on the host."""
    mode, model, ctx = placed
    method = METHODS[name]
    ids = torch.tensor([ctx.cap.encode(ctx.episode.task.query(ctx.episode.test[0].text))])
    with mode:
        art = method.extract(ctx)
        kept = list(tensors_of(art))
        assert kept and not [tuple(t.shape) for t in kept if mode.on_device(t)]
        with torch.no_grad(), method.applied(model, art):
            placed_logits = model(ids.to(model.device)).logits[0, -1]
        if method.hidden_space:  # scoring shifts the captured states, kept on the host
            h = ctx.cap.hidden([ctx.episode.task.query(ctx.episode.test[0].text)])
            assert not mode.on_device(h) and not mode.on_device(method.shift(art, h))
    with torch.no_grad(), method.applied(model, art):
        plain = model(ids).logits[0, -1]
    assert torch.equal(placed_logits, plain)


@contextmanager
def on_the_device(monkeypatch) -> Iterator[Placement]:
    """Every model the library loads (target and source) is put on the device."""
    mode = Placement()
    load = loading.load_model

    def load_on_the_device(*args, **kwargs) -> LoadedModel:
        with mode.paused():  # loaded as a GPU user's is, then put on the device
            lm = load(*args, **kwargs)
        mode.put(lm.model)
        return lm

    # the CLI imports it from its module when it runs; the pipeline (a transfer's source)
    # holds its own name for it
    monkeypatch.setattr(loading, "load_model", load_on_the_device)
    monkeypatch.setattr(pipeline_transfer, "load_model", load_on_the_device)
    with mode:
        yield mode


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_model_pair(tmp_path_factory.mktemp("pair"), WORDS)


COMMON = ["--dtype", "float32", "--device", "cpu", "--quiet", "--batch-size", "8"]


@pytest.mark.parametrize("case", ["every-method", "regression", "transfer"])
def test_evaluate_runs_on_the_device_end_to_end(pair, tmp_path, monkeypatch, case):
    """The method matrix a GPU user runs (`evaluate` with every method; a regression task;
    a transfer with the source loaded), each model on the device: no mix anywhere, and the
    scores equal the same command's with no checker."""
    args = {
        "every-method": ["--model", str(pair / "target"), "--tasks", str(pair / "toy.json"),
                         "--methods", ",".join(all_methods()), "--k", "6", "--n", "24",
                         "--n-test", "12", "--n-val", "8", "--fv-trials", "2", "--fv-prompts", "3",
                         "--i2cl-epochs", "3", "--cost-samples", "2"],
        "regression": ["--model", str(pair / "target"), "--tasks", "linear", "--methods",
                       ",".join(regression_methods()), "--k", "3", "--n", "12", "--n-test", "3",
                       "--max-new-tokens", "3"],
        "transfer": ["--model", str(pair / "target"), "--source-model", str(pair / "source"),
                     "--tasks", str(pair / "toy.json"), "--n", "24", "--n-test", "12",
                     "--methods", "zero-shot,icl,ltv,mean,ltv-transfer",
                     "--source-dtype", "float32"],
    }[case]

    def run(out: str) -> dict:
        extra = ["--work-dir", str(tmp_path / out / "w")] if case == "transfer" else []
        r = CliRunner().invoke(main, ["evaluate", *args, *COMMON, "--runs", "1", *extra,
                                      "--out", str(tmp_path / out)])
        if isinstance(r.exception, PlacementError):
            raise r.exception
        assert r.exit_code == 0, r.output
        doc = json.loads((tmp_path / out / "results.json").read_text())
        # (where and how long each episode ran is not a result)
        return {x["method"]: {k: v for k, v in x.items()
                              if not k.endswith("seconds") and k != "episode"}
                for x in doc["records"]}

    with on_the_device(monkeypatch) as mode:
        placed = run("placed")
    assert mode.models == (2 if case == "transfer" else 1) and mode.checked > 1000
    monkeypatch.undo()
    assert placed == run("plain")


def test_the_old_fv_patch_is_caught(placed, monkeypatch):
    """FV's head patch as it was (mean activations and indices left on the host) failed on a
    GPU only; under the checker the CPU suite fails on it too."""
    mode, model, ctx = placed
    layers = fv_module.decoder_layers(model)

    @contextmanager
    def old_patched_heads(_model, mean_act, layer, head):
        n_heads, hd = mean_act.shape[1:]

        def edit(x, ell, rows):
            y = x.clone()
            sub = y[rows, -1].view(len(rows), n_heads, hd)
            sub[torch.arange(len(rows)), head[rows]] = mean_act[ell, head[rows]].to(x.dtype)
            y[rows, -1] = sub.view(len(rows), n_heads * hd)
            return y

        plan = {int(ell): (layer == ell).nonzero().flatten() for ell in layer.unique()}
        with fv_module.edits(inputs=[(fv_module.attention(layers[ell]).o_proj,
                                      lambda x, ell=ell, rows=rows: edit(x, ell, rows))
                                     for ell, rows in plan.items()]):
            yield

    monkeypatch.setattr(fv_module, "patched_heads", old_patched_heads)
    with mode, pytest.raises(PlacementError, match="__setitem__"):
        METHODS["fv"].extract(ctx)


def test_i2cl_calibration_trains_the_coefficients_its_forward_uses(placed):
    """On a GPU, I2CL's coefficients were a host parameter moved to the device once, when
    the hooks went in: the optimizer updated the host copy and every epoch ran the first
    coefficients again (a flat loss). Under the checker `.to` copies as CUDA does; the
    calibration must give what it gives with no checker, epoch by epoch."""
    from ltv_vllm.methods.i2cl import calibrate

    mode, model, ctx = placed
    n, d = len(fv_module.decoder_layers(model)), model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    c_attn, c_mlp = torch.randn(n, d, generator=g) * 0.1, torch.randn(n, d, generator=g) * 0.1
    prompts = [ctx.cap.encode(ctx.episode.task.query(e.text)) for e in ctx.episode.test[:4]]
    targets = ctx.label_ids[:1] * 4

    def run() -> tuple[torch.Tensor, list[float]]:
        return calibrate(model, c_attn, c_mlp, prompts, targets, epochs=3, noise=0.0)

    plain = run()
    with mode:
        placed_coef, placed_losses = run()
        assert not mode.on_device(placed_coef)  # handed back on the host, as artifacts are
    assert len(set(plain[1])) == 3  # the loss moves from epoch to epoch
    assert placed_losses == plain[1] and torch.equal(placed_coef, plain[0])


def test_extract_writes_the_same_vector_from_the_device(pair, tmp_path, monkeypatch):
    """`extract` (capture, fit, test scoring, the file written) with the model on the
    device: no mix, and the vector the same command writes with no checker."""
    from ltv_vllm.core.vector import load_task_vector

    def run(name: str):
        r = CliRunner().invoke(main, ["extract", "--model", str(pair / "target"), "--task",
                                      str(pair / "toy.json"), "--n", "24", "--n-test", "12",
                                      *COMMON, "-o", str(tmp_path / name)])
        if isinstance(r.exception, PlacementError):
            raise r.exception
        assert r.exit_code == 0, r.output
        return load_task_vector(tmp_path / name)

    with on_the_device(monkeypatch) as mode:
        placed_tv = run("placed.pt")
    assert mode.models == 1 and mode.checked > 100
    monkeypatch.undo()
    plain = run("plain.pt")
    assert torch.equal(placed_tv.U, plain.U) and torch.equal(placed_tv.V, plain.V)
