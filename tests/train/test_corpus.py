"""zeroshard.corpus: sources, tokenization and its cache, the held-out split, the packed
store's batches and every bad input's one line. A small BPE tokenizer is trained here
with the ``tokenizers`` library (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from zeroshard.corpus import DataError, PreparedCorpus, open_corpus, prepare_corpus  # noqa: E402
from zeroshard.corpus.cache import cache_root  # noqa: E402
from zeroshard.corpus.order import permute  # noqa: E402
from zeroshard.corpus.sources import Source, read_pieces  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def _document(rng: random.Random, i: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 80)))
    return f"zq{i:03d}x {body}\n"  # a marker word that names the document


@pytest.fixture(scope="module")
def docs() -> list[str]:
    rng = random.Random(0)
    return [_document(rng, i) for i in range(120)]


def _bpe(docs: list[str]):
    """A byte-level BPE of 400 ids trained on ``docs``; id 0 is ``<eos>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


def _save(tok, folder, **special):
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, docs):
    return _save(_bpe(docs), tmp_path_factory.mktemp("model"), eos_token="<eos>")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _expected(hf, texts: list[str]) -> list[int]:
    out = []
    for t in texts:
        out += hf(t, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    return out


def _text_folder(root, docs):
    root.mkdir()
    (root / "sub").mkdir()
    for i, doc in enumerate(docs):
        (root / ("sub" if i % 3 == 0 else "") / f"d{i:03d}.md").write_text(doc)
    (root / ".hidden.txt").write_text("never read")
    (root / "image.png").write_bytes(b"\x89PNG\0\0\0")  # not text: skipped
    return root


def _stream(info, split="train") -> np.ndarray:
    return np.concatenate([np.fromfile(s.path, dtype=s.dtype)[s.start:s.stop]
                           for s in info.segments(split)])


def test_text_folder_round_trip_with_boundaries(tmp_path, docs, model_dir, hf):
    data = _text_folder(tmp_path / "data", docs)
    info = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False)
    order = sorted(data.rglob("d*.md"), key=lambda p: str(p.relative_to(data)))
    expected = _expected(hf, [p.read_text() for p in order])
    stream = np.concatenate([_stream(info, "train"), _stream(info, "val")])
    assert stream.tolist() == expected
    assert info.eos_id == hf.eos_token_id and info.documents == len(docs) == 120
    ends = np.fromfile(os.path.join(info.cache, "documents.bin"), dtype=np.uint64)
    assert (stream[ends.astype(np.int64) - 1] == info.eos_id).all()
    assert int((stream == info.eos_id).sum()) == 120  # one boundary a document, none else


def test_json_lines_round_trip(tmp_path, docs, model_dir, hf):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs[:40])]
    path.write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
    info = prepare_corpus(path, model_dir, field="body", cache_dir=tmp_path / "c",
                          progress=False, val_fraction=0.2)
    stream = np.concatenate([_stream(info, "train"), _stream(info, "val")])
    assert stream.tolist() == _expected(hf, docs[:40])


def test_large_text_file_streams_in_pieces(tmp_path, docs):
    path = tmp_path / "big.txt"
    text = "".join(docs) + "é" * 3000 + "no newline at the end"
    path.write_text(text)
    src = Source(path, "text", path.stat().st_size, 0)
    pieces = list(read_pieces((src,), "text", piece_bytes=1000))
    assert len(pieces) > 10 and "".join(p.text for p in pieces) == text
    assert [p.ends for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert sum(p.nbytes for p in pieces) == path.stat().st_size


def test_val_split_shares_no_document(tmp_path, docs, model_dir, hf):
    data = _text_folder(tmp_path / "data", docs)
    info = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False,
                          val_fraction=0.1)
    train, val = hf.decode(_stream(info, "train")), hf.decode(_stream(info, "val"))
    in_train = {f"zq{i:03d}x" for i in range(120) if f"zq{i:03d}x" in train}
    in_val = {f"zq{i:03d}x" for i in range(120) if f"zq{i:03d}x" in val}
    assert not in_train & in_val and len(in_train | in_val) == 120
    assert 8 <= len(in_val) <= 16  # ~10% of 120 documents
    assert _stream(info, "train")[-1] == info.eos_id  # the cut follows a boundary
    assert abs(info.tokens("val") / (info.tokens("train") + info.tokens("val")) - 0.1) < 0.02


def test_cache_reused_then_invalidated(tmp_path, docs, model_dir):
    data = _text_folder(tmp_path / "data", docs[:30])
    first = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False)
    tokens = os.path.join(first.cache, "tokens.bin")
    made = os.stat(tokens).st_mtime_ns
    again = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False,
                           val_fraction=0.2)  # the split is cut anew, the tokens are kept
    assert first.built and not again.built
    assert again.cache == first.cache and os.stat(tokens).st_mtime_ns == made
    changed = data / "d005.md"
    changed.write_text(changed.read_text() + " more words")
    third = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False)
    assert third.built and third.cache != first.cache
    assert third.tokens("train") + third.tokens("val") > first.tokens("train") + \
        first.tokens("val")
    entries = [p for p in (tmp_path / "cache").iterdir()]
    assert len(entries) == 2  # no temporary folder is left behind


def test_cache_root_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root(None) == tmp_path / "zeroshard" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(cache_root(None)).endswith(os.path.join(".cache", "zeroshard", "tokens"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs, model_dir):
    root = tmp_path_factory.mktemp("corpus")
    info = prepare_corpus(_text_folder(root / "data", docs), model_dir,
                          cache_dir=root / "cache", progress=False)
    return open_corpus(info, 16)


def test_rank_parts_concatenate_to_the_global_batch(corpus):
    rows = 8
    for step in (0, 1, 7, corpus.sequences("train") // rows + 3):  # the last wraps epochs
        whole_x, whole_y = corpus.batch("train", 5, step, rows, 16)
        assert whole_x.shape == (8, 16) and whole_x.dtype == whole_y.dtype == torch.int64
        assert (whole_x[:, 1:] == whole_y[:, :-1]).all()
        for n in (2, 4):
            parts = [corpus.batch("train", 5, step, rows, 16,
                                  part=slice(r * rows // n, (r + 1) * rows // n))
                     for r in range(n)]
            assert [tuple(p[0].shape) for p in parts] == [(rows // n, 16)] * n
            assert (np.concatenate([p[0] for p in parts]) == whole_x.numpy()).all()
            assert (np.concatenate([p[1] for p in parts]) == whole_y.numpy()).all()


def test_an_epoch_covers_every_window_once(corpus):
    windows, rows = corpus.sequences("train"), 6
    steps = -(-2 * windows // rows)  # two epochs; a step straddles them unless rows | W
    seen = np.concatenate([corpus.windows("train", 3, s, rows) for s in range(steps)])
    for epoch in (seen[:windows], seen[windows:2 * windows]):
        assert sorted(epoch.tolist()) == list(range(windows))
    assert seen[:windows].tolist() != list(range(windows))  # shuffled
    assert seen[:windows].tolist() != seen[windows:2 * windows].tolist()  # anew each epoch
    other = np.concatenate([corpus.windows("train", 4, s, rows) for s in range(steps)])
    assert other[:windows].tolist() != seen[:windows].tolist()  # the seed reorders
    stream = _stream(corpus.info, "train")
    x, y = corpus.batch("train", 3, 2, rows, 16)
    for row, w in enumerate(corpus.windows("train", 3, 2, rows).tolist()):
        assert x[row].tolist() == stream[w * 16:w * 16 + 16].tolist()
        assert y[row].tolist() == stream[w * 16 + 1:w * 16 + 17].tolist()


def test_validation_batches_are_fixed(corpus):
    a, _ = corpus.batch("val", 1, 4, 8, 16)
    b, _ = corpus.batch("val", 1, 4, 8, 16)
    c, _ = corpus.batch("val", 1, 5, 8, 16)
    assert (a == b).all() and not (a == c).all()
    assert corpus.sequences("val") == (corpus.tokens("val") - 1) // 16


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 65, 1000, 4099])
def test_permutation_is_a_bijection(n):
    out = permute(np.arange(n), n, 9, 0, "train")
    assert sorted(out.tolist()) == list(range(n))


def test_token_files(tmp_path, model_dir):
    ids = np.random.default_rng(0).integers(0, 399, 5000).astype(np.uint16)
    ids[::50] = 0  # the tokenizer's EOS id: boundaries every 50 tokens
    ids.tofile(tmp_path / "all.bin")
    info = prepare_corpus(tmp_path / "all.bin", model_dir, cache_dir=tmp_path / "c",
                          progress=False, val_fraction=0.1)
    assert info.train[0].path == str((tmp_path / "all.bin").resolve())  # mapped, not copied
    assert info.tokens("train") == 4501 and info.tokens("val") == 499  # cut after an EOS
    folder = tmp_path / "nano"
    folder.mkdir()
    ids[:4000].tofile(folder / "train.bin")
    ids[4000:].tofile(folder / "val.bin")
    (folder / "meta.pkl").write_bytes(b"\x80\x04\x95\0\0")
    (folder / "README.md").write_text("text beside nanoGPT's files is not read")
    info = prepare_corpus(folder, model_dir, cache_dir=tmp_path / "c", progress=False)
    assert (info.tokens("train"), info.tokens("val")) == (4000, 1000)
    corpus = open_corpus(info, 32)
    x, _ = corpus.batch("val", 0, 0, 4, 32)
    assert set(x.flatten().tolist()) <= set(ids[4000:].tolist())
    wide = (np.arange(3000, dtype=np.uint32) * 37)  # ids up to 110,963: uint32
    wide.tofile(tmp_path / "wide.bin")
    info = prepare_corpus(tmp_path / "wide.bin", None, vocab_size=120_000, progress=False,
                          cache_dir=tmp_path / "c")
    assert info.train[0].dtype == "uint32" and _stream(info).tolist() == wide[:2850].tolist()


def _fails(match: str, path, model_dir, tmp_path, **kw):
    kw.setdefault("cache_dir", tmp_path / "c")
    with pytest.raises(DataError, match=match) as err:
        prepare_corpus(path, model_dir, progress=False, **kw)
    assert "\n" not in str(err.value)


def test_bad_inputs_each_give_one_line(tmp_path, model_dir):
    _fails(r"data path '.*nope' does not exist; give a file or a folder",
           tmp_path / "nope", model_dir, tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.png").write_bytes(b"\x89PNG\0")
    _fails(r"has no usable files \(skipped as not text: a.png\); it needs text files",
           tmp_path / "bin", model_dir, tmp_path)
    (tmp_path / "empty.txt").write_text("")
    _fails(r"holds no text", tmp_path / "empty.txt", model_dir, tmp_path)
    (tmp_path / "short.txt").write_text("the quick brown fox " * 20)
    _fails(r"the train split of '.*short.txt' has 78 tokens, fewer than seq_len \+ 1 = 257",
           tmp_path / "short.txt", model_dir, tmp_path, seq_len=256)
    (tmp_path / "one.txt").write_text("the quick brown fox " * 500)  # one document
    _fails(r"the val split of '.*one.txt' has 100 tokens, fewer than seq_len \+ 1 = 257",
           tmp_path / "one.txt", model_dir, tmp_path, seq_len=256)
    j = tmp_path / "a.jsonl"
    j.write_text('{"text": "fine"}\n{"body": "x", "id": 3}\n')
    _fails(r"a.jsonl:2 has no field 'text' \(fields: body, id\)", j, model_dir, tmp_path)
    j.write_text('{"text": "fine"}\n\n{"text": "x",\n')
    _fails(r"a.jsonl:3 is not JSON \(.*\); a JSON-lines file holds one JSON object per line",
           j, model_dir, tmp_path)
    j.write_text('{"text": ["a"]}\n')
    _fails(r"a.jsonl:1: field 'text' is a list, not a string", j, model_dir, tmp_path)
    big = np.array([1, 2, 70000, 3], dtype=np.uint32)
    big.tofile(tmp_path / "big.bin")
    _fails(r"token file '.*big.bin' holds id 70,000, outside the vocabulary of 400 ",
           tmp_path / "big.bin", model_dir, tmp_path, token_dtype="uint32")
    (np.arange(1, 200, dtype=np.uint32) % 400).tofile(tmp_path / "wide.bin")  # fits uint16
    _fails(r"token file '.*wide.bin' reads as uint16 ids with every second one 0: it holds "
           r"uint32 ids", tmp_path / "wide.bin", model_dir, tmp_path)
    (tmp_path / "odd.bin").write_bytes(b"\1\0\2")
    _fails(r"token file '.*odd.bin' has 3 bytes, not a multiple of 2: the ids of this "
           r"model's vocabulary are read as uint16 \(uint16 up to 65,536 ids, else uint32\)",
           tmp_path / "odd.bin", model_dir, tmp_path)
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    _fails(r"tokenizer directory '.*notok' has no tokenizer", tmp_path / "short.txt",
           tmp_path / "notok", tmp_path)
    (tmp_path / "bin" / "stray.bin").write_bytes(b"\1\0")
    (tmp_path / "bin" / "notes.txt").write_text("notes")
    _fails(r"data folder '.*bin' mixes token files \(.bin\) with text or JSON lines",
           tmp_path / "bin", model_dir, tmp_path)
    _fails(r"data path '.*short.txt' needs a tokenizer directory to tokenize its text",
           tmp_path / "short.txt", None, tmp_path)
    for bad in (0, 0.6, -0.1):
        _fails(rf"val_fraction={bad} is outside \(0, 0.5\]", tmp_path / "short.txt",
               model_dir, tmp_path, val_fraction=bad)
    _fails(r"token_dtype='int8' is not a token file dtype; accepted: uint16, uint32",
           tmp_path / "odd.bin", model_dir, tmp_path, token_dtype="int8")


def test_boundary_is_eos_else_bos_else_refused(tmp_path, docs):
    tok = _bpe(docs[:20])
    (tmp_path / "a.txt").write_text(docs[0] * 30)
    bos = _save(tok, tmp_path / "bos", bos_token="<eos>")
    assert prepare_corpus(tmp_path / "a.txt", bos, cache_dir=tmp_path / "c",
                          progress=False).eos_id == 0
    _fails(r"the tokenizer in '.*none' has neither an EOS nor a BOS token", tmp_path / "a.txt",
           _save(tok, tmp_path / "none"), tmp_path)


def test_vocabulary_and_dtype_checks(tmp_path, model_dir):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps " * 200)
    _fails(r"the tokenizer gives id \d+, outside the model's vocabulary of 100;",
           tmp_path / "a.txt", model_dir, tmp_path, vocab_size=100)
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    _fails(r"token_dtype='uint16' cannot hold a vocabulary of 70,000 ids", tmp_path / "t.bin",
           None, tmp_path, token_dtype="uint16", vocab_size=70_000)
    j = tmp_path / "list.json"
    j.write_text('[{"text": "a"}]\n')
    _fails(r"list.json:1 is a JSON list, not an object; each line holds an object with the "
           r"text in 'text'", j, model_dir, tmp_path)


def test_prepared_corpus_travels_as_json_and_damaged_cache_is_rebuilt(tmp_path, docs,
                                                                       model_dir):
    import pickle
    data = _text_folder(tmp_path / "data", docs[:30])
    info = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False)
    assert PreparedCorpus.from_json(info.to_json()) == info == pickle.loads(pickle.dumps(info))
    assert len(info.to_json()) < 1000
    with open(os.path.join(info.cache, "tokens.bin"), "r+b") as f:
        f.truncate(10)
    again = prepare_corpus(data, model_dir, cache_dir=tmp_path / "cache", progress=False)
    assert again.built and again == PreparedCorpus(**{**vars(info), "built": True})


def test_few_large_documents_and_several_token_files(tmp_path, docs, model_dir):
    data = tmp_path / "two"
    data.mkdir()
    (data / "a.txt").write_text("".join(docs[:3]))
    (data / "b.txt").write_text("".join(docs))  # the cut's target falls inside b
    info = prepare_corpus(data, model_dir, cache_dir=tmp_path / "c", progress=False)
    total = info.tokens("train") + info.tokens("val")
    assert info.tokens("val") == total - round(total * 0.95)  # cut at the token
    files = tmp_path / "bins"
    files.mkdir()
    np.arange(9500, dtype=np.uint16).tofile(files / "a.bin")
    np.arange(500, dtype=np.uint16).tofile(files / "b.bin")
    info = prepare_corpus(files, None, vocab_size=9500, cache_dir=tmp_path / "c",
                          progress=False)
    assert [(s.path[-5:], s.start, s.stop) for s in info.train + info.val] == \
        [("a.bin", 0, 9500), ("b.bin", 0, 500)]  # the join between files is a boundary
    np.arange(4000, dtype=np.uint16).tofile(files / "b.bin")
    info = prepare_corpus(files, None, vocab_size=9500, cache_dir=tmp_path / "c",
                          progress=False, val_fraction=0.1)  # the join is too far: cut in b
    assert [(s.path[-5:], s.start, s.stop) for s in info.train + info.val] == \
        [("a.bin", 0, 9500), ("b.bin", 0, 2650), ("b.bin", 2650, 4000)]
    corpus = open_corpus(info, 100)
    assert corpus.sequences("train") == 94 + 26 and corpus.sequences("val") == 13
    seen = np.concatenate([corpus.batch("train", 0, s, 60, 100)[0] for s in range(2)])
    starts = sorted(row[0] for row in seen.tolist())  # ids are positions in each file
    assert starts == sorted(list(range(0, 9400, 100)) + list(range(0, 2600, 100)))
