"""training/data.py: the corpora (the standard library by default, text files, folders, nanoGPT
.bin files), the split by file, and the order windows are read in."""

import numpy as np
import pytest

from training import data


def test_default_corpus_is_the_standard_library_split_by_file():
    root = data.stdlib_root()
    files = data.stdlib_files(root)
    assert root / "json" / "decoder.py" in files  # a module every CPython ships
    assert not any("site-packages" in f.parts for f in files)
    train, val = data.split_files(files, root)
    assert set(train).isdisjoint(val) and sorted(train + val) == files
    assert 0.03 < len(val) / len(files) < 0.2
    # The rule depends on a file's own path only: the same files land in val from a subset.
    assert data.split_files(files[::2], root)[1] == [f for f in val if f in files[::2]]
    corpus = data.load_corpus()
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    sizes = [f.stat().st_size for f in val]
    assert len(corpus.val) == sum(sizes) + len(val) - 1  # newline-joined
    head = train[0].read_bytes()[:200]
    assert corpus.train[:len(head)].tobytes() == head
    text = corpus.decode(corpus.train[:len(head)].tolist())
    assert text == head.decode("utf-8", errors="replace")


def test_text_file_is_split_at_its_tail(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(bytes(range(100)) * 10)
    corpus = data.load_corpus(path)
    assert len(corpus.train) == 900 and len(corpus.val) == 100
    assert corpus.val.tobytes() == path.read_bytes()[900:]


def test_folder_skips_hidden_and_binary_files_and_splits_by_file(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n" * 20)
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "image.bin.dat").write_bytes(b"\x89PNG\0\0\0")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.txt").write_text("deep\n")
    files = data.text_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == (
        [f"doc{i:02d}.txt" for i in range(30)] + ["sub/deep.txt"])
    corpus = data.load_folder(tmp_path, "docs")
    train_files, val_files = data.split_files(files, tmp_path)
    assert val_files and train_files
    text = lambda fs: b"\n".join(f.read_bytes() for f in fs)  # noqa: E731
    assert corpus.train.tobytes() == text(train_files) and corpus.val.tobytes() == text(val_files)
    assert b"hidden" not in corpus.train.tobytes() + corpus.val.tobytes()


def test_one_file_folder_falls_back_to_the_tail_split(tmp_path):
    (tmp_path / "only.txt").write_bytes(b"a" * 1000)
    corpus = data.load_folder(tmp_path, "one")
    assert (len(corpus.train), len(corpus.val)) == (900, 100)


def test_nanogpt_bin_files(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) * 37 % 50257
    ids.tofile(tmp_path / "train.bin")
    ids[:200].tofile(tmp_path / "val.bin")
    corpus = data.load_corpus(tmp_path / "train.bin")
    assert corpus.vocab_size == int(ids.max()) + 1
    assert np.array_equal(corpus.train, ids) and np.array_equal(corpus.val, ids[:200])
    assert corpus.decode([5, 7]) == "5 7"  # no tokenizer is known for a .bin file
    single = tmp_path / "tokens.bin"
    ids.tofile(single)
    corpus = data.load_corpus(single, vocab_size=50304)
    assert corpus.vocab_size == 50304 and len(corpus.train) == 900 and len(corpus.val) == 100
    with pytest.raises(data.DataError, match="--vocab-size 70000"):
        data.load_corpus(single, vocab_size=70000)


def test_check_length_names_the_split_and_seqlen():
    corpus = data.Corpus(np.zeros(100, np.uint8), np.zeros(10, np.uint8), 256, "tiny")
    data.check_length(corpus, 9)
    with pytest.raises(data.DataError, match="validation split of tiny has 10 tokens, fewer than "
                                             "--seqlen 10 \\+ 1"):
        data.check_length(corpus, 10)


# ----------------------------------------------------------------------------------------------
# Reading order.


def _draw(sampler, batches, size):
    return [sampler.next_starts(size) for _ in range(batches)]


def test_windows_cover_an_epoch_once_in_a_seeded_order():
    num_tokens, seqlen = 1000, 16
    sampler = data.WindowSampler(num_tokens, seqlen, seed=3)
    starts = sum(_draw(sampler, 30, 4), [])
    assert all(0 <= s and s + seqlen + 1 <= num_tokens for s in starts)
    first_epoch = starts[: (num_tokens - 1 - starts[0] % seqlen) // seqlen]
    assert len(set(first_epoch)) == len(first_epoch)  # no window twice within an epoch
    assert len({s % seqlen for s in first_epoch}) == 1  # one offset per epoch
    assert sampler.epoch >= 1  # 120 windows > one epoch's 61 or 62: the batches ran on
    again = data.WindowSampler(num_tokens, seqlen, seed=3)
    assert sum(_draw(again, 30, 4), []) == starts
    other = data.WindowSampler(num_tokens, seqlen, seed=4)
    assert sum(_draw(other, 30, 4), []) != starts


def test_sampler_state_continues_the_same_sequence():
    sampler = data.WindowSampler(5000, 32, seed=0)
    _draw(sampler, 7, 8)
    state = sampler.state_dict()
    rest = _draw(sampler, 40, 8)
    restored = data.WindowSampler(5000, 32, seed=0)
    restored.load_state_dict(state)
    assert _draw(restored, 40, 8) == rest
    with pytest.raises(data.DataError, match="resume with the same --data"):
        data.WindowSampler(4000, 32, seed=0).load_state_dict(state)


def test_ranks_read_slices_of_the_single_process_batch():
    one = data.WindowSampler(5000, 32, seed=1).next_starts(8)
    two = data.WindowSampler(5000, 32, seed=1).next_starts(8)
    assert data.rank_slice(two, 0, 4) + data.rank_slice(two, 1, 4) == one


def test_tiny_data_still_gives_full_batches():
    sampler = data.WindowSampler(20, 16, seed=0)  # room for one window only
    assert len(sampler.next_starts(5)) == 5


def test_validation_windows_are_spread_evenly_and_repeat_when_scarce():
    assert data.val_starts(1001, 10, 4) == [0, 250, 500, 750]
    assert data.val_starts(31, 10, 5) == [0, 10, 20, 0, 10]


def test_windows_shift_targets_by_one():
    import torch

    tokens = np.arange(50, dtype=np.uint8)
    inputs, targets = data.windows(tokens, [0, 10], 4, torch.device("cpu"))
    assert inputs.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert targets.tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert inputs.dtype == torch.int64
