"""Token data sets for causal language models: a token file, and text every Python has.

Lives here: `TokenWindows` (a 1-D token array cut into windows, items `(ids, labels)`),
`token_file` (nanoGPT's train.bin format: a flat file of uint16 or uint32 tokens, read through a
numpy memmap) and `stdlib_text` (the bytes of some of the standard library's own .py files as
tokens 0..255: a real corpus on every machine, for the demo, the README and tests). Lives
elsewhere: loading a data set by name or file (`runtime.data.sources`), batching
(`runtime.data.loader`).

Invariants:
- Item k holds window tokens[k * seq : k * seq + seq + 1] (windows overlap by one token, so every
  token is a target once): `labels="shifted"` gives (ids, labels) = (window[:-1], window[1:]),
  what a model that does not shift its targets takes (the zoo's gpt); `labels="same"` gives
  labels = ids, what a Hugging Face causal LM takes (it shifts inside). Both int64, seq long.
- Deterministic: the same file (the same Python, for stdlib_text) gives the same items.
- `stdlib_text`'s eval split is the last `eval_fraction` of the bytes, never seen in training.
"""

from __future__ import annotations

import sysconfig
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from autosbp.errors import DataError

__all__ = ["STDLIB_MODULES", "Labels", "TokenWindows", "stdlib_text", "token_file"]

# Pure-Python modules of the standard library: 730,213 bytes of source in Python 3.11.7.
STDLIB_MODULES = (
    "argparse", "ast", "dataclasses", "enum", "functools", "inspect", "logging",
    "pathlib", "textwrap", "typing",
)  # fmt: skip
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class Labels(Enum):
    """What an item's labels are, beside its ids."""

    SHIFTED = "shifted"  # the next token of each position
    SAME = "same"  # the ids themselves (a Hugging Face causal LM shifts them inside)


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `seq` ids (and their labels) from a 1-D token array (a memmap is read lazily)."""

    def __init__(self, tokens: np.ndarray, seq: int, labels: Labels | str = Labels.SHIFTED) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise DataError(f"seq={seq!r} is not a sequence length; give a whole number >= 1.")
        self.tokens, self.seq, self.labels = tokens, seq, _labels(labels)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq
        window = torch.from_numpy(np.array(self.tokens[start : start + self.seq + 1], np.int64))
        if self.labels is Labels.SAME:
            return window[:-1], window[:-1].clone()
        return window[:-1], window[1:]


def token_file(path: str, seq: int, dtype: str = "uint16", labels: str = "shifted") -> TokenWindows:
    """The tokens of a flat binary file (nanoGPT's train.bin: `np.array(ids, np.uint16).tofile`)
    as windows of `seq`; `dtype` "uint16" (vocabularies up to 65,536) or "uint32"."""
    if dtype not in TOKEN_DTYPES:
        raise DataError(
            f"Token dtype {dtype!r} is not one a token file holds; give uint16 or uint32."
        )
    file = Path(path)
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if not file.is_file() or file.stat().st_size % itemsize:
        found = f"{file.stat().st_size} bytes" if file.is_file() else "no such file"
        raise DataError(
            f"Token file {path!r} cannot hold {dtype} tokens ({found}); give the path of a file "
            f"of {dtype} tokens ({itemsize} bytes each), e.g. written by "
            f"`np.array(ids, np.{dtype}).tofile(path)`."
        )
    return TokenWindows(np.memmap(file, dtype=TOKEN_DTYPES[dtype], mode="r"), seq, labels)


def stdlib_text(
    seq: int = 64,
    split: str = "train",
    labels: str = "shifted",
    eval_fraction: float = 0.1,
    modules: tuple[str, ...] = STDLIB_MODULES,
) -> TokenWindows:
    """Byte tokens (a vocabulary of 256) of the source of standard-library `modules`, joined in
    order: the first 1 - `eval_fraction` of the bytes for `split="train"`, the rest for "eval"."""
    if split not in ("train", "eval") or not 0 < eval_fraction < 1:
        raise DataError(
            f"stdlib_text cannot take split={split!r}, eval_fraction={eval_fraction!r}; give "
            "split 'train' or 'eval' and an eval_fraction between 0 and 1 (default 0.1)."
        )
    text = b"".join(_source(name).read_bytes() for name in modules)
    tokens = np.frombuffer(text, dtype=np.uint8)
    cut = round(len(tokens) * (1 - eval_fraction))
    return TokenWindows(tokens[:cut] if split == "train" else tokens[cut:], seq, labels)


def _source(module: str) -> Path:
    """The module's source in the standard library's folder (not a same-named file elsewhere
    on sys.path, which could differ between ranks)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    for path in (folder / f"{module}.py", folder / module / "__init__.py"):
        if path.is_file():
            return path
    raise DataError(
        f"The standard library's module {module!r} has no .py source in {folder}; use a Python "
        "that ships its source, or give other modules (modules=...), or a token file "
        "(token_file)."
    )


def _labels(labels: Labels | str) -> Labels:
    try:
        return Labels(labels)
    except ValueError:
        raise DataError(
            f"labels={labels!r} is not a kind of labels; give 'shifted' (the next token: a model "
            "that does not shift its targets) or 'same' (the ids: a Hugging Face causal LM)."
        ) from None
