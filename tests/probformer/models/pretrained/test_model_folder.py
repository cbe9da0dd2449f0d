"""One model folder: a run's ``model/``, a training checkpoint, a torch export and the run
folder itself are read by every entry point (``probformer.from_pretrained``,
``probformer.load``, ``probformer evaluate``, ``diagnose`` and ``export``), each giving
the logits of the model that was saved. A failed save leaves its parent exactly as it
was; an import failure while building a model is reported as one, naming the module."""

import errno
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probformer as pf
from probformer import cli
from probformer.models import pretrained, registry
from probformer.training import checkpoint, data, run_checkpoints

KINDS = ("run", "model", "checkpoint", "export")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The four folder kinds, each holding the same model (and vocabulary)."""
    root = tmp_path_factory.mktemp("folders")
    sentences = data.ptb_sentences("valid")[:30]
    (root / "text.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n")
    vocabulary = data.Vocabulary.build(sentences)
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(
        pf.PTConfig(vocab_size=len(vocabulary), labels=6, channels=2, rank=2, iterations=2)
    ).eval()
    run = root / "run"
    run.mkdir()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_checkpoints.save_training_checkpoint(run, 2, model, optimizer, vocabulary, {"step": 2})
    run_checkpoints.save_model_folder(run, model, vocabulary, None)
    pf.export(model, root / "export", vocabulary=vocabulary)
    paths = {
        "run": run,
        "model": run / "model",
        "checkpoint": run_checkpoints.latest_checkpoint(run),
        "export": root / "export",
    }
    return {"paths": paths, "model": model, "vocabulary": vocabulary, "text": root / "text.txt", "root": root}


def logits(model, vocab_size):
    tokens = torch.arange(12).reshape(2, 6) % vocab_size
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        out = model(tokens, mask)
    return (out[0] if isinstance(out, tuple) else out)[mask]


def test_a_checkpoint_keeps_its_training_state_beside_the_model_files(folders):
    names = {p.name for p in folders["paths"]["checkpoint"].iterdir()}
    assert {"config.json", "model.safetensors", "vocabulary.json"} <= names
    assert {"training.json", "training.safetensors"} <= names
    records = [json.loads((folders["paths"][k] / "config.json").read_text()) for k in ("model", "checkpoint", "export")]
    assert {r["format"] for r in records} == {pretrained.TORCH_FORMAT}  # one format


@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_and_load_read_every_folder_kind(folders, kind):
    expected = logits(folders["model"], len(folders["vocabulary"]))
    path = folders["paths"][kind]
    assert torch.equal(logits(pf.from_pretrained(path), len(folders["vocabulary"])), expected)
    assert torch.equal(logits(pf.load(path), len(folders["vocabulary"])), expected)
    loaded, vocabulary = checkpoint.load(path)
    assert vocabulary.words == folders["vocabulary"].words
    assert torch.equal(logits(loaded.eval(), len(vocabulary)), expected)


def run_cli(argv, folder, capsys, monkeypatch):
    monkeypatch.chdir(folder)
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_every_cli_verb_reads_every_folder_kind(folders, kind, tmp_path, capsys, monkeypatch):
    path, text = folders["paths"][kind], folders["text"]
    table = run_cli(["evaluate", path, "--task", "mlm", "--data", text], tmp_path, capsys, monkeypatch)
    reference_argv = ["evaluate", folders["paths"]["model"], "--task", "mlm", "--data", text]
    reference = run_cli(reference_argv, tmp_path, capsys, monkeypatch)
    assert "perplexity" in table and table == reference  # the same model, whichever folder it is read from
    run_cli(["diagnose", path, "--data", text, "--sentences", "3", "--out", "diagnosis"], tmp_path, capsys, monkeypatch)
    assert (tmp_path / "diagnosis" / "report.nc").is_file()
    run_cli(["export", path, "--out", "exported"], tmp_path, capsys, monkeypatch)
    expected = logits(folders["model"], len(folders["vocabulary"]))
    assert torch.equal(logits(pf.load(tmp_path / "exported"), len(folders["vocabulary"])), expected)


def test_a_run_folder_with_no_model_yet_is_named(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no model yet"):
        pf.from_pretrained(tmp_path)


def test_a_model_folder_written_by_an_earlier_version_still_reads(folders, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for file in folders["paths"]["model"].iterdir():
        (old / file.name).write_bytes(file.read_bytes())
    record = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**record, "format": "probformer-checkpoint/1"}))
    expected = logits(folders["model"], len(folders["vocabulary"]))
    assert torch.equal(logits(pf.from_pretrained(old), len(folders["vocabulary"])), expected)


def test_training_files_are_the_only_extras_a_model_folder_takes(folders, tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    for file in folders["paths"]["checkpoint"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    pf.load(folder)
    (folder / "optimizer.pt").write_bytes(b"\x80\x04")  # a pickle beside the model: refused, never read
    with pytest.raises(ValueError, match="unexpected 'optimizer.pt'"):
        pf.load(folder)


# ---- a subword folder reads with the tokenizer it was trained with ------------------------------


def subword_vocabulary(words: list[str]):
    lines = [" ".join(words[i : i + 5]) for i in range(0, len(words), 3)]
    return data.SubwordVocabulary.train(lines, 60)


@pytest.fixture(scope="module")
def subword(tmp_path_factory):
    """A subword model's folder (checkpoint.save) and its torch export; and a tokenizer of
    another text with as many pieces."""
    root = tmp_path_factory.mktemp("subword")
    vocabulary = subword_vocabulary("the quick brown fox jumps over the lazy dog and then the fox sleeps".split())
    other = subword_vocabulary("the lazy dog jumps over the quick brown fox and then the dog sleeps".split())
    assert len(other) == len(vocabulary) and other.words != vocabulary.words
    torch.manual_seed(0)
    config = {"vocab_size": len(vocabulary), "width": 8, "heads": 2, "layers": 1, "ffn_width": 8}
    model = registry.build("transformer", config).eval()
    folder = checkpoint.save(model, root / "model", vocabulary)
    other.save(root / "other-tokenizer.json")
    return {"folder": folder, "export": pf.export(folder, root / "export"), "other": root / "other-tokenizer.json"}


def copy_folder(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def test_every_subword_folder_kind_reads_with_its_tokenizer(subword):
    for folder in (subword["folder"], subword["export"]):
        model, vocabulary = checkpoint.load(folder)
        assert isinstance(vocabulary, data.SubwordVocabulary) and len(vocabulary) == model.config.vocab_size
        pf.load(folder)


@settings(max_examples=40, deadline=None)
@given(first=st.integers(0, 10**6), second=st.integers(0, 10**6))
def test_vocabulary_json_must_be_the_tokenizers_pieces(subword, tmp_path_factory, first, second):
    """Oracle: two ids of vocabulary.json exchanged: the folder reads exactly when the list is
    unchanged (the same id twice); otherwise every reader refuses it naming tokenizer.json."""
    folder = copy_folder(subword["folder"], tmp_path_factory.mktemp("swap") / "model")
    words = json.loads((folder / "vocabulary.json").read_text())
    i, j = first % len(words), second % len(words)
    swapped = list(words)
    swapped[i], swapped[j] = words[j], words[i]
    (folder / "vocabulary.json").write_text(json.dumps(swapped))
    if swapped == words:
        checkpoint.load(folder)
    else:
        for read in (checkpoint.load, pf.load, pf.from_pretrained):
            with pytest.raises(ValueError, match=f"{folder / 'tokenizer.json'} is not the tokenizer of"):
                read(folder)


def test_a_tokenizer_from_another_run_or_none_is_refused_naming_the_file(subword, tmp_path):
    mixed = copy_folder(subword["folder"], tmp_path / "mixed")
    (mixed / "tokenizer.json").write_bytes(subword["other"].read_bytes())  # same size, other pieces
    with pytest.raises(ValueError, match=f"{mixed / 'tokenizer.json'} is not the tokenizer of"):
        checkpoint.load(mixed)
    lost = copy_folder(subword["folder"], tmp_path / "lost")
    (lost / "tokenizer.json").unlink()  # read as words, it encoded every text into other ids
    with pytest.raises(ValueError, match=f"{lost / 'vocabulary.json'} holds WordPiece continuation pieces"):
        checkpoint.load(lost)
    (lost / "vocabulary.json").unlink()
    (lost / "tokenizer.json").write_bytes(subword["other"].read_bytes())
    checkpoint.load(lost)  # a tokenizer alone has as many pieces as the model has ids
    (lost / "tokenizer.json").write_text(json.dumps({"model": "not a tokenizer"}))
    with pytest.raises(ValueError, match=f"{lost / 'tokenizer.json'} is not a tokenizers JSON file"):
        checkpoint.load(lost)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.text(alphabet="#ab", min_size=1, max_size=4), min_size=1, max_size=9, unique=True))
def test_a_word_vocabulary_without_a_tokenizer_reads_unless_it_holds_wordpiece_pieces(tmp_path_factory, words):
    """Oracle: refused exactly when a word is a continuation piece of one character ('##a'),
    which WordPiece keeps for every character and a word vocabulary holds only from its text."""
    words = [w for w in words if w not in ("<pad>", "<unk>", "<mask>")]
    vocabulary = data.Vocabulary(["<pad>", "<unk>", "<mask>", *words])
    config = {"vocab_size": len(vocabulary), "width": 8, "heads": 2, "layers": 1, "ffn_width": 8}
    folder = checkpoint.save(registry.build("transformer", config), tmp_path_factory.mktemp("words"), vocabulary)
    if any(len(w) == 3 and w.startswith("##") for w in words):
        with pytest.raises(ValueError, match="holds WordPiece continuation pieces"):
            checkpoint.load(folder)
    else:
        assert checkpoint.load(folder)[1].words == vocabulary.words


# ---- a failed save leaves the parent as it was -------------------------------------------------


def snapshot(root: Path) -> dict:
    """Every folder and every file's bytes under ``root``."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def failing_writes(monkeypatch, fail_at: int):
    """Make the ``fail_at``-th file write (safetensors or text, counted from 0) fail as a
    full disk does: a few bytes written, then ENOSPC."""
    import safetensors.torch

    calls = {"n": 0}

    def check(path):
        calls["n"] += 1
        if calls["n"] - 1 == fail_at:
            with open(path, "wb") as handle:
                handle.write(b"\0" * 7)
            raise OSError(errno.ENOSPC, "No space left on device")

    real_save, real_write = safetensors.torch.save_file, Path.write_text

    def save_file(tensors, path, metadata=None):
        check(path)
        return real_save(tensors, path, metadata=metadata)

    def write_text(self, *args, **kwargs):
        check(self)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    monkeypatch.setattr(run_checkpoints, "save_file", save_file)
    monkeypatch.setattr(Path, "write_text", write_text)
    return calls


def small_model_and_vocabulary():
    vocabulary = data.Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(9)])
    torch.manual_seed(0)
    config = {"vocab_size": 12, "width": 8, "heads": 2, "layers": 1, "ffn_width": 8}
    return registry.build("transformer", config), vocabulary


@pytest.mark.parametrize("fail_at", range(3))
def test_a_failed_checkpoint_save_leaves_the_parent_exactly_as_it_was(tmp_path, monkeypatch, fail_at):
    model, vocabulary = small_model_and_vocabulary()
    (tmp_path / "keep.txt").write_text("mine")
    existing = checkpoint.save(model, tmp_path / "existing", vocabulary)
    before = snapshot(tmp_path)
    torch.manual_seed(1)
    other, _ = small_model_and_vocabulary()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    calls = failing_writes(monkeypatch, fail_at)
    with pytest.raises(checkpoint.WriteError, match="No space left on device"):
        checkpoint.save(other, tmp_path / "new" / "deeper" / "ck", vocabulary)
    assert calls["n"] == fail_at + 1
    assert snapshot(tmp_path) == before  # no folder it created, no temporary file
    calls["n"] = 0
    with pytest.raises(checkpoint.WriteError, match="No space left on device"):
        checkpoint.save(other, existing, vocabulary)  # over an earlier checkpoint: all old files, or none
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fail_at", range(5))
def test_a_failed_training_checkpoint_leaves_the_run_folder_as_it_was(tmp_path, monkeypatch, fail_at):
    model, vocabulary = small_model_and_vocabulary()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    before = snapshot(tmp_path)
    calls = failing_writes(monkeypatch, fail_at)
    with pytest.raises(checkpoint.WriteError, match="No space left on device"):
        run_checkpoints.save_training_checkpoint(run, 1, model, optimizer, vocabulary, {"step": 1})
    assert calls["n"] == fail_at + 1
    assert snapshot(tmp_path) == before  # not even checkpoints/, which the first save creates


@pytest.mark.parametrize("fail_at", range(2))
def test_a_failed_save_pretrained_removes_the_folders_it_created(tmp_path, monkeypatch, fail_at):
    model, _ = small_model_and_vocabulary()
    before = snapshot(tmp_path)
    failing_writes(monkeypatch, fail_at)
    with pytest.raises(OSError, match="No space left on device"):
        pretrained.save_pretrained(model, tmp_path / "a" / "b")
    assert snapshot(tmp_path) == before


# ---- an import failure is reported as one -------------------------------------------------------


def test_an_import_failure_while_building_is_an_import_error_naming_the_module(tmp_path, monkeypatch, capsys):
    model, vocabulary = small_model_and_vocabulary()
    folder = checkpoint.save(model, tmp_path / "ck", vocabulary)

    def build(kind, config, section="config"):
        raise ModuleNotFoundError("No module named 'networkx'", name="networkx")

    monkeypatch.setattr(registry, "build", build)
    for read in (pf.load, pf.from_pretrained, checkpoint.load):
        with pytest.raises(ImportError, match="needs the module 'networkx'") as error:
            read(folder)
        assert "bad model config" not in str(error.value) and error.value.name == "networkx"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "ck", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "needs the module 'networkx'" in err and len(err.splitlines()) == 1


def test_an_import_failure_while_reading_a_pt2_names_the_module(tmp_path, monkeypatch):
    model, _ = small_model_and_vocabulary()
    path = pf.export(model, tmp_path / "model.pt2", format="exported")

    def load(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'networkx'", name="networkx")

    monkeypatch.setattr(torch.export, "load", load)
    with pytest.raises(ImportError, match="needs the module 'networkx'") as error:
        pf.load(path)
    assert error.value.name == "networkx"


@pytest.mark.parametrize("pointer", ["/abs/elsewhere", "../../elsewhere", "step-1/../../elsewhere", "model", "link"])
def test_a_run_folder_never_leads_a_reader_out_of_itself(tmp_path, pointer):
    """checkpoints/latest was joined to its folder unchecked, and model/ could be a symlink:
    every reader (load, from_pretrained, evaluate's loader) read a model from anywhere."""
    elsewhere = tmp_path / "elsewhere"
    pf.Transformer(pf.TransformerConfig(vocab_size=10, width=8, heads=2, layers=1, ffn_width=16)).save_pretrained(
        elsewhere
    )
    run = tmp_path / "run" / "a"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    if pointer == "model":
        (run / "model").symlink_to(elsewhere, target_is_directory=True)
        expected = "model is a symlink"
    elif pointer == "link":
        (run / "checkpoints" / "step-1").symlink_to(elsewhere, target_is_directory=True)
        (run / "checkpoints" / "latest").write_text("step-1")
        expected = "step-1 is a symlink"
    else:
        (run / "checkpoints" / "latest").write_text(pointer.replace("/abs", str(tmp_path)))
        expected = "must name a checkpoint folder step-N"
    for read in (pf.load, pf.from_pretrained, pretrained.model_folder):
        with pytest.raises(ValueError, match=expected):
            read(run)


def test_a_run_whose_checkpoints_folder_is_a_link_is_never_pruned(tmp_path):
    """Saving prunes every other entry of checkpoints/: through a link it would delete files
    elsewhere."""
    from probformer.training.run_checkpoints import save_training_checkpoint

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    model = pf.Transformer(pf.TransformerConfig(vocab_size=10, width=8, heads=2, layers=1, ffn_width=16))
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="checkpoints is a symlink"):
        save_training_checkpoint(run, 1, model, optimizer, None, {})
    assert (elsewhere / "keep.txt").read_text() == "mine"
