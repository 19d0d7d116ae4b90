"""The memory plan (`models/plan.py`) on the real configs of the four models the docs plan
for (fields in tests/fixtures/configs): parameter counts against a hand count per tensor and
the model cards' published totals, the TP split against the whole, KV bytes by hand, and
the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ltv_vllm.models.plan import (
    DTYPE_BYTES,
    PlanError,
    PlanRequest,
    Shape,
    check_index,
    make_plan,
    read_shape,
)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def shape(name: str) -> Shape:
    return Shape.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def hand_count(d, inter, layers, heads, kv, vocab, hd=128, bias=False) -> int:
    """Tensor by tensor: embed, q, k, v, o (+ q/k/v biases), gate/up/down, two norms per
    layer, the final norm, an untied LM head."""
    per_layer = (d * heads * hd + 2 * d * kv * hd + heads * hd * d
                 + (heads * hd + 2 * kv * hd if bias else 0) + 3 * d * inter + 2 * d)
    return 2 * vocab * d + layers * per_layer + d


# the model cards' "Number of Parameters" (Qwen) and the Llama 3.1 totals, as published
@pytest.mark.parametrize("name, args, billions", [
    ("qwen2.5-72b", (8192, 29568, 80, 64, 8, 152064), "72.7"),
    ("qwen2.5-7b", (3584, 18944, 28, 28, 4, 152064), "7.61"),
    ("llama-3.1-8b", (4096, 14336, 32, 32, 8, 128256), "8.03"),
    ("llama-3.1-70b", (8192, 28672, 80, 64, 8, 128256), "70.6"),
])
def test_parameter_counts_are_the_models(name, args, billions):
    s = shape(name)
    want = hand_count(*args, bias=name.startswith("qwen"))
    assert s.params() == want
    # to the precision published (the cards round or truncate: 7,615,616,512 is "7.61B")
    decimals = len(billions.split(".")[1])
    assert abs(want / 1e9 - float(billions)) < 10 ** -decimals, want


NAMES = ["qwen2.5-72b", "qwen2.5-7b", "llama-3.1-8b", "llama-3.1-70b"]


@pytest.mark.parametrize("name, tp", [  # every layout whose heads split; 16 > 8 KV heads
    (n, tp) for n in NAMES for tp in (1, 2, 4, 8, 16) if shape(n).num_attention_heads % tp == 0])
def test_a_layer_split_over_tp_adds_up_to_the_layer(name, tp):
    """Summed over the ranks, a layer is the whole layer, plus the KV heads replicated where
    there are fewer than ranks, plus a norm per extra rank."""
    s = shape(name)
    b = DTYPE_BYTES["bfloat16"]
    parts = tp * s.layer_params(tp) * b
    whole = s.layer_params() * b
    kv_copies = max(tp, s.num_key_value_heads) - s.num_key_value_heads  # replicated heads
    kv_extra = 2 * kv_copies * s.head_dim * (s.hidden_size + (1 if s.attention_bias else 0))
    assert parts == whole + (kv_extra + 2 * s.hidden_size * (tp - 1)) * b


def test_kv_bytes_by_hand():
    s = shape("qwen2.5-72b")  # 80 layers × 8 KV heads × 128 × (K, V) × 2 bytes
    assert s.kv_bytes_per_token(2) == 80 * 8 * 128 * 2 * 2 == 327_680
    assert s.kv_bytes_per_token(2, tp=2) == 327_680 // 2
    assert s.kv_bytes_per_token(2, tp=16) == 80 * 1 * 128 * 2 * 2  # a KV head per rank at least
    assert s.kv_bytes_per_token(2, pp=4) == 327_680 // 4
    p = make_plan(s, PlanRequest(tp=2, devices=2, prefix_tokens=1000, query_tokens=50, batch=8))
    assert p.kv_bytes_per_device == (327_680 // 2) * (1000 + 8 * 50)


def test_what_fits_80_gb():
    """72B in bf16 (145 GB) does not fit one 80 GB GPU and does fit two; the 8B fits one."""
    big = shape("qwen2.5-72b")
    assert not make_plan(big, PlanRequest(tp=1, devices=1)).fits
    assert make_plan(big, PlanRequest(tp=2, devices=2)).fits
    assert make_plan(big, PlanRequest(tp=4, devices=4)).fits
    assert make_plan(shape("llama-3.1-8b"), PlanRequest()).fits
    one = make_plan(big, PlanRequest(tp=1, devices=1))
    assert one.param_bytes == big.params() * 2
    # PP splits the layers: every stage is smaller than the whole
    pp = make_plan(big, PlanRequest(pp=4, devices=4))
    assert pp.weight_bytes_per_device < one.weight_bytes_per_device / 3


def test_refusals_say_what_is_wrong(tmp_path):
    s = shape("qwen2.5-7b")
    with pytest.raises(PlanError, match="needs 4 devices; 2 given"):
        make_plan(s, PlanRequest(tp=4, devices=2))
    with pytest.raises(PlanError, match="28 attention heads do not split over TP 8"):
        make_plan(s, PlanRequest(tp=8, devices=8))
    with pytest.raises(PlanError, match="exceeds --max-model-len"):
        make_plan(s, PlanRequest(prefix_tokens=5000, max_model_len=4096))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(PlanError, match="no intermediate_size"):
        read_shape(tmp_path)
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3.1-8b.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * 8_030_261_248}}))
    got, total = read_shape(tmp_path)
    check_index(got, total)  # the real 8B's bytes: the reading agrees
    with pytest.raises(PlanError, match="does not read"):
        check_index(got, 3 * total)


# -- `extract --engine vllm --dry-run`: the plan printed from config.json alone ---------------


def dry_run(tmp_path, name, *args):
    """The CLI's dry run on a directory holding only the model's config.json."""
    from click.testing import CliRunner

    from conftest import write_toy_task
    from ltv_vllm.cli import main

    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_text((CONFIGS / f"{name}.json").read_text())
    task = write_toy_task(d, ["a", "b", "c"])
    return CliRunner().invoke(main, ["extract", "--model", str(d), "--task", str(task),
                                     "--engine", "vllm", "--dry-run", "--k", "10", "--n", "64",
                                     "--n-test", "32", *args])


def gib_line(out: str, what: str) -> float:
    line = next(x for x in out.splitlines() if x.strip().startswith(what))
    return float(line.strip()[len(what):].split()[0])


@pytest.mark.parametrize("name, d, inter, layers, heads, kv, vocab, bias", [
    ("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, True),
    ("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256, False),
])
def test_dry_run_prints_hand_counted_bytes(tmp_path, name, d, inter, layers, heads, kv, vocab,
                                           bias):
    """TP 2 on 2 × 80 GiB in bf16: each rank holds half the heads, half the MLP columns, half
    the embedding's vocabulary rows (no LM head: the pooling runner builds none), two whole
    norms per layer and the final norm; K and V of its KV heads for each token."""
    r = dry_run(tmp_path, name, "-tp", "2", "--devices", "2", "--device-gib", "80",
                "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    hd = 128
    q, k = heads // 2 * hd, kv // 2 * hd
    layer = d * q + 2 * d * k + q * d + (q + 2 * k if bias else 0) + 3 * d * (inter // 2) + 2 * d
    weights = 2 * (layers * layer + (vocab // 2) * d + d)  # bytes, bf16
    assert gib_line(r.output, "weights") == pytest.approx(weights / 2**30, abs=0.006)
    kv_tok = 2 * layers * (kv // 2) * hd * 2
    kv_line = next(x for x in r.output.splitlines() if "KV cache" in x)
    assert f"{kv_tok} B/token" in kv_line
    # the tokens it counted (no tokenizer here: estimated, and it says so)
    prefix, batch, query = (int(x) for x in re.search(
        r"\((\d+) prefix \+ (\d+) × (\d+) query", kv_line).groups())
    assert gib_line(r.output, "KV cache") == pytest.approx(
        kv_tok * (prefix + batch * query) / 2**30, abs=0.006)
    # one engine step of 8192 tokens: two MLP halves, q/k/v and four hidden-size buffers
    act = 8192 * (2 * (inter // 2) + q + 2 * k + 4 * d) * 2
    assert gib_line(r.output, "activations") == pytest.approx(act / 2**30, abs=0.006)
    need = gib_line(r.output, "fits        yes (")
    assert need == pytest.approx(gib_line(r.output, "weights") + gib_line(r.output, "KV cache")
                                 + gib_line(r.output, "activations"), abs=0.02)
    assert "estimated" in r.output and "nothing loaded" in r.output
    assert '"tensor_parallel_size": 2' in r.output and '"runner": "pooling"' in r.output
    assert gib_line(r.output, "label head") == pytest.approx(2 * d * 4 / 2**30, abs=0.006)


def test_dry_run_refuses_a_plan_that_does_not_fit(tmp_path):
    r = dry_run(tmp_path, "qwen2.5-72b", "--devices", "1", "--device-gib", "80")
    assert r.exit_code == 1 and "does not fit" in r.output.splitlines()[-1]
    assert "raise --tensor-parallel-size" in r.output
    r = dry_run(tmp_path / "x", "qwen2.5-72b", "-tp", "4", "--devices", "4", "--device-gib", "80")
    assert r.exit_code == 0 and "fits        yes" in r.output, r.output


def test_a_hub_id_s_dry_run_fetches_no_weights(tmp_path, monkeypatch):
    """`extract --model ORG/NAME --engine vllm --dry-run` asks the hub for the config, index
    and tokenizer files alone: a plan of a 72B model does not download its 145 GB."""
    import huggingface_hub

    from conftest import write_toy_task
    from ltv_vllm.cli import main

    d = tmp_path / "snapshot"
    d.mkdir()
    (d / "config.json").write_text((CONFIGS / "qwen2.5-72b.json").read_text())
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, **_):
        asked.append((repo_id, list(allow_patterns or [])))
        return str(d)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    task = write_toy_task(tmp_path, ["a", "b", "c"])
    from click.testing import CliRunner

    r = CliRunner().invoke(main, ["extract", "--model", "Qwen/Qwen2.5-72B", "--task", str(task),
                                  "--engine", "vllm", "--dry-run", "--k", "10", "--n", "64",
                                  "--n-test", "32", "-tp", "4", "--devices", "4",
                                  "--device-gib", "80"])
    assert r.exit_code == 0 and "fits        yes" in r.output, r.output
    assert asked and all(repo == "Qwen/Qwen2.5-72B" for repo, _ in asked)
    assert all("*.json" in pats and not any("safetensors" in x for x in pats)
               for _, pats in asked), asked


@pytest.mark.parametrize("method", ["tv", "fv", "sv", "i2cl", "i2cl-cal"])
def test_inner_layer_methods_refuse_vllm_before_any_load(tmp_path, method):
    """Refused on the method alone: the model named does not even exist."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    r = CliRunner().invoke(main, ["extract", "--model", str(tmp_path / "none"), "--task", "sst2",
                                  "--engine", "vllm", "--method", method])
    assert r.exit_code == 1
    assert f"--method {method} hooks the model's inner layers" in r.output, r.output


def test_evaluate_on_vllm_refuses_only_inner_layer_methods(tmp_path, tokenizer):
    """`evaluate --engine vllm` once refused every run: ICL (which an evaluation always runs)
    and zero-shot are not the registry's methods, and the inner-layer check asked the
    registry for them ("unknown method 'icl'"). Final-state methods are planned (a dry run:
    nothing loads), an inner-layer one is refused in its own line."""
    from click.testing import CliRunner

    from conftest import make_llama, write_toy_task
    from ltv_vllm.cli import main

    d = tmp_path / "m"
    make_llama(len(tokenizer)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    task = write_toy_task(tmp_path, ["good", "bad", "fine", "dull"])

    def evaluate(methods: str):
        return CliRunner().invoke(main, [
            "evaluate", "--model", str(d), "--tasks", str(task), "--methods", methods,
            "--engine", "vllm", "--dry-run", "--k", "4", "--n", "8", "--n-test", "8",
            "--out", str(tmp_path / "out")])

    r = evaluate("ltv,mean")
    assert r.exit_code == 0 and "nothing loaded" in r.output, r.output
    r = evaluate("ltv,tv")
    assert r.exit_code == 1 and "--method tv hooks the model's inner layers" in r.output, \
        r.output


def test_the_docs_plan_table_is_the_codes():
    """docs/scale.md's table of the four models on 1, 2, 4, 8 GPUs is `plan_table`'s output
    for the request it states (a 1500-token prefix, 256 queries of 64 tokens, bf16)."""
    from ltv_vllm.models.plan import plan_table

    shapes = {n: shape(n) for n in ["qwen2.5-72b", "llama-3.1-70b", "qwen2.5-7b",
                                    "llama-3.1-8b"]}
    table = plan_table(shapes, (1, 2, 4, 8), PlanRequest(prefix_tokens=1500, query_tokens=64,
                                                          batch=256, n_labels=4,
                                                          max_model_len=4096))
    doc = (Path(__file__).parents[1] / "docs" / "scale.md").read_text()
    assert table in doc
    # and the layouts are vLLM-valid: heads split over TP, TP × PP the GPUs
    for line in table.splitlines()[2:]:
        name, _, gpus, layout = (c.strip() for c in line.strip("|").split("|")[:4])
        tp, pp = (int(x) for x in layout.split("×"))
        assert tp * pp == int(gpus) and shapes[name].num_attention_heads % tp == 0


def test_a_transfer_sources_dry_run_plans_its_whole_head_on_the_host(tmp_path):
    """`--source-engine vllm --dry-run` plans the source (its config alone), with the whole LM
    head in float32 on the host for the logit fit: 152064 × 8192 × 4 bytes for the 72B."""
    from click.testing import CliRunner

    from conftest import write_toy_task
    from ltv_vllm.cli import main

    d = tmp_path / "qwen2.5-72b"
    d.mkdir()
    (d / "config.json").write_text((CONFIGS / "qwen2.5-72b.json").read_text())
    task = write_toy_task(tmp_path, ["a", "b", "c"])
    r = CliRunner().invoke(main, ["extract", "--source-model", str(d), "--task", str(task),
                                  "--source-engine", "vllm", "--dry-run", "-tp", "4",
                                  "--devices", "4", "--device-gib", "80", "--n", "64",
                                  "--n-test", "32"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"plan for {d}: 72.71 B parameters")
    assert gib_line(r.output, "LM head") == pytest.approx(152064 * 8192 * 4 / 2**30, abs=0.006)
    assert "all rows, float32" in r.output and '"tensor_parallel_size": 4' in r.output
    r = CliRunner().invoke(main, ["extract", "--task", str(task), "--dry-run"])
    assert r.exit_code == 1 and "--dry-run plans an --engine vllm" in r.output


@pytest.mark.parametrize("args, message", [
    (["--engine", "vllm", "-pp", "2"], "does not run on vLLM's CPU backend"),
    (["--engine", "vllm", "-tp", "0"], "--tensor-parallel-size must be at least 1"),
    (["--engine", "vllm", "--engine-arg", "enforce_eager"], "KEY=VALUE"),
    (["--engine", "vllm", "--engine-arg", "runner=generate"], "set by its own flag"),
    (["-tp", "2"], "need --engine vllm or --source-engine vllm"),
    (["--engine", "vllm", "--device", "cuda"], "places the model itself"),
])
def test_bad_vllm_engine_arguments_are_one_line_before_any_load(tmp_path, monkeypatch, args,
                                                                message):
    """Refused on the arguments alone: the model named does not even exist. (As on a CPU
    machine: on GPUs pipeline parallelism is vLLM's to run.)"""
    import torch
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["extract", "--model", str(tmp_path / "none"), "--task",
                                  "sst2", *args])
    assert r.exit_code == 1 and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
