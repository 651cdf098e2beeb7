"""Publish a converted checkpoint, or convert one on the fly, to the Hugging Face Hub."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._every_rank import once_per_job, push_destination
from ._formats import ReadOptions, read_options
from ._hub_errors import as_hub_error
from ._io.remote_path import as_path, is_url
from ._messages import get_logger
from ._model_card import default_commit_message, render_model_card, written_card_facts
from ._write import write_output
from ._write.options import WriteOptions, write_options
from .errors import CheckpointNotFoundError

if TYPE_CHECKING:
    import torch

    from ._formats import DcpKeys, NamesMode, TPRules
    from ._io.progress import Progress
    from ._types import StrPath

__all__ = ["STALE_WEIGHT_PATTERNS", "PushResult", "create_hub_repo", "push_to_hub"]

logger = get_logger(__name__)

CONVERTED_MARKERS = ("model.safetensors", "model.safetensors.index.json")
"""A folder holding either file is taken as already converted and uploaded as is."""

STALE_WEIGHT_PATTERNS = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model-*-of-*.bin",
    "pytorch_model.bin.index.json",
    "optimizer.safetensors",
    "optimizer-*-of-*.safetensors",
    "optimizer.safetensors.index.json",
    "optimizer.json",
)
"""Weight files of any layout (``save_pretrained`` / zeroio names) that a push deletes from the repo unless it
uploads them again, so a snapshot never holds two layouts (e.g. a stale ``model.safetensors`` beside new shards)."""

_DEFAULT_BRANCH = "main"


@dataclass(frozen=True, slots=True)
class PushResult:
    """What :func:`push_to_hub` committed."""

    repo_id: str
    """The repository pushed to, ``namespace/name``."""
    revision: str
    """The ref the commit landed on: ``"main"``, a branch name, or ``"refs/pr/N"``."""
    commit_url: str
    """URL of the commit (of the current head when nothing changed since the last push)."""
    commit_oid: str
    """Commit hash of that commit."""
    pr_url: str | None
    """URL of the pull request opened with ``create_pr=True``, else None."""
    files: tuple[str, ...]
    """Paths in the repo that the push contained, sorted (files unchanged since the last push included)."""


@once_per_job("push_to_hub", push_destination, PushResult, ("src", "repo_id", "dtype", "max_shard_size", "tag"))
def push_to_hub(
    src: StrPath,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    endpoint: str | None = None,
    model_card: bool = True,
    progress: Progress = True,
    verify_crc: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    tp_rules: TPRules | None = None,
    names: NamesMode | None = None,
    true_vocab_size: int | None = None,
    dcp_keys: DcpKeys = "auto",
) -> PushResult:
    """Push a checkpoint to the Hugging Face Hub as safetensors, converting it first when needed.

    ``src`` is either a folder :func:`zeroio.convert` already wrote (it holds ``model.safetensors`` or
    ``model.safetensors.index.json``), uploaded as is, or anything :func:`zeroio.convert` reads (a DeepSpeed
    checkpoint root or tag folder, a consolidated file), converted into a temporary folder first. The repo is
    created if needed, and everything lands in one commit (huggingface_hub's Xet uploader may split very large
    folders into several). Pushing the same content again creates no commit.

    Alongside the weights it uploads ``config.json``, ``generation_config.json`` and tokenizer files found next
    to the checkpoint (the HF Trainer keeps them in ``checkpoint-N/`` beside ``global_stepN/``), and, unless the
    folder already has one, a ``README.md`` model card tagged ``deepspeed`` and ``zeroio`` that records the
    source checkpoint (DeepSpeed version, ZeRO stage, world size, step, dtypes).

    Authentication is huggingface_hub's: ``token``, else ``HF_TOKEN``, else the token saved by
    ``hf auth login``. The endpoint is ``endpoint``, else ``HF_ENDPOINT`` (read when huggingface_hub is
    imported), else https://huggingface.co. The token is never logged nor put in error messages.

    Args:
        src: a converted folder, or a checkpoint to convert.
        repo_id: ``"namespace/name"``; created if missing.
        token: a Hugging Face token with write access (default: ``HF_TOKEN`` or the saved login).
        private: visibility of a *new* repo (None: the namespace default); an existing repo keeps its own.
        revision: branch to commit to, created from ``main`` if it does not exist; or ``"refs/pr/N"`` to add a
            commit to an open pull request. Default: ``main``.
        create_pr: open a pull request against ``main`` instead of committing to it.
        commit_message: the commit title (default: says what was pushed and that zeroio converted it).
        dtype: cast floating tensors while converting (``"bf16"``, ``"fp16"``, ``"fp32"``). Given with an
            already-converted folder, that folder is converted again with this dtype.
        max_shard_size: largest safetensors shard when converting, ``"5GB"`` (decimal units) or bytes.
        tag: the DeepSpeed tag to convert (default: the one in ``latest``).
        endpoint: the Hub URL (default: ``HF_ENDPOINT`` or https://huggingface.co).
        model_card: write a ``README.md`` model card when the upload has none.
        progress: ``True`` shows conversion (tqdm, bytes) and upload progress on a terminal, ``False`` is silent,
            or pass ``callable(done, total)`` to receive conversion progress in bytes (uploads then stay silent).
        verify_crc: check every record read from a torch zip file (``.pt``/``.bin``) against its stored CRC-32 and
            raise CheckpointFormatError on a mismatch (see ``Checkpoint.verify_crc``); False skips the check.
        storage_options: options of the fsspec filesystem of a URL ``src`` (``s3://``, ``gs://``, ``hf://``; keys,
            endpoint, token; docs/remote.md); a URL source is converted locally, then pushed.
        tp_rules: how a tensor-parallel source's tensors are split where its files do not record it, as for
            :func:`zeroio.open` (``{regex: dim or "replicated"}``, ``"megatron"`` or ``"neox"``).
        names: ``"hf"`` converts a Megatron GPT of the Llama family under transformers' names, with its
            ``config.json``, as :func:`zeroio.convert` does (docs/formats.md).
        true_vocab_size: with ``names="hf"``, the embedding and output rows to write (the tokenizer's vocabulary;
            the rest is Megatron's padding), as for :func:`zeroio.convert`.
        dcp_keys: which tensors of a DCP source are the model's (``"auto"``, ``"model"``, ``"all"``), as for
            :func:`zeroio.convert`.

    Returns:
        A :class:`PushResult`: repo, ref, commit URL and hash, pull request URL, and the files pushed.

    Raises:
        HubError: the Hub refused or could not be reached (bad or missing token, no write access, unknown
            repo or pull request, network failure); the huggingface_hub error is ``__cause__``.
        ValueError: ``create_pr=True`` together with a ``revision``, or an invalid conversion argument.
        CheckpointNotFoundError, CheckpointFormatError: ``src`` cannot be read (raised before any upload).

    Example:
        >>> import zeroio
        >>> result = zeroio.push_to_hub("out/model", "me/my-model", private=True)  # doctest: +SKIP
        >>> result.commit_url  # doctest: +SKIP
        'https://huggingface.co/me/my-model/commit/...'
    """
    # 1. Arguments, before any IO or network.
    if create_pr and revision not in (None, _DEFAULT_BRANCH):
        raise ValueError(
            f"create_pr=True opens a pull request against '{_DEFAULT_BRANCH}', so it cannot be combined with "
            f"revision={revision!r}. Drop revision to open a pull request, or pass revision='refs/pr/N' without "
            "create_pr to add a commit to an open pull request."
        )
    write = write_options(dtype=dtype, max_shard_size=max_shard_size, progress=progress)
    read = read_options(
        tag=tag, verify_crc=verify_crc, tp_rules=tp_rules, names=names, true_vocab_size=true_vocab_size,
        dcp_keys=dcp_keys,
    )  # fmt: skip
    src_path = as_path(src, storage_options)  # a URL's one listing serves the check and the conversion
    converted = _is_converted(src_path) and dtype is None and not is_url(str(src_path))  # a URL: converted here
    _check_source(src_path, dataclasses.replace(read, tag=None) if converted else read)
    try:
        from huggingface_hub import HfApi
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("push_to_hub needs huggingface_hub: pip install 'huggingface_hub>=0.24'") from e

    api = HfApi(endpoint=endpoint, token=token)
    hub_error = functools.partial(
        as_hub_error,
        repo_id=repo_id,
        endpoint=api.endpoint,
        src=src_path,
        revision=revision,
        token_given=token is not None,
    )
    with ExitStack() as stack:
        if progress is not True:
            stack.enter_context(_hub_progress_bars_disabled())

        # 2. Repo and branch first, so a bad token or an unreachable Hub fails before a long conversion.
        with hub_error():
            _ensure_repo(api, repo_id, private, revision)

        # 3-4. The folder to upload (the converted folder itself, or a fresh conversion), staged with the card.
        staging, card_facts = _stage(stack, src_path, repo_id, converted, read, write, model_card=model_card)
        files = tuple(_listing(staging))

        # 5. One upload call: huggingface_hub skips files whose content the Hub already has, and deletes the weight
        #    files of another layout in the same commit (files uploaded again are never deleted).
        logger.debug(
            "pushing %d files from %s to %s at %s (revision=%s, create_pr=%s)",
            len(files),
            src_path,
            repo_id,
            api.endpoint,
            revision,
            create_pr,
        )
        with hub_error():
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=staging,
                commit_message=commit_message or default_commit_message(card_facts, converted=converted),
                revision=revision,
                create_pr=create_pr,
                delete_patterns=list(STALE_WEIGHT_PATTERNS),
            )

    pushed_to = (info.pr_revision if info.pr_url else revision) or _DEFAULT_BRANCH
    logger.debug("pushed %s to %s@%s: %s", src_path, repo_id, pushed_to, info.oid)
    return PushResult(
        repo_id=repo_id,
        revision=pushed_to,
        commit_url=info.commit_url,
        commit_oid=info.oid,
        pr_url=info.pr_url,
        files=files,
    )


def _stage(
    stack: ExitStack,
    src_path: Path,
    repo_id: str,
    converted: bool,
    read: ReadOptions,
    write: WriteOptions,
    *,
    model_card: bool,
) -> tuple[Path, dict[str, Any]]:
    """Steps 3-4 of :func:`push_to_hub`: the staging folder to upload (links to the weights, plus the model card)
    and the card's facts; temporary folders live as long as ``stack``."""
    # 3. The folder to upload: the converted folder itself, or a fresh conversion in a temporary folder.
    card_facts: dict[str, Any] = {}
    if converted:
        weights_dir = src_path
    else:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zeroio-push-")))
        weights_dir = tmp / "model"
        card_facts = written_card_facts(write_output(src_path, weights_dir, read, write).card)

    # 4. Stage weights + card without touching the user's folder (symlinks, not copies). Config and tokenizer
    #    files are in weights_dir: convert copies them from beside the checkpoint (_side_files.py).
    staging = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zeroio-stage-")))
    _link_tree(weights_dir, staging)
    if model_card and not (staging / "README.md").exists():
        (staging / "README.md").write_text(
            render_model_card(repo_id, card_facts, files=_listing(staging)), encoding="utf-8"
        )
    return staging, card_facts


def create_hub_repo(
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
) -> None:
    """Create ``repo_id`` (and the branch ``revision``) on the Hub if missing, as :func:`push_to_hub` does first.

    Call it before a long conversion that you push afterwards (``zeroio convert --push-to-hub`` does): a bad token,
    a missing write permission or an unreachable Hub then fails in seconds instead of after the conversion.

    Raises:
        HubError: as :func:`push_to_hub` raises it.

    Example:
        >>> import zeroio
        >>> zeroio.create_hub_repo("me/my-model", private=True)  # doctest: +SKIP
        >>> zeroio.convert("checkpoints/run1", "out/my-model")  # doctest: +SKIP
        >>> zeroio.push_to_hub("out/my-model", "me/my-model")  # doctest: +SKIP
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    with as_hub_error(
        repo_id=repo_id, endpoint=api.endpoint, src=None, revision=revision, token_given=token is not None
    ):
        _ensure_repo(api, repo_id, private, revision)


def _ensure_repo(api: Any, repo_id: str, private: bool | None, revision: str | None) -> None:
    api.create_repo(repo_id, private=private, exist_ok=True)
    if (
        revision is not None
        and revision != _DEFAULT_BRANCH
        and not revision.startswith("refs/")  # refs/pr/N must exist already: it is not a branch
        and not api.revision_exists(repo_id, revision)
    ):
        api.create_branch(repo_id, branch=revision, exist_ok=True)


# --------------------------------------------------------------------------- the upload folder


def _is_converted(src: Path) -> bool:
    return src.is_dir() and any((src / name).is_file() for name in CONVERTED_MARKERS)


def _link(src: Path, dst: Path) -> None:
    try:
        os.symlink(src.resolve(), dst)
    except OSError:  # e.g. Windows without the symlink privilege
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    """Mirror ``src``'s files into ``dst`` as links, leaving out any link that resolves outside ``src``."""
    root = src.resolve()
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in (".git", ".cache") or path.name.endswith(".partial") or not path.is_file():
            continue
        if not path.resolve().is_relative_to(root):
            # A link to e.g. a token file or /etc/shadow must never be uploaded in its place.
            logger.warning(
                "not uploading '%s': it is a link to a file outside '%s'; copy the file into the folder to push it",
                path,
                src,
            )
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        _link(path, dst / rel)


def _check_source(src: Path, read: ReadOptions) -> None:
    """Everything push can check locally, before it creates a repo: a readable source (arguments are checked)."""
    from ._formats import open_checkpoint

    if not src.exists():
        raise CheckpointNotFoundError(
            f"Nothing to push: '{src}' does not exist. Pass a folder written by zeroio.convert or a DeepSpeed "
            "checkpoint folder.",
            path=src,
        )
    with open_checkpoint(src, read):  # metadata only: headers, rank-file layout
        pass


def _listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@contextmanager
def _hub_progress_bars_disabled() -> Iterator[None]:
    """Silence huggingface_hub's own progress bars for the push, then restore the previous state."""
    from huggingface_hub.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()
