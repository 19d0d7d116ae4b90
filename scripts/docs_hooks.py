"""mkdocs hook: serve every committed benchmark result (benchmarks/results/**) under
results/ in the site, as it is in the repository, so the docs link each results.md (and its
plots) instead of copying their tables; and the root CHANGELOG.md as changelog.md. Nothing
is written into docs/.

The pages link by repository paths (`../benchmarks/results/NAME/results.md`,
`../CHANGELOG.md` from docs/; `docs/PAGE.md` and `benchmarks/results/…` from the changelog),
which work where the files are read on a repository host; `on_page_markdown` maps them to
the site's copies, so the same link works in both (tests/test_docs.py checks every link
against the tree, `mkdocs build --strict` against the site)."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CHANGELOG = "changelog.md"


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".md", ".png", ".json"):
            uri = "results/" + path.relative_to(RESULTS).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    # the changelog lives at the repository's root, where people look for it
    files.append(File.generated(config, CHANGELOG, abs_src_path=str(ROOT / "CHANGELOG.md")))
    return files


def site_links(markdown: str, page_uri: str) -> str:
    """A page's repository links as the site's: docs/ pages and the changelog sit side by
    side at the site's root, the results under results/."""
    if page_uri == CHANGELOG:  # written from the repository's root
        markdown = re.sub(r"\]\(docs/", "](", markdown)
        return re.sub(r"\]\(benchmarks/results/", "](results/", markdown)
    if page_uri.startswith("results/"):
        return markdown
    markdown = re.sub(r"\]\(\.\./benchmarks/results/", "](results/", markdown)
    return re.sub(r"\]\(\.\./CHANGELOG\.md", f"]({CHANGELOG}", markdown)


def on_page_markdown(markdown, page, config, files):
    return site_links(markdown, page.file.src_uri)
