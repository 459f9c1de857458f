"""The checkpoint's chat template, rendered exactly as ``transformers``' ``apply_chat_template`` does.

Same Jinja environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
non-escaping ``tojson``, ``raise_exception``, ``strftime_now``, the restricted ``namespace`` and
``dict``) and the same input handling (``None`` values dropped from messages, inputs rebuilt from
plain JSON types, ``reasoning_content`` / ``thinking`` / ``reasoning`` aliased, the tokenizer's
special tokens passed as variables), so the rendered text is the same string, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from lily._lily import ModelLoadError
from lily.arguments import unicode_paths

__all__ = ["ChatTemplate", "TemplateError"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The chat template rejected the messages (``raise_exception`` in the template) or failed to render."""


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not, and has these options.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    class GenerationTag(jinja2.ext.Extension):
        # transformers' `{% generation %}` block (assistant-token masks); rendering just passes it through.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(lineno)

        def _passthrough(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Rebuild a value from plain JSON types, as transformers does before rendering."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list) -> list:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_schema(tool: Any) -> Any:
    if isinstance(tool, dict):
        return tool
    if callable(tool):
        try:
            from transformers.utils import get_json_schema
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TypeError("tools given as Python functions need transformers installed; pass JSON schemas") from e
        return get_json_schema(tool)
    raise TypeError("Tools should either be a JSON schema (dict) or a function with type hints and a docstring.")


class ChatTemplate:
    """A chat template plus the special-token variables it sees.

    ``source`` is the template text, or a dict of named templates (``"default"``, ``"tool_use"``, ...)
    as ``tokenizer_config.json`` may hold.
    """

    def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, Any] | None = None):
        """Raises ``TemplateError`` if a template is not valid Jinja."""
        named = isinstance(source, Mapping) and all(isinstance(n, str) and isinstance(t, str)
                                                    for n, t in source.items())
        if not (isinstance(source, str) or named):
            raise TypeError(f"source must be a template (str) or a dict of named templates, got {source!r:.60}")
        import jinja2

        for name, text in (source.items() if isinstance(source, Mapping) else [(None, source)]):
            try:
                _compile(text)
            except jinja2.exceptions.TemplateSyntaxError as e:
                where = f"template {name!r}, " if name is not None else ""
                raise TemplateError(f"not a valid Jinja template ({where}line {e.lineno}): {e.message}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, folder: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint folder: ``chat_template.jinja`` first (transformers' order), then
        ``chat_template`` in ``tokenizer_config.json``; None if there is neither. A file that cannot be read,
        is not JSON or holds a template that does not compile is a ``ModelLoadError`` naming it."""
        folder = Path(folder)
        config: dict = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = _read(config_path, json.loads)
            if not isinstance(config, dict):
                raise ModelLoadError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        special = _special_tokens_map(config)
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            return _read(jinja_path, lambda text: cls(text, special))
        source = config.get("chat_template")
        if isinstance(source, list):
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                       for t in source):
                raise ModelLoadError(f"{config_path}: chat_template: expected a list of {{name, template}} objects")
            source = {t["name"]: t["template"] for t in source}
        if not source:
            return None
        return _read(config_path, lambda _: cls(source, special))

    def _pick(self, tools: Any, name: str | None) -> str:
        if isinstance(self.source, str):
            return self.source
        if name is not None:
            if name not in self.source:
                raise ValueError(f"chat template {name!r} not found; available: {sorted(self.source)}")
            return self.source[name]
        if tools is not None and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ValueError(f"no default chat template among {sorted(self.source)}; pass chat_template=NAME")

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (one conversation). Extra keyword arguments become template
        variables (``enable_thinking``, ``preserve_thinking``, ...)."""
        import jinja2

        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
        if len(messages) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise TypeError(f"messages[{i}] must be a dict (role, content, ...), got {type(m).__name__}")
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, (list, tuple))):
            raise TypeError(f"tools must be a list of tools (JSON schemas or functions), got {type(tools).__name__}")
        unicode_paths("messages", messages)
        unicode_paths("tools", tools)
        source = self._pick(tools, chat_template)
        compiled = _compile(source)
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        tool_schemas = _plain([_tool_schema(t) for t in tools]) if tools is not None else None
        if documents is not None:
            for document in documents:
                if not isinstance(document, dict):
                    raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        try:
            variables = _plain({**self.special_tokens, **kwargs})
            chat = _alias_reasoning(_plain(chat))
            return compiled.render(
                messages=chat,
                tools=tool_schemas,
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except RecursionError:
            raise TemplateError("the messages nest too deeply to render (lists or dicts inside one another)") from None
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(str(e)) from e
        except (TypeError, ValueError) as e:  # a filter given what the template did not expect
            raise TemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


def _read(path: Path, parse):
    """``parse(text of path)``; a file that cannot be read or parsed is a ``ModelLoadError`` naming it."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError) as e:  # bad UTF-8 or JSON, a template that is not one
        raise ModelLoadError(f"{path}: {e}") from None


def _special_tokens_map(config: Mapping[str, Any]) -> dict[str, str]:
    """The ``special_tokens_map`` transformers passes to the template, from ``tokenizer_config.json``."""
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out
