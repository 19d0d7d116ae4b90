"""A task rendered through a chat model's own template: the prompts a `/v1/chat/completions`
request produces.

The completion format (`specs.Task`) writes the query as ``"{in_prefix}: {text}\\n{label_prefix}:"``
and reads the label at the next token, the first token of ``" " + label``. Through a chat
template the query is the user's turn and the label is the assistant's first generated token:
the first token of the label word itself (the assistant's turn starts after the template's
generation prompt, a fresh line, so no leading space). The demonstrations come in one of two
shapes (`DEMOS`):

* ``turns``: each demonstration a prior user turn (its query) and assistant turn (its label);
* ``inline``: every demonstration inside the one user message, in the completion format,
  before the query.

The pipeline builds prompts as a prefix and a query (the shared demo cache runs the prefix
once; the zero-shot prompt is `zero_shot(text)`). A `ChatTask` cuts those pieces from the
template's renderings of a placeholder conversation, and `check` compares what the pieces give
against the template's own rendering (`apply_chat_template`) of real conversations: a template
that does not render a conversation as the concatenation of its turns is refused in one line.

Prompts are rendered with the generation prompt and tokenized without the tokenizer's special
tokens, as vLLM's chat route does (its `add_special_tokens` defaults to false: a template
writes its own BOS where it wants one); `special_tokens` says so to the capture.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ltv_vllm.tasks.data import Example
from ltv_vllm.tasks.specs import Task, TaskError

DEMOS = ("turns", "inline")
DEFAULT_DEMOS = "turns"
FORMATS = ("completion", "chat")
# private-use characters: no task text or template contains them (checked where they would)
_HOLE = ("\ue000", "\ue001", "\ue002")


def template_digest(template: str) -> str:
    """What a vector records of the template it was fitted on (a server compares its own)."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def read_template(value: str) -> str:
    """A `--chat-template` value as vLLM reads it: the file's text, or the value itself when it
    is a Jinja template; a path to no file is refused in one line."""
    try:
        if Path(value).is_file():
            return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if isinstance(e, UnicodeDecodeError) or len(value) < 256:
            raise TaskError(f"--chat-template {value!r}: cannot read it ({e})") from None
    if any(c in value for c in "{}\n"):
        return value
    raise TaskError(f"--chat-template {value!r}: no such file, and not a Jinja template")


def render(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None) -> str:
    """The template's text for `messages`, with the generation prompt (the assistant's turn
    opened: where the label is read)."""
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)


@dataclass(frozen=True)
class ChatTask(Task):
    """A Task whose prompts are those its model's chat template renders.

    `query(text)` is the user turn's query and everything the template writes after it up to
    the assistant's first token; `zero_shot(text)` puts the conversation's head (the
    template's default system turn, the user turn's opening) before it; `demos_text(demos)`
    is the head and the demonstrations, so an ICL prompt is `demos_text(demos) + query(text)`.
    Build one with `chat_task`."""

    demos: str = DEFAULT_DEMOS
    template: str = ""          # the Jinja text the pieces were cut from
    head: str = ""              # before the (first) user turn's content
    tail: str = ""              # after the last user turn's content: the generation prompt
    between: tuple[str, str] = ("", "")  # turns: user content → label, label → next user
    prompt_format = "chat"
    special_tokens = False

    def query(self, text: str) -> str:
        return super().query(text) + self.tail

    @property
    def zero_shot_prefix(self) -> str:
        # the instruction line opens the first user message
        return self.head + self.lead

    def demos_text(self, demos: Sequence[Any]) -> str:
        if self.demos == "inline":
            return self.head + self.lead + "".join(self._completion_demo(e) for e in demos)
        to_label, to_user = self.between
        return self.head + self.lead + "".join(f"{Task.query(self, e.text)}{to_label}"
                                               f"{self.labels[e.label]}{to_user}"
                                               for e in demos)

    def label_text(self, label: str) -> str:
        return label

    def _completion_demo(self, e: Any) -> str:
        # Task.demo would call this class's query, which ends in the template's tail
        return f"{Task.query(self, e.text)} {self.labels[e.label]}\n"

    def messages(self, demos: Sequence[Any], text: str) -> list[dict[str, str]]:
        """The conversation a chat client would send for `text` after `demos`: the task's
        system turn (if it has one), its instruction line opening the first user message."""
        q = Task.query(self, text)
        if self.demos == "inline":
            turns = [{"role": "user", "content": "".join(self._completion_demo(e)
                                                         for e in demos) + q}]
        else:
            turns = [*(m for e in demos for m in (
                {"role": "user", "content": Task.query(self, e.text)},
                {"role": "assistant", "content": self.labels[e.label]})),
                {"role": "user", "content": q}]
        turns[0] = {**turns[0], "content": self.lead + turns[0]["content"]}
        return [*system_turn(self), *turns]

    def record(self) -> dict[str, str]:
        """`meta.prompt_format` of a vector fitted on this rendering."""
        return {"name": "chat", "demos": self.demos,
                "template_sha256": template_digest(self.template)}

    def check(self, tokenizer: Any, demos: Sequence[Any], text: str) -> None:
        """The pieces against the template's own rendering of a real conversation, zero-shot
        and after `demos`; a mismatch is one TaskError line."""
        for shown, conversation in ((self.zero_shot(text), self.messages((), text)),
                                    (self.demos_text(demos) + self.query(text),
                                     self.messages(demos, text))):
            rendered = render(tokenizer, conversation, self.template)
            if shown != rendered:
                at = next((i for i, (a, b) in enumerate(zip(shown, rendered, strict=False))
                           if a != b), min(len(shown), len(rendered)))
                raise TaskError(f"the chat template does not render a conversation as its "
                                f"turns one after another (at character {at}: "
                                f"{rendered[at:at + 30]!r}); --format chat cannot use it")

    def to_dict(self) -> dict[str, Any]:
        # the task itself: how it was rendered is the vector's `prompt_format`
        return Task.to_dict(plain_task(self))


def system_turn(task: Task) -> list[dict[str, str]]:
    """The task's system message, or none (the chat template writes its default)."""
    return [{"role": "system", "content": task.system}] if task.system else []


def plain_task(task: Task) -> Task:
    """The completion-format task a ChatTask renders."""
    if not isinstance(task, ChatTask):
        return task
    return Task(**{f.name: getattr(task, f.name) for f in fields(Task)})


def chat_task(task: Task, tokenizer: Any, demos: str = DEFAULT_DEMOS,
              template: str | None = None) -> ChatTask:
    """`task` rendered through `template` (the tokenizer's own chat template by default).
    Refused in one line: a tokenizer without a template, an unknown demonstration shape, a
    template that does not render turns one after another."""
    if demos not in DEMOS:
        raise TaskError(f"chat demonstrations must be one of {', '.join(DEMOS)}, got {demos!r}")
    template = template or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise TaskError("the model's tokenizer has no chat template; --format chat needs one "
                        "(or use --format completion)")
    if any(h in template for h in _HOLE):
        raise TaskError("the chat template uses a private-use character ltv-vllm renders with")
    task = plain_task(task)
    a, b, c = _HOLE
    q_a, q_c = task.query(a), task.query(c)
    system = system_turn(task)
    one = render(tokenizer, [*system, {"role": "user", "content": q_a}], template)
    if one.count(q_a) != 1:
        raise TaskError("the chat template does not show the user's message as it is; "
                        "--format chat cannot use it")
    head, tail = one.split(q_a)
    between = ("", "")
    if demos == "turns":
        two = render(tokenizer, [*system, {"role": "user", "content": q_a},
                                 {"role": "assistant", "content": b},
                                 {"role": "user", "content": q_c}], template)
        if not (two.startswith(head + q_a) and two.endswith(q_c + tail)
                and two.count(b) == 1):
            raise TaskError("the chat template does not render a conversation as its turns "
                            "one after another; --format chat cannot use it")
        middle = two[len(head + q_a):len(two) - len(q_c + tail)]
        between = tuple(middle.split(b))  # type: ignore[assignment]
    base = {f.name: getattr(task, f.name) for f in fields(Task)}
    out = ChatTask(**base, demos=demos, template=template, head=head, tail=tail,
                   between=between)
    # a conversation of real turns, checked whole (the placeholders may hide a template's
    # habit, e.g. a turn rendered differently by its index)
    probe = [Example("a", 0), Example("b", len(task.labels) - 1)]
    out.check(tokenizer, probe, "c")
    return out

