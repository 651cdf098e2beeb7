"""The restricted pickle world: reading ``.pt`` files without running code, walking their trees, writing them back.

Modules, lowest first: ``standins`` (inert stand-ins for the classes a pickle names), ``limits`` (how much work a
pickle may ask for), ``archive`` (the torch zip archive, :class:`RankFile` and lazy :class:`TensorRef`), ``allowed``
(the globals a pickle may name, sealed against change), ``read`` (the restricted unpickler, :func:`load_pickle`),
``replica`` (rank files repeating another's pickle, read without unpickling it), ``plain`` (one walk from a parsed
tree to plain objects), ``archive_layout`` (a rank file's archive around its data, written for the later files
of its kind), ``write`` (DeepSpeed-class records and rank files written chunk by chunk), ``pickle_template`` (rank
files of one shape pickled once).
"""

from __future__ import annotations

from .allowed import short_repr
from .archive import RankFile, TensorRef, read_archive
from .dcp_metadata_unpickler import load_dcp_metadata
from .embedded import EmbeddedTensor
from .limits import MAX_DEPTH, MAX_DIMS, MAX_NUMEL, MAX_PICKLE_BYTES, too_large
from .pickle_template import PickleTemplate
from .plain_tree import Index, StandinRule, TensorRule, Walk, Where, keep_standin, read_tensor, to_plain, where_text
from .read import load_embedded, load_pickle
from .replica import Replica, template_of
from .standins import (
    ZERO_STAGE_ENUM,
    Inert,
    InertDict,
    InertParts,
    ZeroStageEnum,
    global_name,
    inert_parts,
    is_inert,
)
from .write import Chunks, RankFileBuilder, ds_object, ds_value, writable

__all__ = [
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_NUMEL",
    "MAX_PICKLE_BYTES",
    "ZERO_STAGE_ENUM",
    "Chunks",
    "EmbeddedTensor",
    "Index",
    "Inert",
    "InertDict",
    "InertParts",
    "PickleTemplate",
    "RankFile",
    "RankFileBuilder",
    "Replica",
    "StandinRule",
    "TensorRef",
    "TensorRule",
    "Walk",
    "Where",
    "ZeroStageEnum",
    "ds_object",
    "ds_value",
    "global_name",
    "inert_parts",
    "is_inert",
    "keep_standin",
    "load_dcp_metadata",
    "load_embedded",
    "load_pickle",
    "read_archive",
    "read_tensor",
    "short_repr",
    "template_of",
    "to_plain",
    "too_large",
    "where_text",
    "writable",
]
