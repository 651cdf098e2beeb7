"""Bad input raises a specific zeroio error whose one-line message names the file and the fix."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
from fixture_data import FIXTURES
from hostile_dcp import DCP_ATTACKS
from hostile_files import ATTACKS
from hostile_folders import FOLDER_ATTACKS
from hostile_zips import ZIP_ATTACKS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zeroio
from zeroio import errors


@pytest.fixture
def ckpt_copy(tmp_path):
    """A writable copy of a ZeRO-3 world-size-3 fixture."""

    def make(name: str = "z3_ws3_fp32"):
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst)
        return dst

    return make


def test_error_hierarchy():
    """Every zeroio error derives from ZeroIOError and the matching builtin, so generic handlers still work."""
    assert issubclass(errors.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(errors.CheckpointFormatError, ValueError)
    for cls in (
        errors.UnsupportedCheckpointError,
        errors.WorldSizeMismatchError,
        errors.PartitionMismatchError,
        errors.UnsafePickleError,
    ):
        assert issubclass(cls, errors.CheckpointFormatError)
    assert issubclass(errors.TensorNotFoundError, KeyError)
    assert issubclass(errors.OutputError, OSError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        if name != "ZeroIODeprecationWarning":
            assert issubclass(cls, errors.ZeroIOError)


def test_missing_path(tmp_path):
    """A path that does not exist raises CheckpointNotFoundError naming it."""
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(tmp_path / "nope")
    assert str(excinfo.value) == f"Checkpoint path '{tmp_path / 'nope'}' does not exist."
    assert excinfo.value.path == tmp_path / "nope"


def test_not_a_checkpoint_folder(tmp_path):
    """An empty folder is not a checkpoint; the message says what to pass instead."""
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(tmp_path)
    assert str(excinfo.value) == (
        f"'{tmp_path}' is not a DeepSpeed checkpoint: it has no '*_model_states.pt' files, no 'latest' file and no "
        "tag folders. Point zeroio at the folder passed to engine.save_checkpoint()."
    )


def test_a_folder_of_checkpoints_names_them(tmp_path):
    """A folder whose subfolders are checkpoints (torchtitan's step-N/ of consolidated safetensors, a run folder)
    names them, newest last, instead of saying only what it lacks; other folders are not named."""
    for step in (9, 10):
        zeroio.convert(FIXTURES / "z3_ws2_fp32", tmp_path / f"step-{step}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("")
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(tmp_path)
    assert str(excinfo.value) == (
        f"'{tmp_path}' is not a checkpoint itself but holds folders that look like checkpoints: step-9, step-10. "
        f"Pass one of them, e.g. '{tmp_path / 'step-10'}'."
    )
    assert excinfo.value.found == ["step-9", "step-10"]
    with zeroio.open(tmp_path / "step-10") as ckpt:  # the folder the message names opens
        assert "emb.weight" in ckpt


def test_not_a_torch_file(tmp_path):
    """A rank file that is not a zip archive raises CheckpointFormatError naming the file."""
    tag = tmp_path / "global_step1"
    tag.mkdir()
    bogus = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    bogus.write_text("hello")
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(tmp_path)
    assert str(excinfo.value) == (
        f"'{bogus}' is not a torch checkpoint (no zip signature; 5 bytes). Point zeroio at a DeepSpeed checkpoint "
        "folder or a file written by torch.save."
    )


def test_unknown_tag_lists_available(ckpt_copy):
    """An unknown tag lists the available tags and suggests the closest."""
    root = ckpt_copy("z3_ws2_fp32")
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root, tag="global_step3")
    assert str(excinfo.value) == (
        f"Tag 'global_step3' not found in '{root}' (available: global_step1, global_step2). "
        "Did you mean 'global_step2'?"
    )


def test_latest_names_a_missing_tag(ckpt_copy):
    """A `latest` file pointing at a deleted tag says so and lists what exists."""
    root = ckpt_copy("z3_ws2_fp32")
    (root / "latest").write_text("global_step9")
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{root / 'latest'}' names tag 'global_step9', but '{root / 'global_step9'}' does not exist. "
        "Pass tag= explicitly (available: global_step1, global_step2)."
    )


def test_no_latest_and_several_tags(ckpt_copy):
    """Without `latest` and with several tags, the user must choose; the message lists them."""
    root = ckpt_copy("z3_ws2_fp32")
    (root / "latest").unlink()
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"No 'latest' file in '{root}' and no tag was given. Pass tag='global_step2' "
        "(available: global_step1, global_step2)."
    )


def test_missing_middle_rank_file_is_named(ckpt_copy):
    """A missing rank file in the middle is named, with its rank."""
    root = ckpt_copy()
    (root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root)
    assert excinfo.value.rank == 1
    assert str(excinfo.value) == (
        f"Missing optimizer states file(s) for rank(s) 1 in '{root / 'global_step2'}': "
        "zero_pp_rank_1_mp_rank_00_optim_states.pt. A rank failed to save or the copy is incomplete; copy the whole "
        "tag folder again."
    )


def test_world_size_mismatch(ckpt_copy):
    """Fewer optimizer files than partition_count raises WorldSizeMismatchError with both numbers."""
    root = ckpt_copy("z2_ws3_fp16")
    (root / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(errors.WorldSizeMismatchError) as excinfo:
        zeroio.open(root)
    assert (excinfo.value.expected, excinfo.value.found) == (3, 2)
    assert str(excinfo.value) == (
        f"Expected 3 optimizer shards matching '*_optim_states.pt' in '{root / 'global_step2'}' (partition_count=3 "
        "in zero_pp_rank_0_mp_rank_00_optim_states.pt), found 2. A rank may have failed to save, or an older "
        "checkpoint was partly overwritten."
    )


def test_model_and_optim_file_counts_disagree(ckpt_copy):
    """ZeRO-3 writes one model and one optimizer file per rank; a lost optimizer file is reported."""
    root = ckpt_copy()
    (root / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(errors.WorldSizeMismatchError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{root / 'global_step2'}' holds 3 '*_model_states.pt' files but 2 '*_optim_states.pt' files; each rank "
        "writes one of each. Copy the whole tag folder again."
    )


def test_rank_file_from_another_world_size(ckpt_copy):
    """A rank file copied in from a run at another world size is caught by its partition_count."""
    root = ckpt_copy("z3_ws2_fp32")
    shutil.copy(
        FIXTURES / "z3_ws3_fp32" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    )
    with pytest.raises(errors.WorldSizeMismatchError) as excinfo:
        zeroio.open(root)
    assert (excinfo.value.rank, excinfo.value.expected, excinfo.value.found) == (1, 3, 2)


def test_truncated_rank_file(ckpt_copy):
    """A truncated rank file raises CheckpointFormatError naming it, not a zipfile or pickle error."""
    root = ckpt_copy()
    victim = root / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value).startswith(f"'{victim}' is truncated or corrupted (")
    assert excinfo.value.path == victim


def test_unsupported_model_parallel_layout(ckpt_copy):
    """A tensor-parallel folder whose mp_rank_01 lacks its optimizer files is refused, naming the short rank."""
    root = ckpt_copy("z2_ws2_fp32")
    tag = root / "global_step2"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{tag}' holds 2 optimizer file(s) for some model-parallel ranks but 0 for mp_rank_01: each tp rank saves "
        "one per data-parallel rank. Copy the whole tag folder again."
    )


def _flip_or_truncate(data: bytes, position: int, mode: str, value: int) -> bytes:
    position %= len(data)
    if mode == "truncate":
        return data[:position]
    return data[:position] + bytes([data[position] ^ (value or 1)]) + data[position + 1 :]


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    file_index=st.integers(0, 5),
    position=st.integers(0, 10**6),
    mode=st.sampled_from(["flip", "truncate"]),
    value=st.integers(0, 255),
)
def test_damaged_files_only_raise_zeroio_errors(tmp_path_factory, file_index, position, mode, value):
    """Flipping or truncating bytes anywhere in any rank file yields a result or a ZeroIOError, never another error."""
    root = tmp_path_factory.mktemp("fuzz") / "ckpt"
    shutil.copytree(FIXTURES / "z3_ws3_fp32", root)
    files = sorted((root / "global_step2").iterdir())
    victim = files[file_index % len(files)]
    victim.write_bytes(_flip_or_truncate(victim.read_bytes(), position, mode, value))
    try:
        with zeroio.open(root) as ckpt:
            ckpt.state_dict()
    except errors.ZeroIOError as exc:
        assert "\n" not in str(exc) and str(exc).endswith(".")


CORPUS = {**ATTACKS, **{f"zip_{name}": functools.partial(build, 0) for name, build in ZIP_ATTACKS.items()}}
"""Every crafted file: tests/hostile_files.py's pickles and tests/hostile_zips.py's zip structures (read entry by
entry)."""


@functools.cache
def _attack_bytes(name: str) -> bytes:
    return CORPUS[name]()


@settings(max_examples=80, deadline=10000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    attack=st.sampled_from(sorted(CORPUS)),
    position=st.integers(0, 10**6),
    mode=st.sampled_from(["as crafted", "flip", "truncate"]),
    value=st.integers(0, 255),
)
def test_damaged_attack_files_only_raise_zeroio_errors(tmp_path_factory, attack, position, mode, value):
    """The crafted attack files (tests/hostile_files.py), whole or damaged, yield a result or a ZeroIOError."""
    data = _attack_bytes(attack)
    path = tmp_path_factory.mktemp("attack") / "attack.pt"
    path.write_bytes(data if mode == "as crafted" else _flip_or_truncate(data, position, mode, value))
    try:
        with zeroio.open(path) as ckpt:
            ckpt.describe()
            ckpt.state_dict()
    except errors.ZeroIOError as exc:
        assert "\n" not in str(exc) and str(exc).endswith(".")


@pytest.fixture(scope="module")
def hostile_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    """Each folder attack of tests/hostile_folders.py and tests/hostile_dcp.py, built once: ``{name: (where, root,
    edited)}``."""
    built = {}
    for name, build in {**FOLDER_ATTACKS, **DCP_ATTACKS}.items():
        where = tmp_path_factory.mktemp(name)
        built[name] = (where, *build(where))
    return built


@settings(max_examples=30, deadline=20000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    attack=st.sampled_from(sorted({**FOLDER_ATTACKS, **DCP_ATTACKS})),
    position=st.integers(0, 10**6),
    mode=st.sampled_from(["as crafted", "flip", "truncate"]),
    value=st.integers(0, 255),
)
def test_damaged_attack_folders_only_raise_zeroio_errors(
    tmp_path_factory, hostile_folders, attack, position, mode, value
):
    """The hostile folders (tests/hostile_folders.py), as built or with their edited file damaged, yield a result
    or a one-line ZeroIOError."""
    where, root, edited = hostile_folders[attack]
    copy = tmp_path_factory.mktemp("folder") / "w"
    shutil.copytree(where, copy, symlinks=True)
    if mode != "as crafted":
        target = copy / edited.relative_to(where)
        target.write_bytes(_flip_or_truncate(target.read_bytes(), position, mode, value))
    try:
        with zeroio.open(
            copy / root.relative_to(where), tp_rules="megatron" if attack == "tp_huge_name" else None
        ) as ckpt:
            ckpt.describe()
            ckpt.state_dict()
    except errors.ZeroIOError as exc:
        assert "\n" not in str(exc) and str(exc).endswith(".")
