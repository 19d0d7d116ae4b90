"""The code blocks of README.md and docs/ are checked as a user would run them: every python
block compiles with no undefined name, imports only what exists, and runs to the end (on a
tiny model, or against a test server); every `ltv-vllm` command of a shell block names a real
command with real options (the command line, with `--help` added, parses). A block a reader
should not run as it stands follows an `<!-- excerpt -->` line."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow(seconds=60)  # see conftest's ordering

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(<!-- excerpt -->\s*\n)?( *)```(\w+)\n(.*?)\n\2```", re.DOTALL)


def blocks(lang: tuple[str, ...]) -> list[tuple[str, str]]:
    """(page:line, code) of every block in one of `lang`, indentation removed, excerpts
    left out."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) or m.group(3) not in lang:
                continue
            indent = len(m.group(2))
            code = "\n".join(line[indent:] for line in m.group(4).split("\n"))
            out.append((f"{page.name}:{text[:m.start()].count(chr(10)) + 1}", code))
    return out


PYTHON = blocks(("python",))
SHELL = blocks(("bash", "sh", "shell"))


def test_the_docs_have_blocks_to_check():
    assert len(PYTHON) >= 4 and len(SHELL) >= 25


@pytest.mark.parametrize("where,code", PYTHON, ids=[w for w, _ in PYTHON])
def test_python_blocks_compile_with_every_name_defined(where, code, tmp_path):
    """ruff's pyflakes rules (undefined names, unused or missing imports) over the block as a
    file of its own, and every `from ltv_vllm... import name` resolved."""
    src = tmp_path / "block.py"
    src.write_text(code + "\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated",
                        "--select", "F", "--ignore", "F401", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, (where, r.stdout)
    for mod, names in re.findall(r"^from (ltv_vllm[\w.]*) import ([\w, ]+)$", code, re.M):
        module = importlib.import_module(mod)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(module, name), (where, mod, name)


def commands(code: str) -> list[list[str]]:
    """The `ltv-vllm` command lines of a shell block: continuations joined, comments, `&`,
    pipes and redirections cut, `.venv/bin/` dropped."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        line = line.split(" #")[0].strip()
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part.strip().rstrip("&").strip())
            except ValueError:
                continue
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value before the command
            if words and words[0].removeprefix(".venv/bin/") == "ltv-vllm":
                out.append([w for w in words[1:] if not w.startswith((">", "2>"))])
    return out


CLI = [(where, args) for where, code in SHELL for args in commands(code)]


def test_the_shell_blocks_use_the_cli():
    assert len(CLI) >= 40


@pytest.mark.parametrize("where,args", CLI, ids=[f"{w}:{' '.join(a[:2])}" for w, a in CLI])
def test_cli_lines_parse(where, args):
    """The command line with `--help` added: click resolves every (sub)command and refuses an
    option a command does not have, before it prints the help."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    r = CliRunner().invoke(main, [*args, "--help"])
    assert r.exit_code == 0, (where, " ".join(args), r.output[-400:])


# Python blocks are also run, as a reader would run them, with what the suite has no copy of
# replaced by a stand-in: the packaged model by a tiny random one (saved with its tokenizer),
# the vector file by one fitted to it, the README's server by a test server
# (tests/test_server.py runs the completion clients, tests/test_chat_server.py the chat ones).
LIBRARY = [(w, c) for w, c in PYTHON if "localhost:8123" not in c]
CLIENT = [(w, c) for w, c in PYTHON if "localhost:8123" in c and "chat.completions" not in c]
CHAT_CLIENT = [(w, c) for w, c in PYTHON if "localhost:8123" in c and "chat.completions" in c]

# after a block that registers a method, the method is used, as the page goes on to say
AFTER_REGISTER = """
from ltv_vllm import ExtractOptions, extract, get_task, load_model
r = extract(load_model(MODEL), get_task("sst2"), "half-mean", ExtractOptions(k=4, n=8, n_test=8))
assert r.artifact.kind == "hidden" and 0 <= r.metrics["half-mean"]["accuracy"] <= 1
"""


def test_every_python_block_runs_somewhere():
    assert len(LIBRARY) >= 3 and len(CLIENT) >= 2 and len(CHAT_CLIENT) >= 1


@pytest.fixture(scope="module")
def doc_model(tmp_path_factory):
    """A tiny Llama vLLM can serve, with a tokenizer whose TREC and SST-2 labels have distinct
    first tokens, and a TREC vector fitted to it; (model dir, vector path)."""
    import torch

    from conftest import CORPUS, make_tokenizer, make_vllm_llama
    from ltv_vllm import ExtractOptions, extract, get_task, load_model

    corpus = CORPUS + ["Question: who is it?\nAnswer Type: Abbreviation Entity Description "
                       "Person Location Number\n"] * 20
    tok = make_tokenizer(corpus=corpus)
    d = tmp_path_factory.mktemp("doc-model")
    make_vllm_llama(tok, seed=7).save_pretrained(d / "m")
    tok.save_pretrained(d / "m")
    torch.manual_seed(0)
    r = extract(load_model(str(d / "m"), dtype="float32"), get_task("trec"), "ltv",
                ExtractOptions(k=6, n=16, n_test=6, progress=False))
    return d / "m", r.artifact.save(d / "trec.pt")


def stand_in(code: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():
        code = code.replace(old, new)
    return code


@pytest.mark.parametrize("where,code", LIBRARY, ids=[w for w, _ in LIBRARY])
def test_library_blocks_run(where, code, doc_model, tmp_path):
    """The block as a script of its own (in a fresh interpreter, in an empty directory), on
    the tiny model; exit status 0."""
    model, vector = doc_model
    code = stand_in(code, {'"smollm2-135m"': repr(str(model)), '"trec.pt"': repr(str(vector))})
    if "register(" in code:
        code += f"\nMODEL = {str(model)!r}\n" + AFTER_REGISTER
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "LTV_VLLM_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (where, r.stderr[-3000:])


def run_client_blocks(blocks: list[tuple[str, str]], url: str, model: str, cwd) -> None:
    """Client blocks as scripts against a test server: its URL for the README's, its task
    `model` for their `trec`; each exits 0 and prints."""
    for where, code in blocks:
        code = stand_in(code, {"http://localhost:8123/v1": f"{url}/v1",
                               'model="trec"': f'model="{model}"'})
        r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OPENAI_API_KEY": "EMPTY"})
        assert r.returncode == 0 and r.stdout, (where, r.stdout, r.stderr[-2000:])
