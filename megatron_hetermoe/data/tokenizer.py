"""Tokenizers by Megatron-LM's --tokenizer-type names, all offline.

Megatron-LM's own text tokenizers load through `transformers` (and often a hub download); here
the same names are served by HuggingFace `tokenizers` reading local files:

- HuggingFaceTokenizer  --tokenizer-model PATH: a `tokenizer.json` (or a folder holding one)
- GPT2BPETokenizer      --vocab-file vocab.json --merge-file merges.txt (GPT-2 byte-level BPE files)
- NullTokenizer         --vocab-size N: text is space-separated integer ids; EOD is id N

`train_bpe` makes a real byte-level BPE (GPT-2's algorithm) from local text, so a demo or a
test can have a real tokenizer without downloading one. The classes have what megatron-core's
GPTDataset reads from its tokenizer (vocab_size, eod, unique_identifiers) and the
tokenize/detokenize of MegatronTokenizerBase; they do not subclass it, so importing this
module (and the trainer, which imports it through data.py) does not import megatron.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable

from megatron_hetermoe.cli.tokenizer import build_parser
from megatron_hetermoe.config import TOKENIZER_TYPES
from megatron_hetermoe.errors import UserError

EOD_TOKEN = "<|endoftext|>"  # GPT-2's end-of-document token, kept for familiarity
class TokenizerError(UserError, ValueError):
    pass


class _Common:
    """What GPTDataset reads from a tokenizer: vocab_size, eod, unique_identifiers. No `pad`:
    GPTDataset then uses its own out-of-vocabulary pad id, as for Megatron's GPT-2 tokenizer."""

    def __init__(self, path: str, identifiers: dict) -> None:
        self.path = path
        # GPTDataset puts this in its cache hash: a different tokenizer must not reuse an index.
        self.unique_identifiers = {"class": type(self).__name__, **identifiers}

    @property
    def eos(self) -> int:
        return self.eod

    def apply_chat_template(self, *a, **k):
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, path={self.path!r})"


class BPETokenizer(_Common):
    """A HuggingFace `tokenizers` model (byte-level BPE for GPT-2 style files)."""

    def __init__(self, tok, path: str, identifiers: dict) -> None:
        super().__init__(path, identifiers)
        self._tok = tok
        eod = tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise TokenizerError(
                f"tokenizer {path!r} has no {EOD_TOKEN!r} token, which Megatron uses as end of document; "
                f"add it as a special token (train_bpe does)"
            )
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class NullTokenizer(_Common):
    """Megatron's NullTokenizer: the text already holds token ids; EOD is the id after them."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__("", {"vocab_size": vocab_size})
        self._n = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._n + 1)}

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise TokenizerError(f"NullTokenizer with --vocab-size {self._n}: ids {bad[:5]} are out of range")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in ids)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, vocab_size: int | None = None) -> _Common:
    """The tokenizer named by Megatron's --tokenizer-type, from local files only."""
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1; EOD is N)")
        return NullTokenizer(vocab_size)
    from tokenizers import Tokenizer

    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json")
        path = Path(tokenizer_model)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model}: no such file (hub names are not downloaded here); "
                f"pass a local tokenizer.json, e.g. one made by `python -m megatron_hetermoe.data.tokenizer`"
            )
        return BPETokenizer(Tokenizer.from_file(str(path)), str(path), {"tokenizer_model": str(path.resolve())})
    if tokenizer_type == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise TokenizerError("--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json and "
                                 "--merge-file merges.txt")
        for f in (vocab_file, merge_file):
            if not Path(f).is_file():
                raise TokenizerError(f"GPT2BPETokenizer: {f} does not exist")
        from tokenizers import decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return BPETokenizer(tok, vocab_file, {"vocab_file": str(Path(vocab_file).resolve()),
                                              "merge_file": str(Path(merge_file).resolve())})
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not supported here; "
                         f"use one of {', '.join(TOKENIZER_TYPES)}")


def train_bpe(texts: Iterable[str], vocab_size: int, output: str | Path) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2's scheme) of `vocab_size` tokens, EOD (id 0) included; save
    tokenizer.json at `output`, and GPT-2 style vocab.json + merges.txt beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(f"vocab size {vocab_size} < 257: byte-level BPE needs 256 byte tokens plus EOD")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # EOD as a trainer special token: in the model's vocab.json (the GPT-2 files) and never merged.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(output))
    tok.model.save(str(output.parent))  # vocab.json, merges.txt: the GPT2BPETokenizer route
    return build_tokenizer("HuggingFaceTokenizer", str(output))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    def texts():
        with open(a.input, encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                for k in a.json_keys:
                    yield doc[k]

    tok = train_bpe(texts(), a.vocab_size, a.output)
    print(f"wrote {a.output}: vocab size {tok.vocab_size}, EOD id {tok.eod}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
