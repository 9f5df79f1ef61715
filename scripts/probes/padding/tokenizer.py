"""The model's own tokenizer and chat template, loaded and checked as training uses them: the
fast (Rust) tokenizer from the model directory, the template file that wins over the tokenizer's
own, the `{% generation %}` tags that assistant-only loss needs, and the Rust backend set up as
the transformers call path sets it up. ``probes.padding.tokenize`` counts tokens with them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from probes.errors import ProbeError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizeError(ProbeError, ValueError):
    """Tokenizer or template cannot serve this data; the message says which config key to fix."""


def load_tokenizer(model_path: str | Path) -> Any:
    """The model's own tokenizer from a local directory (never a hub id)."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not path.is_dir():
        raise TokenizeError(f"model.path '{path}' is not a directory with tokenizer files.")
    if not (path / "tokenizer.json").is_file():
        raise TokenizeError(
            f"model.path '{path}': no tokenizer.json; the data is tokenized in batches by the "
            "fast (Rust) tokenizer: save it there with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(model_path)."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise TokenizeError(
            f"model.path '{path}': the tokenizer does not load ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); check tokenizer.json and "
            "tokenizer_config.json there."
        ) from error
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizeError(
            f"model.path '{path}': the tokenizer is not a fast (Rust) tokenizer; "
            "ship a tokenizer.json so the data can be tokenized in batches."
        )
    return tokenizer


def resolve_chat_template(tokenizer: Any, template_path: str | Path | None) -> str | None:
    """The template file when configured (it wins), else the tokenizer's own, else None."""
    if template_path:
        return Path(template_path).read_text()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: training uses "default"
        template = template.get("default")
    return template or None


def check_template(template: str | None, loss_on: str, n_chat: int) -> None:
    """Fail early, naming the config key, when chat data cannot be rendered or masked."""
    if n_chat == 0:
        return
    if template is None:
        raise TokenizeError(
            "the tokenizer has no chat template and config model.chat_template is null; "
            "set model.chat_template to a jinja template file "
            "(e.g. config/chat_templates/gemma.jinja)."
        )
    if loss_on == "assistant" and not GENERATION_TAG.search(template):
        raise TokenizeError(
            "training.loss_on is 'assistant' but the chat template has no {% generation %} tags, "
            "so assistant tokens cannot be found; set model.chat_template to a template with "
            "{% generation %}...{% endgeneration %} around assistant turns "
            "(e.g. config/chat_templates/gemma.jinja), or set training.loss_on: all."
        )


def rust_backend(tokenizer: Any) -> Any:
    """The tokenizer's Rust backend set up as the transformers call path sets it up: no
    truncation, no padding, special-token splitting as configured. Used as is when it already
    is (the usual case), else a configured copy (parsing a 262k vocabulary again costs ~1 s)."""
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.truncation is None and backend.padding is None:
        if backend.encode_special_tokens == split:
            return backend
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = split
    return backend


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    # apply_chat_template passes the special tokens map (bos_token, eos_token...) to the template.
    return dict(tokenizer.special_tokens_map)
