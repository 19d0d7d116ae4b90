"""`--batch-size auto`: the planner's memory model against sums done by hand, the Capturer
planning each pass from (a stand-in for) free memory, and the same states as a fixed batch."""

from __future__ import annotations

import pytest
import torch

from ltv_vllm.extraction import batching
from ltv_vllm.extraction.batching import Shape, packed_bytes, padded_bytes, plan_batch

# 2 layers, 4 heads (2 KV heads) of 16, hidden 64, MLP 128, float32
SHAPE = Shape(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128,
              dtype_bytes=4)


def test_memory_model_by_hand():
    # keys and values: 2 (K, V) × 2 layers × 2 heads × 16 × 4 bytes = 512 bytes a position
    assert SHAPE.kv_bytes(120) == 512 * 120
    # one layer, 20 new positions over 120: scores 4·20·120·4, MLP 3·20·128·4, hidden 4·20·64·4
    assert SHAPE.layer_bytes(20, 120) == 38_400 + 30_720 + 20_480
    # 7 padded rows of 20 tokens after a 100-token prefix: each its own prefix copy
    assert padded_bytes(SHAPE, 7, 100, 20) == 7 * (61_440 + 89_600)
    # one packed row: 60 query tokens after the same prefix, once; + the float32 mask
    assert packed_bytes(SHAPE, 100, 60) == 512 * 160 + (4 * 60 * 160 * 4 + 3 * 60 * 128 * 4
                                                        + 4 * 60 * 64 * 4) + 60 * 160 * 4


def test_plan_is_the_largest_batch_within_half_the_free_memory():
    row = padded_bytes(SHAPE, 1, 100, 20)
    free = 2 * 7 * row + 1  # half of it holds 7 rows, not 8
    assert plan_batch(SHAPE, free, 100, [5, 20, 12] * 10) == 7  # rows padded to 20
    assert plan_batch(SHAPE, free, 100, [5, 20]) == 2  # never more than there are prompts
    assert plan_batch(SHAPE, 10, 100, [20] * 50) == 1  # nothing fits: one at a time
    assert plan_batch(SHAPE, 1 << 50, 0, [20] * 500) == batching.CAP
    # packed: the longest queries first; 3 × 20 tokens fit in 500,000 bytes, 4 do not
    assert packed_bytes(SHAPE, 100, 60) <= 500_000 < packed_bytes(SHAPE, 100, 80)
    assert plan_batch(SHAPE, 1_000_000, 100, [20, 3, 20, 20, 20], packed=True) == 3


def test_shape_of_a_transformers_config(tiny_model):
    cfg = tiny_model.config  # conftest: hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128
    assert Shape.of(cfg, 2) == Shape(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64,
                                     intermediate=128, dtype_bytes=2)


def test_capturer_plans_each_pass_and_matches_a_fixed_batch(tiny_model, tokenizer,
                                                            monkeypatch):
    from ltv_vllm.extraction.capture import Capturer

    prefix = "Review: a gorgeous movie\nSentiment: positive\n" * 3
    prompts = [f"Review: the plot {'is dull ' * i}\nSentiment:" for i in range(1, 12)]
    fixed = Capturer(tiny_model, tokenizer, batch_size=16, progress=False)
    want_icl, want_zs = fixed.icl(prefix, prompts), fixed.hidden(prompts)
    for pack in (True, False):
        auto = Capturer(tiny_model, tokenizer, batch_size="auto", progress=False, pack=pack)
        pre = len(auto.encode_prefix(prefix, then=prompts[0]).ids)
        suffixes = [len(auto.encode(prefix + p)) - pre for p in prompts]
        free = 2 * (packed_bytes(SHAPE, pre, sum(sorted(suffixes)[-4:])) if pack
                    else padded_bytes(SHAPE, 4, pre, max(suffixes)))
        monkeypatch.setattr(batching, "free_memory", lambda _device, free=free: free)
        got = auto.icl(prefix, prompts)
        assert auto.batch_size == 4, pack  # the planned batch, remembered
        torch.testing.assert_close(got, want_icl, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(batching, "free_memory", lambda _device: 1 << 40)
    torch.testing.assert_close(auto.hidden(prompts), want_zs, atol=1e-5, rtol=1e-5)
    assert auto.batch_size == len(prompts)


def test_bench_batch_sizes_refused_in_one_line():
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    r = CliRunner().invoke(main, ["bench", "extraction", "--shape", "llama-3.1-8b",
                                  "--batch-sizes", "8,x"])
    assert r.exit_code == 1 and r.output.strip() == (
        "Error: --batch-sizes: 'x' is neither a count nor 'auto'"), r.output


@pytest.mark.parametrize("value,ok", [("auto", True), ("8", True), ("0", False),
                                      ("lots", False)])
def test_batch_size_flag(value, ok, tmp_path):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    r = CliRunner().invoke(main, ["extract", "--task", "sst2", "--batch-size", value,
                                  "--model", str(tmp_path / "none")])
    assert r.exit_code != 0  # no model there either way; the flag is judged first
    if ok:
        assert "--batch-size" not in r.output, r.output
    else:
        assert "--batch-size" in r.output.strip().splitlines()[-1], r.output


def test_device_extraction_bench_runs_at_a_shape(tmp_path, tokenizer, tiny_model):
    """`bench extraction --shape`: a model built in place at a config's shape (random
    weights, the test tokenizer's vocabulary; a small Llama here, on this CPU: the real
    shapes are for a GPU), extract() timed per batch with the positions it computed, and the
    results written."""
    import json

    from conftest import run_cli

    tiny_model.save_pretrained(tmp_path / "tok")  # only its tokenizer is read
    tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "small.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "tie_word_embeddings": False, "max_position_embeddings": 2048}))
    out = tmp_path / "res"
    r = run_cli("bench", "extraction", "--shape", str(tmp_path / "small.json"), "--layers",
                "2", "--model", str(tmp_path / "tok"), "--tasks", "sst2", "--ks", "4", "--ns",
                "16", "--n-test", "8", "--batch-sizes", "3,auto", "--device", "cpu",
                # float32: `auto` is bf16 on a CPU with native bf16, where the two paths'
                # states differ by bf16's rounding (2.6e-3), not by a bug (issue 50)
                "--dtype", "float32", "--out", str(out), cwd=tmp_path)
    doc = json.loads((out / "results.json").read_text())
    assert [row["batch_size"] for row in doc["rows"]] == [3, "auto"]
    assert doc["layers"] == 2 and doc["vocab"] == len(tokenizer)
    # per layer q, o (128²), k, v (128·64), gate, up, down (128·256) and two norms; final norm
    assert doc["body_parameters"] == 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256
                                          + 2 * 128) + 128
    for row in doc["rows"]:
        assert row["positions"] > 0 and row["seconds"] > 0 and row["fraction_of_matmul"] > 0
    assert doc["rows"][0]["planned_batch"] == 3
    assert doc["paths"]["speedup"] > 0 and doc["paths"]["rel_diff_h_icl"] < 1e-4
    assert "| auto |" in r.stdout and "naive path" in r.stdout
