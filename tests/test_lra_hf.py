"""LRA loaders through `datasets` (flashtrain/data/lra_hf.py) on the fixtures in tests/fixtures/lra/: exact tokens,
LRA's grayscale, LRA's AAN file format (bytes literals), splits and the cache."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flashtrain.data.lra_hf import (LRAImageConfig, LRARetrievalConfig, LRATextConfig, aan_text, decode_bytes,
                                    encode_bytes, grayscale, prepare_lra_image, prepare_lra_retrieval,
                                    prepare_lra_text)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "lra"


def test_byte_tokens():
    ids = encode_bytes("Caf\u00e9!", max_length=100)
    assert ids.tolist() == [ord("C") + 1, ord("a") + 1, ord("f") + 1, 0xC3 + 1, 0xA9 + 1, ord("!") + 1]
    assert encode_bytes("Caf\u00e9!", max_length=4).tolist() == ids[:4].tolist()  # cut in bytes, as LRA
    assert decode_bytes(np.concatenate([ids, np.zeros(3, np.uint8)])) == "Caf\u00e9!"  # padding dropped
    assert encode_bytes(b"\xfe\xff", 10).tolist() == [255, 255]  # never in UTF-8; capped into the uint8 range
    assert aan_text("b'Title \\xc3\\xa9t\\xc3\\xa9'") == "Title \u00e9t\u00e9".encode()  # LRA's bytes literals
    assert aan_text("plain 'text'") == b"plain 'text'"


def test_grayscale_is_lras():
    rgb = np.array([[[255, 255, 255], [0, 0, 0], [255, 0, 0]], [[0, 255, 0], [0, 0, 255], [10, 200, 30]]],
                   dtype=np.uint8)  # (2, 3, 3)
    # tf.image.rgb_to_grayscale on uint8: floor((0.2989 R + 0.5870 G + 0.1140 B) / 255 * 255.5)
    # 0.9999 * 255.5 = 255.47; 0.2989 * 255.5 = 76.4; 0.587 * 255.5 = 149.98; 0.114 * 255.5 = 29.1;
    # (2.989 + 117.4 + 3.42) / 255 * 255.5 = 124.05
    expected = [[255, 0, 76], [149, 29, 124]]
    assert grayscale(rgb).tolist() == expected
    with pytest.raises(ValueError, match="rgb"):
        grayscale(rgb[..., :2])


def test_text_loader(tmp_path):
    cfg = LRATextConfig(source=str(FIXTURES / "text"), max_length=24, cache_dir=str(tmp_path), num_proc=1)
    splits = prepare_lra_text(cfg)
    assert splits.meta["sizes"] == {"train": 6, "val": 4, "test": 4}  # val is IMDB's test set, as LRA
    assert splits.meta["max_length"] == 24  # every review is longer than 24 bytes: all cut
    rows = [json.loads(line) for line in (FIXTURES / "text" / "train.jsonl").read_text().splitlines()]
    train = splits.dataset("train", 30)
    for (tokens, label), row in zip(train, rows):
        assert tokens.tolist() == encode_bytes(row["text"], 24).tolist() + [0] * 6 and int(label) == row["label"]
    assert decode_bytes(train[2][0]) == "Caf\u00e9 scenes were charmi"  # 24 bytes, 23 characters: the e-acute is two
    val, test = splits.dataset("val"), splits.dataset("test")
    assert all(val[i][0].tolist() == test[i][0].tolist() for i in range(4))
    # a second call reads the cache: same directory, nothing rebuilt
    assert prepare_lra_text(cfg).directory == splits.directory
    with pytest.raises(FileNotFoundError, match="lra_text.source"):
        prepare_lra_text(LRATextConfig(source=str(tmp_path / "nothing"), cache_dir=str(tmp_path)))


def test_retrieval_loader(tmp_path):
    splits = prepare_lra_retrieval(LRARetrievalConfig(source=str(FIXTURES / "retrieval"), cache_dir=str(tmp_path)))
    assert splits.meta["sizes"] == {"train": 4, "val": 2, "test": 2}
    longest = len("Neural machine translation \u00e9t\u00e9.".encode())  # 33 bytes: the longest document of all splits
    assert splits.meta["max_length"] == 2 * longest
    train = splits.dataset("train")
    tokens, label = train[2]
    first, second = tokens[:longest], tokens[longest:]
    assert decode_bytes(first) == "Neural machine translation \u00e9t\u00e9."  # a bytes literal, decoded
    assert decode_bytes(second) == "Translation models, summer."  # a plain field
    assert first[-1] != 0 and second[-1] == 0 and train[0][0][longest - 1] == 0  # each right-padded to L
    assert [int(label) for _, label in train] == [1, 0, 1, 0]  # "1.0" / "0.0" in the file
    assert decode_bytes(train[3][0][longest:]) == 'A "quoted" title'  # quotes are text (LRA: no quote parsing)


def test_image_loader(tmp_path):
    splits = prepare_lra_image(LRAImageConfig(source=str(FIXTURES / "image"), cache_dir=str(tmp_path)))
    assert splits.meta["sizes"] == {"train": 9, "val": 1, "test": 4}  # the last 10% of train validates
    assert splits.meta["max_length"] == 1024
    import datasets
    source = datasets.load_dataset("parquet", data_files=str(FIXTURES / "image" / "train.parquet"), split="train")
    pixels, label = splits.dataset("val")[0]
    image = source[9]["img"]
    assert isinstance(image, Image.Image) and int(label) == source[9]["label"]
    assert pixels.tolist() == grayscale(np.asarray(image.convert("RGB"))).reshape(-1).tolist()
    assert 0 < int(pixels.min()) and int(pixels.max()) <= 255  # gradients: no black pixel, values fill the range
