"""Fresh process: ltv_vllm.serving.offline.llm.make_llm + classify_offline; prints probabilities
as JSON.

argv: model_dir vector_path texts_json [dtype (default float32)]
"""

from __future__ import annotations

import json
import sys


def classify(model_dir: str, vector: str, texts: list[str], dtype: str = "float32") -> list:
    """One engine: sst2 label and restricted probabilities of every text."""
    from offline_fused import shutdown

    from ltv_vllm.serving.offline.llm import classify_offline, make_llm
    from ltv_vllm.tasks.specs import BUILTIN_TASKS

    llm = make_llm(model_dir, vector if vector != "-" else None, dtype=dtype,
                   max_model_len=256)
    res = classify_offline(llm, BUILTIN_TASKS["sst2"], texts)
    shutdown(llm)
    return [{"label": r.label, "probs": r.probs} for r in res]


def main() -> None:
    model_dir, vector, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
    print("RESULT " + json.dumps(classify(model_dir, vector, texts, dtype)))


if __name__ == "__main__":
    main()
