"""Tasks: exact token layouts, padding, determinism, and the text corpus split."""

import pytest
import torch

from nopelens.models.tasks import (
    BOS_ID,
    EOS_ID,
    SEP_ID,
    TASKS,
    Batch,
    TextTask,
    default_documents,
    file_documents,
    is_validation_document,
    make_task,
)

SYNTHETIC = [
    "copy",
    "repeat",
    "repeat_twice",
    "replace",
    "reverse",
    "previous_token",
    "addition",
    "parity",
    "bigram_backcopy",
]


def rows(batch: Batch):
    """(real tokens, scored targets) per row."""
    out = []
    for b in range(len(batch)):
        real = batch.attention_mask[b].bool()
        out.append((batch.tokens[b][real].tolist(), batch.targets[b][batch.loss_mask[b]].tolist()))
    return out


@pytest.mark.parametrize("name", SYNTHETIC)
def test_batch_shapes_padding_and_bos(name):
    task = make_task(name)
    batch = task.sample(32, 1, 6, seed=0)
    assert batch.tokens.dtype == torch.long and batch.attention_mask.dtype == torch.long
    assert batch.loss_mask.dtype == torch.bool and batch.tokens.shape == batch.loss_mask.shape
    assert (batch.tokens[:, 0] == task.bos_id).all()
    lengths_in_tokens = batch.attention_mask.sum(-1)
    expected = torch.tensor([task.seq_len(int(n)) for n in batch.lengths])
    assert torch.equal(lengths_in_tokens, expected)
    # right padding: ones then zeros, pad tokens exactly where the mask is 0, never scored
    assert (batch.attention_mask.diff(dim=-1) <= 0).all()
    assert ((batch.tokens == task.pad_id) == (batch.attention_mask == 0)).all()
    assert not (batch.loss_mask & (batch.attention_mask == 0)).any()
    assert int(batch.tokens.max()) < task.d_vocab
    assert set(batch.lengths.tolist()) <= set(range(1, 7))


@pytest.mark.parametrize("name", SYNTHETIC)
def test_same_seed_same_batch_other_seed_differs(name):
    task = make_task(name)
    a, b, c = task.sample(16, 2, 5, 7), task.sample(16, 2, 5, 7), task.sample(16, 2, 5, 8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
    assert not (a.tokens.shape == c.tokens.shape and torch.equal(a.tokens, c.tokens))
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(task.sample(16, 2, 5, generator).tokens, a.tokens)


def test_copy_layout():
    for tokens, answer in rows(make_task("copy", n_symbols=5).sample(20, 1, 6, 3)):
        n = (len(tokens) - 3) // 2
        xs = tokens[1 : 1 + n]
        assert tokens == [BOS_ID] + xs + [SEP_ID] + xs + [EOS_ID]
        assert answer == xs + [EOS_ID]
        assert all(4 <= x < 9 for x in xs)


def test_repeat_layout_is_one_symbol():
    for tokens, answer in rows(make_task("repeat").sample(20, 1, 6, 3)):
        n = (len(tokens) - 3) // 2
        assert len(set(tokens[1 : 1 + n])) == 1
        assert tokens == [BOS_ID] + [tokens[1]] * n + [SEP_ID] + [tokens[1]] * n + [EOS_ID]
        assert answer == [tokens[1]] * n + [EOS_ID]


def test_repeat_twice_layout():
    """Kazemnejad et al.'s rsc2x: one symbol n times, answered 2n times."""
    for tokens, answer in rows(make_task("repeat_twice").sample(20, 1, 6, 3)):
        n = (len(tokens) - 3) // 3
        assert tokens == [BOS_ID] + [tokens[1]] * n + [SEP_ID] + [tokens[1]] * (2 * n) + [EOS_ID]
        assert answer == [tokens[1]] * (2 * n) + [EOS_ID]


def test_replace_layout():
    """Kazemnejad et al.'s rdc: "replace a with b in a .. a", answered b .. b, a != b."""
    seen = set()
    for tokens, answer in rows(make_task("replace", n_symbols=3).sample(40, 1, 6, 3)):
        n = (len(tokens) - 5) // 2
        a, b = tokens[1], tokens[2]
        assert a != b and tokens == [BOS_ID, a, b] + [a] * n + [SEP_ID] + [b] * n + [EOS_ID]
        assert answer == [b] * n + [EOS_ID]
        seen.add((a, b))
    assert len(seen) == 6  # every ordered pair of 3 symbols
    with pytest.raises(ValueError, match="two different symbols"):
        make_task("replace", n_symbols=1)


def test_reverse_layout():
    for tokens, answer in rows(make_task("reverse").sample(20, 1, 6, 3)):
        n = (len(tokens) - 3) // 2
        xs = tokens[1 : 1 + n]
        assert answer == xs[::-1] + [EOS_ID]


def test_previous_token_targets_are_the_token_before():
    batch = make_task("previous_token").sample(8, 3, 9, 0)
    for b in range(8):
        for p in range(1, int(batch.attention_mask[b].sum())):
            assert batch.loss_mask[b, p]
            assert batch.targets[b, p] == batch.tokens[b, p - 1]
        assert not batch.loss_mask[b, 0]


def _number(ids):
    return int("".join(str(i - 5) for i in ids))


def test_addition_answer_is_the_reversed_sum():
    task = make_task("addition")
    for tokens, answer in rows(task.sample(50, 1, 7, 11)):
        n = (len(tokens) - 5) // 3
        a, b = _number(tokens[1 : 1 + n]), _number(tokens[2 + n : 2 + 2 * n])
        assert tokens[1 + n] == task.PLUS_ID and tokens[2 + 2 * n] == SEP_ID
        assert answer[-1] == EOS_ID and len(answer) == n + 2
        assert _number(answer[:-1][::-1]) == a + b


def test_addition_beyond_int64():
    tokens, answer = rows(make_task("addition").sample(1, 25, 25, 0))[0]
    a, b = _number(tokens[1:26]), _number(tokens[27:52])
    assert _number(answer[:-1][::-1]) == a + b


def test_parity_answer():
    for tokens, answer in rows(make_task("parity").sample(50, 1, 9, 5)):
        bits = [t - 4 for t in tokens[1:-3]]
        assert answer == [4 + sum(bits) % 2, EOS_ID]


@pytest.mark.parametrize(
    "args, error",
    [((0, 1, 2), ValueError), ((4, 0, 2), ValueError), ((4, 3, 2), ValueError), ((4, 1.5, 2), TypeError)],
)
def test_bad_sizes_are_refused(args, error):
    with pytest.raises(error):
        make_task("copy").sample(*args, seed=0)


def test_bad_seed_type():
    with pytest.raises(TypeError, match="seed"):
        make_task("copy").sample(2, 1, 2, seed="zero")


def test_registry_and_unknown_names():
    assert set(TASKS) == set(SYNTHETIC) | {"text"}
    with pytest.raises(KeyError, match="available"):
        make_task("sorting")
    with pytest.raises(TypeError, match="copy"):
        make_task("copy", width=3)
    task = make_task("copy", n_symbols=7)
    assert make_task(task.name, **task.kwargs).d_vocab == task.d_vocab == 11


def test_bigram_backcopy_layout_and_floor():
    """Guo et al. 2024's BB task: after a trigger the next token is the one before the trigger; after any
    other symbol it follows the bigram chain, so the floor of the loss is 0 after triggers and the
    chain's surprisal elsewhere."""
    task = make_task("bigram_backcopy", n_symbols=16, n_triggers=2)
    assert task.d_vocab == 20 and task.trigger_ids == [4, 5] and task.symbols[:1] == b" "
    batch = task.sample(64, 40, 40, 0)
    tokens, trigger = batch.tokens, task.is_trigger(batch.tokens)
    assert not trigger[:, :2].any()  # x_1 is drawn without triggers
    copies = trigger[:, 1:-1]
    assert copies.any() and torch.equal(tokens[:, 2:][copies], tokens[:, :-2][copies])
    assert torch.equal(batch.targets[:, :-1], tokens[:, 1:]) and batch.loss_mask[:, :-1].all()
    floor = task.oracle_nats(batch)
    assert (floor[trigger & batch.loss_mask] == 0).all() and (floor[~trigger & batch.loss_mask] > 0).all()
    # the non-trigger transitions follow the corpus's bigram rows: empirical frequencies match P
    big = task.sample(2000, 40, 40, 1)
    current, following = big.tokens[:, 1:-1] - 4, big.tokens[:, 2:] - 4
    plain = ~task.is_trigger(big.tokens[:, 1:-1])
    row = int(torch.mode(current[plain]).values)
    seen = torch.bincount(following[plain & (current == row)], minlength=16).double()
    assert torch.allclose(seen / seen.sum(), task.transition[row], atol=0.02)


def test_bigram_backcopy_bad_sizes():
    with pytest.raises(ValueError, match="n_triggers"):
        make_task("bigram_backcopy", n_symbols=4, n_triggers=4)
    with pytest.raises(ValueError, match="n_symbols"):
        make_task("bigram_backcopy", n_symbols=1)


# ----------------------------------------------------------------------------------------- text
@pytest.fixture(scope="module")
def text_task():
    return TextTask()


def test_default_corpus_split_by_document(text_task):
    documents = default_documents()
    validation = [k for k in documents if is_validation_document(k)]
    assert 0 < len(validation) < len(documents)
    assert text_task.documents == {"train": len(documents) - len(validation), "validation": len(validation)}
    held_out = documents[validation[0]].encode("utf-8")
    train_bytes = bytes(text_task.streams["train"].to(torch.uint8).tolist())
    valid_bytes = bytes(text_task.streams["validation"].to(torch.uint8).tolist())
    assert held_out in valid_bytes and held_out not in train_bytes
    # the split is a function of the document key only: the same on every construction
    assert torch.equal(TextTask().streams["validation"], text_task.streams["validation"])


def test_text_windows_are_corpus_bytes(text_task):
    batch = text_task.sample(4, 20, 30, 0)
    stream = bytes(text_task.streams["train"].to(torch.uint8).tolist())
    for b in range(4):
        real = batch.tokens[b][batch.attention_mask[b].bool()].tolist()
        assert real[0] == text_task.bos_id == 256
        assert bytes(real[1:]) in stream
        assert batch.loss_mask[b].sum() == len(real) - 1
    windows = text_task.windows(64, "validation", max_windows=3)
    assert windows.tokens.shape == (3, 65)
    flat = windows.targets[:, :-1].reshape(-1)
    assert torch.equal(flat, text_task.streams["validation"][: 3 * 64])
    with pytest.raises(ValueError, match="split"):
        text_task.sample(2, 5, 6, 0, split="test")


def test_unseen_split_is_the_validation_documents_that_share_no_64_byte_string_with_training(text_task):
    documents = default_documents()
    train = bytes(text_task.streams["train"].to(torch.uint8).tolist())
    stream = bytes(text_task.windows(64, "unseen", max_windows=1).tokens[0, 1:].tolist())
    unseen = bytes(text_task.streams["unseen"].to(torch.uint8).tolist())
    assert stream == unseen[:64] and text_task.documents["unseen"] == 3  # of 11: the help topics copy each other
    for key, text in documents.items():
        data = text.encode("utf-8")
        shares = any(data[i : i + 64] in train for i in range(0, len(data) - 63, 7))
        if is_validation_document(key) and data in unseen:
            assert not any(data[i : i + 64] in train for i in range(len(data) - 63)), key
        elif is_validation_document(key):
            assert shares, f"{key} is left out of the unseen split but shares no 64-byte string"
    assert text_task.bytes_per_character("unseen") >= 1


def test_a_corpus_whose_validation_is_copied_from_training_has_no_unseen_split(tmp_path):
    path = tmp_path / "copies.txt"
    path.write_text("\n\n".join(["the same paragraph, long enough to hold a 64-byte string " * 2] * 60))
    task = make_task("text", path=str(path))
    with pytest.raises(ValueError, match="none of the .* validation documents is unseen"):
        task.windows(16, "unseen")


def test_a_document_shorter_than_the_span_is_unseen_only_when_training_does_not_hold_it_whole(tmp_path):
    copies = tmp_path / "copies.txt"
    copies.write_text("\n\n".join(["hello world"] * 40))
    with pytest.raises(ValueError, match="is unseen"):
        make_task("text", path=str(copies)).windows(4, "unseen")
    novel = tmp_path / "novel.txt"
    novel.write_text("\n\n".join(f"doc {i} zq{i}x" for i in range(60)))
    task = make_task("text", path=str(novel))
    assert len(task.windows(4, "unseen").tokens) >= 1 and task.documents["unseen"] == task.documents["validation"]
    for bad in (0, -5, 16.5, True):
        with pytest.raises(ValueError, match="whole number of bytes"):
            task.windows(bad)


def test_user_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"paragraph number {i}: caf\u00e9" for i in range(60)), encoding="utf-8")
    task = make_task("text", path=str(path))
    assert task.kwargs["path"] == str(path)
    assert sum(task.documents.values()) == 60 and task.documents["validation"] > 0
    assert task.bytes_per_character("train") > 1.0  # the e-acute takes two UTF-8 bytes
    assert len(file_documents(path)) == 60


def test_user_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        make_task("text", path=str(tmp_path / "missing.txt"))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9\n\nna\u00efve".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        make_task("text", path=str(latin))
    single = tmp_path / "single.txt"
    single.write_text("only one paragraph\nwith two lines", encoding="utf-8")
    with pytest.raises(ValueError, match="at least 2"):
        make_task("text", path=str(single))


def test_python_docs_is_the_help_topics_and_the_standard_librarys_docstrings():
    import json
    import sysconfig

    from nopelens.models.text import MIN_DOCSTRING, python_docs_documents

    documents = python_docs_documents()
    topics = {k: v for k, v in documents.items() if k.startswith("topic:")}
    assert topics == {f"topic:{k}": v for k, v in default_documents().items()}
    assert documents["json:"] == json.__doc__.strip()  # a module's own docstring, cleaned
    assert documents["json.decoder:JSONDecoder.decode"].startswith("Return the Python representation of ``s``")
    docstrings = [v for k, v in documents.items() if not k.startswith("topic:")]
    assert len(set(docstrings)) == len(docstrings) and min(map(len, docstrings)) >= MIN_DOCSTRING
    assert not any(k.split(":")[0].split(".")[0] in {"torch", "numpy", "pandas", "site-packages"} for k in documents)
    assert "site-packages" not in sysconfig.get_paths()["stdlib"]
    assert sum(len(v.encode()) for v in documents.values()) > 4 * sum(len(v.encode()) for v in topics.values())


def test_the_built_in_corpus_is_a_setting_of_the_task_that_rebuilds_it():
    task = make_task("text", corpus="python_docs")
    assert task.kwargs == {"path": None, "validation_fraction": 0.1, "corpus": "python_docs"}
    assert task.corpus_name == "CPython's help topics and standard-library docstrings"
    assert torch.equal(make_task("text", **task.kwargs).streams["validation"], task.streams["validation"])
    assert "corpus" not in TextTask().kwargs and TextTask().corpus_name == "CPython's help topics"
    assert task.documents["validation"] > 10 * TextTask().documents["validation"]
    with pytest.raises(ValueError, match="corpus must be one of 'help', 'python_docs'"):
        TextTask(corpus="wiki")
    with pytest.raises(ValueError, match="not both"):
        TextTask(path="some.txt", corpus="python_docs")
