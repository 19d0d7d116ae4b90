"""Fresh process: several vLLM engines one after another, each torn down before the next.

argv: jobs.json — a list of {"key", "kind": "generate" | "classify", and that function's
arguments}; prints one RESULT line, {key: result}. Importing vLLM once for many engines is
most of what a separate process per engine costs on a CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from offline_classify import classify
    from offline_fused import generate

    jobs = json.loads(Path(sys.argv[1]).read_text())
    run = {"generate": generate, "classify": classify}
    out = {}
    for job in jobs:
        key, kind = job.pop("key"), job.pop("kind")
        out[key] = run[kind](**job)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
