"""The user's own vLLM flags beside ltv-vllm's: kept, merged where both can hold, refused in
one line where they conflict, never silently replaced.

vLLM's parser keeps the last value of a flag given twice, so `ltv-vllm serve` puts its own
flags after the user's (`serve.plan_server`) with the user's values merged into them:

    --served-model-name   the user's names serve the bare model (else the MODEL argument);
                          tasks keep their own names; a task named like one of them: refused
    --hf-overrides        merged; a key both set to different values: refused
    --logits-processors   the user's, then ltv-vllm's
    --lora-modules        the user's adapters served beside the tasks (LoRA multi-task mode:
    --lora-target-modules one slot table for both, target modules united, the largest rank,
    --max-lora-rank       slots for all); a task named like an adapter: refused; beside a
    --max-loras           fused vector, which shifts every request: refused
    --host --port --dtype --max-model-len
                          the user's value is used; beside a different value of serve's own
                          option: refused
    --model               the model is serve's MODEL argument: another one refused
    --logprobs-mode       ltv-vllm's classification reads processed logprobs: another
                          mode refused
    --middleware          vLLM appends every one given: the user's and the gate both run

What vLLM's parser reads is what is merged (`vllm_flags`: `--config FILE`, `--flag=value` and
every other spelling it accepts); arguments its parser refuses are left to the server, which
refuses them in its own words. `VllmArgs` is that one parse: the launcher reads every vLLM
flag it needs through it.

Runs in the launcher (`ltv-vllm serve`) and in offline jobs (`offline.llm`: the user's
engine arguments merged the same way).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ltv_vllm.errors import ArgumentError


@dataclass(frozen=True)
class Adapter:
    """A user's LoRA adapter (`--lora-modules`), as vLLM parsed it."""

    name: str
    path: str
    base_model_name: str | None = None

    def flag(self) -> str:
        """The adapter as one `--lora-modules` value (JSON: keeps its base model name)."""
        return json.dumps({"name": self.name, "path": self.path,
                           **({"base_model_name": self.base_model_name}
                              if self.base_model_name else {})})

    def config(self) -> dict[str, Any]:
        """Its PEFT `adapter_config.json` (empty when unreadable: vLLM refuses it at load)."""
        try:
            return json.loads((Path(self.path) / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return {}


@dataclass(frozen=True)
class UserFlags:
    """The flags of the user's (`ltv-vllm serve ... -- FLAGS`) that ltv-vllm also sets;
    None (or empty) where the user gave none."""

    served_names: tuple[str, ...] = ()
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)
    logits_processors: tuple[str, ...] = ()
    adapters: tuple[Adapter, ...] = ()
    enable_lora: bool = False
    lora_target_modules: tuple[str, ...] | None = None
    max_lora_rank: int | None = None
    max_loras: int | None = None
    model: str | None = None
    host: str | None = None
    port: int | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    logprobs_mode: str | None = None

    @property
    def lora(self) -> bool:
        """The user serves LoRA adapters (listed, or loaded at runtime)."""
        return self.enable_lora or bool(self.adapters)

    def adapter_rank(self) -> int:
        """The LoRA rank the user's adapters need (their `r`, and their --max-lora-rank)."""
        ranks = [int(a.config().get("r") or 0) for a in self.adapters]
        return max([*ranks, self.max_lora_rank or 0])

    def adapter_modules(self) -> tuple[str, ...] | None:
        """The modules their adapters target (None: every module vLLM can wrap, as vLLM does
        when --lora-target-modules is not given)."""
        if self.lora_target_modules is not None:
            return self.lora_target_modules
        if self.enable_lora and not self.adapters:
            return None  # runtime loading: any adapter may come
        targets: set[str] = set()
        for a in self.adapters:
            got = a.config().get("target_modules")
            if not isinstance(got, list):
                return None  # a regex or "all-linear": vLLM's own matching decides
            targets.update(str(t) for t in got)
        return tuple(sorted(targets))


def read_user_flags(parsed: Any, defaults: Any) -> UserFlags:
    """The flags the user gave, from vLLM's parsed arguments (`parsed`; None when vLLM's
    parser refused them) beside its defaults (`defaults`: the parse of no arguments): a
    value equal to vLLM's default counts as not given."""
    if parsed is None:
        return UserFlags()

    def given(name: str) -> Any:
        value = getattr(parsed, name, None)
        return None if value == getattr(defaults, name, None) else value

    return UserFlags(
        served_names=tuple(given("served_model_name") or ()),
        hf_overrides=dict(given("hf_overrides") or {}),
        logits_processors=tuple(str(p) for p in given("logits_processors") or ()),
        adapters=tuple(Adapter(m.name, str(m.path), m.base_model_name)
                       for m in given("lora_modules") or ()),
        enable_lora=bool(given("enable_lora")),
        lora_target_modules=(tuple(t) if (t := given("lora_target_modules")) else None),
        max_lora_rank=given("max_lora_rank"), max_loras=given("max_loras"),
        model=given("model"),
        host=given("host"), port=given("port"), dtype=given("dtype"),
        max_model_len=given("max_model_len"), logprobs_mode=given("logprobs_mode"))


def chosen(flag: str, ours: Any, default: Any, theirs: Any) -> Any:
    """One setting both `ltv-vllm serve` (`ours`, at `default` when not given) and the user's
    vLLM flags (`theirs`, None when not given) can set: the one given, refused when both were
    given and differ."""
    if theirs is None:
        return ours
    if ours != default and str(ours) != str(theirs):
        raise ArgumentError(f"{flag} given twice, {ours} to ltv-vllm serve and {theirs} in "
                            "vLLM's arguments: give it once")
    return theirs


def merged_overrides(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """The user's --hf-overrides with ltv-vllm's (the wrapper architecture, the tasks):
    a key both set to different values refused."""
    for key, value in theirs.items():
        if key in ours and ours[key] != value:
            raise ArgumentError(
                f"--hf-overrides sets {key!r}, which ltv-vllm serve sets itself "
                f"(to {json.dumps(ours[key])[:80]}): drop it from --hf-overrides")
    return {**theirs, **ours}


def check_names(tasks: Sequence[str], user: UserFlags) -> None:
    """A task may not take a name the user serves (the bare model's or an adapter's)."""
    taken = {*user.served_names, *(a.name for a in user.adapters)}
    for name in tasks:
        if name in taken:
            what = "an adapter's" if name in {a.name for a in user.adapters} else \
                "a --served-model-name"
            raise ArgumentError(f"task {name!r} has {what} name; rename the task or the other")


def check_fused_lora(user: UserFlags) -> None:
    """LoRA adapters beside a fused vector: refused. It shifts every request, and an
    adapter's requests would be shifted by a vector fitted on the base model."""
    if user.lora:
        raise ArgumentError("a fused vector shifts every request, an adapter's too: serve the "
                            "vector as a named task (--task-vector NAME=PATH) beside LoRA "
                            "adapters")


# -- the user's vLLM arguments, parsed once ---------------------------------------------------
# vLLM options that choose how the model is compiled; given any, serve adds no default.
COMPILATION_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--optimization-level",
                     "--compilation-config", "-cc")


def vllm_flags(vllm_args: tuple[str, ...] | list[str]) -> Any:
    """vLLM's own arguments as vLLM's server parses them (its parser: `--chat_template`,
    `--flag=value`, `--config FILE.yaml` and every other spelling it accepts), so what
    ltv-vllm reads of them is what vLLM will use; None when there are none or vLLM's parser
    refuses them (the server then refuses them itself, in its own words)."""
    if not vllm_args:
        return None
    return _vllm_flags(tuple(vllm_args))


@functools.lru_cache(maxsize=8)
def _vllm_flags(vllm_args: tuple[str, ...]) -> Any:
    import contextlib
    import io

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return make_arg_parser(FlexibleArgumentParser()).parse_args(list(vllm_args))
    except (SystemExit, Exception):  # noqa: BLE001 - vLLM refuses them at its start
        return None


@dataclass(frozen=True)
class VllmArgs:
    """The user's vLLM arguments (`ltv-vllm serve ... -- ARGS`), read once by vLLM's own
    parser (`vllm_flags`); every flag the launcher reads of them is read here."""

    argv: tuple[str, ...] = ()

    @functools.cached_property
    def parsed(self) -> Any:
        return vllm_flags(self.argv)

    def gave(self, flag: str) -> bool:
        """`flag` among the arguments, as `--flag value` or `--flag=value`."""
        return any(a == flag or a.startswith(flag + "=")
                   or (flag == "-O" and a.startswith("-O")) for a in self.argv)

    def value(self, *flags: str) -> str | None:
        """A flag's value as vLLM reads it (None: absent); the first flag's long name is its
        attribute in vLLM's parsed arguments. Read as given (`--flag value`, `--flag=value`)
        only where vLLM's parser does not take the arguments."""
        if self.parsed is not None:
            value = getattr(self.parsed, flags[0].lstrip("-").replace("-", "_"), None)
            return None if value is None else str(value)
        argv = self.argv
        for i, a in enumerate(argv):
            for flag in flags:
                value = (argv[i + 1] if a == flag and i + 1 < len(argv)
                         else a.split("=", 1)[1] if a.startswith(flag + "=") else None)
                if value is not None:
                    return value
        return None

    def integer(self, *flags: str, default: int = 1) -> int:
        """An integer flag as given (`default` when absent or unreadable)."""
        value = self.value(*flags)
        try:
            return int(value) if value is not None else default
        except ValueError:
            return default

    @property
    def api_servers(self) -> int:
        return self.integer("--api-server-count", "-asc")

    @property
    def pipeline_parallel(self) -> int:
        return self.integer("--pipeline-parallel-size", "-pp")

    @property
    def chose_compilation(self) -> bool:
        return any(self.gave(f) for f in COMPILATION_FLAGS)

    @property
    def sized_kv_cache(self) -> bool:
        return self.gave("--kv-cache-memory-bytes")

    @functools.cached_property
    def user(self) -> UserFlags:
        """The user's flags that ltv-vllm sets too, as vLLM parses them; `--model` (the model
        is serve's own option) and a `--logprobs-mode` other than the processed logprobs
        classification reads are refused in one line."""
        user = read_user_flags(self.parsed, _vllm_flags(()))
        if self.gave("--logprobs-mode") and self.parsed is not None:  # vLLM's default, given
            user = replace(user, logprobs_mode=self.parsed.logprobs_mode)
        if user.model is not None:
            raise ArgumentError(f"--model {user.model} in vLLM's arguments: the model is "
                                "ltv-vllm serve's own --model (its task vectors are checked "
                                "against it)")
        if user.logprobs_mode not in (None, "processed_logprobs"):
            raise ArgumentError(f"--logprobs-mode {user.logprobs_mode}: ltv-vllm serves "
                                "processed_logprobs (a label-restricted request's "
                                "distribution, which `ltv-vllm classify` reads); drop the flag")
        return user

    def check_speculative(self) -> None:
        """`--speculative-config` on a runner that cannot serve it beside the shift: one line
        (`vllm_support.speculative_problem`)."""
        spec = getattr(self.parsed, "speculative_config", None) if self.parsed else None
        if not spec:
            return
        from vllm.triton_utils import HAS_TRITON

        from ltv_vllm.serving.contract.vllm_support import speculative_problem

        if (problem := speculative_problem(spec, HAS_TRITON)) is not None:
            raise ArgumentError(problem)
