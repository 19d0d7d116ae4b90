"""Chaos run: three replicas of a real model share one task store while clients send
completions to all of them and a controller uploads, deletes, races and kills.

    python benchmarks/replica_chaos.py --model smollm2-135m --store s3 \
        --out benchmarks/results/replica_chaos_smollm2-135m_s3

1. Offline: `ltv-vllm extract` of a few packaged tasks (float32); versions of a name are
   those vectors scaled (each a new digest).
2. The store: a directory, or moto's S3-API server in a process of its own (`--store s3`).
   Three `ltv-vllm serve --task-store URL --store-poll P` replicas, each in its own session.
3. `--concurrency` clients send greedy completions (1-6 tokens, top-5 logprobs) to a random
   replica, naming the bare model or a task the controller has added. The controller runs
   rounds of: an upload on one replica (the time until each other replica lists it loaded:
   the propagation latency); a DELETE on one replica while the clients ask the others for
   that task; two replicas uploading one name at once (exactly one may win); kill -9 of a
   replica mid-upload and of a replica mid-load (right after an upload elsewhere), each
   restarted; and, with S3, the object store stopped (SIGSTOP: moto keeps its data in
   memory, so a killed one would be a new, empty store) for a few seconds under load and
   resumed. With `--corrupt`, each round also writes one damaged index generation into the
   store by hand, as a confused operator or a newer release could: an entry that is not an
   object, a record with a NaN, a record of an unknown format, a digest naming no object,
   or a generation cut in half. Every replica must stay up with its routes answering
   (/metrics, /v1/models, /v1/ltv/tasks), refuse the damaged name, keep following (an upload
   on one reaches the others) and, once a good generation follows, serve as before.
4. Afterwards every answer is recomputed with transformers: a 200 must be the greedy loop of
   a version its name held in the store within the propagation bound of the request
   (poll + `--slack` seconds), logprobs within `--tol`; any other answer must be a clear
   error (a 4xx/5xx with a one-line message) or a refused connection to a replica the
   controller had killed. Engine deaths: any replica that stops without being killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from ltv_vllm.core.vector import TaskVector, load_task_vector
from ltv_vllm.extraction.apply import task_vector_applied
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
from ltv_vllm.serving.contract.wire import parse_steps
from ltv_vllm.serving.store.shared_store import SharedStore, _generation_key, digest_of
from ltv_vllm.tasks.specs import get_task

HOST, KEY = "127.0.0.1", "chaos-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Replica:
    """One `ltv-vllm serve` in a session of its own (kill -9 ends all of it)."""

    def __init__(self, i: int, argv: list[str], env: dict[str, str], work: Path) -> None:
        self.i, self.argv, self.env, self.work = i, argv, env, work
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.killed = 0  # times the controller killed it
        self.up = threading.Event()

    def start(self) -> float:
        t0 = time.time()
        log = open(self.work / f"replica{self.i}.log", "ab")  # noqa: SIM115 - the process's
        self.proc = subprocess.Popen([*self.argv, "--port", str(self.port)], stdout=log,
                                     stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while time.time() - t0 < 600:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.i} exited at start; see its log")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.up.set()
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"replica {self.i} did not start")

    def kill(self) -> None:
        self.up.clear()
        self.killed += 1
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def died(self) -> bool:
        """Stopped without being killed (an engine death ends vLLM's server)."""
        return self.proc.poll() is not None and self.up.is_set()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class Versions:
    """Every vector a name held in the store, with when (the controller's clock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[dict] = []  # {name, digest, tv, added, removed}
        self.live: dict[str, int] = {}  # name → index of its current version

    def add(self, name: str, tv: TaskVector, digest: str, t: float) -> None:
        with self.lock:
            self.items.append({"name": name, "digest": digest, "tv": tv, "added": t,
                               "removed": None})
            self.live[name] = len(self.items) - 1

    def remove(self, name: str, t: float) -> None:
        with self.lock:
            if name in self.live:
                self.items[self.live.pop(name)]["removed"] = t

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.live)

    def candidates(self, name: str, t_send: float, t_recv: float, bound: float) -> list[dict]:
        with self.lock:
            return [v for v in self.items if v["name"] == name and v["added"] <= t_recv
                    and (v["removed"] is None or v["removed"] >= t_send - bound)]


def client(replicas: list[Replica], versions: Versions, base: str, prompts: list[str],
           stop: threading.Event, log: list, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120, headers=AUTH) as http:
        while not stop.is_set():
            up = [r for r in replicas if r.up.is_set()]  # as a router's health checks
            if not up:
                time.sleep(0.1)
                continue
            r = rng.choice(up)
            names = versions.names()
            name = rng.choice([base, *names]) if names else base
            prompt, n = rng.choice(prompts), rng.randint(1, 6)
            rec = {"replica": r.i, "name": name, "prompt": prompt, "t_send": time.time()}
            try:
                resp = http.post(f"{r.url}/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                    "logprobs": 5, "return_tokens_as_token_ids": True, "ignore_eos": True})
                rec["status"] = resp.status_code
                if resp.status_code == 200:
                    lp = resp.json()["choices"][0]["logprobs"]
                    rec["tokens"] = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
                    rec["top"] = [{int(k.split(":", 1)[1]): v for k, v in top.items()}
                                  for top in lp["top_logprobs"]]
                else:
                    msg = resp.json().get("error", {}).get("message", resp.text)
                    rec["error"] = str(msg)[:300]
            except (httpx.HTTPError, ValueError) as e:
                rec["status"] = "connection"
                rec["error"] = type(e).__name__
                rec["replica_down"] = not r.up.is_set()
            rec["t_recv"] = time.time()
            log.append(rec)


class Controller:
    def __init__(self, replicas: list[Replica], store: SharedStore, vectors: list[TaskVector],
                 versions: Versions, work: Path, poll: float, moto: subprocess.Popen | None,
                 seed: int) -> None:
        self.replicas, self.store, self.vectors = replicas, store, vectors
        self.versions, self.work, self.poll, self.moto = versions, work, poll, moto
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.errors: list[str] = []
        self.made = 0
        self.lock = threading.Lock()

    def version(self) -> tuple[TaskVector, Path, str]:
        """A new vector (a packaged task's, scaled): a new digest."""
        with self.lock:  # the race's two uploads make theirs at once
            self.made += 1
            made = self.made
        src = self.vectors[made % len(self.vectors)]
        tv = TaskVector(src.kind, src.U * (0.6 + 0.1 * (made % 7)), src.V, src.bias,
                        src.model, src.label_token_ids, src.meta)
        path = tv.save(self.work / f"v{made}.safetensors")
        return tv, path, digest_of(path.read_bytes())

    def upload(self, r: Replica, name: str) -> tuple[int | str, TaskVector, str, float]:
        tv, path, digest = self.version()
        t = time.time()
        try:
            resp = httpx.post(f"{r.url}/v1/ltv/tasks", headers=AUTH, timeout=120,
                              data={"name": name},
                              files={"vector": (path.name, path.read_bytes())})
            status: int | str = resp.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        if status == 201:
            self.versions.add(name, tv, digest, t)
        return status, tv, digest, t

    def listed(self, r: Replica, name: str) -> dict | None:
        try:
            data = httpx.get(f"{r.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return next((c.get("ltv") for c in data if c.get("id") == name), None)

    def propagation(self, name: str, digest: str | None, others: list[Replica]) -> list[float]:
        """Seconds until each other replica lists `name` loaded with `digest` (None: gone)."""
        t0, out = time.time(), []
        for r in others:
            while time.time() - t0 < 60:
                card = self.listed(r, name)
                if (card is None if digest is None else
                        card is not None and card["loaded"] and card["digest"] == digest[:16]):
                    break
                time.sleep(0.02)
            else:
                self.errors.append(f"{name} never reached replica {r.i}")
            out.append(time.time() - t0)
        return out

    def sync_versions(self) -> None:
        """After a kill mid-upload: what the store holds decides."""
        idx = self.store.index()
        for name in self.versions.names():
            with self.versions.lock:
                cur = self.versions.items[self.versions.live[name]]["digest"]
            if idx.digest(name) != cur:
                self.versions.remove(name, time.time())

    def round(self, k: int) -> None:
        up = [r for r in self.replicas if r.up.is_set()]
        a, b, c = self.rng.sample(up, 3)
        name = f"t{k % 2}"  # from round 2 on, each round deletes its name first
        if name in self.versions.names():  # a DELETE on one replica, the others streaming
            t = time.time()
            resp = httpx.delete(f"{b.url}/v1/ltv/tasks/{name}", headers=AUTH, timeout=120)
            self.versions.remove(name, t)
            self.events.append({"event": "delete", "status": resp.status_code,
                                "seconds": round(time.time() - t, 3),
                                "gone_after": self.propagation(name, None, [a, c])})
        status, _, digest, _ = self.upload(a, name)
        self.events.append({"event": "upload", "status": status,
                            "loaded_after": self.propagation(name, digest, [b, c])
                            if status == 201 else None})
        # two replicas upload one name at once
        race = f"race{k}"
        out: dict = {}
        th = [threading.Thread(target=lambda r=r: out.__setitem__(r.i, self.upload(r, race)))
              for r in (a, b)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        codes = sorted(str(v[0]) for v in out.values())
        if codes != ["201", "409"]:
            self.errors.append(f"race {race}: {codes}")
        self.events.append({"event": "race", "statuses": codes})
        httpx.delete(f"{c.url}/v1/ltv/tasks/{race}", headers=AUTH, timeout=120)
        self.versions.remove(race, time.time())
        if k % 2 == 0:  # kill -9 a replica mid-upload, restart it
            victim = c
            th = threading.Thread(target=self.upload, args=(victim, f"k{k}"))
            th.start()
            time.sleep(self.rng.uniform(0.0, 2.5))  # before, during or after the store writes
            victim.kill()
            th.join()
            self.sync_versions()
            idx = self.store.index()
            torn = f"k{k}" in idx.tasks and not self._readable(idx.digest(f"k{k}"))
            self.events.append({"event": "kill mid-upload", "replica": victim.i,
                                "in_store": f"k{k}" in idx.tasks, "torn": torn,
                                "restart_seconds": round(victim.start(), 1)})
            if torn:
                self.errors.append(f"k{k}: a torn entry")
            self._clean(f"k{k}", a)
        else:  # kill -9 a replica while it copies a new upload, restart it
            status, _, digest, _ = self.upload(a, f"k{k}")
            c.kill()
            restart = c.start()
            card = self.listed(c, f"k{k}")
            self.events.append({"event": "kill mid-load", "replica": c.i,
                                "restart_seconds": round(restart, 1),
                                "served_after_restart": bool(card and card["loaded"])})
            self._clean(f"k{k}", a)
        if self.moto is not None and k % 3 == 2:  # the object store stops, then resumes
            self.moto.send_signal(signal.SIGSTOP)
            t = time.time()
            time.sleep(5)
            status, *_ = self.upload(a, f"s{k}")  # while stopped: 503, never 201
            self.moto.send_signal(signal.SIGCONT)
            self.events.append({"event": "store stopped 5 s", "upload_status": status,
                                "upload_seconds": round(time.time() - t - 5, 2)})
            if status == 201:
                self.errors.append("an upload was stored while the store was stopped")
            self._clean(f"s{k}", a)

    CORRUPTIONS = ("non-object", "nan", "format", "foreign-digest", "truncated")

    def corrupt(self, k: int, kind: str) -> None:
        """Write one damaged index generation by hand (the replicas' writer never does), check
        that every replica stays up and keeps following, then write a good one after it."""
        up = [r for r in self.replicas if r.up.is_set()]
        a, b = self.rng.sample(up, 2)
        g = self.store._generations()[-1]
        doc = json.loads(self.store.backend.get(_generation_key(g)))
        tasks = dict(doc["tasks"])
        good = next((v for v in tasks.values() if isinstance(v, dict)), None)
        bad = f"bad{k}"
        if kind == "non-object" or good is None:
            tasks[bad] = "not-a-dict"
        elif kind == "nan":
            tasks[bad] = {"digest": good["digest"], "record": {**good["record"],
                                                                 "lam": float("nan")}}
        elif kind == "format":
            tasks[bad] = {"digest": good["digest"], "record": {**good["record"], "format": 2}}
        else:  # foreign-digest (and truncated: a whole record, then the file cut)
            tasks[bad] = {"digest": "f" * 64, "record": good["record"]}
        data = json.dumps({"generation": g + 1, "tasks": tasks, "writer": "chaos",
                           "time": "now"}).encode()  # NaN as JSON's NaN
        if kind == "truncated":
            data = data[: len(data) // 2]
        self.store.backend.create(_generation_key(g + 1), data)
        t0 = time.time()
        self._wait_generation(up, g + 1 if kind != "truncated" else None)
        routes = self._routes(up)
        refused = self._asked_for(up, bad)
        status, *_ = self.upload(a, f"c{k}")
        after = None
        if status == 201:
            after = self.propagation(f"c{k}", self.store.index().digest(f"c{k}"),
                                     [r for r in up if r is not a])
        elif kind != "truncated":  # only a torn newest generation may stop an upload
            self.errors.append(f"corrupt {kind}: an upload answered {status}")
        # repaired: a good generation after the damaged one (the damaged name dropped)
        clean = {n: v for n, v in doc["tasks"].items() if n != bad}
        if status == 201:
            clean = {n: v for n, v in self.store.index().tasks.items() if n != bad}
        g2 = self.store._generations()[-1] + 1
        self.store.backend.create(_generation_key(g2), json.dumps(
            {"generation": g2, "tasks": clean, "writer": "chaos-repair",
             "time": "now"}).encode())
        status2, *_ = self.upload(b, f"r{k}")
        after2 = (self.propagation(f"r{k}", self.store.index().digest(f"r{k}"),
                                   [r for r in up if r is not b]) if status2 == 201 else None)
        if status2 != 201:
            self.errors.append(f"corrupt {kind}: after the repair an upload answered {status2}")
        self.events.append({"event": f"corrupt {kind}", "routes": routes,
                            "damaged_name": refused, "upload_status": status,
                            "loaded_after": after, "repaired_upload_status": status2,
                            "repaired_loaded_after": after2,
                            "seconds": round(time.time() - t0, 2)})
        if any(s != 200 for s in routes.values()):
            self.errors.append(f"corrupt {kind}: a route answered {routes}")
        if any(s == 200 for s in refused.values()):
            self.errors.append(f"corrupt {kind}: the damaged name was answered")
        for n in (f"c{k}", f"r{k}"):
            self._clean(n, a)

    def _wait_generation(self, replicas: list[Replica], g: int | None) -> None:
        """Until each replica serves index generation `g` (its metric); None: a generation
        no replica can read, so three polls."""
        if g is None:
            time.sleep(3 * self.poll)
            return
        for r in replicas:
            end = time.time() + 60
            while time.time() < end:
                try:
                    text = httpx.get(f"{r.url}/metrics", headers=AUTH, timeout=10).text
                except httpx.HTTPError:
                    text = ""
                seen = [float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith("ltv_vllm:task_store_generation")]
                if seen and seen[0] >= g:
                    break
                time.sleep(0.05)
            else:
                self.errors.append(f"replica {r.i} never followed generation {g}")

    def _routes(self, replicas: list[Replica]) -> dict[str, int | str]:
        out: dict[str, int | str] = {}
        for r in replicas:
            for path in ("/metrics", "/v1/models", "/v1/ltv/tasks", "/health"):
                try:
                    out[f"{r.i}{path}"] = httpx.get(f"{r.url}{path}", headers=AUTH,
                                                    timeout=30).status_code
                except httpx.HTTPError as e:
                    out[f"{r.i}{path}"] = type(e).__name__
        return out

    def _asked_for(self, replicas: list[Replica], name: str) -> dict[str, int | str]:
        """A completion naming the damaged record: never a 200."""
        out: dict[str, int | str] = {}
        for r in replicas:
            try:
                resp = httpx.post(f"{r.url}/v1/completions", headers=AUTH, timeout=60, json={
                    "model": name, "prompt": "x", "max_tokens": 1})
                out[str(r.i)] = resp.status_code
                msg = str(resp.json().get("error", {}).get("message", ""))
                if resp.status_code != 200 and ("\n" in msg or not msg):
                    self.errors.append(f"damaged name {name}: an unclear error {msg[:80]!r}")
            except (httpx.HTTPError, ValueError) as e:
                out[str(r.i)] = type(e).__name__
        return out

    def _readable(self, digest: str) -> bool:
        try:
            self.store.vector(digest)
            return True
        except Exception:  # noqa: BLE001 - a torn or missing object
            return False

    def _clean(self, name: str, r: Replica) -> None:
        if name in self.store.index().tasks:
            httpx.delete(f"{r.url}/v1/ltv/tasks/{name}", headers=AUTH, timeout=120)
        self.versions.remove(name, time.time())


def verify(log: list, versions: Versions, base: str, model_spec: str, tol: float,
           bound: float) -> dict:
    from ltv_vllm.models.loading import load_model

    lm = load_model(model_spec, dtype="float32")
    model, tok = lm.model, lm.tokenizer
    cache: dict = {}

    def reference(prompt: str, tokens: list[int], tv) -> torch.Tensor:
        key = (prompt, tuple(tokens), id(tv))
        if key not in cache:
            if len(cache) >= 64:  # the log is walked by prompt and tokens: old keys are done
                cache.clear()
            ids = tok(prompt)["input_ids"] + tokens
            n_prompt = len(ids) - len(tokens)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
                if tv is not None:
                    steps = parse_steps(tv.provenance.shift_steps or "all")
                    with task_vector_applied(model, tv, check=False):
                        shifted = model(torch.tensor([ids])).logits[0]
                    cut = len(ids) if steps is None else n_prompt - 1 + steps
                    logits = torch.cat([shifted[:cut], logits[cut:]])
            cache[key] = torch.log_softmax(logits.double(), -1)[n_prompt - 1:]
        return cache[key]

    def fits(rec: dict, tv) -> float | None:
        ref, worst = reference(rec["prompt"], rec["tokens"], tv), 0.0
        for step, (token, top) in enumerate(zip(rec["tokens"], rec["top"], strict=True)):
            row = ref[step]
            if float(row.max() - row[token]) > tol:
                return None
            for t, v in top.items():
                worst = max(worst, abs(v - float(row[t])))
        return worst if worst <= tol else None

    wrong, checked, worst = [], 0, 0.0
    # by prompt and tokens, so one answer's references are computed once and then dropped:
    # a cache of every (prompt, tokens, version) row set held ~10 GB after 6,933 requests
    for rec in sorted(log, key=lambda r: (r["prompt"], tuple(r.get("tokens") or ()))):
        if rec["status"] != 200:
            continue
        cands = ([None] if rec["name"] == base else
                 [v["tv"] for v in versions.candidates(rec["name"], rec["t_send"],
                                                       rec["t_recv"], bound)])
        errs = [e for tv in cands if (e := fits(rec, tv)) is not None]
        checked += 1
        if errs:
            worst = max(worst, min(errs))
        else:
            wrong.append({k: rec[k] for k in ("replica", "name", "t_send")})
    return {"checked": checked, "wrong": len(wrong), "wrong_examples": wrong[:10],
            "max_abs_logprob_error": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="sst2,trec,subj")
    ap.add_argument("--store", choices=["dir", "s3"], default="s3")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--slack", type=float, default=2.0,
                    help="seconds beyond the poll a replica may answer with a version the "
                         "store no longer holds (its follow under way)")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--corrupt", action="store_true",
                    help="each round also writes a damaged index generation by hand")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="replica-chaos-"))
    res: dict = {"command": " ".join(["python", *sys.argv]), "model": a.model,
                 "dtype": "float32", "store": a.store, "poll": a.poll, "machine": hardware()}
    res["machine_line"] = machine_line(res["machine"])
    print(res["machine_line"], flush=True)
    vectors = []
    for t in a.tasks.split(","):
        path = work / f"{t}.pt"
        subprocess.run([sys.executable, "-m", "ltv_vllm.cli", "extract", "--model", a.model,
                        "--task", t, "--n-test", "1", "--dtype", "float32", "--quiet",
                        "-o", str(path)], check=True, stdout=subprocess.DEVNULL)
        vectors.append(load_task_vector(path))
    prompts = []
    for t in a.tasks.split(","):
        e = plan_episode(get_task(t), ExtractOptions(k=8, n=8, n_test=6, seed=7, n_val=0))
        prompts += [get_task(t).query(x.text) for x in e.test]

    # three replicas on this machine's cores: vLLM's CPU backend would pin each one's
    # threads to the same core ("auto" binding); one thread each, unbound, and the worker
    # inside the engine-core process (one process less per replica)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    moto = None
    if a.store == "s3":
        port = free_port()
        moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p",
                                 str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        env.update({"AWS_ENDPOINT_URL": f"http://{HOST}:{port}", "AWS_ACCESS_KEY_ID": "x",
                    "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"})
        os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                                "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
        import boto3

        for _ in range(100):
            try:
                boto3.client("s3").create_bucket(Bucket="tasks")
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        url = "s3://tasks/chaos"
    else:
        url = f"file://{work / 'shared'}"
    store = SharedStore(url)
    base = a.model
    argv = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", a.model,
            "--dtype", "float32", "--task-store", url, "--store-poll", str(a.poll),
            "--max-tasks", "8", "--api-key", KEY, "--host", HOST]
    replicas = [Replica(i, argv, env, work) for i in range(3)]
    versions, log = Versions(), []
    stop = threading.Event()
    try:
        threads = [threading.Thread(target=r.start) for r in replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        res["start_seconds"] = "concurrent"
        ctl = Controller(replicas, store, vectors, versions, work, a.poll, moto, seed=1)
        clients = [threading.Thread(target=client, args=(replicas, versions, base, prompts,
                                                         stop, log, i))
                   for i in range(a.concurrency)]
        t0 = time.time()
        for c in clients:
            c.start()
        for k in range(a.rounds):
            ctl.round(k)
            if a.corrupt:
                ctl.corrupt(k, ctl.CORRUPTIONS[k % len(ctl.CORRUPTIONS)])
            print(f"round {k}: {len(log)} requests", flush=True)
        stop.set()
        for c in clients:
            c.join()
        res["seconds"] = round(time.time() - t0, 1)
        res["engine_deaths"] = sum(r.died() for r in replicas)
        res["replicas_killed"] = sum(r.killed for r in replicas)
        res["health_after"] = [httpx.get(f"{r.url}/health").status_code for r in replicas]
    finally:
        stop.set()
        for r in replicas:
            r.stop()
        if moto is not None:
            moto.send_signal(signal.SIGCONT)
            moto.kill()
    res["events"] = ctl.events
    res["controller_errors"] = ctl.errors
    statuses: dict[str, int] = {}
    for rec in log:
        statuses[str(rec["status"])] = statuses.get(str(rec["status"]), 0) + 1
    res["requests"] = len(log)
    res["statuses"] = statuses
    # a clear error: a 4xx/5xx with a one-line message, or a refused connection to a replica
    # the controller had killed
    unclear = [r for r in log if r["status"] != 200 and not (
        (isinstance(r["status"], int) and r.get("error") and "\n" not in r["error"])
        or (r["status"] == "connection" and r.get("replica_down")))]
    res["unclear_errors"] = len(unclear)
    res["unclear_examples"] = unclear[:10]
    res["error_messages"] = sorted({r["error"][:120] for r in log
                                    if isinstance(r["status"], int) and r["status"] != 200})
    lat = [x for e in ctl.events if e["event"] == "upload" and e["loaded_after"]
           for x in e["loaded_after"]]
    gone = [x for e in ctl.events if e["event"] == "delete" for x in e["gone_after"]]
    res["propagation_seconds"] = {
        "upload_max": max(lat, default=None), "upload_mean": sum(lat) / len(lat) if lat else None,
        "delete_max": max(gone, default=None), "delete_mean":
            sum(gone) / len(gone) if gone else None}
    print(f"{len(log)} requests in {res['seconds']} s; verifying", flush=True)
    res.update(verify(log, versions, base, a.model, a.tol, a.poll + a.slack))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    line = (f"{res['requests']} requests ({statuses}) over 3 replicas on a {a.store} store in "
            f"{res['seconds']} s, {res['replicas_killed']} replicas killed and restarted: "
            f"{res['wrong']} wrong of {res['checked']} answers checked, "
            f"{res['unclear_errors']} unclear errors, {res['engine_deaths']} engine deaths, "
            f"controller errors {len(ctl.errors)}; propagation "
            f"{json.dumps(res['propagation_seconds'])}; max |Δlogprob| "
            f"{res['max_abs_logprob_error']:.2g}")
    (a.out / "README.md").write_text(
        f"# Replica chaos run\n\n`{res['command']}`\n\n{res['machine_line']}\n\n{line}\n")
    print(line)
    ok = (res["wrong"] == 0 and res["unclear_errors"] == 0 and res["engine_deaths"] == 0
          and not ctl.errors)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
