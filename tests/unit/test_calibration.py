import hashlib

import pytest

import calibration
from factory.errors import SpecError


@pytest.mark.parametrize("name", calibration.BUILTIN)
def test_builtin_texts(name):
    text = calibration.resolve(f"builtin:{name}")
    assert len(text.text) > 100_000
    assert text.sha256 == hashlib.sha256(text.text.encode()).hexdigest()


@pytest.mark.parametrize("name", ["c4", "builtin:pile", "wiki:builtin", "file:", "hf:wikitext"])
def test_unknown_names(name):
    with pytest.raises(SpecError, match="unknown text set .* use one of builtin:c4, builtin:code"):
        calibration.resolve(name)


def test_file_text(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("hello world\n" * 10)
    text = calibration.resolve(f"file:{path}")
    assert text.name == f"file:{path}" and text.text.startswith("hello")
    with pytest.raises(SpecError, match="no such file"):
        calibration.resolve(f"file:{tmp_path / 'missing.txt'}")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(SpecError, match=r"is not a \.txt, \.jsonl or \.parquet file"):
        calibration.resolve(f"file:{tmp_path / 'data.csv'}")


def test_token_windows_deterministic_and_spread():
    ids = list(range(1000))
    windows = calibration.token_windows(ids, 4, 100, "x")
    assert windows == calibration.token_windows(ids, 4, 100, "x")
    assert [w[0] for w in windows] == [0, 300, 600, 900]
    assert all(len(w) == 100 for w in windows)


def test_token_windows_too_short():
    with pytest.raises(SpecError) as e:
        calibration.token_windows(list(range(100)), 16, 128, "file:small.txt")
    assert e.value.message == (
        "text set 'file:small.txt' has 100 tokens, fewer than the 16 x 128 = 2048 requested; "
        "ask for fewer rows or shorter rows, or use a longer text"
    )


def test_jsonl_and_parquet_hash_like_the_same_text(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = ["first record", "second record", "third"]
    (tmp_path / "t.txt").write_text("\n\n".join(records))
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"text": r, "id": i}) for i, r in enumerate(records)))
    pq.write_table(pa.table({"text": records, "id": [1, 2, 3]}), tmp_path / "t.parquet")
    hashes = {calibration.resolve(f"file:{tmp_path / f't.{ext}'}").sha256 for ext in ("txt", "jsonl", "parquet")}
    assert len(hashes) == 1


def test_jsonl_and_parquet_without_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(SpecError, match="line 2 of .* is not a JSON object with a 'text' field"):
        calibration.resolve(f"file:{tmp_path / 'bad.jsonl'}")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(SpecError, match="has no 'text' column; its columns: body"):
        calibration.resolve(f"file:{tmp_path / 'bad.parquet'}")


def test_available_lists_builtins_and_home_texts(tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "notes.md").write_text("ignored")
    names = [t.name for t in calibration.available(tmp_path)]
    assert names == [f"builtin:{b}" for b in calibration.BUILTIN] + [f"file:{tmp_path / 'mine.jsonl'}"]


def test_token_ids_are_kept_once_tokenized(tiny, tmp_path, monkeypatch):
    """A text's ids under a source's tokenizer are read from the cache file the second time (a job's publishing
    pass, a helper, a retry); a cut-short file is tokenized again."""
    from factory.evaluation import evaluate

    text = calibration.resolve("builtin:wiki").text
    cache = tmp_path / "tokens" / "key.npy"
    ids = evaluate.cached_tokens(tiny, text, cache)
    assert ids == evaluate.tokenize(tiny, text) and len(ids) > 100_000 and cache.is_file()

    def no_tokenizing(*_):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:
        m.setattr(evaluate, "tokenize", no_tokenizing)
        assert evaluate.cached_tokens(tiny, text, cache) == ids
    for cut in (1000, 0):  # cut short, or empty (renamed before it reached the disk, then a crash)
        cache.write_bytes(cache.read_bytes()[:cut])
        assert evaluate.cached_tokens(tiny, text, cache) == ids
    assert not list(cache.parent.glob("*.tmp"))


def test_the_first_ids_read_from_a_prefix_are_the_whole_texts(tiny):
    """An eval needs the first windows' ids only (factory/evaluation/evaluate.py tokenize): read from a prefix of the
    text, they are the whole text's first ids, for every builtin text (SmolLM2's tokenizer:
    tests/integration/test_smollm2.py)."""
    from factory.evaluation import evaluate

    for name in calibration.BUILTIN:
        text = calibration.resolve(f"builtin:{name}").text
        whole = evaluate.tokenize(tiny, text)
        for first in (1, 2048, 16384, len(whole) + 5):
            assert evaluate.tokenize(tiny, text, first) == whole[:first], (name, first)


def test_the_token_cache_key_changes_with_the_libraries_that_tokenize():
    """Ids are cached per source, text and what reads the tokenizer's files: another transformers or tokenizers
    (or another way `tokenize` calls them) is another key, so an upgraded host does not read stale ids."""
    from importlib.metadata import version

    from factory import identity
    from factory.evaluation import evaluate

    here = evaluate.tokenizer_version()
    assert version("transformers") in here and version("tokenizers") in here
    assert identity.tokens_key("sha256:a", "t", here) != identity.tokens_key("sha256:a", "t", here + "'")
