"""The prompt format a command renders a task in, as one option object (`--format`,
`--chat-demos`, `--chat-template`); light to import (the CLI builds it from flags). Runs in
the user's process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ltv_vllm.errors import ArgumentError


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """The prompts a task is rendered as (`tasks.chat`): the completion format, or the
    model's own chat template (`demos`: prior turns or inline; `template`: another template,
    a file or its Jinja text, as vLLM's --chat-template takes it)."""

    name: str = "completion"
    demos: str = "turns"
    template: str | None = None

    def check(self, methods: list[str], *, regression: bool = False, transfer: bool = False,
              engine: str = "transformers") -> None:
        """What a chat rendering cannot run, in one line, before any model loads."""
        if self.name != "chat":
            if self.template is not None:
                raise ArgumentError("--chat-template renders --format chat; add --format chat")
            return
        from ltv_vllm.pipeline.extract import check_chat_methods

        check_chat_methods(methods)
        if regression or transfer or engine != "transformers":
            raise ArgumentError("--format chat renders classification tasks captured by "
                                "transformers (no regression task, --source-model or "
                                "--engine vllm)")

    def render(self, task: Any, tokenizer: Any) -> Any:
        """`task` as this format renders it for `tokenizer`'s model (its template checked)."""
        if self.name != "chat":
            return task
        from ltv_vllm.tasks.chat import chat_task, read_template

        template = read_template(self.template) if self.template is not None else None
        return chat_task(task, tokenizer, self.demos, template)
