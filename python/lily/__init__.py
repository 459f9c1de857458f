"""Lily: fast local inference for Qwen3.6-35B-A3B.

The Rust core (``lily._lily``) owns the weights, the device and the per-sequence state;
this package owns tokenization, the chat template, sampling, streaming and the CLI.

    model = lily.load("mlx-community/Qwen3.6-35B-A3B-4bit")
    reply = model.chat([{"role": "user", "content": "Hi!"}])
"""

from lily import _nvrtc
from lily._lily import ContextFullError, DeviceError, Engine, LilyError, ModelLoadError, SequenceEvictedError
from lily.info import info
from lily.loading import load
from lily.model import Model
from lily.outputs import AssistantMessage, ChatChunk, Chunk, Completion, GenerationStats
from lily.reasoning import split_reasoning
from lily.sampling import Sampler
from lily.structured import Grammar
from lily.template import ChatTemplate, TemplateError
from lily.tokenizer import StreamingDetokenizer, Tokenizer
from lily.tools import parse_tool_calls

_nvrtc.configure()  # the core reads LILY_NVRTC when the first CUDA engine is made

__all__ = [
    "AssistantMessage",
    "ChatChunk",
    "ChatTemplate",
    "Chunk",
    "Completion",
    "ContextFullError",
    "DeviceError",
    "Engine",
    "GenerationStats",
    "Grammar",
    "LilyError",
    "Model",
    "ModelLoadError",
    "Sampler",
    "SequenceEvictedError",
    "StreamingDetokenizer",
    "TemplateError",
    "Tokenizer",
    "info",
    "load",
    "parse_tool_calls",
    "split_reasoning",
]
