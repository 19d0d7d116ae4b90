"""A soak of the runtime task store: mixed completions at high concurrency while tasks are
uploaded, compiled and deleted, every answer checked against transformers.

    python benchmarks/store_soak.py --model smollm2-135m --requests 2000 --concurrency 32 \
        --out benchmarks/results/store_soak_smollm2-135m

1. Offline: `ltv-vllm extract` of a few packaged tasks (float32): the vectors the run
   uploads, and one served from the command line (`--task-vector cli=...`).
2. `ltv-vllm serve --task-store` (empty store, `--max-tasks 3`, `--api-key`) on that model.
3. `--concurrency` clients send completions without pause (greedy, 1-8 tokens, top-5
   logprobs) to a name drawn from what is live: the bare model, the command-line task and
   the store's tasks. Meanwhile a controller churns the store: it uploads vectors under
   reused names, compiles demonstrations, and deletes tasks while their requests are still
   in flight (a deleted name leaves the clients' draw first; the DELETE follows at once, so
   the server must drain what it admitted). Every live version's vector is read back from
   the store when it becomes live.
4. Afterwards every answer is recomputed with transformers (+ the vector its name carried
   when the request was sent, at the steps its policy shifts): the generated tokens must be
   the reference's greedy choices and every returned logprob must match within `--tol`.
   Besides plain completions, `--attack-share` of the requests come in shapes the server
   must either answer right or refuse (400): `/invocations` (the model in the body or in
   SageMaker's adapter header), beam search (a task's refused, the bare model's answered
   and checked; also spelled "yes"), a raw engine key (refused), a task's chat without
   consent (refused), the task named by `vllm_xargs.ltv_task` beside the base model
   (answered, checked), a background response and scale-out's `/inference/v1/generate`
   naming the task or its raw key in `extra_args` (refused: the admission rule). The
   engine's batch (`--max-num-seqs`, 8) is below the concurrency, so DELETEs meet queued
   requests. Any other answer is an error; an engine death ends the server.

Done when: >= 1,000 completions, 0 wrong answers, 0 errors (issue 25).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from ltv_vllm.bench.online import Server
from ltv_vllm.extraction.apply import task_vector_applied
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
from ltv_vllm.serving.contract.wire import parse_steps
from ltv_vllm.serving.launcher.serve import ServeOptions, plan_server
from ltv_vllm.serving.store.compile import CompileRequest
from ltv_vllm.serving.store.taskstore import TaskStore, vector_digest
from ltv_vllm.tasks.specs import get_task

HOST, KEY = "127.0.0.1", "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Live:
    """What clients may ask for: name → (version id, vector or None); versions keep every
    vector a name ever carried, for the check afterwards."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[str, int] = {}
        self.versions: list[tuple[str, object]] = []  # id → (name, TaskVector | None)

    def add(self, name: str, vector: object) -> None:
        with self.lock:
            self.versions.append((name, vector))
            self.names[name] = len(self.versions) - 1

    def drop(self, name: str) -> None:
        with self.lock:
            del self.names[name]

    def draw(self, rng: random.Random) -> tuple[str, int]:
        with self.lock:
            name = rng.choice(sorted(self.names))
            return name, self.names[name]


# request shapes beside plain completions (`--attack-share` of the requests): each is either
# answered right (checked like the rest) or refused as it must be (400), never anything else
SHAPES = ("invocations", "invocations-header", "beam", "raw-key", "chat-no-consent",
          # issue 49: the task named by vllm_xargs beside the base model (answered, checked);
          # beam search in a lax spelling; a background response and scale-out's raw
          # generate route naming the task (refused: no route but the three carries one)
          "xargs-task", "beam-lax", "background", "scale-out", "scale-out-raw-key")


def client(url: str, live: Live, prompts: list[str], quota: list[int], log: list,
           seed: int, attack_share: float, store: TaskStore, base: str) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=300, headers=AUTH) as http:
        while True:
            with live.lock:
                if quota[0] <= 0:
                    return
                quota[0] -= 1
            name, version = live.draw(rng)
            prompt = rng.choice(prompts)
            n = rng.randint(1, 8)
            shape = rng.choice(SHAPES) if rng.random() < attack_share else "completion"
            body = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                    "logprobs": 5, "return_tokens_as_token_ids": True,
                    "return_token_ids": True}
            path, headers, refused = "/v1/completions", {}, False
            if shape.startswith("invocations"):
                path = "/invocations"
                if shape == "invocations-header":  # SageMaker names the model in a header
                    headers["X-Amzn-SageMaker-Adapter-Identifier"] = body.pop("model")
            elif shape in ("beam", "beam-lax"):  # a task's beam search is refused; the
                # bare model's runs (vLLM reads "yes" as true: so must the gate)
                body.update(use_beam_search=True if shape == "beam" else "yes", n=1)
                refused = name != base
            elif shape in ("raw-key", "scale-out-raw-key"):  # the server's, never a client's
                try:
                    entry = store.get(name)
                    key = f"{name}@{vector_digest(entry.vector_path)}"
                except Exception:  # noqa: BLE001 - not a store task (or just deleted)
                    key = f"{name}@0000000000000000"
                body.update(model=base, vllm_xargs={"ltv_task": key})
                refused = True
                if shape == "scale-out-raw-key":
                    path = "/inference/v1/generate"
                    body = raw_generate(http, url, base, prompt, n, {"ltv_task": key})
            elif shape == "xargs-task":  # named beside the base model: answered as the task
                if name != base:
                    body.update(model=base, vllm_xargs={"ltv_task": name})
            elif shape == "background":
                path = "/v1/responses"
                body = {"model": name, "input": prompt, "background": True,
                        "max_output_tokens": n}
                refused = name != base
            elif shape == "scale-out":
                path = "/inference/v1/generate"
                body = raw_generate(http, url, base, prompt, n,
                                    {"ltv_task": name} if name != base else None)
                refused = name != base
            elif shape == "chat-no-consent":
                path = "/invocations"
                body = {"model": name, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": n, "temperature": 0.0}
                refused = name != base
                if not refused:
                    body["max_tokens"] = 1  # the bare model's chat: answered, not checked
            t0 = time.time()
            rec = {"name": name, "version": version, "prompt": prompt, "t0": t0,
                   "shape": shape, "expect": 400 if refused else 200}
            try:
                r = http.post(f"{url}{path}", json=body, headers=headers)
                out = r.json() if r.headers.get("content-type", "").startswith(
                    "application/json") else {"text": r.text[:300]}
                rec.update(t1=time.time(), status=r.status_code)
                if r.status_code == 200 and shape in ("background", "scale-out"):
                    pass  # the bare model's (not checked: no logprobs on these routes)
                elif r.status_code == 200 and shape != "chat-no-consent":
                    choice = out["choices"][0]
                    lp = choice.get("logprobs") or {}
                    rec["tokens"] = ([int(t.split(":", 1)[1]) for t in lp["tokens"]]
                                     if lp.get("tokens") else list(choice["token_ids"]))
                    rec["top"] = [{int(k.split(":", 1)[1]): v for k, v in top.items()}
                                  for top in lp.get("top_logprobs") or []]
                    rec["model_answered"] = out.get("model")
                    if shape == "xargs-task":
                        rec["model_answered"] = name if out.get("model") == name else \
                            f"{out.get('model')} (for {name})"
                elif r.status_code != 200:
                    rec["error"] = json.dumps(out)[:300]
            except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
                # no answer, or not the answer's shape: an error, never a lost record
                rec.update(t1=time.time(), status=None, error=repr(e))
            log.append(rec)


def raw_generate(http: httpx.Client, url: str, base: str, prompt: str, n: int,
                 extra: dict | None) -> dict:
    """A scale-out /inference/v1/generate body: token ids and raw sampling params (their
    `extra_args` are the engine's own view of `vllm_xargs`)."""
    ids = http.post(f"{url}/tokenize", json={"model": base, "prompt": prompt}).json()["tokens"]
    params = {"max_tokens": n, "temperature": 0.0, **({"extra_args": extra} if extra else {})}
    return {"model": base, "token_ids": ids, "sampling_params": params}


def controller(url: str, store: TaskStore, live: Live, vectors: dict[str, Path],
               compile_body: dict, done: threading.Event, events: list, errors: list) -> None:
    """Churn until the clients are done: upload / compile / delete under reused names."""
    rng = random.Random(1)
    names = ["A", "B", "C"]
    held: set[str] = set()
    pool = sorted(vectors)
    i = 0
    with httpx.Client(timeout=600, headers=AUTH) as http:
        while not done.is_set():
            i += 1
            free = [n for n in names if n not in held]
            if free and (len(held) < 2 or rng.random() < 0.5):
                name = free[0]
                t0 = time.time()
                if i % 4 == 0:  # a compile: the worker extracts while traffic runs
                    r = http.post(f"{url}/v1/ltv/tasks", json={**compile_body, "name": name})
                    ok = r.status_code == 202
                    while ok and (view := http.get(f"{url}/v1/ltv/tasks/{name}").json()
                                  )["status"] != "ready":
                        ok = view["status"] != "failed"
                        time.sleep(0.5)
                    kind = "compile"
                else:
                    src = vectors[pool[i % len(pool)]]
                    r = http.post(f"{url}/v1/ltv/tasks", data={"name": name},
                                  files={"vector": (src.name, src.read_bytes())})
                    ok = r.status_code == 201
                    kind = f"upload {src.stem}"
                if not ok:
                    errors.append(f"{kind} {name}: {r.status_code} {r.text[:300]}")
                    continue
                held.add(name)
                live.add(name, store.get(name).vector())  # the vector the store serves
                events.append({"t": time.time(), "event": kind, "name": name,
                               "seconds": time.time() - t0})
            elif held:
                name = rng.choice(sorted(held))
                live.drop(name)  # no client draws it from here on ...
                time.sleep(0.05)  # ... and the ones that did are sent or in flight
                t0 = time.time()
                r = http.delete(f"{url}/v1/ltv/tasks/{name}")
                if r.status_code == 202:  # its requests outlast the wait: removed after
                    while http.get(f"{url}/v1/ltv/tasks/{name}").status_code != 404:
                        time.sleep(0.2)
                elif r.status_code != 200:
                    errors.append(f"delete {name}: {r.status_code} {r.text[:300]}")
                held.discard(name)
                events.append({"t": time.time(), "event": "delete", "name": name,
                               "seconds": time.time() - t0})
            time.sleep(rng.uniform(0.5, 2.0))


def verify(log: list, live: Live, model_spec: str, tol: float) -> dict:
    """Every 200 answer recomputed with transformers (+ the vector its version carried)."""
    from ltv_vllm.models.loading import load_model

    lm = load_model(model_spec, dtype="float32")
    model, tok = lm.model, lm.tokenizer
    wrong, worst, checked = [], 0.0, 0
    cache: dict = {}
    for rec in log:
        if rec["status"] != 200 or "tokens" not in rec:
            continue
        _, tv = live.versions[rec["version"]]
        key = (rec["version"], rec["prompt"], tuple(rec["tokens"]))
        if key not in cache:
            ids = tok(rec["prompt"])["input_ids"] + rec["tokens"]
            n_prompt = len(ids) - len(rec["tokens"])
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
                if tv is not None:
                    # the server shifts the first `steps` generated tokens (the vector's
                    # step policy, `meta.shift_steps`; extracted and compiled vectors
                    # record "first"), the bare model writes the rest
                    steps = parse_steps(tv.provenance.shift_steps or "all")
                    with task_vector_applied(model, tv, check=False):  # checked on upload
                        shifted = model(torch.tensor([ids])).logits[0]
                    cut = len(ids) if steps is None else n_prompt - 1 + steps
                    logits = torch.cat([shifted[:cut], logits[cut:]])
            cache[key] = torch.log_softmax(logits.double(), -1)[n_prompt - 1:]
        ref = cache[key]
        bad = None
        tops = rec["top"] or [{}] * len(rec["tokens"])  # beam search: its tokens only
        for step, (token, top) in enumerate(zip(rec["tokens"], tops, strict=True)):
            row = ref[step]
            if float(row.max() - row[token]) > tol:  # not the greedy choice
                bad = f"step {step}: token {token} is {float(row.max() - row[token]):.3g} " \
                      "below the reference's best"
            for t, v in top.items():
                err = abs(v - float(row[t]))
                worst = max(worst, err)
                if err > tol and bad is None:
                    bad = f"step {step}: logprob of {t} off by {err:.3g}"
        checked += 1
        if bad is not None:
            wrong.append({"name": rec["name"], "version": rec["version"], "why": bad})
    return {"checked": checked, "wrong": len(wrong), "wrong_examples": wrong[:10],
            "max_abs_logprob_error": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="sst2,trec,subj,sst5",
                    help="first: the command-line task; the rest: uploaded vectors")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-3, help="logprob tolerance (float32)")
    ap.add_argument("--attack-share", type=float, default=0.25,
                    help="share of requests in the other shapes: /invocations (body or "
                         "SageMaker header), beam search, raw engine keys, chat without "
                         "consent")
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="the engine's batch: below the concurrency, requests queue, so "
                         "DELETEs meet queued requests")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/store_soak"))
    a = ap.parse_args()
    names = a.tasks.split(",")
    work = Path(tempfile.mkdtemp(prefix="store-soak-"))
    res: dict = {"command": " ".join(sys.argv), "model": a.model, "dtype": "float32",
                 "requests": a.requests, "concurrency": a.concurrency, "tol": a.tol,
                 "machine": hardware()}
    res["machine_line"] = machine_line(res["machine"])
    print(res["machine_line"], flush=True)

    vectors = {}
    for t in names:
        vectors[t] = work / f"{t}.pt"
        subprocess.run([sys.executable, "-m", "ltv_vllm.cli", "extract", "--model", a.model,
                        "--task", t, "--n-test", "1", "--dtype", "float32", "--quiet",
                        "-o", str(vectors[t])], check=True, stdout=subprocess.DEVNULL)
        print(f"extracted {t}", flush=True)
    ep = plan_episode(get_task("sst2"), ExtractOptions(k=8, n=64, n_test=1, seed=3, n_val=0))
    compile_body = CompileRequest.from_episode("x", ep, test=False).to_dict()
    prompts = []
    for t in names:
        e = plan_episode(get_task(t), ExtractOptions(k=8, n=8, n_test=10, seed=7, n_val=0))
        prompts += [get_task(t).query(x.text) for x in e.test]

    port = 8000 + (hash(str(work)) % 1000)
    store = TaskStore(work / "store")
    plan = plan_server(ServeOptions(a.model, (f"cli={vectors[names[0]]}",), host=HOST,
                                    port=port, dtype="float32", task_store=str(store.root),
                                    max_tasks=3, vllm_args=("--api-key", KEY, "--max-num-seqs",
                                                               str(a.max_num_seqs),
                                                               "--enable-scale-out")))
    plan.prepare()
    url = f"http://{HOST}:{port}"
    from ltv_vllm.core.vector import load_task_vector

    live = Live()
    live.add(plan.argv[plan.argv.index("--served-model-name") + 1], None)  # the bare model
    live.add("cli", load_task_vector(vectors[names[0]]))
    log: list = []
    events: list = []
    errors: list = []
    done = threading.Event()
    with Server(plan.argv[3:], url=url, env={**plan.env, "TOKENIZERS_PARALLELISM": "false",
                                             "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
                log_path=work / "server.log") as srv:
        res["server_startup_seconds"] = srv.startup_s
        t0 = time.time()
        ctl = threading.Thread(target=controller, args=(
            url, store, live, {t: vectors[t] for t in names[1:]}, compile_body, done, events,
            errors))
        ctl.start()
        quota = [a.requests]
        base = plan.argv[plan.argv.index("--served-model-name") + 1]
        clients = [threading.Thread(target=client, args=(
            url, live, prompts, quota, log, i, a.attack_share, store, base))
            for i in range(a.concurrency)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        done.set()
        ctl.join()
        res["seconds"] = time.time() - t0
        # the server is still up and still refuses a request without the key
        res["health_after"] = httpx.get(f"{url}/health").status_code
        res["unauthenticated_after"] = httpx.get(f"{url}/v1/models").status_code
        # one server process the whole run: an engine death ends vLLM's server
        res["engine_deaths"] = int(srv.proc.poll() is not None or res["health_after"] != 200)
    print(f"{len(log)} completions in {res['seconds']:.0f} s; verifying", flush=True)
    by_kind: dict[str, int] = {}
    for rec in log:
        kind = ("bare" if live.versions[rec["version"]][1] is None else
                "command-line" if rec["name"] == "cli" else "store")
        by_kind[kind] = by_kind.get(kind, 0) + 1
    res["completions"] = len(log)
    res["completions_by_kind"] = by_kind
    # an error: any answer but the one its shape must get (200, or 400 for a refused shape)
    res["errors"] = sum(rec["status"] != rec["expect"] for rec in log)
    res["error_examples"] = [(rec["shape"], rec["status"], rec.get("error"))
                             for rec in log if rec["status"] != rec["expect"]][:10]
    res["shapes"] = {s: {"sent": sum(r["shape"] == s for r in log),
                         "refused": sum(r["shape"] == s and r["status"] == 400 for r in log),
                         "answered": sum(r["shape"] == s and r["status"] == 200 for r in log)}
                     for s in ("completion", *SHAPES)}
    # a task's answer names the task (the bare model's: its served name)
    res["misnamed"] = sum(1 for r in log if r["status"] == 200 and "model_answered" in r
                          and r["model_answered"] != r["name"])
    res["store_events"] = {k: sum(e["event"].startswith(k) for e in events)
                           for k in ("upload", "compile", "delete")}
    res["controller_errors"] = errors
    res["versions_served"] = len(live.versions)
    res["events"] = events
    res.update(verify(log, live, a.model, a.tol))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    line = (f"{res['completions']} completions ({by_kind}) at concurrency {a.concurrency} in "
            f"{res['seconds']:.0f} s while the store saw {res['store_events']}: "
            f"{res['wrong']} wrong, {res['misnamed']} misnamed, {res['errors']} errors, "
            f"{res['engine_deaths']} engine deaths, controller errors {len(errors)}, "
            f"max |Δlogprob| {res['max_abs_logprob_error']:.2g}; request shapes "
            f"{res['shapes']}")
    (a.out / "README.md").write_text(
        f"# Task-store soak\n\n`{res['command']}`\n\n{res['machine_line']}\n\n{line}\n")
    print(line)
    ok = (res["completions"] >= 1000 and res["wrong"] == 0 and res["errors"] == 0
          and res["misnamed"] == 0 and res["engine_deaths"] == 0 and not errors)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
