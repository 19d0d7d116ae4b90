"""The pages agree with each other, with the code and with the committed results:

- no words in a user page that tell how the project was made (`HISTORY`: a list kept here;
  a phrase a page needs for another sense is not in it);
- every link of README, CHANGELOG and docs/ valid where the files are read on a repository
  host: a relative path that exists in the tree (the site build maps the repository paths
  to its copies, `scripts/docs_hooks.py`, and `mkdocs build --strict` checks the site);
- one version everywhere: `__version__`, CITATION.cff, the changelog's newest release and
  `ltv-vllm --version`; the changelog in Keep a Changelog form;
- the figures README and docs/index.md state that a committed result holds, read from it
  (beside test_layout's quick-start block and held-out margins).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ltv_vllm

ROOT = Path(ltv_vllm.__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"

# phrases that tell the project's own history or its developers' machine, not the user's
HISTORY = [
    r"\bthis machine\b", r"\bthis machine's\b", r"\bas run here\b", r"\bmeasured here\b",
    r"\btimed here\b", r"\bwas available\b", r"\bavailable to this project\b",
    r"\bthis project\b", r"\b(before|after) this change\b", r"\bthis session\b",
    r"\bearlier session\b", r"\b(first|second|third) part\b", r"\bthe goal\b",
    r"\bgoal of\b", r"\bagainst the goal\b", r"\bnot met\b", r"\buntil now\b",
    r"\bthe run before\b", r"\bmeasured before\b", r"\bno GPU was\b",
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def history_hits(text: str) -> list[str]:
    return [m.group(0) for pat in HISTORY for m in re.finditer(pat, text, re.IGNORECASE)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_page_tells_how_the_project_was_made(page):
    assert history_hits(page.read_text()) == [], page.name


def test_the_history_check_fails_on_a_planted_phrase():
    text = (ROOT / "docs" / "serving.md").read_text()
    assert history_hits(text) == []
    assert history_hits(text + "\nMeasured here before this change.\n") == [
        "Measured here", "before this change"]


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Links of `page` whose target is not in the tree (anchors and web links aside)."""
    text = page.read_text() if text is None else text
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code is not a link
    bad = []
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        if not (page.parent / target).exists():
            bad.append(target)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_is_a_path_in_the_tree(page):
    assert broken_links(page) == [], page.name


def test_the_link_check_fails_on_a_site_only_link():
    page = ROOT / "docs" / "results.md"
    assert broken_links(page, "[a](results/quickstart/results.md) [b](changelog.md)") == [
        "results/quickstart/results.md", "changelog.md"]
    assert broken_links(page, "[a](../benchmarks/results/quickstart/results.md)") == []


def test_the_site_maps_repository_links_to_its_copies():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.site_links("[r](../benchmarks/results/x/results.md) [c](../CHANGELOG.md#a)",
                            "serving.md") == "[r](results/x/results.md) [c](changelog.md#a)"
    assert hooks.site_links("[s](docs/serving.md#b) [r](benchmarks/results/x/y.png)",
                            "changelog.md") == "[s](serving.md#b) [r](results/x/y.png)"


def test_one_version_everywhere():
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    v = ltv_vllm.__version__
    assert re.search(rf"^version: {re.escape(v)}$", (ROOT / "CITATION.cff").read_text(), re.M)
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"ltv-vllm, version {v}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert releases[:2] == ["Unreleased", v], releases  # the newest release is this version
    assert len(releases) == len(set(releases))  # one section per release
    # Keep a Changelog's subsections only
    kinds = set(re.findall(r"^### (.+)$", changelog, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds


def _table_rows(md: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under each `## heading…` section of `md`."""
    rows = []
    for section in md.split("\n## ")[1:]:
        if section.startswith(heading):
            table = [ln for ln in section.split("\n") if ln.startswith("|")][2:]
            rows += [[c.strip() for c in ln.strip("|").split("|")] for ln in table]
    return rows


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}×"


def test_the_headline_figures_are_their_results():
    """README's and docs/index.md's serving ratios (classify, × zero-shot) are the range over
    the tasks of value_smollm2-135m's serving tables; README's whole first command is the
    quick-start result's."""
    md = (RESULTS / "value_smollm2-135m" / "results.md").read_text()
    rows = _table_rows(md, "Serving cost")
    assert len(rows) >= 10

    def ratio(way: str) -> str:
        return _span([float(r[4]) for r in rows if r[0].startswith(way)])

    want = {"vector": ratio("default vector"), "lora": ratio("LoRA adapter"),
            "prompt": ratio("prompt, one k-shot")}
    readme = " ".join((ROOT / "README.md").read_text().split())
    index = " ".join((ROOT / "docs" / "index.md").read_text().split())
    assert f"classifies at {want['vector']} zero-shot's throughput, the LoRA adapter at " \
           f"{want['lora'].removesuffix('×')}×" in readme
    assert f"classified at {want['vector']} zero-shot's throughput, the LoRA adapter at " \
           f"{want['lora']} and the 30-shot prompt with the prefix cache at " \
           f"{want['prompt']}" in index
    quick = (RESULTS / "quickstart" / "results.md").read_text()
    took = re.search(r"the first command took (\d+ min \d+ s)", readme).group(1)
    assert f"Whole command {took} (wall)" in quick


def test_the_readme_gpu_figures_are_their_results():
    """README's GPU paragraph: the whole extraction's seconds at the Llama-3.1-8B and
    Qwen2.5-32B shapes are the `auto` batch rows of their results, and the CPU/GPU agreement
    figures are the device checks' own."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    secs = []
    for name in ("extraction_llama-3.1-8b_cuda", "extraction_qwen2.5-32b_cuda"):
        row = next(ln for ln in (RESULTS / name / "results.md").read_text().split("\n")
                   if ln.startswith("| auto |"))
        secs.append(f"{float(row.split('|')[3]):.1f} s")
    assert f"takes {secs[0]} at the Llama-3.1-8B shape, {secs[1]} at Qwen2.5-32B's" in readme
    checks = " ".join((RESULTS / "device_checks_h200" / "README.md").read_text().split())
    agree, scores = re.search(r"shape agrees with the CPU's to ([\d.e-]+), every method's "
                              r"scores to ([\d.e-]+)", readme).groups()
    assert f"to {agree} relative" in checks
    assert float(scores) == float(re.search(r"largest difference ([\d.e-]+)\)",
                                            checks).group(1))
