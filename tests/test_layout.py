"""The package's layout is its architecture: wings stacked in one order, each importing only
the ones below it, no import circle anywhere, vLLM only in the serving wing (and the
benchmarks that drive it). Read with the standard library's `ast`, every import counted —
those inside functions too, since a lazy import is still a dependency."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

import ltv_vllm

PKG = Path(ltv_vllm.__file__).parent

# bottom → top; a module may import its own wing and the ones before it
WINGS = ("errors", "tasks", "core", "models", "extraction", "methods", "pipeline", "serving",
         "evaluation", "jobs", "bench", "cli")
VLLM_WINGS = ("serving", "bench")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, is_package: bool) -> set[str]:
    """Every module `name`'s source imports (absolute names; `from X import y` counts as X
    and, when X.y is a module of the package, X.y)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module → the package's modules it imports (names that are not modules dropped)."""
    known = set(sources)
    return {m: {t for t in imports_of(src, m, pkg) if t in known and t != m}
            for m, (src, pkg) in sources.items()}


def wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the root package belongs to no wing


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    g = graph(sources)
    found = []
    # upward imports between wings
    for m, targets in g.items():
        for t in targets:
            a, b = wing(m), wing(t)
            if a is None or b is None:
                continue  # the root: __version__ and the lazy public API only
            if a not in WINGS or b not in WINGS:
                found.append(f"{m if a not in WINGS else t}: in no wing")
            elif WINGS.index(b) > WINGS.index(a):
                found.append(f"upward import: {m} ({a}) imports {t} ({b})")
    # circles (Tarjan's strongly connected components)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append("import circle: " + " → ".join(sorted(comp)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    # vLLM outside its wings
    for m, (src, pkg) in sources.items():
        if wing(m) not in VLLM_WINGS and any(
                t == "vllm" or t.startswith("vllm.") for t in imports_of(src, m, pkg)):
            found.append(f"vllm imported outside {'/'.join(VLLM_WINGS)}: {m}")
    return found


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p, PKG): (p.read_text(), p.name == "__init__.py")
            for p in PKG.rglob("*.py")}


def test_the_package_keeps_its_layers():
    assert violations(package_sources()) == []


def test_every_wing_says_what_lives_there():
    for w in WINGS:
        path = PKG / w / "__init__.py"
        if (PKG / w).is_dir():
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc.split()) >= 20, f"{w}/__init__.py: no paragraph"
        else:
            assert (PKG / f"{w}.py").is_file(), w
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        w for w in WINGS if (PKG / w).is_dir()}, "a folder that is not a wing"


def test_the_root_exports_the_public_api():
    for name in ltv_vllm.__all__:
        assert getattr(ltv_vllm, name) is not None, name
    from ltv_vllm import TaskVector, extract
    from ltv_vllm.core.vector import TaskVector as tv
    from ltv_vllm.pipeline.extract import extract as ex
    assert (TaskVector, extract) == (tv, ex)


def _fake(**modules: str) -> dict[str, tuple[str, bool]]:
    return {("ltv_vllm." + k.replace("__", ".")): (v, False) for k, v in modules.items()}


@pytest.mark.parametrize("modules, expect", [
    ({"core__ridge": "from ltv_vllm.serving import serve", "serving__serve": ""},
     "upward import: ltv_vllm.core.ridge (core) imports ltv_vllm.serving.serve (serving)"),
    ({"models__a": "def f():\n    from ltv_vllm.models import b\n",
      "models__b": "from . import a\n"},
     "import circle: ltv_vllm.models.a → ltv_vllm.models.b"),
    ({"methods__x": "def f():\n    import vllm.lora\n"},
     "vllm imported outside serving/bench: ltv_vllm.methods.x"),
    ({"stray__x": "from ltv_vllm.core import y", "core__y": ""},
     "ltv_vllm.stray.x: in no wing"),
])
def test_the_check_fails_on_what_it_guards(modules, expect):
    assert expect in violations(_fake(**modules))
    # and the same modules with the offending line gone pass
    assert violations(_fake(**{k: "" for k in modules})) == []


def test_the_results_index_links_every_committed_result():
    root = PKG.parent
    index = (root / "docs" / "results.md").read_text()
    for d in sorted((root / "benchmarks" / "results").iterdir()):
        if d.is_dir():
            assert f"](../benchmarks/results/{d.name}/" in index, \
                f"docs/results.md does not link {d.name}"


def test_the_readme_is_a_quick_start():
    readme = (PKG.parent / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert ("bash scripts/setup.sh && .venv/bin/ltv-vllm extract --task trec -o trec.pt\n"
            ".venv/bin/python -m pytest -q\n") in readme  # its two commands
    assert ".venv/bin/python -m pytest -q\n" in (PKG.parent / ".ci" / "run").read_text()


def _tables(text: str) -> list[list[str]]:
    out, cur = [], []
    for line in text.split("\n"):
        if line.startswith("|"):
            cur.append(line.strip())
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def test_numbers_copied_from_results_match_them():
    """The quick start's printed table is the one the committed quick-start result holds, and
    every docs table that copies a results.md table (its header and a row found there) has
    every row there: a number edited by hand, or a result regenerated without the docs,
    fails."""
    root = PKG.parent
    results = {p: p.read_text() for p in (root / "benchmarks" / "results").rglob("*.md")}
    readme = (root / "README.md").read_text()
    block = readme.split("```\ntrec on smollm2-135m", 1)[1].split("```", 1)[0]
    quick = results[root / "benchmarks" / "results" / "quickstart" / "results.md"]
    for line in block.strip().split("\n")[1:6]:  # the header and the four methods
        assert line in quick, line
    checked = 0
    for page in sorted((root / "docs").glob("*.md")):
        for table in _tables(page.read_text()):
            header, rows = table[0], table[2:]
            best, hits = None, 0  # the result this table copies: the most rows in common
            for text in results.values():
                lines = {x.strip() for x in text.split("\n")}
                n = sum(r in lines for r in rows)
                if header in lines and n > hits:
                    best, hits = lines, n
            if best is not None:
                missing = [r for r in rows if r not in best]
                assert not missing, f"{page.name}: {missing[0]} is not in its result"
                checked += 1
    assert checked >= 6  # the copied tables of docs/benchmarks.md


def _cell(text: str) -> str:
    return text.strip().strip("*").strip()


def _label_to_method() -> dict[str, str]:
    from ltv_vllm.evaluation.evaluate import all_methods, method_label

    return {method_label(m): m for m in all_methods()}


def _shown(cell: str, value: float) -> bool:
    """`cell` is `value` rounded to the digits it shows (a figure rounded twice is not)."""
    dec = len(cell.split(".")[1]) if "." in cell else 0
    return abs(float(cell) - value) <= 0.5 * 10 ** -dec + 1e-9


def test_the_docs_accuracy_tables_are_their_results():
    """Every method × task accuracy table in the docs (`| accuracy (%) | sst2 | ...` or
    `| method | sst2 | ...`), after the command that wrote its result (`--out
    benchmarks/results/NAME`), equals that result's summary: per-task accuracy, the average
    accuracy and the average d_NTP, to the digits shown."""
    import re

    root = PKG.parent
    labels = _label_to_method()
    labels.update({k.lower(): v for k, v in labels.items()})
    labels["I2CL calibrated"] = "i2cl-cal"
    short = {"hate": "hate_speech18"}
    avg_acc, avg_dntp = {"Avg.", "avg. acc."}, {"d_NTP avg.", "avg. d_NTP"}
    checked = tables = 0
    for page in sorted((root / "docs").glob("*.md")):
        text = page.read_text()
        for table in _tables(text):
            head = [_cell(c) for c in table[0].strip("|").split("|")]
            if head[0] not in ("accuracy (%)", "method") or not {"sst2", "trec"} & set(head):
                continue
            before = text[: text.index(table[0])]
            name = re.findall(r"--out benchmarks/results/([\w.\-]+)", before)[-1]
            doc = json.loads((root / "benchmarks" / "results" / name / "results.json")
                             .read_text())
            per_task, avg = doc["summary"]["per_task"], doc["summary"]["average"]
            tables += 1
            for row in table[2:]:
                cells = [_cell(c) for c in row.strip("|").split("|")]
                m = labels[cells[0]]
                for col, cell in zip(head[1:], cells[1:], strict=False):
                    task = short.get(col, col)
                    if task in per_task:
                        want = 100 * per_task[task][m]["accuracy"]
                    elif col in avg_acc:
                        want = 100 * avg[m]["accuracy"]
                    elif col in avg_dntp:
                        want = avg[m]["d_ntp"]
                    else:
                        continue  # extraction times, the paper's figures
                    assert _shown(cell, want), (
                        f"{page.name} ({name}): {cells[0]} {col} {cell} ≠ {want}")
                    checked += 1
    assert tables >= 4 and checked >= 150


def test_the_kernel_table_is_its_results():
    """docs/methods.md's table of the maps beyond the paper: accuracy / d_NTP averaged over
    every (task, run) of the two kernel results."""
    root = PKG.parent
    rows = {"zero-shot": "zero-shot", "ICL (k = 30)": "icl", "linear, λ = 5 (the paper)": "ltv",
            "linear, λ by LOO": "ltv-auto", "kernel (RBF), γ and λ by LOO": "kernel",
            "MLP mapping (2 layers, the paper's ablation)": "mlp"}
    table = next(t for t in _tables((root / "docs" / "methods.md").read_text())
                 if t[0].startswith("| map | SmolLM2-135M, 7 tasks × 3 runs"))
    avgs = [json.loads((root / "benchmarks" / "results" / n / "results.json").read_text())
            ["summary"]["average"] for n in ("kernel_smollm2-135m", "kernel_qwen2.5-coder-1.5b")]
    for row in table[2:]:
        cells = [_cell(c) for c in row.strip("|").split("|")]
        m = rows[cells[0]]
        for cell, avg in zip(cells[1:3], avgs, strict=True):
            acc = f"{100 * avg[m]['accuracy']:.1f}"
            want = f"{acc} / —" if m == "icl" else f"{acc} / {avg[m]['d_ntp']:.3f}"
            assert cell.replace("*", "") == want, (cells[0], cell, want)


def test_the_serving_table_is_its_result():
    """docs/benchmarks.md's offline serving table equals benchmarks/results/serving."""
    root = PKG.parent
    off = json.loads((root / "benchmarks" / "results" / "serving" / "results.json")
                     .read_text())["offline"]
    modes = {"zero-shot": "zero-shot", "ICL k=30, prefix cache": "icl-prefix-cache",
             "ICL k=30, no prefix cache": "icl-no-cache", "LTV fused": "ltv-fused",
             "LTV folded": "ltv-folded", "LTV multi-task (LoRA, 4 tasks mixed)": "ltv-lora",
             "zero-shot (again, last)": "zero-shot (again)"}
    table = next(t for t in _tables((root / "docs" / "benchmarks.md").read_text())
                 if t[0].startswith("| Mode (offline) | req/s"))
    zs = off["zero-shot"]
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        r = off[modes[c[0]]]
        gen = r["output_tokens_per_s"]
        want = [f"{r['requests_per_s']:.1f}", f"{r['requests_per_s'] / zs['requests_per_s']:.2f}×",
                f"{gen:.0f}" if gen else "—",
                f"{gen / zs['output_tokens_per_s']:.2f}×" if gen else "—",
                f"{100 * r['accuracy']:.1f}%", f"{r['prompt_tokens_mean']:.0f}"]
        got = c[1:7]
        assert got == want, (c[0], got, want)
        assert c[8] == f"{r['peak_rss_bytes'] / 2**30:.1f} GiB", (c[0], c[8])


def test_the_online_and_extraction_cost_tables_are_their_results():
    """docs/benchmarks.md's online serving table (req/s, p50, p99 at 1 / 8 / 32 in flight)
    and its extraction-cost table (ours, naive, speed-up) equal their results."""
    root = PKG.parent
    res = root / "benchmarks" / "results"
    text = (root / "docs" / "benchmarks.md").read_text()
    online = json.loads((res / "serving" / "results.json").read_text())["online"]
    modes = {"zero-shot": "zero-shot", "ICL, prefix cache": "icl-prefix-cache",
             "ICL, no prefix cache": "icl-no-cache", "LTV fused": "ltv-fused",
             "LTV multi-task (LoRA)": "ltv-lora"}
    table = next(t for t in _tables(text) if t[0].startswith("| Online, 1 / 8 / 32"))
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        levels = [online[modes[c[0]]][n] for n in ("1", "8", "32")]
        want = [" / ".join(f"{x['requests_per_s']:.1f}" for x in levels),
                " / ".join(f"{x['latency_p50_ms']:.0f}" for x in levels),
                " / ".join(f"{x['latency_p99_ms']:.0f}" for x in levels)]
        assert c[1:4] == want, (c[0], c[1:4], want)
    rows = json.loads((res / "extraction_cost" / "results.json").read_text())["rows"]
    table = next(t for t in _tables(text) if t[0].startswith("| k (demo tokens) | N |"))
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        k, n = int(c[0].split()[0]), int(c[1])
        r = next(x for x in rows if x["k"] == k and x["n"] == n)
        want = [f"{k} ({r['prefix_tokens']})", str(n),
                f"{r['ours_capture_seconds'] + r['fit_seconds']:.1f}",
                f"{r['naive_capture_seconds'] + r['fit_seconds']:.1f}", f"{r['speedup']:.1f}×"]
        assert c == want, (c, want)


def test_the_lora_rank_table_is_its_results():
    """docs/benchmarks.md's serving-at-a-lower-rank table: speed from serving_lora_rank
    (against the faster zero-shot run), d_NTP from rank_smollm2-135m, to the digits shown."""
    root = PKG.parent
    res = root / "benchmarks" / "results"
    off = json.loads((res / "serving_lora_rank" / "results.json").read_text())["offline"]
    summ = json.loads((res / "rank_smollm2-135m" / "results.json").read_text())["summary"]
    zs = [off["zero-shot"], off["zero-shot (again)"]]
    zc = max(z["requests_per_s"] for z in zs)
    zg = max(z["output_tokens_per_s"] for z in zs)
    table = next(t for t in _tables((root / "docs" / "benchmarks.md").read_text())
                 if t[0].startswith("| LoRA rank | LoRA B per row"))
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        if c[0].startswith("zero-shot"):
            mode, ours, plain = None, summ["zero-shot"], summ["zero-shot"]
        else:
            rank = c[0].split()[0]
            full = "full" in c[0]
            mode = "ltv-lora" if full else f"ltv-lora-r{rank}"
            ours = summ["LTV r=full" if full else f"LTV r={rank}"]
            plain = summ["LTV r=full" if full else f"plain SVD r={rank}"]
        r = off[mode] if mode else {"requests_per_s": zc, "output_tokens_per_s": zg}
        assert _shown(c[2].rstrip("×"), r["requests_per_s"] / zc), (c[0], c[2])
        assert _shown(c[3].rstrip("×"), r["output_tokens_per_s"] / zg), (c[0], c[3])
        assert _shown(c[4], ours["avg"]["d_ntp"]), (c[0], c[4])
        assert _shown(c[5], plain["avg"]["d_ntp"]), (c[0], c[5])


def test_the_paired_kernel_table_is_its_results():
    """docs/methods.md's "against λ = 5" table, recomputed from the kernel results' records:
    how many (task, run) episodes have a lower d_NTP than linear λ = 5, the median d_NTP
    ratio, and the mean accuracy difference in points."""
    import statistics

    root = PKG.parent
    table = next(t for t in _tables((root / "docs" / "methods.md").read_text())
                 if t[0].startswith("| against λ = 5 |"))
    rows = {"λ by LOO": "ltv-auto", "kernel": "kernel", "MLP": "mlp"}
    names = ("kernel_smollm2-135m", "kernel_qwen2.5-coder-1.5b")
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        m = rows[c[0]]
        for cell, name in zip(c[1:3], names, strict=True):
            recs = json.loads((root / "benchmarks" / "results" / name / "results.json")
                              .read_text())["records"]
            by = {(r["task"], r["run"], r["method"]): r for r in recs}
            eps = sorted({(r["task"], r["run"]) for r in recs})
            lower = sum(by[(*e, m)]["d_ntp"] < by[(*e, "ltv")]["d_ntp"] for e in eps)
            ratio = statistics.median(by[(*e, m)]["d_ntp"] / by[(*e, "ltv")]["d_ntp"]
                                      for e in eps)
            dacc = 100 * statistics.fmean(by[(*e, m)]["accuracy"] - by[(*e, "ltv")]["accuracy"]
                                          for e in eps)
            count, shown_ratio, shown_dacc = (x.strip().replace("*", "")
                                              for x in cell.split(" / "))
            assert count == f"{lower} of {len(eps)}", (c[0], name, count)
            assert _shown(shown_ratio, ratio), (c[0], name, shown_ratio, ratio)
            assert _shown(shown_dacc.replace("−", "-").removesuffix(" pts"), dacc), (
                c[0], name, shown_dacc, dacc)


def test_the_regression_tables_are_their_results():
    """docs/regression.md's two result tables: MSE on the model's own answers (and over all
    answers), the answer counts (parsed / echoes of x / of a demo's y [/ exactly 0]), the KL
    at the first token, and the demo-only references, from each result's summary."""
    import re

    root = PKG.parent
    text = (root / "docs" / "regression.md").read_text()
    rows = {"zero-shot": "zero-shot", "ICL (k = 30)": "icl", "LTV, every step (served)": "ltv",
            "LTV, first step only": "ltv-first", "mean shift": "mean"}
    refs = {"predict 0 (prior mean)": "zero", "predict the demos' mean y": "demo_mean",
            "least squares on the 30 demos": "least_squares"}
    tables = [t for t in _tables(text) if t[0].startswith("| | linear MSE, own answers")]
    assert len(tables) == 2
    for table in tables:
        name = re.findall(r"--out benchmarks/results/([\w.\-]+)",
                          text[: text.index(table[0])])[-1]
        doc = json.loads((root / "benchmarks" / "results" / name / "results.json").read_text())
        summ, ref = doc["summary"], doc["references"]
        zeros = "exactly 0" in table[0]
        for row in table[2:]:
            c = [x.strip().replace("*", "") for x in row.strip("|").split("|")]
            if c[0] in refs:
                for cell, task in ((c[1], "linear"), (c[3], "relu")):
                    assert _shown(cell, ref[task][refs[c[0]]][0]), (name, c[0], cell)
                continue
            m = rows[c[0]]
            for mse, counts, task in ((c[1], c[2], "linear"), (c[3], c[4], "relu")):
                s = summ[task][m]
                want = [s["parsed_total"], s["echoes_x_total"], s["echoes_demo_total"]]
                want += [s["zeros_total"]] if zeros else []
                assert [int(x) for x in counts.split(" / ")] == want, (name, c[0], task)
                if m != "ltv":  # every-step LTV's cell describes its few parsed answers
                    own, overall = re.fullmatch(r"([\d.]+) \(([\d.]+)\)", mse).groups()
                    assert _shown(own, s["mse_own"]) and _shown(overall, s["mse"]), (
                        name, c[0], task, mse)
            kl = c[5].split(" / ")
            if m == "icl":
                assert kl == ["0"]
            else:
                assert all(_shown(x, summ[t][m]["kl_first"])
                           for x, t in zip(kl, ("linear", "relu"), strict=True)), (name, c[0])


def test_the_step_policy_table_is_its_result():
    """docs/regression.md's every-step vs first-step table (clean answers, labels repeated,
    first line as ICL's) equals benchmarks/results/step_policy_smollm2-135m."""
    root = PKG.parent
    tasks = json.loads((root / "benchmarks" / "results" / "step_policy_smollm2-135m" /
                        "results.json").read_text())["tasks"]
    table = next(t for t in _tables((root / "docs" / "regression.md").read_text())
                 if t[0].startswith("| task | policy | answer line is exactly a label"))
    policies = {"ICL": "icl", "LTV every step": "ltv every step",
                "LTV first step": "ltv first step"}
    for row in table[2:]:
        c = [x.strip() for x in row.strip("|").split("|")]
        r = tasks[c[0]][policies[c[1]]]
        cells = [c[2].split(" (")[0], c[3], c[4]]
        for cell, key in zip(cells, ("clean_answer", "label_repeated", "first_line_as_icl"),
                             strict=True):
            if cell == "—":
                continue
            assert _shown(cell.removesuffix(" %"), 100 * r[key]), (c[0], c[1], key, cell)


def test_the_icl_cost_table_is_its_result():
    """docs/benchmarks.md's ICL-cost table (prompt tokens, ICL req/s with and without the
    prefix cache, LTV fused's speed-up over each) equals benchmarks/results/icl_cost."""
    root = PKG.parent
    icl = json.loads((root / "benchmarks" / "results" / "icl_cost" / "results.json")
                     .read_text())["icl_cost"]
    fused = icl["ltv-fused"]["requests_per_s"]
    table = next(t for t in _tables((root / "docs" / "benchmarks.md").read_text())
                 if t[0].startswith("| k | prompt tokens/req | ICL + prefix cache"))
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        cache, none = icl["icl-prefix-cache"][f"k={c[0]}"], icl["icl-no-cache"][f"k={c[0]}"]
        assert _shown(c[1], cache["prompt_tokens_mean"]), c
        assert _shown(c[2], cache["requests_per_s"]) and _shown(c[3], none["requests_per_s"]), c
        assert _shown(c[4].rstrip("×"), fused / cache["requests_per_s"]), c
        assert _shown(c[5].rstrip("×"), fused / none["requests_per_s"]), c


def test_the_dtype_and_startup_tables_are_their_results():
    """docs/benchmarks.md's serving-dtype table (float32 vs bfloat16 on an AVX2 CPU, and
    their ratio) and serve start-up table equal their results."""
    import re

    root = PKG.parent
    res = root / "benchmarks" / "results"
    text = (root / "docs" / "benchmarks.md").read_text()
    off = {dt: json.loads((res / "serving_dtype" / dt / "results.json").read_text())["offline"]
           for dt in ("float32", "bfloat16")}
    keys = [("zero-shot", "requests_per_s"), ("ltv-fused", "requests_per_s"),
            ("zero-shot", "output_tokens_per_s"), ("ltv-fused", "output_tokens_per_s")]
    table = next(t for t in _tables(text) if t[0].startswith("| engine dtype |"))
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        for cell, (mode, key) in zip(c[1:], keys, strict=True):
            f32, bf16 = off["float32"][mode][key], off["bfloat16"][mode][key]
            label = c[0].replace("*", "")
            want = f32 / bf16 if "÷" in label else f32 if label.startswith("float32") else bf16
            assert _shown(cell.rstrip("×"), want), (c[0], mode, key, cell)
    rows = json.loads((res / "startup" / "results.json").read_text())["rows"]
    secs = {(r["config"], r["start"]): r["seconds"] for r in rows}
    table = next(t for t in _tables(text) if t[0].startswith("| mode | eager"))
    configs = {"fused": "fused", "folded (`--fold`)": "folded",
               "multi-task (2 LoRA adapters)": "multi"}
    for row in table[2:]:
        c = [_cell(x) for x in row.strip("|").split("|")]
        cfg = configs[c[0]]
        assert _shown(c[1], secs[(cfg, 1)]), c
        for n, shown in enumerate(re.findall(r"[\d.]+", c[2]), start=1):
            assert _shown(shown, secs[(cfg + "-compiled", n)]), c


def test_the_compile_serving_table_is_its_results():
    """docs/serving.md's compile-on-a-busy-server table, and the prose range beside it, equal
    the three committed compile_serving runs (busy with 1 worker thread, busy with 2, idle):
    every time, ratio to the run's own offline extract, throughput ratio and latency."""
    root = PKG.parent
    res = {name: json.loads((root / "benchmarks" / "results" / f"compile_serving_{name}" /
                             "results.json").read_text())
           for name in ("smollm2-135m", "smollm2-135m_idle", "smollm2-135m_threads2")}
    busy, idle, two = (res[k] for k in ("smollm2-135m", "smollm2-135m_idle",
                                        "smollm2-135m_threads2"))
    text = (root / "docs" / "serving.md").read_text()
    table = next(t for t in _tables(text) if t[0].startswith("| | sst2 | trec |"))
    rows = {_cell(r.strip("|").split("|")[0]): [_cell(x) for x in r.strip("|").split("|")[1:]]
            for r in table[2:]}
    assert len(rows) == 7

    def window(run, name):
        return next(w for w in run["windows"] if w["window"] == name)

    def first_answer(run, t):
        return run["compiles"][t]["post_to_first_answer_seconds"]

    def offline(run, t):
        return run["offline"][t]["extract_seconds"]

    def row(prefix):
        return next(v for k, v in rows.items() if k.startswith(prefix))

    undisturbed = window(busy, "undisturbed")
    assert f"(undisturbed {undisturbed['p50_ms']:.0f} / {undisturbed['p99_ms']:.0f} ms)" in \
        next(k for k in rows if k.startswith("traffic p50"))
    assert f"({undisturbed['throughput']:.2f} req/s)" in \
        next(k for k in rows if k.startswith("traffic during that compile"))
    assert f"(vs {window(two, 'undisturbed')['throughput']:.2f} req/s)" in \
        next(k for k in rows if k.startswith("traffic during it, 2 threads"))
    for i, t in enumerate(("sst2", "trec")):
        assert row("offline `ltv-vllm extract`")[i] == f"{offline(busy, t):.1f} s"
        a, o = first_answer(idle, t), offline(idle, t)
        assert row("POST → first answer of the new task, idle")[i] == \
            f"{a:.1f} s ({a / o:.1f}×; offline {o:.1f} s)"
        for prefix, run in (("POST → first answer, busy server, worker 1", busy),
                            ("POST → first answer, busy server, worker 2", two)):
            a = first_answer(run, t)
            assert row(prefix)[i] == f"{a:.1f} s ({a / offline(run, t):.1f}×)", (prefix, t)
        during = window(busy, f"during {t}")
        assert row("traffic during that compile")[i] == \
            f"{during['throughput'] / undisturbed['throughput']:.2f}×"
        assert row("traffic p50")[i] == f"{during['p50_ms']:.0f} / {during['p99_ms']:.0f} ms"
        ratio = window(two, f"during {t}")["throughput"] / window(two, "undisturbed")["throughput"]
        assert row("traffic during it, 2 threads")[i] == f"{ratio:.2f}×"
    # "traffic is back to its undisturbed rate once the task is served (0.98–1.08×)"
    after = [window(r, f"after {t}")["throughput"] / window(r, "undisturbed")["throughput"]
             for r in (busy, two) for t in ("sst2", "trec")]
    assert f"({min(after):.2f}–{max(after):.2f}×)" in " ".join(text.split())


def test_no_tracker_numbers_or_machine_paths_reach_users():
    """What users read names no tracker issue they cannot open, and no path of the machine
    a result came from: committed results record paths relative to the repository (or
    `<tmp>/`, `~/.cache/`)."""
    root = PKG.parent
    prose = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]
    for p in prose:
        hit = re.search(r"\bissues? #?\d+", p.read_text(), re.IGNORECASE)
        assert hit is None, (p.name, hit.group(0))
    machine = re.compile(r"(?<![\w.<>~-])/(tmp|root|work|home)/")
    results = [p for p in sorted((root / "benchmarks" / "results").rglob("*")) if p.is_file()]
    # what a local run keeps beside its results and git never commits (states, engine logs)
    ignored = set(subprocess.run(
        ["git", "check-ignore", "--stdin"], cwd=root, capture_output=True, text=True,
        input="\n".join(str(p.relative_to(root)) for p in results)).stdout.split("\n"))
    for p in [*prose, *results]:
        if p.suffix in (".png", ".safetensors", ".pt") or str(p.relative_to(root)) in ignored:
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        hit = machine.search(text)
        assert hit is None, (str(p.relative_to(root)),
                             text[max(0, hit.start() - 40):hit.end() + 40])


# -- the serving wing, by the process each part runs in ------------------------------------------
SERVING = PKG / "serving"
# folder (or top-level module) → the serving folders it may import besides its own
BY_PROCESS = {
    "contract": set(),                                  # pure: every process
    "store": {"contract"},                              # files, in whichever process
    "engine": {"contract", "store"},                    # vLLM's engine core and workers
    "api_server": {"contract", "store"},                # vLLM's API-server process
    "launcher": {"contract", "store"},                  # `ltv-vllm serve`
    "offline": {"contract", "store", "launcher", "client"},  # `vllm.LLM` jobs
    "vllm_ext": {"contract", "store", "engine", "api_server"},  # what vLLM loads by name
    "client": {"contract", "store"},                    # the user's process (HTTP)
}
PROCESS_WORDS = re.compile(r"process|\bpure\b", re.I)
MAX_LINES, MAX_FUNCTION = 600, 70


def serving_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "serving" else None


def by_process_violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    found = []
    for m, targets in graph(sources).items():
        a = serving_part(m)
        if a is None:
            continue
        if a not in BY_PROCESS:
            found.append(f"{m}: in no serving folder")
            continue
        for t in targets:
            b = serving_part(t)
            if b is not None and b != a and b not in BY_PROCESS[a]:
                found.append(f"{m} ({a}) imports {t} ({b})")
    return found


def test_the_serving_wing_imports_by_process():
    """API-server code never imports engine code and the engine never API-server code; the
    wire contract imports no other folder; only `vllm_ext` (what vLLM loads by name)
    reaches both."""
    assert by_process_violations(package_sources()) == []


def test_the_serving_layout_check_can_fail():
    sources = {"ltv_vllm.serving.api_server.gate": ("from ltv_vllm.serving.engine import steps",
                                                     False),
               "ltv_vllm.serving.engine.steps": ("", False),
               "ltv_vllm.serving.contract.wire": ("import ltv_vllm.serving.store.taskstore",
                                                   False),
               "ltv_vllm.serving.store.taskstore": ("", False)}
    assert by_process_violations(sources) == [
        "ltv_vllm.serving.api_server.gate (api_server) imports ltv_vllm.serving.engine.steps "
        "(engine)",
        "ltv_vllm.serving.contract.wire (contract) imports ltv_vllm.serving.store.taskstore "
        "(store)"]


def test_contract_and_store_import_no_vllm_at_load():
    """The pure folders: no vLLM import at module level (a function that builds vLLM's
    request objects imports it when called)."""
    for path in [*(SERVING / "contract").glob("*.py"), *(SERVING / "store").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "vllm" or n.startswith("vllm.") for n in names), \
                f"{path.relative_to(PKG)}: imports {names} at load"


def test_every_serving_module_names_its_process_and_stays_small():
    for path in sorted(SERVING.rglob("*.py")):
        name = path.relative_to(PKG)
        text = path.read_text()
        tree = ast.parse(text)
        doc = ast.get_docstring(tree) or ""
        if path.name != "__init__.py" or doc:
            assert PROCESS_WORDS.search(doc), f"{name}: its docstring names no process"
        assert text.count("\n") <= MAX_LINES, f"{name}: {text.count(chr(10))} lines"
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= MAX_FUNCTION, f"{name}: {node.name} has {size} lines"


def _margin(c: dict) -> str:
    """A comparison as the docs write it: `+1.2 points (95 % interval −0.8 to +3.1)`."""
    def pts(x: float) -> str:
        return f"{100 * x:+.1f}".replace("-", "−")

    a = c["average"]
    return f"{pts(a['diff'])} points (95 % interval {pts(a['lo'])} to {pts(a['hi'])})"


def test_the_value_headlines_are_the_held_out_results():
    """README, docs/index.md and docs/benchmarks.md state the default's margin over the prompt
    it replaces, the probe and the LoRA adapter as `bench value` measured them (results.json
    of value_smollm2-135m): every figure, with its interval."""
    root = PKG.parent
    doc = json.loads((root / "benchmarks" / "results" / "value_smollm2-135m" / "results.json")
                     .read_text())
    comps = {(c["row"], c["reference"]): c for c in doc["summary"]["labels"]["comparisons"]}
    default = "default (one k-shot, gold 0.8, λ=5)"
    want = [_margin(comps[(default, ref)]) for ref in
            ("prompt, one k-shot", "probe (L2 on dev)", "LoRA r8 (lr, epochs on dev)")]
    # and on Qwen2.5-Coder-1.5B (no LoRA rival there): the prompt it replaces and the probe
    doc = json.loads((root / "benchmarks" / "results" / "value_qwen2.5-coder-1.5b" /
                      "results.json").read_text())
    comps = {(c["row"], c["reference"]): c for c in doc["summary"]["labels"]["comparisons"]}
    want += [_margin(comps[(default, ref)]) for ref in ("prompt, one k-shot",
                                                        "probe (L2 on dev)")]
    for page in ("README.md", "docs/index.md", "docs/benchmarks.md"):
        text = " ".join((root / page).read_text().split())
        for w in want:
            assert w in text, f"{page} does not state {w}"
