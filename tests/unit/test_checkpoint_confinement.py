"""The checkpoint reader opens only regular files inside the checkpoint's directory, and a refusal reveals nothing
about what it refused: symbolic links (even to a file inside), absolute or ``..`` names in ``latest`` or meta.json.
Its other errors about a checkpoint name the complete ones to fall back to."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from trainkit import checkpoint as ckpt
from trainkit.resume import resolve
from trainkit_strategies import Environment, get_strategy
from trainkit_strategies.state.pieces import Piece

RANK_FILE = "rank00000.safetensors"


def _save(dirpath: Path, name: str, value: float) -> Path:
    strategy = get_strategy("single")
    strategy.setup_environment(Environment())
    data = torch.full((4,), value)
    return ckpt.save(dirpath, name, strategy, {"value": value}, [Piece("model/w", (4,), torch.float32, 0, 4, data)],
                     {})


def _edit_meta(path: Path, edit) -> None:
    """Change meta.json as someone who can write the directory would, digest recomputed (it shows corruption, not
    intent)."""
    meta = json.loads((path / ckpt.META).read_text())
    edit(meta)
    meta["meta_sha256"] = ckpt._meta_digest(meta)
    (path / ckpt.META).write_text(json.dumps(meta))


@pytest.fixture
def two(tmp_path) -> Path:
    """``checkpoints/`` with a-1.0 (older) and b-2.0 (latest)."""
    root = tmp_path / "checkpoints"
    _save(root, "a", 1.0)
    _save(root, "b", 2.0)
    return root


def test_a_rank_file_that_is_a_symbolic_link_is_refused_even_to_a_file_inside(two):
    rank = two / "b" / RANK_FILE
    rank.rename(two / "b" / "moved.safetensors")
    rank.symlink_to("moved.safetensors")  # the same bytes: size and sha256 match
    with pytest.raises(ckpt.CheckpointError, match="is not a regular file") as err:
        ckpt.CheckpointReader(two / "b").full("model/w")
    assert str(rank) in str(err.value) and "resume from another one (a)" in str(err.value)


def test_a_refused_link_says_nothing_about_its_target(two, tmp_path):
    """The size check used to come first: its error told the size of any file a link pointed at."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 1234)
    rank = two / "b" / RANK_FILE
    said = []
    for target in (secret, tmp_path / "absent"):
        rank.unlink()
        rank.symlink_to(target)
        with pytest.raises(ckpt.CheckpointError) as err:
            ckpt.CheckpointReader(two / "b").full("model/w")
        said.append(str(err.value))
    assert said[0] == said[1], said  # existence is not told apart
    assert "1234" not in said[0] and "secret" not in said[0] and "missing" not in said[0]


@pytest.mark.parametrize("pointer", ["absolute", "dotdot", "separator", "symlinked-dir"])
def test_latest_names_only_a_checkpoint_directory_inside(two, tmp_path, pointer):
    """A pointer edited to lead out of the directory is refused; ``--ckpt_path last`` does not follow it either."""
    outside = _save(tmp_path / "elsewhere", "c", 3.0)
    written = {"absolute": str(outside), "dotdot": "../elsewhere/c", "separator": "b/../b",
               "symlinked-dir": "linked"}[pointer]
    (two / "linked").symlink_to(outside)
    (two / ckpt.LATEST).write_text(written)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.latest(two)
    assert repr(written) in str(err.value)
    assert str(two / "a") in str(err.value) and str(two / "b") in str(err.value)  # what to pass instead
    with pytest.raises(ckpt.CheckpointError):
        resolve(two, "last")


@pytest.mark.parametrize(("content", "says"), [
    (b"\xff\xfeb", "is not UTF-8 text"), (b"", "is empty"), (b"a\nb", "holds 'a\\nb', which is not the name"),
])
def test_a_latest_pointer_that_is_not_one_name_is_one_error_listing_the_fallbacks(two, content, says):
    (two / ckpt.LATEST).write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"latest {says}")) as err:
        ckpt.latest(two)
    assert str(two / "a") in str(err.value) and str(two / "b") in str(err.value)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs/outside.safetensors", "sub/rank.safetensors"])
@pytest.mark.parametrize("where", ["files", "piece"])
def test_meta_json_names_only_plain_files_inside(two, tmp_path, name, where):
    """A file of the checkpoint named ``../x``, absolute or with a separator is refused before anything is opened."""
    target = Path(name) if name.startswith("/") else two / "b" / name
    if not name.startswith("/"):
        target.parent.mkdir(exist_ok=True)
        shutil.copy(two / "b" / RANK_FILE, target)  # what it leads to would verify: the name alone is refused

    def edit(meta):
        if where == "files":
            meta["files"] = {name: meta["files"].pop(RANK_FILE)}
        meta["tensors"]["model/w"]["pieces"][0]["file"] = name

    _edit_meta(two / "b", edit)
    with pytest.raises(ckpt.CheckpointError, match="is refused") as err:
        ckpt.CheckpointReader(two / "b").full("model/w")
    assert repr(name) in str(err.value) and "resume from another one (a)" in str(err.value)


@pytest.mark.parametrize("fault", ["not-json", "digest", "missing-files", "not-utf8", "symlink"])
def test_a_corrupt_or_edited_meta_json_names_the_checkpoints_to_fall_back_to(two, tmp_path, fault):
    meta = two / "b" / ckpt.META
    if fault == "not-json":
        meta.write_text(meta.read_text()[:-20])
    elif fault == "digest":
        meta.write_text(meta.read_text().replace('"value": 2.0', '"value": 5.0'))
    elif fault == "missing-files":
        _edit_meta(two / "b", lambda m: m.pop("files"))
    elif fault == "not-utf8":
        meta.write_bytes(b"\xff" + meta.read_bytes())
    else:
        (tmp_path / "copy.json").write_bytes(meta.read_bytes())
        meta.unlink()
        meta.symlink_to(tmp_path / "copy.json")
    with pytest.raises(ckpt.CheckpointError, match="resume from another one \\(a\\)"):
        ckpt.CheckpointReader(two / "b")


def test_listing_skips_symbolic_links_and_a_user_given_link_still_reads(two, tmp_path):
    """Links inside the directory are not its checkpoints; a path the user names (a link included) is their choice."""
    (two / "linked").symlink_to(two / "a")
    assert [p.name for p in ckpt.listing(two)] == ["a", "b"]
    given = tmp_path / "mine"
    given.symlink_to(two / "a")
    assert float(ckpt.CheckpointReader(given).full("model/w")[0]) == 1.0
    assert ckpt.latest(two) == two / "b" and float(ckpt.CheckpointReader(two / "b").full("model/w")[0]) == 2.0
