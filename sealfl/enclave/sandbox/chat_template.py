"""Chat templates rendered as transformers renders them, from a release's verified template
text (the device's LLM runtime renders prompts with it in the parent; the child sees only
token ids)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from sealfl.enclave.errors import LLMInputError

__all__ = ["ChatTemplate"]


class ChatTemplate:
    """A chat template rendered as transformers' ``apply_chat_template`` renders it:
    ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
    with the ``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML,
    and ``raise_exception``/``strftime_now`` globals (transformers
    ``utils/chat_template_utils.py``, 5.x).

    Raises:
        ValueError: the template does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import datetime

        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise LLMInputError(f"chat template does not compile: {exc}") from exc
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> str:
        """Render ``[{"role": str, "content": str}, ...]``.

        Raises:
            ValueError: a message is not a dict of strings with role and content, or the
                template raised an error.
        """
        import jinja2

        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise LLMInputError(f"message {i} must be an object with string 'role' and 'content'")
            clean.append({"role": m["role"], "content": m["content"]})
        if not clean:
            raise LLMInputError("at least one message is needed")
        try:
            return self._template.render(messages=clean, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise LLMInputError(f"the chat template refused the messages: {exc}") from exc
