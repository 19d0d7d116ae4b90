"""The maths and the artifact format, free of models and engines: ridge regression and its
closed-form leave-one-out (`ridge`), the RBF kernel map (`kernel`), accuracy, d_NTP and the
regression scores (`metrics`), the task-vector file (`vector`: `TaskVector`, safetensors with a
checked header) and atomic file writes (`fileio`). Pure tensor functions; I/O only in `vector`
and `fileio`. Imports nothing above `ltv_vllm.tasks`."""
