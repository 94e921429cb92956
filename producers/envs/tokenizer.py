"""Tokenizers the environments speak: the built-in character tokenizer and a thin wrapper around a
real model's HF `tokenizers` file, both with the same small interface (`Tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from bus.errors import ReelError

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

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = False) -> str: ...


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

    def __init__(self) -> None:
        self._itos = [*SPECIALS, *CHARS]
        self._stoi = {s: i for i, s in enumerate(self._itos)}
        self.vocab_size = len(self._itos)
        self.pad_id, self.bos_id, self.eos_id = (self._stoi[s] for s in SPECIALS)

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
    """A real model's tokenizer (tokenizer.json + tokenizer_config.json from an HF directory)."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def __init__(self, tokenizer, *, pad_id: int, bos_id: int | None, eos_id: int) -> None:
        self._tok = tokenizer  # tokenizers.Tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load `path`/tokenizer.json; eos/bos/pad come from `path`/tokenizer_config.json (pad
        defaults to eos, bos may be absent)."""
        try:
            from tokenizers import Tokenizer as RawTokenizer
        except ImportError as exc:
            raise TokenizerError(f"loading the tokenizer of {path} needs the `tokenizers` package; "
                                 "pip install tokenizers") from exc
        path = Path(path)
        try:
            tok = RawTokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text())
        except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
            raise TokenizerError(f"cannot load the tokenizer in {path} (tokenizer.json and "
                                 f"tokenizer_config.json): {exc}") from exc

        def token_id(key: str) -> int | None:
            token = config.get(key)
            if isinstance(token, dict):  # AddedToken form {"content": ...}
                token = token.get("content")
            if token is None:
                return None
            found = tok.token_to_id(token)
            if found is None:
                raise TokenizerError(f"{path / 'tokenizer_config.json'}: {key} {token!r} is not in tokenizer.json")
            return found

        eos_id = token_id("eos_token")
        if eos_id is None:
            raise TokenizerError(f"{path / 'tokenizer_config.json'} has no eos_token; completions could never end")
        pad_id = token_id("pad_token")
        return cls(tok, pad_id=eos_id if pad_id is None else pad_id, bos_id=token_id("bos_token"), eos_id=eos_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)
