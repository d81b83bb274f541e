"""Token streams to train on and the order the trainer reads them in.

Corpora (load_corpus):
- default: the Python standard library's sources (every .py file under sysconfig's stdlib
  folder, installed packages left out), as bytes (vocabulary 256). Every machine with Python
  has it, so nothing is downloaded.
- a text file: its bytes; the last VAL_FRACTION of them is the validation split.
- a folder: the bytes of every text file in it (hidden entries and files with NUL bytes are
  skipped), in path order.
- a .bin file: nanoGPT's pre-tokenised format, a flat array of uint16 token ids (any vocabulary
  up to 65536). train.bin with a val.bin beside it are the two splits; any other .bin is split
  like a text file.

Folders (and the default corpus) are split by file, deterministically: a file is validation
data when the CRC-32 of its path inside the folder is divisible by VAL_EVERY_NTH_FILE, so the
split does not move when files are added elsewhere and no file is in both.
"""

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VAL_FRACTION = 0.1
VAL_EVERY_NTH_FILE = 10
BYTE_VOCAB = 256


class DataError(ValueError):
    """The data cannot be used as asked (the message names what and why)."""


@dataclass
class Corpus:
    train: np.ndarray  # token ids, 1-D (uint8 bytes or uint16; a memmap for .bin)
    val: np.ndarray
    vocab_size: int
    description: str

    @property
    def is_bytes(self):
        return self.vocab_size == BYTE_VOCAB and self.train.dtype == np.uint8

    def decode(self, ids):
        """Token ids -> text: UTF-8 for byte corpora; the ids themselves otherwise (a .bin
        file does not say which tokenizer made it)."""
        if self.is_bytes:
            return bytes(ids).decode("utf-8", errors="replace")
        return " ".join(str(i) for i in ids)


# ----------------------------------------------------------------------------------------------
# Corpora.
# ----------------------------------------------------------------------------------------------


def stdlib_root():
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root=None):
    """The standard library's .py files, sorted, without installed packages."""
    root = stdlib_root() if root is None else root
    return sorted(p for p in root.rglob("*.py")
                  if p.is_file() and not {"site-packages", "dist-packages"} & set(
                      p.relative_to(root).parts))


def is_val_file(relative_path):
    return zlib.crc32(relative_path.as_posix().encode()) % VAL_EVERY_NTH_FILE == 0


def split_files(files, root):
    """(train files, val files), by is_val_file; val gets the file of smallest CRC if the rule
    picked none. Needs at least two files."""
    val = [f for f in files if is_val_file(f.relative_to(root))]
    if not val:
        val = [min(files, key=lambda f: zlib.crc32(f.relative_to(root).as_posix().encode()))]
    chosen = set(val)
    return [f for f in files if f not in chosen], val


def _concat(files):
    # One newline between files, so that a file's last line does not run into the next one.
    return np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)


def _split_tail(tokens):
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


def _is_text_file(path):
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def text_files(folder):
    """Every text file under folder, sorted, skipping hidden files and folders."""
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".")
                                             for part in p.relative_to(folder).parts)
                  and _is_text_file(p))


def load_folder(folder, description):
    files = text_files(folder)
    if not files:
        raise DataError(f"--data {folder}: no text files in this folder")
    if len(files) == 1:  # nothing to split by file: split the one file's bytes
        train, val = _split_tail(_concat(files))
    else:
        train_files, val_files = split_files(files, folder)
        train, val = _concat(train_files), _concat(val_files)
        description += f" ({len(train_files)} train / {len(val_files)} val files)"
    return Corpus(train, val, BYTE_VOCAB, description)


def _read_bin(path):
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"--data {path}: {size} bytes is not a whole number of uint16 token ids "
                        "(nanoGPT's .bin format)")
    if size == 0:
        raise DataError(f"--data {path}: the file is empty")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _max_id(tokens, chunk=1 << 26):
    return max(int(tokens[i: i + chunk].max()) for i in range(0, len(tokens), chunk))


def load_bin(path, vocab_size=None):
    """A nanoGPT .bin file (see the module docstring). vocab_size: the model's vocabulary; by
    default the largest id in the data + 1 (which reads the whole file once)."""
    val_path = path.with_name("val.bin")
    if path.name == "train.bin" and val_path.exists():
        train, val = _read_bin(path), _read_bin(val_path)
        description = f"{path} + {val_path.name}"
    else:
        train, val = _split_tail(_read_bin(path))
        description = str(path)
    if vocab_size is None:
        vocab_size = max(_max_id(train), _max_id(val)) + 1
    elif not 1 <= vocab_size <= 65536:
        raise DataError(f"--vocab-size {vocab_size}: uint16 token ids need a vocabulary of "
                        "1 to 65536")
    return Corpus(train, val, vocab_size, description)


def load_corpus(path=None, vocab_size=None):
    """The Corpus at path (a text file, a folder, a .bin file; None: the standard library)."""
    if path is None:
        root = stdlib_root()
        files = stdlib_files(root)
        if len(files) < 2:
            raise DataError(f"the Python standard library at {root} has no sources to train on; "
                            "pass --data")
        train_files, val_files = split_files(files, root)
        corpus = Corpus(_concat(train_files), _concat(val_files), BYTE_VOCAB,
                        f"the Python standard library's sources at {root} "
                        f"({len(train_files)} train / {len(val_files)} val files)")
    else:
        path = Path(path)
        if not path.exists():
            raise DataError(f"--data {path}: no such file or folder")
        if path.is_dir():
            corpus = load_folder(path, f"{path}")
        elif path.suffix == ".bin":
            corpus = load_bin(path, vocab_size)
        else:
            train, val = _split_tail(np.fromfile(path, dtype=np.uint8))
            corpus = Corpus(train, val, BYTE_VOCAB, str(path))
    if vocab_size is not None and corpus.is_bytes and vocab_size != BYTE_VOCAB:
        raise DataError(f"--vocab-size {vocab_size}: text is read as bytes, a vocabulary of "
                        f"{BYTE_VOCAB}; --vocab-size is for .bin files")
    return corpus


def check_length(corpus, seqlen):
    """Both splits must hold at least one window of seqlen inputs + 1 target."""
    for name, tokens in (("training", corpus.train), ("validation", corpus.val)):
        if len(tokens) < seqlen + 1:
            raise DataError(f"--data: the {name} split of {corpus.description} has "
                            f"{len(tokens)} tokens, fewer than --seqlen {seqlen} + 1; "
                            "use a shorter --seqlen or more data")


# ----------------------------------------------------------------------------------------------
# Reading order.
# ----------------------------------------------------------------------------------------------


def windows(tokens, starts, seqlen, device):
    """(inputs, targets), each (len(starts), seqlen) int64 on device: the windows of seqlen + 1
    tokens at starts, the targets shifted by one."""
    chunk = np.stack([np.asarray(tokens[s: s + seqlen + 1], dtype=np.int64) for s in starts])
    chunk = torch.from_numpy(chunk)
    if device.type == "cuda":
        chunk = chunk.pin_memory().to(device, non_blocking=True)
    return chunk[:, :-1], chunk[:, 1:]


class WindowSampler:
    """The training windows in a new random order each epoch. Epoch e cuts the tokens into
    windows of seqlen + 1 from an offset in [0, seqlen) and shuffles them, both drawn from
    (seed, e); batches run on into the next epoch. The position (epoch, index) is all a
    checkpoint needs to continue the same sequence of batches.

    Every rank draws the same global batch and reads its own slice of it, so N ranks with
    batch B see exactly the windows one process with batch N x B sees."""

    def __init__(self, num_tokens, seqlen, seed):
        if num_tokens < seqlen + 1:
            raise DataError(f"{num_tokens} tokens hold no window of {seqlen + 1}")
        self.num_tokens, self.seqlen, self.seed = num_tokens, seqlen, seed
        self.epoch, self.index = 0, 0
        self._order_epoch, self._offset, self._order = None, None, None

    def _epoch_order(self):
        if self._order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            max_offset = min(self.seqlen, self.num_tokens - self.seqlen)  # a window must fit
            self._offset = int(torch.randint(max_offset, (), generator=generator))
            count = (self.num_tokens - 1 - self._offset) // self.seqlen
            self._order = torch.randperm(count, generator=generator)
            self._order_epoch = self.epoch
        return self._offset, self._order

    def next_starts(self, count):
        """The start offsets of the next count windows of the global batch."""
        starts = []
        while len(starts) < count:
            offset, order = self._epoch_order()
            take = order[self.index: self.index + count - len(starts)]
            starts.extend((offset + take * self.seqlen).tolist())
            self.index += len(take)
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return starts

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "seqlen": self.seqlen, "num_tokens": self.num_tokens}

    def load_state_dict(self, state):
        """Continue at state's position (check_resumable first)."""
        check_resumable(state, self.num_tokens, self.seqlen, self.seed)
        self.epoch, self.index = state["epoch"], state["index"]


def check_resumable(state, num_tokens, seqlen, seed):
    """A WindowSampler position names windows of the same data, seqlen and seed only."""
    saved = (state["num_tokens"], state["seqlen"], state["seed"])
    if saved != (num_tokens, seqlen, seed):
        raise DataError(f"the checkpoint read {saved[0]} training tokens in windows of "
                        f"{saved[1]} with seed {saved[2]}, this run has {num_tokens}, "
                        f"{seqlen} and {seed}: resume with the same --data, --seqlen and --seed")


def val_starts(num_tokens, seqlen, count):
    """count validation windows spread evenly over the split (repeating when it holds fewer):
    the same windows at every evaluation, so the curve has no sampling noise."""
    available = (num_tokens - 1) // seqlen
    return [(i * available // count) * seqlen if count <= available else (i % available) * seqlen
            for i in range(count)]


def rank_slice(starts, rank, per_rank):
    return starts[rank * per_rank: (rank + 1) * per_rank]


def describe_tokens(n):
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
