"""`ltv-vllm serve` refuses bad vectors before any engine starts (no vLLM process needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import write_model_and_vectors
from ltv_vllm.cli import main
from ltv_vllm.core.vector import VectorError
from ltv_vllm.serving.launcher.lora_plan import plan_lora
from ltv_vllm.serving.launcher.serve import parse_vector_specs


@pytest.fixture()
def setup(tmp_path, tokenizer):
    good, other = write_model_and_vectors(tmp_path, tokenizer)
    return tmp_path, good, other


def test_dry_run_commands(setup, monkeypatch):
    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector", str(good),
                                  "--dry-run", "--fold", "--enforce-eager"])
    assert r.exit_code == 0, r.output
    overrides = json.loads(r.output.split("--hf-overrides ")[1].split("' ")[0].strip("'"))
    assert overrides == {"architectures": ["LTVLlamaForCausalLM"],
                         "ltv_task_vector": str(good.resolve()), "ltv_fold": True}
    # the user's own compilation flag is passed on (before serve's: vLLM keeps a flag's last
    # value, and serve's hold the user's merged in), and serve adds no second one
    assert r.output.split(" -m vllm.entrypoints.launchers.api_server.entry ")[1].startswith(
        "--enforce-eager --model")
    assert r.output.count("--enforce-eager") == 1
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector", str(good),
                                  "--dry-run", "-O3"])
    assert r.exit_code == 0, r.output
    assert "--enforce-eager" not in r.output and " -O3 --model" in r.output
    if not torch.cuda.is_available():  # the CPU backend starts eager by default
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                      str(good), "--dry-run"])
        assert r.exit_code == 0 and "--enforce-eager" in r.output, r.output
    # the KV cache: our CPU default (2 GiB), unless the user sized it (the CPU backend lets
    # VLLM_CPU_KVCACHE_SPACE override --kv-cache-memory-bytes, so the default must stay out)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for extra, env in (([], "VLLM_CPU_KVCACHE_SPACE=2 "),
                       (["--kv-cache-memory-bytes", "67108864"], None),
                       (["--kv-cache-memory-bytes=67108864"], None)):
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                      str(good), "--dry-run", *extra])
        assert r.exit_code == 0, r.output
        assert (env in r.output) if env else ("VLLM_CPU_KVCACHE_SPACE" not in r.output), extra
    # named vectors: per-request tasks by default (every vector in the engine, the task names
    # served names of the one model, the gate that maps them, the names in the environment)
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  f"a={good}", "--task-vector", f"b={good}", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--enable-lora" not in r.output
    overrides = json.loads(r.output.split("--hf-overrides ")[1].split("' ")[0].strip("'"))
    held = json.loads(overrides["ltv_tasks"])
    assert {n: t for n, t in held.items() if not n.startswith("@")} == {
        n: {"path": str(good.resolve()), "steps": "all"} for n in "ab"}
    # beside them the start-up self-check's probes (named so that no client can name one),
    # planned in the cache and not written by a dry run
    probes = {n: t for n, t in held.items() if n.startswith("@")}
    assert sorted(probes) == ["@selfcheck-all", "@selfcheck-first", "@selfcheck-two"]
    assert not any(Path(t["path"]).exists() for t in probes.values())
    assert f"--served-model-name {tmp / 'm'} a b" in r.output
    assert "--middleware ltv_vllm.serving.vllm_ext.middleware.TaskGate" in r.output
    assert "--logits-processors ltv_vllm.serving.vllm_ext.steps:LTVStepPolicy" in r.output
    assert ("LTV_VLLM_TASKS='[\"@selfcheck-all\", \"@selfcheck-first\", "
            "\"@selfcheck-two\", \"a\", \"b\"]'") in r.output
    assert '"selfcheck": true' in r.output
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  f"a={good}", "--dry-run", "--skip-selfcheck"])
    assert r.exit_code == 0 and "@selfcheck" not in r.output, r.output
    # --multi-task lora: each vector an lm_head adapter
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  f"a={good}", "--task-vector", f"b={good}", "--dry-run",
                                  "--multi-task", "lora"])
    assert r.exit_code == 0, r.output
    assert "--enable-lora" in r.output and "--max-loras 3" in r.output
    assert "--middleware ltv_vllm.serving.vllm_ext.middleware.LoraGate" in r.output
    assert "--max-lora-rank 8" in r.output  # rank 2, padded to a rank vLLM accepts
    # the start-up self-check's probe adapters, planned in the cache, not written
    lora_probes = json.loads(r.output.split("LTV_VLLM_SERVER=")[1].split("' ")[0].strip("'"))[
        "selfcheck_lora"]
    assert sorted(lora_probes) == ["selfcheck-lora-a", "selfcheck-lora-b", "selfcheck-lora-c"]
    assert not any(Path(p).exists() for p in lora_probes.values())
    # --lora-rank cuts every adapter (W = 2·11ᵀ here has rank 1): a smaller LoRA rank
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  f"a={good}", "--task-vector", f"b={good}", "--dry-run",
                                  "--multi-task", "lora", "--lora-rank", "1"])
    assert r.exit_code == 0, r.output
    assert "--max-lora-rank 1" in r.output
    # (the start-up check's rank-4 probe adapters would raise that to 8: skipped, and said)
    assert "warning: no start-up self-check at --lora-rank 1" in r.output, r.output
    assert '"selfcheck_lora": null' in r.output
    adapter = Path(r.output.split("--lora-modules ")[1].split()[0].split("=", 1)[1])
    assert not adapter.exists()  # a dry run writes nothing
    assert not (tmp / "cache").exists()
    # the plan the dry run printed, written for real: a rank-1 adapter where it said
    plan = plan_lora(tmp / "m", {"a": good, "b": good}, lora_dir=adapter.parent, rank_cap=1)
    plan.write()
    assert plan.adapters["a"] == adapter
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 1
    for extra, message in (([str(good), "--lora-rank", "4"], "give it with --multi-task lora"),
                           ([f"a={good}", "--lora-rank", "4"], "give it with --multi-task lora"),
                           ([f"{tmp / 'm'}={good}"], "has the served model's name")):
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--dry-run",
                                      "--task-vector", *extra])
        assert r.exit_code != 0 and message in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("which,message", [("bad", "was extracted from other"),
                                           ("junk", "junk.pt"), ("missing", "not found")])
def test_refused_with_one_line(setup, which, message):
    tmp, _, bad = setup
    (tmp / "junk.pt").write_bytes(b"\x00garbage")
    path = {"bad": bad, "junk": tmp / "junk.pt", "missing": tmp / "nope.pt"}[which]
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector", str(path),
                                  "--dry-run"])
    assert r.exit_code == 1
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_vector_specs():
    assert set(parse_vector_specs(["a=x.pt", "b=y.pt"])) == {"a", "b"}
    with pytest.raises(VectorError, match="twice"):
        parse_vector_specs(["a=x.pt", "a=y.pt"])
    with pytest.raises(VectorError, match="either one vector"):
        parse_vector_specs(["x.pt", "a=y.pt"])


def test_task_store_dry_run_and_refusals(setup, monkeypatch, tokenizer):
    """`serve --task-store`: per-request tasks by default (the engine loads the store's
    tasks from its root by key; no LoRA); with `--multi-task lora` its entries become LoRA
    modules served from the store itself, with slots and a rank reserved for tasks added at
    runtime; our endpoint plugin allowlisted either way; a dry run writes nothing (not even
    the store); bad combinations are refused in one line."""
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.serving.store.taskstore import TaskStore

    tmp, good, other = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    store = tmp / "store"

    def run(*args, bare=False):
        from test_server import open_store

        return CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), *args,
                                         *([] if bare else open_store(args)), "--dry-run"])

    # a store without any key: refused unless said, in one line, before the model loads
    for args in (("--task-store", str(store)), ("--task-store", f"file://{tmp / 'open'}"),
                 ("--task-store", str(store), "--task-vector", f"beta={good}",
                  "--multi-task", "lora")):
        r = run(*args, bare=True)
        assert r.exit_code != 0 and "--allow-unauthenticated" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and not store.exists()
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "nope"), "--task-store",
                                  str(store), "--dry-run"])  # before the model is looked for
    assert r.exit_code != 0 and "--allow-unauthenticated" in r.output, r.output
    r = run("--task-vector", f"beta={good}", "--skip-selfcheck", bare=True)  # no store: open
    assert r.exit_code == 0, r.output
    r = run("--task-store", str(store))
    assert r.exit_code == 0, r.output
    assert not store.exists()  # a missing store is an empty one, created only by a real start
    assert "--enable-lora" not in r.output and "TaskGate" in r.output
    overrides = json.loads(r.output.split("--hf-overrides ")[1].split("' ")[0].strip("'"))
    assert overrides["ltv_task_store"] == str(store.absolute())
    assert f'"task_store": "{store}"' in r.output and '"store_lora": false' in r.output
    # our two, beside the other plugins vLLM would load unset (test_other_installed_plugins_…)
    assert {"ltv_vllm", "ltv_tasks"} <= set(
        next(x for x in r.output.split() if x.startswith("VLLM_PLUGINS="))[13:].split(","))
    r = run("--task-store", str(store), "--shift-steps", "2")  # the store tasks' default too
    assert r.exit_code == 0 and '"ltv_shift_steps": "2"' in r.output, r.output
    r = run("--task-store", str(store), "--multi-task", "lora")
    assert r.exit_code == 0, r.output
    assert "--enable-lora" in r.output and "--max-loras 9" in r.output  # 8 tasks + 1
    assert "--max-lora-rank 64" in r.output  # full rank min(N = 256, d = 64)
    assert "--lora-modules" not in r.output and '"store_lora": true' in r.output
    TaskStore(store).add("alpha", load_task_vector(good), tmp / "m")
    r = run("--task-store", str(store), "--task-vector", f"beta={good}", "--max-tasks", "3",
            "--multi-task", "lora")
    assert r.exit_code == 0, r.output
    assert f"alpha={store / 'alpha'}" in r.output  # served from the store, not re-exported
    # a slot for the command-line task besides the 3 store tasks, and the spare
    assert "beta=" in r.output and "--max-loras 5" in r.output
    r = run("--task-store")  # no value: the model's store under the cache
    assert r.exit_code == 0, r.output
    assert f'"task_store": "{tmp / "cache" / "task-stores"}' in r.output
    for args, words in [(("--task-store", str(store), "--task-vector", str(good)), "by name"),
                        (("--task-store", str(store), "--task-vector", f"alpha={good}"),
                         "both a --task-vector and an entry"),
                        ((), "at least one --task-vector, or a --task-store"),
                        (("--task-store", str(store), "--max-tasks", "0"), "--max-tasks"),
                        (("--task-store", str(store), "--api-server-count", "2"),
                         "give --task-store file://DIR"),
                        (("--task-store", f"file://{tmp / 'shared'}", "--multi-task", "lora",
                          "--api-server-count", "2"), "one API-server process only"),
                        (("--task-store", str(store), "--max-body-mib", "0"),
                         "--max-body-mib must be at least 1")]:
        r = run(*args)
        assert r.exit_code != 0 and words in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1
    # a shared store: each replica's copy under the cache, the store's URL beside it; a dry
    # run writes nothing (not even the store)
    shared = tmp / "shared"
    r = run("--task-store", f"file://{shared}", "--store-poll", "0.5", "--multi-task", "lora")
    assert r.exit_code == 0, r.output
    settings = json.loads(r.output.split("LTV_VLLM_SERVER=")[1].split("' ")[0].strip("'"))
    assert settings["shared_store"] == str(shared) and settings["store_poll"] == 0.5
    assert settings["task_store"].startswith(str(tmp / "cache" / "task-replicas"))
    assert "--max-loras 9" in r.output and not shared.exists()
    # a shared store holding more tasks than --max-tasks: the replica serves --max-tasks of
    # them, so its LoRA slots are the flag's (not one per index entry)
    from ltv_vllm.serving.store.shared_store import SharedStore

    big = SharedStore(f"file://{tmp / 'big'}")
    for i in range(12):
        big.add(f"t{i}", f"{i:064x}", {"format": 1}, "test")
    r = run("--task-store", f"file://{tmp / 'big'}", "--multi-task", "lora", "--max-tasks", "3")
    assert r.exit_code == 0, r.output
    assert "--max-loras 4" in r.output, r.output
    # per-task metrics are on unless turned off (then the endpoint plugin need not load)
    assert '"task_metrics": true' in r.output
    r = run("--task-vector", str(good), "--no-task-metrics", "--skip-selfcheck")
    assert r.exit_code == 0, r.output
    assert '"task_metrics": false' in r.output and "ltv_tasks" not in r.output
    # several API-server processes: vLLM's own `vllm serve` code starts them
    r = run("--task-store", f"file://{shared}", "--api-server-count", "2")
    assert r.exit_code == 0, r.output
    assert "-m ltv_vllm.serving.vllm_ext.launch " in r.output and not shared.exists()
    for args, words in [(("--task-store", f"file://{shared}", "--store-poll", "0"),
                         "--store-poll must be 0.05..3600"),
                        (("--task-store", str(store), "--export", str(tmp / "dep")),
                         "share a store (s3://… or file://…) to export")]:
        r = run(*args)
        assert r.exit_code != 0 and words in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1
    # keys and the audit log: each bad combination or file one line, before the model loads
    from ltv_vllm.serving.contract.keys import add_key

    add_key(tmp / "keys.json", "ops", "admin")
    (tmp / "bad-keys.json").write_text('{"keys": [{"id": "a", "role": "root", "sha256": "0"}]}')
    r = run("--task-store", str(store), "--api-keys", str(tmp / "keys.json"), "--audit-log",
            str(tmp / "audit.jsonl"))
    assert r.exit_code == 0, r.output
    settings = json.loads(r.output.split("LTV_VLLM_SERVER=")[1].split("' ")[0].strip("'"))
    assert settings["api_keys"][0]["id"] == "ops"
    assert settings["audit_log"] == str(tmp / "audit.jsonl")
    for args, words in [(("--task-store", str(store), "--api-keys", str(tmp / "bad-keys.json")),
                         "role must be one of"),
                        (("--task-store", str(store), "--api-keys", str(tmp / "nope.json")),
                         "cannot read it"),
                        (("--task-store", str(store), "--api-keys", str(tmp / "keys.json"),
                          "--api-key", "k"), "--api-keys with vLLM's --api-key"),
                        (("--task-vector", f"a={good}", "--audit-log", str(tmp / "a.jsonl")),
                         "give it with --task-store"),
                        (("--task-store", str(store), "--audit-log", "/proc/x/audit"),
                         "--audit-log")]:
        r = run(*args)
        assert r.exit_code != 0 and words in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1
    (tmp / "odd").mkdir()
    (tmp / "odd" / "file.txt").write_text("x")
    r = run("--task-store", f"file://{tmp / 'odd'}")
    assert r.exit_code != 0 and "a directory that is not a shared store" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    # an entry that belongs to another model is named
    import shutil

    shutil.rmtree(store / "alpha")
    from conftest import make_llama

    make_llama(len(tokenizer), seed=5).save_pretrained(tmp / "o")  # `other`'s model
    TaskStore(store).add("zeta", load_task_vector(other), tmp / "o")
    r = run("--task-store", str(store))  # an entry it cannot serve: a warning, no refusal
    assert r.exit_code == 0, r.output
    assert ("warning: task store entry 'zeta' is not served (task store entry zeta: "
            "task vector '?' was extracted from other") in r.output
    assert "would be moved to .quarantine/" in r.output
    assert (store / "zeta").is_dir()  # a dry run moves nothing


def test_a_held_store_is_refused_in_its_one_line(setup, monkeypatch, tokenizer):
    """`serve --task-store DIR` while another server holds DIR once printed vLLM's whole
    command line (the store's path in it) and the store's warnings before its refusal: now
    the refusal is the only line, and nothing is started or moved (an entry it would
    quarantine stays). It comes before the server is planned: before vLLM is imported (its
    parser reads the user's flags there) or the model and vectors are read."""
    import os

    import ltv_vllm.serving.launcher.serve as launcher
    from conftest import make_llama
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.serving.store.taskstore import TaskStore

    tmp, _, other = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    make_llama(len(tokenizer), seed=5).save_pretrained(tmp / "o")  # `other`'s model
    store = TaskStore(tmp / "store")
    store.add("zeta", load_task_vector(other), tmp / "o")  # not servable on `m`: a warning

    def no_exec(*_a):
        raise AssertionError("the server was started on a held store")

    def no_plan(*_a):
        raise AssertionError("the server was planned on a held store")

    monkeypatch.setattr(os, "execve", no_exec)
    monkeypatch.setattr(launcher, "plan_server", no_plan)
    fd = store.hold()  # the other server (this process: a second lock on it is refused)
    try:
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-store",
                                      str(store.root), "--skip-selfcheck",
                                      "--allow-unauthenticated"])
    finally:
        os.close(fd)
    assert r.exit_code == 1, r.output
    assert r.output.strip().splitlines() == [r.output.strip()], r.output
    assert "is served by another running server" in r.output and "Traceback" not in r.output
    assert (store.root / "zeta").is_dir()


def test_server_settings_travel_whole_and_default_in_one_place():
    from ltv_vllm.serving.contract.settings import ENV, ServerSettings
    from ltv_vllm.serving.launcher.serve import ServeOptions

    s = ServerSettings(task_store="/x", max_tasks=3, task_rank=64, compile_threads=2,
                       max_body=5 << 20, max_upload=123)
    assert ServerSettings.from_env(s.to_env()) == s
    assert ServerSettings.from_env({}) == ServerSettings()  # not started by `serve`
    assert list(s.to_env()) == [ENV]
    # the CLI's and ServeOptions' defaults are the settings' own
    o = ServeOptions(None, ("v.pt",))
    assert (o.max_tasks, o.compile_threads, o.max_body_mib << 20) == (
        ServerSettings.max_tasks, ServerSettings.compile_threads, ServerSettings.max_body)


def test_shift_steps_default_and_its_refusals(setup, monkeypatch):
    """`--shift-steps first`: the fused engine gets the default through its overrides and the
    step-policy processor; where no policy can apply (folded, multi-task) or the value is
    not a policy, one line and exit 1."""
    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    base = ["serve", "--model", str(tmp / "m"), "--dry-run"]
    r = CliRunner().invoke(main, [*base, "--task-vector", str(good), "--shift-steps", "first"])
    assert r.exit_code == 0, r.output
    overrides = json.loads(r.output.split("--hf-overrides ")[1].split("' ")[0].strip("'"))
    assert overrides["ltv_shift_steps"] == "first"
    assert "--logits-processors ltv_vllm.serving.vllm_ext.steps:LTVStepPolicy" in r.output
    r = CliRunner().invoke(main, [*base, "--task-vector", str(good)])
    assert "ltv_shift_steps" not in r.output  # "all", as before
    for extra, message in ((["--task-vector", str(good), "--fold", "--shift-steps", "1"],
                            "needs per-request shifts"),
                           (["--task-vector", f"a={good}", "--multi-task", "lora",
                             "--shift-steps", "first"], "needs per-request shifts"),
                           (["--task-vector", str(good), "--shift-steps", "most"],
                            "--shift-steps must be")):
        r = CliRunner().invoke(main, [*base, *extra])
        assert r.exit_code == 1 and message in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(main, [*base, "--task-vector", f"a={good}", "--multi-task", "lora"])
    assert "--logits-processors ltv_vllm.serving.vllm_ext.steps:LTVLoraRefused" in r.output
    # per-request tasks: --shift-steps is every task's default; without it each vector's own
    r = CliRunner().invoke(main, [*base, "--task-vector", f"a={good}", "--shift-steps", "2"])
    assert r.exit_code == 0, r.output
    assert '\\"steps\\": \\"2\\"' in r.output.replace('\\\\', '\\'), r.output
    # the vector's own recommendation (what `extract` records) is the default; the flag wins
    from dataclasses import replace

    from ltv_vllm.core.vector import load_task_vector

    tv = load_task_vector(good)
    first = replace(tv, provenance=replace(tv.provenance, shift_steps="first")).save(
        tmp / "first.pt")
    r = CliRunner().invoke(main, [*base, "--task-vector", str(first)])
    assert r.exit_code == 0 and '"ltv_shift_steps": "first"' in r.output, r.output
    r = CliRunner().invoke(main, [*base, "--task-vector", f"a={first}", "--task-vector",
                                  f"b={good}"])
    overrides = json.loads(r.output.split("--hf-overrides ")[1].split("' ")[0].strip("'"))
    tasks = json.loads(overrides["ltv_tasks"])
    assert {n: t["steps"] for n, t in tasks.items() if not n.startswith("@")} == {
        "a": "first", "b": "all"}
    # beside them, the start-up self-check's probes, each with its own policy
    assert {n: t["steps"] for n, t in tasks.items() if n.startswith("@")} == {
        "@selfcheck-first": "first", "@selfcheck-all": "all", "@selfcheck-two": "2"}
    r = CliRunner().invoke(main, [*base, "--task-vector", str(first), "--shift-steps", "all"])
    assert r.exit_code == 0 and "ltv_shift_steps" not in r.output
    bad = replace(tv, provenance=replace(tv.provenance, shift_steps="most")).save(tmp / "bad.pt")
    r = CliRunner().invoke(main, [*base, "--task-vector", str(bad)])
    assert r.exit_code == 1 and "meta.shift_steps: 'most' is not a step policy" in r.output


def test_a_hub_id_not_cached_offline_is_one_line(setup, monkeypatch, tmp_path):
    """`serve --model ORG/NAME` resolves a hub id as extract does (fetched into, or found
    in, the Hugging Face cache); offline and not cached: one line, exit 1, no traceback. A
    cached one is found offline, and served from its snapshot directory."""
    tmp, good, _ = setup
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # (read once, when it is imported)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    r = CliRunner().invoke(main, ["serve", "--model", "someorg/not-cached", "--task-vector",
                                  str(good), "--dry-run"])
    assert r.exit_code == 1 and "not in the Hugging Face cache" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    # the same model in the hub cache's layout: found offline
    import shutil

    snap = tmp_path / "hub" / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tmp / "m", snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0" * 40)
    r = CliRunner().invoke(main, ["serve", "--model", "someorg/tiny", "--task-vector",
                                  str(good), "--dry-run", "--skip-selfcheck"])
    assert r.exit_code == 0, r.output
    assert f"--model {snap}" in r.output, r.output
    # `models prepare` takes a hub id too: the directory, or the same one line
    r = CliRunner().invoke(main, ["models", "prepare", "someorg/tiny"])
    assert r.exit_code == 0 and r.output.strip() == str(snap), r.output
    r = CliRunner().invoke(main, ["models", "prepare", "someorg/not-cached"])
    assert r.exit_code == 1 and "not in the Hugging Face cache" in r.output, r.output


def test_dry_run_of_a_chat_fitted_vector(setup, monkeypatch):
    """A chat-fitted vector: the gate is told its template's sha256 and the server's (the
    tokenizer's, or `--chat-template`'s file or literal, as vLLM reads it); a server that
    would render with another template says so in one warning line."""
    from dataclasses import replace

    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.tasks.chat import template_digest

    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    mine = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tv = load_task_vector(good)
    chat = replace(tv, provenance=replace(tv.provenance, prompt_format={
        "name": "chat", "demos": "turns", "template_sha256": template_digest(mine)}))
    path = chat.save(tmp / "chat.pt")
    (tmp / "t.jinja").write_text(mine)
    # every spelling vLLM's own parser takes (it reads `--chat_template`, `--flag=value` and
    # a `--config` YAML as `--chat-template`): the gate must compare the template vLLM renders
    (tmp / "vllm.yaml").write_text(f"chat-template: {tmp / 't.jinja'}\n")
    for flags in (["--chat-template", mine], ["--chat-template", str(tmp / "t.jinja")],
                  ["--chat_template", str(tmp / "t.jinja")],
                  [f"--chat-template={tmp / 't.jinja'}"], ["--config", str(tmp / "vllm.yaml")]):
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                      f"c={path}", "--dry-run", *flags])
        assert r.exit_code == 0, r.output
        assert f'LTV_VLLM_CHAT_TASKS=\'{{"c": "{template_digest(mine)}"}}\'' in r.output
        assert f"LTV_VLLM_CHAT_TEMPLATE={template_digest(mine)}" in r.output
        assert "warning" not in r.output
    # the tiny tokenizer has no template of its own: every chat request would be refused
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  str(path), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "warning: the vector was fitted through another chat template" in r.output
    assert 'LTV_VLLM_CHAT_TASKS=\'{"": ' in r.output


def test_untrusted_metrics_in_a_vector_file_never_crash_the_cli(setup, monkeypatch):
    """A vector file's metrics are the uploader's: `meta.n_test = -4` crashed `serve` (and
    its dry run) with "math domain error", 10**400 with OverflowError; `inspect` raised
    KeyError for an entry without d_ntp and ValueError for an accuracy given as a string.
    Now each is read as "no figure": exit 0, a table with "-" where a figure is junk, and
    the below-zero-shot warning only where the figures are numbers."""
    from safetensors.torch import save_file

    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.core.vector_files import read_safetensors

    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    base = load_task_vector(good).save(tmp / "base.safetensors")
    header_json, held = read_safetensors(base)
    for i, (n_test, metrics) in enumerate([
            (-4, {"zero-shot": {"accuracy": 0.9, "d_ntp": 1.0},
                  "ltv": {"accuracy": 0.2, "d_ntp": 0.1}}),
            (10 ** 400, {"zero-shot": {"accuracy": 0.9, "d_ntp": 1.0},
                         "ltv": {"accuracy": 0.2, "d_ntp": 0.1}}),
            (100, {"zero-shot": {"accuracy": "0.9"}, "ltv": {"accuracy": 10 ** 400},
                   "mean": {"d_ntp": float("nan")}})]):
        header = json.loads(header_json)
        header["meta"].update({"n_test": n_test, "metrics": metrics, "method": "ltv"})
        path = tmp / f"junk{i}.safetensors"
        save_file({k: t.contiguous() for k, t in held.items()}, str(path),
                  metadata={"ltv_vllm": json.dumps(header)})
        for args in (["inspect", str(path)],
                     ["serve", "--model", str(tmp / "m"), "--task-vector", str(path),
                      "--dry-run"]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 0 and r.exception is None, (args, r.output, r.exception)
            warned = [x for x in r.output.splitlines() if "below zero-shot" in x]
            # the first two: accuracies are numbers, so the shortfall is told (no noise
            # margin from a junk n_test); the third: no number to compare
            assert len(warned) == (1 if i < 2 else 0), (i, r.output)
        if i == 2:
            r = CliRunner().invoke(main, ["inspect", str(path)])
            rows = {x.split()[0]: x.split()[1:] for x in r.output.splitlines()
                    if x.split() and x.split()[0] in ("zero-shot", "ltv", "mean")}
            assert rows["zero-shot"] == ["-", "-"] and rows["mean"] == ["-", "-"], r.output


def test_every_server_kind_leaves_the_runner_to_vllm(setup, monkeypatch):
    """Every server kind `serve` builds (fused, folded, per-request tasks, LoRA, a task
    store in either mode) leaves vLLM's model runner to the user and vLLM: nothing in the
    server's environment names one (a GPU build runs V2 by default, a CPU build V1), so a
    user's `VLLM_USE_V2_MODEL_RUNNER` reaches the engine as set. Which runner each engine
    really got is what the start-up self-check names, read from vLLM's own config
    (test_server, test_gate_attacks: V1 and V2 servers). Speculative decoding where vLLM
    would run V1 (which refuses our logits processor beside drafts) is refused in one line
    before anything is resolved."""
    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    kinds = {"fused": ["--task-vector", str(good)],
             "folded": ["--task-vector", str(good), "--fold"],
             "per-request": ["--task-vector", f"a={good}", "--task-vector", f"b={good}"],
             "lora": ["--task-vector", f"a={good}", "--multi-task", "lora"],
             "store": ["--task-vector", f"a={good}", "--task-store", str(tmp / "s1"),
                       "--allow-unauthenticated"],
             "lora store": ["--task-vector", f"a={good}", "--multi-task", "lora",
                            "--task-store", str(tmp / "s2"), "--allow-unauthenticated"]}
    for kind, args in kinds.items():
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), *args, "--dry-run"])
        assert r.exit_code == 0, (kind, r.output)
        assert "VLLM_USE_V2_MODEL_RUNNER" not in r.output, (kind, r.output)
    ngram = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    for runner, method, expect in ((None, "ngram", "no Triton backend"),
                                   ("0", "ngram", "VLLM_USE_V2_MODEL_RUNNER=0 asks for V1"),
                                   ("1", "suffix", "'suffix' on V1 only")):
        if runner is None:
            monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
        spec = ngram if method == "ngram" else [ngram[0], '{"method": "suffix"}']
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "nowhere"), "--task-vector",
                                      str(good), "--dry-run", *spec])
        assert r.exit_code != 0 and expect in r.output, (runner, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # asked for: planned as usual
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  str(good), "--dry-run", *ngram])
    assert r.exit_code == 0 and "--speculative-config" in r.output, r.output


def test_other_installed_plugins_keep_loading(setup, monkeypatch, tmp_path):
    """Our endpoint plugin must be named in VLLM_PLUGINS, which is one allowlist for every
    plugin group: with the variable unset, a server that needs it names every plugin vLLM
    would load unset (here a third-party general plugin, installed for the test), and no
    other endpoint plugin (those load only when named) nor vLLM's hub LoRA resolver (it reads
    being named as consent to download); a user's own list is kept, ours added."""
    from ltv_vllm.serving.contract.plugins import store_plugins

    dist = tmp_path / "site" / "other_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nother_general = other_plugin:register\n\n"
        "[vllm.stat_logger_plugins]\nother_logger = other_plugin:Logger\n\n"
        "[vllm.endpoint_plugins]\nother_routes = other_plugin:Routes\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    allow = store_plugins().split(",")
    assert {"ltv_vllm", "ltv_tasks", "other_general", "other_logger"} <= set(allow), allow
    assert "other_routes" not in allow and "lora_hf_hub_resolver" not in allow, allow
    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-vector",
                                  f"a={good}", "--task-store", str(tmp / "s3"),
                                  "--allow-unauthenticated", "--dry-run"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.split() if x.startswith("VLLM_PLUGINS="))
    assert set(line.split("=", 1)[1].split(",")) == set(allow), line
    monkeypatch.setenv("VLLM_PLUGINS", "mine")
    assert store_plugins() == "mine,ltv_vllm,ltv_tasks"
    assert store_plugins({"VLLM_PLUGINS": ""}, {}) == "ltv_vllm,ltv_tasks"


def _vllm_argv(output: str) -> list[str]:
    """The vLLM server argv a dry run printed, as vLLM's parser takes it."""
    import shlex

    line = next(x for x in output.splitlines() if "api_server.entry" in x)
    argv = shlex.split(line)
    return argv[argv.index("vllm.entrypoints.launchers.api_server.entry") + 1:]


def _parsed(output: str):
    """What vLLM's own parser reads of that argv (the last of a flag given twice wins)."""
    from ltv_vllm.serving.launcher.flags import vllm_flags

    parsed = vllm_flags(_vllm_argv(output))
    assert parsed is not None, output
    return parsed


def test_user_flags_kept_merged_or_refused(setup, monkeypatch, tmp_path):
    """A user's vLLM flags that serve sets too are never silently replaced: read back through
    vLLM's own parser, the served names keep the user's (the bare model) beside the tasks,
    overrides and logits processors are merged, a user's LoRA adapter joins the tasks'
    slot table in LoRA mode (its rank, targets and a slot added); conflicts are one line."""
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.serving.store.lora import export_lora

    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    # the user's own adapter: rank 16 on q_proj and lm_head (PEFT's config is what is read)
    adapter = export_lora(load_task_vector(good), tmp / "m", tmp_path / "mine")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(
        {**config, "r": 16, "target_modules": ["q_proj", "lm_head"]}))
    base = ["serve", "--model", str(tmp / "m"), "--dry-run"]
    user = ["--served-model-name", "mine", "base", "--hf-overrides", '{"rope_theta": 5000.0}',
            "--logits-processors", "my_pkg:MyProc", "--port", "9001"]
    r = CliRunner().invoke(main, [*base, "--task-vector", f"a={good}", *user])
    assert r.exit_code == 0, r.output
    got = _parsed(r.output)
    assert got.served_model_name == ["mine", "base", "a"]  # the first: the bare model's
    assert got.hf_overrides["rope_theta"] == 5000.0
    assert got.hf_overrides["architectures"] == ["LTVLlamaForCausalLM"]
    assert "a" in json.loads(got.hf_overrides["ltv_tasks"])
    assert got.logits_processors == ["my_pkg:MyProc",
                                     "ltv_vllm.serving.vllm_ext.steps:LTVStepPolicy"]
    assert got.port == 9001 and got.lora_modules is None
    # shift mode: the user's adapter served beside the tasks, as they gave it
    r = CliRunner().invoke(main, [*base, "--task-vector", f"a={good}", "--enable-lora",
                                  "--lora-modules", f"ad={adapter}", "--max-lora-rank", "16"])
    assert r.exit_code == 0, r.output
    got = _parsed(r.output)
    assert [m.name for m in got.lora_modules] == ["ad"] and got.enable_lora
    # LoRA mode: one slot table, the tasks' adapters and the user's
    r = CliRunner().invoke(main, [*base, "--task-vector", f"a={good}", "--multi-task", "lora",
                                  "--lora-modules", f"ad={adapter}", "--max-loras", "2"])
    assert r.exit_code == 0, r.output
    got = _parsed(r.output)
    assert [m.name for m in got.lora_modules] == ["a", "ad"]
    assert got.max_lora_rank == 16  # the user's adapter's r (the task's: 8)
    assert sorted(got.lora_target_modules) == ["lm_head", "q_proj"]
    # a slot per task and probe adapter... plus the user's two
    assert got.max_loras == 2 + 2
    for extra, message in (
            ([f"{tmp / 'm'}={good}", "--served-model-name", "x"], None),
            (["mine=" + str(good), "--served-model-name", "mine"], "a --served-model-name name"),
            (["ad=" + str(good), "--lora-modules", f"ad={adapter}"], "an adapter's name"),
            ([str(good), "--lora-modules", f"ad={adapter}"], "a fused vector shifts every"),
            ([f"a={good}", "--hf-overrides", '{"architectures": ["X"]}'], "'architectures'"),
            # a vLLM config file (`--config`) is read as vLLM reads it: its model and port
            ([f"a={good}", "--config", str(_yaml(tmp_path, model="other"))],
             "--model other in vLLM's arguments"),
            ([f"a={good}", "--logprobs-mode", "raw_logprobs"], "--logprobs-mode raw_logprobs"),
            ([f"a={good}", "--port", "9001", "--config", str(_yaml(tmp_path, port=9002))],
             "--port given twice")):
        r = CliRunner().invoke(main, [*base, "--task-vector", *extra])
        if message is None:  # the model's path as a task name is free once the user names it
            assert r.exit_code == 0, r.output
            continue
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


def _yaml(directory: Path, **settings) -> Path:
    """A vLLM `--config` file."""
    path = directory / f"vllm-{'-'.join(settings)}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
    return path


def test_export_reads_back_as_the_serve_command(setup, monkeypatch, tmp_path):
    """`serve --export DIR`: vLLM's parser reads DIR/vllm.yaml (`--config`) as the flags the
    started server would get; `deploy.apply` puts the environment in place in a process
    started with LTV_VLLM_DEPLOY (ltv-vllm's variables as written, the user's others kept,
    a fresh admission key, the plugin allowlist joined with the user's), once."""
    from ltv_vllm.serving.contract.wire import ADMIT_ENV
    from ltv_vllm.serving.launcher.flags import vllm_flags
    from ltv_vllm.serving.launcher.serve import ServeOptions, plan_server
    from ltv_vllm.serving.vllm_ext import deploy

    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    args = ["--model", str(tmp / "m"), "--task-vector", f"a={good}", "--task-vector",
            f"b={good}", "--enforce-eager"]
    r = CliRunner().invoke(main, ["serve", *args, "--export", str(tmp_path / "dep")])
    assert r.exit_code == 0, r.output
    exported = vllm_flags(["--config", str(tmp_path / "dep" / "vllm.yaml")])
    plan = plan_server(ServeOptions(str(tmp / "m"), (f"a={good}", f"b={good}"),
                                    vllm_args=("--enforce-eager",)))
    started = vllm_flags(plan.argv[3:])
    assert vars(exported) == vars(started)
    # the start-up self-check's probe files were written (a dry run writes none)
    probes = json.loads(exported.hf_overrides["ltv_tasks"])
    assert all(Path(t["path"]).is_file() for n, t in probes.items() if n.startswith("@"))
    env = {"LTV_VLLM_DEPLOY": str(tmp_path / "dep"), "VLLM_CPU_KVCACHE_SPACE": "7",
           "VLLM_PLUGINS": "mine"}
    assert deploy.apply(env) and not deploy.apply(env)  # once per process tree
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "7" and env["VLLM_PLUGINS"] == "mine,ltv_vllm,ltv_tasks"
    assert env["LTV_VLLM_TASKS"] == plan.env["LTV_VLLM_TASKS"]
    assert json.loads(env[ADMIT_ENV])["every"] is False
    assert env[ADMIT_ENV] != plan.env[ADMIT_ENV]  # its own key, never written to the files
    assert plan.env[ADMIT_ENV] not in (tmp_path / "dep" / "environment.json").read_text()
    with pytest.raises(deploy.DeployError, match="cannot read"):
        deploy.apply({"LTV_VLLM_DEPLOY": str(tmp_path / "nowhere")})


@pytest.mark.parametrize("specs", [["{good}"], ["a={good}", "b={other}"]])
def test_a_plan_reads_each_vector_file_once(setup, monkeypatch, specs, tmp_path):
    """Planning a server (checks, overrides, warnings, chat digests) reads each vector file
    once, fused or multi-task; a file replaced meanwhile is read again."""
    import ltv_vllm.serving.launcher.serve as serve_mod
    from ltv_vllm.core.layer_task import load_any
    from ltv_vllm.core.vector import load_task_vector

    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    other = load_task_vector(good)
    second = other.save(tmp_path / "second.pt")
    reads: list[str] = []

    def counted(path):
        reads.append(str(path))
        return load_any(path)  # a final-layer vector or a layer task, as the plan reads one

    monkeypatch.setattr(serve_mod, "load_any", counted)
    serve_mod._checked_vector.cache_clear()
    vectors = tuple(s.format(good=good, other=second) for s in specs)
    serve_mod.plan_server(serve_mod.ServeOptions(str(tmp / "m"), vectors))
    assert sorted(reads) == sorted({str(Path(v.split("=")[-1]).resolve()) for v in vectors})
    import os
    import time

    # a file's mtime is what says it was replaced: a later one, whatever the filesystem's
    # timestamp resolution (nothing to wait on but the clock)
    time.sleep(0.01)
    os.utime(good)  # replaced: read again
    reads.clear()
    serve_mod.plan_server(serve_mod.ServeOptions(str(tmp / "m"), vectors))
    assert str(good.resolve()) in reads


def test_an_export_holds_no_secret(setup, monkeypatch):
    """`--export` with vLLM's `--api-key`: the key is in no file of the export, and a start
    from it without a key stops in one line (`required_problem`); keys files and a shared
    store's keys are written as where they are, never as hashes."""
    from types import SimpleNamespace

    from ltv_vllm.serving.contract.deploy import required_problem
    from ltv_vllm.serving.contract.keys import add_key
    from ltv_vllm.serving.contract.settings import ServerSettings

    tmp, good, _ = setup
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    secret = "sk-do-not-write-me-0123456789"
    for extra, where in ((("--", "--api-key", secret), "dep1"),
                         ((f"--api-key={secret}",), "dep2")):
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-store",
                                      f"file://{tmp / 'shared'}", "--export",
                                      str(tmp / where), *extra])
        assert r.exit_code == 0, r.output
        assert secret not in r.output
        files = list((tmp / where).rglob("*"))
        assert files and not any(secret in p.read_text() for p in files if p.is_file())
        env = json.loads((tmp / where / "environment.json").read_text())["env"]
        settings = ServerSettings.from_env(env)
        assert settings.required["api_key"] is True
        args = SimpleNamespace(served_model_name=settings.required["served_model_name"],
                               api_key=None, hf_overrides=settings.required["hf_overrides"],
                               logits_processors=settings.required["logits_processors"],
                               middleware=settings.required["middleware"], lora_modules=[],
                               logprobs_mode=settings.required["logprobs_mode"])
        assert "give the key at start" in required_problem(args, settings.required)
        assert required_problem(SimpleNamespace(**{**vars(args), "api_key": ["k"]}),
                                settings.required) is None
    keys = tmp / "keys.json"
    add_key(keys, "ops", "admin")
    r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--task-store",
                                  f"file://{tmp / 'shared'}", "--api-keys", str(keys),
                                  "--export", str(tmp / "dep3")])
    assert r.exit_code == 0, r.output
    settings = ServerSettings.from_env(json.loads(
        (tmp / "dep3" / "environment.json").read_text())["env"])
    assert settings.api_keys is None and settings.api_keys_file == str(keys)
    assert "api_key" not in settings.required
