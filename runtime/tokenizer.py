"""Tokenizers: the built-in character tokenizer (tiny examples) and a checkpoint's own tokenizer
(transformers.AutoTokenizer, local files only), both with the same small interface (`Tokenizer`).

Token ids are what travels on the bus; text exists only in environments and in `reel log cat
--decode`, which is why this lives in runtime/ (both sides read it). A prompt is rendered with the
model's chat template when it has one: `prompt_ids` renders the task's user message and the
generation prompt, `turn_ids` the tokens an environment appends after a model turn (a tool result
or a user turn, ending with the next generation prompt).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from reel.bus.errors import ReelError

SPECIALS = ("<pad>", "<bos>", "<eos>")
# Lower-case letters, digits, space and the punctuation task prompts use ("reverse:abc=").
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 :=.,;?!-+"


class TokenizerError(ReelError):
    """Text or ids the tokenizer cannot handle, or a tokenizer file that cannot be loaded."""


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None  # None: the model has no begin-of-sequence token (prompts start without one)
    eos_id: int
    stop_ids: tuple[int, ...]  # sampling any of these ends a model turn (eos first)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = False) -> str: ...

    def prompt_ids(self, text: str) -> list[int]:
        """The ids of a prompt whose user message is `text`, ready for the model's first turn."""
        ...

    def turn_ids(self, role: str, text: str) -> list[int]:
        """The ids appended after a finished model turn: a `role` ("tool", "user") message, then the
        prompt of the next model turn."""
        ...


class CharTokenizer:
    """One id per character of CHARS plus pad/bos/eos, written `<pad>` `<bos>` `<eos>` in text.

    49 ids, so a tiny model's embedding and output layers stay small. decode(encode(s)) == s for
    any text made of CHARS and the three special markers. encode rejects other characters; decode
    accepts any id and writes one outside the vocabulary (a model with a larger output layer can
    sample one) as U+FFFD, so scoring a completion never fails.
    """

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    stop_ids: tuple[int, ...]

    def __init__(self) -> None:
        self._itos = [*SPECIALS, *CHARS]
        self._stoi = {s: i for i, s in enumerate(self._itos)}
        self.vocab_size = len(self._itos)
        self.pad_id, self.bos_id, self.eos_id = (self._stoi[s] for s in SPECIALS)
        self.stop_ids = (self.eos_id,)

    def prompt_ids(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text)]

    def turn_ids(self, role: str, text: str) -> list[int]:
        return self.encode(text)  # no roles: the text itself marks the turn (e.g. "=42;")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            special = next((s for s in SPECIALS if text.startswith(s, i)), None)
            token = special or text[i]
            if token not in self._stoi:
                raise TokenizerError(f"character {token!r} at position {i} of {text!r} is not in the "
                                     f"character tokenizer's vocabulary ({CHARS!r} and {', '.join(SPECIALS)})")
            ids.append(self._stoi[token])
            i += len(token)
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        out: list[str] = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                out.append("\ufffd")
            elif not (skip_special and i < len(SPECIALS)):
                out.append(self._itos[i])
        return "".join(out)


class HFTokenizer:
    """A checkpoint's own tokenizer: transformers.AutoTokenizer on its directory, local files only.

    eos is the tokenizer's eos token; stop ids add the eos ids of generation_config.json (chat
    models often end a turn with a token that is not the tokenizer's eos, e.g. Qwen's <|im_end|>).
    """

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    stop_ids: tuple[int, ...]

    def __init__(self, tokenizer, *, stop_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer  # a transformers PreTrainedTokenizerBase
        self.vocab_size = len(tokenizer)
        self.eos_id = stop_ids[0]
        self.stop_ids = stop_ids
        self.pad_id = self.eos_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.bos_id = tokenizer.bos_token_id
        self._eos_text = tokenizer.convert_ids_to_tokens(self.eos_id)

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """The tokenizer saved in `path` (tokenizer.json / tokenizer_config.json / chat template)."""
        path = Path(path)
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise TokenizerError(f"loading the tokenizer of {path} needs the `transformers` package; "
                                 "pip install transformers") from exc
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad directory
            raise TokenizerError(f"cannot load the tokenizer in {path} (tokenizer.json, tokenizer_config.json): "
                                 f"{exc}".splitlines()[0]) from exc
        stops = [] if tok.eos_token_id is None else [tok.eos_token_id]
        stops += [i for i in _generation_eos_ids(path) if i not in stops]
        if not stops:
            raise TokenizerError(f"the tokenizer in {path} has no eos token (tokenizer_config.json eos_token or "
                                 "generation_config.json eos_token_id); completions could never end")
        return cls(tok, stop_ids=tuple(stops))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def prompt_ids(self, text: str) -> list[int]:
        if not self._tok.chat_template:
            return ([] if self.bos_id is None else [self.bos_id]) + self.encode(text)
        return self.encode(self._render([{"role": "user", "content": text}], generation_prompt=True))

    def turn_ids(self, role: str, text: str) -> list[int]:
        if not self._tok.chat_template:
            return self.encode(text)
        # The template's text for the new message: render a conversation with and without it and
        # keep what follows the model turn's stop token (the model sampled that token itself).
        before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        shorter = self._render(before, generation_prompt=False)
        longer = self._render([*before, {"role": role, "content": text}], generation_prompt=True)
        end = shorter.rfind(self._eos_text)
        if end < 0 or not longer.startswith(shorter[:end + len(self._eos_text)]):
            raise TokenizerError(f"the chat template does not end an assistant turn with {self._eos_text!r}; "
                                 f"cannot append a {role} message")
        return self.encode(longer[end + len(self._eos_text):])

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _generation_eos_ids(path: Path) -> list[int]:
    """eos_token_id of generation_config.json (an int or a list), if the file exists."""
    try:
        found = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return []
    return [found] if isinstance(found, int) else [i for i in (found or []) if isinstance(i, int)]


def load_tokenizer(model_path: str) -> Tokenizer:
    """A run's tokenizer: model.path's own, else (empty path) the character tokenizer."""
    return HFTokenizer.from_dir(model_path) if model_path else CharTokenizer()
